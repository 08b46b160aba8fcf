"""argparse value types shared by the subcommands: a bad value is argparse's usage error naming the
option, the value and what is allowed, never a traceback."""

import argparse


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer ≥ {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer ≥ {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def positive_int_list(text: str) -> list[int]:
    """`1,4,16` → [1, 4, 16]."""
    try:
        return [positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated integers ≥ 1 (e.g. 1,4,16), got {text!r}"
        ) from None
