"""Flag parsing shared by wq-worker and wq-producer (Go-style flags: -name value, -name=value, and
the -- spellings)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

_NUMBER = re.compile(r"^-\d+(\.\d*)?$")


class FlagParser(argparse.ArgumentParser):
    """argparse with Go's strictness about flag names: ``-nope`` is an unknown flag, not ``-n``
    with the value ``ope``. Values go after a space or ``=``."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        argv = list(sys.argv[1:] if args is None else args)
        known = set(self._option_string_actions)
        for arg in argv:
            if arg == "--":
                break
            if arg.startswith("-") and not _NUMBER.match(arg):
                name = arg.split("=", 1)[0]
                if name not in known:
                    self.error(f"flag provided but not defined: {name}")
        parsed: argparse.Namespace = super().parse_args(argv, namespace)
        return parsed


def _int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        rule = "must not be negative" if minimum == 0 else f"must be at least {minimum}"
        raise argparse.ArgumentTypeError(f"{rule}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(1, text)


def non_negative_int(text: str) -> int:
    return _int_at_least(0, text)


def bool_flag(text: str) -> bool:
    """For ``-fail``, ``-fail=true``, ``-fail=false`` (as Go's flag package accepts)."""
    lowered = text.strip().lower()
    if lowered in ("1", "t", "true", "yes", "on"):
        return True
    if lowered in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")
