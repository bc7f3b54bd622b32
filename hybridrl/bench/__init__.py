"""Benchmarks runnable from the `hybridrl bench` command (their drivers live in benchmarks/)."""
