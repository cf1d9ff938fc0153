"""``ProcessRunner``: the task framework's sync functions run in child processes
(``wq worker -pool processes``; docs/design/tasks.md).

``size`` children, one task at a time each, started with ``multiprocessing``'s "spawn" context
(a fork of a process with threads, gRPC's among them, is unsafe). Each child imports the App by
reference (``"pkg.module:attr"``, with the parent's ``sys.path`` and working directory), and
then runs the tasks it is sent: ``app.tasks[name].invoke(args, kwargs, ctx)``, with a context of
its own whose progress reports go back over the child's pipe to the parent's context.

One pipe per child carries everything, pickled: the task's call, its progress reports (each
answered, so ``ctx.report_progress`` blocks until the broker has it, as in a thread) and its
outcome. Exceptions cross as data: ``Retry`` and ``Fail`` as their fields (their ``__init__``
does not survive plain exception pickling), any other exception as itself if it pickles (its
traceback in the child added as a note), else a ``RuntimeError`` with its text. The parent waits
on each pipe with the event loop's reader (no thread, no polling).

Hard limits: cancelling ``run()`` (a cancel, a time limit, a shutdown past its grace: the Worker
cancels the handler) kills the child running that task with SIGKILL, at once, starts another in
its place and lets the ``CancelledError`` through. A child that dies on its own (a segfault,
``os._exit``, the OOM killer) fails its task (``the worker process died: ...``) and is replaced.
Children ignore SIGINT: a Ctrl-C in the terminal reaches the whole process group, and it is the
parent that decides what becomes of the tasks in hand.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import inspect
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Final

from wqclient.worker import Fail, Retry, describe

if TYPE_CHECKING:
    from wqclient.app import Context, TaskFunction

log = logging.getLogger("wqclient.procpool")

#: How long ``close()`` lets children end on their own (their pipe closed) before killing them.
CLOSE_GRACE: Final = 5.0


# -- the messages -------------------------------------------------------------------------------
# parent -> child: ("run", name, args, kwargs, fields); the answer to a progress report:
#   ("progress_ok",) or ("progress_err", error)
# child -> parent: ("ready", pid) once the app is loaded, or ("broken", text) (and it exits);
#   ("progress", value); ("ok", value) or ("err", error)
# An error: ("retry", delay_ms, error), ("fail", error), or ("exc", pickled or None, text, tb).
_RUN: Final = "run"
_READY: Final = "ready"
_BROKEN: Final = "broken"
_PROGRESS: Final = "progress"
_PROGRESS_OK: Final = ("progress_ok",)
_PROGRESS_ERR: Final = "progress_err"
_OK: Final = "ok"
_ERR: Final = "err"

ErrorData = tuple[Any, ...]


def _error_data(error: BaseException) -> ErrorData:
    """An exception as data that crosses the pipe (see :func:`_error_from`)."""
    if type(error) is Retry:
        return ("retry", error.delay_ms, error.error)
    if type(error) is Fail:
        return ("fail", error.error)
    text = describe(error)
    trace = "".join(traceback.format_exception(error))
    blob: bytes | None = None
    if isinstance(error, Exception):  # (a SystemExit is not re-raised in the parent)
        try:
            blob = pickle.dumps(error)
            pickle.loads(blob)  # (one that pickles may still not unpickle)
        except Exception:
            blob = None
    if blob is None and isinstance(error, Retry):  # (a subclass that does not pickle)
        return ("retry", error.delay_ms, error.error)
    if blob is None and isinstance(error, Fail):
        return ("fail", error.error)
    return ("exc", blob, text, trace)


def _error_from(data: ErrorData) -> Exception:
    """The exception that :func:`_error_data` described, to raise here."""
    kind = data[0]
    if kind == "retry":
        return Retry(delay_ms=data[1], error=data[2])
    if kind == "fail":
        return Fail(data[1])
    _, blob, text, trace = data
    if blob is not None:
        try:
            error = pickle.loads(blob)
        except Exception:
            error = None
        if isinstance(error, Exception):
            if trace:
                error.add_note("in the worker process:\n" + trace.rstrip())
            return error
    return RuntimeError(text)


# -- the child ----------------------------------------------------------------------------------


def _load_app(ref: str) -> Any:
    """The object ``"pkg.module:attr"`` names (``attr`` may be dotted)."""
    module_name, colon, attr = ref.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"an app reference is 'module:attribute', got {ref!r}")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


class _PipeSink:
    """The child's progress sink: each report goes to the parent, which answers once the
    parent's context has it (or with the error it raised, raised here)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    @property
    def cancelled(self) -> bool:
        return False  # (a cancelled task's child is killed)

    def report_progress(self, value: Any) -> None:
        self._conn.send((_PROGRESS, value))
        answer = self._conn.recv()
        if answer[0] == _PROGRESS_ERR:
            raise _error_from(answer[1])

    async def progress(self, value: Any) -> None:
        self.report_progress(value)


