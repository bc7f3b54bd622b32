"""Environments: the protocol, the leased environment service, and the tasks (`tasks/`)."""

