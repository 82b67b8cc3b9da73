"""What the sidecar offers beside itself: publishers and gRPC services reading the fleet view."""
