"""The commands reference (docs/reference/commands.md) from the commands' own parsers: for
``wqbroker``, ``wq`` and each of its commands, ``wq worker``, ``wq-worker`` and ``wq-producer``,
the usage line and every flag and argument (its environment variable, default and help), read
from the argparse parser each command builds when it runs."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ref_markdown import block, code, inline, table

from wqwire.flags import SWITCH_NOTE, Flag, is_switch

_VARIABLE = re.compile(r"\$(WQ_[A-Z0-9_]+)")
_DEFAULT = re.compile(r"\(default ([^;)]*)")  # (a help's "(default ...": where its variables are)
_WIDTH = "100"  # (argparse wraps the usage line at $COLUMNS)


@dataclass(frozen=True)
class Command:
    """A command and the parser it builds."""

    name: str  # "wqbroker", "wq dlq requeue"
    parser: argparse.ArgumentParser
    summary: str = ""


def commands() -> list[Command]:
    """Every command, in the order of the page."""
    import wqbroker.__main__ as broker
    from wqclient.cli import admin, completion, producer, run, worker

    out = [Command("wqbroker", broker.build_parser())]
    out.append(Command("wq", admin.top_parser()))
    out += [Command(f"wq {name}", c.parser(), c.summary) for name, c in admin.COMMANDS.items()]
    out.append(Command("wq worker", run.build_parser(), admin.WORKER_SUMMARY))
    out.append(
        Command("wq completion", _completion_parser(completion.SHELLS), admin.COMPLETION_SUMMARY)
    )
    out.append(Command("wq-worker", worker.build_parser()))
    out.append(Command("wq-producer", producer.build_parser()))
    return out


def _completion_parser(shells: tuple[str, ...]) -> argparse.ArgumentParser:
    """``wq completion`` reads its one argument by hand: a parser that says the same."""
    p = argparse.ArgumentParser(prog="wq completion", add_help=False)
    p.add_argument("-h", "-help", "--help", action="help", help="show this help message and exit")
    p.add_argument("shell", choices=shells, help="the shell to print a completion script for")
    return p


def anchor(name: str) -> str:
    """A command's anchor: words joined by ``-``, a command's own ``-`` as ``_`` (``wq worker``:
    ``wq-worker``; the command ``wq-worker``: ``wq_worker``)."""
    return "-".join(word.replace("-", "_") for word in name.split())


def summary_of(command: Command) -> str:
    """What a command does: its summary, else its parser's description (up to a list)."""
    text = command.summary or (command.parser.description or "").split("\n\n")[0]
    return " ".join(text.split())


@contextmanager
def _columns(width: str) -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def _flags_of(parser: argparse.ArgumentParser) -> dict[str, tuple[str, Flag]]:
    """The flags a FlagParser reads from the environment, by dest: (variable, flag)."""
    from_env: list[tuple[str, Flag]] = getattr(parser, "_from_env", [])
    return {flag.dest: (var, flag) for var, flag in from_env}


def spelling(action: argparse.Action) -> str:
    """How a flag or an argument is written: ``-addr ADDR``, ``-json [BOOL]``, ``ID``."""
    if not action.option_strings:
        return str(action.metavar or action.dest)
    name = action.option_strings[0]
    if action.nargs == 0:
        return name
    if is_switch(action):
        return f"{name} [BOOL]"
    if action.metavar is not None:
        value = str(action.metavar)
    elif action.choices is not None:
        value = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        value = action.dest.upper()
    return f"{name} {value}"


def _default(action: argparse.Action, flag: Flag | None) -> str:
    value = flag.default if flag is not None else action.default
    if value is None or value is argparse.SUPPRESS or value == "" or value is False:
        return ""
    if isinstance(value, list | tuple):
        value = ",".join(str(v) for v in value)
    return code(str(value))


def _row(action: argparse.Action, flags: dict[str, tuple[str, Flag]]) -> list[str]:
    var, flag = flags.get(action.dest, (None, None))
    text = flag.help if flag is not None else (action.help or "")
    if text is argparse.SUPPRESS:
        text = ""
    text = text.replace("%%", "%")
    said = " ".join(_DEFAULT.findall(text))
    variables = [var] if var else list(dict.fromkeys(_VARIABLE.findall(said)))
    choices = action.choices if action.choices is not None and flag is None else None
    if flag is not None and flag.choices is not None:
        choices = flag.choices
    described = inline(text)
    if choices is not None:
        described += "<br><small>one of " + ", ".join(code(str(c)) for c in choices) + "</small>"
    names = " ".join(code(n) for n in action.option_strings[1:])
    if names:
        described += f"<br><small>also {names}</small>"
    return [
        code(spelling(action)),
        ", ".join(code("$" + v) for v in variables),
        _default(action, flag),
        described,
    ]


def section(command: Command, level: int = 2) -> str:
    """One command: its usage, description and a table of its flags and arguments."""
    parser = command.parser
    with _columns(_WIDTH):
        usage = parser.format_usage().strip()
    out = [f"{'#' * level} {command.name} {{ #{anchor(command.name)} }}", ""]
    summary = summary_of(command)
    if summary:
        out += [block(summary), ""]
    out += ["```text", usage, "```", ""]
    if parser.epilog:
        out += ["```text", parser.epilog.strip(), "```", ""]
    flags = _flags_of(parser)
    actions = [a for a in parser._actions if not isinstance(a, argparse._SubParsersAction)]
    positionals = [a for a in actions if not a.option_strings]
    options = [a for a in actions if a.option_strings]
    header = ["Flag", "Environment", "Default", "Description"]
    if positionals:
        rows = [_row(a, flags) for a in positionals]
        out += [table(["Argument", "Environment", "Default", "Description"], rows), ""]
    out += [table(header, [_row(a, flags) for a in options]), ""]
    return "\n".join(out)


def render(listing: Callable[[], list[Command]] = commands) -> str:
    """The page's generated body."""
    found = listing()
    rows = [[f"[{c.name}](#{anchor(c.name)})", inline(summary_of(c))] for c in found]
    out = [table(["Command", "What it does"], rows), "", block(SWITCH_NOTE), ""]
    for c in found:
        level = 3 if c.name.startswith("wq ") else 2
        out.append(section(c, level))
    return "\n".join(out)
