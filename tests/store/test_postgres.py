"""The PostgreSQL store beyond the contract: its schema at open, exact payloads, and several
stores (as several brokers would hold them) on one database acting as one store.

Each test here gets a database of its own (tests/pg.py; dropped at the end of the run).
"""

from __future__ import annotations

import asyncio
import random
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, cast

import asyncpg
import pytest

from tests import pg
from wqbroker.broker import Broker, StartupError, open_store
from wqbroker.clock import SystemClock
from wqbroker.config import Config
from wqbroker.errors import LeaseLost, NotFound, StoreError
from wqbroker.models import NewTask
from wqbroker.retry import Backoff
from wqbroker.store import enqueue_one
from wqbroker.store.postgres import LISTENER_NAME, SCHEMA_VERSION, PostgresStore
from wqbroker.store.postgres.queries import Q
from wqclient import AsyncClient

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


async def test_a_task_buried_before_schema_8_has_no_burial_time(dsn: str) -> None:
    """A dead task whose buried_at is NULL (buried before version 8 added it) is shown without
    one, in a lookup, the dead-letter queue and the dead listing; a requeue clears it."""
    store = await PostgresStore.open(dsn, backoff(), random.Random(1))
    try:
        task_id = (await enqueue_one(store, b"1", max_attempts=1, delay=0.0, now=NOW)).id
        d = await store.claim(lease=LEASE, now=NOW)
        assert d is not None
        await store.nack(task_id, d.lease_id, "no", now=NOW + 5)
        [dead] = await store.dead_letters()
        assert dead.buried_at == NOW + 5
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("UPDATE wq.tasks SET buried_at = NULL")
        finally:
            await conn.close()
        [dead] = await store.dead_letters()
        assert (dead.id, dead.buried_at) == (task_id, None)
        found = await store.lookup(task_id)
        assert found is not None
        assert (found.state, found.task.buried_at) == ("dead", None)
        [listed] = (await store.list_tasks("default", "dead", limit=10)).tasks
        assert listed.task.buried_at is None
        await store.requeue(task_id, now=NOW + 6)
        found = await store.lookup(task_id)
        assert found is not None
        assert (found.state, found.task.buried_at) == ("ready", None)
    finally:
        await store.close()


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


# -- between brokers: wake-ups ------------------------------------------------------------------


class Heard:
    """What a store's on_ready callback was told."""

    def __init__(self, store: PostgresStore) -> None:
        self.calls: list[set[str] | None] = []
        self.event = asyncio.Event()
        store.on_ready(self._heard)

    def _heard(self, queues: Iterable[str] | None) -> None:
        self.calls.append(None if queues is None else set(queues))
        self.event.set()

    async def next(self, timeout: float = 5.0) -> set[str] | None:
        await asyncio.wait_for(self.event.wait(), timeout)
        self.event.clear()
        return self.calls.pop(0)

    @property
    def queues(self) -> set[str]:
        return {q for call in self.calls if call is not None for q in call}


