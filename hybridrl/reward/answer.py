"""Verifiers of a final numeric answer: exact value (normalised) and answer format.

The answer must be a number literal, not an expression: "12*34" is not an answer to "what is
12*34". Normalisation: surrounding space, a leading "+", thousands separators ("1,234") and
leading zeros ("007") are accepted; "408.0" equals 408. A literal of any length is read exactly
(its digits are converted in chunks, below Python's int-string limit), so a 5000-digit answer is a
wrong answer, not an evaluator error.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_CHUNK = 500            # digits per int() call: below any int-string limit Python allows (>= 640)


def digits_to_int(digits: str) -> int:
    """int(digits) for a string of decimal digits of any length (int() refuses more than
    sys.get_int_max_str_digits(), 4300 by default)."""
    digits = digits.lstrip("0") or "0"
    value = 0
    for i in range(0, len(digits), _CHUNK):
        chunk = digits[i:i + _CHUNK]
        value = value * 10 ** len(chunk) + int(chunk)
    return value


def parse_number(text: str | None) -> Fraction | None:
    """The value of a number literal, or None if `text` is not exactly one number."""
    if text is None:
        return None
    text = text.strip().replace("\u2212", "-")
    if not _NUMBER.fullmatch(text):
        return None
    sign = -1 if text.startswith("-") else 1
    whole, _, frac = text.lstrip("+-").replace(",", "").partition(".")
    frac = frac.rstrip("0")
    value = Fraction(digits_to_int(whole)) + (Fraction(digits_to_int(frac), 10 ** len(frac)) if frac else 0)
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
    """1.0 when the episode ended with exactly one `<answer>` holding a number literal."""

    name, version = "answer_format", 1

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"

    def __call__(self, answer: str | None, num_answers: int, completed: bool) -> float:
        return 1.0 if completed and num_answers == 1 and parse_number(answer) is not None else 0.0
