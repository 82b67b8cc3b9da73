"""Pick an inference engine's load numbers out of its Prometheus metrics body.

A vLLM body is 30-50 KB of histograms; a full parse costs 6-17 ms per scrape. Only a
handful of series matter, so `extract` picks the lines of the wanted metric names in one
compiled-regex pass over the body (names match exactly: `vllm:num_requests_waiting` must
not pick up `vllm:num_requests_waiting_by_reason`), then searches and parses only those.

Errors, by design:
- `extract` returns None for engine kinds that expose no metrics ("openai": health only).
- It raises `MetricsFormatError` when the body is unusable: empty, truncated (the last
  line has no newline, so its value may be cut mid-number; OpenMetrics bodies end at
  `# EOF` instead, and one served as OpenMetrics without `# EOF` is truncated even when
  cut at a line's end), not exposition text (HTML, JSON), or missing the running/waiting
  gauges. Optional fields (KV use, prefix counters, token counter, token latency) are
  None when absent.
- It raises plain `ValueError` for an unknown engine kind (a configuration error, kept
  apart from body errors so a probe that catches MetricsFormatError does not hide it).
- Nothing else: decoding never fails (invalid UTF-8 is replaced) and a malformed line
  among the wanted ones is skipped, as if absent.

Aggregation rules:
- Series are grouped by data-parallel identity, the values of the `engine` and `dp_rank`
  labels. Groups are summed (each is a separate engine with its own queue).
- Several series within one group are views of the same engine (SGLang `tp_rank`
  replicas, a per-model breakdown): the largest is taken, never the sum.
- When some series carry a data-parallel label, series without one are aggregates
  (totals) and are ignored, so a total is never added to its parts.
- KV usage is a fraction per engine: it is averaged over groups (DP engines are
  identical replicas behind one internal balancer), not summed, and clamped to 0..1.
- Non-finite values (NaN, +Inf, -Inf) in an optional field count as absent; in the
  running/waiting gauges they make the body unusable ("invalid value +Inf for ...": the
  load is unknown, which is not the same as a missing metric). Negative gauges are
  clamped to 0.
- Renamed metrics: for each field the first name that has any series wins, so vLLM
  0.9.2-0.10 (which emit old and new names) are not double counted.
- Token latency is a (seconds, tokens) pair of cumulative counters (a histogram's `_sum`
  and `_count`): both come from the first family that has both, never one from each.
- The latency histograms kept whole (time to first token, time per output token) are
  summed bucket by bucket over data-parallel engines (the same rules per `le`), from the
  first family that has buckets, a `+Inf` bucket, a sum and a count; else None. They are
  re-exported by the sidecar per pool, model and worker (the dashboard's TTFT and TPOT).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Final, Literal

from confgen.errors import ConfgenError

__all__ = ["ENGINE_KINDS", "HistogramSample", "LoadSample", "MetricsFormatError", "extract", "has_metrics"]


class MetricsFormatError(ConfgenError, ValueError):
    """The metrics body holds no usable load numbers (empty, truncated, HTML, JSON...)."""


@dataclass(frozen=True, slots=True)
class HistogramSample:
    """A cumulative histogram as the engine reports it: (upper bound, count) per bucket in
    ascending order, +Inf last, with its sum and count (counters: they grow until a restart)."""

    buckets: tuple[tuple[float, float], ...]
    total: float
    count: float


@dataclass(frozen=True, slots=True)
class LoadSample:
    """Load of one worker (all its data-parallel engines) at one scrape.

    `generated_tokens` is a monotonic progress counter that must move on every engine
    step while requests run (stall detection relies on it): vLLM's generated-token
    counter, llama.cpp's decode-call counter. It is None for engines whose token
    counters only move when a request completes (SGLang, TGI), where a long generation
    would look like a stall.

    `token_latency_s` and `token_latency_n` are the cumulative sum (seconds) and count
    (tokens) of the engine's inter-token latency histogram: their deltas between two
    scrapes give the mean time per generated token, i.e. the worker's decode speed as a
    sequence sees it. Both None when the engine exports no such histogram.
    """

    running: float
    waiting: float
    kv_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    generated_tokens: float | None = None
    engines: int = 1
    token_latency_s: float | None = None
    token_latency_n: float | None = None
    ttft: HistogramSample | None = None  # time to first token (vLLM, SGLang)
    tpot: HistogramSample | None = None  # time per output token (inter-token latency; TGI's per-request mean)
    output_tokens: float | None = None  # generated tokens counter, for tokens/s (moves on completion for some)
    kv_blocks: float | None = None  # KV cache size in blocks (vLLM's cache_config_info num_gpu_blocks), summed
    # Cumulative counters the endpoint picker learns a worker's costs from (deltas between scrapes):
    prefill_seconds: float | None = None  # time spent prefilling (vLLM: the prefill-phase histogram's sum)
    prefill_tokens: float | None = None  # prompt tokens prefilled, the cached ones excluded
    finished: float | None = None  # requests finished (the generated-tokens-per-request histogram's count)
    finished_tokens: float | None = None  # tokens those requests generated (that histogram's sum)
    # requests that stopped at their max_tokens (vLLM: request_success_total{finished_reason="length"}):
    # against `finished`, how far a request's max_tokens says its answer's length
    finished_bounded: float | None = None


_Combine = Literal["sum", "mean"]


@dataclass(frozen=True, slots=True)
class _Field:
    names: tuple[str, ...]  # suffixes after the engine prefix; preferred (newest) first
    combine: _Combine = "sum"


@dataclass(frozen=True, slots=True)
class _Engine:
    prefixes: tuple[str, ...]  # tried in order; the first with running/waiting wins
    running: _Field
    waiting: _Field
    kv_usage: _Field | None = None
    prefix_queries: _Field | None = None
    prefix_hits: _Field | None = None
    # Prompt tokens NOT served from the cache; with no `prefix_queries` field the queries are
    # hits + misses (llama.cpp counts the two apart).
    prefix_misses: _Field | None = None
    generated_tokens: _Field | None = None
    # (sum, count) names of an inter-token latency histogram, preferred first.
    token_latency: tuple[tuple[str, str], ...] = ()
    # TGI has no KV gauge; reserved batch tokens / token budget is the closest proxy.
    kv_ratio: tuple[str, str] | None = None
    # histogram families (base names, preferred first) kept whole, and the output token counter
    ttft: tuple[str, ...] = ()
    tpot: tuple[str, ...] = ()
    output_tokens: _Field | None = None
    # (info metric, label) giving the KV cache's size in blocks (the endpoint picker sizes its index).
    kv_blocks: tuple[str, str] | None = None
    # What the picker learns costs from: seconds spent prefilling (a counter, or a histogram's
    # `_sum`), prompt tokens processed (all of them: the cached ones are subtracted when
    # `prompt_includes_cached`), and a per-request generated-tokens histogram (base name).
    prefill_seconds: _Field | None = None
    # the tokens those seconds computed, counted for the same requests (vLLM >= 0.13: recorded with the prefill
    # time as each request finishes, cached tokens excluded); when absent, `prompt_tokens` less the cache hits
    prefill_computed: _Field | None = None
    prompt_tokens: _Field | None = None
    # the load gauges appear only once the engine served a request (TGI): their absence beside the engine's
    # other series is an idle engine
    idle_unreported: bool = False
    prompt_includes_cached: bool = True
    generation_hist: tuple[str, ...] = ()
    # (counter, label, value): the requests finished because they reached their max_tokens
    bounded: tuple[str, str, str] | None = None
    # With speculative decoding (this counter present) the inter-token histogram gets one observation per
    # engine step, however many tokens the step accepted: its sum over count is a step, 2-3 tokens. The time
    # per token is then the decode seconds over the tokens after each request's first (`generation_hist`).
    speculative: _Field | None = None
    decode_seconds: _Field | None = None


_ENGINES: Final[dict[str, _Engine | None]] = {
    "vllm": _Engine(
        # "vllm_": prometheus_client mangles ':' when OpenMetrics was negotiated.
        prefixes=("vllm:", "vllm_"),
        running=_Field(("num_requests_running",)),
        waiting=_Field(("num_requests_waiting",)),
        kv_usage=_Field(("kv_cache_usage_perc", "gpu_cache_usage_perc"), "mean"),
        prefix_queries=_Field(("prefix_cache_queries_total", "gpu_prefix_cache_queries_total")),
        prefix_hits=_Field(("prefix_cache_hits_total", "gpu_prefix_cache_hits_total")),
        generated_tokens=_Field(("generation_tokens_total",)),
        # Before V1, time_per_output_token_seconds was the per-token latency histogram.
        token_latency=(
            ("inter_token_latency_seconds_sum", "inter_token_latency_seconds_count"),
            ("time_per_output_token_seconds_sum", "time_per_output_token_seconds_count"),
        ),
        ttft=("time_to_first_token_seconds",),
        tpot=("inter_token_latency_seconds", "time_per_output_token_seconds"),
        output_tokens=_Field(("generation_tokens_total",)),
        kv_blocks=("cache_config_info", "num_gpu_blocks"),
        prefill_seconds=_Field(("request_prefill_time_seconds_sum",)),
        # prompt_tokens_total moves as prompts are prefilled, the prefill time as requests finish: over a cycle
        # the two cover different requests (k 22 % high, 0.4-4.9x swings with long answers, measured in review)
        prefill_computed=_Field(("request_prefill_kv_computed_tokens_sum",)),
        prompt_tokens=_Field(("prompt_tokens_total",)),
        generation_hist=("request_generation_tokens",),
        bounded=("request_success_total", "finished_reason", "length"),
        speculative=_Field(("spec_decode_num_accepted_tokens_total",)),
        decode_seconds=_Field(("request_decode_time_seconds_sum",)),
    ),
    "sglang": _Engine(
        prefixes=("sglang:", "sglang_"),
        running=_Field(("num_running_reqs",)),
        waiting=_Field(("num_queue_reqs",)),
        kv_usage=_Field(("token_usage",), "mean"),
        token_latency=(("inter_token_latency_seconds_sum", "inter_token_latency_seconds_count"),),
        ttft=("time_to_first_token_seconds",),
        tpot=("inter_token_latency_seconds",),
        output_tokens=_Field(("generation_tokens_total",)),
    ),
    "tgi": _Engine(
        prefixes=("tgi_",),
        running=_Field(("batch_current_size",)),
        waiting=_Field(("queue_size",)),
        kv_ratio=("batch_current_max_tokens", "batch_max_total_tokens"),
        tpot=("request_mean_time_per_token_duration",),
        output_tokens=_Field(("request_generated_tokens_sum",)),
        generation_hist=("request_generated_tokens",),
        idle_unreported=True,
    ),
    # llama-server --metrics (checked against the real server, tests/realengine): busy slots
    # and deferred requests; no KV gauge at all (KV use is None); the prompt cache as tokens
    # reused (`prompt_tokens_cached_total`) beside tokens processed without the cache
    # (`prompt_tokens_total` excludes the cached ones), so queries = processed + cached.
    "llamacpp": _Engine(
        prefixes=("llamacpp:", "llamacpp_"),
        running=_Field(("requests_processing",)),
        waiting=_Field(("requests_deferred",)),
        prefix_hits=_Field(("prompt_tokens_cached_total",)),
        prefix_misses=_Field(("prompt_tokens_total",)),
        generated_tokens=_Field(("n_decode_total",)),
        # generation time over the tokens generated (both counted as each request completes): seconds a token
        token_latency=(("tokens_predicted_seconds_total", "tokens_predicted_total"),),
        output_tokens=_Field(("tokens_predicted_total",)),
        prefill_seconds=_Field(("prompt_seconds_total",)),
        prompt_tokens=_Field(("prompt_tokens_total",)),
        prompt_includes_cached=False,
    ),
    "openai": None,  # generic OpenAI-compatible server: health only
}

ENGINE_KINDS: Final[frozenset[str]] = frozenset(_ENGINES)

_DP_LABELS: Final = ("engine", "dp_rank")
_ESCAPES: Final = {"n": "\n", "\\": "\\", '"': '"'}
# A quoted label value, escapes included, matched in one pass (the unrolled loop: linear in its length; a
# value of a million escapes took 2.8 s when each escape searched on to the closing quote again).
_LABEL_VALUE: Final = re.compile(r'"([^"\\]*(?:\\.[^"\\]*)*)"', re.S)
_ESCAPE: Final = re.compile(r"\\(.)", re.S)
_MAX_LABEL_DIGITS: Final = 12  # a count in a label (vLLM's num_gpu_blocks): more digits is no count
_MAX_LOAD: Final = 1e9  # requests running or waiting on one engine: past it a report is not a load
_MAX_FIGURE: Final = 1e15  # any other figure (a counter's tokens, seconds): past it not reported


def _unescape(m: re.Match[str]) -> str:
    return _ESCAPES.get(m.group(1), "\\" + m.group(1))

_Series = tuple[dict[str, str], float]


def has_metrics(engine_kind: str) -> bool:
    """Whether `engine_kind` exposes load metrics worth fetching ("openai" does not)."""
    if engine_kind not in _ENGINES:
        raise ValueError(f"unknown engine kind {engine_kind!r}; known: {sorted(ENGINE_KINDS)}")
    return _ENGINES[engine_kind] is not None


def extract(engine_kind: str, body: bytes, *, openmetrics: bool = False) -> LoadSample | None:
    """Return the load in `body` for `engine_kind`; None for health-only kinds.

    `openmetrics`: the server said the body is OpenMetrics (its Content-Type), which must
    end with `# EOF`; without it the body is truncated, even when cut at a line's end.
    Raises MetricsFormatError for an unusable body, ValueError for an unknown kind.
    """
    if engine_kind not in _ENGINES:
        raise ValueError(f"unknown engine kind {engine_kind!r}; known: {sorted(ENGINE_KINDS)}")
    spec = _ENGINES[engine_kind]
    if spec is None:
        return None
    if not body.strip():
        raise MetricsFormatError("empty metrics body")
    raw = body.decode("utf-8", "replace")
    text, eof = _prepare(raw, _WANTED[engine_kind])
    for prefix in spec.prefixes:
        running_found = _first_named(text, prefix, spec.running)
        waiting_found = _first_named(text, prefix, spec.waiting)
        if running_found[0] or waiting_found[0]:
            break
    if openmetrics and not eof:
        raise MetricsFormatError(f"truncated OpenMetrics body: no `# EOF` ({_describe(body)})")
    if not eof and not raw.endswith("\n"):
        raise MetricsFormatError(
            f"truncated metrics body: the last line has no newline ({_describe(body)})"
        )
    for f, found in ((spec.running, running_found), (spec.waiting, waiting_found)):
        bad = _non_finite(found[0])
        if bad is not None:
            raise MetricsFormatError(f"invalid value {bad} for {prefix}{f.names[0]}: the load is unknown")
    running, waiting = _aggregate(running_found), _aggregate(waiting_found)
    for f, (value, _) in ((spec.running, running), (spec.waiting, waiting)):
        if value is not None and value > _MAX_LOAD:  # sums of these over a fleet must stay numbers
            raise MetricsFormatError(f"implausible value {value:g} for {prefix}{f.names[0]} (over {_MAX_LOAD:g} "
                                     "requests): the load is unknown")
    if (spec.idle_unreported and running[0] is None and waiting[0] is None
            and any(raw.startswith(p) or f"\n{p}" in raw for p in spec.prefixes)):
        # TGI creates its queue and batch gauges at its first request: an engine that has served none yet
        # reports its other series only. Nothing has run there: idle, not a bad scrape.
        running, waiting = (0.0, 1), (0.0, 1)
    if running[0] is None or waiting[0] is None:
        if running[0] is None and waiting[0] is None:
            prefix = spec.prefixes[0]
        missing = [
            prefix + f.names[0]
            for f, (v, _) in ((spec.running, running), (spec.waiting, waiting))
            if v is None
        ]
        raise MetricsFormatError(f"no {', '.join(missing)} in body ({_describe(body)})")

    def field(f: _Field | None) -> float | None:
        return None if f is None else _aggregate(_first_named(text, prefix, f))[0]

    kv = field(spec.kv_usage)
    if spec.kv_ratio is not None:
        used = field(_Field((spec.kv_ratio[0],)))
        total = field(_Field((spec.kv_ratio[1],)))
        kv = used / total if used is not None and total else None
    latency_s, latency_n = _token_latency(text, prefix, spec.token_latency)
    hits, queries = field(spec.prefix_hits), field(spec.prefix_queries)
    if queries is None and spec.prefix_misses is not None:
        misses = field(spec.prefix_misses)
        queries = None if misses is None or hits is None else misses + hits
    kv_blocks = None
    if spec.kv_blocks is not None:
        blocks = [labels.get(spec.kv_blocks[1], "") for labels, _ in _find_series(text, prefix + spec.kv_blocks[0])]
        numbers = [float(b) for b in blocks if b.isascii() and b.isdigit() and len(b) <= _MAX_LABEL_DIGITS]
        kv_blocks = sum(numbers) if numbers else None
    prefill_tokens = field(spec.prefill_computed)
    if prefill_tokens is None:
        prefill_tokens = field(spec.prompt_tokens)
        if prefill_tokens is not None and spec.prompt_includes_cached:
            prefill_tokens = None if hits is None else max(0.0, prefill_tokens - hits)
    finished = finished_tokens = None
    for base in spec.generation_hist:
        finished_tokens = _aggregate((_find_series(text, prefix + base + "_sum"), "sum"))[0]
        finished = _aggregate((_find_series(text, prefix + base + "_count"), "sum"))[0]
        if finished is not None and finished_tokens is not None:
            break
    if field(spec.speculative) is not None and finished is not None and finished_tokens is not None:
        decode_s = field(spec.decode_seconds)
        if decode_s is not None:  # seconds and tokens of the same finished requests, their first token excluded
            latency_s, latency_n = decode_s, max(0.0, finished_tokens - finished)
    return _finite_only(LoadSample(
        running=running[0],
        waiting=waiting[0],
        kv_usage=None if kv is None else min(kv, 1.0),
        prefix_queries=queries,
        prefix_hits=hits,
        generated_tokens=field(spec.generated_tokens),
        engines=max(running[1], 1),
        token_latency_s=latency_s,
        token_latency_n=latency_n,
        ttft=_histogram(text, prefix, spec.ttft),
        tpot=_histogram(text, prefix, spec.tpot),
        output_tokens=field(spec.output_tokens),
        kv_blocks=kv_blocks,
        prefill_seconds=field(spec.prefill_seconds),
        prefill_tokens=prefill_tokens,
        finished=finished,
        finished_tokens=finished_tokens,
        finished_bounded=_labelled(text, prefix, spec.bounded),
    ))


def _finite_only(sample: LoadSample) -> LoadSample:
    """The sample with every optional figure that is not a finite number of at most `_MAX_FIGURE` dropped
    (None: not reported). Each is finite as read; one computed from two (misses + hits past a float's range)
    may not be, a huge one summed over a fleet may overflow, and nothing downstream may see infinity
    (int(inf) and round(nan) raise)."""
    changes: dict[str, Any] = {f.name: None for f in dataclasses.fields(sample)
                               if isinstance(value := getattr(sample, f.name), float)
                               and not (math.isfinite(value) and abs(value) <= _MAX_FIGURE)}
    return dataclasses.replace(sample, **changes) if changes else sample


def _labelled(text: str, prefix: str, spec: tuple[str, str, str] | None) -> float | None:
    """The counter family's series whose label has the value, summed per the module rules; 0 when the
    family has series but none of that value yet, None when the family is absent."""
    if spec is None:
        return None
    name, label, value = spec
    series = _find_series(text, prefix + name)
    if not series:
        return None
    chosen = [(labels, v) for labels, v in series if labels.get(label) == value]
    return _aggregate((chosen, "sum"))[0] or 0.0


def _histogram(text: str, prefix: str, bases: tuple[str, ...]) -> HistogramSample | None:
    """The first family of `bases` with buckets (+Inf among them), a sum and a count, summed
    over data-parallel engines bucket by bucket; None when none is whole."""
    for base in bases:
        by_bound: dict[float, list[_Series]] = {}
        for labels, value in _find_series(text, prefix + base + "_bucket"):
            try:
                bound = float(labels.get("le", ""))
            except ValueError:
                continue
            by_bound.setdefault(bound, []).append(({k: v for k, v in labels.items() if k != "le"}, value))
        if not by_bound or math.inf not in by_bound:
            continue
        buckets = []
        for bound in sorted(by_bound):
            count = _aggregate((by_bound[bound], "sum"))[0]
            if count is not None:
                buckets.append((bound, count))
        total = _aggregate((_find_series(text, prefix + base + "_sum"), "sum"))[0]
        count = _aggregate((_find_series(text, prefix + base + "_count"), "sum"))[0]
        if total is not None and count is not None and buckets and buckets[-1][0] == math.inf:
            return HistogramSample(tuple(buckets), total, count)
    return None


def _token_latency(
    text: str, prefix: str, pairs: tuple[tuple[str, str], ...]
) -> tuple[float | None, float | None]:
    """(seconds, tokens) from the first histogram family that has both its sum and count."""
    for sum_name, count_name in pairs:
        total = _aggregate((_find_series(text, prefix + sum_name), "sum"))[0]
        if total is None:
            continue
        count = _aggregate((_find_series(text, prefix + count_name), "sum"))[0]
        if count is not None:
            return total, count
    return None, None


def _prepare(raw: str, wanted: re.Pattern[str]) -> tuple[str, bool]:
    """Return ("\\n" + the wanted lines before `# EOF`, each ending in a newline), and whether
    the body has `# EOF`.

    One regex pass picks the lines of every name any field may ask for (`_wanted_lines`),
    so the per-name searches afterwards scan a few hundred bytes, not the whole body.
    """
    lines: list[str] = []
    for line in wanted.findall("\n" + raw):
        if line.startswith("#"):  # the first `# EOF`: nothing after it counts
            return "\n" + "".join(f"{ln}\n" for ln in lines), True
        lines.append(line)
    return "\n" + "".join(f"{ln}\n" for ln in lines), False


def _wanted_lines(spec: _Engine | None) -> re.Pattern[str]:
    """A pattern matching `# EOF` and every sample line named by `spec` (any prefix, any
    name it may fall back to), without the leading newline. Names match exactly: the name
    must be followed by `{`, a space or a tab."""
    names: set[str] = set()
    if spec is not None:
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            if isinstance(value, _Field):
                names.update(value.names)
            elif f.name in ("ttft", "tpot"):
                names.update(base + suffix for base in value for suffix in ("_bucket", "_sum", "_count"))
            elif f.name == "generation_hist":
                names.update(base + suffix for base in value for suffix in ("_sum", "_count"))
            elif f.name == "bounded":
                names.update(value[:1] if value else ())
            elif f.name != "prefixes" and isinstance(value, tuple):
                names.update(_flatten(value))
    prefixes = "|".join(re.escape(p) for p in (spec.prefixes if spec is not None else ())) or "(?!)"
    alternatives = "|".join(re.escape(name) for name in sorted(names)) or "(?!)"
    return re.compile(rf"\n(# EOF(?=[\r\n ]|\Z)|(?:{prefixes})(?:{alternatives})[{{ \t][^\n]*)")


def _flatten(value: object) -> list[str]:
    """Every string in nested tuples (kv_ratio, token_latency pairs)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, tuple):
        return [name for item in value for name in _flatten(item)]
    return []


