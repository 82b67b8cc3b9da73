"""EDS weights from speed and load (bounds, monotonicity, smoothing, ramp, measured speed on
simulated engines, stability) and fleet-level signals."""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import pairwise

import pytest

from confgen.simulate import BatchEngine, EngineRequest, LatencyModel
from confgen.simulate._metrics_text import MetricsInput, histogram_bounds, render
from sidecar.decide.weights import Trend, WeightPolicy, pool_saturation, queue_depth, relative_speeds, weight
from sidecar.observe.engines import LoadSample, extract

POLICY = WeightPolicy()
# One weight unit per slot, no EWMA, a queue of half the capacity takes all the room, KV
# pressure counted from 0.8 (both terms are off by default).
NO_SMOOTHING = WeightPolicy(smoothing=1.0, weight_per_slot=1.0, waiting_penalty=2.0, kv_knee=0.8)


def load(running: float, waiting: float = 0.0, kv: float | None = None) -> LoadSample:
    return LoadSample(running=running, waiting=waiting, kv_usage=kv)


def test_weight_is_an_integer_within_bounds() -> None:
    """Every weight is an int in [1, max_weight], also for overload and zero ramp."""
    policy = WeightPolicy(max_weight=50, waiting_penalty=2.0)
    cases = [load(0), load(256, 500, kv=1.0), load(0, kv=0.0)]
    for sample in cases:
        for previous in (None, 1, 50):
            for ramp in (0.0, 0.3, 1.0):
                w = weight(sample, 256, previous, policy, ramp=ramp)
                assert isinstance(w, int) and 1 <= w <= 50
    assert weight(load(0), 256, None, policy) == 50  # idle big worker: clamped
    assert weight(load(256, 128), 256, None, policy) == 1  # queue of half its size: a trickle, not 0
    for speed in (0.0, 1e-9, 0.5, 1.0, 3.0):
        assert 1 <= weight(load(0), 256, None, policy, speed=speed) <= 50


def test_weight_falls_as_the_queue_grows_and_ignores_the_running_count() -> None:
    """More waiting requests never raise the weight: a queue of a quarter of the capacity
    halves it, one of half the capacity leaves a trickle. The running count alone does not
    move it (Envoy counts its own in-flight requests), and `queue` (the smoothed value)
    replaces the sample's own waiting count."""
    weights = [weight(load(64, q), 64, None, NO_SMOOTHING) for q in range(0, 40)]
    assert weights == sorted(weights, reverse=True)
    assert (weights[0], weights[16], weights[32]) == (64, 32, 1)
    assert {weight(load(r), 64, None, NO_SMOOTHING) for r in range(0, 70)} == {64}
    assert weight(load(64, 32), 64, None, NO_SMOOTHING, queue=0.0) == 64
    assert weight(load(64, 0), 64, None, NO_SMOOTHING, queue=16.0) == 32


def test_kv_pressure_above_knee_lowers_weight() -> None:
    """Below the 0.8 knee KV use does not matter; above it the weight falls to the floor.
    With the default knee of 1 KV use never lowers the weight."""
    assert weight(load(10, kv=0.5), 64, None, NO_SMOOTHING) == 64
    assert weight(load(10, kv=0.9), 64, None, NO_SMOOTHING) == 32
    assert weight(load(10, kv=1.0), 64, None, NO_SMOOTHING) == 1
    assert weight(load(10, kv=1.0), 64, None, WeightPolicy()) == 64


def test_bigger_capacity_draws_more() -> None:
    """With equal load, the worker with more declared capacity gets the higher weight."""
    assert weight(load(8), 64, None, POLICY) > weight(load(8), 16, None, POLICY)


def test_smoothing_moves_part_way_and_still_converges() -> None:
    """An EWMA of 0.5 halves the step, and rounding toward the target never sticks."""
    assert weight(load(0), 100, 20, WeightPolicy(smoothing=0.5, weight_per_slot=1.0)) == 60
    w = 1
    for _ in range(20):
        w = weight(load(0), 2, w, WeightPolicy(smoothing=0.1, weight_per_slot=1.0))
    assert w == 2
    w = 100
    for _ in range(60):
        w = weight(load(100, 50), 100, w, WeightPolicy(smoothing=0.1, weight_per_slot=1.0, waiting_penalty=2.0))
    assert w == 1


