"""Run the documentation's runnable blocks, as a reader would, and report what differs.

A fenced block is run only if the line right before its fence is a marker comment::

    <!-- wq:run -->
    ```console
    $ curl -s localhost:8080/stats
    {"ready":0,...}
    ```

The syntax (docs/development/docs.md is the writer's guide):

- ``<!-- wq:run [OPTIONS] -->`` before a fence. Options, space-separated (shell quoting):
  ``background`` (run it for the rest of the page, a second terminal), with ``wait=URL`` (poll
  until the URL answers 200) or ``wait-output="TEXT"`` (until its output holds TEXT), up to 30 s
  or ``timeout=``; ``file=NAME`` (write the block's text as NAME, do not run it); ``retry=SECONDS``
  (run it again until it passes, up to SECONDS); ``timeout=SECONDS`` (default 60); ``install``
  (the block installs wq: skipped, since the venv the page runs with has it, except in the
  newcomer run, where ``wqueue`` in its ``pip install`` lines is replaced by a built wheel's path).
- Languages: ``sh``/``bash``/``shell`` (run by the page's one bash, so variables and ``cd`` carry
  over; any failing command fails the block); ``console`` (``$ `` lines are commands, ``\\``
  continues one; the lines up to the next ``$ `` are its expected output: a line ``...`` matches
  any number of lines, ``...`` in a line any text; no lines: not checked; the exit status must be
  0 unless the command ends in ``# exit N``); ``python`` (the page's ``python``, from the shell's
  directory, with its exported variables; must exit 0; its output is checked against the next
  block if that is a ``text`` block marked ``<!-- wq:output -->``).
- ``<!-- wq:hidden`` ... ``-->``: shell run at that point, never shown.

Each page runs in a fresh temporary directory with one ``bash --noprofile --norc`` (a session of
its own), ``PATH`` starting with the venv's bin. Everything the page started (the shell's process
group, each background block's, each python block's) is killed when it ends, and the broker's
default ports (8080, 50051) must be free before a page starts and after it ends.

Command line: ``python -m tests.docs.runner docs/x.md [more.md] [-v] [--bin DIR] [--wheel WHL]``:
exits 1 if any block failed, printing each failure (page, line, command, expected, actual).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Final, TextIO

ROOT: Final = Path(__file__).resolve().parent.parent.parent
DEFAULT_BIN: Final = ROOT / ".venv" / "bin"
DEFAULT_PORTS: Final = (8080, 50051)  # the broker's HTTP and gRPC ports: pages run one at a time
DEFAULT_TIMEOUT: Final = 60.0
DEFAULT_WAIT: Final = 30.0
PORTS_WAIT = 10.0  # how long the ports may take to be free, before a page and after it

SHELLS: Final = frozenset({"sh", "bash", "shell"})
LANGUAGES: Final = SHELLS | {"console", "python"}
_FLAGS: Final = frozenset({"background", "install"})
_VALUED: Final = frozenset({"wait", "wait-output", "file", "retry", "timeout"})

_MARKER = re.compile(r"^(?P<indent>\s*)<!--\s*wq:(?P<kind>run|output)\b(?P<options>.*?)-->\s*$")
_HIDDEN = re.compile(r"^\s*<!--\s*wq:hidden\b(?P<rest>.*)$")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*\{?\.?(?P<lang>[\w+-]*)")
_EXIT = re.compile(r"#\s*exit\s+(?P<status>\d+)\s*$")
_PIP_INSTALL = re.compile(r"\bpip3?\s+install\b")
_REQUIREMENT = re.compile(
    r"(?<![\w./-])(?P<q>['\"]?)wqueue(?P<extras>\[[\w,\s-]*\])?(?P=q)(?![\w./-])"
)


class DocError(Exception):
    """A page the runner cannot read: a marker not followed by a fence, an unknown option..."""

    def __init__(self, page: Path | str, line: int, message: str) -> None:
        super().__init__(f"{page}:{line}: {message}")


@dataclass(frozen=True)
class Options:
    background: bool = False
    install: bool = False
    wait_url: str | None = None
    wait_output: str | None = None
    file: str | None = None
    retry: float = 0.0
    timeout: float | None = None  # (None: DEFAULT_TIMEOUT, or DEFAULT_WAIT for a wait)


@dataclass(frozen=True)
class Command:
    """One ``$ `` command of a console block."""

    line: int  # its line in the page
    text: str
    expected: tuple[str, ...] | None  # None: its output is not checked
    status: int = 0


@dataclass
class Block:
    page: Path
    line: int  # the line of its opening fence (a hidden block's: of its comment), 1-based
    lang: str  # "sh" for a hidden block
    text: str
    options: Options = field(default_factory=Options)
    hidden: bool = False
    expected_output: str | None = None  # the wq:output block after it
    output_line: int = 0  # that block's line
    commands: tuple[Command, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


# ----------------------------------------------------------------------------------------------
# Reading a page


def parse_options(text: str, page: Path | str = "?", line: int = 0) -> Options:
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise DocError(page, line, f"cannot read the marker's options: {e}") from e
    flags: dict[str, bool] = {}
    values: dict[str, str] = {}
    for word in words:
        name, eq, value = word.partition("=")
        if not eq and name in _FLAGS:
            flags[name] = True
        elif eq and name in _VALUED and value:
            values[name] = value
        else:
            known = ", ".join(sorted(_FLAGS) + [f"{v}=..." for v in sorted(_VALUED)])
            raise DocError(page, line, f"unknown wq:run option {word!r} (known: {known})")
    try:
        retry = float(values.get("retry", 0))
        timeout = float(values["timeout"]) if "timeout" in values else None
    except ValueError as e:
        raise DocError(page, line, f"retry= and timeout= take seconds: {e}") from e
    background = flags.get("background", False)
    wait_url, wait_output = values.get("wait"), values.get("wait-output")
    if (wait_url or wait_output) and not background:
        raise DocError(page, line, "wait= and wait-output= are for background blocks")
    return Options(
        background=background,
        install=flags.get("install", False),
        wait_url=wait_url,
        wait_output=wait_output,
        file=values.get("file"),
        retry=retry,
        timeout=timeout,
    )


def parse_console(text: str, first_line: int, page: Path | str = "?") -> tuple[Command, ...]:
    """The commands of a console block whose first line is the page's ``first_line``."""
    commands: list[Command] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$"):
            if lines[i].strip():
                raise DocError(page, first_line + i, "a console block starts with a '$ ' command")
            i += 1
            continue
        start = i
        parts = [lines[i][1:].removeprefix(" ")]
        while parts[-1].endswith("\\") and i + 1 < len(lines):
            i += 1
            parts.append(lines[i])
        i += 1
        output: list[str] = []
        while i < len(lines) and not lines[i].startswith("$"):
            output.append(lines[i].rstrip())
            i += 1
        while output and not output[-1]:
            output.pop()
        command = "\n".join(parts)
        status = _EXIT.search(parts[-1])
        commands.append(
            Command(
                line=first_line + start,
                text=command,
                expected=tuple(output) if output else None,
                status=int(status["status"]) if status else 0,
            )
        )
    return tuple(commands)


