"""``make bench``: start brokers, drive them from processes of their own, print one table.

    python -m bench [--quick] [--json FILE] [SECTION ...]

A SECTION alone runs that part only: ``python -m bench tasks`` (``make bench ARGS=tasks``) the
task framework (``wq worker MODULE:APP``, ``-exec``) against the raw Worker and the same no-op task
in Dramatiq and Celery (Redis at $WQ_BENCH_REDIS, default redis://127.0.0.1:6379/0).

Every figure is measured on this machine, now; nothing here passes or fails a build. The targets
column repeats the goals of the performance issue for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench import pg
from bench import tasks as task_rows

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


@dataclass
class Row:
    section: str
    name: str
    value: str
    target: str = ""
    ok: bool | None = None


ROWS: list[Row] = []
RESULTS: dict[str, Any] = {}


def add(section: str, name: str, value: str, target: str = "", ok: bool | None = None) -> None:
    ROWS.append(Row(section, name, value, target, ok))
    mark = "" if ok is None else (" ok" if ok else " MISSED")
    print(f"  {name}: {value}{'  (target ' + target + mark + ')' if target else ''}", flush=True)


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", GRPC_VERBOSITY="ERROR")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    http: str
    grpc: str


@contextlib.contextmanager
def broker(*args: str, grpc: bool = True) -> Iterator[Server]:
    http_port, grpc_port = free_port(), free_port()
    grpc_addr = f"127.0.0.1:{grpc_port}" if grpc else "off"
    cmd = [
        PY,
        "-m",
        "wqbroker",
        "-addr",
        f"127.0.0.1:{http_port}",
        "-grpc-addr",
        grpc_addr,
        "-log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env())
    try:
        wait_port(http_port)
        if grpc:
            wait_port(grpc_port)
        yield Server(proc, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def _null_process(module: str, scheme: str) -> Iterator[tuple[str, int]]:
    """A null broker (``python -m MODULE PORT``): its URL and its pid."""
    port = free_port()
    proc = subprocess.Popen([PY, "-m", module, str(port)], cwd=ROOT, env=env())
    try:
        wait_port(port)
        yield f"{scheme}://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def null_broker_process() -> contextlib.AbstractContextManager[tuple[str, int]]:
    """The null broker (:mod:`bench.nullbroker`): its URL and its pid."""
    return _null_process("bench.nullbroker", "http")


def null_grpc_broker_process() -> contextlib.AbstractContextManager[tuple[str, int]]:
    """The null gRPC broker (:mod:`bench.nullgrpc`): its grpc:// URL and its pid."""
    return _null_process("bench.nullgrpc", "grpc")


@contextlib.contextmanager
def null_broker() -> Iterator[str]:
    with null_broker_process() as (url, _):
        yield url


def run_json(*args: str, timeout: float = 600) -> dict[str, Any]:
    out = subprocess.run(
        [PY, "-m", *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout
    )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def end_to_end(target: str, mode: str, n: int, concurrency: int) -> float:
    """Tasks/s from the producer's first enqueue to the consumer's last ack."""
    consume = subprocess.Popen(
        [PY, "-m", "bench.load", "consume", target, mode, str(n), str(concurrency)],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)  # let the consumer park first
    produced = run_json("bench.load", "produce", target, mode, str(n), str(concurrency))
    consumed = json.loads(consume.communicate(timeout=600)[0].strip().splitlines()[-1])
    elapsed: float = max(consumed["last"], produced["last"]) - produced["first"]
    return n / elapsed


def enqueue_rate(target: str, mode: str, n: int, concurrency: int) -> float:
    produced = run_json("bench.load", "produce", target, mode, str(n), str(concurrency))
    elapsed: float = produced["last"] - produced["first"]
    return n / elapsed


def best_of(runs: int, fn: Callable[..., float], *args: Any) -> float:
    return max(fn(*args) for _ in range(runs))


# -- sections -------------------------------------------------------------------------------------


def throughput(q: bool) -> None:
    print("End-to-end throughput (enqueue -> deliver -> ack), tasks/s", flush=True)
    runs = 1 if q else 3
    n_http, n_unary, n_stream = (8_000, 6_000, 40_000) if q else (30_000, 15_000, 150_000)
    # The null broker and wq take turns, so that a machine that speeds up or slows down during
    # the run does not tilt the ratio; each reports its median run.
    nulls: list[float] = []
    https: list[float] = []
    with null_broker() as url, broker() as b:
        for _ in range(runs):
            nulls.append(end_to_end(url, "http", n_http, 32))
            https.append(end_to_end(b.http, "http", n_http, 32))
    null, http = statistics.median(nulls), statistics.median(https)
    with broker() as b:
        unary = best_of(runs, end_to_end, b.grpc, "unary", n_unary, 32)
        batched = best_of(runs, end_to_end, b.grpc, "unary-batched", n_unary * 2, 32)
        stream = best_of(runs, end_to_end, b.grpc, "stream", n_stream, 256)
    RESULTS["throughput"] = {
        "null": null,
        "http": http,
        "unary": unary,
        "unary_batched": batched,
        "stream": stream,
    }
    add("throughput", "null broker (aiohttp, canned answers), HTTP", f"{null:,.0f}")
    add(
        "throughput",
        "HTTP long-poll, one task per request",
        f"{http:,.0f} = {http / null:.0%} of null",
        ">= 75% of null",
        http / null >= 0.75,
    )
    add(
        "throughput",
        "unary gRPC (Enqueue, NextJob, Ack)",
        f"{unary:,.0f}",
        ">= 3,000",
        unary >= 3000,
    )
    add(
        "throughput",
        "unary gRPC, EnqueueBatch + acks riding on NextJob",
        f"{batched:,.0f}",
        ">= 3,000",
        batched >= 3000,
    )
    add(
        "throughput",
        "gRPC stream (EnqueueBatch, StreamJobs, batched acks)",
        f"{stream:,.0f}",
        ">= 15,000",
        stream >= 15000,
    )


def durable(q: bool) -> None:
    print("Memory versus SQLite store (SQLite: WAL, synchronous=FULL unless noted)", flush=True)
    n_http, n_stream = (6_000, 30_000) if q else (20_000, 100_000)
    figures: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="wq-bench-") as tmp:
        for label, args in (
            ("memory", ()),
            ("sqlite full", ("-store", f"sqlite:{tmp}/full.db")),
            ("sqlite normal", ("-store", f"sqlite:{tmp}/normal.db", "-sqlite-sync", "normal")),
        ):
            with broker(*args) as b:
                figures[label] = {
                    "e2e_http": end_to_end(b.http, "http", n_http, 32),
                    "e2e_stream": end_to_end(b.grpc, "stream", n_stream, 256),
                    # last: it leaves its tasks queued
                    "enqueue_http": enqueue_rate(b.http, "http", n_http, 32),
                }
    RESULTS["stores"] = figures
    mem = figures["memory"]
    for label, f in figures.items():
        add("stores", f"{label}: HTTP enqueue rate", f"{f['enqueue_http']:,.0f}/s")
        ratio = f["e2e_http"] / mem["e2e_http"]
        stream_ratio = f["e2e_stream"] / mem["e2e_stream"]
        if label == "memory":
            add("stores", "memory: HTTP end to end", f"{f['e2e_http']:,.0f}/s")
            add("stores", "memory: stream end to end", f"{f['e2e_stream']:,.0f}/s")
            continue
        add(
            "stores",
            f"{label}: HTTP end to end",
            f"{f['e2e_http']:,.0f}/s = {ratio:.0%} of memory",
            ">= 50% of memory",
            ratio >= 0.5,
        )
        add(
            "stores",
            f"{label}: stream end to end",
            f"{f['e2e_stream']:,.0f}/s = {stream_ratio:.0%} of memory",
        )