def _child_main(ref: str, conn: Connection, path: list[str], cwd: str) -> None:
    """A child process: load the app, say so, then run the tasks sent until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the parent decides what Ctrl-C does)
    os.set_inheritable(conn.fileno(), False)  # (a program the task starts must not hold it)
    sys.path[:] = path
    try:
        os.chdir(cwd)
    except OSError:
        pass
    try:
        tasks = _load_app(ref).tasks
        from wqclient.app import Context
    except BaseException as e:
        answer: tuple[Any, ...] = (_BROKEN, "".join(traceback.format_exception(e)).rstrip())
    else:
        answer = (_READY, os.getpid())
    try:
        conn.send(answer)
    except OSError:
        return  # (the parent has let it go: closed, or gone)
    if answer[0] == _BROKEN:
        return
    sink = _PipeSink(conn)
    while True:
        try:
            _kind, name, args, kwargs, fields = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe (or is gone)
        answer = _run_one(tasks, Context, sink, name, args, kwargs, fields)
        try:
            conn.send(answer)
        except OSError:
            return
        except Exception as e:  # (a result that does not pickle)
            error = RuntimeError(
                f"the task's result cannot be sent back from the worker process: {describe(e)}"
            )
            conn.send((_ERR, _error_data(error)))


def _run_one(
    tasks: Mapping[str, Any],
    context: Callable[..., Any],
    sink: _PipeSink,
    name: str,
    args: list[Any],
    kwargs: dict[str, Any],
    fields: tuple[Any, ...],
) -> tuple[Any, ...]:
    """Run one task in the child; the answer to send."""
    task_id, ctx_name, attempt, max_attempts, queue, parents, schedule, scheduled_for = fields
    try:
        function = tasks.get(name)
        if function is None:
            raise RuntimeError(
                f"task {name!r} is not registered in the worker process's app "
                f"(it has: {', '.join(sorted(tasks)) or 'none'})"
            )
        ctx = context(
            task_id=task_id,
            name=ctx_name,
            attempt=attempt,
            max_attempts=max_attempts,
            queue=queue,
            parents=parents,
            schedule=schedule,
            scheduled_for=scheduled_for,
            sink=sink,
        )
        value = function.invoke(args, kwargs, ctx)
        if inspect.isawaitable(value):  # (an async function sent here after all)
            value = asyncio.run(_awaited(value))
        return (_OK, value)
    except BaseException as e:
        return (_ERR, _error_data(e))


async def _awaited(value: Any) -> Any:
    return await value


# -- the parent ---------------------------------------------------------------------------------


class _Died(Exception):
    """The child's pipe ended: it exited (or was killed)."""