def _fence_end(lines: list[str], start: int, indent: str, fence: str) -> int:
    """The index of the line closing the fence opened at ``start`` (len(lines) if none)."""
    closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
    for j in range(start + 1, len(lines)):
        if closing.match(lines[j]):
            return j
    return len(lines)


def _dedent(lines: list[str], indent: str) -> str:
    return "".join(
        (ln[len(indent) :] if ln.startswith(indent) else ln.lstrip()) + "\n" for ln in lines
    )


def parse(text: str, page: Path | str = "?") -> list[Block]:
    """Every block of the page that the runner runs, in order (install blocks included)."""
    page = Path(page)
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: tuple[str, str, int] | None = None  # (kind, options, line) of a marker just read
    last_fenced: Block | None = None  # the block of the last fence, if it was marked
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            end = _fence_end(lines, i, fence["indent"], fence["fence"])
            body = _dedent(lines[i + 1 : end], fence["indent"])
            last_fenced = _fenced(page, i + 1, fence["lang"], body, pending, last_fenced, blocks)
            pending = None
            i = end + 1
            continue
        if pending is not None and line.strip():
            raise DocError(page, pending[2], f"wq:{pending[0]} must be right before a fence")
        marker = _MARKER.match(line)
        hidden = _HIDDEN.match(line)
        if marker:
            pending = (marker["kind"], marker["options"], i + 1)
        elif hidden:
            i = _hidden(page, lines, i, hidden["rest"], blocks)
        i += 1
    if pending is not None:
        raise DocError(page, pending[2], f"wq:{pending[0]} must be right before a fence")
    return blocks


