"""Verifiers of a final numeric answer: exact value (normalised) and answer format.

The answer must be a number literal, not an expression: "12*34" is not an answer to "what is
12*34". Normalisation: surrounding space, a leading "+", thousands separators ("1,234") and
leading zeros ("007") are accepted; "408.0" equals 408.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def parse_number(text: str | None) -> Fraction | None:
    """The value of a number literal, or None if `text` is not exactly one number."""
    if text is None:
        return None
    text = text.strip().replace("\u2212", "-")
    if not _NUMBER.fullmatch(text):
        return None
    sign = -1 if text.startswith("-") else 1
    whole, _, frac = text.lstrip("+-").replace(",", "").partition(".")
    value = Fraction(int(whole)) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
    return sign * value


class ExactNumber:
    """1.0 when the answer's value equals the reference's, else 0.0."""

    name, version = "exact_number", 1

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"

    def __call__(self, answer: str | None, reference: str) -> float:
        got, want = parse_number(answer), parse_number(reference)
        if want is None:
            raise ValueError(f"reference answer {reference!r} is not a number")
        return 1.0 if got is not None and got == want else 0.0


class AnswerFormat:
    """1.0 when the episode ended with exactly one <answer> holding a number literal."""

    name, version = "answer_format", 1

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"

    def __call__(self, answer: str | None, num_answers: int, completed: bool) -> float:
        return 1.0 if completed and num_answers == 1 and parse_number(answer) is not None else 0.0
