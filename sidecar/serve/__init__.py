"""The sidecar's own HTTP surface: health, readiness, state, metrics, drain, /v1/models and the Envoy relay."""
