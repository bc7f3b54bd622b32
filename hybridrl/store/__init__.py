"""State that must survive: run checkpoints (and the trajectory log)."""
