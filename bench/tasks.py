"""The task framework as users run it (docs/design/tasks.md), next to the raw ``Worker`` and to
Dramatiq and Celery: ``python -m bench tasks`` (``--quick`` for a smoke run).

Every row is a no-op task enqueued one per call by concurrent producers in one process and run
by a worker started, in another process, with its framework's own command, from a project
directory of its own (the modules below, written where a user keeps them). Two parts:

**The framework's cost** (wq alone): true no-ops (``nothing``), their completions counted by the
broker (the queue's acked total, polled every 5 ms), and PURE_PRODUCERS producers, so that the
worker, not the producer, sets the pace:

- raw ``Worker``: ``wqclient.Worker(url, handler)`` with a no-op handler (``python -m bench.tasks
  raw-worker``, on uvloop as ``wq worker`` is), the same producer (``await nothing.enqueue()``):
  what the framework is measured against;
- ``wq worker bench_tasks:app``: ``@app.task async def nothing()`` (and with ``-quiet``: no line
  per task); the same with a sync function (run in the worker's thread pool); ``wq worker -exec
  ./nothing.sh`` (a program per task: expected far slower, fewer tasks); the async task over HTTP.

**Side by side** with the Python task queues users compare wq with: each task increments a Redis
counter (one round trip; the one that brings it to N writes the time), the same work and the
same count for every framework, PRODUCERS producers each:

- ``wq worker bench_tasks:app`` with ``@app.task async def noop()``, ``await noop.enqueue()``;
- Dramatiq (``dramatiq bench_dramatiq -p 1 -t C``, Redis broker, ``noop.send()`` from PRODUCERS
  threads) and Celery (``celery -A bench_celery worker --pool threads -c C``, Redis broker,
  ``noop.delay()`` from PRODUCERS threads): users' producers are synchronous.

The figure is tasks/s from the first timed enqueue to the last completion. Before the clock
starts, one task is sent and awaited (the worker is up, the producer connected). Redis is
``$WQ_BENCH_REDIS`` (default ``redis://127.0.0.1:6379/0``); its keys are named after the run and
deleted after it.

The roles a row's processes play (run from the project directory)::

    python -m bench.tasks produce KIND N PRODUCERS   KIND: app, dramatiq, celery
    python -m bench.tasks raw-worker URL CONCURRENCY

(``$WQ_BROKER``, ``$BENCH_REDIS``, ``$BENCH_KEY``, ``$BENCH_N``, ``$BENCH_QUEUE``, ``$BENCH_TASK``
say the rest.)
``produce`` prints ``{"first", "last", "done", "n"}`` (``time.time()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BIN = Path(PY).parent
REDIS = os.environ.get("WQ_BENCH_REDIS", "redis://127.0.0.1:6379/0")
CONCURRENCY = 8  # the worker's (wq worker's default): threads, coroutines
PRODUCERS = 8  # concurrent producers in the producer's one process

# -- the project directory: what a user writes ----------------------------------------------------

WQ_MODULE = '''\
"""Run by ``wq worker bench_tasks:app``."""

import os
import time

import redis
import redis.asyncio

import wqclient

app = wqclient.App()  # $WQ_BROKER
QUEUE = os.environ["BENCH_QUEUE"]
KEY, N = os.environ["BENCH_KEY"], int(os.environ["BENCH_N"])
_aredis = redis.asyncio.Redis.from_url(os.environ["BENCH_REDIS"])
_redis = redis.Redis.from_url(os.environ["BENCH_REDIS"])


@app.task(queue=QUEUE)
async def noop() -> None:
    if await _aredis.incr(KEY) == N:
        await _aredis.set(KEY + ":done", repr(time.time()))


@app.task(queue=QUEUE)
def noop_sync() -> None:
    if _redis.incr(KEY) == N:
        _redis.set(KEY + ":done", repr(time.time()))


@app.task(queue=QUEUE)
async def nothing() -> None:
    """A true no-op: the broker counts it (acked)."""


@app.task(queue=QUEUE)
def nothing_sync() -> None:
    """The same, in the thread pool."""
'''

DRAMATIQ_MODULE = '''\
"""Run by ``dramatiq bench_dramatiq -p 1 -t 8``."""

import os
import time

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

dramatiq.set_broker(
    RedisBroker(url=os.environ["BENCH_REDIS"], namespace=os.environ["BENCH_QUEUE"])
)
KEY, N = os.environ["BENCH_KEY"], int(os.environ["BENCH_N"])
_redis = redis.Redis.from_url(os.environ["BENCH_REDIS"])


@dramatiq.actor(max_retries=0)
def noop() -> None:
    if _redis.incr(KEY) == N:
        _redis.set(KEY + ":done", repr(time.time()))
'''

CELERY_MODULE = '''\
"""Run by ``celery -A bench_celery worker --pool threads -c 8``."""

import os
import time

import redis
from celery import Celery

app = Celery("bench_celery", broker=os.environ["BENCH_REDIS"])
app.conf.task_default_queue = os.environ["BENCH_QUEUE"]
app.conf.broker_connection_retry_on_startup = True
KEY, N = os.environ["BENCH_KEY"], int(os.environ["BENCH_N"])
_redis = redis.Redis.from_url(os.environ["BENCH_REDIS"])


@app.task(ignore_result=True)
def noop() -> None:
    if _redis.incr(KEY) == N:
        _redis.set(KEY + ":done", repr(time.time()))
'''

# A trivial program for ``wq worker -exec``: bash builtins only (no program started but bash).
EXEC_SCRIPT = """\
#!/usr/bin/env bash
# Counts itself in Redis over bash's /dev/tcp; the payload on stdin is read and ignored.
read -r -d '' _ || true
exec 3<>"/dev/tcp/$BENCH_REDIS_HOST/$BENCH_REDIS_PORT"
if [ "$BENCH_REDIS_DB" != 0 ]; then
  printf 'SELECT %s\\r\\n' "$BENCH_REDIS_DB" >&3
  read -r _ <&3
