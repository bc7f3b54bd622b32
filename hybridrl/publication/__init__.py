"""Moving trained weights into rollout engines: plans, buckets, transports, manifests, parity."""
