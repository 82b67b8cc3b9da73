"""Metric extraction from engine bodies: per engine, malformed bodies, exact names, DP sums."""

from __future__ import annotations

import math
import random
import re

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as om_families,
)
from prometheus_client.parser import text_string_to_metric_families

from sidecar.observe.engines import ENGINE_KINDS, LoadSample, MetricsFormatError, extract
from tests.sidecar.sidecar_fixtures import BAD, EXPECTED, FIXTURES, GENERATORS


def _body(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def test_committed_fixtures_match_generator() -> None:
    """The committed fixture files are exactly what the generator script produces."""
    for name, make in GENERATORS.items():
        assert _body(name) == make().encode(), f"{name}: rerun tests/sidecar/sidecar_fixtures.py"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_extract_each_fixture(name: str) -> None:
    """Each engine's fixture yields the hand-computed sums (DP summed, renames not doubled)."""
    kind, running, waiting, kv, queries, hits, tokens, engines = EXPECTED[name]
    sample = extract(kind, _body(name))
    assert sample is not None
    assert sample.running == running
    assert sample.waiting == waiting
    assert sample.engines == engines
    for got, want in ((sample.kv_usage, kv), (sample.prefix_queries, queries),
                      (sample.prefix_hits, hits), (sample.generated_tokens, tokens)):
        if want is None:
            assert got is None
        else:
            assert got == pytest.approx(want)


def _reference(name: str) -> tuple[float, float, int]:
    """Running/waiting/engine count via prometheus_client's full parser (independent parse)."""
    kind = EXPECTED[name][0]
    text = _body(name).decode()
    families = om_families(text) if name.endswith(".txt") else text_string_to_metric_families(text)
    wanted = {
        "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
        "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
        "tgi": ("tgi_batch_current_size", "tgi_queue_size"),
        "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
    }[kind]
    if name.startswith("sglang_underscore"):
        wanted = ("sglang_num_running_reqs", "sglang_num_queue_reqs")
    per_engine: dict[str, dict[str, float]] = {w: {} for w in wanted}
    for family in families:
        for s in family.samples:
            if s.name in wanted:
                key = s.labels.get("engine", "") + "/" + s.labels.get("dp_rank", "")
                prev = per_engine[s.name].get(key, s.value)
                per_engine[s.name][key] = max(prev, s.value)  # tp replicas: one value
    running, waiting = (per_engine[w] for w in wanted)
    return sum(running.values()), sum(waiting.values()), len(running)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_extract_agrees_with_prometheus_client(name: str) -> None:
    """The line-picking scanner finds the same series and values as a full parse."""
    running, waiting, engines = _reference(name)
    sample = extract(EXPECTED[name][0], _body(name))
    assert sample is not None
    assert (sample.running, sample.waiting, sample.engines) == (running, waiting, engines)


@pytest.mark.parametrize("name", BAD)
@pytest.mark.parametrize("kind", ["vllm", "sglang", "tgi", "llamacpp"])
def test_malformed_bodies_raise_metrics_format_error(name: str, kind: str) -> None:
    """Empty, HTML, JSON, truncated and foreign bodies raise MetricsFormatError, nothing else."""
    with pytest.raises(MetricsFormatError):
        extract(kind, _body(name))


def test_truncated_body_is_reported_as_truncated() -> None:
    """A body whose last line lacks its newline is refused: the value may be cut mid-number."""
    body = _body("vllm_0.9.1_old_names.prom")
    cut = body.index(b"vllm:num_requests_running{") + 200
    cut = body.index(b"\n", cut) - 1  # inside the digits of some later line
    with pytest.raises(MetricsFormatError, match="truncated"):
        extract("vllm", body[:cut])


def test_error_messages_name_html_and_json() -> None:
    """The error says what the body looked like, for the operator reading the log."""
    with pytest.raises(MetricsFormatError, match="HTML"):
        extract("vllm", _body("bad_html.prom"))
    with pytest.raises(MetricsFormatError, match=r"JSON.*|.*JSON"):
        extract("vllm", _body("bad_json.prom") + b"\n")


def test_openai_kind_is_health_only() -> None:
    """The generic OpenAI kind has no metrics: extract returns None whatever the body."""
    assert extract("openai", b"") is None
    assert extract("openai", _body("vllm_v1_dp2.prom")) is None


def test_unknown_kind_is_a_value_error_not_a_body_error() -> None:
    """A misconfigured engine kind raises ValueError, distinct from MetricsFormatError."""
    with pytest.raises(ValueError, match="unknown engine kind") as info:
        extract("triton", b"x 1\n")
    assert not isinstance(info.value, MetricsFormatError)
    assert {"vllm", "sglang", "tgi", "llamacpp", "openai"} == ENGINE_KINDS


def test_names_match_exactly_not_by_prefix() -> None:
    """`..._waiting_by_reason` and `..._waiting_created` never count as `..._waiting`."""
    body = (b"vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 40\n"
            b"vllm:num_requests_waitingX 99\n"
            b"vllm:num_requests_running 1\n"
            b"vllm:num_requests_waiting 2\n")
    sample = extract("vllm", body)
    assert sample is not None and sample.waiting == 2.0
    with pytest.raises(MetricsFormatError, match="num_requests_waiting"):
        extract("vllm", body.replace(b"vllm:num_requests_waiting 2\n", b""))


def test_data_parallel_engines_are_summed_and_totals_ignored() -> None:
    """Per-engine series are summed; an unlabelled total beside them is not added again."""
    body = (b'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
            b'vllm:num_requests_running{engine="1",model_name="m"} 4\n'
            b'vllm:num_requests_running{model_name="m"} 7\n'
            b'vllm:num_requests_waiting{engine="0",model_name="m"} 1\n'
            b'vllm:num_requests_waiting{engine="1",model_name="m"} 2\n'
            b'vllm:kv_cache_usage_perc{engine="0"} 0.9\n'
            b'vllm:kv_cache_usage_perc{engine="1"} 0.5\n')
    assert extract("vllm", body) == LoadSample(running=7.0, waiting=3.0, kv_usage=0.7,
                                               engines=2)


def test_sglang_tp_ranks_are_one_engine_dp_ranks_are_many() -> None:
    """SGLang tp_rank series are replicas (largest taken); dp_rank series are summed."""
    body = (b'sglang:num_running_reqs{tp_rank="0",dp_rank="0"} 4\n'
            b'sglang:num_running_reqs{tp_rank="1",dp_rank="0"} 5\n'
            b'sglang:num_running_reqs{tp_rank="0",dp_rank="1"} 2\n'
            b'sglang:num_running_reqs{tp_rank="1",dp_rank="1"} 2\n'
            b'sglang:num_queue_reqs{tp_rank="0",dp_rank="0"} 1\n'
            b'sglang:num_queue_reqs{tp_rank="1",dp_rank="0"} 1\n')
    sample = extract("sglang", body)
    assert sample is not None
    assert (sample.running, sample.waiting, sample.engines) == (7.0, 1.0, 2)


def test_label_values_with_escapes_braces_and_spaces() -> None:
    """Quoted label values may hold \\\\, \\", \\n, `}`, `,`, `=` and spaces."""
    body = (b'vllm:num_requests_running{model_name="a\\"} b\\\\",engine="1",x="p q} 9"} 5 17\n'
            b'vllm:num_requests_waiting{engine="1" , model_name="x\\ny"} 1e+01\n')
    sample = extract("vllm", body)
    assert sample is not None
    assert (sample.running, sample.waiting, sample.engines) == (5.0, 10.0, 1)


def test_special_values_exponents_timestamps() -> None:
    """NaN/±Inf in an optional field count as absent; exponent values and timestamps parse;
    a non-finite total next to per-engine series is ignored like any total."""
    body = (b'vllm:num_requests_running NaN\n'
            b'vllm:num_requests_running{engine="1"} 4.5e+00 1732870000123\n'
            b'vllm:num_requests_waiting{engine="1"} 0\n'
            b'vllm:generation_tokens_total{engine="0"} 4.81234e+06\n'
            b'vllm:generation_tokens_total{engine="1"} -Inf\n')
    assert extract("vllm", body) == LoadSample(running=4.5, waiting=0.0,
                                               generated_tokens=4.81234e6, engines=1, output_tokens=4.81234e6)


@pytest.mark.parametrize("value", ["+Inf", "-Inf", "NaN"])
def test_non_finite_load_gauges_are_invalid_values_not_missing(value: str) -> None:
    """running/waiting at ±Inf or NaN (all engines or one of several) is reported as an
    invalid value naming the gauge, never as a missing metric: the load is unknown."""
    alone = f"vllm:num_requests_running {value}\nvllm:num_requests_waiting 1\n".encode()
    with pytest.raises(MetricsFormatError, match=re.escape(f"invalid value {value} for vllm:num_requests_running")
                       ) as info:
        extract("vllm", alone)
    assert "no " not in str(info.value)
    one_of_two = (f'vllm:num_requests_running{{engine="0"}} 1\nvllm:num_requests_running{{engine="1"}} 2\n'
                  f'vllm:num_requests_waiting{{engine="0"}} 0\nvllm:num_requests_waiting{{engine="1"}} {value}\n')
    with pytest.raises(MetricsFormatError, match=re.escape(f"invalid value {value} for vllm:num_requests_waiting")):
        extract("vllm", one_of_two.encode())


def test_openmetrics_without_eof_is_truncated() -> None:
    """Served as OpenMetrics, a body cut at a line's end (no `# EOF`) is truncated; the same
    body as Prometheus text is complete, and with `# EOF` OpenMetrics is complete."""
    body = b"vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"
    with pytest.raises(MetricsFormatError, match="truncated OpenMetrics body"):
        extract("vllm", body, openmetrics=True)
    assert extract("vllm", body) == LoadSample(running=2.0, waiting=1.0)
    assert extract("vllm", body + b"# EOF\n", openmetrics=True) == LoadSample(running=2.0, waiting=1.0)


def test_openmetrics_eof_and_exemplars() -> None:
    """OpenMetrics: exemplars are ignored, nothing after `# EOF` counts, no final newline needed."""
    body = (b'vllm:num_requests_running 2\n'
            b'vllm:num_requests_waiting 1\n'
            b'vllm:generation_tokens_total 10 # {trace_id="a b}"} 1.0 1.5\n'
            b'# EOF')
    assert extract("vllm", body) == LoadSample(running=2.0, waiting=1.0, generated_tokens=10.0, output_tokens=10.0)
    after = body + b"\nvllm:num_requests_waiting 50\n"
    assert extract("vllm", after) == LoadSample(running=2.0, waiting=1.0, generated_tokens=10.0, output_tokens=10.0)


def test_openmetrics_mangled_names_fall_back() -> None:
    """A body with ':' mangled to '_' (OpenMetrics negotiated by mistake) still extracts."""
    body = b"vllm_num_requests_running 2\nvllm_num_requests_waiting 1\n# EOF\n"
    assert extract("vllm", body) == LoadSample(running=2.0, waiting=1.0)


def test_crlf_line_endings() -> None:
    """Windows line endings do not break value parsing."""
    body = b"llamacpp:requests_processing 3\r\nllamacpp:requests_deferred 1\r\n"
    assert extract("llamacpp", body) == LoadSample(running=3.0, waiting=1.0)


def test_mutated_bodies_only_raise_metrics_format_error() -> None:
    """Random corruption of real bodies never raises anything but MetricsFormatError."""
    rng = random.Random(42)
    sources = [(EXPECTED[n][0], _body(n)) for n in sorted(EXPECTED)]
    junk = [b"\xff", b"{", b"}", b'"', b"\\", b"\n", b" ", b"#", b"=", b",", b"\x00", b"e+"]
    for _ in range(400):
        kind, body = rng.choice(sources)
        data = bytearray(body)
        for _ in range(rng.randrange(1, 20)):
            pos = rng.randrange(len(data))
            data[pos:pos + rng.randrange(0, 3)] = rng.choice(junk)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        try:
            sample = extract(kind, bytes(data))
        except MetricsFormatError:
            continue
        assert sample is not None
        for value in (sample.running, sample.waiting):
            assert math.isfinite(value) and value >= 0
        assert sample.kv_usage is None or 0.0 <= sample.kv_usage <= 1.0


def test_token_latency_is_the_itl_histograms_sum_and_count() -> None:
    """The inter-token latency histogram's _sum/_count are picked by exact name (not a
    _bucket line, not another histogram), summed over data-parallel engines; an engine
    without a per-token sum (TGI: a per-request mean) reports None for both. llama.cpp's are its generation
    seconds and tokens (found by review: without them a llama.cpp pool was never predicted)."""
    sample = extract("vllm", _body("vllm_v1_dp2.prom"))
    assert sample is not None
    assert sample.token_latency_s == pytest.approx(2042.015 + 3582.525)
    assert sample.token_latency_n == 3645.0 + 3749.0
    tgi = extract("tgi", _body("tgi.prom"))
    assert tgi is not None and tgi.token_latency_s is None and tgi.token_latency_n is None
    llama = extract("llamacpp", _body("llamacpp.prom"))
    assert llama is not None and (llama.token_latency_s, llama.token_latency_n) == (98123.5, 4.81234e+06)


def test_token_latency_sum_and_count_come_from_one_family() -> None:
    """vLLM 0.9.x-0.10 print the deprecated per-token histogram next to the new one: the
    new family wins for both halves; a family with only a _sum is not paired with another
    family's _count; the pre-V1 name is used when it is the only one."""
    new = ('vllm:inter_token_latency_seconds_sum{engine="0"} 2.0\n'
           'vllm:inter_token_latency_seconds_count{engine="0"} 40.0\n')
    old = ('vllm:time_per_output_token_seconds_sum{engine="0"} 9.0\n'
           'vllm:time_per_output_token_seconds_count{engine="0"} 10.0\n')
    gauges = 'vllm:num_requests_running{engine="0"} 1.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'

    def latency(text: str) -> tuple[float | None, float | None]:
        sample = extract("vllm", (gauges + text).encode())
        assert sample is not None
        return sample.token_latency_s, sample.token_latency_n

    assert latency(old + new) == (2.0, 40.0)
    assert latency(old) == (9.0, 10.0)
    assert latency(new.splitlines(keepends=True)[0] + old) == (9.0, 10.0)
    assert latency(new.splitlines(keepends=True)[0]) == (None, None)


@pytest.mark.parametrize(("name", "family"), [("vllm_v1_dp2.prom", "vllm:time_to_first_token_seconds"),
                                              ("vllm_v1_dp2.prom", "vllm:inter_token_latency_seconds"),
                                              ("sglang_tp2_dp2.prom", "sglang:time_to_first_token_seconds"),
                                              ("vllm_v0.prom", "vllm:time_to_first_token_seconds")])
def test_latency_histograms_match_prometheus_clients_parse(name: str, family: str) -> None:
    """TTFT / TPOT kept whole: per bucket, the sum over data-parallel engines (the largest of
    one engine's tp-rank copies) that prometheus_client's own parser reads; count = +Inf."""
    kind = EXPECTED[name][0]
    sample = extract(kind, _body(name))
    assert sample is not None
    hist = sample.ttft if "first_token" in family else sample.tpot
    assert hist is not None
    per: dict[tuple[str, float], float] = {}
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(_body(name).decode()):
        for s in fam.samples:
            group = s.labels.get("engine", "") + "/" + s.labels.get("dp_rank", "")
            if s.name == family + "_bucket":
                key = (group, float(s.labels["le"]))
                per[key] = max(per.get(key, 0.0), s.value)
            elif s.name == family + "_sum":
                sums[group] = max(sums.get(group, 0.0), s.value)
    bounds = sorted({le for _, le in per})
    assert [b for b, _ in hist.buckets] == bounds and bounds[-1] == math.inf
    for bound, count in hist.buckets:
        assert count == pytest.approx(sum(v for (_, le), v in per.items() if le == bound))
    assert hist.count == hist.buckets[-1][1]
    assert hist.total == pytest.approx(sum(sums.values()))


def test_a_histogram_without_its_inf_bucket_is_not_kept() -> None:
    """A family cut before `le="+Inf"` (or without sum/count) is no histogram: None."""
    body = _body("vllm_v1_dp2.prom").decode()
    cut = "\n".join(line for line in body.splitlines() if 'time_to_first_token_seconds_bucket{' not in line
                    or 'le="+Inf"' not in line) + "\n"
    sample = extract("vllm", cut.encode())
    assert sample is not None and sample.ttft is None and sample.tpot is not None
    assert sample.output_tokens == pytest.approx(8_000_000.0)
def test_vllm_kv_cache_size_in_blocks_from_cache_config_info() -> None:
    body = (
        b"vllm:num_requests_running{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"0\"} 0\n"
        b"vllm:num_requests_running{engine=\"1\"} 1\nvllm:num_requests_waiting{engine=\"1\"} 0\n"
        b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="4096",num_cpu_blocks="None"} 1.0\n'
        b'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="4096",num_cpu_blocks="None"} 1.0\n'
    )
    sample = extract("vllm", body)
    assert sample is not None and sample.kv_blocks == 8192  # both data-parallel engines
    plain = extract("vllm", b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n")
    assert plain is not None and plain.kv_blocks is None


def test_vllm_requests_that_ran_to_their_max_tokens_from_the_finish_reasons() -> None:
    """`finished_bounded`: vLLM's request_success_total{finished_reason="length"}, summed over data-parallel
    engines (totals beside them ignored), as prometheus_client's parse reads the same body; 0 while the
    family has other reasons only, None where it is absent (TGI, llama.cpp, older bodies)."""
    body = (
        'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_waiting{engine="0"} 0\n'
        'vllm:num_requests_running{engine="1"} 2\nvllm:num_requests_waiting{engine="1"} 0\n'
        '# TYPE vllm:request_success_total counter\n'
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 90\n'
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 10\n'
        'vllm:request_success_total{engine="1",finished_reason="length",model_name="m"} 5\n'
        'vllm:request_success_total{engine="1",finished_reason="abort",model_name="m"} 1\n'
        'vllm:request_success_total{finished_reason="length",model_name="m"} 15\n'
    )
    sample = extract("vllm", body.encode())
    assert sample is not None and sample.finished_bounded == 15.0
    reference = sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
                    if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "length"
                    and "engine" in s.labels)
    assert sample.finished_bounded == reference
    stops_only = body.replace('finished_reason="length"', 'finished_reason="stop"')
    assert extract("vllm", stops_only.encode()).finished_bounded == 0.0  # type: ignore[union-attr]
    assert extract("vllm", _body("vllm_v1_dp2.prom")).finished_bounded is None  # type: ignore[union-attr]
    assert extract("tgi", _body("tgi.prom")).finished_bounded is None  # type: ignore[union-attr]


