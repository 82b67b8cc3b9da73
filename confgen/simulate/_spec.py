"""What a simulated fleet looks like: worker and fleet specs, and their YAML/dict form."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args

from ..errors import SpecError as SpecError  # re-exported: the simulator's modules import it from here
from ..model import health_floor_s

EngineKind = Literal["vllm", "vllm_v0", "sglang", "tgi", "llamacpp", "openai"]
ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)

FaultMode = Literal[
    "none",
    "crash",
    "hang",
    "slow_health",
    "error_burst",
    "stall",
    "garbage_metrics",
    "html_metrics",
    "truncated_metrics",
    "slow_start",
    "queue_full",
    "slow",
]
FAULT_MODES: tuple[str, ...] = get_args(FaultMode)

# "default" = what the engine kind prints today; "both_names" = vLLM 0.9.2-0.10 (old and new
# cache names side by side); "underscore_prefix" = newer SGLang builds (`sglang_` not `sglang:`).
MetricsVariant = Literal["default", "both_names", "underscore_prefix"]
METRICS_VARIANTS: tuple[str, ...] = get_args(MetricsVariant)


@dataclass(frozen=True)
class FaultSpec:
    """A fault mode plus its parameters, e.g. FaultSpec("error_burst", {"count": 5})."""

    mode: FaultMode
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise SpecError(f"unknown fault mode {self.mode!r}; expected one of {FAULT_MODES}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> FaultSpec:
        """Build from the admin JSON form: {"mode": ..., **params}."""
        if not isinstance(data, Mapping) or not isinstance(data.get("mode"), str):
            raise SpecError('a fault needs a string "mode"')
        params = {k: v for k, v in data.items() if k != "mode"}
        mode = data["mode"]
        if mode not in FAULT_MODES:
            raise SpecError(f"unknown fault mode {mode!r}; expected one of {FAULT_MODES}")
        return cls(mode, params)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, **dict(self.params)}


@dataclass(frozen=True)
class ScheduledFault:
    """Switch to `fault` `at_s` seconds after the worker started."""

    at_s: float
    fault: FaultSpec


@dataclass(frozen=True)
class WorkerSpec:
    """One simulated engine server (one port).

    Latency model (all times are divided by `speed`, so 0.5 is a GPU half as fast):
    a step of the continuous batch takes `decode_ms * (1 + decode_growth * (batch - 1))`
    plus `prefill_ms_per_1k * uncached_prompt_tokens / 1000` for the requests it admits.
    """

    engine: EngineKind = "vllm"
    models: tuple[str, ...] = ("sim-model",)
    name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    max_num_seqs: int = 16
    speed: float = 1.0
    prefill_ms_per_1k: float = 60.0
    decode_ms: float = 20.0
    decode_growth: float = 0.03
    prefix_cache_size: int = 256
    prefix_key_chars: int = 256
    # "key": an LRU of `prefix_cache_size` keys (x-session-id, else the prompt's first
    # `prefix_key_chars` characters), each holding its longest prompt + answer. "blocks": like
    # vLLM's automatic prefix caching, an LRU of kv_cache_tokens / 16 prompt blocks keyed by
    # chained hashes of the prompt text (headers ignored: a hit is the shared leading blocks).
    prefix_cache_mode: str = "key"
    kv_cache_tokens: int = 65536
    data_parallel: int = 1
    default_max_tokens: int = 64
    # Waiting-queue capacity per worker; None = unbounded (vLLM), except TGI which rejects
    # above its max concurrent requests (128 in-flight by default).
    max_queue: int | None = None
    overload_status: int | None = None  # None: 429 for TGI, 503 for the others
    initial_fault: FaultSpec | None = None
    fault_schedule: tuple[ScheduledFault, ...] = ()
    metrics_variant: MetricsVariant = "default"
    # SGLang's health handler looks for its one-token generation's answer once a second (confgen.model's
    # HEALTH_POLL_S): its /health answers after this long at the earliest, as the real one does
    sglang_health_poll_s: float = health_floor_s("sglang", "/health")

    def __post_init__(self) -> None:
        # Python callers may pass a list; keep the spec hashable and immutable.
        object.__setattr__(self, "models", tuple(self.models))
        if self.engine not in ENGINE_KINDS:
            raise SpecError(f"unknown engine {self.engine!r}; expected one of {ENGINE_KINDS}")
        if not self.models or not all(isinstance(m, str) for m in self.models):
            raise SpecError("models must be a non-empty list of model names")
        if self.max_num_seqs < 1 or self.data_parallel < 1:
            raise SpecError("max_num_seqs and data_parallel must be >= 1")
        if self.speed <= 0:
            raise SpecError("speed must be > 0")
        if min(self.prefill_ms_per_1k, self.decode_ms, self.decode_growth) < 0:
            raise SpecError("latency parameters must be >= 0")
        if self.decode_ms == 0 and self.prefill_ms_per_1k == 0:
            raise SpecError("decode_ms and prefill_ms_per_1k cannot both be 0")
        if not 0 <= self.port <= 65535:
            raise SpecError(f"port {self.port} out of range")
        if self.prefix_cache_mode not in ("key", "blocks"):
            raise SpecError(f"prefix_cache_mode must be 'key' or 'blocks', not {self.prefix_cache_mode!r}")
        if self.prefix_cache_size < 0 or self.kv_cache_tokens < 1:
            raise SpecError("prefix_cache_size must be >= 0 and kv_cache_tokens >= 1")
        if self.max_queue is not None and self.max_queue < 0:
            raise SpecError("max_queue must be >= 0")
        if self.metrics_variant not in METRICS_VARIANTS:
            raise SpecError(f"unknown metrics_variant {self.metrics_variant!r}")

    def effective_max_queue(self) -> int | None:
        if self.max_queue is not None:
            return self.max_queue
        if self.engine == "tgi":
            return max(0, 128 - self.max_num_seqs * self.data_parallel)
        return None

    def effective_overload_status(self) -> int:
        if self.overload_status is not None:
            return self.overload_status
        return 429 if self.engine == "tgi" else 503


@dataclass(frozen=True)
class FleetSpec:
    """A set of workers served from one event loop, plus the control channel's port."""

    workers: tuple[WorkerSpec, ...]
    seed: int = 0
    control_host: str = "127.0.0.1"
    control_port: int = 0

    def __post_init__(self) -> None:
        if not self.workers:
            raise SpecError("a fleet needs at least one worker")
        names = [w.name for w in self.named_workers()]
        if len(set(names)) != len(names):
            raise SpecError(f"worker names must be unique: {names}")

    def named_workers(self) -> tuple[WorkerSpec, ...]:
        """The workers with default names filled in (`<engine>-<index>`)."""
        return tuple(w if w.name else replace(w, name=f"{w.engine}-{i}") for i, w in enumerate(self.workers))

    @classmethod
    def uniform(
        cls,
        count: int,
        *,
        seed: int = 0,
        base_port: int = 0,
        speeds: Sequence[float] = (1.0,),
        **worker_fields: Any,
    ) -> FleetSpec:
        """`count` workers alike but for their port (base_port + i, or 0) and speed (cycled)."""
        if count < 1:
            raise SpecError("count must be >= 1")
        if not speeds:
            raise SpecError("speeds must not be empty")
        workers = tuple(
            WorkerSpec(
                port=base_port + i if base_port else 0,
                speed=speeds[i % len(speeds)],
                **worker_fields,
            )
            for i in range(count)
        )
        return cls(workers=workers, seed=seed)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> FleetSpec:
        """Parse the YAML form.

        seed: 7
        control_port: 0
        defaults: {engine: vllm, models: [m], max_num_seqs: 8}
        workers:
          - {name: a100-0, port: 8001}
          - {name: a10-0, port: 8002, speed: 0.5, count: 3}   # count: repeat, ports +1
        """
        if not isinstance(data, Mapping):
            raise SpecError("the fleet config must be a mapping")
        _reject_unknown(data, {"seed", "control_host", "control_port", "defaults", "workers"}, "")
        defaults = data.get("defaults") or {}
        if not isinstance(defaults, Mapping):
            raise SpecError("defaults must be a mapping")
        raw_workers = data.get("workers")
        if not isinstance(raw_workers, list) or not raw_workers:
            raise SpecError("workers must be a non-empty list")
        workers: list[WorkerSpec] = []
        for index, raw in enumerate(raw_workers):
            if not isinstance(raw, Mapping):
                raise SpecError(f"workers[{index}] must be a mapping")
            merged = {**defaults, **raw}
            count = merged.pop("count", 1)
            if not isinstance(count, int) or count < 1:
                raise SpecError(f"workers[{index}].count must be a positive integer")
            for copy in range(count):
                item = dict(merged)
                if count > 1:
                    if item.get("port"):
                        item["port"] = int(item["port"]) + copy
                    if item.get("name"):
                        item["name"] = f"{item['name']}-{copy}"
                workers.append(worker_from_mapping(item, f"workers[{index}]"))
        try:
            return cls(
                workers=tuple(workers),
                seed=int(data.get("seed", 0)),
                control_host=str(data.get("control_host", "127.0.0.1")),
                control_port=int(data.get("control_port", 0)),
            )
        except (TypeError, ValueError) as exc:
            raise SpecError(str(exc)) from exc


