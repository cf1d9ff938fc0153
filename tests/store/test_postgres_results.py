"""The PostgreSQL store's side of results and workflows (docs/design/results.md), beyond the
contract suite: the migration from a version-3 database, brokers on one database waking each
other (children released by an ack on one wake the consumers of another; a watched task ended on
one is told to the others), fan-in and fan-out of 10,000 (one statement, one update per child per
transaction), brokers acking overlapping parents at once (no deadlock, each child released once),
a deadlock the database breaks (the call made again), children and parents raced across brokers,
a broker killed between a parent's ack and its children's release, and the counters' invariant
after random operations on two brokers.

Two :class:`PostgresStore` objects on one database are two brokers. Time is the tests' (``now=``),
not the database's clock. Each test gets a database of its own (tests/pg.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import pg
from tests.helpers import examples
from wqbroker.errors import (
    Cancelled,
    Conflict,
    LeaseLost,
    NotFound,
    TimeLimitReached,
    UnknownParent,
)
from wqbroker.models import (
    ACKED,
    CANCELLED_STATE,
    DEAD,
    DEFAULT_QUEUE,
    EXPIRED_STATE,
    LIST_STATES,
    READY,
    SUCCEEDED,
    WAITING,
    Delivery,
    NackItem,
    NewTask,
    ParentResult,
    Stats,
)
from wqbroker.retry import Backoff
from wqbroker.store.postgres import SCHEMA_VERSION, PostgresStore
from wqbroker.store.postgres.queries import Q
from wqbroker.store.postgres.schema import MIGRATIONS

NOW = 1_700_000_000.0
LEASE = 30.0
ROOT = Path(__file__).resolve().parents[2]


def backoff(seed: int = 1) -> Backoff:
    return Backoff(1.0, 30.0, random.Random(seed))


@pytest.fixture
async def dsn() -> str:
    return await pg.create_database("r")


@pytest.fixture
async def two(dsn: str) -> AsyncIterator[tuple[PostgresStore, PostgresStore]]:
    a = await PostgresStore.open(dsn, backoff(1), random.Random(1), pool_size=4)
    b = await PostgresStore.open(dsn, backoff(2), random.Random(2), pool_size=4)
    yield a, b
    await a.close()
    await b.close()


def task(
    payload: bytes = b"{}",
    *,
    queue: str = DEFAULT_QUEUE,
    after: Sequence[str | int] = (),
    delay: float = 0.0,
    ttl: float | None = None,
    max_attempts: int = 3,
    key: str | None = None,
    expires_at: float | None = None,
) -> NewTask:
    """A task to enqueue; ``ttl``: its result TTL (seconds), given (None: the default, an hour)."""
    new = NewTask(
        payload,
        max_attempts,
        delay,
        queue,
        key=key,
        key_until=NOW + 300 if key is not None else 0.0,
        expires_at=expires_at,
        after=tuple(after),
    )
    if ttl is not None:
        new.result_ttl, new.result_ttl_given = ttl, True
    return new


def held(stats: Stats) -> int:
    """The gauges of the invariant (results held are not among them: those tasks were acked)."""
    return stats.ready + stats.handed_out + stats.delayed + stats.dead + stats.waiting


def gone(stats: Stats) -> int:
    t = stats.totals
    return t.enqueued - t.acked - t.purged - t.cancelled - t.expired


async def consistent(*stores: PostgresStore) -> Stats:
    """The counters agree with the tasks (per queue: the six gauges; the edges with their
    children), the extended invariant holds, and every store reads the same; the stats."""
    await stores[0].check_invariants()
    stats = await stores[0].stats()
    assert held(stats) == gone(stats), stats
    t = stats.totals
    assert t.nacked + t.reclaimed == t.retried + t.buried, stats
    for other in stores[1:]:
        assert await other.stats() == stats
    return stats


async def until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def state_of(store: PostgresStore, task_id: str) -> str:
    found = await store.lookup(task_id)
    assert found is not None, f"no task {task_id}"
    return found.state


async def claim_all(store: PostgresStore, queue: str, now: float = NOW) -> list[Delivery]:
    """Every task ready in ``queue`` (claims of up to 1000 until none is left)."""
    got: list[Delivery] = []
    while batch := await store.claim_many([LEASE] * 1000, now=now, queues=(queue,)):
        got += batch
    return got


class Heard:
    """What a store is told by the other brokers: queues made ready, watched tasks ended."""

    def __init__(self, store: PostgresStore) -> None:
        self.ready: set[str] = set()
        self.anything = 0  # told "any queue"
        self.finished: list[tuple[str, str]] = []
        store.on_ready(self._ready)
        store.on_finished(self.finished.extend)

    def _ready(self, queues: Any) -> None:
        if queues is None:
            self.anything += 1
        else:
            self.ready.update(queues)


# -- the migration -------------------------------------------------------------------------------


async def _version_3_database(dsn: str) -> None:
    """A database as a version-3 broker left it: the tables of 001 to 003, its version and id
    key, and tasks in every state (one with an expiry, one with a unique key) with the counters
    that match them."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            for migration in MIGRATIONS.files[:3]:
                await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO wq.meta VALUES ('schema', '3'), ('id_key', '12345');"
                "INSERT INTO wq.queues VALUES ('default', false), ('q', false);"
                "SELECT setval('wq.ord', 100); SELECT setval('wq.id_blocks', 5)"
            )
            rows = [  # id, queue, state, ord, payload, attempts, lease, deadline, expires, ukey
                (1, "default", 0, 10, b'{"n":1}', 0, None, None, NOW + 900, None),
                (2, "default", 0, 11, b'{"n":2}', 0, None, None, None, "u"),
                (3, "default", 1, 12, b'{"n":3}', 1, "00000000000000aa", NOW + 30, None, None),
                (4, "q", 2, 13, b'{"n":4}', 1, None, None, None, None),
                (5, "q", 3, 14, b'{"n":5}', 3, None, None, None, None),
            ]
            await conn.executemany(
                "INSERT INTO wq.tasks (id, queue, state, priority, ord, payload, attempts, "
                "max_attempts, created_at, available_at, lease_id, deadline, expires_at, ukey) "
                "VALUES ($1, $2, $3, 0, $4 * 1048576, $5, $6, 3, $7, $8, $9, $10, $11, $12)",
                [(*r[:6], NOW, NOW + 60 if r[2] == 2 else NOW, *r[6:]) for r in rows],
            )
            await conn.execute(
                "INSERT INTO wq.counters (slot, queue, enqueued, delivered, nacked, retried, "
                "buried, ready, handed_out, delayed, dead) VALUES "
                "(0, 'default', 3, 1, 0, 0, 0, 2, 1, 0, 0), (0, 'q', 2, 4, 4, 3, 1, 0, 0, 1, 1)"
            )
    finally:
        await conn.close()