def test_figures_past_a_floats_range_are_not_reported_never_infinite() -> None:
    """Found by review, each ended the sidecar's loop: a num_gpu_blocks label of 400 nines (read as
    infinity, then int() of it), two data-parallel engines' waiting of 1e308 each (their sum infinite,
    then round(nan) in the weights), prefix misses + hits past a float. A sum past the range is no
    figure (running/waiting: the body's load is unknown); an optional one is not reported."""
    head = b'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_waiting{engine="0"} 0\n'
    blocks = head + b'vllm:cache_config_info{engine="0",num_gpu_blocks="' + b"9" * 400 + b'"} 1.0\n'
    sample = extract("vllm", blocks)
    assert sample is not None and sample.kv_blocks is None
    for name in (b"waiting", b"running"):
        huge = (b'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 1\n'
                b'vllm:num_requests_waiting{engine="0"} 0\nvllm:num_requests_waiting{engine="1"} 0\n')
        huge = huge.replace(b"num_requests_" + name + b'{engine="0"} ' + (b"1" if name == b"running" else b"0"),
                            b"num_requests_" + name + b'{engine="0"} 1e308')
        huge = huge.replace(b"num_requests_" + name + b'{engine="1"} ' + (b"1" if name == b"running" else b"0"),
                            b"num_requests_" + name + b'{engine="1"} 1e308')
        with pytest.raises(MetricsFormatError):
            extract("vllm", huge)


