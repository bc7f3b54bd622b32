from __future__ import annotations

from fractions import Fraction

import pytest

from hybridrl.reward import AnswerFormat, ExactNumber, RewardResult, parse_number


@pytest.mark.parametrize("text, value", [
    ("408", 408), (" 00408 ", 408), ("+7", 7), ("-0", 0), ("1,234", 1234), ("−5",
                                                                            -5), ("3.50", Fraction(7, 2)),
    ("12*34", None), ("1,23", None), ("", None), (None, None), ("4 08", None), ("0x10", None), ("1e3", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_exact_number_and_format():
    exact, fmt = ExactNumber(), AnswerFormat()
    assert exact("0408", "408") == 1.0 and exact("408.0", "408") == 1.0 and exact("407", "408") == 0.0
    assert exact(None, "408") == 0.0
    with pytest.raises(ValueError, match="not a number"):
        exact("1", "abc")
    assert fmt("408", 1, True) == 1.0 and fmt("408", 2, True) == 0.0 and fmt("408", 1, False) == 0.0
    assert fmt("four", 1, True) == 0.0
    assert exact.id == "exact_number@1" and fmt.id == "answer_format@1"


def test_reward_result_weights():
    r = RewardResult().add("a", 1.0, "x@1").add("b", 1.0, "y@2", weight=0.25)
    assert r.total == 1.25 and r.evaluators == {"a": "x@1", "b": "y@2"}


def test_numbers_of_any_length_are_read_exactly():
    """Past Python's int-string limit (4300 digits) int() raises ValueError: an evaluator error (the
    episode INFRA_INVALID) caused by what the policy wrote. Read in chunks, it is a wrong answer."""
    huge = "9" * 5000
    assert parse_number(huge) == 10 ** 5000 - 1
    assert parse_number(f"-{huge}.{huge}0") == -(Fraction(10 ** 5000 - 1) + Fraction(10 ** 5000 - 1, 10 ** 5000))
    assert parse_number("0" * 6000 + "42") == 42
    exact, fmt = ExactNumber(), AnswerFormat()
    assert exact(huge, "408") == 0.0 and fmt(huge, 1, True) == 1.0
    assert exact("0" * 9000 + "408", "408") == 1.0
