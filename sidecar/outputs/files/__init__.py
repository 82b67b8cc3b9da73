"""File-based xDS: EDS files and the whole tree, confirmed through Envoy's admin; the in-flight
limiter on Envoy's runtime."""
