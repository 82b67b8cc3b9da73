"""What the sidecar publishes and serves: publishers, gRPC services, and the transport they share."""