def test_slow_start_ramp_scales_the_weight() -> None:
    """The ramp multiplies the target: 0 gives the floor, 0.5 about half."""
    assert weight(load(0), 100, None, NO_SMOOTHING, ramp=0.0) == 1
    assert weight(load(0), 100, None, NO_SMOOTHING, ramp=0.5) == 50
    assert weight(load(0), 100, None, NO_SMOOTHING, ramp=1.0) == 100


def test_no_sample_uses_the_static_weight() -> None:
    """Without metrics the target is capacity * weight_per_slot, as with no sidecar."""
    assert weight(None, 32, None, POLICY) == 32
    with pytest.raises(ValueError, match="capacity"):
        weight(None, 0, None, POLICY)


def test_pool_saturation_and_queue_depth() -> None:
    """Saturation is max(slots used, mean KV / 0.8); queue depth sums waiting."""
    samples = {"a": load(30, 10, kv=0.4), "b": load(20, 0, kv=0.2), "c": None}
    caps = {"a": 64, "b": 64, "c": 64}
    assert pool_saturation(samples, caps) == pytest.approx(60 / 128)
    kv_bound = {"a": load(2, 0, kv=0.96), "b": load(2, 0, kv=0.96)}
    assert pool_saturation(kv_bound, caps) == pytest.approx(1.2)
    assert pool_saturation({"c": None}, caps) == 0.0
    assert queue_depth(samples) == 10.0
    assert queue_depth({}) == 0.0


def test_policy_validation() -> None:
    """A zero max weight, an out-of-range smoothing factor, a negative speed exponent or a
    non-positive speed half-life is refused."""
    with pytest.raises(ValueError, match="max_weight"):
        WeightPolicy(max_weight=0)
    with pytest.raises(ValueError, match="smoothing"):
        WeightPolicy(smoothing=0.0)
    with pytest.raises(ValueError, match="speed_exponent"):
        WeightPolicy(speed_exponent=-1.0)
    with pytest.raises(ValueError, match="speed_half_life_s"):
        WeightPolicy(speed_half_life_s=0.0)


def test_static_share_multiplies_the_weight() -> None:
    """The topology's worker weight scales the load-based weight, still clamped to the
    policy's maximum and never below 1."""
    assert weight(load(8), 32, None, NO_SMOOTHING, share=3) == 3 * weight(load(8), 32, None, NO_SMOOTHING)
    assert weight(load(0), 100, None, WeightPolicy(max_weight=250), share=4) == 250
    assert weight(load(32, 16), 32, None, NO_SMOOTHING, share=5) == 1
    with pytest.raises(ValueError, match="share"):
        weight(None, 8, None, POLICY, share=0)


def test_no_sample_weight_is_what_confgen_renders_first() -> None:
    """Without a sample, a fresh endpoint gets confgen's static_weight(capacity, share),
    the weight `confgen render` writes, so the sidecar's first start changes no weight."""
    from confgen import envoy, parse_topology
    from confgen.endpoints import MAX_WEIGHT, static_weight

    for capacity, share in ((1, 1), (4, 3), (256, 1), (256, 128), (100_000, 2)):
        assert weight(None, capacity, None, POLICY, share=share) == static_weight(capacity, share)
    assert static_weight(100_000, 2) == MAX_WEIGHT
    topo, _ = parse_topology(b"""
version: 1
name: w
listeners: [{name: l, port: 8080}]
pools:
  - name: p
    engine: vllm
    models: [m]
    capacity: 16
    workers: ["10.0.0.1:8000", {address: "10.0.0.2:8000", weight: 3}, {address: "10.0.0.3:8000", capacity: 2}]
""")
    _, rendered = envoy.parse_eds(envoy.render(topo, config_dir="/cfg")["eds/p/endpoints.json"])
    pool = topo.pools[0]
    for ep, worker in zip(rendered, pool.workers, strict=True):
        assert ep.weight == weight(None, worker.capacity or pool.capacity, None, POLICY, share=worker.weight)
    assert [ep.weight for ep in rendered] == [16, 48, 2]