def _hidden(page: Path, lines: list[str], i: int, rest: str, blocks: list[Block]) -> int:
    """Reads a hidden block starting at line index ``i``; returns the index of its last line."""
    body: list[str] = []
    j = i
    text = rest
    while "-->" not in text:
        body.append(text)
        j += 1
        if j >= len(lines):
            raise DocError(page, i + 1, "wq:hidden is never closed with -->")
        text = lines[j]
    body.append(text[: text.index("-->")])
    script = "\n".join(body)  # (its first line is the comment's: line numbers stay right)
    blocks.append(Block(page=page, line=i + 1, lang="sh", text=script + "\n", hidden=True))
    return j


def _fenced(
    page: Path,
    line: int,
    lang: str,
    body: str,
    pending: tuple[str, str, int] | None,
    previous: Block | None,
    blocks: list[Block],
) -> Block | None:
    """Takes in a fenced block at ``line``; the block it makes, if it was marked wq:run."""
    if pending is None:
        return None
    kind, options_text, marker_line = pending
    if kind == "output":
        if previous is None or previous.options.background or previous.lang == "console":
            raise DocError(page, marker_line, "wq:output must follow a python or shell block")
        previous.expected_output = body
        previous.output_line = line
        return None
    options = parse_options(options_text, page, marker_line)
    if options.file is None and lang not in LANGUAGES:
        known = ", ".join(sorted(LANGUAGES))
        raise DocError(page, line, f"cannot run a {lang or 'plain'} block ({known}, or file=)")
    if options.background and lang == "python":
        raise DocError(page, line, "a background block is shell or console")
    block = Block(page=page, line=line, lang=lang, text=body, options=options)
    if lang == "console" and options.file is None:
        block.commands = parse_console(body, line + 1, page)
    blocks.append(block)
    return block


def has_blocks(page: Path) -> bool:
    """Whether the page has any runnable block (markers inside fences do not count)."""
    return bool(parse(page.read_text(), page))


def matches(expected: Sequence[str], actual: Sequence[str]) -> bool:
    """Whether the output lines ``actual`` are what ``expected`` says, ``...`` being wildcards."""
    want = [e.rstrip() for e in expected]
    got = [a.rstrip() for a in actual]
    while want and not want[-1]:
        want.pop()
    while got and not got[-1]:
        got.pop()

    @cache
    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(got)
        if want[i].strip() == "...":
            return match(i + 1, j) or (j < len(got) and match(i, j + 1))
        return j < len(got) and _line_matches(want[i], got[j]) and match(i + 1, j + 1)

    return match(0, 0)


def _line_matches(want: str, got: str) -> bool:
    if "..." not in want:
        return want == got
    pattern = ".*".join(re.escape(part) for part in want.split("..."))
    return re.fullmatch(pattern, got) is not None


