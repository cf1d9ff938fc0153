"""The PostgreSQL store's side of control over every task (docs/design/control.md), beyond the
contract suite: the migration from a version-2 database, listings paged while other brokers
change the queue, unique keys raced by brokers, cancels heard by another broker (and what else
may be heard on its channel), cancel and empty left to the database when the broker is killed,
expiry and time limits across brokers, and the counters' invariant after random operations on two
brokers.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import pg
from tests.helpers import examples
from wqbroker.errors import (
    Cancelled,
    Conflict,
    InvalidArgument,
    LeaseLost,
    NotFound,
    TimeLimitReached,
)
from wqbroker.models import (
    CANCELLED,
    CANCELLING,
    DEAD,
    DEFAULT_QUEUE,
    DELAYED,
    HANDED_OUT,
    PURGED,
    READY,
    Delivery,
    NackItem,
    NewTask,
    Stats,
    Task,
)
from wqbroker.retry import Backoff
from wqbroker.store.postgres import SCHEMA_VERSION, PostgresStore
from wqbroker.store.postgres.schema import MIGRATIONS

T = TypeVar("T")

NOW = 1_700_000_000.0
LEASE = 30.0
ROOT = Path(__file__).resolve().parents[2]


def backoff(seed: int = 1) -> Backoff:
    return Backoff(1.0, 30.0, random.Random(seed))


@pytest.fixture
async def dsn() -> str:
    return await pg.create_database("c")


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
    priority: int = 0,
    delay: float = 0.0,
    max_attempts: int = 3,
    key: str | None = None,
    unique: bool = False,
    expires_at: float | None = None,
    timeout: float | None = None,
) -> NewTask:
    return NewTask(
        payload,
        max_attempts,
        delay,
        queue,
        priority,
        key,
        NOW + 300 if key is not None and not unique else 0.0,
        expires_at=expires_at,
        timeout=timeout,
        unique=unique,
    )


def held(stats: Stats) -> int:
    return stats.ready + stats.handed_out + stats.delayed + stats.dead


def gone(stats: Stats) -> int:
    t = stats.totals
    return t.enqueued - t.acked - t.purged - t.cancelled - t.expired


async def consistent(*stores: PostgresStore) -> Stats:
    """The counters agree with the tasks (per queue, and with the totals), the same from every
    store; the whole store's stats."""
    await stores[0].check_invariants()
    stats = await stores[0].stats()
    assert held(stats) == gone(stats), stats
    t = stats.totals
    assert t.nacked + t.reclaimed == t.retried + t.buried, stats
    for other in stores[1:]:
        assert await other.stats() == stats
    return stats


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


# -- the migration -------------------------------------------------------------------------------


