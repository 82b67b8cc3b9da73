"""The typed topology: the single source of truth every renderer reads.

A topology describes listeners, pools of inference workers, how requests are routed to
pools, and the limits and failure handling around them. The YAML file maps 1:1 onto these
frozen dataclasses (keys are the attribute names unless a field says otherwise); defaults
here are the ones fit for LLM traffic (long streams, slow first tokens, costly retries).
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, replace
from typing import Literal

from ._fields import Duration, field

Engine = Literal["vllm", "sglang", "tgi", "llamacpp", "openai"]
Policy = Literal["auto", "round_robin", "random", "least_request", "ring_hash", "maglev", "prefix_affinity"]
RetryOn = Literal["connect-failure", "reset", "refused-stream", "gateway-error", "retriable-4xx"]
Discovery = Literal["eds", "strict_dns"]
CannedKind = Literal["error", "completion"]
XdsMode = Literal["files", "ads"]
XdsProtocol = Literal["delta", "sotw"]
LimitScope = Literal["local", "global"]
LimitUnit = Literal["requests", "input_tokens", "output_tokens", "total_tokens"]
LimitWindow = Literal["second", "minute", "hour", "day"]
WINDOW_SECONDS: dict[str, int] = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
TrafficClass = Literal["critical", "standard", "sheddable"]

# The health path each engine answers on (see the engines' docs; sglang's /health runs a
# one-token generation, which is what we want to know).
DEFAULT_HEALTH_PATH: dict[str, str] = {
    "vllm": "/health",
    "sglang": "/health",
    "tgi": "/health",
    "llamacpp": "/health",
    "openai": "/v1/models",
}
# Health paths whose healthy answer takes a fixed time by design, and that time: SGLang's /health and
# /health_generate (0.5.x; SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION on by default) submit a one-token generation,
# then poll once a second for the scheduler's answer (sglang/srt/entrypoints/http_server.py, `health_generate`:
# `await asyncio.sleep(1)` before the first look): a healthy engine answers after 1 s at the earliest. The
# sidecar's probe waits it out and counts only the excess as latency; `validate` warns on a proxy health check
# timing out before HEALTH_FLOOR_MARGIN_S past it; the simulated SGLang polls alike.
HEALTH_POLL_S: dict[str, tuple[frozenset[str], float]] = {"sglang": (frozenset({"/health", "/health_generate"}), 1.0)}
HEALTH_FLOOR_MARGIN_S = 0.5


def health_floor_s(engine: str, path: str) -> float:
    """Seconds a healthy `engine` takes by design to answer a health request on `path` (0 for most)."""
    paths, floor = HEALTH_POLL_S.get(engine, (frozenset(), 0.0))
    return floor if path.split("?", 1)[0] in paths else 0.0


def _d(text: str) -> Duration:
    from ._fields import parse_duration

    parsed = parse_duration(text)
    assert parsed is not None, text
    return parsed


# Envoy's protos say `gt: {}` for these durations (connect timeout, health-check interval,
# timeout and no_traffic_interval, outlier interval and base ejection time): 0s is refused.
_POSITIVE = _d("1ms")


@dataclass(frozen=True)
class Admin:
    socket: str | None = field(
        None,
        doc="The Unix socket Envoy's admin interface listens on (mode 0600: only Envoy's user can connect; the "
        "sidecar must run as that user), as both Envoy and the sidecar see it. Default: envoy-admin.sock in the "
        "directory the rendered files live in (envoy.config_dir, else the output directory; the sidecar looks in "
        "its --xds-dir). Envoy's admin can stop Envoy, change runtime values (the "
        "in-flight limits, the picker's bypass share) and drain listeners, and has no authentication of its own.",
        pattern="file_path",
    )
    address: str | None = field(
        None,
        doc="Put Envoy's admin on TCP at this address instead of its Unix socket (with port; default port 9901). "
        "Any local process can then reach it, loopback included: use it where the loopback is Envoy's own (a "
        "pod), or for the nginx target's status page (127.0.0.1 by default).",
    )
    port: int | None = field(
        None,
        doc="Put Envoy's admin on TCP at this port instead of its Unix socket (address default 127.0.0.1); the "
        "nginx target's status page port (default 9901).",
        minimum=1,
        maximum=65535,
    )


ADMIN_SOCKET = "envoy-admin.sock"  # Envoy's admin socket in the rendered files' directory (admin.socket's default)
DEFAULT_ADMIN_ADDRESS = "127.0.0.1"
DEFAULT_ADMIN_PORT = 9901


# Largest request body a listener takes by default (listeners[].max_request_bytes).
DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024
# The endpoint picker (confgen-sidecar's ext_proc service) takes gRPC messages of at most this
# many bytes; Envoy sends it the whole request body in one message, so a listener in front of a
# prefix_affinity pool takes bodies of at most PICKER_MAX_BODY_BYTES (room left for the message's
# own fields). The sidecar's GrpcLimits.max_message_bytes must be at least this.
PICKER_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
PICKER_MAX_BODY_BYTES = PICKER_MAX_MESSAGE_BYTES - 64 * 1024


@dataclass(frozen=True)
class TrustedHeaders:
    names: list[str] = field(
        doc="The headers; each a header of your own (not one the proxies own or the client-id header).",
        pattern="header", min_items=1,
    )
    from_: list[str] = field(
        key="from",
        doc="CIDR ranges of the peers allowed to send them, matched on the connection's own source address "
        "(not X-Forwarded-For); empty: no peer (Envoy removes them from every request).",
        pattern="cidr",
    )


@dataclass(frozen=True)
class Listener:
    name: str = field(doc="Listener name.", pattern="name")
    port: int = field(doc="Port clients connect to.", minimum=1, maximum=65535)
    address: str = field("0.0.0.0", doc="IP address to listen on.")
    stream_idle_timeout: Duration = field(
        _d("5m"), doc="Close a stream with no bytes in either direction for this long."
    )
    request_headers_timeout: Duration = field(_d("10s"), doc="Time a client has to send its request headers.")
    max_request_bytes: int = field(
        DEFAULT_MAX_REQUEST_BYTES,
        doc="Largest request body accepted; a larger one is answered 413 `request_too_large` before any of it "
        "is parsed. Envoy parses the whole body to read `model` (measured: 0.09 CPU-s and 88 MiB of peak memory "
        "per MB of a dense JSON integer array, a tenth of that for text), so the default (2 MiB: a 128k-token "
        "prompt as text or token ids, or a few images in base64) bounds what one request can cost. With a "
        "prefix_affinity pool at most 4128768 (4 MiB less 64 KiB): the endpoint picker takes the body in one "
        "gRPC message of at most 4 MiB.",
        minimum=1024,
        maximum=256 * 1024 * 1024,
    )
    trusted_headers: TrustedHeaders | None = field(
        None,
        doc="Request headers a trusted hop in front of this listener sets (an upstream gateway); Envoy removes "
        "them from every other peer, so a route's class may depend on them (see routes[].class).",
    )


@dataclass(frozen=True)
class Worker:
    __shorthand__ = "address"  # a plain "host:port" string stands for a worker

    address: str = field(
        doc="host:port of one inference server (IPv4, [IPv6] or a DNS name). A tensor- or "
        "pipeline-parallel server spanning several GPUs is one worker."
    )
    weight: int = field(1, doc="Static share of traffic relative to the pool's other workers.", minimum=1, maximum=128)
    capacity: int | None = field(
        None,
        doc="Max concurrent sequences this worker runs (vLLM --max-num-seqs); defaults to the pool's.",
        minimum=1,
        maximum=100_000,
    )
    zone: str | None = field(None, doc="Zone or rack, published as the endpoint's locality.", pattern="label")
    labels: dict[str, str] = field(factory=dict, doc="Free-form labels (for example gpu: a100).", pattern="label")
    drain: bool = field(False, doc="Planned drain: finish in-flight requests, take no new ones.")


@dataclass(frozen=True)
class HashOn:
    header: str | None = field(None, doc="Hash on this request header (e.g. x-session-id).", pattern="header")
    cookie: str | None = field(None, doc="Hash on this cookie's value.", pattern="cookie")


@dataclass(frozen=True)
class Balancing:
    policy: Policy = field(
        "auto",
        doc="Load-balancing policy. prefix_affinity (Envoy only): confgen-sidecar's endpoint picker chooses per "
        "request the worker where it predicts the request finishes first (its queue, the prompt blocks it does "
        "not hold in its KV cache, its decode speed under its batch), with least_request when the picker says "
        "nothing. auto (the default): prefix_affinity where the engine reports metrics (vllm, sglang, tgi, "
        "llamacpp) and Envoy can reach the picker as configured, least_request otherwise (validate says why); "
        "nginx balances auto and prefix_affinity as least_request.",
    )
    choice_count: int = field(
        2, doc="least_request: hosts sampled per pick (power of two choices).", minimum=2, maximum=100
    )
    active_request_bias: float = field(
        0.5,
        doc="least_request: how strongly in-flight requests lower a weighted host's share "
        "(weight / (in flight + 1)^bias, when weights differ; 0.5 chosen by the worst case over "
        "bench/sweep's fleet matrix).",
        minimum=0.0,
        maximum=10.0,
    )
    hash_on: HashOn | None = field(None, doc="ring_hash/maglev: what keeps a session on one worker.")
    hash_balance_factor: int = field(
        150,
        doc="ring_hash/maglev: a host takes at most this percent of the average load "
        "before a session spills to the next host (bounded-load hashing).",
        minimum=100,
        maximum=1000,
    )


@dataclass(frozen=True)
class HealthCheck:
    enabled: bool = field(True, doc="Let the proxy actively probe each worker.")
    path: str | None = field(None, doc="Health path; defaults to the engine's.", pattern="http_path")
    interval: Duration = field(_d("5s"), doc="Time between probes.", minimum=_POSITIVE)
    timeout: Duration = field(_d("2s"), doc="A probe slower than this fails.", minimum=_POSITIVE)
    healthy_threshold: int = field(2, doc="Passing probes before a worker is readmitted.", minimum=1, maximum=100)
    unhealthy_threshold: int = field(3, doc="Failing probes before a worker is evicted.", minimum=1, maximum=100)
    no_traffic_interval: Duration = field(
        _d("5s"),
        doc="Probe interval for a pool with no traffic (Envoy's default of 60 s misses dead workers).",
        minimum=_POSITIVE,
    )


@dataclass(frozen=True)
class OutlierDetection:
    enabled: bool = field(True, doc="Eject workers that fail real requests.")
    consecutive_5xx: int = field(5, doc="Consecutive 5xx answers before ejection.", minimum=1, maximum=1000)
    consecutive_gateway_failure: int = field(
        3, doc="Consecutive 502/503/504 or connection failures before ejection.", minimum=1, maximum=1000
    )
    interval: Duration = field(_d("5s"), doc="How often ejections are evaluated.", minimum=_POSITIVE)
    base_ejection_time: Duration = field(
        _d("30s"), doc="First ejection length (grows with repeats).", minimum=_POSITIVE
    )
    max_ejection_percent: int = field(50, doc="Never eject more than this share of a pool.", minimum=0, maximum=100)


@dataclass(frozen=True)
class Retries:
    attempts: int = field(2, doc="Retries per request (0 disables).", minimum=0, maximum=10)
    retry_on: list[RetryOn] = field(
        factory=lambda: ["connect-failure", "reset", "refused-stream"],
        doc="Failures that are retried, always on a different worker. A generation is only "
        "retried before its first byte reached the client.",
    )
    budget_percent: float = field(
        20.0, doc="Retries may add at most this percent to the requests in flight.", minimum=0.0, maximum=100.0
    )
    min_concurrency: int = field(
        10,
        doc="Retries always allowed regardless of the budget (a crashed worker fails all its in-flight requests "
        "at once; Envoy's default of 3 let some of them fail in a 3-worker pool).",
        minimum=0,
        maximum=10_000,
    )


@dataclass(frozen=True)
class Timeouts:
    connect: Duration = field(_d("2s"), doc="TCP connect timeout to a worker.", minimum=_POSITIVE)
    request: Duration = field(_d("0s"), doc="Whole-request limit; 0s means none (a long generation must not be cut).")
    idle: Duration = field(
        _d("10m"),
        doc="Longest silence from a worker: before the first byte of an answer (a non-streamed answer sends "
        "nothing until it is complete; a stream nothing until its first token, after queueing and prefill) and "
        "between two chunks of a stream. 10 minutes, as the OpenAI SDK's own timeout: a minute cut non-streamed "
        "generations past 60 s after the GPU had done the work.",
    )


@dataclass(frozen=True)
class Autoscale:
    target: str = field(doc="The workers' Kubernetes object the HPA scales.", pattern="scale_target")
    min_replicas: int = field(1, doc="Fewest workers.", minimum=1, maximum=10_000)
    max_replicas: int = field(8, doc="Most workers.", minimum=1, maximum=10_000)
    queue_depth_per_replica: float = field(
        4.0,
        doc="Requests a worker may keep waiting (llm_queue_depth per worker); the HPA aims at 80 % of it, "
        "20 % headroom for new workers to start.",
        minimum=0.1,
        maximum=10_000.0,
    )


@dataclass(frozen=True)
class Admission:
    standard: float | None = field(
        None,
        doc="How long a standard request may wait to start, as a multiple of the pool's median service time (how "
        "long one request holds a slot, which the endpoint picker measures). While the pool is under pressure a "
        "request whose predicted delay on every worker is past it is refused at once (429 with retry-after). "
        "Lower: a shorter queue and a lower admitted P99, more refused at a burst. Unset: the sidecar's "
        "`--picker budget_standard` (0.4).",
        minimum=0.0,
        maximum=1000.0,
    )
    sheddable: float | None = field(
        None,
        doc="The same for sheddable traffic: kept below standard's, so sheddable traffic is refused first. Unset: "
        "the sidecar's `--picker budget_sheddable` (0.03). Critical traffic is never refused by the picker.",
        minimum=0.0,
        maximum=1000.0,
    )
    min_wait: Duration | None = field(
        None,
        doc="A floor under both budgets, for a pool whose requests are so short that a multiple of their service "
        "time is no wait at all. Unset: the sidecar's `--picker budget_floor_s` (0s).",
    )

    def given(self) -> list[str]:
        """The fields the topology sets (empty: the sidecar's budgets for this pool)."""
        return [name for name in ("standard", "sheddable", "min_wait") if getattr(self, name) is not None]


@dataclass(frozen=True)
class Pool:
    name: str = field(doc="Pool name; also the Envoy cluster name.", pattern="name")
    engine: Engine = field(doc="Inference engine the workers run.")
    models: list[str] = field(doc="Model names the workers serve (--served-model-name).", pattern="model", min_items=1)
    workers: list[Worker] = field(doc="The inference servers of this pool.", min_items=1)
    aliases: list[str] = field(factory=list, doc="More names clients may ask for.", pattern="model")
    capacity: int = field(
        256, doc="Default max concurrent sequences per worker (vLLM --max-num-seqs).", minimum=1, maximum=100_000
    )
    balancing: Balancing = field(factory=Balancing, doc="How requests are spread over workers.")
    health: HealthCheck = field(factory=HealthCheck, doc="Active health checks.")
    outlier_detection: OutlierDetection = field(factory=OutlierDetection, doc="Passive ejection on failures.")
    retries: Retries = field(factory=Retries, doc="Retries on connection failures.")
    timeouts: Timeouts = field(factory=Timeouts, doc="Timeouts fit for long generations.")
    fallback: str | None = field(
        None, doc="Pool that takes this pool's traffic when it has no healthy worker.", pattern="name"
    )
    discovery: Discovery = field(
        "eds",
        doc="eds: endpoints in a file the sidecar rewrites (DNS names are resolved by the "
        "sidecar); strict_dns: the proxy resolves the names itself (no sidecar).",
    )
    metrics_path: str = field("/metrics", doc="Prometheus metrics path (read by the sidecar).", pattern="http_path")
    allow_clients: list[str] | None = field(
        None, doc="API-key clients allowed to use this pool (default: every client).", pattern="name"
    )
    autoscale: Autoscale | None = field(
        None, doc="Kubernetes target: an HPA that scales the workers on the sidecar's llm_queue_depth."
    )
    max_output_tokens: int | None = field(
        None,
        doc="Most tokens one answer of this pool can generate (the engine's limit, e.g. vLLM's max_model_len "
        "less the prompt). A request without max_tokens reserves this many output tokens of a token budget "
        "until its answer ends (default: 4096).",
        minimum=1,
        maximum=10_000_000,
    )
    admission: Admission = field(
        factory=Admission,
        doc="Admission per request, by the sidecar's endpoint picker (Envoy pools on the picker only): how long "
        "each class may wait before it is refused under overload. Other pools are shed by the sidecar's "
        "in-flight limiter (backpressure).",
    )
    pod_labels: dict[str, str] = field(
        factory=dict,
        doc="gateway-api target: labels of this pool's worker pods, the selector of its InferencePool.",
        pattern="k8s_label_value",
    )

    @property
    def health_path(self) -> str:
        return self.health.path or DEFAULT_HEALTH_PATH[self.engine]

    @property
    def served_names(self) -> list[str]:
        return [*self.models, *self.aliases]

    def capacity_of(self, worker: Worker) -> int:
        """Concurrent sequences `worker` (one of this pool's) runs: its own `capacity`, else the pool's."""
        return worker.capacity or self.capacity

    @property
    def total_capacity(self) -> int:
        """Concurrent sequences the pool's workers run in all: the listed workers', or, for a
        pool with `autoscale`, at least `max_replicas` workers' (a headless Service listed once
        resolves to every pod the autoscaler starts; the safety cap must make room for them)."""
        listed = sum(self.capacity_of(w) for w in self.workers)
        if self.autoscale is None:
            return listed
        return max(listed, self.autoscale.max_replicas * self.capacity)


@dataclass(frozen=True)
class HeaderMatch:
    name: str = field(
        doc="Header name; not a hop-by-hop header nor x-forwarded-for/-proto or x-request-id (Envoy strips or "
        "sets those before routing, so the targets would route differently).",
        pattern="header",
    )
    exact: str | None = field(None, doc="Match this value exactly.", pattern="header_value")
    prefix: str | None = field(None, doc="Match values starting with this.", pattern="header_value")
    present: bool | None = field(None, doc="Match when the header is (true) or is not (false) sent.")


@dataclass(frozen=True)
class Match:
    models: list[str] | None = field(None, doc="The JSON body's `model` is one of these.", pattern="model")
    headers: list[HeaderMatch] | None = field(None, doc="Every listed header matches.")
    path_prefix: str | None = field(None, doc="The URL path starts with this.", pattern="http_path")


@dataclass(frozen=True)
class Route:
    name: str = field(doc="Route name.", pattern="name")
    pool: str = field(doc="Pool that serves matching requests.", pattern="name")
    match: Match = field(factory=Match, doc="All given conditions must hold; none given matches every request.")
    allow_clients: list[str] | None = field(
        None, doc="API-key clients allowed on this route (default: the pool's).", pattern="name"
    )
    class_: TrafficClass = field(
        "standard", key="class",
        doc="Under overload (Envoy only; nginx honours no class): critical traffic is never shed by the "
        "sidecar's limit (only the safety cap bounds it); sheddable traffic is refused first (429 overloaded, a "
        "share the sidecar raises while the pool's limit refuses requests); standard traffic absorbs what "
        "remains. A request's class: critical if its route or its API-key client says critical, else "
        "sheddable if either says sheddable, else standard.",
    )


@dataclass(frozen=True)
class ApiKey:
    client: str = field(doc="Client id, forwarded to workers and used for per-key limits.", pattern="name")
    env: str | None = field(None, doc="Environment variable that holds the key at render time.", pattern="env_var")
    file: str | None = field(None, doc="File that holds the key at render time.", pattern="file_path")
    rate_limit: LimitSet | None = field(
        None, doc="This client's own limits, one or a list (replace limits.per_key for this client)."
    )
    class_: TrafficClass = field(
        "standard", key="class",
        doc="This client's traffic class on every route: critical if either this or the route's class is "
        "critical, else sheddable if either is sheddable, else standard; see routes[].class.",
    )


@dataclass(frozen=True)
class Auth:
    api_keys: list[ApiKey] = field(doc="Accepted keys, sent as `Authorization: Bearer <key>`.", min_items=1)
    client_header: str = field(
        "x-confgen-client",
        doc="Header that carries the authenticated client id to workers; not one the proxies own or that "
        "carries the key (authorization, host, connection, x-forwarded-*, x-envoy-*, ... are refused).",
        pattern="header",
    )


@dataclass(frozen=True)
class RateLimit:
    requests: int | None = field(
        None,
        doc="unit requests: requests admitted every `per` (local) or `window` (global).",
        minimum=1,
        maximum=10_000_000,
    )
    tokens: int | None = field(
        None,
        doc="Token units (scope global only): tokens admitted every `window`, counted from each response's "
        "`usage` (see docs/targets.md for streams).",
        minimum=1,
        maximum=1_000_000_000_000,
    )
    per: Duration | None = field(
        None,
        doc="scope local: refill period of the token bucket (Envoy's timer refuses periods under 50ms).",
        minimum=_d("50ms"),
    )
    burst: int | None = field(
        None, doc="scope local: bucket size (default: requests).", minimum=1, maximum=10_000_000
    )
    scope: LimitScope = field(
        "local",
        doc="local: a token bucket in each proxy (N proxies admit N times the rate). global: one budget for "
        "the whole fleet, counted by confgen-sidecar's rate limit service in `limits.store` (Envoy only).",
    )
    unit: LimitUnit = field(
        "requests",
        doc="What is counted: requests, or (scope global) the tokens of each answer's `usage`: input_tokens "
        "(prompt), output_tokens (completion) or total_tokens.",
    )
    window: LimitWindow | None = field(
        None, doc="scope global: the fixed window the budget is counted in (second, minute, hour or day)."
    )
    per_model: bool = field(
        False,
        doc="scope global: a separate budget per model the route serves (routes that name no model share one).",
    )
    fail_closed: bool = field(
        False,
        doc="scope global: answer 429 when the rate limit service or its store cannot be reached (default: "
        "admit, with the local limits as the only bound).",
    )

    @property
    def bucket(self) -> int:
        return self.burst or self.rate

    @property
    def rate(self) -> int:
        """requests (or tokens) admitted per period; the checks guarantee one is set."""
        return self.requests if self.requests is not None else (self.tokens or 1)

    @property
    def period(self) -> Duration:
        """`per`, or the window's length (the checks guarantee one is set)."""
        if self.per is not None:
            return self.per
        return Duration(WINDOW_SECONDS[self.window or "second"] * 1000)


LimitSet = RateLimit | list[RateLimit]  # one limit, or several (a request must fit all of them)


def limit_list(value: LimitSet | None) -> list[RateLimit]:
    """The limits a `LimitSet` field holds, in order."""
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


@dataclass(frozen=True)
class RedisSentinel:
    addresses: list[str] = field(
        doc="host:port of each Redis Sentinel watching the primary (three on separate hosts for a quorum). The "
        "sidecar asks them for the current primary, and asks again when it fails over.",
        pattern="server",
        min_items=1,
    )
    master: str = field(
        doc="The name the Sentinels monitor the primary under (`sentinel monitor <master> ...`).",
        pattern="name",
    )


@dataclass(frozen=True)
class LimitStore:
    redis: str | None = field(
        None,
        doc="host:port of the Redis (or Valkey) every confgen-sidecar counts global limits in. Give this or "
        "sentinel.",
        pattern="server",
    )
    sentinel: RedisSentinel | None = field(
        None,
        doc="A Redis that fails over: the Sentinels that know its primary (instead of redis). Counting resumes "
        "on the new primary after a failover; meanwhile the local floor decides (docs/limits.md).",
    )
    username: str | None = field(
        None,
        doc="The Redis ACL user the sidecar authenticates as (Redis 6+; with password_env). Default: the "
        "`default` user.",
        pattern="name",
    )
    password_env: str | None = field(
        None,
        doc="Environment variable holding the password the sidecar sends the Redis primary (AUTH) when it "
        "connects. A Redis without a password lets whoever reaches it (loopback: every local user) reset or "
        "exhaust every budget; set `requirepass` (or an ACL user) there and its password here. Sentinels "
        "themselves are asked without it.",
        pattern="env_var",
    )
    timeout: Duration = field(
        _d("50ms"),
        doc="Longest wait for one Redis call; past it (or when Redis is down) the sidecar admits the request, "
        "unless the limit is fail_closed.",
        minimum=_d("1ms"),
        maximum=_d("10s"),
    )
    check_timeout: Duration = field(
        _d("100ms"),
        doc="Longest time Envoy waits for the sidecar's answer before it admits the request (or refuses it "
        "for fail_closed limits). Longer than `timeout`, so the sidecar answers first.",
        minimum=_d("1ms"),
        maximum=_d("10s"),
    )
    envoys: int | None = field(
        None,
        doc="Rate limit services counting in this store: the Envoys (a sidecar beside each), or with envoy.xds.mode "
        "ads the control-plane servers (they answer every Envoy's checks). While the store cannot be reached, each "
        "admits a global budget's amount / envoys per window on its own (the local floor; never unlimited). "
        "Default: kubernetes.replicas; with ads, the number of envoy.xds.servers.",
        minimum=1,
        maximum=10_000,
    )


@dataclass(frozen=True)
class Limits:
    global_: LimitSet | None = field(
        None, key="global",
        doc="Limits on all requests together, not per client (local: each listener of each proxy; global: every "
        "listener of every Envoy): one, or a list."
    )
    per_key: LimitSet | None = field(
        None, doc="Limits on each API-key client's requests (each client its own budget): one, or a list."
    )
    store: LimitStore | None = field(
        None, doc="Where scope: global limits are counted; required when any limit is global."
    )


# The largest values the proxies accept for an in-flight cap: Envoy's circuit-breaker
# thresholds are uint32; nginx's limit_conn refuses a number above 65535.
ENVOY_CAP_MAX = 2**32 - 1
NGINX_CAP_MAX = 65535


@dataclass(frozen=True)
class Backpressure:
    max_utilization: float = field(
        0.8,
        doc="Read by the sidecar only. A pool is saturated, and the sidecar sheds new requests (429), when "
        "the workers without headroom hold at least this share of the declared capacity of the workers in "
        "rotation. A worker has no headroom when, on fresh metrics, its engine's waiting queue (smoothed, "
        "projected along its rise) reaches 1.5 requests per declared slot, or its KV-cache use is at least 0.8 "
        "while requests wait. In-flight counts are never compared with it.",
        minimum=0.05,
        maximum=1.0,
    )
    safety_cap: float = field(
        4.0,
        doc="The proxy's hard cap on requests in flight to a pool, as a multiple of the pool's declared "
        "capacity (the sum of its workers' capacity): every slot plus the engines' own waiting queues. "
        "Past it the proxy answers 429 at once; it is a safety net, not the shedding rule.",
        minimum=1.0,
        maximum=1000.0,
    )
    retry_after: Duration = field(_d("2s"), doc="Sent as retry-after on 429 answers (whole seconds).")


def in_flight_cap(total_capacity: int, safety_cap: float, ceiling: int) -> int:
    """ceil(safety_cap x total_capacity), within [1, ceiling] by construction.

    The proxy's safety cap on requests in flight to one pool (Envoy's circuit breakers with
    ceiling ENVOY_CAP_MAX, nginx's limit_conn with NGINX_CAP_MAX). In-flight counts include
    the requests waiting in the engines' own queues, so a cap at the slot count would queue
    or shed at normal load; the default multiple of 4 leaves room for every slot and three
    batches' worth of waiting requests, which a fleet below saturation does not reach.
    """
    return min(max(1, math.ceil(total_capacity * safety_cap - 1e-9)), ceiling)


@dataclass(frozen=True)
class Canned:
    kind: CannedKind = field("error", doc="error: an OpenAI error object; completion: a chat completion.")
    status: int = field(503, doc="HTTP status of the canned answer.", minimum=200, maximum=599)
    message: str = field(
        "All inference capacity is busy or unavailable. Please retry shortly.",
        doc="Text of the error message or of the assistant's reply.",
        pattern="text",
    )


@dataclass(frozen=True)
class GrpcTls:
    cert: str = field(doc="Envoy's client certificate chain (PEM), as Envoy sees the path (cert-manager: tls.crt); "
                      "signed by the CA the sidecar's --grpc-client-ca names. Over ADS the control plane accepts "
                      "the Envoy's node id only when it is one of this certificate's names (SAN or CN), or "
                      "<name>/<anything> for a certificate a group of Envoys shares.", pattern="file_path")
    key: str = field(doc="Its private key (PEM; tls.key).", pattern="file_path")
    ca: str = field(doc="CA that signs the sidecar's gRPC certificate (PEM; ca.crt).", pattern="file_path")
    server_names: list[str] = field(
        factory=list,
        doc="Names the sidecar's gRPC certificate must carry (a DNS or IP subjectAltName, any one of them); "
        "default: the hosts Envoy calls (sidecar.address, or with envoy.xds.mode ads the hosts of envoy.xds.servers).",
        pattern="host",
    )


@dataclass(frozen=True)
class Xds:
    mode: XdsMode = field(
        "files",
        doc="files: Envoy reads LDS/CDS/EDS from rendered files, one sidecar next to each Envoy. ads: Envoy takes "
        "listeners, clusters, endpoints and the in-flight limits (RTDS) over one gRPC stream from "
        "`confgen-sidecar --serve-xds` (one control plane probes the fleet for any number of Envoys).",
    )
    servers: list[str] = field(
        factory=list,
        doc="ads: the control plane's host:port addresses (two for high availability). Envoy connects to one "
        "at a time and moves to another when it fails; each Envoy keeps its last config meanwhile.",
        pattern="server",
    )
    protocol: XdsProtocol = field(
        "delta",
        doc="ads: delta (DELTA_GRPC: only changed endpoints travel) or sotw (GRPC, state of the world). "
        "The sidecar serves both.",
    )
    tls: GrpcTls | None = field(
        None,
        doc="Deprecated (read for one release, with a warning): write sidecar.grpc_tls, the one TLS block of "
        "every gRPC surface of the sidecar (ADS, the endpoint picker, rate limits). Read as sidecar.grpc_tls "
        "when that is not set.",
    )


@dataclass(frozen=True)
class EnvoyOptions:
    config_dir: str | None = field(
        None,
        doc="Where the rendered files live when Envoy runs (default: the output directory).",
        pattern="file_path",
    )
    node_id: str | None = field(None, doc="Envoy node id (default: the topology name).", pattern="name")
    max_eds_files: int = field(
        100,
        doc="Most pools with discovery: eds. Envoy opens one inotify instance per watched xDS file and "
        "fs.inotify.max_user_instances is often 128: past it Envoy aborts, even on a live CDS update. "
        "Raise both together.",
        minimum=1,
        maximum=100_000,
    )
    xds: Xds = field(factory=Xds, doc="How Envoy gets its configuration: rendered files, or ADS over gRPC.")


@dataclass(frozen=True)
class NginxOptions:
    config_dir: str | None = field(
        None, doc="Where the rendered files live when nginx reads them (default: the output directory).",
        pattern="file_path",
    )


@dataclass(frozen=True)
class Kubernetes:
    namespace: str = field("default", doc="Namespace of the rendered objects.", pattern="k8s_name")
    replicas: int = field(2, doc="Proxy pods (each runs Envoy and the sidecar; with envoy.xds.mode ads, Envoy "
                          "alone, and this is the HPA's minimum).", minimum=1, maximum=1000)
    envoy_max_replicas: int = field(
        10, doc="envoy.xds.mode ads: most Envoy pods the HPA scales to on CPU.", minimum=1, maximum=1000)
    envoy_image: str = field("envoyproxy/envoy:v1.40.0", doc="Envoy container image.", pattern="image")
    sidecar_image: str = field("confgen/sidecar:0.1.0", doc="Sidecar image (sidecar/Dockerfile).", pattern="image")
    keys_secret: str | None = field(
        None,
        doc="Secret holding the API keys: an entry per auth.api_keys[].env name, and per key file its file "
        "name (default: confgen-<name>-api-keys). The manifests only reference it; render needs no key.",
        pattern="k8s_name",
    )
    admin_token_secret: str | None = field(
        None,
        doc="Secret whose entry `token` the sidecar requires on POST /drain and /undrain; bound on the pod's "
        "address, those endpoints are off without it.",
        pattern="k8s_name",
    )
    termination_grace_seconds: int = field(
        180,
        doc="How long a stopping proxy pod drains: Envoy fails its health, drains listeners and waits "
        "for streams to finish, within this (terminationGracePeriodSeconds).",
        minimum=30,
        maximum=3600,
    )
    monitoring: bool = field(
        False,
        doc="Also render a ServiceMonitor, a PrometheusRule with confgen's alert rules and the Grafana "
        "dashboard as a ConfigMap (Prometheus Operator and Grafana sidecar conventions).",
    )
    monitoring_labels: dict[str, str] = field(
        factory=dict,
        doc="Labels added to the ServiceMonitor, PrometheusRule and dashboard ConfigMap, for the Prometheus and "
        "Grafana that select them (kube-prometheus-stack selects `release: <its release name>` by default).",
        pattern="k8s_label_value",
    )
    redis: bool = field(
        False,
        doc="Also run a Redis for limits.store: kubernetes renders a Deployment and a Service named "
        "confgen-<name>-redis (write limits.store.redis: confgen-<name>-redis:6379), compose a redis service on "
        "the host's loopback (write 127.0.0.1:<port>). Counters live one window, so it keeps no data on disk. "
        "Leave it false to point limits.store at a Redis you run.",
    )
    redis_image: str = field("redis:7.2-alpine", doc="Image of the rendered Redis.", pattern="image")
    gateway: str | None = field(
        None, doc="gateway-api target: the Gateway (in kubernetes.namespace) the rendered HTTPRoute attaches to.",
        pattern="k8s_name",
    )
    prometheus_url: str = field(
        "http://prometheus-operated.monitoring.svc:9090",
        doc="Prometheus the KEDA ScaledObjects (keda/ in the kubernetes output) query.",
        pattern="url",
    )


@dataclass(frozen=True)
class SidecarLink:
    address: str = field(
        "127.0.0.1", doc="IP address where the proxy reaches confgen-sidecar's HTTP server (its --listen)."
    )
    port: int = field(9109, doc="Port of confgen-sidecar's HTTP server.", minimum=1, maximum=65535)
    grpc_port: int = field(
        9110,
        doc="Port of confgen-sidecar's gRPC services on the same address (the endpoint picker Envoy calls for "
        "pools with policy prefix_affinity; the sidecar's --grpc-listen). With envoy.xds.mode ads the control "
        "plane serves them: Envoy calls this port on the hosts of envoy.xds.servers.",
        minimum=1,
        maximum=65535,
    )
    grpc_tls: GrpcTls | None = field(
        None,
        doc="Mutual TLS from Envoy to every gRPC surface of the sidecar: ADS (envoy.xds.mode ads), the endpoint "
        "picker, the rate limit service (the sidecar's `--grpc-tls-cert/--grpc-tls-key/--grpc-client-ca`); "
        "required when Envoy reaches them beyond loopback. Without it Envoy calls them over Unix sockets in "
        "grpc_socket_dir (only the sidecar's user can connect), or plaintext TCP on loopback when "
        "grpc_plaintext_loopback says so.",
    )
    grpc_socket_dir: str | None = field(
        None,
        doc="Without grpc_tls: the directory of the sidecar's Unix sockets (grpc.sock: picker and rate limits; "
        "xds.sock: ADS), as both Envoy and the sidecar see it. The sidecar creates it 0700 (or refuses one "
        "another user owns) and its sockets 0600: Envoy must run as the sidecar's user. Default "
        "/tmp/confgen-<name>.",
        pattern="file_path",
    )
    grpc_plaintext_loopback: bool = field(
        False,
        doc="Without grpc_tls: plaintext gRPC over TCP on loopback (sidecar.grpc_port, envoy.xds.servers) instead "
        "of the Unix sockets. Any local process can then connect, read the API keys over ADS and move the "
        "limits; the sidecar must be started with --grpc-plaintext-loopback to agree. Off by default.",
    )
    models: bool = field(
        True,
        doc="Answer GET /v1/models from the sidecar's health view: only the models with healthy capacity "
        "somewhere in their fallback chain. When the sidecar cannot be reached the proxy answers the full "
        "list from the topology.",
    )


@dataclass(frozen=True)
class Topology:
    version: int = field(doc="Format version; must be 1.", minimum=1, maximum=1)
    name: str = field(doc="Name of this deployment (Envoy node cluster).", pattern="name")
    listeners: list[Listener] = field(doc="Where clients connect.", min_items=1)
    pools: list[Pool] = field(doc="Pools of inference workers.", min_items=1)
    routes: list[Route] = field(
        factory=list, doc="Explicit routes, tried in order before the per-model routes implied by pools."
    )
    default_pool: str | None = field(
        None, doc="Pool for requests that name no model (bodies without `model`).", pattern="name"
    )
    admin: Admin = field(factory=Admin, doc="Envoy's admin interface.")
    auth: Auth | None = field(None, doc="API-key authentication at the edge.")
    limits: Limits = field(
        factory=Limits, doc="Rate limits: local token buckets, and global budgets in requests or tokens (429)."
    )
    backpressure: Backpressure = field(
        factory=Backpressure, doc="Load shedding: the proxy's safety cap and the sidecar's saturation rule."
    )
    last_resort: Canned | None = field(None, doc="Canned answer when no pool in a fallback chain is healthy.")
    models_endpoint: bool = field(True, doc="Answer GET /v1/models at the edge from the pools' models.")
    sidecar: SidecarLink = field(factory=SidecarLink, doc="Where the proxy reaches confgen-sidecar, and what it asks.")
    envoy: EnvoyOptions = field(factory=EnvoyOptions, doc="Envoy-specific output options.")
    nginx: NginxOptions = field(factory=NginxOptions, doc="Nginx-specific output options.")
    kubernetes: Kubernetes = field(factory=Kubernetes, doc="Options of the kubernetes and compose targets.")

    def critical_clients(self) -> tuple[str, ...]:
        """API-key clients whose traffic is critical on every route."""
        return tuple(k.client for k in self.auth.api_keys if k.class_ == "critical") if self.auth else ()

    def sheddable_clients(self) -> tuple[str, ...]:
        """API-key clients whose traffic is sheddable on every route that is not critical."""
        return tuple(k.client for k in self.auth.api_keys if k.class_ == "sheddable") if self.auth else ()

    def trusted_header_names(self) -> frozenset[str]:
        """Headers every listener declares set by a trusted hop (listeners[].trusted_headers): Envoy
        removes them from other peers, so no client can send them."""
        sets = [set(lst.trusted_headers.names) if lst.trusted_headers else set() for lst in self.listeners]
        return frozenset(set.intersection(*sets)) if sets else frozenset()

    def has_critical(self) -> bool:
        """Some traffic is critical: the render gives the pools a HIGH-priority circuit breaker."""
        return bool(self.critical_clients()) or any(r.class_ == "critical" for r in self.routes)

    def in_flight_cap(self, pool: Pool, ceiling: int) -> int:
        """The proxy's safety cap on requests in flight to `pool` (see `in_flight_cap`)."""
        return in_flight_cap(pool.total_capacity, self.backpressure.safety_cap, ceiling)

    def pool(self, name: str) -> Pool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)


