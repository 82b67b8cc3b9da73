"""Benchmarks: routing quality, proxy overhead, failover, reload, sidecar cost, render scale.

    python -m bench run [--quick] [--only SCENARIO ...] [--seed N] --out DIR

Every figure in the report is measured by the run that writes it.
"""
