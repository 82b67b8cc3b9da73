"""Deterministic generator of the metrics bodies in tests/sidecar/fixtures/.

Run `python tests/sidecar/sidecar_fixtures.py` to rewrite the files; a test checks the
committed files still equal what this produces. `EXPECTED` holds, per fixture, the load
numbers a correct extraction must find (worked out by hand from the values below).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# Bucket boundaries in the shape vLLM uses.
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
       10.0, 20.0, 40.0, 80.0]
E2E = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
       120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKENS = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
          10000.0, 20000.0, 50000.0, 100000.0, 131072.0]


def _fmt(v: float) -> str:
    return repr(float(v))


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    inner = ",".join(f'{k}="{esc(v)}"' for k, v in pairs)
    return "{" + inner + "}" if inner else ""


class Body:
    """A small exposition writer (text 0.0.4, or OpenMetrics with `om=True`)."""

    def __init__(self, om: bool = False) -> None:
        self.lines: list[str] = []
        self.om = om

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: Iterable[tuple[str, str]], value: float | str,
               tail: str = "") -> None:
        v = value if isinstance(value, str) else _fmt(value)
        self.lines.append(f"{name}{_labels(labels)} {v}{tail}")

    def histogram(self, name: str, help_text: str, buckets: list[float],
                  per_engine: list[list[tuple[str, str]]], rng: random.Random) -> None:
        self.family(name, "histogram", help_text)
        for labels in per_engine:
            count = 0
            total = 0.0
            for le in buckets:
                count += rng.randrange(0, 400)
                total += le * rng.randrange(0, 50)
                self.sample(f"{name}_bucket", [*labels, ("le", str(le))], count)
            count += rng.randrange(0, 10)
            self.sample(f"{name}_bucket", [*labels, ("le", "+Inf")], count)
            self.sample(f"{name}_count", labels, count)
            self.sample(f"{name}_sum", labels, round(total, 3))
        if not self.om:
            self.family(f"{name}_created", "gauge", help_text)
            for labels in per_engine:
                self.sample(f"{name}_created", labels, 1.7321e9)

    def counter(self, name: str, help_text: str, per_engine: list[list[tuple[str, str]]],
                values: list[float], exemplar: str = "") -> None:
        """`name` ends in _total; OpenMetrics names the family without it."""
        family = name.removesuffix("_total") if self.om else name
        self.family(family, "counter", help_text)
        created = name.removesuffix("_total") + "_created"
        for labels, value in zip(per_engine, values, strict=True):
            self.sample(name, labels, value, exemplar)
            if self.om:  # OpenMetrics keeps each label set's samples together
                self.sample(created, labels, 1.7321e9)
        if not self.om:
            self.family(created, "gauge", help_text)
            for labels in per_engine:
                self.sample(created, labels, 1.7321e9)

    def gauge(self, name: str, help_text: str, per_engine: list[list[tuple[str, str]]],
              values: list[float | str], tail: str = "") -> None:
        self.family(name, "gauge", help_text)
        for labels, value in zip(per_engine, values, strict=True):
            self.sample(name, labels, value, tail)

    def text(self) -> str:
        return "\n".join(self.lines) + ("\n# EOF\n" if self.om else "\n")


def _process_metrics(b: Body) -> None:
    """What prometheus_client's default registry adds to every Python server."""
    b.family("python_gc_objects_collected_total", "counter", "Objects collected during gc")
    for gen, v in (("0", 18231.0), ("1", 4122.0), ("2", 921.0)):
        b.sample("python_gc_objects_collected_total", [("generation", gen)], v)
    b.family("python_info", "gauge", "Python platform information")
    b.sample("python_info", [("implementation", "CPython"), ("major", "3"), ("minor", "12"),
                             ("patchlevel", "8"), ("version", "3.12.8")], 1.0)
    b.family("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.")
    b.sample("process_resident_memory_bytes", [], 4.81234e9)
    b.family("process_open_fds", "gauge", "Number of open file descriptors.")
    b.sample("process_open_fds", [], 87.0)