fi
printf 'INCR %s\\r\\n' "$BENCH_KEY" >&3
read -r reply <&3
if [ "${reply%$'\\r'}" = ":$BENCH_N" ]; then
  printf 'SET %s:done %s\\r\\n' "$BENCH_KEY" "$EPOCHREALTIME" >&3
  read -r _ <&3
fi
"""

# The true no-op for ``-exec``: reads nothing, writes nothing, exits 0.
NOTHING_SCRIPT = """\
#!/bin/sh
exit 0
"""

FILES = {
    "nothing.sh": NOTHING_SCRIPT,
    "bench_tasks.py": WQ_MODULE,
    "bench_dramatiq.py": DRAMATIQ_MODULE,
    "bench_celery.py": CELERY_MODULE,
    "noop.sh": EXEC_SCRIPT,
}


def write_project(where: Path) -> None:
    for name, text in FILES.items():
        (where / name).write_text(text)
    (where / "noop.sh").chmod(0o755)
    (where / "nothing.sh").chmod(0o755)


# -- the producer and the raw worker (processes of a row) -----------------------------------------


def _redis() -> Any:
    import redis

    return redis.Redis.from_url(os.environ["BENCH_REDIS"])


def _wait_count(r: Any, key: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while int(r.get(key) or 0) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{key}: {int(r.get(key) or 0)} of {n} tasks done in {timeout} s")
        time.sleep(0.02)


def _wait_done(r: Any, key: str, n: int) -> float:
    """The time the counter reached its last task (the worker wrote it), waiting for it."""
    _wait_count(r, key, n + 1, timeout=max(120.0, n / 50))
    deadline = time.monotonic() + 10
    while (done := r.get(key + ":done")) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"{key}: counted to {n + 1} but no time written")
        time.sleep(0.01)
    return float(done)


async def _acked(client: Any, queue: str, n: int, timeout: float) -> float:
    """When the broker's count of the queue's acked tasks reached ``n`` (polled every 5 ms)."""
    deadline = time.monotonic() + timeout
    while (await client.stats(queue)).totals.acked < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{queue}: fewer than {n} tasks acked in {timeout} s")
        await asyncio.sleep(0.005)
    return time.time()


async def _produce_async(n: int, producers: int) -> tuple[float, float, float | None]:
    """Warm up with one task, then ``n`` enqueued one per call (``await noop.enqueue()``) by
    ``producers`` coroutines. With ``$BENCH_PURE`` the tasks do nothing and the broker counts
    them: the time the queue's acked count reached n + 1 (else None: Redis counts)."""
    pure = bool(os.environ.get("BENCH_PURE"))
    queue = os.environ["BENCH_QUEUE"]
    module = importlib.import_module("bench_tasks")
    async with module.app:
        enqueue = getattr(module, os.environ.get("BENCH_TASK", "noop")).enqueue
        await enqueue()
        if pure:
            await _acked(module.app.client, queue, 1, 120.0)
        else:
            await asyncio.to_thread(_wait_count, _redis(), os.environ["BENCH_KEY"], 1, 120.0)
        counter = iter(range(n))

        async def one() -> None:
            for _ in counter:
                await enqueue()

        first = time.time()
        await asyncio.gather(*(one() for _ in range(producers)))
        last = time.time()
        done = await _acked(module.app.client, queue, n + 1, max(120.0, n / 50)) if pure else None
        return first, last, done


