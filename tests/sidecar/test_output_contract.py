"""The outputs' statuses combined into what the fleet view shows (sidecar.outputs.contract.combine)."""

from __future__ import annotations

from sidecar.outputs.contract import OutputStatus, PoolStatus, combine, published


def test_statuses_combine_counts_add_flags_hold_values_come_first_problems_keep_order() -> None:
    """A publisher's and a limiter's status of one pool make one row: counts add up (shed per
    reason too), a flag holds when either holds, a value is the first output's that gives one;
    problems, refusals and failures are listed in the outputs' order; a pool no output reports
    reads as all defaults."""
    publisher = OutputStatus(problems=("last chat update rejected by Envoy",),
                             pools=published({"chat": 3}, {"chat": 1, "cds": 1}, {"chat"}),
                             write_failures={"tree": 1}, external_changes={"chat": 2})
    limiter = OutputStatus(pools={"chat": PoolStatus(inflight_limit=20, saturated="inflight", shed={"cap": 4},
                                                     shedding=True, sheddable_share=100)})
    picker = OutputStatus(problems=("picker: x",), pools={"chat": PoolStatus(shed={"cap": 1, "share": 2})},
                          refused={("picker", "chat", "sheddable"): 5})
    both = combine([publisher, limiter, picker])
    assert both.problems == ("last chat update rejected by Envoy", "picker: x")
    assert both.pool("chat") == PoolStatus(publishes=3, rejections=1, rejected=True, inflight_limit=20,
                                           saturated="inflight", shed={"cap": 5, "share": 2}, shedding=True,
                                           sheddable_share=100)
    assert both.pool("cds").rejections == 1 and both.pool("gone") == PoolStatus()
    assert both.refused == {("picker", "chat", "sheddable"): 5}
    assert (both.write_failures, both.external_changes, both.xds) == ({"tree": 1}, {"chat": 2}, None)
    assert combine([]) == OutputStatus(pools={})
    assert limiter.pool("chat").shed == {"cap": 4}  # the outputs' own statuses are left as they were
