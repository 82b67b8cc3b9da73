"""Metrics text per engine kind: names, labels, types, histograms, number formats, size."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from confgen.simulate import BatchEngine, EngineRequest, LatencyModel
from confgen.simulate._faults import garbage_metrics, html_metrics, truncate_metrics
from confgen.simulate._metrics_text import (
    MetricsInput,
    cpp_number,
    histogram_bounds,
    py_float,
    render,
    render_llamacpp,
)
from tests.support.exposition import RECORDED_LLAMACPP, families

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _busy_input(kind: str, *, data_parallel: int = 1) -> MetricsInput:
    """Engines with 2 running, 3 waiting, some finished requests and a prefix hit."""
    engines = []
    for _ in range(data_parallel):
        engine = BatchEngine(
            LatencyModel(max_num_seqs=2, decode_ms=10, prefill_ms_per_1k=10),
            histogram_bounds=histogram_bounds(kind),
        )
        engine.submit(EngineRequest("done-1", 800, 3, 0.0, cache_key="k"), 0.0)
        engine.advance(1.0)
        engine.submit(EngineRequest("done-2", 800, 3, 1.0, cache_key="k"), 1.0)
        engine.advance(2.0)
        for i in range(5):
            engine.submit(EngineRequest(f"r{i}", 500, 1000, 2.0), 2.0)
        engine.advance(2.1)
        engines.append(engine)
    return MetricsInput(MODEL, engines, request_failures={"overloaded": 1}, requests_received=9)


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _types(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_vllm_v1_names_labels_and_values() -> None:
    """vLLM V1: documented names, labels {engine, model_name}, running/waiting/kv/prefix values."""
    text = render("vllm", _busy_input("vllm"))
    samples = _samples(text)
    labels = {"engine": "0", "model_name": MODEL}
    assert samples["vllm:num_requests_running"] == [(labels, 2.0)]
    assert samples["vllm:num_requests_waiting"] == [(labels, 3.0)]
    kv = samples["vllm:kv_cache_usage_perc"][0][1]
    assert 0 < kv < 1
    assert samples["vllm:prefix_cache_hits_total"][0][1] > 0
    assert samples["vllm:prefix_cache_queries_total"][0][1] >= samples["vllm:prefix_cache_hits_total"][0][1]
    assert samples["vllm:generation_tokens_total"][0][1] > 0
    for name in ("vllm:prompt_tokens_total", "vllm:num_preemptions_total", "vllm:engine_sleep_state"):
        assert name in samples
    assert {lab["reason"] for lab, _ in samples["vllm:num_requests_waiting_by_reason"]} == {"capacity", "deferred"}
    types = _types(text)
    for hist in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        assert types[hist] == "histogram"
        buckets = samples[f"{hist}_bucket"]
        assert buckets[-1][0]["le"] == "+Inf" and len(buckets) > 10
        assert samples[f"{hist}_count"][0][1] == buckets[-1][1]
    assert types["vllm:prefix_cache_hits"] == "counter"
    assert "vllm:gpu_cache_usage_perc" not in samples
    assert "# HELP vllm:num_requests_running " in text and "# TYPE vllm:num_requests_running gauge" in text
    # prometheus_client order: labels sorted, `le` among them.
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="' in text


def test_vllm_body_has_its_real_size() -> None:
    """A vLLM scrape is 30-50 KB (histograms included), for one engine."""
    for model in (MODEL, "sim-model"):
        data = _busy_input("vllm")
        text = render("vllm", MetricsInput(model, data.engines, requests_received=9))
        assert text is not None
        assert 30_000 <= len(text.encode()) <= 50_000, len(text)


def test_vllm_data_parallel_has_one_series_per_engine() -> None:
    """Data parallel: one `engine` label value per rank, each rank's own numbers."""
    samples = _samples(render("vllm", _busy_input("vllm", data_parallel=3)) or "")
    running = samples["vllm:num_requests_running"]
    assert sorted(lab["engine"] for lab, _ in running) == ["0", "1", "2"]
    assert sum(v for _, v in running) == 6.0


def test_vllm_v0_uses_the_old_names() -> None:
    """V0 engine: gpu_cache_usage_perc, swapped, hit rate; no `engine` label, no new names."""
    samples = _samples(render("vllm_v0", _busy_input("vllm_v0", data_parallel=2)) or "")
    assert samples["vllm:num_requests_running"] == [({"model_name": MODEL}, 4.0)]
    for name in ("vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc", "vllm:num_requests_swapped"):
        assert name in samples
    hit_rate = samples["vllm:gpu_prefix_cache_hit_rate"][0][1]
    assert 0 < hit_rate < 1
    assert "vllm:kv_cache_usage_perc" not in samples
    assert "vllm:prefix_cache_hits_total" not in samples


