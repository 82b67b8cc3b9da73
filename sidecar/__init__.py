"""Sidecar daemon: probes inference workers and publishes Envoy EDS weights and health.

Pure core (no sockets, files or clock reads): `engines` (metrics text -> LoadSample),
`state` (per-endpoint health state machine and the pool ejection cap), `weights`
(LoadSample -> per-endpoint speed trend -> EDS weight, fleet saturation and queue depth).
"""
