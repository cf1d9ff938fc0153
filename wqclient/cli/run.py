"""``wq worker`` (``python -m wqclient.cli.run``): run an App's tasks, or a program per task
(docs/design/tasks.md, "wq worker").

::

    wq worker [flags] MODULE:APP                 # an App in an importable module (cwd on sys.path)
    wq worker [flags] -exec "./handle.sh --flag" # a program per task (shlex-split)
    wq worker [flags] -- ./handle.sh --flag      # the same, the program's argv as it is

It builds a :class:`~wqclient.Worker` over ``app.handler(runner)`` (sync functions in threads,
or with ``-pool processes`` in child processes) or over :class:`~wqclient._exec.ExecHandler`.
SIGTERM or SIGINT stops it as ``Worker.stop(grace)`` does (the tasks in hand have ``-grace``
seconds to finish, then are handed back); a second signal hands them back at once
(``Worker.stop_now()``). It exits 0 after a clean stop. ``-metrics-addr`` serves Prometheus
text at ``/metrics``; ``-reload`` runs the worker as a child process, restarted when a ``.py``
file under the current directory changes. A bad command line (flags, a module that cannot be
imported, an attribute that is not an App, an App with no tasks) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

from wqclient.cli import (
    Connection,
    SettingError,
    add_auth_flags,
    add_broker_flag,
    connection,
    quiet_grpc,
)
from wqclient.client import AsyncClient
from wqclient.errors import CertificateError, PermissionDenied, Unauthenticated, WqError
from wqclient.limits import DEFAULT_LEASE_MS, DEFAULT_WAIT_MS
from wqclient.models import DEFAULT_QUEUE, Task
from wqclient.worker import AUTO_PREFETCH_MAX, Worker
from wqwire.flags import (
    LOG_FORMATS,
    FlagParser,
    add_switch,
    positive_int,
    queue_list,
    setup_logging,
)

if TYPE_CHECKING:
    from wqclient.app import App

T = TypeVar("T")

PROG: Final = "wq worker"
DEFAULT_CONCURRENCY: Final = 8
DEFAULT_GRACE: Final = 30.0
POOLS: Final = ("threads", "processes")
LOOPS: Final = ("uvloop", "asyncio")
# -reload: how often the files are looked at, and how long a child is given to stop beyond its
# grace before it is killed.
RELOAD_POLL: Final = 1.0
RELOAD_KILL_AFTER: Final = 10.0

log = logging.getLogger("wqclient.cli.run")


class _Usage(Exception):
    """A bad command line: one line, exit 2."""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds from 0, got {text}")
    return value


def _host_port(text: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def build_parser() -> FlagParser:
    p = FlagParser(
        prog=PROG,
        description="Run an App's tasks (MODULE:APP), or a program per task (-exec, or after "
        "--), taking tasks from a wq broker. SIGTERM/SIGINT: the tasks in hand have -grace "
        "seconds to finish, then are handed back; a second signal hands them back at once.",
    )
    p.usage = f"{PROG} [flags] MODULE:APP | -exec 'PROGRAM ARGS' | -- PROGRAM ARGS"
    p.add_argument(
        "target",
        nargs="?",
        default=None,
        metavar="MODULE:APP",
        help="the App to run: a module importable from the current directory and the App's "
        "name in it (tasks:app)",
    )
    add_broker_flag(p, app=True)
    p.add_argument(
        "-exec",
        "--exec",
        dest="exec_",
        default=None,
        metavar="COMMAND",
        help="run this program per task (split as a shell would, run without one): the "
        "payload on stdin, exit 0 acks (stdout, if JSON, is the result), 100 fails for good, "
        "any other exit retries",
    )
    p.add_argument(
        "-queues",
        "--queues",
        type=queue_list,
        default=None,
        metavar="NAMES",
        help="the queues to take tasks from, comma-separated, in order of preference "
        f"(default: the App's tasks' queues; with -exec, {DEFAULT_QUEUE})",
    )
    p.add_argument(
        "-concurrency",
        "--concurrency",
        type=positive_int,
        default=DEFAULT_CONCURRENCY,
        metavar="N",
        help=f"how many tasks to run at once (default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "-pool",
        "--pool",
        choices=POOLS,
        default=None,
        help="where synchronous task functions run: threads, or processes (a child process "
        "each, killed when its task is stopped) (default threads)",
    )
    p.add_argument(
        "-prefetch",
        "--prefetch",
        type=positive_int,
        default=None,
        metavar="N",
        help="how many tasks to hold at once, those waiting for a free slot included (default: "
        f"it follows the tasks, from twice -concurrency over gRPC up to {AUTO_PREFETCH_MAX})",
    )
    p.add_argument(
        "-lease-ms",
        "--lease-ms",
        type=positive_int,
        default=DEFAULT_LEASE_MS,
        metavar="MS",
        help=f"each task's lease, extended while it runs (default {DEFAULT_LEASE_MS})",
    )
    p.add_argument(
        "-wait-ms",
        "--wait-ms",
        type=positive_int,
        default=DEFAULT_WAIT_MS,
        metavar="MS",
        help=f"how long each long-poll waits for a task (default {DEFAULT_WAIT_MS})",
    )
    p.add_argument(
        "-grace",
        "--grace",
        type=_seconds,
        default=DEFAULT_GRACE,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long the tasks in hand have to finish before they are "
        f"handed back (default {DEFAULT_GRACE:g})",
    )
    add_switch(
        p,
        "reload",
        "restart the worker when a .py file under the current directory changes (for development)",
    )
    p.add_argument(
        "-metrics-addr",
        "--metrics-addr",
        type=_host_port,
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics",
    )
    p.add_argument(
        "-log-format",
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: a line per record; json: one JSON object per line, with each record's "
        "fields (task_name, task_id, attempts, outcome, duration_ms ...) (default text)",
    )
    p.add_argument(
        "-loop",
        "--loop",
        choices=LOOPS,
        default="uvloop",
        help="the event loop: uvloop (libuv, faster; the asyncio loop where it is not "
        "installed) or asyncio (default uvloop)",
    )
    add_switch(p, "quiet", "log only warnings and errors (no line per task)")
    add_auth_flags(p, app=True)
    return p


@dataclass
class Invocation:
    """A command line, understood: the flags, and what to run (an App, or a program)."""

    args: argparse.Namespace
    argv: list[str]  # the flags as given (before any --), switches spelt with their value
    program: list[str] | None  # -exec's or --'s argv


def parse(argv: Sequence[str]) -> Invocation:  # noqa: C901 (a check a line)
    """The command line understood; raises SystemExit (2, after one line on stderr) if it is
    wrong, or (0) after -h."""
    argv = list(argv)
    program: list[str] | None = None
    if "--" in argv:
        i = argv.index("--")
        argv, program = argv[:i], argv[i + 1 :]
    parser = build_parser()
    argv = parser.spell_switches(argv)
    args = parser.parse_args(argv)
    try:
        if program is not None and not program:
            raise _Usage("no program after --")
        if args.exec_ is not None:
            if program is not None:
                raise _Usage("give -exec or a program after --, not both")
            try:
                program = shlex.split(args.exec_)
            except ValueError as e:
                raise _Usage(f"-exec: {e}") from None
            if not program:
                raise _Usage("-exec: no program given")
        if args.target is not None and program is not None:
            raise _Usage("give MODULE:APP or a program (-exec, or after --), not both")
        if args.target is None and program is None:
            raise _Usage("nothing to run: give MODULE:APP, -exec 'PROGRAM ARGS' or -- PROGRAM ARGS")
        if program is not None and args.pool is not None:
            raise _Usage("-pool is for an App's synchronous tasks, not for a program")
        if args.prefetch is not None and args.prefetch < args.concurrency:
            raise _Usage("-prefetch must be at least -concurrency")
        if args.token is not None or args.token_file is not None:
            # The flags settle the token whatever the App's: checked before anything starts.
            args.token, args.token_file = connection(args).token, None
    except (_Usage, SettingError) as e:
        parser.error(str(e))
    return Invocation(args, argv, program)


def load_app(ref: str) -> App:
    """The App that ``MODULE:ATTR`` names, the current directory on ``sys.path``; raises
    _Usage saying what is wrong."""
    from wqclient.app import App

    module_name, colon, attr = ref.partition(":")
    if not colon or not module_name or not attr:
        raise _Usage(f"{ref!r} is not MODULE:APP (a module, a colon, the App's name in it)")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise _Usage(
                f"no module named {module_name!r} (looked in {cwd} and on the Python path)"
            ) from None
        raise _Usage(f"importing {module_name}: {e}") from None
    except Exception as e:  # its own error: one line, not a traceback
        raise _Usage(f"importing {module_name} failed: {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise _Usage(f"module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, App):
        raise _Usage(f"{ref} is not a wqclient.App (it is {type(obj).__name__})")
    if not obj.tasks:
        raise _Usage(f"{ref} has no tasks (make some with @{attr.split('.')[-1]}.task)")
    return obj


# -- the line per task ---------------------------------------------------------------------------


class TaskLines:
    """The line per task (``on_task``): the same line, or JSON object, that the Worker's
    ``wqclient.worker.tasks`` logger would write, made without the logging machinery and written
    to stderr once per turn of the event loop.

    At tens of thousands of tasks a second, a record through :mod:`logging` (a LogRecord, its
    ``extra``, a formatter, a write and a flush for each) costs about as much as the task does;
    this costs a format and an append, and one write per batch."""

    def __init__(self, log_format: str, stream: Any = None) -> None:
        self._json = log_format == "json"
        self._stream = stream if stream is not None else sys.stderr
        self._lines: list[str] = []
        self._second = -1
        self._stamp = ""
        self._loop: asyncio.AbstractEventLoop | None = None

    def _when(self) -> str:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            if self._json:
                self._stamp = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            else:
                self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        if self._json:
            return f"{self._stamp}.{int((now - second) * 1e6):06d}Z"
        return f"{self._stamp},{int((now - second) * 1000):03d}"

    def observe(self, task: Task, name: str | None, outcome: str, seconds: float) -> None:
        ms = seconds * 1000
        message = (
            f"task {name + ' ' if name else ''}{task.id} (attempt {task.attempts} of "
            f"{task.max_attempts}): {outcome} in {ms:.1f} ms"
        )
        if self._json:
            line = json.dumps(
                {
                    "time": self._when(),
                    "level": "info",
                    "logger": "wqclient.worker.tasks",
                    "message": message,
                    "task_id": task.id,
                    "queue": task.queue,
                    "attempts": task.attempts,
                    "max_attempts": task.max_attempts,
                    "outcome": outcome,
                    "task_name": name,
                    "duration_ms": round(ms, 3),
                },
                ensure_ascii=False,
            )
        else:
            line = f"{self._when()} wq worker INFO {message}"
        lines = self._lines
        lines.append(line)
        if len(lines) == 1:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self.flush)

    def flush(self) -> None:
        if self._lines:
            text = "\n".join(self._lines) + "\n"
            self._lines.clear()
            try:
                self._stream.write(text)
                self._stream.flush()
            except (OSError, ValueError):  # stderr closed: the lines have nowhere to go
                pass


def _observers(
    *observers: Callable[[Task, str | None, str, float], None] | None,
) -> Callable[[Task, str | None, str, float], None] | None:
    """The Worker's one ``on_task`` for the observers given (None: none)."""
    given = [o for o in observers if o is not None]
    if not given:
        return None
    if len(given) == 1:
        return given[0]
    first, second = given

    def both(task: Task, name: str | None, outcome: str, seconds: float) -> None:
        first(task, name, outcome, seconds)
        second(task, name, outcome, seconds)

    return both