def vllm_v1(engines: list[dict[str, float]], *, om: bool = False, old_names: bool = False,
            new_names: bool = True, model: str = MODEL, seed: int = 1) -> str:
    """A vLLM V1 body; one dict of wanted values per data-parallel engine."""
    rng = random.Random(seed)
    b = Body(om=om)
    if not om:
        _process_metrics(b)
    per = [[("engine", str(i)), ("model_name", model)] for i in range(len(engines))]
    ex = ' # {trace_id="4bf92f3577b34da6"} 1.0 1732870000.5' if om else ""
    b.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
            per, [e["running"] for e in engines])
    # The by-reason gauge comes first: its name starts with the plain waiting gauge's.
    b.gauge("vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.",
            [[*p, ("reason", r)] for p in per for r in ("capacity", "deferred")],
            [v for e in engines for v in (e["waiting"] + 40.0, 7.0)])
    b.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            per, [e["waiting"] for e in engines])
    b.gauge("vllm:engine_sleep_state", "Engine sleep state",
            [[*p, ("sleep_state", s)] for p in per for s in ("awake", "weights_offloaded")],
            [v for _ in engines for v in (1.0, 0.0)])
    if new_names:
        b.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                per, [e["kv"] for e in engines])
    if old_names:
        b.gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
                per, [e["kv"] for e in engines])
    if new_names:
        b.counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of tokens.",
                  per, [e["queries"] for e in engines])
        b.counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of tokens.",
                  per, [e["hits"] for e in engines])
    if old_names:
        b.counter("vllm:gpu_prefix_cache_queries_total", "GPU prefix cache queries.",
                  per, [e["queries"] for e in engines])
        b.counter("vllm:gpu_prefix_cache_hits_total", "GPU prefix cache hits.",
                  per, [e["hits"] for e in engines])
    b.counter("vllm:num_preemptions_total", "Cumulative number of preemption.", per,
              [float(rng.randrange(0, 50)) for _ in engines])
    b.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", per,
              [float(rng.randrange(10**6, 10**8)) for _ in engines], ex)
    b.counter("vllm:generation_tokens_total", "Number of generation tokens processed.", per,
              [e["tokens"] for e in engines], ex)
    for name, help_text, buckets in (
        ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
         TOKENS),
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         TTFT),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
         ITL),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
         E2E),
        ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase.", E2E),
        ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase.",
         E2E),
        ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase.",
         E2E),
        ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase.", E2E),
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKENS),
        ("vllm:request_generation_tokens", "Number of generation tokens processed.", TOKENS),
    ):
        b.histogram(name, help_text, buckets, per, rng)
    b.gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            [[("block_size", "16"), ("cache_dtype", "auto"), ("enable_prefix_caching", "True"),
              ("engine", str(i)), ("gpu_memory_utilization", "0.9"),
              ("num_gpu_blocks", "27169"), ("swap_space_bytes", "4294967296")]
             for i in range(len(engines))], [1.0] * len(engines))
    return b.text()


def vllm_v0_like() -> str:
    """vLLM up to 0.9.1 (V0 engine): old names only, no `engine` label, swapped gauge."""
    b = Body()
    _process_metrics(b)
    per = [[("model_name", MODEL)]]
    b.gauge("vllm:num_requests_running", "Number of requests running.", per, [4.0])
    b.gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", per, [0.0])
    b.gauge("vllm:num_requests_waiting", "Number of requests waiting.", per, [2.0])
    b.gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage.", per, [0.52])
    b.gauge("vllm:cpu_cache_usage_perc", "CPU KV-cache usage.", per, [0.0])
    b.gauge("vllm:gpu_prefix_cache_hit_rate", "GPU prefix cache block hit rate.", per, [-1.0])
    b.counter("vllm:generation_tokens_total", "Number of generation tokens processed.", per,
              [918273.0])
    b.histogram("vllm:time_to_first_token_seconds", "TTFT.", TTFT, per, random.Random(3))
    return b.text()


def sglang(prefix: str, dp: int, tp: int) -> str:
    """SGLang with `tp` tensor-parallel replicas of each of `dp` data-parallel engines."""
    rng = random.Random(7)
    b = Body()
    _process_metrics(b)
    model = "Qwen/Qwen2.5-7B-Instruct"

    def labels(d: int, t: int) -> list[tuple[str, str]]:
        out = [("model_name", model), ("tp_rank", str(t))]
        return [*out, ("dp_rank", str(d))] if dp > 1 else out

    per = [labels(d, t) for d in range(dp) for t in range(tp)]
    running = [5.0, 7.0, 3.0, 1.0]
    waiting = [1.0, 2.0, 0.0, 0.0]
    usage = [0.3, 0.5, 0.2, 0.1]
    for name, vals in (("num_running_reqs", running), ("num_queue_reqs", waiting),
                       ("token_usage", usage)):
        b.gauge(prefix + name, f"The {name}.", per, [vals[d] for d in range(dp) for _ in range(tp)])
    b.gauge(prefix + "num_used_tokens", "The number of used tokens.", per,
            [float(rng.randrange(1000, 90000)) for _ in per])
    b.gauge(prefix + "gen_throughput", "The generation throughput (token/s).", per,
            [round(rng.uniform(100, 900), 2) for _ in per])
    b.gauge(prefix + "cache_hit_rate", "The prefix cache hit rate.", per,
            [round(rng.uniform(0, 1), 4) for _ in per])
    b.counter(prefix + "generation_tokens_total", "Number of generation tokens processed.",
              [[("model_name", model)]], [812345.0])
    b.histogram(prefix + "time_to_first_token_seconds", "Histogram of TTFT.", TTFT,
                [[("model_name", model)]], rng)
    return b.text()


