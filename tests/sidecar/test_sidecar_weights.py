"""EDS weights from load (bounds, monotonicity, smoothing, ramp) and fleet-level signals."""

from __future__ import annotations

import pytest

from sidecar.engines import LoadSample
from sidecar.weights import WeightPolicy, pool_saturation, queue_depth, weight

POLICY = WeightPolicy()
NO_SMOOTHING = WeightPolicy(smoothing=1.0)


def load(running: float, waiting: float = 0.0, kv: float | None = None) -> LoadSample:
    return LoadSample(running=running, waiting=waiting, kv_usage=kv)


def test_weight_is_an_integer_within_bounds() -> None:
    """Every weight is an int in [1, max_weight], also for overload and zero ramp."""
    policy = WeightPolicy(max_weight=50)
    cases = [load(0), load(256, 500, kv=1.0), load(0, kv=0.0)]
    for sample in cases:
        for previous in (None, 1, 50):
            for ramp in (0.0, 0.3, 1.0):
                w = weight(sample, 256, previous, policy, ramp=ramp)
                assert isinstance(w, int) and 1 <= w <= 50
    assert weight(load(0), 256, None, policy) == 50  # idle big worker: clamped
    assert weight(load(256, 10), 256, None, policy) == 1  # full worker: a trickle, not 0


def test_weight_falls_clearly_as_the_queue_grows() -> None:
    """More waiting requests never raise the weight, and a queue of 10 cuts it by a lot."""
    weights = [weight(load(40, q), 64, None, NO_SMOOTHING) for q in range(0, 30)]
    assert weights == sorted(weights, reverse=True)
    assert weights[0] == 24 and weights[10] == 4
    running = [weight(load(r), 64, None, NO_SMOOTHING) for r in range(0, 70)]
    assert running == sorted(running, reverse=True)


def test_kv_pressure_above_knee_lowers_weight() -> None:
    """Below the 0.8 knee KV use does not matter; above it the weight falls to the floor."""
    assert weight(load(10, kv=0.5), 64, None, NO_SMOOTHING) == 54
    assert weight(load(10, kv=0.9), 64, None, NO_SMOOTHING) == 27
    assert weight(load(10, kv=1.0), 64, None, NO_SMOOTHING) == 1


def test_bigger_capacity_draws_more() -> None:
    """With equal load, the worker with more declared capacity gets the higher weight."""
    assert weight(load(8), 64, None, POLICY) > weight(load(8), 16, None, POLICY)


def test_smoothing_moves_part_way_and_still_converges() -> None:
    """The EWMA halves the step by default, and rounding toward the target never sticks."""
    assert weight(load(0), 100, 20, POLICY) == 60
    w = 1
    for _ in range(20):
        w = weight(load(0), 2, w, WeightPolicy(smoothing=0.1))
    assert w == 2
    w = 100
    for _ in range(60):
        w = weight(load(100), 100, w, WeightPolicy(smoothing=0.1))
    assert w == 1


def test_slow_start_ramp_scales_the_weight() -> None:
    """The ramp multiplies the target: 0 gives the floor, 0.5 about half."""
    assert weight(load(0), 100, None, POLICY, ramp=0.0) == 1
    assert weight(load(0), 100, None, POLICY, ramp=0.5) == 50
    assert weight(load(0), 100, None, POLICY, ramp=1.0) == 100


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
    """A zero max weight or an out-of-range smoothing factor is refused."""
    with pytest.raises(ValueError, match="max_weight"):
        WeightPolicy(max_weight=0)
    with pytest.raises(ValueError, match="smoothing"):
        WeightPolicy(smoothing=0.0)


def test_static_share_multiplies_the_weight() -> None:
    """The topology's worker weight scales the load-based weight, still clamped to the
    policy's maximum and never below 1."""
    assert weight(load(8), 32, None, NO_SMOOTHING, share=3) == 3 * weight(load(8), 32, None, NO_SMOOTHING)
    assert weight(load(0), 100, None, WeightPolicy(max_weight=250), share=4) == 250
    assert weight(load(32, 10), 32, None, NO_SMOOTHING, share=5) == 1
    with pytest.raises(ValueError, match="share"):
        weight(None, 8, None, POLICY, share=0)


def test_no_sample_weight_is_what_confgen_renders_first() -> None:
    """Without a sample, a fresh endpoint gets confgen's static_weight(capacity, share),
    the weight `confgen render` writes, so the sidecar's first start changes no weight."""
    from confgen import envoy, parse_topology
    from confgen.envoy.eds import MAX_WEIGHT, static_weight

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
    """A max_weight above confgen.envoy.eds.MAX_WEIGHT would build endpoints the EDS
    builder refuses: refused up front."""
    from confgen.envoy.eds import MAX_WEIGHT

    assert WeightPolicy().max_weight == MAX_WEIGHT
    with pytest.raises(ValueError, match="max_weight"):
        WeightPolicy(max_weight=MAX_WEIGHT + 1)