def latency(q: bool) -> None:
    print("Enqueue-to-delivery latency, one task at a time, a worker already parked", flush=True)
    n = "300" if q else "2000"
    with broker() as b:
        http = run_json("bench.load", "latency", b.http, "http", n, "2", "0")
        stream = run_json("bench.load", "latency", b.grpc, "stream", n, "2", "0")
    RESULTS["latency"] = {"http": http, "stream": stream}
    add("latency", "HTTP p50", f"{http['p50_ms']:.2f} ms", "<= 1 ms", http["p50_ms"] <= 1)
    add("latency", "HTTP p99", f"{http['p99_ms']:.2f} ms", "<= 5 ms", http["p99_ms"] <= 5)
    add("latency", "stream p50", f"{stream['p50_ms']:.2f} ms")
    add("latency", "stream p99", f"{stream['p99_ms']:.2f} ms", "<= 3 ms", stream["p99_ms"] <= 3)


def delayed(q: bool) -> None:
    print("Delayed tasks: how late they become claimable (delay_ms 50, worker parked)", flush=True)
    n = "200" if q else "1000"
    with broker() as b:
        http = run_json("bench.load", "latency", b.http, "http", n, "1", "50")
        stream = run_json("bench.load", "latency", b.grpc, "stream", n, "1", "50")
    RESULTS["delayed"] = {"http": http, "stream": stream}
    for label, r in (("HTTP", http), ("stream", stream)):
        add(
            "delayed",
            f"{label} lateness median",
            f"{r['p50_ms']:.2f} ms",
            "<= 5 ms",
            r["p50_ms"] <= 5,
        )
        add(
            "delayed",
            f"{label} lateness p99",
            f"{r['p99_ms']:.2f} ms",
            "<= 20 ms",
            r["p99_ms"] <= 20,
        )


def memory(q: bool) -> None:
    print("Memory: RSS per ready task, 100-byte payloads, beyond the payload bytes", flush=True)
    n = 200_000 if q else 1_000_000
    r = run_json("bench.inproc", "memory", str(n))
    RESULTS["memory"] = r
    per = r["bytes_per_task_beyond_payload"]
    add(
        "memory",
        f"{n:,} ready tasks",
        f"{per:.0f} B/task (RSS {r['rss_mb']:.0f} MiB)",
        "<= 300 B",
        per <= 300,
    )


def _scrape_ms(url: str, times: int = 5) -> float:
    """The fastest of ``times`` scrapes of ``url``/metrics, in milliseconds."""
    best = float("inf")
    for _ in range(times):
        started = time.perf_counter()
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            resp.read()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def metrics(q: bool) -> None:
    """A scrape of GET /metrics with few and with many tasks waiting (five queues)."""
    print("Metrics: the cost of a scrape as the backlog grows", flush=True)
    sizes = (10_000, 200_000) if q else (10_000, 1_000_000)
    found: dict[int, float] = {}
    with broker() as b:
        have = 0
        for n in sizes:
            run_json("bench.load", "produce", b.grpc, "stream", str(n - have), "4")
            have = n
            found[n] = _scrape_ms(b.http)
    RESULTS["metrics"] = found
    small, large = (found[n] for n in sizes)
    add("metrics", f"scrape with {sizes[0]:,} tasks ready", f"{small:.2f} ms")
    add(
        "metrics",
        f"scrape with {sizes[1]:,} tasks ready",
        f"{large:.2f} ms = {large / small:.2f}x",
        "no per-task work (~1x)",
        large / small <= 1.5,
    )


def backlog(q: bool) -> None:
    print("SQLite backlog: resident memory per ready task, and a restart", flush=True)
    n_small, n_big, n_restart = (50_000, 20_000, 200_000) if q else (300_000, 100_000, 1_000_000)
    with tempfile.TemporaryDirectory(prefix="wq-bench-") as tmp:
        small = run_json("bench.durable", "fill", f"{tmp}/a.db", str(n_small), "60")
        big = run_json("bench.durable", "fill", f"{tmp}/b.db", str(n_big), "1024")
        filled = run_json("bench.durable", "build", f"{tmp}/c.db", str(n_restart), "60")
        restart = run_json("bench.durable", "open", f"{tmp}/c.db")
    RESULTS["backlog"] = {"fill_60": small, "fill_1k": big, "built": filled, "restart": restart}
    for label, r in ((f"{n_small:,} x 60 B", small), (f"{n_big:,} x 1 KiB", big)):
        per = r["bytes_per_task"]
        add(
            "backlog",
            f"RSS per ready task, {label} (enqueue_many)",
            f"{per:.0f} B; each further one {r['marginal_bytes_per_task']:.0f} B "
            f"(RSS {r['rss_mb']:.0f} MiB; filled at {r['n'] / r['fill_s']:,.0f} tasks/s)",
            "<= 350 B",
            per <= 350,
        )
    add(
        "backlog",
        "projected RSS at 10M tasks of 1 KiB",
        f"{big['projected_10m_gib']:.2f} GiB",
        "well under 4 GiB",
        big["projected_10m_gib"] < 2,
    )
    add(
        "backlog",
        f"restart with {restart['ready']:,} ready tasks",
        f"{restart['open_s']:.2f} s",
        "<= 5 s",
        restart["open_s"] <= 5,
    )
    grew = restart["rss_mb"] <= filled["rss_mb"]
    add(
        "backlog",
        "RSS after the restart / before it",
        f"{restart['rss_mb']:.0f} / {filled['rss_mb']:.0f} MiB",
        "no more after",
        grew,
    )