def test_a_label_value_of_a_million_escapes_parses_in_one_pass() -> None:
    """Found by review: each escape searched on to the closing quote again, so a 2 MB value of `\\\\` pairs
    held the event loop for seconds on every probe (1 MB: 2.8 s). One pass now, and the value is unescaped."""
    import time

    def parse(value: bytes) -> float:
        body = (b'vllm:num_requests_running{engine="0",junk="' + value + b'"} 3\n'
                b'vllm:num_requests_waiting{engine="0"} 1\n')
        started = time.process_time()
        sample = extract("vllm", body)
        assert sample is not None and sample.running == 3 and sample.waiting == 1
        return time.process_time() - started

    plain = parse(b"x" * (2 << 20))  # 2 MiB without an escape: the cost of reading that much
    escaped = parse(b"\\\\" * (1 << 20))  # 2 MiB of escaped backslashes
    # one pass: ~0.4 s here (a regex step and an unescape per pair), ~20x the plain read; the quadratic
    # search took ~11 s (500x)
    assert escaped < 60 * plain + 0.5, (escaped, plain)


def test_a_load_past_a_billion_requests_is_not_a_load() -> None:
    """Found by review: one worker reporting 1e308 running and 1e308 waiting (each finite) overflowed the
    pool's sums to infinity, then round() and floor() of it ended the sidecar (ADS limits, the in-flight
    setpoint). Past 1e9 requests on one engine the body's load is unknown; any other figure past 1e15 is
    not reported."""
    for body in (b"vllm:num_requests_running 1e308\nvllm:num_requests_waiting 1e308\n",
                 b"vllm:num_requests_running 1\nvllm:num_requests_waiting 2e9\n"):
        with pytest.raises(MetricsFormatError, match="implausible"):
            extract("vllm", body)
    sample = extract("vllm", b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
                             b"vllm:generation_tokens_total 1e300\n")
    assert sample is not None and sample.generated_tokens is None
    sample = extract("vllm", b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
                             b"vllm:generation_tokens_total 123456789\n")
    assert sample is not None and sample.generated_tokens == 123456789


