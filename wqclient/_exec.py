"""``ExecHandler``: a Worker handler that runs a program once per task (``wq worker -exec``;
docs/design/tasks.md), so a task can be handled in any language.

The program's stdin is the payload's exact JSON text, then EOF. Its environment is the worker's
(plus ``env``), with ``WQ_TASK_ID``, ``WQ_ATTEMPT``, ``WQ_MAX_ATTEMPTS``, ``WQ_QUEUE``,
``WQ_TASK_NAME`` (the payload's ``"task"``, if it is an object with a string one) and, for a task
with parents, ``WQ_PARENTS`` (``[{"id": ..., "result": ...}]``; past 64 KiB, written to a file
named by ``WQ_PARENTS_FILE`` instead, removed afterwards).

Its exit status decides: 0 acks (stdout, if it is JSON, is the task's result; other output is
not one, and is logged at DEBUG), 100 fails the task for good (``Fail``: to the dead-letter
queue), any other status or a signal nacks it (retried), the error being the last lines of its
stderr (or "exited with status N" / "killed by signal SIGSEGV"). A cancel, a time limit or a
shutdown (the Worker cancels the handler) sends SIGTERM to the program's process group (it runs
in a session of its own, so its own children are reached too), then SIGKILL ``kill_grace``
seconds later.

What is read of it is capped: stdout at 16 MiB (beyond it, the output is drained and dropped,
and the task fails: no result that large is taken), stderr's tail only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, Final, cast

from wqclient.models import ParentResult, Task
from wqclient.worker import Fail, TaskFailed

log = logging.getLogger("wqclient.exec")

#: The exit status that fails a task for good (a terminal nack).
EXIT_FAIL: Final = 100
#: The most of stdout kept (a result); a program that writes more fails its task.
MAX_STDOUT: Final = 16 * 1024 * 1024
#: How much of stderr's end is kept, and how much of that (its last lines) an error tells.
STDERR_KEPT: Final = 64 * 1024
ERROR_LINES: Final = 20
ERROR_BYTES: Final = 4096
#: Past this size, the parents go in a file (``WQ_PARENTS_FILE``) rather than ``WQ_PARENTS``.
MAX_PARENTS_ENV: Final = 64 * 1024


class ProgramError(TaskFailed):
    """The program failed (a status other than 0 and 100, or a signal), or could not be run:
    the task is nacked (retried) with this text alone as its error."""


class ExecHandler:
    """An async Worker handler that runs ``argv`` once per task (see the module's text).

    ``argv``: the program and its arguments, run without a shell (give one yourself:
    ``["sh", "-c", "..."]``). ``kill_grace``: seconds between the SIGTERM and the SIGKILL of a
    program that is stopped. ``env``: variables added to the worker's environment (which is
    read once, here)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        kill_grace: float = 5.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if isinstance(argv, str):
            raise TypeError("argv is a sequence of strings (the program, then its arguments)")
        self.argv = list(argv)
        if not self.argv or not self.argv[0]:
            raise ValueError("no program to run: argv is empty")
        if kill_grace < 0:
            raise ValueError("kill_grace must be at least 0")
        self.kill_grace = kill_grace
        _check_program(self.argv[0])
        self._env = dict(os.environ)
        if env is not None:
            self._env.update(env)

    def __repr__(self) -> str:
        return f"ExecHandler({self.argv!r})"

    async def __call__(self, task: Task) -> bytes | None:
        env, parents_file = self._environment(task)
        try:
            return await self._run(task, env)
        finally:
            if parents_file is not None:
                try:
                    os.unlink(parents_file)
                except OSError:
                    pass

    def _environment(self, task: Task) -> tuple[dict[str, str], str | None]:
        """The program's environment for ``task``; the parents' file to remove after, if any."""
        env = self._env.copy()
        env["WQ_TASK_ID"] = task.id
        env["WQ_ATTEMPT"] = str(task.attempts)
        env["WQ_MAX_ATTEMPTS"] = str(task.max_attempts)
        env["WQ_QUEUE"] = task.queue
        name = _task_name(task.payload_json)
        if name is not None:
            env["WQ_TASK_NAME"] = name
        else:
            env.pop("WQ_TASK_NAME", None)
        env.pop("WQ_PARENTS", None)
        env.pop("WQ_PARENTS_FILE", None)
        parents = task.parents
        if not parents:
            return env, None
        text = _parents_json(parents)
        if len(text) <= MAX_PARENTS_ENV:
            env["WQ_PARENTS"] = text
            return env, None
        fd, path = tempfile.mkstemp(prefix=f"wq-parents-{task.id}-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        env["WQ_PARENTS_FILE"] = path
        return env, path

    async def _run(self, task: Task, env: dict[str, str]) -> bytes | None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        # The spawn is shielded: a cancel that lands in it (before the pipes are connected)
        # would go to asyncio's own clean-up, which SIGKILLs the program's pid alone, and a
        # child it had started by then would live on. The cancel waits for the spawn instead,
        # then stops the program's whole group as any other.
        spawn = asyncio.ensure_future(
            loop.subprocess_exec(
                lambda: _Output(done),
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        )
        cancelled = False
        while True:
            try:
                transport, output = await asyncio.shield(spawn)
                break
            except asyncio.CancelledError:
                if spawn.cancelled():
                    raise
                cancelled = True  # (the spawn goes on: its program is stopped below)
            except OSError as e:
                if cancelled:
                    raise asyncio.CancelledError from e
                raise ProgramError(f"cannot run {self.argv[0]!r}: {e.strerror or e}") from e
        if cancelled:
            try:
                await self._stop(transport, output)
            finally:
                transport.close()
            raise asyncio.CancelledError
        try:
            _feed(transport, task.payload_json)
            await asyncio.shield(done)  # (a cancel must not cancel ``done``: _stop waits on it)
        except asyncio.CancelledError:
            await self._stop(transport, output)
            raise
        finally:
            transport.close()
        return self._outcome(task, transport.get_returncode(), output)

    async def _stop(self, transport: asyncio.SubprocessTransport, output: _Output) -> None:
        """The handler was cancelled: SIGTERM to the program's process group, SIGKILL after
        ``kill_grace`` seconds if it has not ended (with its pipes), and reap it."""
        pid = transport.get_pid()
        _signal_group(pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(output.done), self.kill_grace)
        except TimeoutError:
            log.debug("program %s (pid %d) still runs: SIGKILL", self.argv[0], pid)
        except asyncio.CancelledError:
            pass  # (cancelled again: kill it now)
        _signal_group(pid, signal.SIGKILL)  # (whatever of its group is left: its children)
        if transport.get_returncode() is None:
            await asyncio.shield(output.exited)

    def _outcome(self, task: Task, status: int | None, output: _Output) -> bytes | None:
        """The task's result, or the exception that says how the program failed."""
        if status == 0:
            if output.over:
                raise Fail(
                    f"the program wrote more than {MAX_STDOUT // (1024 * 1024)} MiB to stdout: "
                    "too large for a result"
                )
            self._log_stderr(task, output)
            return _result(task, bytes(output.out))
        error = _stderr_tail(output.err)
        if status == EXIT_FAIL:
            raise Fail(error or f"exit {EXIT_FAIL}")
        if status is not None and status < 0:
            how = f"killed by signal {_signal_name(-status)}"
        else:
            how = f"exited with status {status}"
        raise ProgramError(error or how)

    def _log_stderr(self, task: Task, output: _Output) -> None:
        if output.err and log.isEnabledFor(logging.DEBUG):
            log.debug("task %s: the program's stderr: %s", task.id, _stderr_tail(output.err))


class _Output(asyncio.SubprocessProtocol):
    """What the program writes, capped; ``done`` once it has exited and its pipes are closed,
    ``exited`` once it has exited."""

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done
        self.exited: asyncio.Future[None] = done.get_loop().create_future()
        self.out = bytearray()
        self.err = bytearray()
        self.over = False  # stdout passed MAX_STDOUT: it is dropped

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        if isinstance(data, str):  # (never: the pipes are bytes)
            data = data.encode()
        if fd == 1:
            if self.over:
                return
            if len(self.out) + len(data) > MAX_STDOUT:
                self.over = True
                self.out = bytearray()
                return
            self.out += data
        elif fd == 2:
            err = self.err
            err += data
            if len(err) > 2 * STDERR_KEPT:
                del err[:-STDERR_KEPT]

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        # (the process has exited and every pipe is closed)
        if not self.exited.done():
            self.exited.set_result(None)
        if not self.done.done():
            self.done.set_result(None)


def _feed(transport: asyncio.SubprocessTransport, payload: bytes) -> None:
    """Write the payload to the program's stdin and close it (a program that does not read
    it, or is gone, is no error)."""
    pipe = transport.get_pipe_transport(0)
    if pipe is None:
        return
    # (a write transport, though not always of asyncio's class: uvloop's is its own)
    stdin = cast(asyncio.WriteTransport, pipe)
    try:
        stdin.write(payload)
        stdin.write_eof()
    except (BrokenPipeError, ConnectionResetError, RuntimeError):
        pass


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # (its own session: its group is its pid)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _result(task: Task, out: bytes) -> bytes | None:
    """stdout as the task's result: its text stripped, if it is JSON; else none."""
    text = out.strip()
    if not text:
        return None
    try:
        json.loads(text)
    except ValueError:
        log.debug(
            "task %s: the program's output is not JSON, so not a result: %r",
            task.id,
            text[:200],
        )
        return None
    return text


def _stderr_tail(err: bytearray) -> str:
    """The last lines of stderr (at most ERROR_LINES, ERROR_BYTES), stripped."""
    tail = bytes(err[-ERROR_BYTES:]).decode("utf-8", "replace").strip()
    lines = tail.splitlines()
    if len(lines) > ERROR_LINES:
        tail = "\n".join(lines[-ERROR_LINES:])
    return tail


def _task_name(payload: bytes) -> str | None:
    """The payload's ``"task"``, if it is an object with a string one."""
    if not payload.lstrip().startswith(b"{"):
        return None
    try:
        value: Any = json.loads(payload)
    except ValueError:
        return None
    name = value.get("task") if isinstance(value, dict) else None
    return name if isinstance(name, str) else None


def _parents_json(parents: tuple[ParentResult, ...]) -> str:
    """``[{"id": ..., "result": ...}]``, each result's JSON text as it is (null if none)."""
    items = []
    for parent in parents:
        result = parent.result_json
        text = "null" if result is None else result.decode("utf-8")
        items.append(f'{{"id":{json.dumps(parent.id)},"result":{text}}}')
    return "[" + ",".join(items) + "]"


def _check_program(program: str) -> None:
    """Raise a clear error now if ``program`` cannot be run (missing, not executable)."""
    if os.sep in program or (os.altsep is not None and os.altsep in program):
        if not os.path.exists(program):
            raise FileNotFoundError(f"program not found: {program!r}")
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            raise PermissionError(f"program is not executable: {program!r}")
        return
    if shutil.which(program) is None:
        raise FileNotFoundError(f"program not found on PATH: {program!r}")