def scale(q: bool) -> None:
    print(
        "Scale: cost per operation with 1k versus 1M tasks each ready, delayed, handed out",
        flush=True,
    )
    large = 200_000 if q else 1_000_000
    r = run_json("bench.inproc", "scale", "1000", str(large), "20000")
    RESULTS["scale"] = r
    for op in ("enqueue", "claim", "ack"):
        ratio = r["ratio"][op]
        add(
            "scale",
            f"{op}: {r['us_small'][op]:.2f} us -> {r['us_large'][op]:.2f} us",
            f"ratio {ratio:.2f}",
            "<= 1.5",
            ratio <= 1.5,
        )
    s = run_json("bench.inproc", "sweep", str(large))
    RESULTS["sweep"] = s
    add(
        "scale",
        f"sweeper tick, {large:,} leases none due",
        f"median {s['tick_median_us']:.1f} us, max {s['tick_max_us']:.0f} us",
        "<= 1 ms",
        s["tick_median_us"] <= 1000,
    )


def queues(q: bool) -> None:
    print(
        "Queues: cost per operation with tasks over 1,000 queues x 10 priorities vs one queue",
        flush=True,
    )
    tasks = 100_000 if q else 1_000_000
    r = run_json("bench.inproc", "queues", "1000", "10", str(tasks), "20000")
    RESULTS["queues"] = r
    for op in ("enqueue", "claim", "ack"):
        ratio = r["ratio"][op]
        add(
            "queues",
            f"{op}: {r['us_one'][op]:.2f} us (one queue) -> {r['us_many'][op]:.2f} us",
            f"ratio {ratio:.2f}",
            "<= 1.5" if op == "claim" else "",
            ratio <= 1.5 if op == "claim" else None,
        )


def pollers(q: bool) -> None:
    print(
        "Parked HTTP long-pollers: broker memory each, and a worker's latency with them", flush=True
    )
    count = 2000 if q else 10_000
    samples = "300" if q else "1000"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, count * 2 + 1000)), hard))
    # Alone, with them, alone again: the baseline is the mean of the two runs around the other.
    runs = []
    for pollers in ("1", str(count), "1"):
        with broker(grpc=False) as b:
            runs.append(run_json("bench.pollers", b.http, str(b.proc.pid), pollers, samples, "2"))
    first, many, last = runs
    base = {k: (first[k] + last[k]) / 2 for k in ("p50_ms", "p99_ms")}
    RESULTS["pollers"] = {"one": base, "many": many}
    per = many["bytes_per_poller"]
    add(
        "pollers",
        f"{count:,} parked pollers",
        f"{per / 1024:.1f} KB each",
        "<= 20 KB",
        per <= 20 * 1024,
    )
    change = many["p50_ms"] / base["p50_ms"]
    figure = f"{base['p50_ms']:.2f} -> {many['p50_ms']:.2f} ms ({change:.2f}x)"
    add("pollers", "delivery latency p50, alone -> with them", figure, "<= 1.2x", change <= 1.2)
    add(
        "pollers",
        "delivery latency p99, alone -> with them",
        f"{base['p99_ms']:.2f} -> {many['p99_ms']:.2f} ms",
    )


def rabbitmq(q: bool) -> None:
    print("RabbitMQ on 127.0.0.1:5672, same workload (aio-pika, confirms, manual acks)", flush=True)
    try:
        with socket.create_connection(("127.0.0.1", 5672), 1):
            pass
    except OSError:
        add("rabbitmq", "RabbitMQ", "not running on 127.0.0.1:5672: skipped")
        return
    try:
        import aio_pika  # noqa: F401
    except ImportError:
        add("rabbitmq", "RabbitMQ", "aio-pika is not installed: skipped")
        return
    n = 10_000 if q else 50_000
    url = os.environ.get("WQ_BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672/")
    queue = f"wq-bench-{os.getpid()}"
    consume = subprocess.Popen(
        [PY, "-m", "bench.rabbit", "consume", url, queue, str(n), "256"],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    produced = run_json("bench.rabbit", "produce", url, queue, str(n), "64")
    consumed = json.loads(consume.communicate(timeout=600)[0].strip().splitlines()[-1])
    rate = n / (consumed["last"] - produced["first"])
    RESULTS["rabbitmq"] = rate
    add("rabbitmq", "RabbitMQ end to end (prefetch 256, 64 publishers)", f"{rate:,.0f}/s")
    t = RESULTS.get("throughput")
    if t:
        add(
            "rabbitmq", "wq for comparison", f"HTTP {t['http']:,.0f}/s, stream {t['stream']:,.0f}/s"
        )


# -- PostgreSQL ----------------------------------------------------------------------------------


def last_json(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0 or not out.strip():
        raise RuntimeError(f"{what} failed (exit status {proc.returncode})")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PY, "-m", *args], cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True
    )


def shared_end_to_end(urls: list[str], n: int, concurrency: int) -> float:
    """Tasks/s with a producer and a consumer process on each of ``urls`` (brokers on one
    database; the same URL twice: both pairs on one broker), each producer enqueueing its share;
    each consumer takes whatever it gets until ``n`` are acked in all."""
    share = n // len(urls)
    consumers = [
        spawn("bench.pg", "consume", u, str(share * len(urls)), str(concurrency)) for u in urls
    ]
    time.sleep(1.0)  # let the consumers read the totals and park
    producers = [
        spawn("bench.load", "produce", u, "http", str(share), str(concurrency)) for u in urls
    ]
    produced = [last_json(p, "a producer") for p in producers]
    consumed = [last_json(c, "a consumer") for c in consumers]
    first: float = min(p["first"] for p in produced)
    last: float = max(r["last"] for r in (*produced, *consumed))
    return share * len(urls) / (last - first)


def with_cpu(pids: list[int], fn: Callable[..., float], *args: Any) -> tuple[float, dict[str, Any]]:
    before = pg.cpu_reading(pids)
    rate = fn(*args)
    return rate, pg.cpu_use(before, pids)


def cpu_text(cpu: dict[str, Any], rate: float) -> str:
    """Cores used (and CPU milliseconds per task) by the brokers and PostgreSQL; the machine's
    figure also counts the load generators, and anything else running."""
    brokers = " + ".join(f"{c:.2f}" for c in cpu["brokers"])
    per_task = (sum(cpu["brokers"]), cpu["postgres"])
    ms = [f"{c / rate * 1000:.2f}" for c in per_task]
    return (
        f"broker {brokers}, postgres {cpu['postgres']:.2f}, machine {cpu['machine']:.2f} of "
        f"{cpu['cores']}; per task: broker {ms[0]} ms, postgres {ms[1]} ms"
    )