async def _version_2_database(dsn: str) -> None:
    """A database as a version-2 broker left it: the tables of 001 and 002, its version and id
    key, and tasks in every state with the counters that match them (written as version 2's
    functions wrote them)."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            for migration in MIGRATIONS.files[:2]:
                await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO wq.meta VALUES ('schema', '2'), ('id_key', '12345');"
                "INSERT INTO wq.queues VALUES ('default', false), ('q', true);"
                "SELECT setval('wq.ord', 100); SELECT setval('wq.id_blocks', 5)"
            )
            rows = [  # id, queue, state, priority, ord, payload, attempts, lease, deadline
                (1, "default", 0, 5, 10 * 2**20, b'{"n":1}', 0, None, None),
                (2, "default", 0, 0, 11 * 2**20, b'{"n":2}', 1, None, None),
                (3, "default", 1, 0, 12 * 2**20, b'{"n":3}', 1, "00000000000000aa", NOW + 30),
                (4, "q", 2, 0, 13 * 2**20, b'{"n":4}', 1, None, None),
                (5, "q", 3, 0, 14 * 2**20, b'{"n":5}', 3, None, None),
            ]
            await conn.executemany(
                "INSERT INTO wq.tasks (id, queue, state, priority, ord, payload, attempts, "
                "max_attempts, created_at, available_at, lease_id, deadline) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, 3, $8, $9, $10, $11)",
                [
                    (*r[:7], NOW, NOW + 60 if r[2] == 2 else NOW, r[7], r[8])  # (delayed: 60 s)
                    for r in rows
                ],
            )
            await conn.execute(
                "INSERT INTO wq.counters (slot, queue, enqueued, delivered, nacked, retried, "
                "buried, ready, handed_out, delayed, dead) VALUES "
                "(0, 'default', 3, 2, 1, 1, 0, 2, 1, 0, 0), (0, 'q', 2, 4, 4, 3, 1, 0, 0, 1, 1)"
            )
            await conn.execute(
                "INSERT INTO wq.keys VALUES ('default', 'kept', -9223372036854775807, $1)",
                NOW + 300,
            )
    finally:
        await conn.close()


async def test_a_version_2_database_is_upgraded_in_place(dsn: str) -> None:
    await _version_2_database(dsn)
    store = await PostgresStore.open(dsn, backoff(), random.Random(1))
    try:
        stats = await consistent(store)
        assert (stats.ready, stats.handed_out, stats.delayed, stats.dead) == (2, 1, 1, 1)
        assert (stats.totals.cancelled, stats.totals.expired) == (0, 0)
        # Every task is where it was, its new fields unset.
        for key, state in ((1, READY), (2, READY), (3, HANDED_OUT), (4, DELAYED), (5, DEAD)):
            found = await store.lookup("%016x" % (key + 2**63))
            assert found is not None
            assert found.state == state
            assert found.task.payload == b'{"n":%d}' % key
            t = found.task
            assert (t.expires_at, t.timeout, t.progress, t.cancelling) == (None, None, None, False)
        # The old lease still holds, and the new operations work on the old rows.
        lease_held = "%016x" % (3 + 2**63)
        assert await store.extend(
            lease_held, "00000000000000aa", lease=10, now=NOW, progress=b"1"
        ) == pytest.approx(NOW + 10)
        assert (await store.cancel(lease_held, now=NOW)).state == CANCELLING
        failure = await store.nack(lease_held, "00000000000000aa", "x", now=NOW)
        assert failure.cancelled
        page = await store.list_tasks(DEFAULT_QUEUE, READY, limit=10)
        assert [s.task.payload for s in page.tasks] == [b'{"n":1}', b'{"n":2}']
        d = await store.claim(lease=LEASE, now=NOW)
        assert d is not None
        assert d.task.payload == b'{"n":1}'
        dup = await store.enqueue_many([task(key="kept")], now=NOW)
        assert dup[0].duplicate  # the window's keys are kept
        assert await store.empty_queue("q", now=NOW) == 1
        stats = await consistent(store)
        assert (stats.totals.cancelled, stats.handed_out, stats.dead) == (2, 1, 1)
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT value FROM wq.meta WHERE key = 'schema'") == str(
            SCHEMA_VERSION
        )
        indexes = {
            r[0] for r in await conn.fetch("SELECT indexname FROM pg_indexes WHERE schemaname='wq'")
        }
        for name in ("tasks_delayed_queue", "tasks_leased_queue", "tasks_expiry", "tasks_unique"):
            assert name in indexes
    finally:
        await conn.close()


# -- listings under concurrent changes -----------------------------------------------------------


async def page_all(store: PostgresStore, queue: str, state: str, limit: int) -> list[Task]:
    """Every task of a listing, a page at a time (each page asked for after the last's key)."""
    tasks: list[Task] = []
    after = None
    while True:
        page = await store.list_tasks(queue, state, limit=limit, after=after)
        assert len(page.tasks) <= limit
        assert all(s.state == state for s in page.tasks)
        tasks += [s.task for s in page.tasks]
        if page.after is None:
            return tasks
        assert len(page.tasks) == limit  # (a short page is the last)
        after = page.after
        await asyncio.sleep(0.002)  # (the other broker's changes come between the pages)


class Mutator:
    """Changes made through the other broker while a listing is paged, until told to stop: the
    ids of the tasks it moved out of (or within) the listed state."""

    def __init__(self, store: PostgresStore, seed: int) -> None:
        self.store = store
        self.rng = random.Random(seed)
        self.touched: set[str] = set()
        self.stop = asyncio.Event()
        self.rounds = 0

    async def run(self, step: Callable[[], Awaitable[None]]) -> None:
        while not self.stop.is_set():
            await step()
            self.rounds += 1
            await asyncio.sleep(0.001)


# Each state's scene: its tasks made through broker ``a``, in the order the listing must show
# them, and a step of changes the other broker (the Mutator's) makes meanwhile.
Scene = tuple[list[str], Callable[[], Awaitable[None]]]
N_LISTED = 240


async def _ready_scene(a: PostgresStore, m: Mutator) -> Scene:
    b, rng = m.store, m.rng
    priorities = [rng.randrange(10) for _ in range(N_LISTED)]
    done = await a.enqueue_many([task(queue="q", priority=p) for p in priorities], now=NOW)
    keys = [(-p, i) for i, p in enumerate(priorities)]
    order = [e.id for _, e in sorted(zip(keys, done, strict=True))]

    async def step() -> None:
        got = await b.claim_many([LEASE] * 2, now=NOW, queues=("q",))
        m.touched.update(d.task.id for d in got)
        await b.enqueue_many([task(queue="q", priority=rng.randrange(10))], now=NOW)
        victim = rng.choice(order)
        m.touched.add(victim)
        with _gone_already():
            await b.cancel(victim, now=NOW)

    return order, step


async def _delayed_scene(a: PostgresStore, m: Mutator) -> Scene:
    b, rng = m.store, m.rng
    delays = [float(rng.randrange(1, 20)) for _ in range(N_LISTED)]  # (many equal due times)
    done = await a.enqueue_many([task(queue="q", delay=d) for d in delays], now=NOW)
    keys = [(d, i) for i, d in enumerate(delays)]
    order = [e.id for _, e in sorted(zip(keys, done, strict=True))]

    async def step() -> None:
        await b.enqueue_many([task(queue="q", delay=float(rng.randrange(1, 20)))], now=NOW)
        victim = rng.choice(order)
        m.touched.add(victim)
        with _gone_already():
            await b.cancel(victim, now=NOW)

    return order, step


async def _handed_out_scene(a: PostgresStore, m: Mutator) -> Scene:
    b, rng = m.store, m.rng
    await a.enqueue_many([task(queue="q") for _ in range(N_LISTED + 400)], now=NOW)
    leases = [float(rng.randrange(10, 40)) for _ in range(N_LISTED)]
    got = await a.claim_many(leases, now=NOW, queues=("q",))
    keys = [(lease, i) for i, lease in enumerate(leases)]
    order = [d.task.id for _, d in sorted(zip(keys, got, strict=True))]
    held = {d.task.id: d for d in got}

    async def step() -> None:
        d = held[rng.choice(order)]
        m.touched.add(d.task.id)
        with _gone_already():
            if rng.random() < 0.5:
                await b.extend(d.task.id, d.lease_id, lease=rng.randrange(5, 50), now=NOW)
            else:
                await b.ack(d.task.id, d.lease_id, now=NOW)
        await b.claim_many([float(rng.randrange(10, 40))], now=NOW, queues=("q",))

    return order, step


async def _dead_scene(a: PostgresStore, m: Mutator) -> Scene:
    b, rng = m.store, m.rng
    await a.enqueue_many([task(queue="q", max_attempts=1) for _ in range(N_LISTED + 400)], now=NOW)
    got = await a.claim_many([LEASE] * N_LISTED, now=NOW, queues=("q",))
    await a.settle_many([], [NackItem(d.task.id, d.lease_id, "x") for d in got], now=NOW)
    order = [d.task.id for d in got]  # (one call: buried in the order nacked)
    spare = await a.claim_many([LEASE] * 400, now=NOW, queues=("q",))

    async def step() -> None:
        victim = rng.choice(order)
        m.touched.add(victim)
        with _gone_already():
            if rng.random() < 0.5:
                await b.requeue(victim, now=NOW)
            else:
                await b.purge(victim)
        if spare:
            d = spare.pop()
            await b.nack(d.task.id, d.lease_id, "late", now=NOW)

    return order, step


SCENES: dict[str, Callable[[PostgresStore, Mutator], Awaitable[Scene]]] = {
    READY: _ready_scene,
    DELAYED: _delayed_scene,
    HANDED_OUT: _handed_out_scene,
    DEAD: _dead_scene,
}


@pytest.mark.parametrize("state", list(SCENES))
async def test_a_page_never_repeats_nor_skips_a_task_that_stayed_while_others_change(
    two: tuple[PostgresStore, PostgresStore], state: str
) -> None:
    a, b = two
    m = Mutator(b, 8)
    order, step = await SCENES[state](a, m)
    mutating = asyncio.ensure_future(m.run(step))
    try:
        listed = await page_all(a, "q", state, limit=7)
    finally:
        m.stop.set()
        await mutating
    assert m.rounds >= 3, "the listing did not overlap the changes"
    ids = [t.id for t in listed]
    twice = {t for t in ids if ids.count(t) > 1}
    if state == HANDED_OUT:  # (one extended meanwhile moves to its new deadline: maybe twice)
        assert twice <= m.touched, "a task was listed twice"
    else:
        assert not twice, "a task was listed twice"
    stayed = [t for t in order if t not in m.touched]
    kept = set(stayed)
    assert [t for t in ids if t in kept] == stayed  # every one, once, in the state's order
    await consistent(a, b)


class _gone_already:
    """A change the other broker makes to a task that may have left already (NotFound,
    LeaseLost: another step got there first) is simply not made."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, (NotFound, LeaseLost))


async def test_listings_show_the_control_fields_and_never_a_lease(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    await a.enqueue_many(
        [task(expires_at=NOW + 50, timeout=60.0), task(delay=5.0, expires_at=NOW + 9)], now=NOW
    )
    d = await b.claim(lease=LEASE, now=NOW)
    assert d is not None
    await b.extend(d.task.id, d.lease_id, lease=1, now=NOW, progress=b'{"done": 0.5}')
    await a.cancel(d.task.id, now=NOW)
    (out,) = (await a.list_tasks(DEFAULT_QUEUE, HANDED_OUT, limit=5)).tasks
    assert out.task.progress == b'{"done": 0.5}'
    assert out.task.cancelling
    assert out.task.expires_at == pytest.approx(NOW + 50)
    assert out.task.timeout == 60.0
    assert d.lease_id not in repr(out)
    (waiting,) = (await a.list_tasks(DEFAULT_QUEUE, DELAYED, limit=5)).tasks
    assert waiting.task.expires_at == pytest.approx(NOW + 9)
    assert (waiting.task.progress, waiting.task.cancelling) == (None, False)
    found = await b.lookup(d.task.id)
    assert found is not None
    assert (found.task.progress, found.task.cancelling) == (b'{"done": 0.5}', True)


@pytest.mark.parametrize(
    "after",
    [(), (1.5,), (1e300, -1e300), (-5.0, 2**70), (3.0, 4.0, 5.0), (float(2**64), 1.0)],
)
async def test_a_key_the_store_never_gave_is_refused_or_read_in_range(
    two: tuple[PostgresStore, PostgresStore], after: tuple[float, ...]
) -> None:
    # (The service only hands a store keys made of finite numbers, from cursors it decoded: a
    # forged cursor must not reach the database as an out-of-range parameter, a 500.)
    a, _ = two
    await a.enqueue_many([task(priority=p) for p in range(10)], now=NOW)
    for state in (READY, DELAYED, HANDED_OUT, DEAD):
        if len(after) != (1 if state == DEAD else 2):  # (not even the shape of one)
            with pytest.raises(InvalidArgument, match="cursor"):
                await a.list_tasks(DEFAULT_QUEUE, state, limit=3, after=after)
        else:
            page = await a.list_tasks(DEFAULT_QUEUE, state, limit=3, after=after)
            assert len(page.tasks) <= 3


# -- unique keys raced by brokers ----------------------------------------------------------------


async def _active_per_key(dsn: str) -> dict[tuple[str, str], int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT queue, ukey, count(*) FROM wq.tasks "
            "WHERE ukey IS NOT NULL AND state IN (0, 1, 2) GROUP BY queue, ukey"
        )
    finally:
        await conn.close()
    return {(r[0], r[1]): r[2] for r in rows}


class KeyRace:
    """Brokers enqueueing unique keys at once, and others ending the tasks that hold them."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.made: dict[str, set[str]] = {k: set() for k in keys}  # the tasks each key made
        self.answers: list[tuple[str, str, bool]] = []  # (key, id answered, duplicate)

    async def racer(self, store: PostgresStore, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(30):
            # (Several keys a batch, in any order: brokers wait for each other's keys.)
            keys = rng.sample(self.keys, 3)
            done = await store.enqueue_many(
                [task(queue="u", key=k, unique=True) for k in keys], now=NOW
            )
            for key, e in zip(keys, done, strict=True):
                self.answers.append((key, e.id, e.duplicate))
                if not e.duplicate:
                    self.made[key].add(e.id)

    async def finisher(self, store: PostgresStore) -> None:
        """Ends the key holders as they come (ack, nack to the dead, cancel), so that keys are
        freed and taken again while the racers race."""
        rng = random.Random(3)
        for _ in range(60):
            d = await store.claim(lease=LEASE, now=NOW, queues=("u",))
            if d is None:
                await asyncio.sleep(0.002)
                continue
            end = rng.randrange(3)
            if end == 0:
                await store.ack(d.task.id, d.lease_id, now=NOW)
            elif end == 1:
                await store.nack(d.task.id, d.lease_id, "x", now=NOW, terminal=True)
            else:
                await store.cancel(d.task.id, now=NOW)
                await store.nack(d.task.id, d.lease_id, "x", now=NOW)


async def test_unique_keys_raced_by_two_brokers_make_one_active_task_each(
    dsn: str, two: tuple[PostgresStore, PostgresStore]
) -> None:
    a, b = two
    race = KeyRace([f"k{i}" for i in range(8)])
    made = race.made
    await asyncio.gather(
        *(race.racer(s, i) for i, s in enumerate([a, b, a, b, a, b])),
        race.finisher(a),
        race.finisher(b),
    )
    active = await _active_per_key(dsn)
    assert all(n == 1 for n in active.values()), active
    # Every duplicate named a task that its key made; every task made is one enqueue's.
    for key, task_id, duplicate in race.answers:
        assert task_id in made[key], (key, task_id, duplicate)
    stats = await consistent(a, b)
    assert stats.totals.enqueued == sum(len(ids) for ids in made.values())
    assert stats.totals.enqueued > len(made)  # keys were freed and taken again
    # A key whose task is still active answers with it, from either broker.
    for (_, key), _n in active.items():
        (again,) = await b.enqueue_many([task(queue="u", key=key, unique=True)], now=NOW)
        assert again.duplicate
        found = await a.lookup(again.id)
        assert found is not None
        assert found.state in (READY, HANDED_OUT, DELAYED)


async def test_batches_of_unique_keys_in_opposite_orders_never_deadlock(
    dsn: str, two: tuple[PostgresStore, PostgresStore]
) -> None:
    a, b = two
    for store in (a, b):  # (the queue exists; each broker has ids at hand)
        await store.enqueue_many([task(queue="u")], now=NOW)
    conn = await asyncpg.connect(dsn)
    try:
        # Another transaction holds the key k3 (uncommitted): both brokers' batches wait for it
        # with what they took before it; once it goes, they must not wait for each other's.
        tx = conn.transaction()
        await tx.start()
        await conn.execute(
            "INSERT INTO wq.tasks (id, queue, state, priority, ord, payload, attempts, "
            "max_attempts, created_at, available_at, ukey) "
            "VALUES (7, 'u', 0, 0, 1, '{}', 0, 1, 0, 0, 'k3')"
        )
        first = asyncio.ensure_future(
            a.enqueue_many(
                [task(queue="u", key=k, unique=True) for k in ("k1", "k3", "k2")], now=NOW
            )
        )
        second = asyncio.ensure_future(
            b.enqueue_many(
                [task(queue="u", key=k, unique=True) for k in ("k2", "k3", "k1")], now=NOW
            )
        )
        deadline = time.monotonic() + 10
        while True:
            # (inside a transaction, pg_stat_activity is a snapshot taken at its first read:
            # cleared before each look, or a first look before the batches waited is all it says)
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE '%wq.enqueue%'"
            )
            if waiting >= 2:
                break
            assert time.monotonic() < deadline, "the batches never waited for k3"
            await asyncio.sleep(0.01)
        await tx.rollback()
        done = await first + await second  # (a deadlock: StoreError)
    finally:
        await conn.close()
    made = {e.id for e in done if not e.duplicate}
    assert len(made) == 3
    assert all(e.id in made for e in done)
    await consistent(a, b)


async def test_a_unique_key_and_a_window_key_are_one_namespace(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    (first,) = await a.enqueue_many([task(key="k", unique=True)], now=NOW)
    (plain,) = await b.enqueue_many([task(key="k")], now=NOW)  # held by an active unique task
    assert (plain.id, plain.duplicate) == (first.id, True)
    (windowed,) = await b.enqueue_many([task(key="w")], now=NOW)
    (unique,) = await a.enqueue_many([task(key="w", unique=True)], now=NOW)  # in its window
    assert (unique.id, unique.duplicate) == (windowed.id, True)
    assert a.key_hint(DEFAULT_QUEUE, "k", NOW) is None  # (a unique key is never a window key)
    stats = await consistent(a, b)
    assert stats.totals.enqueued == 2


# -- cancels heard by the other brokers ----------------------------------------------------------


async def test_a_cancel_on_one_broker_reaches_the_other_at_once(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    heard_a: list[str] = []
    heard_b: list[str] = []
    a.on_cancel(heard_a.extend)
    b.on_cancel(heard_b.extend)
    await a.enqueue_many([task(), task(), task(delay=5.0)], now=NOW)
    held = await b.claim_many([LEASE, LEASE], now=NOW)
    first = await a.cancel(held[0].task.id, now=NOW)
    assert (first.state, first.lease_id) == (CANCELLING, held[0].lease_id)
    await until(lambda: heard_b == [held[0].lease_id])
    again = await a.cancel(held[0].task.id, now=NOW)  # (said again: announced again)
    assert again.state == CANCELLING
    await until(lambda: heard_b == [held[0].lease_id] * 2)
    second = await b.cancel(held[1].task.id, now=NOW)
    assert second.lease_id == held[1].lease_id
    await until(lambda: heard_a == [held[1].lease_id])
    # What is not handed out is not announced: nobody holds it.
    page = await a.list_tasks(DEFAULT_QUEUE, DELAYED, limit=1)
    assert (await b.cancel(page.tasks[0].task.id, now=NOW)).state == CANCELLED
    await asyncio.sleep(0.2)
    assert heard_a == [held[1].lease_id]  # and a broker never hears its own
    assert heard_b == [held[0].lease_id] * 2
    with pytest.raises(Cancelled):
        await a.extend(held[0].task.id, held[0].lease_id, lease=LEASE, now=NOW)


async def test_a_broker_ignores_what_is_not_a_cancel_it_can_read(
    dsn: str, two: tuple[PostgresStore, PostgresStore]
) -> None:
    a, b = two
    heard: list[list[str]] = []
    woken: list[object] = []
    b.on_cancel(lambda leases: heard.append(list(leases)))
    b.on_ready(woken.append)
    lease = "0123456789abcdef"
    junk = [
        "",
        "\n",
        "~",
        "x\n~",
        "x\n~\n",
        "x\n~\nnot-a-lease\n0123456789ABCDEF\n0123456789abcdef0\n\x01",
        "x\n~\n" + "\n".join(["zz"] * 2000),
        "x\n\u00e9\u00e9\n*\n",
        f"x\n~\n{lease}\n{lease[:-1]}\n  {lease}",  # (one lease id among the junk)
    ]
    conn = await asyncpg.connect(dsn)
    try:
        for payload in junk:
            await conn.execute("SELECT pg_notify('wq_ready', $1)", payload)

        def boom(_leases: object) -> None:
            raise RuntimeError("a callback that fails")

        await until(lambda: heard == [[lease]])
        b.on_cancel(boom)  # (a failing callback is logged; the listener goes on)
        await conn.execute("SELECT pg_notify('wq_ready', $1)", f"x\n~\n{lease}")
        await asyncio.sleep(0.1)
        b.on_cancel(lambda leases: heard.append(list(leases)))
    finally:
        await conn.close()
    # Still listening: a real cancel is heard.
    await a.enqueue_many([task()], now=NOW)
    d = await a.claim(lease=LEASE, now=NOW)
    assert d is not None
    await a.cancel(d.task.id, now=NOW)
    await until(lambda: heard[-1:] == [[d.lease_id]])
    assert b.problem() is None


# -- a broker killed mid-operation: the database decides -----------------------------------------

_CHILD = textwrap.dedent(
    """
    import asyncio, random, sys
    from wqbroker.retry import Backoff
    from wqbroker.store.postgres import PostgresStore

    async def main(dsn, what, ids):
        store = await PostgresStore.open(dsn, Backoff(1.0, 30.0, random.Random(1)))
        print("open", flush=True)
        if what == "empty":
            print(await store.empty_queue("big", now=1.0), flush=True)
        else:
            for task_id in ids:
                await store.cancel(task_id, now=1.0)
                print(task_id, flush=True)
        await store.close()

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.stdin.read().split()))
    """
)


def _child(dsn: str, what: str, ids: Sequence[str] = ()) -> subprocess.Popen[str]:
    """A broker of its own (a process) that empties the queue ``big``, or cancels ``ids`` one
    after the other, saying what it did on its stdout."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, dsn, what],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write("\n".join(ids))
    proc.stdin.close()
    return proc


async def _backends_gone(conn: asyncpg.Connection, like: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND query LIKE $1 AND pid <> pg_backend_pid()"
    )
    while await conn.fetchval(query, like):
        assert time.monotonic() < deadline, "the killed broker's statement is still running"
        await asyncio.sleep(0.05)


async def test_an_empty_cut_short_by_sigkill_is_all_or_nothing(
    dsn: str, two: tuple[PostgresStore, PostgresStore]
) -> None:
    a, _ = two
    n = 3000
    for _ in range(n // 1000):
        await a.enqueue_many([task(queue="big") for _ in range(1000)], now=NOW)
    await a.enqueue_many([task(queue="big", delay=9.0) for _ in range(100)], now=NOW)
    conn = await asyncpg.connect(dsn)
    try:
        # One ready task held locked (as a claim would): the child's delete waits for it, part
        # done, while the child is killed.
        blocker = await asyncpg.connect(dsn)
        tx = blocker.transaction()
        await tx.start()
        await blocker.fetchval(
            "SELECT id FROM wq.tasks WHERE queue = 'big' AND state = 0 ORDER BY ord DESC "
            "LIMIT 1 FOR UPDATE"
        )
        proc = _child(dsn, "empty")
        try:
            deadline = time.monotonic() + 20
            while not await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE '%wq.empty%' AND wait_event_type = 'Lock'"
            ):
                assert time.monotonic() < deadline, "the child's empty never started"
                await asyncio.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        await tx.rollback()
        await blocker.close()
        await _backends_gone(conn, "%wq.empty%")
    finally:
        await conn.close()
    stats = await consistent(a)
    # All of it or none of it: never part of the queue gone, or gone uncounted.
    big = await a.stats("big")
    assert (big.ready + big.delayed, big.totals.cancelled) in ((n + 100, 0), (0, n + 100))
    assert stats.totals.cancelled == big.totals.cancelled


async def test_cancels_cut_short_by_sigkill_leave_each_task_whole(
    dsn: str, two: tuple[PostgresStore, PostgresStore]
) -> None:
    a, b = two
    done = await a.enqueue_many([task(queue="big") for _ in range(400)], now=NOW)
    held = await b.claim_many([LEASE] * 100, now=NOW, queues=("big",))
    ids = [e.id for e in done]
    random.Random(5).shuffle(ids)
    proc = _child(dsn, "cancel", ids)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "open"
        for _ in range(20):  # some done, then killed among the rest
            proc.stdout.readline()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    conn = await asyncpg.connect(dsn)
    try:
        await _backends_gone(conn, "%wq.cancel%")
    finally:
        await conn.close()
    stats = await consistent(a, b)
    flags = []  # which of the held tasks the dead broker made cancelling
    for d in held:
        found = await a.lookup(d.task.id)
        assert found is not None
        flags.append(found.task.cancelling)
    cancelling = sum(flags)
    assert 20 <= stats.totals.cancelled + cancelling < 400, "not killed among its cancels"
    assert stats.ready == 300 - stats.totals.cancelled  # each cancelled one gone, counted
    assert stats.handed_out == 100
    # A handed-out task the dead broker cancelled is cancelling: its holder's nack drops it;
    # the others are retried.
    for d, flag in zip(held, flags, strict=True):
        failure = await b.nack(d.task.id, d.lease_id, "x", now=NOW)
        assert failure.cancelled == flag
    final = await consistent(a, b)
    assert final.totals.cancelled == stats.totals.cancelled + cancelling
    assert final.delayed == 100 - cancelling


# -- expiry and time limits, across brokers ------------------------------------------------------


async def test_expiry_by_the_sweep_costs_what_is_due_and_counts_each_once(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    soon = [task(queue="e", expires_at=NOW + 10) for _ in range(150)]
    soon += [task(queue="e", delay=20.0, expires_at=NOW + 10) for _ in range(50)]  # due after
    later = [task(queue="e", expires_at=NOW + 100) for _ in range(30)]
    await a.enqueue_many(soon + later + [task(queue="e")], now=NOW)
    result, due = await b.sweep(now=NOW)
    assert result.expired == 0
    assert due == pytest.approx(NOW + 10)  # the sweeper wakes for the expiry
    # Two brokers sweep at once: each expired task dropped and counted once.
    (ra, _), (rb, due) = await asyncio.gather(a.sweep(now=NOW + 10), b.sweep(now=NOW + 10))
    assert ra.expired + rb.expired == 200
    assert due == pytest.approx(NOW + 100)
    stats = await consistent(a, b)
    assert (stats.ready, stats.delayed, stats.totals.expired) == (31, 0, 200)
    assert (await a.stats("e")).totals.expired == 200
    # The delayed ones never came back; the rest go at their own time.
    result, _ = await a.sweep(now=NOW + 100)
    assert (result.expired, result.promoted) == (30, 0)
    d = await b.claim(lease=LEASE, now=NOW + 100, queues=("e",))
    assert d is not None
    assert d.task.expires_at is None


async def test_a_claim_never_hands_out_an_expired_task_whoever_sweeps(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    items = [task(queue="c", expires_at=NOW + 5 if i % 2 else None) for i in range(200)]
    items += [task(queue="c", delay=3.0, expires_at=NOW + 5) for _ in range(40)]
    done = await a.enqueue_many(items, now=NOW)
    expiring = {e.id for e, t in zip(done, items, strict=True) if t.expires_at is not None}

    async def drain(store: PostgresStore) -> list[Delivery]:
        got: list[Delivery] = []
        while batch := await store.claim_many([LEASE] * 7, now=NOW + 5, queues=("c",)):
            got += batch
        return got

    # No sweep: the claims of both brokers meet the expired tasks, ready and due from delayed.
    ga, gb = await asyncio.gather(drain(a), drain(b))
    handed = [d.task.id for d in ga + gb]
    assert len(handed) == len(set(handed)) == 100
    assert not expiring & set(handed)
    stats = await consistent(a, b)
    assert (stats.ready, stats.delayed, stats.handed_out) == (0, 0, 100)
    assert stats.totals.expired == 140


async def test_a_retry_past_its_expiry_expires_from_delayed(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    await a.enqueue_many([task(expires_at=NOW + 5)], now=NOW)
    d = await b.claim(lease=LEASE, now=NOW)
    assert d is not None
    failure = await a.nack(d.task.id, d.lease_id, "x", now=NOW + 4, delay=10.0)
    assert failure.retry_at == pytest.approx(NOW + 14)
    result, due = await a.sweep(now=NOW + 14)
    assert (result.expired, result.promoted, due) == (1, 0, None)
    assert await b.claim(lease=LEASE, now=NOW + 14) is None
    stats = await consistent(a, b)
    assert (stats.totals.expired, stats.totals.retried) == (1, 1)


async def test_a_time_limit_holds_whichever_broker_extends(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    (done,) = await a.enqueue_many([task(timeout=40.0, max_attempts=2)], now=NOW)
    d = await a.claim(lease=LEASE, now=NOW)
    assert d is not None
    assert d.deadline == pytest.approx(NOW + 30)
    assert d.task.timeout == 40.0
    assert await b.extend(d.task.id, d.lease_id, lease=5, now=NOW + 1) == pytest.approx(NOW + 6)
    # A shortened lease is shortened; a long one cut to the limit; then refused from either.
    assert await b.extend(
        d.task.id, d.lease_id, lease=100, now=NOW + 2, progress=b"[1]"
    ) == pytest.approx(NOW + 40)
    for store in (a, b):
        with pytest.raises(TimeLimitReached, match="40000 ms"):
            await store.extend(d.task.id, d.lease_id, lease=1, now=NOW + 3, progress=b"[2]")
    found = await a.lookup(done.id)
    assert found is not None
    assert found.task.progress == b"[1]"  # (a refused extension records nothing)
    result, _ = await b.sweep(now=NOW + 40)
    assert result.reclaimed == [(d.task.id, d.lease_id)]
    found = await a.lookup(done.id)
    assert found is not None
    assert (found.state, found.task.progress) == (DELAYED, None)
    await a.sweep(now=NOW + 100)
    again = await b.claim(lease=LEASE, now=NOW + 100)
    assert again is not None
    assert await a.extend(
        again.task.id, again.lease_id, lease=1000, now=NOW + 110
    ) == pytest.approx(NOW + 140)  # a fresh limit: from its new hand-out
    await consistent(a, b)


async def test_a_queue_deleted_while_brokers_enqueue_to_it_is_never_lost(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    outcomes = {"deleted": 0, "refused": 0}

    async def enqueuer(store: PostgresStore) -> None:
        for _ in range(60):
            await store.enqueue_many([task(queue="d")], now=NOW)
            d = await store.claim(lease=LEASE, now=NOW, queues=("d",))
            if d is not None:
                await store.ack(d.task.id, d.lease_id, now=NOW)

    async def deleter(store: PostgresStore) -> None:
        for _ in range(120):
            try:
                await store.delete_queue("d")
                outcomes["deleted"] += 1
            except NotFound:
                pass
            except Conflict:
                outcomes["refused"] += 1
            await asyncio.sleep(0)

    await asyncio.gather(enqueuer(a), enqueuer(b), deleter(a), deleter(b), a.sweep(now=NOW))
    assert outcomes["deleted"]
    assert outcomes["refused"]
    stats = await consistent(a, b)
    # Whatever was deleted when: every task left is in a queue that is known, and the broker's
    # totals kept what the deleted queues counted.
    names = {q.name for q in await a.queues()}
    left = await a.stats("d")
    if held(left):
        assert "d" in names
    assert stats.totals.enqueued == 120
    assert stats.totals.acked + stats.ready + stats.handed_out == 120


# -- the counters add up, whatever two brokers do ------------------------------------------------

QUEUES = ("q1", "q2")
# What an operation may be refused with (Conflict: a queue deleted only when it holds nothing).
_REFUSALS = (NotFound, LeaseLost, Cancelled, TimeLimitReached, Conflict)

ops = st.one_of(
    st.tuples(
        st.just("enqueue"),
        st.integers(1, 4),
        st.sampled_from(QUEUES),
        st.integers(0, 9),
        st.sampled_from([0.0, 0.0, 4.0]),
        st.sampled_from([None, None, 3.0, 20.0]),  # expires in
        st.sampled_from([None, None, 2.0, 50.0]),  # timeout
        st.sampled_from([None, None, "k1", "k2"]),
        st.booleans(),  # unique
    ),
    st.tuples(st.just("claim"), st.integers(1, 4), st.sampled_from([QUEUES, QUEUES[::-1]])),
    st.tuples(st.sampled_from(["ack", "nack", "bury", "reclaim", "release"]), st.integers(0, 99)),
    st.tuples(st.just("extend"), st.integers(0, 99), st.sampled_from([1.0, 10.0, 100.0])),
    st.tuples(st.sampled_from(["cancel", "cancel_held"]), st.integers(0, 99)),
    st.tuples(st.sampled_from(["empty", "delete"]), st.sampled_from(QUEUES)),
    st.tuples(st.sampled_from(["sweep", "requeue_all"])),
    st.tuples(st.just("advance"), st.sampled_from([1.0, 3.0, 10.0, 60.0])),
    st.tuples(st.just("list"), st.sampled_from([READY, DELAYED, HANDED_OUT, DEAD])),
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

    async def step(self, store: PostgresStore, step: tuple[Any, ...]) -> None:
        kind = step[0]
        if kind in _ON_HELD:
            if self.held:
                d = self.held[step[1] % len(self.held)]
                await self.on_held(store, kind, d, step)
        elif kind == "advance":
            self.now += step[1]
        else:
            await getattr(self, kind)(store, *step[1:])

    async def enqueue(
        self,
        store: PostgresStore,
        n: int,
        queue: str,
        priority: int,
        delay: float,
        expires_in: float | None,
        timeout: float | None,
        key: str | None,
        unique: bool,
    ) -> None:
        expires_at = None if expires_in is None else self.now + expires_in
        new = [
            task(
                queue=queue,
                priority=priority,
                delay=delay,
                max_attempts=2,
                key=key,
                unique=unique and key is not None,
                expires_at=expires_at,
                timeout=timeout,
            )
            for _ in range(n)
        ]
        self.ids += [e.id for e in await store.enqueue_many(new, now=self.now)]

    async def claim(self, store: PostgresStore, n: int, queues: tuple[str, ...]) -> None:
        now = self.now
        got = await store.claim_many([10.0] * n, now=now, queues=queues)
        for d in got:  # never one at or past its expiry; a lease within its time limit
            assert d.task.expires_at is None or d.task.expires_at > now
            if d.task.timeout is not None:
                assert d.deadline <= now + d.task.timeout + 1e-6
        self.held += got

    async def on_held(
        self, store: PostgresStore, kind: str, d: Delivery, step: tuple[Any, ...]
    ) -> None:
        now, task_id, lease_id = self.now, d.task.id, d.lease_id
        if kind == "ack":
            await store.ack(task_id, lease_id, now=now)
        elif kind in ("nack", "bury"):
            failure = await store.nack(
                task_id, lease_id, "x", now=now, delay=2.0, terminal=kind == "bury"
            )
            assert not (failure.cancelled and failure.buried)
        elif kind == "reclaim":
            await store.reclaim(task_id, lease_id, "gone", now=now)
        elif kind == "release":
            await store.release(task_id, lease_id, now=now)
        else:
            progress = b'{"at": %d}' % int(now)
            await store.extend(task_id, lease_id, lease=step[2], now=now, progress=progress)

    async def cancel(self, store: PostgresStore, i: int) -> None:
        if self.ids:
            result = await store.cancel(self.ids[i % len(self.ids)], now=self.now)
            assert result.state in (CANCELLED, CANCELLING, PURGED)
            assert (result.lease_id is not None) == (result.state == CANCELLING)

    async def cancel_held(self, store: PostgresStore, i: int) -> None:
        if self.held:
            result = await store.cancel(self.held[i % len(self.held)].task.id, now=self.now)
            assert result.state in (CANCELLING, CANCELLED, PURGED)

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
            tasks = await page_all(store, queue, state, limit=2)
            assert len({t.id for t in tasks}) == len(tasks)


_ON_HELD = frozenset({"ack", "nack", "bury", "reclaim", "release", "extend"})


def test_the_counters_add_up_whatever_two_brokers_do() -> None:
    loop = asyncio.new_event_loop()

    async def open_two() -> tuple[PostgresStore, PostgresStore]:
        dsn = await pg.create_database("h")
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


# -- a cancel through one broker reaches a stream on another -------------------------------------


async def test_a_worker_streaming_from_one_broker_is_told_of_a_cancel_sent_to_another(
    dsn: str,
) -> None:
    import grpc

    from wqbroker.broker import Broker
    from wqbroker.config import Config
    from wqwire.pb import broker_pb2 as pb
    from wqwire.pb import broker_pb2_grpc as pb_grpc

    brokers = [Broker(Config(addr="off", grpc_addr="127.0.0.1:0", store=dsn)) for _ in range(2)]
    for broker in brokers:
        await broker.start()
    try:
        async with (
            grpc.aio.insecure_channel(brokers[0].grpc_target) as to_a,
            grpc.aio.insecure_channel(brokers[1].grpc_target) as to_b,
        ):
            a, b = pb_grpc.BrokerStub(to_a), pb_grpc.BrokerStub(to_b)
            call = b.StreamJobs(None)
            await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=2)))

            async def read() -> pb.StreamJobsResponse:
                response = await asyncio.wait_for(call.read(), 10)
                assert isinstance(response, pb.StreamJobsResponse), "the stream ended"
                return response

            assert await read() == pb.StreamJobsResponse()  # (open)
            task_id = (await a.Enqueue(pb.EnqueueRequest(payload=b"1"))).id
            response = await read()
            while not response.deliveries:
                response = await read()
            [delivery] = response.deliveries
            assert delivery.task.id == task_id
            # Cancelled through the other broker: this stream hears of it from the database.
            assert (await a.CancelTask(pb.CancelTaskRequest(id=task_id))).state == "cancelling"
            told = await read()
            while not told.cancels:
                told = await read()
            assert list(told.cancels) == [pb.Cancel(id=task_id, lease_id=delivery.lease_id)]
            nack = pb.NackRequest(id=task_id, lease_id=delivery.lease_id)
            await call.write(pb.StreamJobsRequest(nacks=[nack]))
            settled = await read()
            while not settled.settled:
                settled = await read()
            assert [s.code for s in settled.settled] == [0]
            stats = await a.Stats(pb.StatsRequest())
            assert (stats.totals.cancelled, stats.totals.retried, stats.ready) == (1, 0, 0)
            call.cancel()
    finally:
        for broker in brokers:
            await broker.stop()
