"""Limits per queue (docs/design/schedules.md) over several brokers on one PostgreSQL database:
three services, each with its own store (the database's clock, as a broker runs), and many
concurrent claimers spread over them. A concurrency limit is never exceeded (what the claimers
hold, and what the store counts, at every step), and a rate limit's hand-outs in any window of its
period stay within ``tasks + burst`` (read from the rows: each task's deadline less its lease is
the database's time of its hand-out), while both keep handing out (a freed slot and a token wake
claimers parked on any broker). Then the migration: a database of the version before keeps its
queues, without limits. Each test gets a database of its own (tests/pg.py)."""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest

from tests import pg
from tests.helpers import wait_until
from wqbroker.clock import SystemClock
from wqbroker.models import Limits
from wqbroker.retry import Backoff
from wqbroker.service import Service, Submission
from wqbroker.store.postgres import SCHEMA_VERSION, PostgresStore

PAYLOAD = b'{"job": 1}'
BROKERS = 3
CLAIMERS = 30  # over the brokers
RUN = 3.0  # seconds


@pytest.fixture
async def dsn() -> str:
    return await pg.create_database("limits")


@pytest.fixture
async def services(dsn: str) -> AsyncIterator[list[Service]]:
    clock = SystemClock()
    out: list[Service] = []
    for i in range(BROKERS):
        rng = random.Random(i)
        store = await PostgresStore.open(
            dsn, Backoff(1.0, 30.0, rng), rng, pool_size=6, db_clock=True, clock=clock
        )
        service = Service(store, clock)
        await service.start()
        out.append(service)
    yield out
    for service in out:
        await service.close()
        await service.store.close()


async def test_a_concurrency_limit_holds_over_every_broker(services: list[Service]) -> None:
    limit = 3
    await services[0].set_limits("c", None, limit)
    for _ in range(10):
        await services[1].enqueue_many([_submission("c") for _ in range(100)])
    held = 0
    most = 0
    acked = 0
    stop = time.monotonic() + RUN
    rng = random.Random(5)

    async def claimer(service: Service) -> None:
        nonlocal held, most, acked
        while time.monotonic() < stop:
            d = await service.claim(200, 30_000, queues="c")
            if d is None:
                continue
            held += 1  # (from its commit to before the ack's: within what the store counts)
            most = max(most, held)
            assert held <= limit
            await asyncio.sleep(rng.random() * 0.01)
            held -= 1
            await service.ack(d.task.id, d.lease_id)
            acked += 1

    async def watch() -> None:
        while time.monotonic() < stop:
            stats = await services[2].stats("c")
            assert stats.handed_out <= limit, stats
            await asyncio.sleep(0.005)

    await asyncio.gather(watch(), *(claimer(services[i % BROKERS]) for i in range(CLAIMERS)))
    assert most == limit  # it was reached (and never passed)
    assert acked >= 60, acked  # and the slots freed kept waking claimers, on every broker
    # (a claim whose wait ran out as the database handed it a task gives that task back on its
    # own, a moment later: on a loaded machine, after the claimers ended)
    stats = await wait_until(
        lambda: services[0].stats("c"),
        lambda s: s.handed_out == 0,
        what="the tasks handed to claims that had given up to be given back",
        timeout=10,
    )
    assert stats.totals.acked == acked
    for service in services:
        assert isinstance(service.store, PostgresStore)
        await service.store.check_invariants()


async def test_a_rate_limit_holds_over_every_broker(services: list[Service], dsn: str) -> None:
    tasks, per, burst, lease = 20, 1.0, 5, 300
    await services[0].set_limits("r", {"tasks": tasks, "per_ms": 1000, "burst": burst}, None)
    await services[1].enqueue_many([_submission("r") for _ in range(200)])
    await services[1].enqueue_many([_submission("o") for _ in range(400)])
    got = {"r": 0, "o": 0}
    stop = time.monotonic() + RUN

    async def claimer(service: Service, queues: list[str]) -> None:
        while time.monotonic() < stop:
            d = await service.claim(200, lease * 1000, queues=queues)
            if d is not None:
                got[d.task.queue] += 1  # (held: its row keeps the time it was handed out)
                if d.task.queue == "o":
                    await service.ack(d.task.id, d.lease_id)
                    await asyncio.sleep(0.01)

    await asyncio.gather(
        *(
            claimer(services[i % BROKERS], ["r", "o"] if i % 3 == 0 else ["r"])
            for i in range(CLAIMERS)
        )
    )
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT deadline FROM wq.tasks WHERE queue = 'r' AND state = 1 ORDER BY deadline"
        )
    finally:
        await conn.close()
    times = [r[0] - lease for r in rows]
    assert len(times) == got["r"]
    for i, t in enumerate(times):
        end = bisect.bisect_right(times, t + per)
        assert end - i <= tasks + burst, (t, times[i:end])
    # About the burst, then tasks a period (the tokens kept waking claimers, on every broker).
    assert burst + tasks * (RUN - 1) <= got["r"] <= burst + tasks * (RUN + 0.5), got
    assert got["o"] > 0  # a claim over both moved on to the other queue
    (row,) = [r for r in await services[2].queues() if r.name == "r"]
    assert row.limits is not None
    assert row.tokens is not None
    assert 0 <= row.tokens <= burst


async def test_a_database_of_the_version_before_upgrades_keeping_its_queues(dsn: str) -> None:
    assert SCHEMA_VERSION >= 6  # (limits came with 6)
    rng = random.Random(1)
    store = await PostgresStore.open(dsn, Backoff(1.0, 30.0, rng), rng, pool_size=2)
    try:
        await store.set_paused("old", True)
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:  # back to version 5: the limits' columns gone
        await conn.execute(
            "ALTER TABLE wq.queues DROP COLUMN rate_tasks, DROP COLUMN rate_per, "
            "DROP COLUMN rate_burst, DROP COLUMN concurrency, DROP COLUMN tokens, "
            "DROP COLUMN refilled_at; UPDATE wq.meta SET value = '5' WHERE key = 'schema'"
        )
    finally:
        await conn.close()
    store = await PostgresStore.open(dsn, Backoff(1.0, 30.0, rng), rng, pool_size=2)
    try:
        (old,) = [q for q in await store.queues() if q.name == "old"]
        assert old.paused
        assert old.limits is None
        assert old.tokens is None
        await store.set_limits("old", Limits(concurrency=2), now=0)
        (old,) = [q for q in await store.queues() if q.name == "old"]
        assert old.limits == Limits(concurrency=2)
    finally:
        await store.close()


def _submission(queue: str) -> Submission:
    return Submission(PAYLOAD, queue=queue)