_WANTED: Final[dict[str, re.Pattern[str]]] = {kind: _wanted_lines(spec) for kind, spec in _ENGINES.items()}


def _describe(body: bytes) -> str:
    head = body.lstrip()[:1]
    if head == b"<":
        return "looks like HTML"
    if head in (b"{", b"["):
        return "looks like JSON"
    return f"{len(body)} bytes"


def _first_named(text: str, prefix: str, f: _Field) -> tuple[list[_Series], _Combine]:
    for name in f.names:
        series = _find_series(text, prefix + name)
        if series:
            return series, f.combine
    return [], f.combine


def _find_series(text: str, name: str) -> list[_Series]:
    """All samples named exactly `name`; `text` starts with and ends in a newline."""
    needle = "\n" + name
    skip = len(needle)
    found: list[_Series] = []
    at = text.find(needle)
    while at != -1:
        after = at + skip
        if text[after] not in "{ \t":  # a longer name sharing this prefix, or a newline
            at = text.find(needle, after)
            continue
        end = text.find("\n", after)  # never -1: text ends in a newline
        parsed = _parse_after_name(text[after:end])
        if parsed is not None:
            found.append(parsed)
        at = text.find(needle, end)
    return found


def _parse_after_name(rest: str) -> _Series | None:
    """Parse `{labels} value [timestamp] [# exemplar]`; None when malformed."""
    labels: dict[str, str] = {}
    i = 0
    if rest.startswith("{"):
        parsed = _parse_labels(rest)
        if parsed is None:
            return None
        labels, i = parsed
    fields = rest[i:].split(None, 1)
    if not fields:
        return None
    try:
        return labels, float(fields[0])
    except ValueError:
        return None