def pg_one_broker(q: bool, dsn: str, figures: dict[str, Any]) -> None:
    """HTTP against the memory store, back to back; the stream."""
    runs = 1 if q else 3
    n_http, n_stream = (4_000, 30_000) if q else (10_000, 100_000)
    mems: list[float] = []
    pgs: list[float] = []
    with broker() as m, broker("-store", dsn) as p:
        for _ in range(runs):
            rate, mem_cpu = with_cpu([m.proc.pid], end_to_end, m.http, "http", n_http, 32)
            mems.append(rate)
            rate, http_cpu = with_cpu([p.proc.pid], end_to_end, p.http, "http", n_http, 32)
            pgs.append(rate)
        mem_stream = end_to_end(m.grpc, "stream", n_stream, 256)
        stream, stream_cpu = with_cpu([p.proc.pid], end_to_end, p.grpc, "stream", n_stream, 256)
    mem, http = statistics.median(mems), statistics.median(pgs)
    figures["one_broker"] = {
        "memory_http": mems,
        "memory_http_cpu": mem_cpu,
        "postgres_http": pgs,
        "postgres_http_cpu": http_cpu,
        "memory_stream": mem_stream,
        "postgres_stream": stream,
        "postgres_stream_cpu": stream_cpu,
    }
    add("postgres", f"memory: HTTP end to end (median of {runs})", f"{mem:,.0f}/s")
    add("postgres", "  CPU during it (cores)", cpu_text(mem_cpu, mems[-1]))
    add(
        "postgres",
        "postgres, one broker: HTTP end to end",
        f"{http:,.0f}/s = {http / mem:.0%} of memory",
        ">= 50% of memory",
        http / mem >= 0.5,
    )
    add("postgres", "  CPU during it (cores)", cpu_text(http_cpu, pgs[-1]))
    add("postgres", "memory: stream end to end", f"{mem_stream:,.0f}/s")
    add(
        "postgres",
        "postgres, one broker: stream end to end",
        f"{stream:,.0f}/s = {stream / mem_stream:.0%} of memory",
        ">= 5,000",
        stream >= 5000,
    )
    add("postgres", "  CPU during it (cores)", cpu_text(stream_cpu, stream))


def pg_two_brokers(q: bool, a: Server, b: Server, figures: dict[str, Any]) -> None:
    """Two producer and two consumer processes, all on broker A, then split over A and B."""
    runs = 1 if q else 3
    n = 4_000 if q else 10_000
    pids = [a.proc.pid, b.proc.pid]
    ones: list[float] = []
    twos: list[float] = []
    for _ in range(runs):
        rate, one_cpu = with_cpu(pids, shared_end_to_end, [a.http, a.http], n, 16)
        ones.append(rate)
        rate, two_cpu = with_cpu(pids, shared_end_to_end, [a.http, b.http], n, 16)
        twos.append(rate)
    one, two = statistics.median(ones), statistics.median(twos)
    figures["two_brokers"] = {"one": ones, "one_cpu": one_cpu, "two": twos, "two_cpu": two_cpu}
    add("postgres", "one broker, 2 producers + 2 consumers (HTTP)", f"{one:,.0f}/s")
    add("postgres", "  CPU during it (cores)", cpu_text(one_cpu, ones[-1]))
    add(
        "postgres",
        "two brokers, one database, the same load split",
        f"{two:,.0f}/s = {two / one:.2f}x one broker",
        ">= 1.0x one broker",
        two / one >= 1.0,
    )
    add("postgres", "  CPU during it (cores)", cpu_text(two_cpu, twos[-1]))


def pg_wake(q: bool, a: Server, b: Server, figures: dict[str, Any]) -> None:
    """A task enqueued on A, a worker parked on A (same broker) or on B (across brokers)."""
    n = "50" if q else "200"
    budget = "15" if q else "45"
    found: dict[str, dict[str, Any]] = {}
    for label, mode, enqueue, claim in (
        ("same broker, HTTP", "wake", a.http, a.http),
        ("across brokers, HTTP", "wake", a.http, b.http),
        ("same broker, stream", "wake-stream", a.grpc, a.grpc),
        ("across brokers, stream", "wake-stream", a.grpc, b.grpc),
    ):
        r = found[label] = run_json("bench.pg", mode, enqueue, claim, n, budget)
        if not r["n"]:
            add("postgres", f"wake-up {label}", "no sample within the budget")
            continue
        cut = f" (budget: {r['n']} samples)" if r["budget_hit"] else ""
        figure = f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f} ms{cut}"
        across = label.startswith("across")
        ok = r["p50_ms"] <= 5 and r["p99_ms"] <= 25
        add(
            "postgres",
            f"wake-up {label}: p50 / p99",
            figure,
            "<= 5 / <= 25 ms" if across else "",
            ok if across else None,
        )
    figures["wake"] = found


def pg_churn(q: bool, fresh: str, dsn: str, figures: dict[str, Any]) -> None:
    n = 200_000 if q else 1_000_000
    r = figures["churn"] = run_json(
        "bench.pg", "churn", fresh, dsn, str(n), "10000", "1000" if q else "2000", timeout=1800
    )
    add(
        "postgres",
        "claim+ack (two calls), fresh table, 10k ready",
        f"{r['fresh_ms']:.2f} ms (two fresh tables: {r['noise_ratio']:.2f}x)",
    )
    add(
        "postgres",
        f"claim+ack after {n:,} tasks processed (in turns with it)",
        f"{r['after_ms']:.2f} ms = {r['ratio']:.2f}x ({r['at_once_ms']:.2f} ms right after)",
        "<= 1.5x",
        r["ratio"] <= 1.5,
    )
    add(
        "postgres",
        f"{n:,} tasks pushed (enqueue, claim, ack: batches of 1,000)",
        f"{r['push_rate']:,.0f} tasks/s ({r['push_s']:.0f} s)",
    )
    end = r["table_end"]
    add(
        "postgres",
        "wq.tasks at the end",
        f"{end['bytes'] / 2**20:.0f} MiB, {end['rows']:,} rows, {end['n_dead_tup']:,} dead tuples; "
        f"{r['store_vacuums']} VACUUMs by the store, {end['autovacuums']} autovacuums "
        f"(server: autovacuum={r['autovacuum']}, naptime {r['autovacuum_naptime']})",
    )


def postgres(q: bool) -> None:
    print(
        f"PostgreSQL store at {pg.MAINTENANCE} (scratch databases, dropped at the end)", flush=True
    )
    why = pg.unreachable()
    if why is not None:
        add("postgres", "PostgreSQL", f"unreachable ({why}): skipped")
        return
    figures: dict[str, Any] = {}
    RESULTS["postgres"] = figures
    started = time.monotonic()
    with pg.scratch() as make:
        pg_one_broker(q, make("one"), figures)
        shared = make("shared")
        with broker("-store", shared) as a, broker("-store", shared) as b:
            pg_two_brokers(q, a, b, figures)
            pg_wake(q, a, b, figures)
        pg_churn(q, make("fresh"), make("churn"), figures)
    figures["seconds"] = time.monotonic() - started
    add("postgres", "the section took", f"{figures['seconds']:.0f} s")


# -- draining a backlog ---------------------------------------------------------------------------

DRAIN_CONCURRENCY: Final = (3, 64)  # wq-worker's default, and the users section's Worker


