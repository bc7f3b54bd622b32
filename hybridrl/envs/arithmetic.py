"""A safe arithmetic evaluator: tokenize, parse (recursive descent), compute with exact fractions.

Never `eval`: the input is model-generated text. Numbers are normalised (`007` is 7, `1,234`
is 1234, `3.50` is 7/2); `x`/`×`, `÷` and the unicode minus are accepted; `^` and `**` are powers.
Every problem is an `ArithmeticError_` whose message is meant to be shown to the model as text.

    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "/" | "//" | "%") unary)*
    unary  := ("+" | "-") unary | power
    power  := atom (("**" | "^") unary)?
    atom   := NUMBER | "(" expr ")"
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MAX_DIGITS = 1000        # a result (numerator or denominator) above 10**MAX_DIGITS is refused
MAX_DEPTH = 64           # parenthesis / unary nesting
DECIMALS = 10            # non-integer results are rounded to this many decimals

_TOKEN = re.compile(r"\s*(?:(\d[\d,_]*(?:\.\d*)?|\.\d+)|(\*\*|//|[-+*/%^()]))")
_SYNONYMS = str.maketrans({"×": "*", "x": "*", "X": "*", "·": "*", "÷": "/", "−": "-", "–": "-"})


class ArithmeticError_(ValueError):
    """A parse or evaluation problem, phrased for the model (`str(err)`)."""


def _number(text: str, position: int) -> Fraction:
    clean = text.replace(",", "").replace("_", "")
    if "," in text and not re.fullmatch(r"\d{1,3}(,\d{3})*(\.\d*)?", text):
        raise ArithmeticError_(f"malformed number '{text}' at position {position}")
    whole, _, frac = clean.partition(".")
    if len(whole) + len(frac) > MAX_DIGITS:
        raise ArithmeticError_(f"number at position {position} has too many digits")
    value = Fraction(int(whole or "0"))          # int() normalises leading zeros
    if frac:
        value += Fraction(int(frac), 10 ** len(frac))
    return value


def tokenize(expression: str) -> list[tuple[str, object, int]]:
    """[(kind, value, position)] with kind "num" (Fraction value) or "op" (str value)."""
    text = expression.translate(_SYNONYMS)
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            bad = text[pos:].lstrip()[:1]
            where = len(text) - len(text[pos:].lstrip())
            raise ArithmeticError_(f"unexpected character '{bad}' at position {where}")
        start = match.start(1) if match.group(1) else match.start(2)
        if match.group(1):
            tokens.append(("num", _number(match.group(1), start), start))
        else:
            tokens.append(("op", match.group(2), start))
        pos = match.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, object, int]], length: int):
        self.tokens, self.i, self.length, self.depth = tokens, 0, length, 0

    def peek(self) -> str | None:
        return self.tokens[self.i][1] if self.i < len(self.tokens) and self.tokens[self.i][0] == "op" else None

    def where(self) -> str:
        return f"position {self.tokens[self.i][2]}" if self.i < len(self.tokens) else "the end"

    def take(self):
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def parse(self) -> Fraction:
        if not self.tokens:
            raise ArithmeticError_("empty expression")
        value = self.expr()
        if self.i != len(self.tokens):
            raise ArithmeticError_(f"unexpected '{self.tokens[self.i][1]}' at {self.where()}")
        return value

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            rhs = self.term()
            value = _check(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            _, op, pos = self.take()
            rhs = self.unary()
            if op == "*":
                value = _check(value * rhs)
                continue
            if rhs == 0:
                raise ArithmeticError_(f"division by zero at position {pos}")
            if op == "/":
                value = _check(value / rhs)
            elif op == "//":
                value = Fraction(math.floor(value / rhs))
            else:
                value = _check(value - rhs * math.floor(value / rhs))
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            op = self.take()[1]
            self.enter()
            value = self.unary()
            self.depth -= 1
            return -value if op == "-" else value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() in ("**", "^"):
            pos = self.take()[2]
            exponent = self.unary()
            return _power(base, exponent, pos)
        return base

    def atom(self) -> Fraction:
        if self.i >= len(self.tokens):
            raise ArithmeticError_("expression ends where a number was expected")
        kind, value, pos = self.take()
        if kind == "num":
            return value  # type: ignore[return-value]
        if value == "(":
            self.enter()
            inner = self.expr()
            self.depth -= 1
            if self.peek() != ")":
                raise ArithmeticError_(f"missing ')' for the '(' at position {pos}")
            self.take()
            return inner
        raise ArithmeticError_(f"unexpected '{value}' at position {pos}")

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ArithmeticError_(f"expression nested deeper than {MAX_DEPTH}")


def _check(value: Fraction) -> Fraction:
    if max(abs(value.numerator), value.denominator).bit_length() > MAX_DIGITS * 3.33:
        raise ArithmeticError_(f"result has more than {MAX_DIGITS} digits")
    return value


def _power(base: Fraction, exponent: Fraction, pos: int) -> Fraction:
    if exponent.denominator != 1:
        raise ArithmeticError_(f"only whole-number exponents are supported (position {pos})")
    e = int(exponent)
    if base == 0 and e < 0:
        raise ArithmeticError_(f"division by zero (0 to a negative power) at position {pos}")
    size = max(abs(base.numerator), base.denominator)
    # size >= 2 has log10(size) >= 0.30: an exponent above 4 * MAX_DIGITS is too large before any float
    # arithmetic (which would overflow for exponents like 10^400)
    if size > 1 and (abs(e) > 4 * MAX_DIGITS or abs(e) * math.log10(size) > MAX_DIGITS):
        raise ArithmeticError_(f"result has more than {MAX_DIGITS} digits")
    return _check(base ** e)


def evaluate(expression: str, *, max_chars: int = 256) -> Fraction:
    """The exact value of `expression`; raises `ArithmeticError_` with a message for the model."""
    if len(expression) > max_chars:
        raise ArithmeticError_(f"expression longer than {max_chars} characters")
    return _Parser(tokenize(expression), len(expression)).parse()


def format_value(value: Fraction) -> str:
    """Integers exactly; other values rounded to `DECIMALS` decimals without trailing zeros."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    scaled = round(abs(value) * 10 ** DECIMALS)
    whole, frac = divmod(scaled, 10 ** DECIMALS)
    text = f"{whole}.{frac:0{DECIMALS}d}".rstrip("0").rstrip(".")
    return sign + text if text != "0" else "0"


def calculate(expression: str, *, max_chars: int = 256) -> tuple[str, bool]:
    """(text for the model, ok): the formatted value, or `error: ...`."""
    try:
        return format_value(evaluate(expression, max_chars=max_chars)), True
    except ArithmeticError_ as err:
        return f"error: {err}", False
