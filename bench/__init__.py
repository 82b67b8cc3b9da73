"""Benchmarks: a routing matrix, chat sessions, overload, steady-state EDS writes, proxy overhead, failover,
reload, sidecar cost, render scale.

    python -m bench run [--quick] [--only SCENARIO ...] [--seed N] [--set KEY=SECONDS] --out DIR

Every figure in the report is measured by the run that writes it.
"""
