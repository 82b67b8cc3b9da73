"""A pool's admission state on its own (admission.py: `Admission`), fed the best predicted starts a
picker would feed it, on a fake clock. The picker that feeds it: test_picker_predict.py, test_picker_lobby.py;
the service that reads it: test_picker_lateness.py, test_picker_bypass.py."""

from __future__ import annotations

import pytest

from sidecar.outputs.picker.admission import Admission, WaitBudgets
from sidecar.outputs.picker.scheduling import PickerPolicy

SERVICE_S = 2.0  # the pool's median time a request holds a slot
SERVES = 10.0  # requests a second the pool serves


def _admission(policy: PickerPolicy, now: list[float], pickers: int = 1) -> Admission:
    return Admission(policy, pickers=lambda: pickers, clock=lambda: now[0])


def test_a_pool_never_looked_at_has_no_budget_no_gate_and_no_surge() -> None:
    admission = _admission(PickerPolicy(), [0.0])
    assert admission.budget("chat", "standard") is None
    assert not admission.admitting("chat") and not admission.surging("chat") and not admission.gate("chat")
    assert admission.refusal_unread("chat", "standard", saturated=True) is None
    assert admission.pressure("chat") is None and admission.pressures() == {}
    # without the gate (admission_gate=0) every pool admits, looked at or not
    assert _admission(PickerPolicy(admission_gate=0), [0.0]).admitting("chat")


def test_a_standing_wait_opens_the_gate_and_sets_how_far_past_its_budget_an_unread_request_is() -> None:
    now = [0.0]
    policy = PickerPolicy()
    admission = _admission(policy, now)
    standard = policy.budget_standard * SERVICE_S
    # a wait of two service times, one arrival a tenth of a second (at what the pool serves): the
    # pressure's average passes open_share of a service time within pressure_s
    opened_at = None
    for i in range(60):
        now[0] = i / 10
        if admission.observe("chat", 2 * SERVICE_S, SERVICE_S, SERVES) and opened_at is None:
            opened_at = now[0]
    assert opened_at is not None and opened_at < 2 * policy.pressure_s, opened_at
    assert admission.admitting("chat") and admission.surging("chat")
    assert admission.budget("chat", "standard") == pytest.approx(standard)
    assert admission.budget("chat", "critical") is None
    pressure = admission.pressure("chat")
    assert pressure is not None and pressure.held and admission.pressures() == {"chat": pressure}
    # a request answered without a pick 0.5 s after the last look: the wait seen then, drained since
    now[0] += 0.5
    past = admission.refusal_unread("chat", "standard", saturated=False)
    assert past == pytest.approx(2 * SERVICE_S - 0.5 - standard)
    assert admission.refusal_unread("chat", "critical", saturated=False) is None  # never refused
    now[0] += 2 * SERVICE_S  # drained past the budget: placed by the proxy
    assert admission.refusal_unread("chat", "standard", saturated=False) is None


def test_the_gate_follows_the_pools_own_budgets_and_is_per_pool() -> None:
    now = [0.0]
    admission = _admission(PickerPolicy(), now)
    admission.pool_budgets = {"batch": WaitBudgets(standard=10.0, sheddable=5.0)}
    for i in range(60):
        now[0] = i / 10
        admission.observe("chat", 2 * SERVICE_S, SERVICE_S, SERVES)
        admission.observe("batch", 2 * SERVICE_S, SERVICE_S, SERVES)
    # the same waits: past the policy's opening level in chat, under batch's budget of ten service times
    assert admission.admitting("chat") and not admission.admitting("batch")
    assert admission.budget("batch", "sheddable") == pytest.approx(5.0 * SERVICE_S)


def test_a_spike_opens_the_gate_at_once_and_each_picker_counts_for_those_it_shares_the_pool_with() -> None:
    policy = PickerPolicy()
    needed = max(policy.spike_min, policy.spike_ratio * SERVES * policy.spike_s)  # arrivals in spike_s
    wait = 1.0 * SERVICE_S  # past the standard budget, under the pressure's opening level for now
    for pickers in (1, 2):
        now = [0.0]
        admission = _admission(policy, now, pickers)
        share = int(needed / pickers + 1)
        opened = [admission.observe("chat", wait, SERVICE_S, SERVES) for _ in range(share)]
        assert opened[-1] and not any(opened[:-2]), (pickers, opened.index(True), share)
        assert admission.rushing("chat")
    # requests answered without a pick count as arrivals too (a rush that makes the picker late)
    now = [0.0]
    admission = _admission(policy, now)
    for _ in range(int(needed)):
        admission.arrived("chat")
    assert admission.observe("chat", wait, SERVICE_S, SERVES)
