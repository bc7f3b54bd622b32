"""hybridrl: colocated single-controller hybrid-engine reinforcement learning for LLM agents."""

__version__ = "0.1.0"