def substitute_wheel(text: str, wheel: Path | str) -> str:
    """An install block's text with the ``wqueue`` requirement of each ``pip install`` line
    replaced by the wheel's path (its extras kept): ``pip install 'wqueue[broker,cli]'`` becomes
    ``pip install '/tmp/.../wqueue-0.1.0-py3-none-any.whl[broker,cli]'``."""

    def one(m: re.Match[str]) -> str:
        return f"{m['q']}{wheel}{m['extras'] or ''}{m['q']}"

    return "\n".join(
        _REQUIREMENT.sub(one, line) if _PIP_INSTALL.search(line) else line
        for line in text.split("\n")
    )


# ----------------------------------------------------------------------------------------------
# Running a page


@dataclass
class Failure:
    where: str  # page:line of the block (or of its command)
    what: str
    command: str | None = None
    expected: str | None = None
    actual: str | None = None
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        out = [f"{self.where}: {self.what}"]
        if self.command is not None:
            out.append(_section("command", self.command))
        if self.expected is not None:
            out.append(_section("expected", self.expected))
        if self.actual is not None:
            out.append(_section("actual", self.actual))
        out.extend(self.notes)
        return "\n".join(out)


def _section(title: str, text: str) -> str:
    body = text.rstrip("\n")
    return f"  --- {title} ---\n" + ("\n".join("  | " + ln for ln in body.split("\n")) or "  |")


@dataclass
class PageResult:
    page: Path
    failures: list[Failure] = field(default_factory=list)
    passed: int = 0
    skipped: int = 0  # install blocks (outside the newcomer run), blocks after a dead shell

    @property
    def ok(self) -> bool:
        return not self.failures

    def report(self) -> str:
        head = f"{self.page}: {self.passed} passed, {len(self.failures)} failed"
        head += f", {self.skipped} skipped" if self.skipped else ""
        return "\n\n".join([head, *map(str, self.failures)])


class _ShellGone(Exception):
    """The page's shell exited or a block in it ran past its time-out: the page stops."""


# The page's shell: a command that fails in a block (a sourced file: BASH_SOURCE is set) writes
# its status, line and text to $__wq_ef (the first one only) and returns from the block; set -E
# carries the trap into functions. (Not `set -e`: that would end the shell, and with it the page.)
_SHELL_INIT = (
    "set -E\n"
    '__wq_err() { [ -e "$__wq_ef" ] || printf "%s\\n%s\\n%s" "$1" "$2" "$3" >"$__wq_ef"; }\n'
    # (one line: $LINENO in a trap of several lines is off by them)
    'trap \'__wq_rc=$?; if [ "${#BASH_SOURCE[@]}" -gt 0 ]; then'
    ' __wq_err "$__wq_rc" "$LINENO" "$BASH_COMMAND"; return $__wq_rc; fi\' ERR\n'
)
_TAIL = 40  # lines of a log shown with a failure


def _tail(text: str, n: int = _TAIL) -> str:
    lines = text.rstrip("\n").split("\n")
    cut = [f"[... {len(lines) - n} lines before]"] if len(lines) > n else []
    return "\n".join(cut + lines[-n:])


def _is_venv_bin(entry: str) -> bool:
    return (Path(entry).parent / "pyvenv.cfg").exists()


def page_environment(bin_dir: Path | None) -> dict[str, str]:
    """The page's environment: this one's, less anything that would change what the commands
    do (``WQ_*``, ``PYTHONPATH``, pytest's, any virtualenv on ``PATH``), with ``bin_dir`` first."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONSAFEPATH"}
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("WQ_", "PYTEST_", "COV_"))
    }
    path = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and not _is_venv_bin(p)]
    if bin_dir is not None:
        path.insert(0, str(bin_dir))
        env["VIRTUAL_ENV"] = str(bin_dir.parent)
    env["PATH"] = os.pathsep.join(path)
    return env


def port_busy(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


def _wait_ports_free(ports: Sequence[int], seconds: float) -> list[int]:
    """Waits until nothing answers on ``ports``; those still answering after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        busy = [p for p in ports if port_busy(p)]
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group is still running (zombies not counted: the init of a
    container may take a second or two to reap the orphans)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # (after the command: state, ppid, pgrp)
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


