"""Choosing the sidecar's weight defaults by their worst case over a matrix of fleets.

`python -m bench.sweep` (see __main__) writes bench/sweep/results.md; `_model` is the
deterministic fleet model it runs, `_fleets` the matrix, `live_check` a bounded live run
of the real sidecar against a simulated fleet behind Envoy. `overload` and `picker` are
two more virtual-time models (admission, the endpoint picker); all three run on the one
event loop of `_loop` (the event queue, the engines' step ends, the sidecar's weight cycle).
"""
