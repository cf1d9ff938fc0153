"""The PostgreSQL store under load: scratch databases, CPU readings, and the measurements the
``postgres`` section runs in processes of their own.

    python -m bench.pg consume URL TOTAL CONCURRENCY   # until TOTAL acked through any broker
    python -m bench.pg wake ENQUEUE_URL CLAIM_URL N BUDGET_S          # HTTP wake-up latency
    python -m bench.pg wake-stream ENQUEUE_ADDR CLAIM_ADDR N BUDGET_S  # the same over the stream
    python -m bench.pg churn FRESH_DSN DSN N READY CYCLES   # claim+ack cost after N tasks

Each prints one JSON line. ``consume`` is one of several consumers on brokers sharing one database:
it stops when the database's ``acked`` total (``GET /stats``, the same on every broker) has grown by
TOTAL since it started, so consumers on different brokers may each take any share. ``wake`` parks
a long-poll on CLAIM_URL, enqueues one task on ENQUEUE_URL, and times the enqueue request's start
to the long-poll's answer, N times one after the other (or until BUDGET_S seconds are spent: a
broker woken only by its long-poll ending takes seconds each). ``churn`` works on the store itself
(no broker): see :func:`churn`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import statistics
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
import asyncpg

from bench.load import PAYLOAD, _loop_policy
from wqbroker.limits import DEFAULT_SWEEP_INTERVAL
from wqbroker.models import NewTask
from wqbroker.store.postgres import PostgresStore

MAINTENANCE = os.environ.get("WQ_BENCH_POSTGRES", "postgres://postgres@127.0.0.1:5432/postgres")
BATCH = 1000
GAP = 0.02  # seconds between a wake-up sample's answer and the next enqueue (let it park again)


# -- scratch databases ----------------------------------------------------------------------------


def dsn_of(name: str) -> str:
    parts = urllib.parse.urlsplit(MAINTENANCE)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(MAINTENANCE, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def unreachable() -> str | None:
    """Why the server cannot be used, or None if it can."""
    try:
        asyncio.run(_admin("SELECT 1"))
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
        lines = str(e).strip().splitlines()
        return lines[0] if lines else type(e).__name__
    return None


@contextlib.contextmanager
def scratch() -> Iterator[Callable[[str], str]]:
    """A maker of fresh databases (``make(label)`` -> DSN), every one dropped at the end, however
    the block ends (WITH (FORCE): brokers still connected are cut off)."""
    prefix = f"wq_bench_{secrets.token_hex(4)}"
    made: list[str] = []

    def make(label: str) -> str:
        name = f"{prefix}_{label}"
        asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
        made.append(name)
        return dsn_of(name)

    try:
        yield make
    finally:
        for name in made:
            asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


# -- CPU ------------------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _ticks(pid: int | str) -> tuple[str, int]:
    """(command name, user + system clock ticks) of a process; ("", 0) if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return "", 0
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return name, int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)