def _produce_threads(kind: str, n: int, producers: int) -> tuple[float, float]:
    """Dramatiq's ``send()`` / Celery's ``delay()`` from ``producers`` threads (both are
    synchronous: that is how their users send)."""
    module = importlib.import_module(f"bench_{kind}")
    send: Callable[[], object] = module.noop.send if kind == "dramatiq" else module.noop.delay
    send()
    _wait_count(_redis(), os.environ["BENCH_KEY"], 1, 120.0)
    counter = iter(range(n))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if next(counter, None) is None:
                    return
            send()

    threads = [threading.Thread(target=work) for _ in range(producers)]
    first = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return first, time.time()


def produce(kind: str, n: int, producers: int) -> dict[str, Any]:
    """The producer of a row (the broker: ``$WQ_BROKER``, or Redis for Dramatiq and Celery)."""
    done: float | None = None
    if kind == "app":
        first, last, done = asyncio.run(_produce_async(n, producers))
    elif kind in ("dramatiq", "celery"):
        first, last = _produce_threads(kind, n, producers)
    else:
        raise SystemExit(f"unknown producer kind {kind!r}")
    if done is None:
        done = _wait_done(_redis(), os.environ["BENCH_KEY"], n)
    return {"first": first, "last": last, "done": done, "n": n}


async def raw_worker(url: str, concurrency: int) -> None:
    """``Worker(url, handler)``, the handler counting in Redis as the tasks do; until SIGTERM."""
    import redis.asyncio

    from wqclient import Task, Worker

    r = redis.asyncio.Redis.from_url(os.environ["BENCH_REDIS"])
    key, n = os.environ["BENCH_KEY"], int(os.environ["BENCH_N"])

    async def handler(_task: Task) -> None:
        if await r.incr(key) == n:
            await r.set(key + ":done", repr(time.time()))

    async def nothing(_task: Task) -> None:
        return None

    if os.environ.get("BENCH_PURE"):
        handler = nothing  # (the broker counts)

    worker = Worker(url, handler, concurrency=concurrency, queues=[os.environ["BENCH_QUEUE"]])
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
    await worker.run()


# -- a row: its worker process, its producer process ----------------------------------------------


class _Server(Protocol):
    @property
    def http(self) -> str: ...
    @property
    def grpc(self) -> str: ...


@dataclass
class Spec:
    name: str
    worker: list[str]  # the worker's command, {url} and {queue} filled in
    producer: str  # the producer's kind
    n: int
    transport: str = "grpc"  # or "http"; "redis" for Dramatiq and Celery
    env: dict[str, str] = field(default_factory=dict)
    producers: int = PRODUCERS


