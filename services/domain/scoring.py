"""Exact-integer answers: the one rule that the built-in environments (arithmetic, calculator, the
MCP tool environment's default scorer, guess-the-number's guesses) read integers and score them by.

An answer is correct when it is, surrounding whitespace aside, exactly the expected integer ("7",
" -3 "; not "7!", "7.0" or "the answer is 7"). `answer_in_text` is the diagnosis beside it: was the
first integer anywhere in the answer the expected one, even when the format was not. Beside them, how
numbers are read from metadata and answers (`as_int`, `as_finite`)."""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

INTEGER = re.compile(r"-?\d+")
_INTEGER_VALUED = re.compile(r"(-?\d+)(?:\.0+)?")


class IntegerVerdict(NamedTuple):
    correct: float
    """1.0 when the answer, surrounding whitespace aside, is exactly the expected integer, else 0.0."""
    answer_in_text: float
    """1.0 when the first integer in the answer is the expected one (right number, maybe wrong format)."""


def as_int(value: Any) -> int | None:
    """`value` as an int if it is one, else None: metadata travels as a protobuf Struct, where every
    number is a float (3 arrives as 3.0), and datasets often write numbers as strings ("3", "3.0")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = _INTEGER_VALUED.fullmatch(value.strip())
        if match is not None:
            return int(match.group(1))
    return None


def as_finite(value: Any) -> float | None:
    """`value` as a float if it is a finite number as JSON carries one (an int or a float, not a bool
    and not a numeric string), else None: rewards and reward settings read from an answer or metadata."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def first_integer(text: str) -> int | None:
    """The first integer written anywhere in `text`, or None."""
    match = INTEGER.search(text)
    return None if match is None else int(match.group())


def score_integer(answer: str, expected: int) -> IntegerVerdict:
    """How `answer` (a model's final text) fares against the integer `expected`."""
    text = answer.strip()
    correct = INTEGER.fullmatch(text) is not None and int(text) == expected
    return IntegerVerdict(correct=float(correct), answer_in_text=float(first_integer(answer) == expected))
