"""The sidecar's HTTP side: its server, metrics, the /v1/models answer, the Envoy relay, the guard."""