def tgi() -> str:
    """Text Generation Inference: unlabelled gauges, counters without _total."""
    lines = [
        "# TYPE tgi_request_count counter", "tgi_request_count 18423",
        "# TYPE tgi_request_success counter", "tgi_request_success 18390",
        "# TYPE tgi_request_failure counter",
        'tgi_request_failure{err="validation"} 31', 'tgi_request_failure{err="overloaded"} 2',
        "# TYPE tgi_queue_size gauge", "tgi_queue_size 4",
        "# TYPE tgi_batch_current_size gauge", "tgi_batch_current_size 16",
        "# TYPE tgi_batch_current_max_tokens gauge", "tgi_batch_current_max_tokens 12000",
        "# TYPE tgi_batch_max_total_tokens gauge", "tgi_batch_max_total_tokens 40000",
        "# TYPE tgi_request_generated_tokens histogram",
    ]
    count = 0
    for le in TOKENS:
        count += 97
        lines.append(f'tgi_request_generated_tokens_bucket{{le="{le}"}} {count}')
    lines += [f'tgi_request_generated_tokens_bucket{{le="+Inf"}} {count}',
              "tgi_request_generated_tokens_sum 3912871",
              f"tgi_request_generated_tokens_count {count}"]
    return "\n".join(lines) + "\n"


def llamacpp() -> str:
    """llama-server with --metrics, names, help, types and order as the real server prints them
    (tests/realengine/test_exposition.py diffs them against the built binary): no KV gauge,
    `n_busy_slots_per_decode` a gauge, large values in exponent form."""
    rows = [
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed, excluding cached tokens",
         "1.92837e+07"),
        ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache", "8.1163e+06"),
        ("prompt_seconds_total", "counter", "Total time spent processing prompts", "3841.21"),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed", "4.81234e+06"),
        ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens", "98123.5"),
        ("n_decode_total", "counter",
         "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
         "1.23457e+06"),
        ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)", "8190"),
        ("spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft tokens generated", "0"),
        ("spec_decode_num_accepted_tokens_total", "counter",
         "Speculative: Total draft tokens accepted by the target model", "0"),
        ("spec_decode_num_drafts_total", "counter", "Speculative: Total speculative decoding verification steps",
         "0"),
        ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s", "5012.3"),
        ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s", "48.2"),
        ("requests_processing", "gauge", "Number of requests processing", "3"),
        ("requests_deferred", "gauge", "Number of requests deferred", "2"),
        ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call", "3.21"),
    ]  # fmt: skip
    out = []
    for name, kind, help_text, value in rows:
        out += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {value}"]
    return "\n".join(out) + "\n"


def tricky_labels() -> str:
    """Escapes, `}`, `,`, `=`, spaces and `#` inside label values; timestamps; NaN/Inf."""
    model = 'org/m "quoted" {x} a,b=c # not a comment\\path\nline2'
    body = vllm_v1([dict(running=6.0, waiting=2.0, kv=0.25, queries=1000.0, hits=250.0,
                         tokens=5.5e6)], model=model, seed=11)
    extra = (
        "# TYPE vllm:spec_decode_draft_acceptance_rate gauge\n"
        'vllm:spec_decode_draft_acceptance_rate{engine="0",model_name="x"} NaN\n'
        '# TYPE vllm:lora_requests_info gauge\n'
        'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",'
        'waiting_lora_adapters="a, b"} 1.7321e+09\n'
        "# TYPE vllm:unbounded gauge\n"
        'vllm:unbounded{engine="0"} +Inf\nvllm:unbounded{engine="1"} -Inf\n'
    )
    # Add a millisecond timestamp to every wanted gauge line (text format allows it).
    lines = [line + " 1732870000123" if line.startswith(("vllm:num_requests_running{",
                                                        "vllm:num_requests_waiting{"))
             else line for line in body.splitlines()]
    return "\n".join(lines) + "\n" + extra


