"""Flag parsing shared by wq-worker and wq-producer (Go-style flags: -name value, -name=value, and
the -- spellings)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def bool_flag(text: str) -> bool:
    """For ``-fail``, ``-fail=true``, ``-fail=false`` (as Go's flag package accepts)."""
    lowered = text.strip().lower()
    if lowered in ("1", "t", "true", "yes", "on"):
        return True
    if lowered in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")
