"""Go-style command-line flags, shared by wqbroker, wq-worker and wq-producer.

Every flag has a one-dash and a two-dash spelling and takes its value after a space or ``=``
(``-n 5``, ``--n=5``). A switch (a flag shown with ``[BOOL]``) is true given alone (``-json``), and
takes a boolean after ``=`` (``-json=false``) or as the next word when that word is one
(``-json false``; :data:`BOOL_WORDS`): any other next word is the next argument, never its value.

Parsing is strict as Go's ``flag`` package is: a name that is not defined exactly (``-nope``,
or an abbreviation such as ``-add`` for ``-addr``) is an error, not a guess. Any error is one
line on stderr, ``prog: message``, and exit status 2; ``-h``, ``-help`` and ``--help`` print the
usage and exit 0.

The logging convention too: ``-log-format text|json`` (:func:`setup_logging`, and
:class:`JsonFormatter` for one JSON object a line).

Part of :mod:`wqwire`: the broker and the client's commands follow the same conventions, and
neither owns them.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import logging
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from datetime import UTC, datetime
from typing import Any, Final, NoReturn

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


SWITCH_NOTE: Final = (
    "[BOOL] flags are switches: alone they mean true; -x=false or -x false (also 0, no, off) "
    "turns one off, -x=true or -x true (1, yes, on) on."
)


def is_switch(action: argparse.Action) -> bool:
    """Whether ``action`` is a switch: a flag whose value is a boolean that may be left out."""
    return bool(action.option_strings) and action.nargs == "?" and action.const is True


def switch_spellings(parser: argparse.ArgumentParser) -> set[str]:
    """Every spelling (``-json``, ``--json``) of every switch of ``parser``."""
    return {name for a in parser._actions if is_switch(a) for name in a.option_strings}


def spell_switches(argv: Sequence[str], switches: set[str]) -> list[str]:
    """``argv`` with every switch given its value after ``=``: ``-json`` as ``-json=true``,
    ``-json false`` as ``-json=false`` (the next word taken only when it is a boolean), so a
    switch never takes the next argument by mistake. What follows ``--`` is left alone."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        if arg in switches:
            following = argv[i + 1] if i + 1 < len(argv) else None
            if following is not None and following.strip().lower() in BOOL_WORDS:
                out.append(f"{arg}={following}")
                i += 2
                continue
            out.append(f"{arg}=true")
        else:
            out.append(arg)
        i += 1
    return out


def add_switch(
    p: argparse.ArgumentParser, name: str, help: str, *, dest: str | None = None
) -> None:
    """A switch, ``-name [BOOL]`` (false unless given): see :data:`SWITCH_NOTE`."""
    p.add_argument(
        f"-{name}",
        f"--{name}",
        dest=dest or name.replace("-", "_"),
        type=bool_flag,
        nargs="?",
        const=True,
        default=False,
        metavar="BOOL",
        help=help,
    )