def _parse_labels(s: str) -> tuple[dict[str, str], int] | None:
    """Parse `{a="x",b="y\\"z"}` from s[0]; return the labels and the index after `}`."""
    labels: dict[str, str] = {}
    n = len(s)
    i = 1
    while True:
        while i < n and s[i] in " \t":
            i += 1
        if i >= n:
            return None
        if s[i] == "}":
            return labels, i + 1
        eq = s.find("=", i)
        if eq == -1:
            return None
        key = s[i:eq].strip()
        i = eq + 1
        while i < n and s[i] in " \t":
            i += 1
        if i >= n or s[i] != '"':
            return None
        value = _LABEL_VALUE.match(s, i)  # a quoted value may hold `}`, `,`, spaces and escapes
        if value is None:
            return None
        raw = value.group(1)
        labels[key] = _ESCAPE.sub(_unescape, raw) if "\\" in raw else raw
        i = value.end()
        while i < n and s[i] in " \t":
            i += 1
        if i < n and s[i] == ",":
            i += 1


def _counted(series: list[_Series]) -> list[_Series]:
    """The series that count: all, or only per-engine ones when some carry a DP label."""
    has_dp = any(label in labels for labels, _ in series for label in _DP_LABELS)
    if not has_dp:
        return series
    return [(labels, value) for labels, value in series if any(labels.get(label) for label in _DP_LABELS)]


def _non_finite(series: list[_Series]) -> str | None:
    """The first NaN/+Inf/-Inf among the series that count, as exposition text; None if none."""
    for _, value in _counted(series):
        if not math.isfinite(value):
            return "NaN" if math.isnan(value) else "+Inf" if value > 0 else "-Inf"
    return None


def _aggregate(found: tuple[list[_Series], _Combine]) -> tuple[float | None, int]:
    """Combine series per the module rules; return (value or None, engine groups)."""
    series, combine = found
    has_dp = any(label in labels for labels, _ in series for label in _DP_LABELS)
    groups: dict[tuple[str, ...], float] = {}
    for labels, value in series:
        if not math.isfinite(value):
            continue
        key = tuple(labels.get(label, "") for label in _DP_LABELS)
        if has_dp and not any(key):
            continue  # a total next to per-engine series
        value = max(value, 0.0)
        groups[key] = max(groups.get(key, value), value)
    if not groups:
        return None, 0
    total = sum(groups.values())
    if not math.isfinite(total):  # finite parts past a float's range together (1e308 + 1e308): not a figure
        return None, 0
    return (total / len(groups) if combine == "mean" else total), len(groups)
