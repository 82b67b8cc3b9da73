"""What the workers say: probes, engine metrics adapters, DNS, the topology watcher."""
