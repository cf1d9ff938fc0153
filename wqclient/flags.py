"""Go-style command-line flags, shared by wqbroker, wq-worker and wq-producer.

Every flag has a one-dash and a two-dash spelling and takes its value after a space or ``=``
(``-n 5``, ``--n=5``). Parsing is strict as Go's ``flag`` package is: a name that is not defined
exactly (``-nope``, or an abbreviation such as ``-add`` for ``-addr``) is an error, not a guess.
Any error is one line on stderr, ``prog: message``, and exit status 2; ``-h``, ``-help`` and
``--help`` print the usage and exit 0.

``wqbroker`` may import this module (as it imports ``wqclient.pb``): it holds no client code.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, NoReturn

_NUMBER = re.compile(r"^-\d+(\.\d*)?$")


@dataclass(frozen=True, slots=True)
class Flag:
    """One row of a command's flag table.

    ``parse`` turns the text into the value (raising ``argparse.ArgumentTypeError`` with a message
    naming what is wrong); ``choices`` limits the text to a fixed set instead. A flag whose
    default is a ``bool`` is a switch: ``-name`` alone means true, ``-name=false`` false. The
    help text gets `` (default X)`` appended, unless the default is ``False`` or ``""``.
    """

    name: str
    _: KW_ONLY
    default: Any
    help: str
    parse: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


class FlagParser(argparse.ArgumentParser):
    """argparse with Go's strictness about flag names and a one-line error."""

    def __init__(self, prog: str, description: str, flags: Sequence[Flag] = ()) -> None:
        super().__init__(prog=prog, description=description, add_help=False, allow_abbrev=False)
        self.add_argument(
            "-h", "-help", "--help", action="help", help="show this help message and exit"
        )
        for flag in flags:
            self.add_flag(flag)

    def add_flag(self, flag: Flag) -> None:
        names = (f"-{flag.name}", f"--{flag.name}")
        unset = flag.default is False or flag.default == ""
        text = flag.help if unset else f"{flag.help} (default {flag.default})"
        text = text.replace("%", "%%")  # argparse %-formats help texts
        if isinstance(flag.default, bool):
            self.add_argument(
                *names,
                dest=flag.dest,
                type=flag.parse or bool_flag,
                nargs="?",
                const=True,
                default=flag.default,
                metavar="BOOL",
                help=text,
            )
            return
        self.add_argument(
            *names,
            dest=flag.dest,
            type=flag.parse or str,
            choices=flag.choices,
            default=flag.default,
            metavar=flag.metavar,
            help=text,
        )

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        argv = list(sys.argv[1:] if args is None else args)
        known = set(self._option_string_actions)
        for arg in argv:
            if arg == "--":
                break
            # argparse would take "-add" for "-addr" (it matches prefixes of one-dash names even
            # with allow_abbrev=False): every name must be defined exactly.
            if arg.startswith("-") and not _NUMBER.match(arg):
                name = arg.split("=", 1)[0]
                if name not in known:
                    self.error(f"flag provided but not defined: {name}")
        parsed: argparse.Namespace = super().parse_args(argv, namespace)
        return parsed

    def error(self, message: str) -> NoReturn:
        """One line, ``prog: message``, and exit status 2 (argparse would print the usage too)."""
        self.exit(2, f"{self.prog}: {' '.join(message.split())}\n")


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


def priority(text: str) -> int:
    """A task priority: an integer from 0 to 9 (higher is served first)."""
    value = _int_at_least(0, text)
    if value > 9:
        raise argparse.ArgumentTypeError(f"must be from 0 to 9, got {value}")
    return value


def queue_list(text: str) -> list[str]:
    """``a,b``: queue names separated by commas, in order of preference (the broker checks the
    names themselves)."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of queue names")
    return names


def bool_flag(text: str) -> bool:
    """For ``-fail``, ``-fail=true``, ``-fail=false`` (as Go's flag package accepts)."""
    lowered = text.strip().lower()
    if lowered in ("1", "t", "true", "yes", "on"):
        return True
    if lowered in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")