def test_max_weight_cannot_pass_what_an_endpoint_accepts() -> None:
    """A max_weight above confgen.endpoints.MAX_WEIGHT would build endpoints the EDS
    builder refuses: refused up front."""
    from confgen.endpoints import MAX_WEIGHT

    assert WeightPolicy().max_weight == MAX_WEIGHT
    with pytest.raises(ValueError, match="max_weight"):
        WeightPolicy(max_weight=MAX_WEIGHT + 1)


# -- speed: measured from the engines' own metrics, on a fake (virtual) clock -------------------


class _SimWorker:
    """A simulated engine (confgen.simulate's batching model) kept at a fixed number of
    sequences in flight, scraped through its real metrics text and `extract`."""

    def __init__(self, kind: str, speed: float, in_flight: int, seed: int | None = None) -> None:
        model = LatencyModel(max_num_seqs=8, speed=speed, decode_ms=40.0, decode_growth=0.03)
        self.kind = kind
        self.engine = BatchEngine(model, histogram_bounds=histogram_bounds(kind))
        self.in_flight = in_flight
        self.requests: list[EngineRequest] = []
        self.sent = 0
        self.rng = random.Random(seed) if seed is not None else None  # None: identical requests

    def submit(self, now: float) -> EngineRequest:
        self.sent += 1
        prompt, out = (200, 24) if self.rng is None else (self.rng.randint(50, 1500), self.rng.randint(4, 48))
        request = EngineRequest(f"r{self.sent}", prompt_tokens=prompt, max_tokens=out, arrival=now)
        self.engine.submit(request, now)
        self.requests.append(request)
        return request

    def run_until(self, now: float) -> None:
        """Advance to `now`, topping the flight back up at every step end."""
        while (end := self.engine.next_event_time()) is not None and end <= now:
            self.engine.advance(end)
            self.requests = [r for r in self.requests if not r.finished]
            while len(self.requests) < self.in_flight:
                self.submit(end)
        while len(self.requests) < self.in_flight:
            self.submit(now)

    def scrape(self) -> LoadSample | None:
        text = render(self.kind, MetricsInput("sim-model", [self.engine]))
        assert text is not None
        return extract(self.kind, text.encode())


def _drive(workers: dict[str, _SimWorker], policy: WeightPolicy, seconds: float, tick: float = 0.5,
           capacity: int = 64) -> list[dict[str, int]]:
    """Scrape every `tick` s of virtual time: Trend.observe -> relative_speeds -> weight."""
    trends = {name: Trend() for name in workers}
    previous: dict[str, int] = {}
    history: list[dict[str, int]] = []
    now = 0.0
    while now < seconds:
        now += tick
        for name, worker in workers.items():
            worker.run_until(now)
            trends[name] = trends[name].observe(worker.scrape(), now, policy)
        speeds = relative_speeds({name: t.token_latency_s for name, t in trends.items()})
        for name, worker in workers.items():
            previous[name] = weight(worker.scrape(), capacity, previous.get(name), policy,
                                    speed=speeds[name], queue=trends[name].queue)
        history.append(dict(previous))
    return history


def test_a_half_speed_worker_gets_about_half_the_weight() -> None:
    """Two simulated vLLM engines under the same load, one at half speed: its measured
    relative speed is about 0.5, so with speed_exponent 1 it gets about half the weight, and
    with the default exponent about 0.5 ** exponent of it (a big capacity, so rounding to
    an integer weight does not blur the ratio)."""
    for policy in (WeightPolicy(speed_exponent=1.0, waiting_penalty=0.0), replace(POLICY, waiting_penalty=0.0)):
        workers = {"fast": _SimWorker("vllm", 1.0, 4), "slow": _SimWorker("vllm", 0.5, 4)}
        last = _drive(workers, policy, 30.0, capacity=4096)[-1]
        assert last["fast"] == 4096 * policy.weight_per_slot
        assert (last["slow"] / last["fast"]) ** (1 / policy.speed_exponent) == pytest.approx(0.5, rel=0.05)