# -- metrics ---------------------------------------------------------------------------------------


class Metrics:
    """The worker's Prometheus metrics, in a registry of their own: ``observe`` is the
    Worker's ``on_task`` (one counter and one histogram child per task name, looked up once)."""

    def __init__(self, in_hand: Callable[[], int]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self._tasks = Counter(
            "wq_worker_tasks",
            "Tasks settled by this worker, by task name and outcome (succeeded, failed, "
            "retried, cancelled, timed_out, handed_back, discarded).",
            ["task", "outcome"],
            registry=self.registry,
        )
        self._duration = Histogram(
            "wq_worker_task_duration_seconds",
            "Seconds from a task's handler start to its settling, by task name.",
            ["task"],
            registry=self.registry,
        )
        gauge = Gauge(
            "wq_worker_tasks_in_flight",
            "Tasks held whose handlers have not ended (running, or waiting for a slot).",
            registry=self.registry,
        )
        gauge.set_function(lambda: float(in_hand()))
        self._counted: dict[tuple[str, str], Callable[[], None]] = {}
        self._timed: dict[str, Callable[[float], None]] = {}

    def observe(self, task: Task, name: str | None, outcome: str, seconds: float) -> None:
        label = name or ""
        try:
            self._counted[label, outcome]()
        except KeyError:
            inc = self._counted[label, outcome] = self._tasks.labels(label, outcome).inc
            inc()
        try:
            self._timed[label](seconds)
        except KeyError:
            timed = self._timed[label] = self._duration.labels(label).observe
            timed(seconds)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


async def serve_metrics(metrics: Metrics, host: str, port: int) -> Callable[[], Awaitable[None]]:
    """Serve ``/metrics`` on host:port (aiohttp, on this loop); the function that stops it."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner.cleanup


# -- running ---------------------------------------------------------------------------------------


def _connection(
    args: argparse.Namespace, broker: str | None, token: str | None, ca_file: str | None
) -> Connection:
    """The flags', else the App's own (``broker``, ``token``, ``ca_file``), else the
    environment's, else the defaults (:func:`wqclient.cli.connection`)."""
    try:
        return connection(args, broker=broker, token=token, ca_file=ca_file)
    except SettingError as e:
        raise _Usage(str(e)) from None


async def _run(inv: Invocation) -> int:  # noqa: C901 (one branch per kind of worker)
    args = inv.args
    app: App | None = None
    runner: Any = None
    if inv.program is None:
        app = load_app(args.target)
        from wqclient.app import ThreadRunner

        pool = args.pool or "threads"
        if pool == "processes":
            from wqclient._procpool import ProcessRunner

            runner = ProcessRunner(args.target, args.concurrency)
        else:
            runner = ThreadRunner(args.concurrency)
        handler: Callable[[Task], Any] = app.handler(runner)
        queues = args.queues or app.queues()
        n = len(app.tasks)
        what = f"{n} task{'' if n == 1 else 's'} ({', '.join(sorted(app.tasks))}) of {args.target}"
        conn = _connection(args, app.broker, app.token, app.ca_file)
    else:
        from wqclient._exec import ExecHandler

        pool = "exec"
        try:
            handler = ExecHandler(inv.program)
        except (OSError, ValueError) as e:
            raise _Usage(str(e)) from None
        queues = args.queues or [DEFAULT_QUEUE]
        what = f"the program {shlex.join(inv.program)}"
        conn = _connection(args, None, None, None)
    broker = conn.broker
    try:
        client = AsyncClient(broker, token=conn.token, ca_file=conn.ca_file)
    except WqError as e:
        raise _Usage(e.message) from None
    metrics: Metrics | None = None
    worker_box: list[Worker] = []
    # The line per task (unless -quiet): written by TaskLines, not through the logger.
    lines = None if args.quiet else TaskLines(args.log_format)
    logging.getLogger("wqclient.worker.tasks").setLevel(logging.WARNING)
    if args.metrics_addr is not None:
        metrics = Metrics(lambda: worker_box[0].in_hand if worker_box else 0)
    worker = Worker(
        client,
        handler,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        wait_ms=args.wait_ms,
        lease_ms=args.lease_ms,
        queues=queues,
        on_task=_observers(
            lines.observe if lines is not None else None,
            None if metrics is None else metrics.observe,
        ),
    )
    worker_box.append(worker)
    stop_metrics: Callable[[], Awaitable[None]] | None = None
    try:
        if metrics is not None:
            host, port = args.metrics_addr
            try:
                stop_metrics = await serve_metrics(metrics, host, port)
            except OSError as e:
                print(f"{PROG}: cannot serve metrics on {host}:{port}: {e}", file=sys.stderr)
                return 1
            log.info("metrics at http://%s:%d/metrics", host, port)
        start = getattr(runner, "start", None)
        if start is not None:  # (a process pool: its children up, the app loaded, before tasks)
            try:
                await start()
            except Exception as e:
                print(f"{PROG}: the pool's processes could not start: {e}", file=sys.stderr)
                return 1
        signals = [0]

        def signalled() -> None:
            signals[0] += 1
            if signals[0] == 1:
                worker.stop(args.grace)
            else:
                log.warning("second signal: handing back the tasks in hand now")
                worker.stop_now()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signalled)
        protocol = "gRPC, one stream" if client.can_stream else "HTTP, long-polling"
        log.info(
            "running %s: queues %s, concurrency %d, pool %s, broker %s (%s)",
            what,
            ",".join(queues),
            args.concurrency,
            pool,
            broker,
            protocol,
        )
        try:
            await worker.run()
        except (Unauthenticated, PermissionDenied, CertificateError):
            return 1  # the worker has said why
    finally:
        close = getattr(handler, "close", None)
        if close is not None:
            await close()
        if runner is not None:
            await runner.close()
        if stop_metrics is not None:
            await stop_metrics()
        await client.close()
        if app is not None:
            await app.aclose()
        if lines is not None:
            lines.flush()
    log.info(
        "stopped: %d succeeded, %d failed, %d cancelled, %d handed back",
        worker.succeeded,
        worker.failed,
        worker.cancelled,
        worker.handed_back,
    )
    return 0