def test_a_tgi_that_has_served_nothing_yet_is_idle_not_a_bad_scrape() -> None:
    """Found by review: TGI creates tgi_queue_size and tgi_batch_current_size at its first request, so a fresh
    TGI's scrape raised "no tgi_batch_current_size" (logged bad_metrics each cycle). Its other series present
    and those two absent: idle. Without any tgi_ series, or for another engine, still an error."""
    fresh = b"# TYPE tgi_request_count counter\ntgi_request_count 0\ntgi_batch_max_total_tokens 16000\n"
    sample = extract("tgi", fresh)
    assert sample is not None and (sample.running, sample.waiting) == (0.0, 0.0)
    with pytest.raises(MetricsFormatError):
        extract("tgi", b"# nothing of tgi here\nprocess_cpu_seconds_total 1\n")
    with pytest.raises(MetricsFormatError):
        extract("vllm", b"vllm:prompt_tokens_total 0\n")


def test_vllm_prefill_tokens_are_the_ones_its_prefill_time_counts() -> None:
    """Found by review: vLLM records the prefill time as each request finishes, while prompt_tokens_total moves
    as prompts are prefilled: their deltas over a cycle cover different requests (the learned prefill cost 22 %
    high with 0.4-4.9x swings when answers are long). Where vLLM reports the prefill's computed tokens (recorded
    with the time, cached ones excluded) those are the tokens; else the prompt tokens less the cache hits."""
    base = ('vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_waiting{engine="0"} 0\n'
            'vllm:prompt_tokens_total{engine="0"} 5000\nvllm:prefix_cache_hits_total{engine="0"} 1000\n'
            'vllm:request_prefill_time_seconds_sum{engine="0"} 2.5\n')
    older = extract("vllm", base.encode())
    assert older is not None and older.prefill_tokens == 4000.0
    newer = extract("vllm", (base + 'vllm:request_prefill_kv_computed_tokens_sum{engine="0"} 3700\n').encode())
    assert newer is not None and (newer.prefill_tokens, newer.prefill_seconds) == (3700.0, 2.5)


def test_with_speculative_decoding_the_time_per_token_is_decode_time_over_tokens() -> None:
    """Found by review: with speculative decoding vLLM observes its inter-token histogram once per engine step
    however many tokens the step accepted, so its sum over count is a step (2-3 tokens): every prediction and
    queue wait came out that much too long, and admission shed early. Where the speculative counter is present,
    the time per token is the finished requests' decode seconds over their tokens after the first."""
    base = ('vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_waiting{engine="0"} 0\n'
            'vllm:inter_token_latency_seconds_sum{engine="0"} 30.0\n'
            'vllm:inter_token_latency_seconds_count{engine="0"} 1000\n'
            'vllm:request_generation_tokens_sum{engine="0"} 2600\n'
            'vllm:request_generation_tokens_count{engine="0"} 100\n'
            'vllm:request_decode_time_seconds_sum{engine="0"} 30.0\n')
    plain = extract("vllm", base.encode())
    assert plain is not None and (plain.token_latency_s, plain.token_latency_n) == (30.0, 1000.0)
    spec = extract("vllm", (base + 'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 1500\n').encode())
    assert spec is not None and (spec.token_latency_s, spec.token_latency_n) == (30.0, 2500.0)