def test_batch_size_bias_is_bounded_and_in_the_stabilising_direction() -> None:
    """A half-speed worker running a quarter of the fast one's batch looks a little faster
    than half (time per token grows with the batch), never as fast as the fast one."""
    workers = {"fast": _SimWorker("vllm", 1.0, 8), "slow": _SimWorker("vllm", 0.5, 2)}
    policy = WeightPolicy(speed_exponent=1.0, waiting_penalty=0.0)
    last = _drive(workers, policy, 30.0)[-1]
    assert 0.5 < last["slow"] / last["fast"] < 0.65


def test_weights_are_stable_under_a_steady_load() -> None:
    """Under a steady but irregular load (random prompt and output lengths, so the time per
    token of single intervals jitters by tens of percent) the published weights settle:
    after a warm-up no weight moves by more than 6 % between scrapes, none wanders more
    than 20 %, and the half-speed worker stays below both full-speed ones throughout."""
    workers = {"a": _SimWorker("vllm", 1.0, 6, seed=1), "b": _SimWorker("vllm", 1.0, 6, seed=2),
               "c": _SimWorker("vllm", 0.5, 3, seed=3)}
    history = _drive(workers, POLICY, 120.0, capacity=1024)[40:]
    for name in workers:
        series = [h[name] for h in history]
        steps = [abs(x - y) for x, y in pairwise(series)]
        assert max(steps) <= 0.06 * max(series), (name, series)
        assert max(series) - min(series) <= 0.2 * max(series), (name, series)
    assert all(h["c"] < min(h["a"], h["b"]) / 4 for h in history)


def test_engines_without_a_latency_signal_keep_speed_one() -> None:
    """TGI exports no per-token latency pair (a per-request mean only): its trend has no speed, so a
    half-speed one keeps the full weight, exactly what a sample without speed gets; in a pool with a
    measured worker, the unmeasured one counts as full speed. llama.cpp's generation seconds and tokens
    are one (read since review): its half-speed worker weighs less."""
    policy = replace(POLICY, waiting_penalty=0.0)
    workers = {"a": _SimWorker("tgi", 1.0, 4), "b": _SimWorker("tgi", 0.5, 4)}
    history = _drive(workers, policy, 10.0)
    sample = workers["b"].scrape()
    assert sample is not None and sample.token_latency_s is None
    assert history[-1]["a"] == history[-1]["b"] == weight(sample, 64, None, policy)
    workers = {"a": _SimWorker("llamacpp", 1.0, 4), "b": _SimWorker("llamacpp", 0.5, 4)}
    history = _drive(workers, policy, 10.0)
    sample = workers["b"].scrape()
    assert sample is not None and sample.token_latency_s is not None
    assert history[-1]["a"] > history[-1]["b"]
    assert relative_speeds({"measured": 0.08, "unknown": None, "slow": 0.16}) == {
        "measured": 1.0, "unknown": 1.0, "slow": 0.5}
    assert relative_speeds({"x": None}) == {"x": 1.0}


def _tokens(seconds: float, count: float, waiting: float = 0.0) -> LoadSample:
    return LoadSample(running=4, waiting=waiting, token_latency_s=seconds, token_latency_n=count)


def test_trend_updates_only_while_generating() -> None:
    """The speed estimate moves only on intervals with at least speed_min_tokens tokens (an
    idle worker keeps it, fewer tokens accumulate into the next interval); a counter that
    goes down (engine restart) only re-baselines; an older scrape and a missing sample
    change nothing."""
    policy = WeightPolicy(speed_min_tokens=16)
    t = Trend().observe(_tokens(0.0, 0), 0.0, policy)
    assert t.token_latency_s is None
    t = t.observe(_tokens(2.0, 40), 1.0, policy)
    assert t.token_latency_s == pytest.approx(0.05)
    idle = t.observe(_tokens(2.0, 40), 60.0, policy)
    assert idle.token_latency_s == t.token_latency_s
    few = idle.observe(_tokens(2.5, 45), 61.0, policy)
    assert few.token_latency_s == t.token_latency_s and few.latency_count == 40
    more = few.observe(_tokens(4.0, 60), 62.0, policy)  # 20 tokens at 0.1 s since the baseline
    assert t.token_latency_s is not None and more.token_latency_s is not None
    assert t.token_latency_s < more.token_latency_s <= (0.05 + 0.1) / 2 + 1e-9
    restarted = more.observe(_tokens(0.1, 2), 63.0, policy)
    assert restarted.token_latency_s == more.token_latency_s and restarted.latency_count == 2
    assert restarted.observe(_tokens(9.0, 90), 10.0, policy) is restarted
    assert restarted.observe(None, 70.0, policy) is restarted