def _id(key: int) -> str:
    return "%016x" % (key + 2**63)


async def test_a_version_3_database_is_upgraded_in_place(dsn: str) -> None:
    await _version_3_database(dsn)
    store = await PostgresStore.open(dsn, backoff(), random.Random(1))
    try:
        stats = await consistent(store)
        assert (stats.ready, stats.handed_out, stats.delayed, stats.dead) == (2, 1, 1, 1)
        assert (stats.waiting, stats.succeeded) == (0, 0)
        for key in range(1, 6):  # every task as it was, none of the new fields set
            found = await store.lookup(_id(key))
            assert found is not None
            t = found.task
            assert t.payload == b'{"n":%d}' % key
            assert (t.result, t.finished_at, t.result_ttl, t.after, t.waiting_for) == (
                None,
                None,
                None,
                None,
                0,
            )
            assert await store.children(_id(key), limit=5) == ([], 0)
        # The old tasks take part in workflows: children of each state but the dead one wait.
        old = [_id(k) for k in (1, 3, 4)]
        done = await store.enqueue_many(
            [task(queue="c", after=old), task(queue="c", after=[_id(5)])], now=NOW
        )
        assert done[0].task is not None
        assert done[0].task.waiting_for == 3
        dead_one = await store.lookup(done[1].id)
        assert dead_one is not None
        assert (dead_one.state, dead_one.task.last_error) == (DEAD, f"parent {_id(5)} is dead")
        # The old lease still holds: its ack keeps a result (an old row's TTL: the default).
        await store.ack(_id(3), "00000000000000aa", now=NOW, result=b'"three"')
        found = await store.lookup(_id(3))
        assert found is not None
        assert (found.state, found.task.result, found.task.finished_at) == (
            SUCCEEDED,
            b'"three"',
            NOW,
        )
        # The old unique key still holds, and now while a task waits too.
        (dup,) = await store.enqueue_many([task(key="u")], now=NOW)
        assert (dup.id, dup.duplicate) == (_id(2), True)
        result, due = await store.sweep(now=NOW + 100)
        assert (result.promoted, result.pruned, result.expired) == (1, 0, 0)
        assert due == pytest.approx(NOW + 900)  # (the old task's expiry: still in its index)
        stats = await consistent(store)
        assert (stats.waiting, stats.succeeded, stats.dead) == (1, 1, 2)
        # The old row's result is kept an hour, and longer while the child waiting for it lives.
        result, due = await store.sweep(now=NOW + 3600)
        assert (result.pruned, result.expired) == (0, 1)
        assert await state_of(store, _id(3)) == SUCCEEDED
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        version = await conn.fetchval("SELECT value FROM wq.meta WHERE key = 'schema'")
        assert version == str(SCHEMA_VERSION)
        indexes = {
            r[0] for r in await conn.fetch("SELECT indexname FROM pg_indexes WHERE schemaname='wq'")
        }
        for name in (
            "edges_parent",
            "tasks_results",
            "tasks_succeeded_queue",
            "tasks_waiting_queue",
        ):
            assert name in indexes
        predicate = await conn.fetchval(
            "SELECT pg_get_expr(indpred, indrelid) FROM pg_index "
            "WHERE indexrelid = 'wq.tasks_unique'::regclass"
        )
        assert "4" in predicate  # (a waiting task holds its unique key)
    finally:
        await conn.close()


# -- between brokers -----------------------------------------------------------------------------


