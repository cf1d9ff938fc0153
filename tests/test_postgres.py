"""The PostgreSQL store beyond the contract: its schema at open, exact payloads, and several
stores (as several brokers would hold them) on one database acting as one store.

Each test here gets a database of its own (tests/pg.py; dropped at the end of the run).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import asyncpg
import pytest

from tests import pg
from wqbroker.broker import Config, StartupError, open_store
from wqbroker.errors import LeaseLost, NotFound, StoreError
from wqbroker.models import NewTask
from wqbroker.retry import Backoff
from wqbroker.store import enqueue_one
from wqbroker.store.postgres import SCHEMA_VERSION, PostgresStore

NOW = 1_700_000_000.0
LEASE = 30.0


def backoff(seed: int = 1) -> Backoff:
    return Backoff(1.0, 30.0, random.Random(seed))


@pytest.fixture
async def dsn() -> str:
    return await pg.create_database("t")


@pytest.fixture
async def two(dsn: str) -> AsyncIterator[tuple[PostgresStore, PostgresStore]]:
    a = await PostgresStore.open(dsn, backoff(1), random.Random(1))
    b = await PostgresStore.open(dsn, backoff(2), random.Random(2))
    yield a, b
    await a.close()
    await b.close()


async def test_schema_creation_is_idempotent(dsn: str) -> None:
    first = await PostgresStore.open(dsn, backoff(), random.Random(1))
    await enqueue_one(first, b'{"n":1}', max_attempts=3, delay=0.0, now=NOW)
    await first.close()
    again = await PostgresStore.open(dsn, backoff(), random.Random(2))
    try:
        assert (await again.stats()).ready == 1  # nothing recreated, nothing lost
        conn = await asyncpg.connect(dsn)
        try:
            version = await conn.fetchval("SELECT value FROM wq.meta WHERE key = 'schema'")
        finally:
            await conn.close()
        assert version == str(SCHEMA_VERSION)
    finally:
        await again.close()


async def test_brokers_starting_at_once_create_the_schema_once(dsn: str) -> None:
    stores = await asyncio.gather(
        *(PostgresStore.open(dsn, backoff(i), random.Random(i)) for i in range(4))
    )
    try:
        done = await enqueue_one(stores[0], b"1", max_attempts=1, delay=0.0, now=NOW)
        for s in stores:
            looked = await s.lookup(done.id)
            assert looked is not None
            assert looked.state == "ready"
    finally:
        for s in stores:
            await s.close()


async def test_a_database_with_other_tables_is_refused(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE TABLE invoices (id int PRIMARY KEY)")
    finally:
        await conn.close()
    with pytest.raises(StoreError, match="not a wq database") as e:
        await PostgresStore.open(dsn, backoff())
    assert "\n" not in e.value.message
    conn = await asyncpg.connect(dsn)
    try:  # and it was left alone
        assert await conn.fetchval("SELECT to_regclass('wq.meta')") is None
    finally:
        await conn.close()


async def test_a_newer_schema_version_is_refused(dsn: str) -> None:
    store = await PostgresStore.open(dsn, backoff())
    await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "UPDATE wq.meta SET value = $1 WHERE key = 'schema'", str(SCHEMA_VERSION + 1)
        )
    finally:
        await conn.close()
    with pytest.raises(StoreError, match="newer wq") as e:
        await PostgresStore.open(dsn, backoff())
    assert "\n" not in e.value.message


async def test_an_unreachable_server_is_a_one_line_startup_error() -> None:
    config = Config(store="postgres://postgres@127.0.0.1:1/nowhere")
    with pytest.raises(StartupError, match="cannot connect") as e:
        await open_store(config, backoff(), random.Random(1))
    assert "\n" not in str(e.value)


async def test_the_store_flag_opens_postgres(dsn: str) -> None:
    for spec in (dsn, dsn.replace("postgres://", "postgresql://", 1)):
        store = await open_store(Config(store=spec), backoff(), random.Random(1))
        assert isinstance(store, PostgresStore)
        await store.close()


async def test_payloads_keep_their_exact_bytes(two: tuple[PostgresStore, PostgresStore]) -> None:
    a, b = two
    payloads = [
        b'{"a": 1,   "b":[1,2 ,3]}',  # spacing and key order as sent
        b'"\\u00e9 \xc3\xa9"',  # an escape and raw UTF-8
        b'{"n": 1.0000000000000000001, "big": 123456789012345678901234567890}',
        b"\x00\xff binary-ish",
        b"",
    ]
    done = await a.enqueue_many([NewTask(p, 1, 0.0) for p in payloads], now=NOW)
    got = await b.claim_many([LEASE] * len(payloads), now=NOW)
    assert [d.task.payload for d in got] == payloads
    for e, p in zip(done, payloads, strict=True):
        looked = await b.lookup(e.id)
        assert looked is not None
        assert looked.task.payload == p


async def test_two_stores_on_one_database_are_one_store(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    first = await enqueue_one(a, b"1", max_attempts=2, delay=0.0, now=NOW, queue="q", priority=5)
    await enqueue_one(a, b"2", max_attempts=2, delay=0.0, now=NOW, queue="q")
    d = await b.claim(lease=LEASE, now=NOW, queues=("q",))
    assert d is not None
    assert d.task.id == first.id
    with pytest.raises(LeaseLost):
        await a.ack(d.task.id, "0" * 16, now=NOW)
    await a.ack(d.task.id, d.lease_id, now=NOW)  # acked through the first
    with pytest.raises(NotFound):
        await b.ack(d.task.id, d.lease_id, now=NOW)
    d2 = await a.claim(lease=LEASE, now=NOW, queues=("q",))
    assert d2 is not None
    failure = await b.nack(d2.task.id, d2.lease_id, "boom", now=NOW)
    assert not failure.buried
    assert (await a.stats()) == (await b.stats())
    assert (await a.stats("q")) == (await b.stats("q"))
    stats = await a.stats()
    assert (stats.ready, stats.handed_out, stats.delayed, stats.dead) == (0, 0, 1, 0)
    t = stats.totals
    assert (t.enqueued, t.delivered, t.acked, t.nacked, t.retried) == (2, 2, 1, 1, 1)
    # the retry is promoted by whichever store sweeps
    assert failure.retry_at is not None
    result, _ = await b.sweep(now=failure.retry_at)
    assert result.promoted == 1
    assert result.ready_queues == {"q"}
    await a.set_paused("q", True)
    assert await b.claim(lease=LEASE, now=failure.retry_at, queues=("q",)) is None
    assert [q.paused for q in await b.queues()] == [True]
    # idempotency keys are shared too
    keyed = await enqueue_one(
        a, b"k", max_attempts=1, delay=0.0, now=NOW, key="k", key_until=NOW + 9
    )
    again = await enqueue_one(
        b, b"k", max_attempts=1, delay=0.0, now=NOW, key="k", key_until=NOW + 9
    )
    assert again.duplicate
    assert again.id == keyed.id
    await a.check_invariants()


async def test_concurrent_claims_never_hand_out_a_task_twice(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    n = 400
    await a.enqueue_many([NewTask(str(i).encode(), 1, 0.0) for i in range(n)], now=NOW)

    async def drain(store: PostgresStore, batch: int) -> list[str]:
        got: list[str] = []
        while True:
            ds = await store.claim_many([LEASE] * batch, now=NOW)
            if not ds:
                return got
            got.extend(d.task.id for d in ds)
            acks = [(d.task.id, d.lease_id) for d in ds]
            acked, _ = await store.settle_many(acks, (), now=NOW)
            assert acked == [None] * len(ds)

    results = await asyncio.gather(*(drain(s, k) for s in (a, b) for k in (1, 3, 7)))
    claimed = [i for r in results for i in r]
    assert len(claimed) == len(set(claimed)) == n
    assert sum(1 for r in results if r) >= 2  # they did contend
    stats = await b.stats()
    assert (stats.ready, stats.handed_out) == (0, 0)
    assert (stats.totals.delivered, stats.totals.acked) == (n, n)
    await a.check_invariants()