async def test_a_store_hears_what_another_made_ready_and_not_its_own(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    heard_a, heard_b = Heard(a), Heard(b)
    await enqueue_one(a, b"1", max_attempts=1, delay=0.0, now=NOW, queue="alpha")
    assert await heard_b.next() == {"alpha"}
    # A delayed task is not ready: nothing to say; a requeue, a release and a resume are.
    await enqueue_one(a, b"2", max_attempts=1, delay=60.0, now=NOW, queue="later")
    d = await a.claim(lease=LEASE, now=NOW, queues=("alpha",))
    assert d is not None
    assert await a.release(d.task.id, d.lease_id, now=NOW)
    assert await heard_b.next() == {"alpha"}
    d = await a.claim(lease=LEASE, now=NOW, queues=("alpha",))
    assert d is not None
    await a.nack(d.task.id, d.lease_id, "no", now=NOW, terminal=True)
    await a.requeue(d.task.id, now=NOW)
    assert await heard_b.next() == {"alpha"}
    await a.set_paused("beta", True)
    await a.set_paused("beta", False)
    assert await heard_b.next() == {"beta"}
    await asyncio.sleep(0.1)  # anything else would have arrived by now
    assert heard_b.queues == set()
    assert "later" not in heard_b.queues
    assert heard_a.calls == []  # a store never hears its own announcements


async def test_promotions_by_a_claim_are_told_here_and_announced(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    heard_a, heard_b = Heard(a), Heard(b)
    await enqueue_one(a, b"x", max_attempts=1, delay=5.0, now=NOW, queue="other")
    # A claim on the default queue, after the delay, promotes the task of "other": both this
    # broker (its consumers of "other") and the rest hear of it.
    assert await a.claim(lease=LEASE, now=NOW + 6) is None
    assert await heard_a.next() == {"other"}
    assert await heard_b.next() == {"other"}


async def test_announcements_in_a_burst_are_coalesced(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    heard = Heard(b)
    n = 200
    await asyncio.gather(
        *(
            enqueue_one(a, b"1", max_attempts=1, delay=0.0, now=NOW, queue=f"q{i % 4}")
            for i in range(n)
        )
    )
    await wait_for(lambda: heard.queues == {"q0", "q1", "q2", "q3"})
    # one NOTIFY in flight at a time, carrying every queue gathered meanwhile
    assert 1 <= a.announcements < n


async def test_a_lost_listening_connection_is_made_again_and_everything_rechecked(
    dsn: str, two: tuple[PostgresStore, PostgresStore]
) -> None:
    a, b = two
    heard = Heard(b)
    await terminate_listeners(dsn)
    # b listens again by itself and, as announcements may have been missed, re-checks every queue
    assert await heard.next() is None
    await enqueue_one(a, b"1", max_attempts=1, delay=0.0, now=NOW, queue="after")
    assert await heard.next() == {"after"}


# -- the database goes away ---------------------------------------------------------------------


async def test_while_the_database_is_away_calls_fail_fast_and_it_recovers_alone(
    dsn: str,
) -> None:
    proxy = await pg.Proxy.start(dsn)
    store = await PostgresStore.open(proxy.dsn(dsn), backoff(), random.Random(1))
    heard = Heard(store)
    try:
        kept = await enqueue_one(store, b"kept", max_attempts=1, delay=0.0, now=NOW)
        await proxy.cut()
        with pytest.raises(StoreError, match="unreachable"):
            await store.stats()
        assert store.problem() is not None
        # and now without trying the network: at once, with the same reason
        with pytest.raises(StoreError, match="unreachable"):
            await enqueue_one(store, b"x", max_attempts=1, delay=0.0, now=NOW)
        await proxy.restore()
        await wait_for(lambda: store.problem() is None, timeout=10)
        assert None in heard.calls  # told to re-check every queue
        d = await store.claim(lease=LEASE, now=NOW)
        assert d is not None
        assert d.task.id == kept.id
    finally:
        await store.close()
        await proxy.cut()


async def test_killed_connections_are_replaced(dsn: str) -> None:
    store = await PostgresStore.open(dsn, backoff(), random.Random(1), pool_size=2)
    try:
        await enqueue_one(store, b"1", max_attempts=1, delay=0.0, now=NOW)
        await terminate_listeners(dsn, everything=True)
        ok = 0
        for _ in range(50):  # a call may fail (its connection was killed); then they work
            try:
                stats = await store.stats()
            except StoreError:
                await asyncio.sleep(0.05)
                continue
            ok += 1
            assert stats.ready == 1
        assert ok >= 45
        await wait_for(lambda: store.problem() is None)
    finally:
        await store.close()


# -- time, counters, schema ---------------------------------------------------------------------


class SkewedClock(SystemClock):
    def __init__(self, skew: float) -> None:
        self.skew = skew

    def now(self) -> float:
        return time.time() + self.skew


@pytest.mark.parametrize("skew", [3600.0, -3600.0])
async def test_with_the_database_clock_skewed_brokers_agree(dsn: str, skew: float) -> None:
    clock = SkewedClock(skew)
    skewed = await PostgresStore.open(dsn, backoff(), db_clock=True, clock=clock)
    right = await PostgresStore.open(dsn, backoff(), db_clock=True, clock=SystemClock())
    try:
        assert abs(skewed.skew + skew) < 1  # the database is 'skew' behind this broker
        # times handed to the skewed broker are in its own clock
        now = clock.now()
        done = await enqueue_one(skewed, b"1", max_attempts=1, delay=0.3, now=now)
        assert done.task is not None
        assert abs(done.task.available_at - (now + 0.3)) < 0.5
        # the other broker sees the task due 0.3 s from now, not an hour early or late
        assert await right.claim(lease=LEASE, now=time.time()) is None
        await asyncio.sleep(0.4)
        d = await right.claim(lease=1.0, now=time.time())
        assert d is not None
        assert abs(d.deadline - (time.time() + 1.0)) < 0.5
        # a lease taken through the other is reclaimed by the skewed one at its deadline
        result, _ = await skewed.sweep(now=clock.now())
        assert result.reclaimed == []
        await asyncio.sleep(1.1)
        result, _ = await skewed.sweep(now=clock.now())
        assert result.reclaimed == [(d.task.id, d.lease_id)]
    finally:
        await skewed.close()
        await right.close()


async def test_counters_of_gone_connections_are_folded_and_stats_stay_exact(dsn: str) -> None:
    for i in range(3):  # three brokers come and go, each with its own connections
        s = await PostgresStore.open(dsn, backoff(i), random.Random(i))
        await enqueue_one(s, b"1", max_attempts=1, delay=0.0, now=NOW, queue="q")
        d = await s.claim(lease=LEASE, now=NOW, queues=("q",))
        assert d is not None
        await s.ack(d.task.id, d.lease_id, now=NOW)
        await enqueue_one(s, b"2", max_attempts=1, delay=0.0, now=NOW, queue="q")
        await s.close()
    store = await PostgresStore.open(dsn, backoff(), random.Random(9))
    try:
        before = await store.stats()
        conn = await asyncpg.connect(dsn)
        try:
            rows_before = await conn.fetchval("SELECT count(*) FROM wq.counters")
            await store.sweep(now=NOW)  # the first sweep folds
            rows_after = await conn.fetchval("SELECT count(*) FROM wq.counters")
            slots = await conn.fetch("SELECT DISTINCT slot FROM wq.counters")
        finally:
            await conn.close()
        assert rows_after < rows_before
        assert [r[0] for r in slots] == [0]
        assert await store.stats() == before
        assert (before.ready, before.totals.enqueued, before.totals.acked) == (3, 6, 3)
        await store.check_invariants()
    finally:
        await store.close()


async def test_an_older_schema_is_upgraded_in_place(dsn: str) -> None:
    store = await PostgresStore.open(dsn, backoff())
    kept = await enqueue_one(store, b"kept", max_attempts=1, delay=0.0, now=NOW)
    await store.close()
    conn = await asyncpg.connect(dsn)
    try:  # as version 1 left it: no fold function, no index of key expiries, and its version
        await conn.execute(
            "DROP FUNCTION wq.fold(); DROP INDEX wq.keys_until; "
            "UPDATE wq.meta SET value = '1' WHERE key = 'schema'"
        )
    finally:
        await conn.close()
    again = await PostgresStore.open(dsn, backoff())
    try:
        await again.sweep(now=NOW)  # it folds: the function is back
        d = await again.claim(lease=LEASE, now=NOW)
        assert d is not None
        assert d.task.id == kept.id
    finally:
        await again.close()
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT value FROM wq.meta WHERE key = 'schema'") == str(
            SCHEMA_VERSION
        )
        assert await conn.fetchval("SELECT to_regclass('wq.keys_until')") is not None
    finally:
        await conn.close()


async def test_an_enqueue_wakes_a_parked_claim_whatever_the_clocks_say(dsn: str) -> None:
    # The broker translates the database's times into its own clock only to within its estimate
    # of the skew; whether a new task is ready must not hang on that estimate.
    config = Config(
        addr="127.0.0.1:0", grpc_addr="off", store=dsn, poll_interval=60, sweep_interval=60
    )
    broker = Broker(config)
    await broker.start()
    try:
        store = broker.store
        assert isinstance(store, PostgresStore)
        await broker.service.sweep()  # (its first poll: the next is a minute away)
        for error in (0.05, -0.05):
            store.skew -= error  # an estimate 50 ms off, either way
            claim = asyncio.ensure_future(broker.service.claim(wait_ms=10_000))
            await asyncio.sleep(0.05)
            await broker.service.enqueue(b'{"n":1}')
            d = await asyncio.wait_for(claim, 5)  # not at the next poll, a minute away
            assert d is not None
            await broker.service.ack(d.task.id, d.lease_id)
    finally:
        await broker.stop()


async def test_a_client_given_two_brokers_balances_and_outlives_one(dsn: str) -> None:
    brokers = [Broker(Config(addr="off", grpc_addr="127.0.0.1:0", store=dsn)) for _ in range(2)]
    for b in brokers:
        await b.start()
    try:
        url = "grpc://" + ",".join(b.grpc_target for b in brokers)
        async with AsyncClient(url) as client:
            ids = [await client.enqueue({"n": i}) for i in range(20)]
            calls = [b.store.transactions for b in brokers]
            assert all(n >= 3 for n in calls), calls  # both served (round robin)
            await brokers[0].stop()
            more = [await client.enqueue({"n": i}) for i in range(5)]  # the other serves
            got = []
            for _ in ids + more:
                d = await client.claim(wait_ms=1000)
                assert d is not None
                await client.ack(d)
                got.append(d.task.id)
            assert sorted(got) == sorted(ids + more)
    finally:
        for b in brokers:
            await b.stop()


async def test_concurrent_calls_are_grouped_and_each_gets_its_own_answer(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    n = 60
    before = a.transactions
    done = await asyncio.gather(
        *(
            enqueue_one(
                a,
                str(i).encode(),
                max_attempts=1,
                delay=0.0,
                now=NOW,
                key=f"k{i % 40}",
                key_until=NOW + 60,
            )
            for i in range(n)
        )
    )
    grouped = a.transactions - before
    assert grouped < n // 2  # far fewer commits than calls
    # every caller got its own answer: a new task, or (same key) a duplicate of the first one's
    new = [e for e in done if not e.duplicate]
    assert len(new) == len({e.id for e in new}) == 40
    firsts = {i % 40: done[i].id for i in range(40)}
    assert all(done[i].duplicate and done[i].id == firsts[i % 40] for i in range(40, n))
    ds = await b.claim_many([LEASE] * 40, now=NOW)
    assert {d.task.payload for d in ds} == {str(i).encode() for i in range(40)}
    # acks: the right lease, a wrong one, an unknown task -- each caller gets its own outcome
    before = a.transactions
    outcomes = await asyncio.gather(
        *(a.settle_many([(d.task.id, d.lease_id)], (), now=NOW) for d in ds[:30]),
        a.settle_many([(ds[30].task.id, "0" * 16)], (), now=NOW),
        a.settle_many([("f" * 16, "0" * 16)], (), now=NOW),
    )
    assert [o[0] for o in outcomes[:30]] == [[None]] * 30
    assert isinstance(outcomes[30][0][0], LeaseLost)
    assert isinstance(outcomes[31][0][0], NotFound)
    assert a.transactions - before < 15
    stats = await b.stats()
    assert (stats.ready, stats.handed_out, stats.totals.acked) == (0, 10, 30)
    await a.check_invariants()


async def test_on_the_database_clock_calls_group_whatever_now_each_passes(dsn: str) -> None:
    """A broker passes its own clock's reading with every call (each a little later than the
    last); on the database's clock those readings are not used, and must not keep concurrent
    calls apart. Claims for the same queues group too, the first callers served first."""
    store = await PostgresStore.open(dsn, backoff(), db_clock=True, clock=SystemClock())
    try:
        n = 40
        before = store.transactions
        done = await asyncio.gather(
            *(
                enqueue_one(store, str(i).encode(), max_attempts=1, delay=0.0, now=time.time())
                for i in range(n)
            )
        )
        assert store.transactions - before < n // 4
        assert len({e.id for e in done}) == n
        # claims for one queue: more claimers than tasks; for another queue: apart from them
        await enqueue_one(store, b"other", max_attempts=1, delay=0.0, now=time.time(), queue="b")
        before = store.transactions
        claims = await asyncio.gather(
            *(store.claim(lease=LEASE, now=time.time()) for _ in range(n + 10)),
            store.claim(lease=LEASE, now=time.time(), queues=("b",)),
        )
        assert store.transactions - before < n // 4
        got = [d for d in claims[:-1] if d is not None]
        assert sorted(d.task.payload for d in got) == sorted(str(i).encode() for i in range(n))
        assert len({d.lease_id for d in got}) == n
        assert claims[-1] is not None
        assert claims[-1].task.payload == b"other"
        before = store.transactions
        outcomes = await asyncio.gather(
            *(store.ack(d.task.id, d.lease_id, now=time.time()) for d in got),
            return_exceptions=True,
        )
        assert outcomes == [None] * n
        assert store.transactions - before < n // 4
        stats = await store.stats()
        assert (stats.ready, stats.handed_out, stats.totals.acked) == (0, 1, n)
        await store.check_invariants()
    finally:
        await store.close()


async def test_a_claim_cancelled_while_waiting_for_its_group_hands_its_task_back(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    for i in range(2):
        await enqueue_one(a, str(i).encode(), max_attempts=1, delay=0.0, now=NOW)
    told: list[Iterable[str] | None] = []
    a.on_ready(told.append)
    first = asyncio.ensure_future(a.claim(lease=LEASE, now=NOW))
    await asyncio.sleep(0)  # in flight
    second = asyncio.ensure_future(a.claim(lease=LEASE, now=NOW))
    await asyncio.sleep(0)  # waiting for the first
    second.cancel()
    d = await first
    assert d is not None
    assert d.task.payload == b"0"
    with pytest.raises(asyncio.CancelledError):
        await second

    async def back() -> bool:
        s = await b.stats()
        return (s.ready, s.handed_out) == (1, 1)

    deadline = time.monotonic() + 5
    while not (await back() and told):
        assert time.monotonic() < deadline, "the orphaned claim was not handed back"
        await asyncio.sleep(0.02)
    assert [list(q) for q in told if q is not None] == [["default"]]  # local consumers told
    again = await b.claim(lease=LEASE, now=NOW)
    assert again is not None
    assert again.task.payload == b"1"
    assert again.task.attempts == 1


async def test_claims_for_different_queues_do_not_wait_for_each_other(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit keeps one claim in flight per list of queues, not one in all: consumers of
    different queues are not served one after the other."""
    store = await PostgresStore.open(dsn, backoff(), db_clock=True, clock=SystemClock())
    try:
        names = [f"q{i}" for i in range(5)]
        for name in names:
            await enqueue_one(store, b"1", max_attempts=1, delay=0.0, now=time.time(), queue=name)
        in_flight: list[tuple[str, ...]] = []
        most: dict[str, int] = {"any": 0, "q0": 0}
        fetch = store._fetch

        async def slow_fetch(sql: str, *args: object) -> list[asyncpg.Record]:
            if "wq.claim" not in sql:
                return await fetch(sql, *args)
            queues = tuple(cast(list[str], args[3]))
            in_flight.append(queues)
            most["any"] = max(most["any"], len(in_flight))
            most["q0"] = max(most["q0"], in_flight.count(("q0",)))
            try:
                await asyncio.sleep(0.05)  # long enough for every claim below to be made
                return await fetch(sql, *args)
            finally:
                in_flight.remove(queues)

        monkeypatch.setattr(store, "_fetch", slow_fetch)
        got = await asyncio.gather(
            *(store.claim(lease=LEASE, now=time.time(), queues=(name,)) for name in names),
            *(store.claim(lease=LEASE, now=time.time(), queues=("q0",)) for _ in range(4)),
        )
        assert most == {"any": 5, "q0": 1}  # five lists of queues at once; q0's one at a time
        assert [d is not None and d.task.queue for d in got[:5]] == names
        assert got[5:] == [None] * 4  # q0 had one task, and the first claim took it
    finally:
        await store.close()


# -- helpers ------------------------------------------------------------------------------------


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def terminate_listeners(dsn: str, *, everything: bool = False) -> None:
    """Kill the LISTENing connections to the database (or all of them but ours)."""
    name = urllib.parse.urlsplit(dsn).path.lstrip("/")
    conn = await asyncpg.connect(dsn)
    try:
        which = "" if everything else f"AND application_name = '{LISTENER_NAME}'"
        killed = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            f"WHERE datname = $1 AND pid <> pg_backend_pid() {which}",
            name,
        )
        assert killed >= 1
    finally:
        await conn.close()


async def test_on_a_slow_link_calls_of_a_kind_go_side_by_side(dsn: str) -> None:
    """20 ms each way to the database (bench/delayproxy.py): once a group is seen to take that
    long, concurrent calls go in transactions side by side (pipelined on the pool's connections)
    instead of each waiting a whole round trip behind the one in flight; every call's answer is
    its own, and each task is enqueued, claimed and acked once."""
    from bench.delayproxy import DelayProxy

    parts = urllib.parse.urlsplit(dsn)
    proxy = DelayProxy((parts.hostname or "127.0.0.1", parts.port or 5432), 0.02)
    port = await proxy.start()
    user = parts.netloc.rpartition("@")[0]
    slow = urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{port}"))
    store = await PostgresStore.open(slow, backoff(), random.Random(1), pool_size=8)
    try:
        await enqueue_one(store, b'{"n":0}', max_attempts=3, delay=0.0, now=NOW)  # (slow: seen)

        async def one(n: int) -> str:
            return (
                await enqueue_one(store, b'{"n":%d}' % n, max_attempts=3, delay=0.0, now=NOW)
            ).id

        ids = await asyncio.gather(*(one(n) for n in range(1, 9)))
        assert len(set(ids)) == 8
        assert store._enqueues.most_in_flight >= 2
        got = await asyncio.gather(*(store.claim(lease=30.0, now=NOW) for _ in range(9)))
        claimed = [d for d in got if d is not None]
        assert len({d.task.id for d in claimed}) == len(claimed)
        acked = await asyncio.gather(
            *(store.settle_many([(d.task.id, d.lease_id)], (), now=NOW) for d in claimed)
        )
        assert all(a == ([None], []) for a in acked)
        stats = await store.stats()
        assert stats.totals.acked == len(claimed)
        assert stats.ready + stats.handed_out == 9 - len(claimed)
    finally:
        await store.close()
        await proxy.close()


async def test_on_a_slow_link_a_dozen_enqueues_go_side_by_side(dsn: str) -> None:
    """20 ms each way: each producer waiting for its answer has its batch in a group in flight, so
    the enqueues side by side bound the rate (in flight / round trip). A dozen go at once, on the
    store's own pool, each its own transaction; none waits for another's round trip."""
    from bench.delayproxy import DelayProxy

    parts = urllib.parse.urlsplit(dsn)
    proxy = DelayProxy((parts.hostname or "127.0.0.1", parts.port or 5432), 0.02)
    port = await proxy.start()
    user = parts.netloc.rpartition("@")[0]
    slow = urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{port}"))
    store = await PostgresStore.open(slow, backoff(), random.Random(1))
    try:
        await enqueue_one(store, b"0", max_attempts=3, delay=0.0, now=NOW)  # (slow: seen)
        batches = [[NewTask(b"%d" % (10 * i + j), 3, 0.0) for j in range(10)] for i in range(12)]
        done = await asyncio.gather(*(store.enqueue_many(b, now=NOW) for b in batches))
        assert store._enqueues.most_in_flight == 12
        assert len({e.id for answer in done for e in answer}) == 120
        assert (await store.stats()).ready == 121
    finally:
        await store.close()
        await proxy.close()


async def test_a_standby_promoted_behind_the_old_primary_never_hands_out_an_id_again(
    dsn: str,
) -> None:
    """Under asynchronous replication a promoted standby may not have had the last blocks of ids
    the old primary reserved. A store opened after the switch, and one that saw the database go
    away and come back, move the sequence ahead before reserving: no id is given twice."""
    old = await PostgresStore.open(dsn, backoff(1), random.Random(1))
    try:
        batch = [NewTask(b"1", 1, 0.0) for _ in range(3000)]  # (three blocks)
        before = {e.id for e in await old.enqueue_many(batch, now=NOW)}
        conn = await asyncpg.connect(dsn)
        try:  # the promoted standby had not had the last three reservations
            await conn.execute(
                "SELECT setval('wq.id_blocks', last_value - 2, false) FROM wq.id_blocks"
            )
        finally:
            await conn.close()
        new = await PostgresStore.open(dsn, backoff(2), random.Random(2))
        try:
            after = {e.id for e in await new.enqueue_many(batch, now=NOW)}
        finally:
            await new.close()
        # The store that was open through the switch: the database away, then back.
        old._pool.unreachable("the primary is gone")
        await old._pool.recovered()
        again = {e.id for e in await old.enqueue_many(batch, now=NOW)}
        assert len(before | after | again) == 9000
        assert (await old.stats()).ready == 9000
    finally:
        await old.close()


async def test_ids_are_reserved_ahead_so_the_next_group_waits_for_no_reservation(
    dsn: str,
) -> None:
    """Every reservation of ids is a round trip before the enqueue's own: on a distant database,
    a second one per group. The store reserves ahead, and tops up beside the calls, so a group
    like the last finds its ids already reserved."""
    store = await PostgresStore.open(dsn, backoff(1), random.Random(1))
    reservations: list[str] = []
    fetch = store._fetch

    async def counted(sql: str, *args: Any) -> Any:
        if sql == Q.id_blocks and asyncio.current_task() not in store._side_tasks:
            reservations.append(sql)  # (one on a call's way, not a top-up beside the calls)
        return await fetch(sql, *args)

    store._fetch = counted  # type: ignore[method-assign]
    try:
        batch = [NewTask(b"1", 1, 0.0) for _ in range(3000)]  # (three blocks)
        seen: set[str] = set()
        for i in range(5):
            await asyncio.gather(*store._side_tasks)  # (a top-up under way ends)
            before = len(reservations)
            seen |= {e.id for e in await store.enqueue_many(batch, now=NOW)}
            if i:
                assert len(reservations) == before
        assert len(seen) == 15_000
        assert reservations == [Q.id_blocks]  # (the first group's)
    finally:
        await store.close()


async def test_groups_side_by_side_find_their_ids_reserved_once_the_store_kept_enough_ahead(
    dsn: str,
) -> None:
    """On a distant database several groups are in flight at once, and take ids while a top-up
    is under way: as many again as one group needs is too few. Each time a group finds too few
    ids, the store keeps twice as many ahead, until the groups of a round find theirs reserved."""
    store = await PostgresStore.open(dsn, backoff(1), random.Random(1))
    reservations: list[str] = []
    fetch = store._fetch

    async def counted(sql: str, *args: Any) -> Any:
        if sql == Q.id_blocks and asyncio.current_task() not in store._side_tasks:
            reservations.append(sql)  # (one on a group's way, not a top-up beside the groups)
        return await fetch(sql, *args)

    store._fetch = counted  # type: ignore[method-assign]
    try:
        batch = [NewTask(b"1", 1, 0.0) for _ in range(1000)]
        seen: set[str] = set()
        on_the_way: list[int] = []
        for _ in range(8):
            await asyncio.gather(*store._side_tasks)  # (a top-up under way ends)
            before = len(reservations)
            # Four groups side by side (as the group commit sends them to a distant database).
            for out in await asyncio.gather(*(store._enqueue(batch, NOW) for _ in range(4))):
                seen |= {e.id for e in out}
            on_the_way.append(len(reservations) - before)
        assert len(seen) == 32_000
        assert on_the_way[0] >= 1, on_the_way
        assert on_the_way[-4:] == [0, 0, 0, 0], on_the_way
        assert (await store.stats()).ready == 32_000
    finally:
        await store.close()