def test_vllm_both_names_variant_emits_old_and_new() -> None:
    """vLLM 0.9.2-0.10 emit both cache names side by side."""
    samples = _samples(render("vllm", _busy_input("vllm"), variant="both_names") or "")
    assert samples["vllm:gpu_cache_usage_perc"] == samples["vllm:kv_cache_usage_perc"]
    assert samples["vllm:gpu_prefix_cache_hits_total"] == samples["vllm:prefix_cache_hits_total"]


def test_sglang_names_and_labels() -> None:
    """SGLang: sglang:num_running_reqs etc. with model_name/tp_rank, dp_rank only under DP."""
    samples = _samples(render("sglang", _busy_input("sglang")) or "")
    assert samples["sglang:num_running_reqs"] == [({"model_name": MODEL, "tp_rank": "0"}, 2.0)]
    assert samples["sglang:num_queue_reqs"][0][1] == 3.0
    for name in ("sglang:token_usage", "sglang:cache_hit_rate", "sglang:gen_throughput"):
        assert name in samples
    assert samples["sglang:cache_hit_rate"][0][1] > 0
    assert "sglang:time_to_first_token_seconds_bucket" in samples
    dp = _samples(render("sglang", _busy_input("sglang", data_parallel=2)) or "")
    assert sorted(lab["dp_rank"] for lab, _ in dp["sglang:num_running_reqs"]) == ["0", "1"]
    newer = _samples(render("sglang", _busy_input("sglang"), variant="underscore_prefix") or "")
    assert "sglang_num_running_reqs" in newer


def test_tgi_is_unlabelled_with_counters_without_total() -> None:
    """TGI: tgi_queue_size / tgi_batch_current_size unlabelled; `tgi_request_count 9`."""
    text = render("tgi", _busy_input("tgi")) or ""
    samples = _samples(text)
    assert samples["tgi_queue_size"] == [({}, 3.0)]
    assert samples["tgi_batch_current_size"] == [({}, 2.0)]
    assert "tgi_batch_current_max_tokens" in samples and "tgi_batch_max_total_tokens" in samples
    assert "\ntgi_request_count 9\n" in text
    assert "tgi_request_count_total" not in text
    assert '\ntgi_request_failure{err="overloaded"} 1\n' in text
    # prometheus_client's parser adds `_total` to counter samples that lack it.
    assert samples["tgi_request_failure_total"] == [({"err": "overloaded"}, 1.0)]
    assert _types(text)["tgi_request_duration"] == "histogram"


def test_llamacpp_names_and_exponent_counters() -> None:
    """llama.cpp: requests_processing/deferred; large counters print as `4.81234e+06`."""
    data = _busy_input("llamacpp")
    samples = _samples(render_llamacpp(data))
    assert samples["llamacpp:requests_processing"] == [({}, 2.0)]
    assert samples["llamacpp:requests_deferred"] == [({}, 3.0)]
    data.engines[0].counters.generation_tokens = 4_812_340
    text = render_llamacpp(data)
    assert "llamacpp:tokens_predicted_total 4.81234e+06\n" in text
    assert _samples(text)["llamacpp:tokens_predicted_total"][0][1] == 4.81234e6
    assert cpp_number(1234) == "1234"


def test_llamacpp_families_are_the_real_servers() -> None:
    """The simulated llama.cpp prints the real llama-server's families with their types, in
    its order: no `kv_cache_usage_ratio`/`kv_cache_tokens` (the real server has no KV gauge),
    `prompt_tokens_cached_total`, `n_tokens_max` and `spec_decode_*` present,
    `n_busy_slots_per_decode` a gauge. The recorded body is checked against the built binary
    in tests/realengine/test_llama_exposition.py."""
    data = _busy_input("llamacpp")
    text = render_llamacpp(data)
    assert families(text) == families(RECORDED_LLAMACPP.read_text())
    samples = _samples(text)
    # done-2 reused done-1's prompt but its last token; the processed count excludes the reused ones
    cached = samples["llamacpp:prompt_tokens_cached_total"][0][1]
    assert cached == 799
    assert samples["llamacpp:prompt_tokens_total"][0][1] == data.engines[0].counters.prompt_tokens - cached


def test_number_formats_match_prometheus_client() -> None:
    """Python floats, Go-style exponents for big values, +Inf/NaN spelled as Prometheus does."""
    assert py_float(3) == "3.0"
    assert py_float(1789843202.3697093) == "1.7898432023697093e+09"
    assert py_float(1234567.0) == "1.234567e+06"
    assert py_float(123456.0) == "123456.0"
    assert py_float(float("inf")) == "+Inf"
    assert py_float(float("nan")) == "NaN"
    assert py_float(1.5e-05) == "1.5e-05"


def test_openai_kind_has_no_metrics() -> None:
    """A plain OpenAI-compatible server has no /metrics body to render."""
    assert render("openai", _busy_input("vllm")) is None


@pytest.mark.parametrize(
    "body", [garbage_metrics(3), html_metrics(), truncate_metrics(render("vllm", _busy_input("vllm")) or "", 0.5)]
)
def test_broken_bodies_do_not_parse(body: str) -> None:
    """Garbage, HTML and truncated bodies are rejected by a real parser."""
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(body))
