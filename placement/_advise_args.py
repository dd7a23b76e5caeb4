"""The argument types of ``python -m placement advise``: numbers, counts, commit times and copy
counts, each refused with a message that says what was expected."""

from __future__ import annotations

import argparse
import math


def number(text: str) -> float:
    return _parse_float(text, allow_zero=False)


def number_or_zero(text: str) -> float:
    return _parse_float(text, allow_zero=True)


def _parse_float(text: str, *, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"must be {'>= 0' if allow_zero else '> 0'}, got {text}")
    return value


def count(text: str) -> int:
    return _parse_int(text, minimum=1)


def count_or_zero(text: str) -> int:
    return _parse_int(text, minimum=0)


def _parse_int(text: str, *, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def commit_seconds(text: str) -> float | dict[int, float]:
    if "=" not in text:
        return number_or_zero(text)
    out: dict[int, float] = {}
    for part in text.split(","):
        m, sep, seconds = part.partition("=")
        try:
            out[int(m)] = number_or_zero(seconds)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(
                f"expected seconds or REPLICAS=SECONDS,... like 1=1,2=3,3=5, got {text!r}"
            ) from None
        if int(m) < 1:
            raise argparse.ArgumentTypeError(f"replicas must be >= 1 in {text!r}")
    return out


def replica_counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected copy counts like 1,2,3, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"copy counts must be >= 1, got {text!r}")
    return values