def _row_env(spec: Spec, url: str, queue: str, key: str) -> dict[str, str]:
    parsed = urllib.parse.urlsplit(REDIS)
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        GRPC_VERBOSITY="ERROR",
        WQ_BROKER=url,
        BENCH_REDIS=REDIS,
        BENCH_REDIS_HOST=parsed.hostname or "127.0.0.1",
        BENCH_REDIS_PORT=str(parsed.port or 6379),
        BENCH_REDIS_DB=(parsed.path.strip("/") or "0"),
        BENCH_QUEUE=queue,
        BENCH_KEY=key,
        BENCH_N=str(spec.n + 1),  # the warm-up task and n
        **spec.env,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Whatever the worker left behind (Dramatiq's forked worker, a program of -exec).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _forget(prefix: str) -> None:
    """Delete the run's Redis keys (the counters, Dramatiq's and Celery's queues)."""
    import redis

    r = redis.Redis.from_url(REDIS)
    keys = list(r.scan_iter(match=f"*{prefix}*", count=1000))
    if keys:
        r.delete(*keys)


def run_row(spec: Spec, project: Path, url: str) -> float:
    """Tasks/s from the first timed enqueue to the last completion."""
    tag = f"wqbench-{secrets.token_hex(4)}"
    queue, key = tag, f"{tag}:count"
    row_env = _row_env(spec, url, queue, key)
    log_path = project / f"{tag}.log"
    cmd = [part.format(url=url, queue=queue) for part in spec.worker]
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            cmd,
            cwd=project,
            env=row_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        producer = subprocess.Popen(
            [PY, "-m", "bench.tasks", "produce", spec.producer, str(spec.n), str(spec.producers)],
            cwd=project,
            env=row_env,
            stdout=subprocess.PIPE,
            text=True,
        )
        while producer.poll() is None:
            if worker.poll() is not None:
                producer.kill()
                producer.wait()
                break
            time.sleep(0.1)
        out = producer.communicate()[0]
        if producer.returncode != 0 or not out.strip():
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{spec.name}: the producer failed; the worker's log:\n{tail}")
        r = json.loads(out.strip().splitlines()[-1])
    finally:
        _stop(worker)
        _forget(tag)
    return float(r["n"]) / (float(r["done"]) - float(r["first"]))


# -- the section ----------------------------------------------------------------------------------

RAW = "raw Worker, no-op handler (python -m bench.tasks raw-worker)"
WQ_ASYNC = "wq worker bench_tasks:app: @app.task async def nothing()"
WQ_SYNC = "wq worker bench_tasks:app: @app.task def nothing_sync() (thread pool)"
WQ_QUIET = "wq worker -quiet bench_tasks:app: the same, no line per task"
WQ_EXEC = "wq worker -exec ./nothing.sh (a program per task)"
WQ_REDIS = "wq worker bench_tasks:app: @app.task async def noop()"
DRAMATIQ = f"Dramatiq (Redis): dramatiq bench_dramatiq -p 1 -t {CONCURRENCY}; actor.send()"
CELERY = f"Celery (Redis): celery -A bench_celery worker --pool threads -c {CONCURRENCY}; .delay()"
#: The framework's own cost: true no-ops counted by the broker, and enough concurrent producers
#: (the client's enqueues coalesce) that the worker, not the producer, sets the pace.
PURE_PRODUCERS = 64
PURE = {"BENCH_PURE": "1"}


def _wq(*args: str) -> list[str]:
    wq = BIN / "wq"
    prefix = [str(wq)] if wq.exists() else [PY, "-m", "wqclient.cli.admin"]
    return [*prefix, "worker", "-broker", "{url}", "-concurrency", str(CONCURRENCY), *args]


def specs(quick: bool) -> list[Spec]:
    n = 3_000 if quick else 10_000
    n_pure = 5_000 if quick else 20_000
    n_exec = 200 if quick else 1_000
    raw = [PY, "-m", "bench.tasks", "raw-worker", "{url}", str(CONCURRENCY)]
    app = _wq("bench_tasks:app")
    exec_ = _wq("-queues", "{queue}", "-exec", "./nothing.sh")

    def pure(name: str, worker: list[str], count: int, transport: str, task: str) -> Spec:
        env = {**PURE, "BENCH_TASK": task}
        return Spec(name, worker, "app", count, transport, env, PURE_PRODUCERS)

    rows = [
        pure(f"gRPC: {RAW}", raw, n_pure, "grpc", "nothing"),
        pure(f"gRPC: {WQ_ASYNC}", app, n_pure, "grpc", "nothing"),
        pure(f"gRPC: {WQ_QUIET}", _wq("-quiet", "bench_tasks:app"), n_pure, "grpc", "nothing"),
        pure(f"gRPC: {WQ_SYNC}", app, n_pure, "grpc", "nothing_sync"),
        pure(f"gRPC: {WQ_EXEC}", exec_, n_exec, "grpc", "nothing"),
        pure(f"HTTP: {RAW}", raw, n_pure, "http", "nothing"),
        pure(f"HTTP: {WQ_ASYNC}", app, n_pure, "http", "nothing"),
    ]
    dramatiq = [str(BIN / "dramatiq"), "bench_dramatiq", "-p", "1", "-t", str(CONCURRENCY)]
    celery = [str(BIN / "celery"), "-A", "bench_celery", "worker", "--pool", "threads"]
    celery += ["-c", str(CONCURRENCY), "--loglevel", "WARNING"]
    rows += [
        Spec(f"gRPC: {WQ_REDIS}", app, "app", n),
        Spec(DRAMATIQ, dramatiq, "dramatiq", n, transport="redis"),
        # (Half as many: Celery's thread pool runs a few hundred a second here.)
        Spec(CELERY, celery, "celery", n // 2, transport="redis"),
    ]
    return rows


def redis_unreachable() -> str | None:
    try:
        import redis

        redis.Redis.from_url(REDIS, socket_connect_timeout=2).ping()
    except Exception as e:
        return f"{REDIS}: {e}"
    return None


Add = Callable[..., None]


def section(quick: bool, broker: Callable[[], AbstractContextManager[_Server]], add: Add) -> Any:
    """The rows, each once per round (1 quick, else 3), rounds in turn; each row's median."""
    print(
        f"The task framework: a no-op task enqueued one per call, workers of {CONCURRENCY} "
        "(tasks/s)",
        flush=True,
    )
    why = redis_unreachable()
    if why is not None:
        add("tasks", "Redis (counts every row's completions)", f"unreachable ({why}): skipped")
        return {}
    found: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="wq-bench-tasks-") as tmp, broker() as b:
        project = Path(tmp)
        write_project(project)
        rows = specs(quick)
        urls = {"grpc": f"grpc://{b.grpc}", "http": b.http, "redis": REDIS}
        for _ in range(1 if quick else 3):
            for spec in rows:
                found.setdefault(spec.name, []).append(run_row(spec, project, urls[spec.transport]))
    medians = {name: statistics.median(rates) for name, rates in found.items()}
    report(medians, {s.name: s.n for s in rows}, add)
    return {"rates": found, "medians": medians}


def report(medians: dict[str, float], counts: dict[str, int], add: Add) -> None:
    raw = {t: medians[f"{t}: {RAW}"] for t in ("gRPC", "HTTP")}
    wq = medians[f"gRPC: {WQ_REDIS}"]
    add(
        "tasks",
        "the framework's cost",
        f"true no-ops, counted by the broker (acked); {PURE_PRODUCERS} producers",
    )
    for name, rate in medians.items():
        value, target, ok = f"{rate:,.0f}/s ({counts[name]:,} tasks)", "", None
        transport = name.split(":")[0]
        if name.endswith(WQ_ASYNC):
            ratio = rate / raw[transport]
            value += f" = {ratio:.0%} of the raw Worker"
            target, ok = ">= 85% of the raw Worker", ratio >= 0.85
        elif name.endswith(WQ_QUIET) or name.endswith(WQ_SYNC):
            value += f" = {rate / raw[transport]:.0%} of the raw Worker"
        elif name.endswith(WQ_EXEC):
            value += f" = {rate / raw[transport]:.1%} of the raw Worker"
        elif name.endswith(WQ_REDIS):
            add(
                "tasks",
                "side by side",
                f"each task a Redis INCR (every framework the same); {PRODUCERS} producers",
            )
        elif name in (DRAMATIQ, CELERY):
            value += f" = {rate / wq:.2f}x wq's async task (gRPC)"
        add("tasks", name, value, target, ok)


# -- the roles ------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    role = argv[0] if argv else ""
    if role == "produce" and len(argv) == 4:
        result = produce(argv[1], int(argv[2]), int(argv[3]))
        print(json.dumps(result), flush=True)
    elif role == "raw-worker" and len(argv) == 3:
        import uvloop  # (the loop `wq worker` runs on: the framework's cost, not the loop's)

        uvloop.run(raw_worker(argv[1], int(argv[2])))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