def _drain_once(url: str, n: int, concurrency: int) -> float:
    """Fill the broker with ``n`` ready tasks (not timed), then one Worker drains them: tasks/s."""
    run_json("bench.drain", "fill", url, str(n))
    return float(run_json("bench.drain", "run", url, str(n), str(concurrency))["rate"])


def drain(q: bool) -> None:
    """One Worker (wqclient's, a handler that returns at once) draining a backlog of ready tasks,
    on each store, the stores in turn in every round; each row's median."""
    print("Draining a backlog: one Worker, tasks all ready before it starts (tasks/s)", flush=True)
    n = 3_000 if q else 10_000
    runs = 1 if q else 3
    why = pg.unreachable()
    found: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="wq-bench-") as tmp, pg.scratch() as make:
        stores = [("memory", ()), ("sqlite", ("-store", f"sqlite:{tmp}/drain.db"))]
        if why is None:
            stores.append(("postgres", ("-store", make("drain"))))
        with contextlib.ExitStack() as stack:
            brokers = [(label, stack.enter_context(broker(*args))) for label, args in stores]
            for _ in range(runs):
                for concurrency in DRAIN_CONCURRENCY:
                    for label, b in brokers:
                        key = f"{label} gRPC {concurrency}"
                        found.setdefault(key, []).append(
                            _drain_once(f"grpc://{b.grpc}", n, concurrency)
                        )
                for label, b in brokers:
                    key = f"{label} HTTP 64"
                    found.setdefault(key, []).append(_drain_once(b.http, n, 64))
    RESULTS["drain"] = found
    medians = {key: statistics.median(rates) for key, rates in found.items()}
    if why is not None:
        add("drain", "PostgreSQL", f"unreachable ({why}): skipped")
    for key, rate in medians.items():
        label, transport, width = key.split()
        name = f"{label}: {n:,} tasks, {transport}, Worker(concurrency={width})"
        mem = medians[f"memory {transport} {width}"]
        if label == "memory":
            add("drain", name, f"{rate:,.0f}/s")
            continue
        add(
            "drain",
            name,
            f"{rate:,.0f}/s = {rate / mem:.0%} of memory",
            ">= 50% of memory",
            rate >= 0.5 * mem,
        )


# -- listing a queue's tasks --------------------------------------------------------------------


def listing(q: bool) -> None:
    """A page of a queue's tasks (ListTasks, 100 a page) with a small and a large queue, ready
    and delayed, on each store: the whole listing read page after page, each call timed."""
    print("Listing a queue's tasks, 100 a page (ms per page)", flush=True)
    big = 100_000 if q else 1_000_000
    why = pg.unreachable()
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="wq-bench-") as tmp, pg.scratch() as make:
        stores: list[tuple[str, Callable[[str], tuple[str, ...]]]] = [
            ("memory", lambda _: ()),
            ("sqlite", lambda tag: ("-store", f"sqlite:{tmp}/{tag}.db")),
        ]
        if why is None:
            stores.append(("postgres", lambda tag: ("-store", make(tag))))
        for label, store in stores:
            for state in ("ready", "delayed"):
                for n in (1_000, big):
                    tag = f"list_{state}_{n}"
                    with broker(*store(tag), "-max-tasks", "0") as b:
                        run_json("bench.listing", "fill", b.grpc, str(n), state, timeout=1800)
                        r = run_json("bench.listing", "pages", b.grpc, state, "100", timeout=1800)
                    found[f"{label} {state} {n}"] = r
                    add(
                        "listing",
                        f"{label}: {n:,} {state} tasks, {r['pages']:,} pages",
                        f"first {r['first_ms']:.2f}, median {r['median_ms']:.2f}, p99 "
                        f"{r['p99_ms']:.2f}, last {r['last_ms']:.2f} ms",
                    )
    if why is not None:
        add("listing", "PostgreSQL", f"unreachable ({why}): skipped")
    RESULTS["listing"] = found


# -- workflows: fan-in and fan-out ---------------------------------------------------------------


def workflows(q: bool) -> None:
    """A fan-in of 10,000 parents into one child, and a fan-out of one parent into 10,000
    children (docs/design/results.md), on each store, each run on a fresh broker: how soon the
    child is handed out after the last parent's ack, how long the ack that releases 10,000
    children takes, and when they are all handed out."""
    print("Workflows: a fan-in and a fan-out of 10,000 (ms)", flush=True)
    n = 2_000 if q else 10_000
    runs = 1 if q else 3
    why = pg.unreachable()
    found: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="wq-bench-") as tmp, pg.scratch() as make:
        stores: list[tuple[str, Callable[[str], tuple[str, ...]]]] = [
            ("memory", lambda _: ()),
            ("sqlite", lambda tag: ("-store", f"sqlite:{tmp}/{tag}.db")),
        ]
        if why is None:
            stores.append(("postgres", lambda tag: ("-store", make(tag))))
        for run in range(runs):
            for label, store in stores:
                for shape in ("fan-in", "fan-out"):
                    with broker(*store(f"wf_{shape.replace('-', '')}_{run}")) as b:
                        r = run_json("bench.workflows", shape, b.grpc, str(n), timeout=600)
                    found.setdefault(f"{label} {shape}", []).append(r)
    RESULTS["workflows"] = found
    if why is not None:
        add("workflows", "PostgreSQL", f"unreachable ({why}): skipped")
    for key, rs in found.items():
        label, shape = key.split()
        if shape == "fan-in":
            release = statistics.median(r["release_ms"] for r in rs)
            once = all(r["deliveries"] == 1 and r["parents_on_delivery"] == n for r in rs)
            add(
                "workflows",
                f"{label}: {n:,} parents into one child: the child handed out after the last "
                "parent's ack (median)",
                f"{release:.1f} ms ({'once, with every parent' if once else 'NOT ONCE'})",
                "<= 50 ms, once",
                release <= 50 and once,
            )
        else:
            ack = statistics.median(r["ack_ms"] for r in rs)
            last = statistics.median(r["last_ms"] for r in rs)
            first = statistics.median(r["first_ms"] for r in rs)
            add(
                "workflows",
                f"{label}: one parent into {n:,} children: its ack / first / last child handed "
                "out (medians)",
                f"{ack:.1f} / {first:.1f} / {last:.1f} ms",
            )


# -- schedules: how late each fire is -------------------------------------------------------------