class FlagParser(argparse.ArgumentParser):
    """argparse with Go's strictness about flag names and a one-line error.

    With ``env_prefix`` (``"WQ_"``), every flag added with :meth:`add_flag` can also be set from
    the environment: ``WQ_`` + its name in capitals with ``-`` as ``_`` (``-grpc-addr``:
    ``WQ_GRPC_ADDR``). A flag on the command line wins over its variable; an empty variable is
    unset; a bad value is the same one-line error as a bad flag, naming the variable."""

    def __init__(
        self,
        prog: str,
        description: str,
        flags: Sequence[Flag] = (),
        *,
        env_prefix: str | None = None,
    ) -> None:
        if env_prefix is not None:
            description += (
                f" Every flag can also be set from the environment: {env_prefix} + its name in "
                f"capitals, - as _ (as shown after each flag); a flag given wins."
            )
        super().__init__(prog=prog, description=description, add_help=False, allow_abbrev=False)
        self.env_prefix = env_prefix
        self._from_env: list[tuple[str, Flag]] = []  # (variable, flag)
        self.add_argument(
            "-h", "-help", "--help", action="help", help="show this help message and exit"
        )
        for flag in flags:
            self.add_flag(flag)

    def env_var(self, flag: Flag) -> str | None:
        """The environment variable that sets ``flag`` (None without an ``env_prefix``)."""
        if self.env_prefix is None:
            return None
        return self.env_prefix + flag.dest.upper()

    def add_flag(self, flag: Flag) -> None:
        names = (f"-{flag.name}", f"--{flag.name}")
        unset = flag.default is False or flag.default == ""
        text = flag.help if unset else f"{flag.help} (default {flag.default})"
        var = self.env_var(flag)
        if var is not None:
            self._from_env.append((var, flag))
            text += f" [${var}]"
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
        argv = self.spell_switches(sys.argv[1:] if args is None else args)
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
        given = {arg.split("=", 1)[0] for arg in itertools.takewhile(lambda a: a != "--", argv)}
        for var, flag in self._from_env:
            text = os.environ.get(var, "")
            if text.strip() and not given & {f"-{flag.name}", f"--{flag.name}"}:
                setattr(parsed, flag.dest, self._env_value(var, flag, text))
        return parsed

    def spell_switches(self, argv: Sequence[str]) -> list[str]:
        """``argv`` with each switch's value after ``=`` (:func:`spell_switches`)."""
        return spell_switches(list(argv), switch_spellings(self))

    def format_help(self) -> str:
        """The help, with :data:`SWITCH_NOTE` when there are switches."""
        text = super().format_help()
        if any(is_switch(a) for a in self._actions):
            width = max(min(shutil.get_terminal_size().columns, 80) - 2, 40)
            text += "\n" + textwrap.fill(SWITCH_NOTE, width) + "\n"
        return text

    def _env_value(self, var: str, flag: Flag, text: str) -> Any:
        """The value of ``flag`` from variable ``var``; a bad one exits as a bad flag does."""
        if flag.choices is not None and text not in flag.choices:
            choices = ", ".join(repr(c) for c in flag.choices)
            self.error(
                f"environment variable {var}: invalid choice: {text!r} (choose from {choices})"
            )
        parse = flag.parse or (bool_flag if isinstance(flag.default, bool) else str)
        try:
            return parse(text)
        except (argparse.ArgumentTypeError, ValueError) as e:
            self.error(f"environment variable {var}: {e}")

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


TRUE_WORDS: Final = frozenset({"1", "t", "true", "yes", "on"})
FALSE_WORDS: Final = frozenset({"0", "f", "false", "no", "off"})
BOOL_WORDS: Final = TRUE_WORDS | FALSE_WORDS
"""What a switch takes as its value (in any case): after ``=``, or as the next word."""


def bool_flag(text: str) -> bool:
    """For ``-fail``, ``-fail=true``, ``-fail false`` (:data:`BOOL_WORDS`, in any case)."""
    lowered = text.strip().lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")


# -- logging: -log-format ---------------------------------------------------------------------

LOG_FORMATS: Final = ("text", "json")

# What every LogRecord has: anything else on a record was passed with ``extra=``.
_RECORD_FIELDS: Final = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys() | {"message", "asctime", "taskName"}
)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (RFC 3339, UTC), ``level``, ``logger``, ``message``, then
    every field the call passed with ``extra=`` (``task_id``, ``queue``, ``outcome`` ...), and
    ``exception`` (its traceback) if there is one. Values JSON cannot hold are given as text."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC)
        out: dict[str, Any] = {
            "time": when.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                out.setdefault(key, value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: int, log_format: str, text_format: str) -> None:
    """Log to stderr at ``level``: lines of ``text_format`` (``-log-format text``), or JSON
    objects (``-log-format json``: :class:`JsonFormatter`)."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(text_format)
    handler.setFormatter(formatter)
    logging.basicConfig(level=level, handlers=[handler])


# -- the commands' entry points ------------------------------------------------------------------

_OURS: Final = frozenset({"wqbroker", "wqclient", "wqwire"})


def run_command(prog: str, module: str, extra: str) -> int:
    """Run ``module``'s ``main()`` (a command's entry point). If a package it needs is not
    installed, say in one line which extra of the ``wqueue`` distribution brings it, and exit
    status 1, instead of a traceback (``pip install wqueue`` is the client alone)."""
    try:
        main = importlib.import_module(module).main
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if not missing or missing in _OURS:
            raise
        print(f"{prog}: {missing} is not installed: pip install 'wqueue[{extra}]'", file=sys.stderr)
        return 1
    return int(main())