_WORKER_FIELDS = {f.name for f in fields(WorkerSpec)}


def worker_from_mapping(data: Mapping[str, Any], where: str = "worker") -> WorkerSpec:
    """One worker from its YAML/dict form (lists become tuples, faults become FaultSpecs)."""
    _reject_unknown(data, _WORKER_FIELDS, where)
    values = dict(data)
    if "models" in values:
        models = values["models"]
        values["models"] = (models,) if isinstance(models, str) else tuple(models)
    if values.get("initial_fault") is not None:
        values["initial_fault"] = FaultSpec.from_mapping(values["initial_fault"])
    if "fault_schedule" in values:
        schedule = []
        for entry in values["fault_schedule"] or ():
            if not isinstance(entry, Mapping) or "at_s" not in entry:
                raise SpecError(f"{where}.fault_schedule entries need at_s and mode")
            rest = {k: v for k, v in entry.items() if k != "at_s"}
            schedule.append(ScheduledFault(float(entry["at_s"]), FaultSpec.from_mapping(rest)))
        values["fault_schedule"] = tuple(schedule)
    try:
        return WorkerSpec(**values)
    except TypeError as exc:
        raise SpecError(f"{where}: {exc}") from exc
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from exc


def _reject_unknown(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise SpecError(f"{where or 'fleet'}: unknown keys {unknown}; allowed: {sorted(allowed)}")