def _postgres_ticks() -> dict[int, int]:
    """Every postgres process's ticks by pid (connections come and go between readings)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            name, ticks = _ticks(entry)
            if name == "postgres" or name.startswith("postgres:"):
                out[int(entry)] = ticks
    return out


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) ticks of the whole machine."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return sum(values) - idle, sum(values)


@dataclass
class CpuReading:
    at: float
    brokers: list[int]
    postgres: dict[int, int]
    machine: tuple[int, int]


def cpu_reading(broker_pids: list[int]) -> CpuReading:
    return CpuReading(
        time.monotonic(),
        [_ticks(pid)[1] for pid in broker_pids],
        _postgres_ticks(),
        _machine_ticks(),
    )


def cpu_use(before: CpuReading, broker_pids: list[int]) -> dict[str, Any]:
    """CPU used since ``before``, in cores (1.0: one core all the time): each broker, PostgreSQL
    (every postgres process; one that ended meanwhile is missed) and the whole machine."""
    after = cpu_reading(broker_pids)
    span = (after.at - before.at) * TICK
    pg = sum(t - before.postgres.get(pid, 0) for pid, t in after.postgres.items())
    busy = after.machine[0] - before.machine[0]
    total = after.machine[1] - before.machine[1]
    return {
        "brokers": [(a - b) / span for a, b in zip(after.brokers, before.brokers, strict=True)],
        "postgres": pg / span,
        "machine": busy / total * (os.cpu_count() or 1) if total else 0.0,
        "cores": os.cpu_count() or 1,
    }


# -- a consumer among several, on brokers sharing a database --------------------------------------


async def _acked(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/stats") as resp:
        body = json.loads(await resp.read())
    return int(body["totals"]["acked"])


async def consume_shared(url: str, total: int, concurrency: int) -> dict[str, Any]:
    mine = 0
    last = 0.0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        base = await _acked(session, url)

        async def loop() -> None:
            nonlocal mine, last
            while True:
                async with session.get(url + "/jobs/next?wait_ms=1000") as resp:
                    if resp.status == 204:
                        continue
                    body = json.loads(await resp.read())
                ack = f"{url}/jobs/{body['task']['id']}/ack?lease_id={body['lease_id']}"
                async with session.post(ack) as resp:
                    assert resp.status == 204, resp.status
                mine += 1
                last = time.time()

        workers = [asyncio.ensure_future(loop()) for _ in range(concurrency)]
        while await _acked(session, url) - base < total:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.02)
        # Every task is acked: no loop holds one, so cutting their polls short loses nothing.
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return {"last": last, "n": mine}


# -- wake-up latency ------------------------------------------------------------------------------


def _summary(samples: list[float], budget_hit: bool) -> dict[str, Any]:
    samples = sorted(samples)
    if not samples:
        return {"n": 0, "budget_hit": budget_hit}
    return {
        "n": len(samples),
        "p50_ms": samples[len(samples) // 2] * 1000,
        "p99_ms": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1000,
        "max_ms": samples[-1] * 1000,
        "mean_ms": statistics.fmean(samples) * 1000,
        "budget_hit": budget_hit,
    }


async def wake_http(enqueue_url: str, claim_url: str, n: int, budget: float) -> dict[str, Any]:
    samples: list[float] = []
    got = asyncio.Event()
    sent = 0.0
    async with aiohttp.ClientSession() as session:

        async def receive() -> None:
            while True:
                async with session.get(claim_url + "/jobs/next?wait_ms=5000") as resp:
                    if resp.status == 204:
                        continue
                    raw = await resp.read()
                samples.append(time.perf_counter() - sent)
                body = json.loads(raw)
                ack = f"{claim_url}/jobs/{body['task']['id']}/ack?lease_id={body['lease_id']}"
                async with session.post(ack) as r:
                    await r.read()
                got.set()

        async def send() -> None:
            nonlocal sent
            sent = time.perf_counter()
            async with session.post(enqueue_url + "/jobs", data=b'{"payload":{}}') as resp:
                assert resp.status == 201, resp.status

        receiver = asyncio.ensure_future(receive())
        budget_hit = await _sample(n, budget, got, send)
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)
    return _summary(samples, budget_hit)


async def _sample(n: int, budget: float, got: asyncio.Event, send: Callable[[], Any]) -> bool:
    """Send one task at a time, each once the previous one was received and the receiver has had
    time to park again; True if the budget ran out first."""
    deadline = time.monotonic() + budget
    await asyncio.sleep(0.3)  # let the receiver park
    for _ in range(n):
        if time.monotonic() > deadline:
            return True
        got.clear()
        await send()
        await asyncio.wait_for(got.wait(), 30)
        await asyncio.sleep(GAP)
    return False


async def wake_stream(enqueue_addr: str, claim_addr: str, n: int, budget: float) -> dict[str, Any]:
    import grpc

    from wqwire.pb import broker_pb2 as pb
    from wqwire.pb import broker_pb2_grpc as pb_grpc

    samples: list[float] = []
    got = asyncio.Event()
    sent = 0.0
    async with (
        grpc.aio.insecure_channel(enqueue_addr) as enqueue_channel,
        grpc.aio.insecure_channel(claim_addr) as claim_channel,
    ):
        enqueuer = pb_grpc.BrokerStub(enqueue_channel)
        call = pb_grpc.BrokerStub(claim_channel).StreamJobs(None)
        await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=1)))
        await call.read()  # the open acknowledgement
        request = pb.EnqueueRequest(payload=PAYLOAD)

        async def receive() -> None:
            while True:
                response = cast(pb.StreamJobsResponse, await call.read())
                for d in response.deliveries:
                    samples.append(time.perf_counter() - sent)
                    ack = pb.AckRequest(id=d.task.id, lease_id=d.lease_id)
                    await call.write(pb.StreamJobsRequest(acks=[ack]))
                    got.set()

        async def send() -> None:
            nonlocal sent
            sent = time.perf_counter()
            await enqueuer.Enqueue(request)

        receiver = asyncio.ensure_future(receive())
        budget_hit = await _sample(n, budget, got, send)
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)
        call.cancel()
    return _summary(samples, budget_hit)


# -- the store itself: a claim+ack cycle before and after a million tasks ------------------------


def _tasks(k: int) -> list[NewTask]:
    return [NewTask(PAYLOAD, 3, 0.0) for _ in range(k)]


async def _fill(store: PostgresStore, n: int) -> None:
    for start in range(0, n, BATCH):
        await store.enqueue_many(_tasks(min(BATCH, n - start)), now=time.time())


async def _cycles(store: PostgresStore, cycles: int) -> list[float]:
    """Seconds of each of ``cycles`` claim (a single task) + ack cycles, two calls each; each
    round's tasks are put back afterwards (not timed), so as many stay ready throughout."""
    times: list[float] = []
    left = cycles
    while left:
        k = min(left, 500)
        for _ in range(k):
            t0 = time.perf_counter()
            d = await store.claim(lease=30.0, now=time.time())
            assert d is not None
            await store.ack(d.task.id, d.lease_id, now=time.time())
            times.append(time.perf_counter() - t0)
        await store.enqueue_many(_tasks(k), now=time.time())
        left -= k
    return times


