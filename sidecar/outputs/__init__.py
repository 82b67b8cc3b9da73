"""What the sidecar offers the proxies: publishers (files, ADS, nginx) and gRPC services."""