@contextlib.contextmanager
def _ports_lock(ports: Sequence[int], out: TextIO | None) -> Iterator[None]:
    """Holds a lock, shared by every runner on this machine, for the ports: two runs of pages
    that use the broker's default ports (two shells, a test beside the command line) take
    turns instead of failing each other."""
    if not ports:
        yield
        return
    name = "wq-docs-ports-" + "-".join(map(str, sorted(ports))) + ".lock"
    with (Path(tempfile.gettempdir()) / name).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if out is not None:
                print(f"waiting for another run of pages on ports {list(ports)}", file=out)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _kill_group(leader: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """SIGTERM to the process group ``leader`` leads (``start_new_session``), then SIGKILL to
    whatever of it is left after ``grace``."""
    pgid = leader.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        leader.poll()  # (reaped: a zombie leader would keep the group "alive")
        if not _group_alive(pgid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


@dataclass
class _Background:
    block: Block
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def note(self) -> str:
        """A note on it for a failure: its output's last lines (all of the tail if it has
        exited, the likely cause of what followed)."""
        status = self.proc.poll()
        if status is None:
            title = f"the background block at {self.block.where} (running); its last output"
            return _section(title, _tail(self.output(), 10))
        return _section(
            f"the background block at {self.block.where} has exited ({status}); its output",
            _tail(self.output()),
        )


class PageRun:
    """One page being run: its directory, its shell, what it started."""

    def __init__(
        self,
        page: Path,
        *,
        bin_dir: Path | None,
        wheel: Path | None,
        ports: Sequence[int],
        verbose: bool,
        out: TextIO,
    ) -> None:
        self.page = page
        self.wheel = wheel
        self.ports = tuple(ports)
        self.verbose = verbose
        self.out = out
        self.env = page_environment(bin_dir)
        self.result = PageResult(_shown(page))
        self.root = Path(tempfile.mkdtemp(prefix="wq-docs-"))
        self.work = self.root / "work"  # the reader's directory
        self.ctl = self.root / "ctl"  # the runner's files: scripts, outputs, logs
        self.work.mkdir()
        self.ctl.mkdir()
        self.backgrounds: list[_Background] = []
        self.shell: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._step = 0

    # -- the page's shell ----------------------------------------------------------------

    def _start_shell(self) -> subprocess.Popen[bytes]:
        shell = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=self.work,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(self.ctl / "shell.err").open("wb"),
            start_new_session=True,
        )
        assert shell.stdin is not None
        shell.stdin.write(_SHELL_INIT.encode())
        shell.stdin.flush()
        return shell

    def _shell_do(self, script: str, timeout: float) -> tuple[int, str, list[str] | None]:
        """Runs ``script`` in the page's shell: its status, its output (stdout and stderr) and,
        if a command in it failed, [status, line in the script, command]."""
        if self.shell is None:
            self.shell = self._start_shell()
        self._step += 1
        n = self._step
        script_file, out, err = (self.ctl / f"{n}.{ext}" for ext in ("sh", "out", "err"))
        script_file.write_text(script)
        q = shlex.quote
        driver = (
            f"__wq_ef={q(str(err))}; {{ source {q(str(script_file))}; }} >{q(str(out))} 2>&1"
            f' </dev/null; echo "__WQ_DONE_{n} $?"\n'
        )
        assert self.shell.stdin is not None
        try:
            self.shell.stdin.write(driver.encode())
            self.shell.stdin.flush()
        except BrokenPipeError:
            raise _ShellGone(self._shell_gone()) from None
        status = self._await(n, time.monotonic() + timeout)
        output = out.read_text(errors="replace") if out.exists() else ""
        if status is None:
            self._stop_shell()
            raise _ShellGone(f"timed out after {timeout:g} s", output)
        failed = err.read_text(errors="replace").split("\n", 2) if err.exists() else None
        return status, output, failed

    def _await(self, n: int, deadline: float) -> int | None:
        assert self.shell is not None
        assert self.shell.stdout is not None
        fd = self.shell.stdout.fileno()
        marker = f"__WQ_DONE_{n} ".encode()
        while True:
            for line in self._buffer.split(b"\n")[:-1]:
                if line.startswith(marker):
                    self._buffer = b""
                    return int(line[len(marker) :])
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 0.2))
            # (Not only at the end of its output: a subshell it forked holds that open.)
            if not ready and self.shell.poll() is not None:
                raise _ShellGone(self._shell_gone())
            if ready:
                data = os.read(fd, 65536)
                if not data:
                    raise _ShellGone(self._shell_gone())
                self._buffer += data

    def _shell_gone(self) -> str:
        assert self.shell is not None
        try:
            status = self.shell.wait(5)
        except subprocess.TimeoutExpired:
            status = None
        err = (self.ctl / "shell.err").read_text(errors="replace")
        return f"the page's shell exited ({status}): did a block run exit?" + (
            "\n" + _tail(err) if err.strip() else ""
        )

    def _stop_shell(self) -> None:
        if self.shell is not None:
            _kill_group(self.shell, grace=1.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.shell.wait(5)

    def _shell_state(self) -> tuple[Path, dict[str, str]]:
        """The shell's current directory and exported variables (what a program it ran gets)."""
        status, _, _ = self._shell_do(
            f"pwd >{shlex.quote(str(self.ctl / 'pwd'))}\n"
            f"env -0 >{shlex.quote(str(self.ctl / 'env'))}\n",
            10,
        )
        assert status == 0, "could not read the page shell's directory and environment"
        cwd = Path((self.ctl / "pwd").read_text().strip())
        env = dict(
            item.split("=", 1) for item in (self.ctl / "env").read_text().split("\0") if "=" in item
        )
        return cwd, env

    # -- blocks --------------------------------------------------------------------------

    def run(self) -> PageResult:
        try:
            blocks = parse(self.page.read_text(), _shown(self.page))
        except DocError as e:
            self.result.failures.append(
                Failure(str(self.result.page), f"cannot read the page: {e}")
            )
            return self.result
        with _ports_lock(self.ports, self.out if self.verbose else None):
            busy = _wait_ports_free(self.ports, PORTS_WAIT)
            if busy:
                what = f"port(s) {busy} in use before the page started: something else holds them"
                self.result.failures.append(Failure(str(self.result.page), what))
                return self.result
            try:
                self._run_blocks(blocks)
            finally:
                self._finish()
        return self.result

    def _run_blocks(self, blocks: list[Block]) -> None:
        for index, block in enumerate(blocks):
            if block.options.install and self.wheel is None:
                self._log(block, "skipped (install)")
                self.result.skipped += 1
                continue
            started = time.monotonic()
            try:
                failure = self._run_with_retry(block)
            except _ShellGone as gone:
                text = gone.args[0]
                output = gone.args[1] if len(gone.args) > 1 else None
                command = block.text if not block.commands else None
                failure = Failure(block.where, text, command=command, actual=output)
                self._failed(block, failure)
                self.result.skipped += len(blocks) - index - 1
                self._log(block, f"stopping the page: {len(blocks) - index - 1} block(s) not run")
                return
            took = time.monotonic() - started
            if failure is None:
                self.result.passed += 1
                self._log(block, f"ok ({took:.1f} s)")
            else:
                self._failed(block, failure)

    def _failed(self, block: Block, failure: Failure) -> None:
        failure.notes.extend(b.note() for b in self.backgrounds if b.block is not block)
        self.result.failures.append(failure)
        self._log(block, "FAILED")
        if self.verbose:
            print(str(failure), file=self.out)

    def _log(self, block: Block, what: str) -> None:
        if self.verbose:
            kind = (
                "hidden"
                if block.hidden
                else block.lang + (" background" * block.options.background)
            )
            print(f"{block.where} [{kind}] {what}", file=self.out, flush=True)

    def _run_with_retry(self, block: Block) -> Failure | None:
        deadline = time.monotonic() + block.options.retry
        tries = 0
        while True:
            tries += 1
            failure = self._run_block(block)
            if failure is None or block.options.background or time.monotonic() >= deadline:
                if failure is not None and tries > 1:
                    failure.what += f" (tried {tries} times over {block.options.retry:g} s)"
                return failure
            time.sleep(0.5)

    def _run_block(self, block: Block) -> Failure | None:
        timeout = block.options.timeout or DEFAULT_TIMEOUT
        if block.options.file is not None:
            return self._write_file(block)
        if block.options.background:
            return self._start_background(block)
        if block.lang == "python":
            return self._run_python(block, timeout)
        if block.lang == "console":
            return self._run_console(block, timeout)
        return self._run_shell(block, timeout)

    def _script(self, block: Block) -> str:
        if block.commands:
            return "".join(c.text + "\n" for c in block.commands)
        if block.options.install and self.wheel is not None:
            return substitute_wheel(block.text, self.wheel)
        return block.text

    def _write_file(self, block: Block) -> Failure | None:
        assert block.options.file is not None
        cwd, _ = self._shell_state()
        target = cwd / block.options.file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text)
        return None

    def _run_shell(self, block: Block, timeout: float) -> Failure | None:
        status, output, failed = self._shell_do(self._script(block), timeout)
        if status != 0:
            what = f"exited {status}"
            if failed and len(failed) == 3 and failed[1].isdigit():
                line = block.line + int(failed[1]) - (1 if block.hidden else 0)
                what = f"a command failed (exit {failed[0]}) at line {line}: {failed[2]}"
            return Failure(block.where, what, command=block.text, actual=output)
        return self._check_output(block, output)

    def _check_output(self, block: Block, output: str) -> Failure | None:
        if block.expected_output is None:
            return None
        if matches(block.expected_output.splitlines(), output.splitlines()):
            return None
        return Failure(
            f"{block.page}:{block.output_line}",
            f"the output of the block at line {block.line} is not what the page shows",
            command=block.text,
            expected=block.expected_output,
            actual=output,
        )

    def _run_console(self, block: Block, timeout: float) -> Failure | None:
        deadline = time.monotonic() + timeout
        for command in block.commands:
            left = max(deadline - time.monotonic(), 0.1)
            try:
                status, output, _ = self._shell_do(command.text + "\n", left)
            except _ShellGone as gone:
                raise _ShellGone(f"{gone.args[0]}: $ {command.text}", *gone.args[1:]) from None
            where = f"{block.page}:{command.line}"
            if status != command.status:
                return Failure(
                    where,
                    f"exited {status}, not {command.status}",
                    command=command.text,
                    actual=output,
                )
            if command.expected is not None and not matches(command.expected, output.splitlines()):
                return Failure(
                    where,
                    "the output is not what the page shows",
                    command=command.text,
                    expected="\n".join(command.expected),
                    actual=output,
                )
        return None

    def _run_python(self, block: Block, timeout: float) -> Failure | None:
        cwd, env = self._shell_state()
        python = shutil.which("python", path=env.get("PATH")) or "python"
        proc = subprocess.Popen(
            [python, "-"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            data, _ = proc.communicate(block.text.encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc, grace=1.0)
            data, _ = proc.communicate()
            output = data.decode(errors="replace")
            return Failure(block.where, f"timed out after {timeout:g} s", block.text, None, output)
        finally:
            _kill_group(proc, grace=1.0)  # (anything it left behind)
        output = data.decode(errors="replace")
        if proc.returncode != 0:
            return Failure(block.where, f"exited {proc.returncode}", block.text, None, output)
        return self._check_output(block, output)

    def _start_background(self, block: Block) -> Failure | None:
        cwd, env = self._shell_state()
        n = len(self.backgrounds) + 1
        script, log = self.ctl / f"background-{n}.sh", self.ctl / f"background-{n}.log"
        script.write_text(self._script(block))
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                ["bash", "--noprofile", "--norc", str(script)],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        background = _Background(block, proc, log)
        self.backgrounds.append(background)
        return self._wait_for(background)

    def _wait_for(self, background: _Background) -> Failure | None:
        options = background.block.options
        if options.wait_url is None and options.wait_output is None:
            return None
        seconds = options.timeout or DEFAULT_WAIT
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if options.wait_url is not None and _answers_200(options.wait_url):
                time.sleep(0.2)  # (not another's: one that could not listen exits at once)
                if background.proc.poll() is None:
                    return None
            if options.wait_output is not None and options.wait_output in background.output():
                return None
            if background.proc.poll() is not None:
                what = f"exited ({background.proc.returncode}) before it was ready"
                return Failure(
                    background.block.where,
                    what,
                    background.block.text,
                    None,
                    _tail(background.output()),
                )
            time.sleep(0.2)
        until = (
            f"{options.wait_url} answered 200"
            if options.wait_url
            else f"{options.wait_output!r} in its output"
        )
        return Failure(
            background.block.where,
            f"not ready after {seconds:g} s (waited until {until})",
            background.block.text,
            None,
            _tail(background.output()),
        )

    def _finish(self) -> None:
        """Kills everything the page started; checks that the ports are free again."""
        self._stop_shell()
        for background in self.backgrounds:
            _kill_group(background.proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                background.proc.wait(5)
        if self.shell is not None:
            for stream in (self.shell.stdin, self.shell.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        busy = _wait_ports_free(self.ports, PORTS_WAIT)
        if busy:
            what = (
                f"port(s) {busy} still answer after the page ended and everything it started "
                "was killed: a process left its process group, or something else holds them"
            )
            self.result.failures.append(Failure(str(self.result.page), what))
        shutil.rmtree(self.root, ignore_errors=True)


def _shown(page: Path) -> Path:
    """The page as failures name it: relative to the current directory if it is under it."""
    try:
        return page.resolve().relative_to(Path.cwd())
    except ValueError:
        return page


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def run_page(
    page: Path | str,
    *,
    bin_dir: Path | None = DEFAULT_BIN,
    wheel: Path | None = None,
    ports: Sequence[int] = DEFAULT_PORTS,
    verbose: bool = False,
    out: TextIO = sys.stderr,
) -> PageResult:
    """Runs every runnable block of the page; what passed and what failed.

    ``bin_dir`` goes first on ``PATH`` (None: the system's ``PATH`` alone, less any virtualenv);
    ``wheel``: the newcomer run, install blocks executed with it in place of ``wqueue``;
    ``ports``: free before the page starts, and again once all it started is killed."""
    return PageRun(
        Path(page), bin_dir=bin_dir, wheel=wheel, ports=ports, verbose=verbose, out=out
    ).run()


def pages_with_blocks(root: Path) -> Iterator[Path]:
    """The pages under ``root`` that have a runnable block (or cannot be read), sorted."""
    for page in sorted(root.rglob("*.md")):
        try:
            if has_blocks(page):
                yield page
        except DocError:
            yield page


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.docs.runner",
        description="Run the runnable blocks of documentation pages (docs/development/docs.md).",
    )
    parser.add_argument("pages", nargs="+", type=Path, help="Markdown pages, run one at a time")
    parser.add_argument("-v", "--verbose", action="store_true", help="say how each block went")
    parser.add_argument(
        "--bin",
        type=Path,
        default=DEFAULT_BIN,
        help="the directory put first on PATH (default: %(default)s)",
    )
    parser.add_argument(
        "--wheel",
        type=Path,
        help="the newcomer run: execute install blocks, with this wheel in place of wqueue",
    )
    args = parser.parse_args(argv)
    failed = 0
    for page in args.pages:
        result = run_page(
            page,
            bin_dir=args.bin.resolve(),
            wheel=args.wheel.resolve() if args.wheel else None,
            verbose=args.verbose,
            out=sys.stdout,
        )
        # (-v printed each failure as it happened)
        report = result.report()
        print(report.split("\n")[0] if args.verbose or result.ok else report, flush=True)
        failed += not result.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