def schedules(q: bool) -> None:
    """N schedules firing every second (docs/design/schedules.md), from a -schedule-file, on a
    broker of each store for a while: each fire's delay from its scheduled time to its task's
    enqueue (created_at - scheduled_for), and that no time fired twice."""
    n = 50 if q else 500
    seconds = 5 if q else 20
    print(f"Schedules: {n} firing every second for {seconds} s (fire delay, ms)", flush=True)
    why = pg.unreachable()
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="wq-bench-") as tmp, pg.scratch() as make:
        path = f"{tmp}/schedules.json"
        run_json("bench.schedules", "file", path, str(n))
        stores: list[tuple[str, Callable[[str], tuple[str, ...]]]] = [
            ("memory", lambda _: ()),
            ("sqlite", lambda tag: ("-store", f"sqlite:{tmp}/{tag}.db")),
        ]
        if why is None:
            stores.append(("postgres", lambda tag: ("-store", make(tag))))
        for label, store in stores:
            with broker(*store(f"sched_{label}"), "-schedule-file", path) as b:
                time.sleep(seconds)
                r = run_json("bench.schedules", "delays", b.http, timeout=600)
            found[label] = r
            add(
                "schedules",
                f"{label}: {n} schedules every second, {r['fires']:,} fires ({r['per_s']:,.0f}/s)",
                f"p50 {r['p50_ms']:.1f}, p99 {r['p99_ms']:.1f}, max {r['max_ms']:.1f} ms; after "
                f"the first second: p99 {r['warm_p99_ms']:.1f}, max {r['warm_max_ms']:.1f} ms"
                + ("" if r["once"] else " (A TIME FIRED TWICE)"),
            )
    if why is not None:
        add("schedules", "PostgreSQL", f"unreachable ({why}): skipped")
    RESULTS["schedules"] = found