def test_queue_is_smoothed_over_time() -> None:
    """The queue the weight sees follows the waiting count with a half-life, so a one-scrape
    burst moves it only part way and a persistent queue is fully felt."""
    policy = WeightPolicy(queue_half_life_s=2.0)
    t = Trend().observe(_tokens(0, 0, waiting=0), 0.0, policy)
    burst = t.observe(_tokens(0, 0, waiting=8), 1.0, policy)
    assert burst.queue == pytest.approx(8 * (1 - 0.5**0.5))
    persistent = burst
    for second in range(2, 30):
        persistent = persistent.observe(_tokens(0, 0, waiting=8), float(second), policy)
    assert persistent.queue == pytest.approx(8, rel=0.01)
    assert weight(_tokens(0, 0, waiting=8), 16, None, WeightPolicy(waiting_penalty=2), queue=persistent.queue) == 1


def _steady_trend(policy: WeightPolicy, per_token: list[float], start: Trend | None = None,
                  t0: float = 0.0) -> tuple[Trend, float]:
    """Feed one 1-s interval of 100 tokens per entry of `per_token` (its time per token)."""
    trend = start or Trend().observe(_tokens(0.0, 0), t0, policy)
    total, count, now = trend.latency_sum or 0.0, trend.latency_count or 0.0, t0
    for value in per_token:
        now += 1.0
        total, count = total + value * 100, count + 100
        trend = trend.observe(_tokens(total, count), now, policy)
    return trend, now


def test_a_level_shift_replaces_the_estimate_on_the_second_interval() -> None:
    """After a steady minute at 50 ms per token, a worker that slows 2x is measured at its
    new speed on the second interval past the jump bound (the EWMA alone, half-life 20 s,
    would take a minute); one outlier interval followed by a normal one is not a shift,
    and a speed-up is a shift too."""
    policy = WeightPolicy(speed_half_life_s=20.0)
    steady, now = _steady_trend(policy, [0.05] * 60)
    assert steady.token_latency_s == pytest.approx(0.05)
    once, _ = _steady_trend(policy, [0.1], steady, now)
    assert once.token_latency_s is not None and once.token_latency_s < 0.055
    twice, now2 = _steady_trend(policy, [0.1, 0.1], steady, now)
    assert twice.token_latency_s == pytest.approx(0.1)
    blip, _ = _steady_trend(policy, [0.1, 0.05, 0.1], steady, now)
    assert blip.token_latency_s is not None and blip.token_latency_s < 0.06
    back, _ = _steady_trend(policy, [0.05, 0.05], twice, now2)
    assert back.token_latency_s == pytest.approx(0.05)


def test_noisy_intervals_raise_the_jump_bound() -> None:
    """Where single intervals jitter by +-30 % (prefill-heavy traffic), two +60 % intervals
    are noise (the EWMA moves a little), while a 2.5x slowdown is still a shift."""
    policy = WeightPolicy(speed_half_life_s=20.0)
    noisy, now = _steady_trend(policy, [0.05 * (1.3 if i % 2 else 0.7) for i in range(120)])
    assert noisy.noise == pytest.approx(0.3, rel=0.15)
    assert noisy.token_latency_s is not None
    spikes, _ = _steady_trend(policy, [noisy.token_latency_s * 1.6] * 2, noisy, now)
    assert spikes.token_latency_s is not None and spikes.token_latency_s < noisy.token_latency_s * 1.2
    slowed, _ = _steady_trend(policy, [noisy.token_latency_s * 2.5] * 2, noisy, now)
    assert slowed.token_latency_s == pytest.approx(noisy.token_latency_s * 2.5)