class _Child:
    """A child process and the parent's end of its pipe, read by the event loop's reader:
    each message goes to the one waiting for it (:meth:`next`), else into the inbox. Its end
    is seen on its pipe, or (should another process hold the pipe open) on its pidfd."""

    def __init__(
        self,
        process: BaseProcess,
        conn: Connection,
        loop: asyncio.AbstractEventLoop,
        on_lost: Callable[[_Child], None],
    ) -> None:
        self.process = process
        self.pid = process.pid
        self.conn = conn
        self.loop = loop
        self.ready = False  # it said it has loaded the app
        self.busy = False  # a run() has it
        self.dead = False  # its pipe has ended (or it was let go)
        self.inbox: deque[Any] = deque()
        self.waiter: asyncio.Future[Any] | None = None
        self.reaping: asyncio.Future[int | None] | None = None
        self._on_lost = on_lost
        self._fd = conn.fileno()
        loop.add_reader(self._fd, self._readable)
        self.pidfd = _pidfd(process)
        if self.pidfd >= 0:
            loop.add_reader(self.pidfd, self._exited)

    def _readable(self) -> None:
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self._lost()
            return
        except Exception as e:  # the message came whole but does not unpickle here
            message = (_ERR, _error_data(_unreadable(e)))
            self.dead = True  # (what it waits for now is unknown: it is let go after this)
        self._deliver(message)

    def _deliver(self, message: Any) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            self.waiter = None
            waiter.set_result(message)
        else:
            self.inbox.append(message)

    def _exited(self) -> None:
        """Its process has ended: what it sent before is read, then it is lost."""
        self.loop.remove_reader(self.pidfd)
        while self._fd >= 0:
            try:
                if not self.conn.poll():
                    break
                self._deliver(self.conn.recv())
            except Exception:
                break
        if self._fd >= 0:
            self._lost()

    def _lost(self) -> None:
        self.detach()
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            self.waiter = None
            waiter.set_exception(_Died())
        self._on_lost(self)

    def detach(self) -> None:
        """Stop reading its pipe, and close it (a child waiting for a task then exits)."""
        if self._fd >= 0:
            self.loop.remove_reader(self._fd)
            if self.pidfd >= 0:
                self.loop.remove_reader(self.pidfd)
            self._fd = -1
            self.dead = True
            self.conn.close()

    async def next(self) -> Any:
        """Its next message (raises _Died once its pipe has ended)."""
        if self.inbox:
            return self.inbox.popleft()
        if self._fd < 0:
            raise _Died
        waiter = self.loop.create_future()
        self.waiter = waiter
        return await waiter

    def send(self, message: Any) -> None:
        if self._fd < 0:
            raise _Died
        try:
            self.conn.send(message)
        except OSError:  # (BrokenPipeError: it is gone; its pipe's end is read next)
            raise _Died from None

    async def reap(self) -> int | None:
        """Wait (on the event loop) for its process to end; its exit code."""
        process = self.process
        if process.exitcode is None:
            ended: asyncio.Future[None] = self.loop.create_future()

            def done() -> None:
                if not ended.done():
                    ended.set_result(None)

            fd = self.pidfd if self.pidfd >= 0 else process.sentinel
            self.loop.add_reader(fd, done)
            try:
                if process.exitcode is None:  # (it may have ended meanwhile)
                    await ended
            finally:
                self.loop.remove_reader(fd)
        process.join()  # (it has ended: this only collects it)
        exitcode = process.exitcode
        process.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        return exitcode


def _pidfd(process: BaseProcess) -> int:
    """A pidfd of the process (readable once it ends), or -1 where there is none."""
    pid = process.pid
    if pid is None or not hasattr(os, "pidfd_open"):
        return -1
    try:
        return os.pidfd_open(pid)
    except OSError:
        return -1