async def in_turns(stores: list[PostgresStore], cycles: int, rounds: int = 5) -> list[float]:
    """Each store's claim+ack cycle, timed in turns (``rounds`` rounds of ``cycles / rounds``
    each) so that the machine speeding up or slowing down does not tilt the comparison; the
    best round's mean for each, in seconds."""
    best = [float("inf")] * len(stores)
    for _ in range(rounds):
        for i, store in enumerate(stores):
            best[i] = min(best[i], statistics.fmean(await _cycles(store, cycles // rounds)))
    return best


async def push(store: PostgresStore, n: int) -> float:
    """Put ``n`` tasks through in batches: enqueue_many, claim_many, settle_many (acks). Seconds."""
    t0 = time.perf_counter()
    for start in range(0, n, BATCH):
        k = min(BATCH, n - start)
        await store.enqueue_many(_tasks(k), now=time.time())
        got = await store.claim_many([30.0] * k, now=time.time())
        acks = [(d.task.id, d.lease_id) for d in got]
        acked, _ = await store.settle_many(acks, (), now=time.time())
        assert len(got) == k, (len(got), k)
        assert not any(acked), acked
    return time.perf_counter() - t0


_TABLE = """
SELECT pg_total_relation_size('wq.tasks'), n_live_tup, n_dead_tup, autovacuum_count,
       coalesce(extract(epoch FROM now() - last_autovacuum), -1)
FROM pg_stat_user_tables WHERE relid = 'wq.tasks'::regclass
"""


async def table_state(dsn: str) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        row = await conn.fetchrow(_TABLE)
        assert row is not None
        ready = await conn.fetchval("SELECT count(*) FROM wq.tasks")
    finally:
        await conn.close()
    size, live, dead, vacuums, since = row
    return {
        "bytes": int(size),
        "rows": int(ready),
        "n_live_tup": int(live),
        "n_dead_tup": int(dead),
        "autovacuums": int(vacuums),
        "since_last_autovacuum_s": float(since),
    }


async def _setting(dsn: str, name: str) -> str:
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        return str(await conn.fetchval("SELECT current_setting($1)", name))
    finally:
        await conn.close()


async def _sweeper(store: PostgresStore) -> None:
    """Sweep as a broker's sweeper does (the store does its housekeeping in sweeps)."""
    while True:
        await asyncio.sleep(DEFAULT_SWEEP_INTERVAL)
        await store.sweep(now=time.time())


async def churn(fresh_dsn: str, dsn: str, n: int, ready: int, cycles: int) -> dict[str, Any]:
    """Two fresh databases, each with ``ready`` tasks left ready throughout, each swept as a
    broker would (the store does its housekeeping, vacuum included, in its sweeps). Their
    claim+ack cycles timed in turns (the two should compare equal: the noise); ``n`` tasks pushed
    through the second in batches of 1,000 (each acked, so deleted: dead rows for vacuum); its
    cycle timed at once, then both again in turns; the second table's size and dead tuples."""
    stores = [await PostgresStore.open(d) for d in (fresh_dsn, dsn)]
    sweepers = [asyncio.ensure_future(_sweeper(s)) for s in stores]
    try:
        for store in stores:
            await _fill(store, ready)
            await _cycles(store, 200)  # warm up: connections, plans
        before = await in_turns(stores, cycles)
        seconds = await push(stores[1], n)
        pushed = await table_state(dsn)
        at_once = await _cycles(stores[1], cycles // 5)
        after = await in_turns(stores, cycles)
        end = await table_state(dsn)
        settings = {k: await _setting(dsn, k) for k in ("autovacuum", "autovacuum_naptime")}
    finally:
        for sweeper in sweepers:
            sweeper.cancel()
        await asyncio.gather(*sweepers, return_exceptions=True)
        for store in stores:
            await store.close()
    return {
        "n": n,
        "ready": ready,
        "cycles": cycles,
        "fresh_ms": after[0] * 1000,
        "after_ms": after[1] * 1000,
        "ratio": after[1] / after[0],
        "noise_ratio": before[1] / before[0],  # the same two tables, both fresh
        "at_once_ms": statistics.fmean(at_once) * 1000,  # right after the push
        "push_s": seconds,
        "push_rate": n / seconds,
        "table_pushed": pushed,
        "table_end": end,
        **settings,
        "store_vacuums": getattr(stores[1], "vacuums", None),  # VACUUMs run in its sweeps
    }


def main(argv: list[str]) -> None:
    _loop_policy()
    what = argv[0]
    result: dict[str, Any]
    if what == "consume":
        result = asyncio.run(consume_shared(argv[1], int(argv[2]), int(argv[3])))
    elif what == "wake":
        result = asyncio.run(wake_http(argv[1], argv[2], int(argv[3]), float(argv[4])))
    elif what == "wake-stream":
        result = asyncio.run(wake_stream(argv[1], argv[2], int(argv[3]), float(argv[4])))
    elif what == "churn":
        result = asyncio.run(churn(argv[1], argv[2], *(int(a) for a in argv[3:6])))
    else:
        raise SystemExit(f"unknown measurement {what}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
