"""Sidecar daemon: probes inference workers and publishes Envoy EDS weights and health.

Pure core (no sockets, files or clock reads): `engines` (metrics text -> LoadSample),
`state` (per-endpoint health state machine and the pool ejection cap), `weights`
(LoadSample -> per-endpoint speed trend -> EDS weight, fleet saturation and queue depth).
"""

import os as _os

# gRPC core logs one line per failed TLS handshake at INFO, outside the structured log and
# unbounded: any client without a certificate could fill the log. Errors only, unless the
# operator asks for more (set GRPC_VERBOSITY). Set before grpc loads (on the first import of
# any sidecar module).
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