def limits(q: bool) -> None:
    """Limits per queue (docs/design/schedules.md) on a broker of each store: workers of the
    public client (wqclient.Worker, over gRPC) asking for far more than a queue limited to 200 a
    second (a burst of 20) and one limited to 8 at once allow, for a while (bench/limits.py):
    the rate achieved after the burst and the most in any one-second window, against the
    limit; the most tasks of the concurrency-limited queue held at once, against the limit."""
    rate, burst, concurrency = 200, 20, 8
    seconds = 4 if q else 10
    print(f"Limits: {rate}/s (burst {burst}), {concurrency} at once, {seconds} s", flush=True)
    why = pg.unreachable()
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="wq-bench-") as tmp, pg.scratch() as make:
        stores: list[tuple[str, Callable[[str], tuple[str, ...]]]] = [
            ("memory", lambda _: ()),
            ("sqlite", lambda tag: ("-store", f"sqlite:{tmp}/{tag}.db")),
        ]
        if why is None:
            stores.append(("postgres", lambda tag: ("-store", make(tag))))
        for label, store in stores:
            with broker(*store(f"limits_{label}")) as b:
                r = run_json(
                    "bench.limits",
                    "run",
                    f"grpc://{b.grpc}",
                    str(seconds),
                    str(rate),
                    str(burst),
                    str(concurrency),
                    timeout=600,
                )
            found[label] = r
            rr, cc = r["rate"], r["concurrency"]
            # (The window is measured where the handlers start, a delivery's jitter after the
            # broker's hand-out: a task or two over the broker's bound is that jitter; the tests
            # check the bound exactly, from the hand-out times the store keeps.)
            slack = max(2, (rate + burst) // 100)
            add(
                "limits",
                f"{label}: a queue limited to {rate}/s (burst {burst}): rate after the burst; "
                "most in any second, at the handlers",
                f"{rr['steady_per_s']:.1f}/s; {rr['max_window']} (bound {rr['window_bound']})",
                f"~{rate}/s, <= {rate + burst} (+ jitter {slack})",
                rr["max_window"] <= rate + burst + slack and rr["steady_per_s"] >= 0.9 * rate,
            )
            add(
                "limits",
                f"{label}: a queue limited to {concurrency} at once (5 ms tasks): most held "
                "(broker / handlers); tasks a second",
                f"{cc['max_held_broker']} / {cc['max_in_handlers']}; {cc['per_s']:.0f}/s",
                f"{concurrency}",
                cc["max_held_broker"] <= concurrency and cc["max_in_handlers"] <= concurrency,
            )
    if why is not None:
        add("limits", "PostgreSQL", f"unreachable ({why}): skipped")
    RESULTS["limits"] = found


# -- a slow link to the database -------------------------------------------------------------------

LINK_DELAY_MS: Final = 20  # each way


@contextlib.contextmanager
def delay_proxy(target: str, delay_ms: float) -> Iterator[int]:
    """:mod:`bench.delayproxy` in a process of its own, forwarding to ``target`` (host:port)
    ``delay_ms`` late each way: its port."""
    proc = subprocess.Popen(
        [PY, "-m", "bench.delayproxy", "0", target, str(delay_ms)],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield int(json.loads(proc.stdout.readline())["port"])
    finally:
        proc.terminate()
        proc.wait(10)


def _via(dsn: str, port: int) -> str:
    """``dsn`` with its host and port replaced by 127.0.0.1:``port``."""
    parts = urllib.parse.urlsplit(dsn)
    user = parts.netloc.rpartition("@")[0]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{port}"))


def _produce_rate(url: str, mode: str, n: int, concurrency: int) -> float:
    r = run_json("bench.users", "produce", url, mode, str(n), str(concurrency))
    return float(n / (r["last"] - r["first"]))


def slow_link(q: bool) -> None:
    """wqclient's producer and Worker against a broker whose PostgreSQL is behind a link with
    LINK_DELAY_MS added each way (bench.delayproxy), and against one on the database directly,
    in turns; each row's median."""
    print(
        f"A slow database link: PostgreSQL {LINK_DELAY_MS} ms away each way, against direct "
        "(tasks/s)",
        flush=True,
    )
    why = pg.unreachable()
    if why is not None:
        add("slow link", "PostgreSQL", f"unreachable ({why}): skipped")
        return
    n = 2_000 if q else 5_000
    runs = 1 if q else 3
    parts = urllib.parse.urlsplit(pg.MAINTENANCE)
    target = f"{parts.hostname or '127.0.0.1'}:{parts.port or 5432}"
    found: dict[str, list[float]] = {}
    cases: list[tuple[str, Callable[[str], float]]] = [
        ("producer: enqueue(), 32 in flight", lambda u: _produce_rate(u, "one", n, 32)),
        (
            "producer: enqueue_many(100 tasks), 4 in flight",
            lambda u: _produce_rate(u, "many", n * 4, 4),
        ),
        ("producer: enqueue(), 512 in flight", lambda u: _produce_rate(u, "one", n * 2, 512)),
        (
            "producer: enqueue_many(100 tasks), 32 in flight",
            lambda u: _produce_rate(u, "many", n * 16, 32),
        ),
        ("Worker() (concurrency=3) draining a backlog", lambda u: _drain_once(u, n * 2, 3)),
        ("Worker(concurrency=64) draining a backlog", lambda u: _drain_once(u, n * 2, 64)),
        ("Worker(concurrency=512) draining a backlog", lambda u: _drain_once(u, n * 4, 512)),
        ("Worker(concurrency=2048) draining a backlog", lambda u: _drain_once(u, n * 8, 2048)),
    ]
    with pg.scratch() as make, delay_proxy(target, LINK_DELAY_MS) as port:
        direct, far = make("direct"), make("far")
        with broker("-store", direct) as a, broker("-store", _via(far, port)) as b:
            for _ in range(runs):
                for name, measure in cases:
                    for where, server in (("direct", a), ("slow", b)):
                        found.setdefault(f"{where}|{name}", []).append(
                            measure(f"grpc://{server.grpc}")
                        )
    RESULTS["slow_link"] = found
    medians = {key: statistics.median(rates) for key, rates in found.items()}
    for name, _ in cases:
        near, slow = medians[f"direct|{name}"], medians[f"slow|{name}"]
        add("slow link", f"{name}, gRPC: direct", f"{near:,.0f}/s")
        add(
            "slow link",
            f"{name}, gRPC: {LINK_DELAY_MS} ms each way",
            f"{slow:,.0f}/s = {slow / near:.0%} of direct",
            ">= 50% of direct",
            slow >= 0.5 * near,
        )


# -- the library as users write it ----------------------------------------------------------------


def _pids_named(name: str) -> list[int]:
    """Processes whose command name is ``name`` (a peer broker's server)."""
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and pg._ticks(entry)[0] == name
    ]


def _pair(consumer: list[str], producer: list[str], pids: list[int]) -> tuple[float, float | None]:
    """Tasks/s from the producer's first enqueue to the consumer's last settle, and the CPU
    seconds per task of ``pids`` (the broker's processes; None if there are none)."""
    before = sum(pg._ticks(pid)[1] for pid in pids)
    consume = spawn("bench.users", *consumer)
    time.sleep(0.7)  # let the consumer connect and wait first
    produced = last_json(spawn("bench.users", *producer), "a producer")
    consumed = last_json(consume, "a consumer")
    n = int(produced["n"])
    if int(consumed["n"]) < n:
        raise RuntimeError(f"the consumer got {consumed['n']} of {n} tasks")
    rate = n / (max(consumed["last"], produced["last"]) - produced["first"])
    ticks = sum(pg._ticks(pid)[1] for pid in pids) - before
    return rate, (ticks / pg.TICK / n if pids else None)


@contextlib.contextmanager
def beanstalkd() -> Iterator[tuple[str, int] | None]:
    """A beanstalkd of our own (no binlog: kept in memory), if Debian's package is installed."""
    exe = shutil.which("beanstalkd")
    if exe is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen([exe, "-l", "127.0.0.1", "-p", str(port)])
    try:
        wait_port(port)
        yield f"beanstalk://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


Pair = tuple[str, list[str], list[str], list[int]]  # name, consumer args, producer args, pids


def _user_rows(n: int, b: Server) -> list[Pair]:
    grpc_url, http_url, pids = f"grpc://{b.grpc}", b.http, [b.proc.pid]
    return [
        (
            "gRPC: enqueue, 32 in flight; Worker(concurrency=64)",
            ["consume", grpc_url, "worker", str(n), "64"],
            ["produce", grpc_url, "one", str(n), "32"],
            pids,
        ),
        (
            "gRPC: enqueue, 32 in flight; async for d in stream: await stream.ack(d)",
            ["consume", grpc_url, "stream", str(n), "64"],
            ["produce", grpc_url, "one", str(n), "32"],
            pids,
        ),
        (
            "gRPC: enqueue_many(100 tasks), 4 in flight; Worker(concurrency=64)",
            ["consume", grpc_url, "worker", str(n), "64"],
            ["produce", grpc_url, "many", str(n), "4"],
            pids,
        ),
        (
            "HTTP: enqueue, 32 in flight; Worker(concurrency=64)",
            ["consume", http_url, "worker", str(n), "64"],
            ["produce", http_url, "one", str(n), "32"],
            pids,
        ),
    ]


def _peer_rows(n: int, bean: tuple[str, int] | None) -> list[Pair]:
    """The peers running on this machine (RabbitMQ and NATS as services; our own beanstalkd)."""
    amqp = os.environ.get("WQ_BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672/")
    nats_url = os.environ.get("WQ_BENCH_NATS", "nats://127.0.0.1:4222")
    peers: list[Pair] = []
    rabbit_pids = _pids_named("beam.smp")
    if rabbit_pids:
        peers.append(
            (
                "RabbitMQ (aio-pika): confirmed publish, 32 in flight; ack each, prefetch 64",
                ["rabbit-consume", amqp, "-", str(n), "64"],
                ["rabbit-produce", amqp, "-", str(n), "32"],
                rabbit_pids,
            )
        )
    nats_pids = _pids_named("nats-server")
    for storage in ("file", "memory") if nats_pids else ():
        peers.append(
            (
                f"NATS JetStream (nats-py), {storage} storage: publish + PubAck, 32 in flight; "
                "pull 64, ack each",
                ["nats-consume", nats_url, storage, str(n), "64"],
                ["nats-produce", nats_url, storage, str(n), "32"],
                nats_pids,
            )
        )
    if bean is not None:
        bean_url, bean_pid = bean
        peers.append(
            (
                "beanstalkd (greenstalk): put, 32 threads; reserve + delete, 32 threads",
                ["beanstalk-consume", bean_url, "-", str(n), "32"],
                ["beanstalk-produce", bean_url, "-", str(n), "32"],
                [bean_pid],
            )
        )
    return peers


NULL_GRPC = "gRPC: the same producer and Worker, the null gRPC broker (grpc.aio, a deque)"
RAW_HTTP = "HTTP: the spec's API from a plain aiohttp client"
NULL_HTTP = "HTTP: the same client, the null broker (aiohttp, canned answers)"


def users(q: bool) -> None:
    """Rows of what users write (wqclient's public API, producer and consumer in processes of
    their own), the raw load generator, and the peers; every row once per round, rounds in
    turn, each row's median reported."""
    print("The library as users write it (tasks/s; broker CPU per task)", flush=True)
    n = 3_000 if q else 10_000
    found: dict[str, list[tuple[float, float | None]]] = {}
    with (
        broker() as b,
        beanstalkd() as bean,
        null_broker_process() as (null_url, null_pid),
        null_grpc_broker_process() as (null_grpc_url, null_grpc_pid),
    ):
        rows, peers = _user_rows(n, b), _peer_rows(n, bean)
        floor: Pair = (
            NULL_GRPC,
            ["consume", null_grpc_url, "worker", str(n), "64"],
            ["produce", null_grpc_url, "one", str(n), "32"],
            [null_grpc_pid],
        )
        for _ in range(1 if q else 3):
            for name, consumer, producer, pids in [*rows, floor, *peers]:
                # A peer's queue (stream, tube) of its own for each run.
                extra = [] if consumer[0] == "consume" else [f"wqbench{secrets.token_hex(4)}"]
                found.setdefault(name, []).append(
                    _pair([*consumer, *extra], [*producer, *extra], pids)
                )
            for name, (url, pid) in (
                (RAW_HTTP, (b.http, b.proc.pid)),
                (NULL_HTTP, (null_url, null_pid)),
            ):
                before = pg._ticks(pid)[1]
                rate = end_to_end(url, "http", n, 32)
                cpu = (pg._ticks(pid)[1] - before) / pg.TICK / n
                found.setdefault(name, []).append((rate, cpu))
        # A lone task, the system otherwise idle: wqclient's enqueue() to the Worker's handler.
        lone = str(300 if q else 2000)
        latencies = {
            kind: run_json("bench.users", "latency", url, "-", lone, "2")
            for kind, url in (("gRPC", f"grpc://{b.grpc}"), ("HTTP", b.http))
        }
    RESULTS["users"] = found
    RESULTS["users_latency"] = latencies
    medians: dict[str, tuple[float, float | None]] = {}
    for name, runs in found.items():
        cpus = [c for _, c in runs if c is not None]
        medians[name] = (
            statistics.median(r for r, _ in runs),
            statistics.median(cpus) if cpus else None,
        )
    _report_users(medians, [r[0] for r in rows], [p[0] for p in peers])
    for kind, figures in latencies.items():
        p50, p99 = figures["p50_ms"], figures["p99_ms"]
        add(
            "users",
            f"a lone task, enqueue() to the Worker's handler, {kind}: p50 / p99",
            f"{p50:.2f} / {p99:.2f} ms",
            "<= 1 / <= 3 ms" if kind == "gRPC" else "",
            (p50 <= 1 and p99 <= 3) if kind == "gRPC" else None,
        )


def _report_users(
    medians: dict[str, tuple[float, float | None]], rows: list[str], peers: list[str]
) -> None:
    one, stream_loop, batched, http_one = (medians[name] for name in rows)
    checks: dict[str, tuple[str, str, bool]] = {
        rows[0]: (
            f" = {one[0] / batched[0]:.0%} of enqueue_many",
            ">= 80% of enqueue_many",
            one[0] >= 0.8 * batched[0],
        ),
        rows[1]: (
            f" = {stream_loop[0] / one[0]:.0%} of Worker",
            ">= 50% of Worker",
            stream_loop[0] >= 0.5 * one[0],
        ),
    }
    for name, (rate, cpu) in medians.items():
        figure = f"{rate:,.0f}/s" + ("" if cpu is None else f"; {cpu * 1000:.3f} ms CPU/task")
        more, target, ok = checks.get(name, ("", "", None))
        add("users", name, figure + more, target, ok)
    raw, null = medians[RAW_HTTP], medians[NULL_HTTP]
    if raw[1] is not None and null[1] is not None:
        ratio = raw[1] / null[1]
        add(
            "users",
            "broker CPU per task over HTTP (plain client): wq / the null broker",
            f"{ratio:.2f}x",
            "<= 1.25x",
            ratio <= 1.25,
        )
        ratio = http_one[0] / raw[0]
        add(
            "users",
            "Worker over HTTP vs a plain aiohttp client (tasks/s)",
            f"{ratio:.2f}x",
            ">= 1.0x",
            ratio >= 1.0,
        )
    floor = medians[NULL_GRPC][1]
    if one[1] is not None and http_one[1] is not None and floor is not None:
        ratio = one[1] / http_one[1]
        add(
            "users",
            "broker CPU per task, one per call: gRPC / HTTP",
            f"{ratio:.2f}x",
            "<= 0.5x",
            ratio <= 0.5,
        )
        # What no grpc.aio broker can go under: the null one's cost, against wq's over HTTP.
        add(
            "users",
            "broker CPU per task: the null gRPC broker / wq over HTTP (the floor of the above)",
            f"{floor / http_one[1]:.2f}x",
        )
        add(
            "users",
            "broker CPU per task, one per call: wq over gRPC / the null gRPC broker",
            f"{one[1] / floor:.2f}x",
        )
    # Each peer as it comes (NATS JetStream keeps its streams in files unless told otherwise),
    # and the best of all, NATS JetStream in memory included.
    defaults = [p for p in peers if "memory storage" not in p]
    for which, names in (("at its defaults", defaults), ("of all", peers)):
        best = max(((medians[p][0], p) for p in names), default=None)
        if best is None:
            continue
        for label, (rate, _) in (("one per call", one), ("enqueue_many", batched)):
            ratio = rate / best[0]
            add(
                "users",
                f"gRPC {label} vs the best peer {which} ({best[0]:,.0f}/s: {best[1][:20]})",
                f"{ratio:.2f}x",
                ">= 1.0x",
                ratio >= 1,
            )
        # (Not a target of the issue: what the same code gets over HTTP, for comparison.)
        add(
            "users",
            f"HTTP one per call vs the best peer {which} ({best[0]:,.0f}/s: {best[1][:20]})",
            f"{http_one[0] / best[0]:.2f}x",
        )


def tasks(q: bool) -> None:
    """The task framework (``wq worker MODULE:APP``, ``-exec``) against the raw Worker, and the
    same no-op task in Dramatiq and Celery on Redis, each started with its own command
    (bench/tasks.py)."""
    RESULTS["tasks"] = task_rows.section(q, broker, add)


SECTIONS = {
    "users": users,
    "throughput": throughput,
    "stores": durable,
    "latency": latency,
    "delayed": delayed,
    "memory": memory,
    "metrics": metrics,
    "backlog": backlog,
    "scale": scale,
    "queues": queues,
    "pollers": pollers,
    "rabbitmq": rabbitmq,
    "postgres": postgres,
    "drain": drain,
    "slowlink": slow_link,
    "listing": listing,
    "workflows": workflows,
    "schedules": schedules,
    "limits": limits,
    "tasks": tasks,
}


def table() -> str:
    width = max(len(r.name) for r in ROWS)
    vwidth = max(len(r.value) for r in ROWS)
    lines = [f"{'measure':<{width}}  {'figure':<{vwidth}}  target", "-" * (width + vwidth + 30)]
    section = None
    for r in ROWS:
        if r.section != section:
            section = r.section
            lines.append(f"[{section}]")
        mark = "" if r.ok is None else ("  ok" if r.ok else "  MISSED")
        lines.append(f"{r.name:<{width}}  {r.value:<{vwidth}}  {r.target}{mark}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    parser.add_argument("--json", metavar="FILE", help="also write the raw figures here")
    parser.add_argument("sections", nargs="*", help=f"only these, of: {', '.join(SECTIONS)}")
    args = parser.parse_args()
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    started = time.monotonic()
    cpu = os.cpu_count()
    print(f"wq benchmark on {cpu} cores, Python {sys.version.split()[0]}", flush=True)
    for name in args.sections or SECTIONS:
        SECTIONS[name](args.quick)
    print()
    print(table())
    print(f"\n({time.monotonic() - started:.0f} s; `make bench` again for fresh figures)")
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=2))


if __name__ == "__main__":
    main()
