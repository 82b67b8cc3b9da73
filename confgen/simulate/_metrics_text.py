"""Prometheus text (format 0.0.4) as each real engine prints it. Pure: state in, text out.

Formatting facts each renderer keeps (measured against the real engines' /metrics output):
- vLLM and SGLang use prometheus_client: labels sorted by name (`le` among them), floats
  printed as Python floats (`3.0`) switching to Go-style exponents above 1e6
  (`1.7898432023697093e+09`), counters with a `_created` gauge family after them.
- vLLM V1 labels every series with `engine` (one value per data-parallel rank) and
  `model_name`; the V0 engine had `model_name` only and other names.
- TGI (Rust metrics exporter): unlabelled, counters without `_total`, integers as `12`.
- llama.cpp: unlabelled, numbers in C++ stream default (`%g`), so `4.81234e+06`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ._engine import BatchEngine, Histogram

__all__ = [
    "MetricsInput",
    "histogram_bounds",
    "render",
    "render_llamacpp",
    "render_sglang",
    "render_tgi",
    "render_vllm",
]

VllmNames = Literal["v1", "v0", "both"]


@dataclass(frozen=True)
class MetricsInput:
    """Everything a metrics endpoint reports, read from one worker's engines."""

    model_name: str
    engines: Sequence[BatchEngine]
    started_at_unix: float = 1_700_000_000.0
    prefix_caching: bool = True
    http_requests: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    http_durations: Histogram | None = None
    request_failures: Mapping[str, int] = field(default_factory=dict)
    requests_received: int = 0


# -- bucket layouts --------------------------------------------------------------------

_VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
              2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
             5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_VLLM_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_VLLM_ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_SGLANG_TTFT = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0,
                60.0, 80.0, 100.0, 200.0, 400.0)  # fmt: skip
_SGLANG_ITL = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04,
               0.06, 0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)  # fmt: skip
_SGLANG_E2E = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0,
               80.0, 100.0, 200.0, 400.0, 800.0)  # fmt: skip
_TGI_DURATION = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TGI_TOKENS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)
# prometheus-fastapi-instrumentator's "highr" latency buckets, which vLLM's API server exposes.
HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                      3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)  # fmt: skip


def _one_two_five(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(out)
            out.append(float(value))
        exponent += 1


def histogram_bounds(kind: str) -> dict[str, tuple[float, ...]]:
    """Which quantities an engine of this kind keeps histograms for, with its buckets."""
    if kind in ("vllm", "vllm_v0"):
        tokens = _one_two_five(8192)
        return {
            "ttft": _VLLM_TTFT,
            "itl": _VLLM_ITL,
            "tpot": _VLLM_ITL,
            "e2e": _VLLM_LATENCY,
            "queue": _VLLM_LATENCY,
            "inference": _VLLM_LATENCY,
            "prefill": _VLLM_LATENCY,
            "decode": _VLLM_LATENCY,
            "prompt_tokens": tokens,
            "generation_tokens": tokens,
            "max_tokens_param": tokens,
            "iteration_tokens": tuple(float(b) for b in _VLLM_ITERATION),
        }
    if kind == "sglang":
        return {"ttft": _SGLANG_TTFT, "itl": _SGLANG_ITL, "e2e": _SGLANG_E2E, "queue": _SGLANG_E2E}
    if kind == "tgi":
        return {
            "e2e": _TGI_DURATION,
            "queue": _TGI_DURATION,
            "inference": _TGI_DURATION,
            "tpot": _TGI_DURATION,
            "generation_tokens": _TGI_TOKENS,
            "prompt_tokens": _TGI_TOKENS,
            "max_tokens_param": _TGI_TOKENS,
        }
    return {}


# -- number formats ----------------------------------------------------------------------


def py_float(value: float) -> str:
    """prometheus_client's rendering: Python float repr, Go-style exponent from 1e7 up."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(value)
    whole, _, frac = text.partition(".")
    if value > 0 and "e" not in text and len(whole) > 6:
        digits = (whole + frac).rstrip("0") or "0"
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{mantissa}e+{len(whole) - 1:02d}"
    return text


def rust_number(value: float) -> str:
    """Rust `{}` Display of an f64: integral values without a fraction."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def cpp_number(value: float) -> str:
    """C++ ostream default for a double (`%g`): six significant digits."""
    return f"{float(value):g}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Text:
    """Accumulates exposition lines; `sorted_labels` mimics prometheus_client multiprocess."""

    def __init__(self, number: Callable[[float], str], *, sorted_labels: bool = True) -> None:
        self._lines: list[str] = []
        self._number = number
        self._sorted = sorted_labels

    def family(self, name: str, kind: str, help_text: str | None) -> None:
        if help_text is not None:
            self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: Mapping[str, str], value: float) -> None:
        items = sorted(labels.items()) if self._sorted else list(labels.items())
        if items:
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in items)
            self._lines.append(f"{name}{{{body}}} {self._number(value)}")
        else:
            self._lines.append(f"{name} {self._number(value)}")

    def histogram(self, name: str, labels: Mapping[str, str], hist: Histogram, bound: Callable[[float], str]) -> None:
        for upper, count in hist.cumulative():
            self.sample(f"{name}_bucket", {**labels, "le": bound(upper)}, count)
        self.sample(f"{name}_count", labels, hist.count)
        self.sample(f"{name}_sum", labels, hist.total)

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _empty(kind_bounds: Sequence[float]) -> Histogram:
    return Histogram(kind_bounds)