def join_address(host: str, port: int) -> str:
    """host:port, the host in brackets when it is an IPv6 address ([::1]:8000): `split_address`'s inverse."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(text: str) -> tuple[str, int] | None:
    """Split host:port ([v6]:port for IPv6); None when it is not of that form."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            return None
    else:
        host, sep, port = text.rpartition(":")
        if not sep or ":" in host:
            return None
    if not (port.isascii() and port.isdigit()) or len(port) > 5 or not 1 <= int(port) <= 65535:
        return None
    return host, int(port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def grpc_service_hosts(topo: Topology) -> list[str]:
    """Where Envoy reaches confgen-sidecar's gRPC services (picker, rate limits), at sidecar.grpc_port:
    sidecar.address, or with envoy.xds.mode ads the control plane (the hosts of envoy.xds.servers, in order)."""
    if topo.envoy.xds.mode != "ads":
        return [topo.sidecar.address]
    hosts: list[str] = []
    for server in topo.envoy.xds.servers:
        parts = split_address(server)
        if parts is not None and parts[0] not in hosts:
            hosts.append(parts[0])
    return hosts


def is_loopback_host(host: str) -> bool:
    """A loopback IP or `localhost` (a name that may resolve elsewhere is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


MAX_SOCKET_PATH = 107  # bytes: sockaddr_un.sun_path (108) with its terminating NUL, on Linux
# A worker's DNS name stands for at most this many addresses (confgen-sidecar takes no more of one answer;
# nginx's upstream zones are sized to hold them): a headless Service of a large pool is hundreds of pods.
MAX_NAME_ADDRESSES = 1024
GRPC_SOCKET = "grpc.sock"  # the endpoint picker and the rate limit service
XDS_SOCKET = "xds.sock"  # ADS


def grpc_tls(topo: Topology) -> GrpcTls | None:
    """The one TLS block of the sidecar's gRPC surfaces: sidecar.grpc_tls, else (deprecated) envoy.xds.tls."""
    return topo.sidecar.grpc_tls or topo.envoy.xds.tls


def grpc_socket_dir(topo: Topology) -> str:
    """Where the sidecar's Unix sockets live (sidecar.grpc_socket_dir, default /tmp/confgen-<name>)."""
    return (topo.sidecar.grpc_socket_dir or f"/tmp/confgen-{topo.name}").rstrip("/")  # noqa: S108 - checked 0700


def grpc_transport(topo: Topology) -> str:
    """How Envoy reaches the sidecar's gRPC surfaces: "mtls", "unix" (the default) or "plaintext" (loopback)."""
    if grpc_tls(topo) is not None:
        return "mtls"
    return "plaintext" if topo.sidecar.grpc_plaintext_loopback else "unix"


def grpc_reachable(topo: Topology) -> bool:
    """Whether Envoy may call the sidecar's gRPC services as the topology stands: over mutual TLS, on
    the Unix socket of an ADS control plane (ADS's own check says where one cannot reach), or on
    loopback hosts only."""
    transport = grpc_transport(topo)
    if transport == "mtls" or (transport == "unix" and topo.envoy.xds.mode == "ads"):
        return True
    return all(is_loopback_host(host) for host in grpc_service_hosts(topo))


def admin_tcp(topo: Topology) -> tuple[str, int]:
    """Where a TCP admin listens (Envoy's when admin_on_tcp says so; nginx's status page always):
    admin.address and admin.port, by default 127.0.0.1:9901."""
    return (topo.admin.address or DEFAULT_ADMIN_ADDRESS, topo.admin.port or DEFAULT_ADMIN_PORT)


def admin_reach(topo: Topology) -> tuple[str, int]:
    """Where a process beside Envoy connects to its TCP admin (admin_tcp; a wildcard bind is reached on
    loopback)."""
    host, port = admin_tcp(topo)
    return ("127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host), port


def admin_on_tcp(topo: Topology) -> bool:
    """Whether Envoy's admin listens on TCP (admin.address or admin.port set, and no admin.socket) rather
    than on its Unix socket (the default)."""
    return topo.admin.socket is None and (topo.admin.address is not None or topo.admin.port is not None)


def admin_socket(topo: Topology, config_dir: str) -> str | None:
    """The Unix socket of Envoy's admin (admin.socket, else envoy-admin.sock in `config_dir`, the
    directory Envoy reads its files from); None when it listens on TCP (admin_tcp)."""
    if admin_on_tcp(topo):
        return None
    return topo.admin.socket or f"{config_dir.rstrip('/')}/{ADMIN_SOCKET}"


def admin_on_loopback(topo: Topology) -> Topology:
    """The topology with Envoy's admin on TCP at admin_tcp (127.0.0.1:9901 unless it says otherwise):
    `confgen render --admin-loopback`, for a pod whose loopback only its own containers reach."""
    address, port = admin_tcp(topo)
    return replace(topo, admin=replace(topo.admin, socket=None, address=address, port=port))


def grpc_socket(topo: Topology, name: str) -> str:
    """The path of one of the sidecar's sockets (GRPC_SOCKET, XDS_SOCKET)."""
    return f"{grpc_socket_dir(topo)}/{name}"