DP2 = [dict(running=12.0, waiting=3.0, kv=0.41, queries=182340.0, hits=91200.0,
            tokens=4812340.0),
       dict(running=9.0, waiting=0.0, kv=0.27, queries=100000.0, hits=50000.0,
            tokens=3187660.0)]
ONE = [dict(running=5.0, waiting=1.0, kv=0.3, queries=20000.0, hits=5000.0, tokens=123456.0)]

HTML = ("<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head>\n"
        "<body><center><h1>502 Bad Gateway</h1></center><hr><center>nginx</center>\n"
        "</body></html>\n")
JSON = '{"object":"error","message":"Not Found","type":"NotFoundError","code":404}'

_ONLY_PROCESS = Body()
_process_metrics(_ONLY_PROCESS)


def _truncated() -> str:
    body = vllm_v1(ONE, seed=5)
    cut = body.index("vllm:num_requests_waiting{") + 60
    return body[:cut]


GENERATORS: dict[str, Callable[[], str]] = {
    "vllm_v1_dp2.prom": lambda: vllm_v1(DP2),
    "vllm_0.9.1_old_names.prom": lambda: vllm_v1(ONE, old_names=True, new_names=False, seed=2),
    "vllm_0.10_both_names.prom": lambda: vllm_v1(ONE, old_names=True, seed=3),
    "vllm_v0.prom": vllm_v0_like,
    "vllm_v1_openmetrics.txt": lambda: vllm_v1(DP2, om=True, seed=4),
    "vllm_tricky_labels.prom": tricky_labels,
    "sglang_tp2_dp2.prom": lambda: sglang("sglang:", dp=2, tp=2),
    "sglang_underscore_tp4.prom": lambda: sglang("sglang_", dp=1, tp=4),
    "tgi.prom": tgi,
    "llamacpp.prom": llamacpp,
    "bad_empty.prom": lambda: "",
    "bad_html.prom": lambda: HTML,
    "bad_json.prom": lambda: JSON,
    "bad_truncated.prom": _truncated,
    "bad_no_engine_metrics.prom": _ONLY_PROCESS.text,
}

# fixture -> (engine kind, running, waiting, kv, prefix queries, prefix hits, tokens, engines)
Expected = tuple[str, float, float, float | None, float | None, float | None, float | None, int]
EXPECTED: dict[str, Expected] = {
    "vllm_v1_dp2.prom": ("vllm", 21.0, 3.0, 0.34, 282340.0, 141200.0, 8.0e6, 2),
    "vllm_0.9.1_old_names.prom": ("vllm", 5.0, 1.0, 0.3, 20000.0, 5000.0, 123456.0, 1),
    "vllm_0.10_both_names.prom": ("vllm", 5.0, 1.0, 0.3, 20000.0, 5000.0, 123456.0, 1),
    "vllm_v0.prom": ("vllm", 4.0, 2.0, 0.52, None, None, 918273.0, 1),
    "vllm_v1_openmetrics.txt": ("vllm", 21.0, 3.0, 0.34, 282340.0, 141200.0, 8.0e6, 2),
    "vllm_tricky_labels.prom": ("vllm", 6.0, 2.0, 0.25, 1000.0, 250.0, 5.5e6, 1),
    "sglang_tp2_dp2.prom": ("sglang", 12.0, 3.0, 0.4, None, None, None, 2),
    "sglang_underscore_tp4.prom": ("sglang", 5.0, 1.0, 0.3, None, None, None, 1),
    "tgi.prom": ("tgi", 16.0, 4.0, 0.3, None, None, None, 1),
    "llamacpp.prom": ("llamacpp", 3.0, 2.0, None, 1.92837e7 + 8.1163e6, 8.1163e6, 1.23457e6, 1),
}
BAD = ["bad_empty.prom", "bad_html.prom", "bad_json.prom", "bad_truncated.prom",
       "bad_no_engine_metrics.prom"]


def main(argv: list[str]) -> int:
    FIXTURES.mkdir(exist_ok=True)
    for name, make in GENERATORS.items():
        (FIXTURES / name).write_bytes(make().encode())
    print(f"wrote {len(GENERATORS)} fixtures to {FIXTURES}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
