"""Verifiers: versioned reward functions. Each reward component records the evaluator that made it."""

from hybridrl.reward.base import RewardResult
from hybridrl.reward.answer import AnswerFormat, ExactNumber, parse_number

__all__ = ["AnswerFormat", "ExactNumber", "RewardResult", "parse_number"]
