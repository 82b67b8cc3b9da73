"""Helpers shared by the test suites: tiny loopback backends, rendering + running Envoy."""