def _unreadable(error: Exception) -> RuntimeError:
    return RuntimeError(
        f"the worker process's answer cannot be read in the parent: {describe(error)}"
    )


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "its exit status is unknown"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class ProcessRunner:
    """Runs the App's sync task functions in ``size`` child processes, one task per child at a
    time (a ``SyncRunner``: docs/design/tasks.md). ``app_ref`` names the App,
    ``"pkg.module:attr"``, importable in a child (the parent's ``sys.path`` and working
    directory are its own). ``mp_context``: a ``multiprocessing`` context, or a start method's
    name ("spawn" if not given). The children start at the first ``run()``; ``close()`` ends
    them."""

    def __init__(
        self, app_ref: str, size: int, *, mp_context: BaseContext | str | None = None
    ) -> None:
        if size < 1:
            raise ValueError("a process pool's size must be at least 1")
        module_name, colon, attr = app_ref.partition(":")
        if not colon or not module_name or not attr:
            raise ValueError(f"an app reference is 'module:attribute', got {app_ref!r}")
        self.app_ref = app_ref
        self.size = size
        if mp_context is None or isinstance(mp_context, str):
            mp_context = multiprocessing.get_context(mp_context or "spawn")
        self._mp = mp_context
        self._slots: list[_Child | None] = [None] * size
        self._free: asyncio.Queue[int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reaping: set[asyncio.Future[int | None]] = set()
        self._closed = False
        _RUNNERS.add(self)

    @property
    def pids(self) -> list[int]:
        """The process ids of its children now (those started and not ended)."""
        return [c.pid for c in self._slots if c is not None and not c.dead and c.pid is not None]

    # -- running ----------------------------------------------------------------------------------

    async def run(
        self,
        fn: TaskFunction[Any, Any],
        args: list[Any],
        kwargs: dict[str, Any],
        ctx: Context,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` in a child (waiting for a free one), its context a copy of
        ``ctx`` whose progress reports reach ``ctx``; its value, or its exception raised here."""
        if self._closed:
            raise RuntimeError("the process runner is closed")
        free = self._start()
        slot = await free.get()
        try:
            if self._closed:  # (it waited for a child while the runner closed)
                raise RuntimeError("the process runner was closed")
            return await self._run_in(slot, fn.name, args, kwargs, ctx)
        finally:
            free.put_nowait(slot)

    async def start(self) -> None:
        """Start the children now and wait until each has loaded the app (else the first
        ``run()`` starts them, and a task waits for that); raises what a child could not load.
        Optional: a worker may call it before it claims tasks, to fail fast."""
        if self._closed:
            raise RuntimeError("the process runner is closed")
        free = self._start()
        slots = [await free.get() for _ in range(self.size)]
        try:
            await asyncio.gather(*(self._ready_in(slot) for slot in slots))
        finally:
            for slot in slots:
                free.put_nowait(slot)

    async def _ready_in(self, slot: int) -> None:
        child = self._slots[slot]
        if child is None or child.dead:
            child = self._slots[slot] = self._spawn(slot)
        if not child.ready:
            child.busy = True
            try:
                await self._until_ready(slot, child)
            finally:
                child.busy = False

    def _start(self) -> asyncio.Queue[int]:
        """The queue of free slots; at the first call, the children are started."""
        free = self._free
        if free is None:
            self._loop = asyncio.get_running_loop()
            free = self._free = asyncio.Queue()
            for slot in range(self.size):
                self._slots[slot] = self._spawn(slot)
                free.put_nowait(slot)
        return free

    async def _run_in(
        self, slot: int, name: str, args: list[Any], kwargs: dict[str, Any], ctx: Context
    ) -> Any:
        child = self._slots[slot]
        if child is None or child.dead:
            if child is not None:
                self._reap_soon(child)
            child = self._slots[slot] = self._spawn(slot)
        fields = (
            ctx.task_id,
            ctx.name,
            ctx.attempt,
            ctx.max_attempts,
            ctx.queue,
            tuple(ctx.parents or ()),
            ctx.schedule,
            ctx.scheduled_for,
        )
        child.busy = True
        sent = False
        try:
            if not child.ready:
                await self._until_ready(slot, child)
            try:
                child.send((_RUN, name, args, kwargs, fields))
            except _Died:
                raise
            except Exception as e:  # (pickling the call failed: nothing was sent)
                raise TypeError(
                    f"task {name!r}: its arguments cannot be sent to a worker process: "
                    f"{describe(e)}"
                ) from e
            sent = True
            return await self._outcome(child, ctx)
        except asyncio.CancelledError:
            if sent:
                await self._kill(slot, child)
            raise
        except _Died:
            exitcode = await self._replace(slot, child)
            raise RuntimeError(
                f"the worker process died ({_how_it_ended(exitcode)}) while it ran task {name!r}"
            ) from None
        finally:
            child.busy = False
            if child.dead and self._slots[slot] is child:  # (an answer it could not read)
                await self._kill(slot, child)

    async def _until_ready(self, slot: int, child: _Child) -> None:
        """Wait for a new child to load the app; raise what it could not."""
        try:
            message = await child.next()
        except _Died:
            exitcode = await self._replace(slot, child, again=False)
            raise RuntimeError(
                f"the worker process ended ({_how_it_ended(exitcode)}) before it loaded "
                f"the app {self.app_ref!r}"
            ) from None
        if message[0] == _BROKEN:
            child.detach()
            await self._replace(slot, child, again=False)
            raise RuntimeError(
                f"the worker process could not load the app {self.app_ref!r}:\n{message[1]}"
            )
        child.ready = True

    async def _outcome(self, child: _Child, ctx: Context) -> Any:
        """The child's answer to the task sent, its progress reports forwarded meanwhile."""
        while True:
            message = await child.next()
            kind = message[0]
            if kind == _OK:
                return message[1]
            if kind == _ERR:
                raise _error_from(message[1])
            # a progress report: to the parent's context, and its outcome back
            try:
                await ctx.progress(message[1])
            except Exception as e:
                child.send((_PROGRESS_ERR, _error_data(e)))
            else:
                child.send(_PROGRESS_OK)

    # -- children -------------------------------------------------------------------------------

    def _spawn(self, slot: int) -> _Child:
        assert self._loop is not None
        mine, theirs = self._mp.Pipe(duplex=True)
        process = self._mp.Process(  # type: ignore[attr-defined]
            target=_child_main,
            args=(self.app_ref, theirs, list(sys.path), os.getcwd()),
            name=f"wq-proc-{slot}",
        )
        try:
            process.start()
        finally:
            theirs.close()  # (the child's end is its own: its death ends the pipe here)
        log.debug("worker process %s started (slot %d)", process.pid, slot)
        return _Child(process, mine, self._loop, self._lost)

    def _lost(self, child: _Child) -> None:
        """A child's pipe ended. One that a run() holds is handled there; an idle one that had
        loaded the app is replaced now (one that never did, at the next run())."""
        if child.busy or self._closed:
            return
        for slot, held in enumerate(self._slots):
            if held is child:
                self._reap_soon(child)
                if child.ready:
                    log.warning("worker process %s ended while idle; starting another", child.pid)
                    self._slots[slot] = self._spawn(slot)
                else:  # (it could not load the app: the next run() tries again, and says why)
                    self._slots[slot] = None
                return

    async def _kill(self, slot: int, child: _Child) -> None:
        """Kill a child with SIGKILL, start another in its slot, and reap it."""
        try:
            child.process.kill()
        except (OSError, ValueError):
            pass  # (gone already)
        log.debug("worker process %s killed", child.pid)
        await self._replace(slot, child)

    async def _replace(self, slot: int, child: _Child, *, again: bool = True) -> int | None:
        """Put a new child in ``child``'s slot (``again``; else at the next run()), and reap
        ``child``; its exit code."""
        child.detach()
        if self._slots[slot] is child:
            self._slots[slot] = self._spawn(slot) if again and not self._closed else None
        return await asyncio.shield(self._reap_soon(child))

    def _reap_soon(self, child: _Child) -> asyncio.Future[int | None]:
        reaping = child.reaping
        if reaping is None:
            reaping = child.reaping = asyncio.ensure_future(child.reap())
            self._reaping.add(reaping)
            reaping.add_done_callback(self._reaping.discard)
        return reaping

    # -- closing ----------------------------------------------------------------------------------

    async def close(self, grace: float = CLOSE_GRACE) -> None:
        """End the children: their pipes are closed (an idle child exits at once), and those
        still running ``grace`` seconds later are killed. A run() still waiting fails."""
        if self._closed:
            return
        self._closed = True
        _RUNNERS.discard(self)
        children = [c for c in self._slots if c is not None]
        self._slots = [None] * self.size
        for child in children:
            waiter = child.waiter
            child.detach()
            if waiter is not None and not waiter.done():
                waiter.set_exception(RuntimeError("the process runner was closed"))
        reaps = [self._reap_soon(child) for child in children]
        if reaps:
            _, late = await asyncio.wait(reaps, timeout=grace)
            for child, reaping in zip(children, reaps, strict=True):
                if reaping in late:
                    log.warning("worker process %s did not end: killing it", child.pid)
                    try:
                        child.process.kill()
                    except (OSError, ValueError):
                        pass
            await asyncio.wait(reaps)
        if self._reaping:
            await asyncio.wait(list(self._reaping))

    def _kill_all(self) -> None:
        """At interpreter exit, a runner never closed: its children killed (multiprocessing
        would otherwise wait for them)."""
        for child in self._slots:
            if child is not None:
                try:
                    if child.process.exitcode is None:
                        child.process.kill()
                except (OSError, ValueError):  # (gone, or its process object closed)
                    pass


_RUNNERS: weakref.WeakSet[ProcessRunner] = weakref.WeakSet()


@atexit.register
def _at_exit() -> None:
    for runner in list(_RUNNERS):
        runner._kill_all()
