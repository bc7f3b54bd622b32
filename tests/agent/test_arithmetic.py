"""The calculator's evaluator: exact, normalising, errors as text, never eval."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from hybridrl.envs.arithmetic import ArithmeticError_, calculate, evaluate, format_value


def random_expression(rng: random.Random) -> str:
    terms = [str(rng.randint(0, 99999)) for _ in range(rng.randint(2, 5))]
    text = terms[0]
    for t in terms[1:]:
        text = f"{text} {rng.choice('+-*')} {t}"
        if rng.random() < 0.3:
            text = f"({text})"
    return text


def test_matches_python_integer_arithmetic_on_random_expressions():
    # Reference: Python's own integer arithmetic on expressions we generated (digits, + - *, parens).
    rng = random.Random(0)
    for _ in range(500):
        expr = random_expression(rng)
        assert evaluate(expr) == Fraction(eval(expr)), expr  # noqa: S307 - trusted reference input


@pytest.mark.parametrize("expr, want", [
    ("007 + 8", "15"), ("0012*034", "408"), ("1,234 * 2", "2468"), ("2^10", "1024"), ("2**10", "1024"),
    ("3 x 4", "12"), ("6 × 7", "42"), ("9 ÷ 3", "3"), ("−5 + 2", "-3"), ("10/4",
                                                                         "2.5"), ("10/3", "3.3333333333"),
    ("-7 // 2", "-4"), ("-7 % 3", "2"), ("0.1 + 0.2", "0.3"), ("1.50 * 2", "3"), ("2 * -3", "-6"),
    ("-(2 + 3) * 4", "-20"), ("2 ^ -1", "0.5"), ("((((1))))", "1"), ("  42  ", "42"),
])
def test_normalises_and_computes(expr, want):
    assert calculate(expr) == (want, True)


@pytest.mark.parametrize("expr, words", [
    ("1/0", "division by zero"), ("12 +", "number was expected"), ("(1+2", "missing ')'"),
    ("1+2)", "unexpected ')'"), ("abc", "unexpected character 'a'"), ("", "empty expression"),
    ("__import__('os').system('true')", "unexpected character '_'"), ("1e5", "unexpected character 'e'"),
    ("2**99999", "more than 1000 digits"), ("9" * 300, "longer than 256"), ("1,23 + 1", "malformed number"),
    ("2 ^ 0.5", "whole-number exponents"), ("(" * 80 + "1" + ")" * 80, "nested deeper than 64"),
])
def test_errors_are_text_for_the_model(expr, words):
    text, ok = calculate(expr)
    assert not ok and text.startswith("error: ") and words in text, text


def test_deep_nesting_is_refused_not_a_recursion_error():
    with pytest.raises(ArithmeticError_, match="nested deeper"):
        evaluate("-" * 100 + "1", max_chars=1000)
    with pytest.raises(ArithmeticError_, match="nested deeper"):
        evaluate("(" * 100 + "1" + ")" * 100, max_chars=1000)


def test_format_value():
    assert format_value(Fraction(-1, 3)) == "-0.3333333333"
    assert format_value(Fraction(1, 10**12)) == "0"
    assert format_value(Fraction(10**30)) == "1" + "0" * 30