async def test_children_released_by_one_broker_wake_the_consumers_of_another(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    heard = Heard(b)
    (parent,) = await a.enqueue_many([task(queue="p", ttl=60.0)], now=NOW)
    children = await a.enqueue_many(
        [task(queue="c", after=[parent.id]), task(queue="d", after=[parent.id], delay=5.0)],
        now=NOW,
    )
    await until(lambda: "p" in heard.ready)
    await asyncio.sleep(0.1)
    assert "c" not in heard.ready  # (waiting: nothing to wake anyone for)
    d = await a.claim(lease=LEASE, now=NOW, queues=("p",))
    assert d is not None
    await a.ack(d.task.id, d.lease_id, now=NOW, result=b'{"sum": 3}')
    # This broker's consumers: through take_released; the other's: announced.
    released = a.take_released()
    assert released is not None
    assert released.queues == {"c"}
    assert released.earliest == pytest.approx(NOW + 5)
    assert a.take_released() is None
    await until(lambda: "c" in heard.ready)
    got = await b.claim(lease=LEASE, now=NOW, queues=("c",))
    assert got is not None
    assert got.task.id == children[0].id
    assert got.parents == [ParentResult(parent.id, b'{"sum": 3}')]
    assert got.task.after == (parent.id,)
    await consistent(a, b)


async def test_a_watched_task_ended_on_one_broker_is_told_to_the_others(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    heard = Heard(b)
    mine = Heard(a)  # (a broker hears its own ends from its calls, never twice)
    ids = [e.id for e in await a.enqueue_many([task(max_attempts=1) for _ in range(6)], now=NOW)]
    (grandchild,) = await a.enqueue_many([task(after=[ids[2]], queue="w")], now=NOW)
    for task_id in [*ids, grandchild.id]:
        assert (await b.watch(task_id)).state in (READY, WAITING)
    ds = {d.task.id: d for d in await a.claim_many([LEASE] * 4, now=NOW)}
    await a.ack(ids[0], ds[ids[0]].lease_id, now=NOW, result=b"1")
    await a.ack(ids[1], ds[ids[1]].lease_id, now=NOW)
    await a.nack(ids[2], ds[ids[2]].lease_id, "boom", now=NOW)  # (its only attempt: dead)
    await a.cancel(ids[4], now=NOW)
    await a.cancel(ids[3], now=NOW)  # (handed out: cancelling, not ended yet)
    await a.nack(ids[3], ds[ids[3]].lease_id, "bye", now=NOW)
    expected = {
        (ids[0], SUCCEEDED),
        (ids[1], ACKED),
        (ids[2], DEAD),
        (grandchild.id, DEAD),  # (buried with its parent)
        (ids[3], CANCELLED_STATE),
        (ids[4], CANCELLED_STATE),
    }
    await until(lambda: set(heard.finished) == expected)
    assert sorted(mine.finished) == sorted(expected)
    # An unwatched task's end is told nowhere.
    (plain,) = await b.enqueue_many([task(queue="x")], now=NOW)
    d = await b.claim(lease=LEASE, now=NOW, queues=("x",))
    assert d is not None
    assert d.task.id == plain.id
    await b.ack(d.task.id, d.lease_id, now=NOW)
    # One watched on this broker expires on the other's sweep: each hears it once.
    (last,) = await a.enqueue_many([task(queue="x", expires_at=NOW + 5)], now=NOW)
    await a.watch(last.id)
    await b.sweep(now=NOW + 5)
    await until(lambda: (last.id, EXPIRED_STATE) in mine.finished)
    await asyncio.sleep(0.1)
    assert heard.finished[len(expected) :] == [(last.id, EXPIRED_STATE)]
    assert mine.finished[len(expected) :] == [(last.id, EXPIRED_STATE)]
    await consistent(a, b)


async def test_hundreds_of_watched_tasks_ended_in_one_transaction_are_all_told(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    # (A notification holds 8000 bytes: the ends of one transaction go 250 to a message.)
    a, b = two
    heard = Heard(b)
    ids = [e.id for e in await a.enqueue_many([task() for _ in range(700)], now=NOW)]
    for task_id in ids:
        await b.watch(task_id)
    ds = await a.claim_many([LEASE] * 700, now=NOW)
    acked, _ = await a.settle_many(
        [(d.task.id, d.lease_id) for d in ds], [], now=NOW, results={ids[0]: b"0"}
    )
    assert acked == [None] * 700
    await until(lambda: len(heard.finished) == 700)
    assert dict(heard.finished) == {i: SUCCEEDED if i == ids[0] else ACKED for i in ids}
    await consistent(a, b)


async def test_a_result_waited_for_on_one_broker_is_answered_by_an_ack_on_another(
    dsn: str,
) -> None:
    from wqbroker.broker import Broker
    from wqbroker.config import Config
    from wqclient import AsyncClient

    # (A result wait is never polled for: only the other broker's announcement can answer it
    # before its time runs out, when it would be answered "still pending", None.)
    brokers = [Broker(Config(addr="127.0.0.1:0", grpc_addr="off", store=dsn)) for _ in range(2)]
    for broker in brokers:
        await broker.start()
    conn = await asyncpg.connect(dsn)
    try:
        async with (
            AsyncClient(brokers[0].http_url) as to_a,
            AsyncClient(brokers[1].http_url) as to_b,
        ):
            task_id = await to_a.enqueue({"n": 1})
            waiting = asyncio.ensure_future(to_b.wait_result(task_id, timeout=20))
            key = int(task_id, 16) - 2**63
            deadline = time.monotonic() + 10
            while not await conn.fetchval("SELECT watched FROM wq.tasks WHERE id = $1", key):
                assert time.monotonic() < deadline, "the wait never marked the task watched"
                await asyncio.sleep(0.01)
            d = await to_a.claim(wait_ms=1000)
            assert d is not None
            assert d.task.id == task_id
            await to_a.ack(d, result={"answer": 42})
            result = await asyncio.wait_for(waiting, 30)
            assert result is not None
            assert (result.state, result.result) == (SUCCEEDED, {"answer": 42})
    finally:
        await conn.close()
        for broker in brokers:
            await broker.stop()


# -- fan-in and fan-out --------------------------------------------------------------------------

N = 10_000


class Counted:
    """The statements a store sends (each a round trip), by text, while counting."""

    def __init__(self, store: PostgresStore) -> None:
        self.sent: list[str] = []
        fetch = store._fetch

        async def counted(sql: str, *args: Any) -> Any:
            self.sent.append(sql)
            return await fetch(sql, *args)

        store._fetch = counted  # type: ignore[method-assign]


async def test_a_fan_out_of_ten_thousand_is_released_by_one_statement(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    (parent,) = await a.enqueue_many([task(queue="p")], now=NOW)
    children = await a.enqueue_many([task(queue="c", after=[parent.id]) for _ in range(N)], now=NOW)
    assert all(e.task is not None and e.task.waiting_for == 1 for e in children)
    assert (await a.stats()).waiting == N
    assert await b.children(parent.id, limit=3) == ([e.id for e in children[:3]], N)
    d = await b.claim(lease=LEASE, now=NOW, queues=("p",))
    assert d is not None
    counted = Counted(b)
    await b.ack(d.task.id, d.lease_id, now=NOW)
    assert counted.sent == [Q.settle]  # the ack and every release: one round trip
    released = b.take_released()
    assert released is not None
    assert released.queues == {"c"}
    stats = await consistent(a, b)
    assert (stats.ready, stats.waiting) == (N, 0)
    # Ready at the back of their line, in the order they were enqueued.
    got = await claim_all(a, "c")
    assert [g.task.id for g in got] == [e.id for e in children]
    assert all(g.parents == [ParentResult(parent.id)] for g in got)  # (no result held)


async def test_a_fan_in_of_ten_thousand_releases_its_child_once(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    parents = [e.id for e in await a.enqueue_many([task(queue="p") for _ in range(N)], now=NOW)]
    (child,) = await b.enqueue_many([task(queue="c", after=parents)], now=NOW)
    assert child.task is not None
    assert child.task.waiting_for == N
    ds = await claim_all(a, "p")
    random.Random(4).shuffle(ds)
    # Both brokers ack, in batches of every size; the last batches at once.
    batches: list[list[Delivery]] = []
    while ds:
        size = min(len(ds), random.Random(len(ds)).choice([1, 7, 100, 999]))
        batches.append(ds[:size])
        ds = ds[size:]
    released: list[Any] = []

    async def acks(store: PostgresStore, mine: list[list[Delivery]]) -> None:
        for batch in mine:
            outcome, _ = await store.settle_many(
                [(d.task.id, d.lease_id) for d in batch],
                [],
                now=NOW,
                results={batch[0].task.id: b'"first"'},
            )
            assert outcome == [None] * len(batch)
            released.append(store.take_released())

    await asyncio.gather(acks(a, batches[0::2]), acks(b, batches[1::2]))
    assert sum(r is not None for r in released) == 1  # released once, by the last ack
    found = await a.lookup(child.id)
    assert found is not None
    assert found.state == READY
    got = await a.claim(lease=LEASE, now=NOW, queues=("c",))
    assert got is not None
    assert got.task.id == child.id
    assert got.parents is not None
    assert len(got.parents) == N
    assert [p.id for p in got.parents] == parents  # in the order of its after
    assert sum(p.result is not None for p in got.parents) == len(batches)
    assert await b.claim(lease=LEASE, now=NOW, queues=("c",)) is None
    stats = await consistent(a, b)
    assert (stats.handed_out, stats.waiting, stats.succeeded) == (1, 0, len(batches))
    assert a.retries + b.retries == 0


async def test_a_child_counts_each_of_its_parents_acked_in_one_transaction_once(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    # One counter update per child per transaction: parents acked together count together.
    a, _ = two
    parents = [e.id for e in await a.enqueue_many([task(queue="p") for _ in range(5)], now=NOW)]
    await a.enqueue_many(
        [task(queue="c", after=parents), task(queue="c", after=parents[:2])], now=NOW
    )
    ds = await claim_all(a, "p")
    await a.settle_many([(d.task.id, d.lease_id) for d in ds[:3]], [], now=NOW)
    page = await a.list_tasks("c", WAITING, limit=5)
    assert [s.task.waiting_for for s in page.tasks] == [2]  # (the second: released)
    await a.settle_many([(d.task.id, d.lease_id) for d in ds[3:]], [], now=NOW)
    assert len(await claim_all(a, "c")) == 2
    await consistent(a)


# -- results pinned by their children -----------------------------------------------------------


async def _deadline(dsn: str, task_id: str) -> float:
    """When the sweep looks at a result next (the row's deadline)."""
    conn = await asyncpg.connect(dsn)
    try:
        return float(
            await conn.fetchval(
                "SELECT deadline FROM wq.tasks WHERE id = $1 AND state = 5",
                int(task_id, 16) - 2**63,
            )
        )
    finally:
        await conn.close()


async def test_a_pinned_result_is_looked_at_again_later_and_when_its_child_leaves(
    dsn: str, two: tuple[PostgresStore, PostgresStore]
) -> None:
    a, b = two
    parents = [e.id for e in await a.enqueue_many([task(queue="p", ttl=5.0)] * 2, now=NOW)]
    children = await a.enqueue_many(
        [task(queue="c", after=[p], delay=1000.0) for p in parents], now=NOW
    )
    for d in await claim_all(a, "p"):
        await a.ack(d.task.id, d.lease_id, now=NOW, result=b"1")
    assert await _deadline(dsn, parents[0]) == NOW + 5
    # Its time is up, but a child still needs it: not pruned, and not looked at again at every
    # sweep (a minute later; or as soon as the child leaves).
    result, due = await b.sweep(now=NOW + 10)
    assert result.pruned == 0
    assert due == pytest.approx(NOW + 70)
    assert await _deadline(dsn, parents[0]) == NOW + 70
    result, due = await a.sweep(now=NOW + 20)
    assert result.pruned == 0
    assert due == pytest.approx(NOW + 70)
    await a.cancel(children[0].id, now=NOW + 30)
    assert await _deadline(dsn, parents[0]) == NOW + 5  # (due again: its own time)
    # A parent another transaction holds when its child leaves is not waited for: looked at
    # again at its later time.
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute(
                "SELECT 1 FROM wq.tasks WHERE id = $1 FOR UPDATE", int(parents[1], 16) - 2**63
            )
            await b.cancel(children[1].id, now=NOW + 30)
    finally:
        await conn.close()
    result, due = await b.sweep(now=NOW + 31)
    assert result.pruned == 1
    assert await a.lookup(parents[0]) is None
    assert due == pytest.approx(NOW + 70)
    result, due = await a.sweep(now=NOW + 70)
    assert (result.pruned, due) == (1, None)
    stats = await consistent(a, b)
    assert (stats.succeeded, stats.totals.cancelled) == (0, 2)


# -- brokers at once -----------------------------------------------------------------------------


async def test_brokers_acking_overlapping_parents_at_once_never_deadlock(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    rng = random.Random(7)
    parents = [e.id for e in await a.enqueue_many([task(queue="p") for _ in range(300)], now=NOW)]
    items = [task(queue="c", after=rng.sample(parents, rng.randrange(1, 6))) for _ in range(600)]
    children = [e.id for e in await b.enqueue_many(items, now=NOW)]
    ds = await claim_all(a, "p")
    rng.shuffle(ds)
    tally = {a: 0, b: 0}

    async def acker(store: PostgresStore, mine: list[Delivery]) -> None:
        while mine:
            k = rng.randrange(1, 12)
            batch, mine = mine[:k], mine[k:]
            outcome, _ = await store.settle_many(
                [(d.task.id, d.lease_id) for d in batch], [], now=NOW
            )
            assert outcome == [None] * len(batch)
            released = store.take_released()
            if released is not None:
                tally[store] += 1

    # Four ackers on two brokers, each with a share of the parents, all at once.
    await asyncio.gather(*(acker(s, ds[i::4]) for i, s in enumerate([a, b, a, b])))
    assert a.retries + b.retries == 0  # never a deadlock to break
    got = await claim_all(b, "c") + await claim_all(a, "c")
    assert sorted(g.task.id for g in got) == sorted(children)  # each released, once
    stats = await consistent(a, b)
    assert (stats.waiting, stats.handed_out) == (0, 600)


async def test_a_deadlock_the_database_breaks_is_made_again_and_releases_once(
    dsn: str, two: tuple[PostgresStore, PostgresStore]
) -> None:
    a, _ = two
    (parent,) = await a.enqueue_many([task(queue="p")], now=NOW)
    (child,) = await a.enqueue_many([task(queue="c", after=[parent.id])], now=NOW)
    d = await a.claim(lease=LEASE, now=NOW, queues=("p",))
    assert d is not None
    keys = [int(parent.id, 16) - 2**63, int(child.id, 16) - 2**63]
    other = await asyncpg.connect(dsn)
    try:
        # Another transaction holds the child; the ack takes the parent and waits for the child;
        # the other then asks for the parent: a cycle, which the database breaks (the ack, which
        # waited first, is chosen) and the store makes the ack again.
        tx = other.transaction()
        await tx.start()
        # (This side looks for deadlocks late: the ack's side, first to wait, finds this one.)
        await other.execute("SET LOCAL deadlock_timeout = '30s'")
        await other.execute("SELECT 1 FROM wq.tasks WHERE id = $1 FOR UPDATE", keys[1])
        acking = asyncio.ensure_future(a.ack(d.task.id, d.lease_id, now=NOW, result=b"7"))
        deadline = time.monotonic() + 10
        while True:
            # (inside a transaction, pg_stat_activity is a snapshot taken at its first read:
            # cleared before each look, or a first look before the ack waited is all it says)
            await other.execute("SELECT pg_stat_clear_snapshot()")
            if await other.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE '%wq.settle%'"
            ):
                break
            assert time.monotonic() < deadline, "the ack never waited for the child"
            await asyncio.sleep(0.01)
        await other.execute("SELECT 1 FROM wq.tasks WHERE id = $1 FOR UPDATE", keys[0])
        await tx.rollback()
        await asyncio.wait_for(acking, 10)
    finally:
        await other.close()
    assert a.retries >= 1  # (once, unless it took the parent back before the other went on)
    assert a.take_released() is not None
    got = await a.claim(lease=LEASE, now=NOW, queues=("c",))
    assert got is not None
    assert got.parents == [ParentResult(parent.id, b"7")]
    await consistent(a)


async def test_a_child_named_while_its_parent_ends_on_another_broker_never_waits_for_nothing(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    outcomes = {"waited": 0, "ready": 0, "unknown": 0, "dead": 0}
    for i in range(40):
        (parent,) = await a.enqueue_many([task(queue="p", max_attempts=1)], now=NOW)
        d = await a.claim(lease=LEASE, now=NOW, queues=("p",))
        assert d is not None
        end = i % 4  # ack with a result, without one, bury, cancel (then its holder nacks)

        async def ending(d: Delivery = d, end: int = end) -> None:
            if end == 0:
                await a.ack(d.task.id, d.lease_id, now=NOW, result=b"1")
            elif end == 1:
                await a.ack(d.task.id, d.lease_id, now=NOW)
            elif end == 2:
                await a.nack(d.task.id, d.lease_id, "x", now=NOW)
            else:
                await a.cancel(d.task.id, now=NOW)
                await a.nack(d.task.id, d.lease_id, "x", now=NOW)

        async def naming(parent_id: str = parent.id) -> str | None:
            try:
                (child,) = await b.enqueue_many([task(queue="c", after=[parent_id])], now=NOW)
            except UnknownParent:
                outcomes["unknown"] += 1
                return None
            return child.id

        _, child_id = await asyncio.gather(ending(), naming())
        if child_id is None:
            assert end in (1, 3)  # (gone: acked without a result, or cancelled)
            continue
        found = await b.lookup(child_id)
        assert found is not None
        # Released, born ready, or buried: never left waiting for a parent that has ended.
        assert found.state in (READY, DEAD), found
        outcomes["ready" if found.state == READY else "dead"] += 1
        if found.state == READY and end != 0:
            outcomes["waited"] += 1
    assert outcomes["ready"]
    assert outcomes["dead"]
    await consistent(a, b)


async def test_a_batch_with_keys_names_the_tasks_its_duplicates_stand_for(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    (first,) = await a.enqueue_many([task(key="k")], now=NOW)
    done = await b.enqueue_many(
        [task(key="k"), task(after=[0], key="j"), task(after=[0, 1], queue="c")], now=NOW
    )
    assert (done[0].id, done[0].duplicate) == (first.id, True)
    assert done[1].task is not None
    assert done[1].task.after == (first.id,)
    assert done[2].task is not None
    assert done[2].task.after == (first.id, done[1].id)
    assert done[2].task.waiting_for == 2
    assert await a.children(first.id, limit=5) == ([done[1].id, done[2].id], 2)
    # A duplicate that stands for a task that is gone is no parent: nothing of the call is made.
    d = await a.claim(lease=LEASE, now=NOW)
    assert d is not None
    assert d.task.id == first.id
    await a.ack(d.task.id, d.lease_id, now=NOW)
    with pytest.raises(UnknownParent) as refused:
        await b.enqueue_many([task(), task(key="k"), task(after=[1])], now=NOW)
    assert (refused.value.item, refused.value.position, refused.value.task_id) == (
        2,
        0,
        first.id,
    )
    stats = await consistent(a, b)
    assert stats.totals.enqueued == 3


# -- a broker killed between a parent's ack and its children's release ---------------------------

_CHILD = textwrap.dedent(
    """
    import asyncio, random, sys
    from wqbroker.retry import Backoff
    from wqbroker.store.postgres import PostgresStore

    async def main(dsn, held):
        store = await PostgresStore.open(dsn, Backoff(1.0, 30.0, random.Random(1)))
        print("open", flush=True)
        for line in held:
            task_id, lease_id = line.split()
            await store.ack(task_id, lease_id, now=1_700_000_000.0, result=b'"r"')
            print(task_id, flush=True)
        await store.close()

    asyncio.run(main(sys.argv[1], sys.stdin.read().splitlines()))
    """
)


def _acker(dsn: str, held: Sequence[tuple[str, str]]) -> subprocess.Popen[str]:
    """A broker of its own (a process) that acks ``held`` (task id, lease id) one after the
    other, each with a result, saying so on its stdout."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, dsn],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write("".join(f"{task_id} {lease_id}\n" for task_id, lease_id in held))
    proc.stdin.close()
    return proc


async def test_a_broker_killed_between_an_ack_and_the_release_leaves_both_or_neither(
    dsn: str, two: tuple[PostgresStore, PostgresStore]
) -> None:
    a, b = two
    per = 50
    parents = [e.id for e in await a.enqueue_many([task(queue="p") for _ in range(8)], now=NOW)]
    children: dict[str, list[str]] = {}
    for p in parents:
        made = await a.enqueue_many([task(queue="c", after=[p]) for _ in range(per)], now=NOW)
        children[p] = [e.id for e in made]
    ds = {d.task.id: d for d in await claim_all(a, "p")}
    stuck = parents[3]  # its release will wait for a child another transaction holds
    conn = await asyncpg.connect(dsn)
    blocker = await asyncpg.connect(dsn)
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute(
            "SELECT 1 FROM wq.tasks WHERE id = $1 FOR UPDATE",
            int(children[stuck][-1], 16) - 2**63,
        )
        proc = _acker(dsn, [(p, ds[p].lease_id) for p in parents])
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "open"
            deadline = time.monotonic() + 20
            while not await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE '%wq.settle%' AND wait_event_type = 'Lock'"
            ):
                assert time.monotonic() < deadline, "the child's ack never waited"
                await asyncio.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        await tx.rollback()
        deadline = time.monotonic() + 20
        while await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE '%wq.settle%' AND pid <> pg_backend_pid() AND state <> 'idle'"
        ):
            assert time.monotonic() < deadline, "the killed broker's ack is still running"
            await asyncio.sleep(0.05)
    finally:
        await conn.close()
        await blocker.close()
    await consistent(a, b)
    # Each parent: acked with its children released, or neither (never one without the other).
    before, after = parents[:3], parents[4:]
    for p in parents:
        found = await a.lookup(p)
        assert found is not None
        states = {await state_of(b, c) for c in children[p]}
        if found.state == SUCCEEDED:
            assert states == {READY}, (p, states)
        else:
            assert found.state == "handed_out", p
            assert states == {WAITING}, (p, states)
    assert [await state_of(a, p) for p in before] == [SUCCEEDED] * len(before)
    assert [await state_of(a, p) for p in after] == ["handed_out"] * len(after)
    # The others take over: the dead broker's leases run out, its parents run again elsewhere.
    now = NOW + LEASE + 1
    await b.sweep(now=now)
    now += 100
    await a.sweep(now=now)
    while True:
        d = await b.claim(lease=LEASE, now=now, queues=("p",))
        if d is None:
            break
        await b.ack(d.task.id, d.lease_id, now=now)
    got = await claim_all(a, "c", now=now) + await claim_all(b, "c", now=now)
    assert sorted(g.task.id for g in got) == sorted(c for p in parents for c in children[p])
    stats = await consistent(a, b)
    assert (stats.waiting, stats.ready, stats.handed_out) == (0, 0, len(parents) * per)


# -- the counters add up, whatever two brokers do ------------------------------------------------

QUEUES = ("q1", "q2")
_REFUSALS = (NotFound, LeaseLost, Cancelled, TimeLimitReached, Conflict, UnknownParent)

ops = st.one_of(
    st.tuples(
        st.just("enqueue"),
        st.integers(1, 3),
        st.sampled_from(QUEUES),
        st.sampled_from([0.0, 0.0, 4.0]),  # delay
        st.sampled_from([None, None, 3.0, 20.0]),  # expires in
        st.sampled_from([None, None, 0.0, 2.0]),  # result TTL
        st.lists(st.integers(0, 99), max_size=3),  # parents among the tasks made
        st.booleans(),  # the last items name earlier ones of the batch
        st.sampled_from([None, None, "k1"]),
    ),
    st.tuples(st.just("claim"), st.integers(1, 4), st.sampled_from([QUEUES, QUEUES[::-1]])),
    st.tuples(
        st.sampled_from(["ack", "ack_result", "nack", "bury", "reclaim", "release"]),
        st.integers(0, 99),
    ),
    st.tuples(st.just("settle"), st.integers(0, 99), st.integers(1, 4)),
    st.tuples(st.sampled_from(["cancel", "watch", "purge", "requeue"]), st.integers(0, 99)),
    st.tuples(st.sampled_from(["empty", "delete"]), st.sampled_from(QUEUES)),
    st.tuples(st.sampled_from(["sweep", "requeue_all"])),
    st.tuples(st.just("advance"), st.sampled_from([1.0, 3.0, 10.0, 60.0])),
    st.tuples(st.just("list"), st.sampled_from(LIST_STATES)),
)


class TwoBrokers:
    """Random operations played on two stores sharing one database, on a clock of the test's."""

    def __init__(self, stores: tuple[PostgresStore, PostgresStore]) -> None:
        self.stores = stores
        self.now = NOW
        self.held: list[Delivery] = []
        self.ids: list[str] = []

    async def play(self, steps: list[tuple[Any, ...]], sides: list[int]) -> None:
        for step, side in zip(steps, sides, strict=False):
            store = self.stores[side % 2]
            with contextlib.suppress(*_REFUSALS):
                await self.step(store, step)
            await consistent(*self.stores)
            for s in self.stores:
                s.take_released()

    async def step(self, store: PostgresStore, step: tuple[Any, ...]) -> None:
        kind = step[0]
        if kind == "advance":
            self.now += step[1]
        elif kind in ("ack", "ack_result", "nack", "bury", "reclaim", "release"):
            if self.held:
                await self.on_held(store, kind, self.held[step[1] % len(self.held)])
        elif kind in ("cancel", "watch", "purge", "requeue"):
            if self.ids:
                await self.on_task(store, kind, self.ids[step[1] % len(self.ids)])
        else:
            await getattr(self, kind)(store, *step[1:])

    async def enqueue(
        self,
        store: PostgresStore,
        n: int,
        queue: str,
        delay: float,
        expires_in: float | None,
        ttl: float | None,
        parents: list[int],
        chained: bool,
        key: str | None,
    ) -> None:
        after: list[str | int] = [self.ids[i % len(self.ids)] for i in parents if self.ids]
        items = []
        for i in range(n):
            refs = list(dict.fromkeys(after))
            if chained and i:
                refs.append(i - 1)
            items.append(
                task(
                    queue=queue,
                    delay=delay,
                    max_attempts=2,
                    expires_at=None if expires_in is None else self.now + expires_in,
                    ttl=ttl,
                    after=refs,
                    key=key if i == 0 else None,
                )
            )
        done = await store.enqueue_many(items, now=self.now)
        for e, item in zip(done, items, strict=True):
            if e.task is None:
                continue
            if not item.after:
                assert e.task.after is None
                continue
            assert e.task.after is not None
            assert len(e.task.after) == len(item.after)
            named = [(r, x) for r, x in zip(item.after, e.task.after, strict=True)]
            assert all(r == x for r, x in named if isinstance(r, str))
        self.ids += [e.id for e in done]

    async def claim(self, store: PostgresStore, n: int, queues: tuple[str, ...]) -> None:
        got = await store.claim_many([10.0] * n, now=self.now, queues=queues)
        for d in got:  # a task with parents comes with them, in order
            found = d.task.after
            assert (d.parents is None) == (found is None)
            if d.parents is not None:
                assert tuple(p.id for p in d.parents) == found
        self.held += got

    async def on_held(self, store: PostgresStore, kind: str, d: Delivery) -> None:
        now, task_id, lease_id = self.now, d.task.id, d.lease_id
        if kind == "ack":
            await store.ack(task_id, lease_id, now=now)
        elif kind == "ack_result":
            await store.ack(task_id, lease_id, now=now, result=b'{"r": 1}')
        elif kind in ("nack", "bury"):
            await store.nack(task_id, lease_id, "x", now=now, delay=2.0, terminal=kind == "bury")
        elif kind == "reclaim":
            await store.reclaim(task_id, lease_id, "gone", now=now)
        else:
            await store.release(task_id, lease_id, now=now)

    async def settle(self, store: PostgresStore, i: int, n: int) -> None:
        """Acks (with results now and then, one maybe twice) and nacks in one call."""
        if not self.held:
            return
        picked = [self.held[(i + j) % len(self.held)] for j in range(n)]
        acks = [(d.task.id, d.lease_id) for d in picked[::2]]
        nacks = [NackItem(d.task.id, d.lease_id, "x") for d in picked[1::2]]
        results = {t: b"[%d]" % k for k, (t, _) in enumerate(acks) if k % 2 == 0}
        await store.settle_many(acks, nacks, now=self.now, results=results)

    async def on_task(self, store: PostgresStore, kind: str, task_id: str) -> None:
        if kind == "cancel":
            await store.cancel(task_id, now=self.now)
        elif kind == "watch":
            await store.watch(task_id)
        elif kind == "purge":
            await store.purge(task_id)
        else:
            await store.requeue(task_id, now=self.now)
        await store.children(task_id, limit=3)

    async def empty(self, store: PostgresStore, queue: str) -> None:
        await store.empty_queue(queue, now=self.now)

    async def delete(self, store: PostgresStore, queue: str) -> None:
        await store.delete_queue(queue)

    async def sweep(self, store: PostgresStore) -> None:
        await store.sweep(now=self.now)

    async def requeue_all(self, store: PostgresStore) -> None:
        await store.requeue_all(now=self.now)

    async def list(self, store: PostgresStore, state: str) -> None:
        for queue in QUEUES:
            seen: list[str] = []
            after = None
            while True:
                page = await store.list_tasks(queue, state, limit=2, after=after)
                assert all(s.state == state for s in page.tasks)
                seen += [s.task.id for s in page.tasks]
                if page.after is None:
                    break
                after = page.after
            assert len(seen) == len(set(seen))


def test_the_counters_add_up_whatever_two_brokers_do() -> None:
    loop = asyncio.new_event_loop()

    async def open_two() -> tuple[PostgresStore, PostgresStore]:
        dsn = await pg.create_database("rh")
        a = await PostgresStore.open(dsn, backoff(1), random.Random(1), pool_size=2)
        b = await PostgresStore.open(dsn, backoff(2), random.Random(2), pool_size=2)
        return a, b

    stores = loop.run_until_complete(open_two())

    @settings(
        max_examples=examples(100),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        steps=st.lists(ops, min_size=10, max_size=40),
        sides=st.lists(st.integers(0, 1), min_size=40, max_size=40),
    )
    def run(steps: list[tuple[Any, ...]], sides: list[int]) -> None:
        for store in stores:  # (each forgets the ids it had reserved: the numbers start over)
            loop.run_until_complete(store.wipe())
        loop.run_until_complete(TwoBrokers(stores).play(steps, sides))

    try:
        run()
    finally:
        for s in stores:
            loop.run_until_complete(s.close())
        loop.close()
