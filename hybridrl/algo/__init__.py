"""Algorithms as small pure functions: advantage estimators, policy losses, KL, aggregation, filters."""