# -- vLLM ------------------------------------------------------------------------------------

_VLLM_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("iteration_tokens", "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step."),
    (
        "generation_tokens",
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
    ),
    ("max_tokens_param", "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."),
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    (
        "tpot",
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
    ),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("tpot", "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request."),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    ("queue", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
    ("inference", "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
    ("prefill", "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
    ("decode", "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
    ("prompt_tokens", "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "vllm:request_generation_tokens", "Number of generation tokens processed."),
)


_V1_ONLY_HISTOGRAMS = ("vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds")


def render_vllm(data: MetricsInput, *, names: VllmNames = "v1") -> str:
    """vLLM's /metrics. "v1": V1 engine names with an `engine` label per data-parallel rank;
    "both": V1 plus the pre-0.10 cache names (0.9.2-0.10); "v0": the V0 engine (old names,
    `model_name` label only, data-parallel ranks summed)."""
    out = _Text(py_float)
    created = data.started_at_unix
    if names == "v0":
        series: list[tuple[dict[str, str], list[BatchEngine]]] = [({"model_name": data.model_name}, list(data.engines))]
    else:
        series = [({"engine": str(i), "model_name": data.model_name}, [e]) for i, e in enumerate(data.engines)]

    def gauge(name: str, help_text: str, value: Callable[[list[BatchEngine]], float]) -> None:
        out.family(name, "gauge", help_text)
        for labels, engines in series:
            out.sample(name, labels, value(engines))

    def counter(
        base: str, help_text: str, value: Callable[[list[BatchEngine]], float],
        extra: Iterable[dict[str, str]] = ({},),
        extra_value: Callable[[list[BatchEngine], dict[str, str]], float] | None = None,
    ) -> None:  # fmt: skip
        extras = list(extra)
        out.family(f"{base}_total", "counter", help_text)
        for labels, engines in series:
            for more in extras:
                v = extra_value(engines, more) if extra_value else value(engines)
                out.sample(f"{base}_total", {**labels, **more}, v)
        out.family(f"{base}_created", "gauge", help_text)
        for labels, _ in series:
            for more in extras:
                out.sample(f"{base}_created", {**labels, **more}, created)

    def total(attr: str) -> Callable[[list[BatchEngine]], float]:
        return lambda engines: float(sum(getattr(e.counters, attr) for e in engines))

    def running(es: list[BatchEngine]) -> float:
        return float(sum(len(e.running) for e in es))

    def waiting(es: list[BatchEngine]) -> float:
        return float(sum(len(e.waiting) for e in es))

    def kv(es: list[BatchEngine]) -> float:
        return sum(e.kv_usage() for e in es) / max(1, len(es))

    if names == "v0":
        gauge("vllm:num_requests_running", "Number of requests currently running on GPU.", running)
        gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", lambda es: 0.0)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", kv)
        gauge("vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.", lambda es: 0.0)
        gauge("vllm:cpu_prefix_cache_hit_rate", "CPU prefix cache block hit rate.", lambda es: -1.0)
        gauge(
            "vllm:gpu_prefix_cache_hit_rate",
            "GPU prefix cache block hit rate.",
            lambda es: _hit_rate(es) if data.prefix_caching else -1.0,
        )
    else:
        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        out.family(
            "vllm:num_requests_waiting_by_reason", "gauge", "Number of requests waiting, by the reason they wait."
        )
        for labels, engines in series:
            capacity = _capacity_blocked(engines)
            out.sample("vllm:num_requests_waiting_by_reason", {**labels, "reason": "capacity"}, capacity)
            out.sample(
                "vllm:num_requests_waiting_by_reason", {**labels, "reason": "deferred"}, waiting(engines) - capacity
            )
        out.family(
            "vllm:engine_sleep_state",
            "gauge",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        )
        for labels, _ in series:
            for state, value in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
                out.sample("vllm:engine_sleep_state", {**labels, "sleep_state": state}, value)
        if names == "both":
            gauge(
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
                kv,
            )
            counter(
                "vllm:gpu_prefix_cache_queries",
                "GPU prefix cache queries, in terms of number of queried tokens."
                "DEPRECATED: Use vllm:prefix_cache_queries instead.",
                total("prefix_queries_tokens"),
            )
            counter(
                "vllm:gpu_prefix_cache_hits",
                "GPU prefix cache hits, in terms of number of cached tokens."
                "DEPRECATED: Use vllm:prefix_cache_hits instead.",
                total("prefix_hits_tokens"),
            )
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv)
        counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            total("prefix_queries_tokens"),
        )
        counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            total("prefix_hits_tokens"),
        )
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", total("preemptions"))
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", total("prompt_tokens"))
    counter("vllm:generation_tokens", "Number of generation tokens processed.", total("generation_tokens"))
    counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        lambda es: 0.0,
        extra=({"finished_reason": r} for r in ("abort", "length", "stop")),
        extra_value=lambda es, more: float(
            sum(e.counters.requests_finished.get(more["finished_reason"], 0) for e in es)
        ),
    )
    bounds = histogram_bounds("vllm")
    for key, name, help_text in _VLLM_HISTOGRAMS:
        if names == "v0" and name in _V1_ONLY_HISTOGRAMS:
            continue
        if names == "v1" and name == "vllm:time_per_output_token_seconds":
            continue  # deprecated in 0.10, gone after
        out.family(name, "histogram", help_text)
        for labels, engines in series:
            hist = _merged([e.histograms.get(key) for e in engines], bounds[key])
            out.histogram(name, labels, hist, py_float)
        out.family(f"{name}_created", "gauge", help_text)
        for labels, _ in series:
            out.sample(f"{name}_created", labels, created)
    out.family("vllm:request_params_n", "histogram", "Histogram of the n request parameter.")
    for labels, engines in series:
        done = float(sum(sum(e.counters.requests_finished.values()) for e in engines))
        n_hist = Histogram((1.0, 2.0, 5.0, 10.0, 20.0))
        n_hist.observe(1.0, int(done))  # every simulated request has n=1
        out.histogram("vllm:request_params_n", labels, n_hist, py_float)
    out.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
    out.sample(
        "vllm:cache_config_info",
        {
            "block_size": "16",
            "cache_dtype": "auto",
            "calculate_kv_scales": "False",
            "enable_prefix_caching": str(data.prefix_caching),
            "gpu_memory_utilization": "0.9",
            "num_gpu_blocks": str(data.engines[0].model.kv_cache_tokens // 16),
            "num_cpu_blocks": "None",
            "prefix_caching_hash_algo": "sha256",
            "swap_space": "4",
        },
        1.0,
    )
    _render_http(out, data)
    return _render_process(data) + out.text()


def _hit_rate(engines: Sequence[BatchEngine]) -> float:
    queries = sum(e.counters.prefix_queries_tokens for e in engines)
    hits = sum(e.counters.prefix_hits_tokens for e in engines)
    return hits / queries if queries else 0.0


def _capacity_blocked(engines: Sequence[BatchEngine]) -> float:
    """Waiting requests held back by KV room rather than by max_num_seqs."""
    blocked = 0
    for e in engines:
        if e.waiting and len(e.running) < e.model.max_num_seqs:
            blocked += len(e.waiting)
    return float(blocked)


def _merged(hists: Sequence[Histogram | None], bounds: Sequence[float]) -> Histogram:
    out = Histogram(bounds)
    for h in hists:
        if h is not None:
            out.add(h)
    return out


def _render_process(data: MetricsInput) -> str:
    """The default collectors prometheus_client adds to a Python server (fixed values)."""
    out = _Text(py_float)
    for name, kind, help_text, samples in (
        ("python_gc_objects_collected_total", "counter", "Objects collected during gc",
         [("0", 14371.0), ("1", 8232.0), ("2", 1024.0)]),
        ("python_gc_objects_uncollectable_total", "counter", "Uncollectable objects found during GC",
         [("0", 0.0), ("1", 0.0), ("2", 0.0)]),
        ("python_gc_collections_total", "counter", "Number of times this generation was collected",
         [("0", 1288.0), ("1", 117.0), ("2", 9.0)]),
    ):  # fmt: skip
        out.family(name, kind, help_text)
        for generation, value in samples:
            out.sample(name, {"generation": generation}, value)
    out.family("python_info", "gauge", "Python platform information")
    out.sample(
        "python_info",
        {"implementation": "CPython", "major": "3", "minor": "12", "patchlevel": "11",
         "version": "3.12.11"},
        1.0,
    )  # fmt: skip
    for name, help_text, value in (
        ("process_virtual_memory_bytes", "Virtual memory size in bytes.", 9.3158481920e10),
        ("process_resident_memory_bytes", "Resident memory size in bytes.", 3.2763904e09),
        ("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
         data.started_at_unix),
        ("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", 1234.56),
        ("process_open_fds", "Number of open file descriptors.", 121.0),
        ("process_max_fds", "Maximum number of open file descriptors.", 1048576.0),
    ):  # fmt: skip
        kind = "counter" if name.endswith("_total") else "gauge"
        out.family(name, kind, help_text)
        out.sample(name, {}, value)
    return out.text()


def _render_http(out: _Text, data: MetricsInput) -> None:
    """prometheus-fastapi-instrumentator series of vLLM's OpenAI API server."""
    out.family("http_requests_total", "counter", "Total number of requests by method, status and handler.")
    for (handler, method, status), count in sorted(data.http_requests.items()):
        out.sample("http_requests_total", {"handler": handler, "method": method, "status": status}, count)
    out.family("http_requests_created", "gauge", "Total number of requests by method, status and handler.")
    for handler, method, status in sorted(data.http_requests):
        out.sample(
            "http_requests_created", {"handler": handler, "method": method, "status": status}, data.started_at_unix
        )
    durations = data.http_durations or Histogram(HTTP_HIGHR_BUCKETS)
    help_text = "Latency with many buckets but no API specific labels. Made for more accurate percentile calculations. "
    out.family("http_request_duration_highr_seconds", "histogram", help_text)
    out.histogram("http_request_duration_highr_seconds", {}, durations, py_float)
    out.family("http_request_duration_highr_seconds_created", "gauge", help_text)
    out.sample("http_request_duration_highr_seconds_created", {}, data.started_at_unix)


# -- SGLang ----------------------------------------------------------------------------------


def render_sglang(data: MetricsInput, *, prefix: str = "sglang:") -> str:
    """SGLang with --enable-metrics: labels model_name, tp_rank (+ dp_rank when DP > 1)."""
    out = _Text(py_float)
    multi = len(data.engines) > 1
    series = []
    for i, e in enumerate(data.engines):
        labels = {"model_name": data.model_name, "tp_rank": "0"}
        if multi:
            labels["dp_rank"] = str(i)
        series.append((labels, e))

    def gauge(name: str, help_text: str, value: Callable[[BatchEngine], float]) -> None:
        out.family(prefix + name, "gauge", help_text)
        for labels, e in series:
            out.sample(prefix + name, labels, value(e))

    def counter(name: str, help_text: str, value: Callable[[BatchEngine], float]) -> None:
        out.family(prefix + name + "_total", "counter", help_text)
        for labels, e in series:
            out.sample(prefix + name + "_total", labels, value(e))
        out.family(prefix + name + "_created", "gauge", help_text)
        for labels, _ in series:
            out.sample(prefix + name + "_created", labels, data.started_at_unix)

    gauge("num_running_reqs", "The number of running requests.", lambda e: float(len(e.running)))
    gauge("num_used_tokens", "The number of used tokens.", lambda e: float(e.kv_tokens()))
    gauge("token_usage", "The token usage.", lambda e: e.kv_usage())
    gauge(
        "gen_throughput",
        "The generation throughput (token/s).",
        lambda e: e.last_step_batch / e.last_step_seconds if e.last_step_seconds else 0.0,
    )
    gauge("num_queue_reqs", "The number of requests in the waiting queue.", lambda e: float(len(e.waiting)))
    gauge("cache_hit_rate", "The prefix cache hit rate.", lambda e: _hit_rate([e]))
    gauge("spec_accept_length", "The average acceptance length of speculative decoding.", lambda e: 0.0)
    gauge("num_grammar_queue_reqs", "The number of requests in the grammar waiting queue.", lambda e: 0.0)
    counter("prompt_tokens", "Number of prefill tokens processed.", lambda e: float(e.counters.prompt_tokens))
    counter(
        "generation_tokens", "Number of generation tokens processed.", lambda e: float(e.counters.generation_tokens)
    )
    counter("cached_tokens", "Number of cached prompt tokens.", lambda e: float(e.counters.prefix_hits_tokens))
    counter(
        "num_requests", "Number of requests processed.", lambda e: float(sum(e.counters.requests_finished.values()))
    )
    bounds = histogram_bounds("sglang")
    for key, name, help_text in (
        ("ttft", "time_to_first_token_seconds", "Histogram of time to first token in seconds."),
        ("itl", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
        ("e2e", "e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds"),
        ("queue", "queue_time_seconds", "Histogram of queueing time in seconds."),
    ):
        out.family(prefix + name, "histogram", help_text)
        for labels, e in series:
            out.histogram(prefix + name, labels, e.histograms.get(key) or _empty(bounds[key]), py_float)
        out.family(prefix + name + "_created", "gauge", help_text)
        for labels, _ in series:
            out.sample(prefix + name + "_created", labels, data.started_at_unix)
    return out.text()


# -- TGI -------------------------------------------------------------------------------------


def render_tgi(data: MetricsInput) -> str:
    """text-generation-inference: unlabelled, counters without `_total`."""
    out = _Text(rust_number, sorted_labels=False)
    engines = data.engines
    model = engines[0].model

    def plain(name: str, kind: str, value: float, help_text: str | None = None) -> None:
        out.family(name, kind, help_text)
        out.sample(name, {}, value)

    finished = sum(sum(e.counters.requests_finished.values()) for e in engines)
    aborted = sum(e.counters.requests_finished.get("abort", 0) for e in engines)
    plain("tgi_request_count", "counter", data.requests_received, "Total number of requests")
    plain("tgi_request_success", "counter", finished - aborted, "Number of successful requests")
    out.family("tgi_request_failure", "counter", "Number of failed requests")
    for err, count in sorted(data.request_failures.items()):
        out.sample("tgi_request_failure", {"err": err}, count)
    plain("tgi_queue_size", "gauge", sum(len(e.waiting) for e in engines), "Current queue size")
    plain("tgi_batch_current_size", "gauge", sum(len(e.running) for e in engines), "Current batch size")
    plain(
        "tgi_batch_current_max_tokens",
        "gauge",
        sum(e.kv_tokens() for e in engines),
        "Maximum tokens for the current batch",
    )
    plain(
        "tgi_batch_max_total_tokens",
        "gauge",
        model.kv_cache_tokens * len(engines),
        "Maximum amount of tokens in total.",
    )
    plain(
        "tgi_batch_inference_count",
        "counter",
        sum(e.counters.steps for e in engines),
        "Inference calls per method (prefill or decode)",
    )
    bounds = histogram_bounds("tgi")
    for key, name, help_text in (
        ("e2e", "tgi_request_duration", "Request duration"),
        ("queue", "tgi_request_queue_duration", "Time spent in the queue per request"),
        ("inference", "tgi_request_inference_duration", "Request inference duration"),
        ("tpot", "tgi_request_mean_time_per_token_duration", "Mean time per token per request"),
        ("generation_tokens", "tgi_request_generated_tokens", "Generated tokens per request"),
        ("prompt_tokens", "tgi_request_input_length", "Input token length per request"),
        ("max_tokens_param", "tgi_request_max_new_tokens", "Maximum new tokens per request"),
    ):
        out.family(name, "histogram", help_text)
        hist = _merged([e.histograms.get(key) for e in engines], bounds[key])
        out.histogram(name, {}, hist, rust_number)
    return out.text()


# -- llama.cpp -------------------------------------------------------------------------------


def render_llamacpp(data: MetricsInput) -> str:
    """llama-server --metrics, as the real server prints it (tools/server/server-task.cpp,
    checked by tests/realengine against the built binary): ten counters then five gauges,
    unlabelled, `%g` numbers (large counters in exponent form). No KV-cache gauge exists;
    `prompt_tokens_total` excludes the tokens reused from the prompt cache, which
    `prompt_tokens_cached_total` counts; `n_busy_slots_per_decode` is a gauge. The
    speculative-decoding counters stay 0 (no draft model), and their per-position family is
    printed only when drafts were accepted, so never here."""
    out = _Text(cpp_number)
    engines = data.engines
    c = [e.counters for e in engines]
    prompt_s = sum(x.prefill_seconds for x in c)
    decode_s = sum(x.decode_seconds for x in c)
    cached = sum(x.prefix_hits_tokens for x in c)
    prompt = sum(x.prompt_tokens for x in c) - cached
    predicted = sum(x.generation_tokens for x in c)
    steps = sum(x.steps for x in c)
    counters = (
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", prompt),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", cached),
        ("prompt_seconds_total", "Total time spent processing prompts", prompt_s),
        ("tokens_predicted_total", "Number of generation tokens processed", predicted),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", decode_s),
        (
            "n_decode_total",
            "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
            steps,
        ),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)",
         max((x.longest_sequence for x in c), default=0)),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
        ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model", 0),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", 0),
    )  # fmt: skip
    gauges = (
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt / prompt_s if prompt_s else 0.0),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
         predicted / decode_s if decode_s else 0.0),
        ("requests_processing", "Number of requests processing", sum(len(e.running) for e in engines)),
        ("requests_deferred", "Number of requests deferred", sum(len(e.waiting) for e in engines)),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         sum(x.busy_slot_steps for x in c) / max(steps, 1)),
    )  # fmt: skip
    for kind, rows in (("counter", counters), ("gauge", gauges)):
        for name, help_text, value in rows:
            out.family(f"llamacpp:{name}", kind, help_text)
            out.sample(f"llamacpp:{name}", {}, float(value))
    return out.text()


def render(kind: str, data: MetricsInput, *, variant: str = "default") -> str | None:
    """The /metrics body for an engine kind (None: this kind has no metrics endpoint)."""
    if kind == "vllm":
        return render_vllm(data, names="both" if variant == "both_names" else "v1")
    if kind == "vllm_v0":
        return render_vllm(data, names="v0")
    if kind == "sglang":
        return render_sglang(data, prefix="sglang_" if variant == "underscore_prefix" else "sglang:")
    if kind == "tgi":
        return render_tgi(data)
    if kind == "llamacpp":
        return render_llamacpp(data)
    return None
