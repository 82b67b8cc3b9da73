"""Choosing the sidecar's weight defaults by their worst case over a matrix of fleets.

`python -m bench.sweep` (see __main__) writes bench/sweep/results.md; `_model` is the
deterministic fleet model it runs, `_fleets` the matrix, `live_check` a bounded live run
of the real sidecar against a simulated fleet behind Envoy.
"""