def _exit_now_if_threads_run_on(code: int) -> int:
    """A task function's thread abandoned at shutdown would keep the interpreter from exiting
    (it joins the pools' threads): exit without waiting for it."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if others:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``wq worker``: returns the exit status."""
    try:
        inv = parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    args = inv.args
    setup_logging(
        logging.WARNING if args.quiet else logging.INFO,
        args.log_format,
        "%(asctime)s wq worker %(levelname)s %(message)s",
    )
    if args.reload:
        return supervise(inv)
    try:
        # (-exec on asyncio's loop: a program per task gains nothing from uvloop, whose
        # subprocesses, spawned while gRPC's threads run, were seen to die of SIGSEGV before
        # their program started: 3 in 1,000)
        code = run_loop(_run(inv), "asyncio" if inv.program is not None else args.loop)
    except _Usage as e:
        print(f"{PROG}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return _exit_now_if_threads_run_on(code)


def run_loop(main: Coroutine[Any, Any, T], loop: str) -> T:
    """Run ``main`` on uvloop (libuv: less time in the loop for each task) unless told
    otherwise, or where it is not installed (it comes with the ``cli`` extra, not on Windows)."""
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


# -- -reload ---------------------------------------------------------------------------------------


def _sources(root: Path) -> dict[str, int]:
    """Every ``.py`` file under ``root`` (hidden directories and __pycache__ left out), with
    its modification time."""
    found: dict[str, int] = {}
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                try:
                    found[path] = os.stat(path).st_mtime_ns
                except OSError:
                    pass
    return found


def _changed(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


def supervise(inv: Invocation) -> int:  # noqa: C901
    """``-reload``: run the worker as a child (the same command line without -reload) and
    restart it (SIGTERM, wait, start again) when a ``.py`` file under the current directory
    changes; on SIGTERM/SIGINT, pass the signal on, wait for the child, and exit."""
    flags = [a for a in inv.argv if a.split("=", 1)[0] not in ("-reload", "--reload")]
    child_argv = [sys.executable, "-m", "wqclient.cli.run", *flags]
    if inv.program is not None and inv.args.exec_ is None:
        child_argv += ["--", *inv.program]
    root = Path.cwd()
    woken = threading.Event()
    signals: list[int] = []
    proc: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, frame: Any) -> None:
        signals.append(signum)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)
        woken.set()

    def start() -> subprocess.Popen[bytes]:
        # A session of its own: a Ctrl-C at the terminal reaches it once, through us.
        return subprocess.Popen(child_argv, start_new_session=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    seen = _sources(root)
    log.info("reloading: watching the .py files under %s", root)
    proc = start()
    reported_exit = False
    while True:
        woken.wait(RELOAD_POLL)
        if signals:
            return _child_ended(proc, inv.args.grace)
        if proc.poll() is not None and not reported_exit:
            reported_exit = True
            log.warning("the worker exited (%d); waiting for a change to start it", proc.returncode)
        now = _sources(root)
        changed = _changed(seen, now)
        if not changed:
            continue
        seen = now
        log.info("%s changed: restarting the worker", os.path.relpath(changed[0], root))
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            _child_ended(proc, inv.args.grace)
        if signals:
            return 0
        proc = start()
        reported_exit = False


def _child_ended(proc: subprocess.Popen[bytes], grace: float) -> int:
    """Wait for the child to exit (killed if it outlives its grace by RELOAD_KILL_AFTER)."""
    try:
        return proc.wait(grace + RELOAD_KILL_AFTER)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


if __name__ == "__main__":
    quiet_grpc()
    sys.exit(main())
