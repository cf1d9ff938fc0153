"""The store contract, checked against every backend.

Everything here goes through the async contract methods only (enqueue, enqueue_many, claim,
claim_many, ack, nack, reclaim, release, sweep, stats, dead, requeue), with an explicit ``now``, so
a durable backend added to ``BACKENDS`` in helpers.py is held to exactly the same rules. After every
operation the gauges and every lifetime counter are checked, and so is
``nacked + reclaimed == retried + buried``.

The last section (clearly marked) checks the memory backend's internal structures; it builds its
own MemoryStore and is not part of the contract.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from wqbroker.errors import LeaseLost, NotFound
from wqbroker.models import (
    DEFAULT_QUEUE,
    Delivery,
    Enqueued,
    Failure,
    NackItem,
    NewTask,
    QueueStats,
    Stats,
    Task,
    TaskState,
    Totals,
)
from wqbroker.retry import Backoff
from wqbroker.store import ReadyListener, Store, enqueue_one
from wqbroker.store.memory import MemoryStore

NOW = 1_000_000.0
PAYLOAD = b'{"line": "hello", "n": [1, 2.5, null, "\\u00e9"]}'
LEASE = 30.0

TOTALS = (
    "enqueued",
    "delivered",
    "acked",
    "nacked",
    "reclaimed",
    "retried",
    "buried",
    "requeued",
    "purged",
    "cancelled",
    "expired",
)


async def expect(
    store: Store,
    *,
    ready: int = 0,
    handed_out: int = 0,
    delayed: int = 0,
    dead: int = 0,
    waiting: int = 0,
    succeeded: int = 0,
    **totals: int,
) -> Stats:
    """Assert every gauge and every counter (gauges and counters not named must be 0) and the
    invariant (``waiting`` among the gauges; ``succeeded``, results held, is not: those tasks
    were acked)."""
    unknown = set(totals) - set(TOTALS)
    assert not unknown, unknown
    stats = await store.stats()
    gauges = (stats.ready, stats.handed_out, stats.delayed, stats.dead, stats.waiting)
    assert gauges == (ready, handed_out, delayed, dead, waiting), stats
    assert stats.succeeded == succeeded, stats
    assert stats.totals == Totals(**{name: totals.get(name, 0) for name in TOTALS}), stats
    t = stats.totals
    assert t.nacked + t.reclaimed == t.retried + t.buried, stats
    held = sum(gauges)
    assert held == t.enqueued - t.acked - t.purged - t.cancelled - t.expired, stats
    return stats


async def enqueue(store: Store, payload: bytes = PAYLOAD, **kw: Any) -> str:
    kw.setdefault("max_attempts", 3)
    kw.setdefault("delay", 0.0)
    kw.setdefault("now", NOW)
    return (await enqueue_one(store, payload, **kw)).id


def tasks_of(done: list[Enqueued]) -> list[Task]:
    """The new tasks of an enqueue_many (none of which may be a duplicate)."""
    out = []
    for enqueued in done:
        assert not enqueued.duplicate
        assert enqueued.task is not None
        out.append(enqueued.task)
    return out


async def claim(store: Store, now: float = NOW, lease: float = LEASE) -> Delivery:
    delivery = await store.claim(lease=lease, now=now)
    assert delivery is not None
    return delivery


def nominal(attempts: int) -> float:
    return min(30.0, 2.0 ** (attempts - 1))


def assert_backoff(failure: Failure, attempts: int, now: float) -> float:
    assert not failure.buried
    assert failure.retry_at is not None
    wait = failure.retry_at - now
    assert nominal(attempts) / 2 <= wait <= nominal(attempts), (attempts, wait)
    return failure.retry_at


async def bury(store: Store, task_id: str, error: str | None, now: float = NOW) -> None:
    """Claim ``task_id`` (a task with max_attempts=1 at the head of ready) and nack it to death."""
    d = await claim(store, now)
    assert d.task.id == task_id
    failure = await store.nack(d.task.id, d.lease_id, error, now=now)
    assert failure == Failure(task_id, True, None)


# -- enqueue ----------------------------------------------------------------------------------


async def test_only_a_shared_store_tells_of_tasks_made_ready_elsewhere(store: Store) -> None:
    # A store other brokers share is told of their tasks (on_ready); one this broker alone
    # changes has nothing to tell and no on_ready to call.
    assert isinstance(store, ReadyListener) == store.shared


async def test_enqueue_puts_the_task_in_ready(store: Store) -> None:
    await expect(store)
    done = await enqueue_one(store, PAYLOAD, max_attempts=4, delay=0.0, now=NOW)
    assert not done.duplicate
    view = done.task
    assert view is not None
    assert view.id == done.id
    assert view.queue == DEFAULT_QUEUE
    assert view.priority == 0
    assert view.payload == PAYLOAD
    assert view.attempts == 0
    assert view.max_attempts == 4
    assert view.created_at == NOW
    assert view.available_at == NOW
    assert view.last_error is None
    await expect(store, ready=1, enqueued=1)


async def test_task_ids_are_unique(store: Store) -> None:
    ids = [await enqueue(store) for _ in range(300)]
    assert len(set(ids)) == 300
    assert all(isinstance(i, str) and i for i in ids)
    await expect(store, ready=300, enqueued=300)


async def test_payload_bytes_come_back_verbatim(store: Store) -> None:
    odd = b'{ "a" : 1e3,\n "b":"\\ud83d\\ude00", "c": {"x": []} }'
    await enqueue(store, odd)
    d = await claim(store)
    assert d.task.payload == odd


async def test_delayed_enqueue_goes_to_delayed(store: Store) -> None:
    view = (await enqueue_one(store, PAYLOAD, max_attempts=3, delay=5.0, now=NOW)).task
    assert view is not None
    assert view.available_at == NOW + 5.0
    assert view.created_at == NOW
    await expect(store, delayed=1, enqueued=1)


async def test_a_delayed_task_is_not_claimable_before_its_time(store: Store) -> None:
    await enqueue(store, delay=5.0)
    assert await store.claim(lease=LEASE, now=NOW) is None
    assert await store.claim(lease=LEASE, now=NOW + 4.5) is None
    await expect(store, delayed=1, enqueued=1)


@pytest.mark.parametrize("at", [5.0, 5.5, 3600.0])
async def test_claim_promotes_a_due_delayed_task(store: Store, at: float) -> None:
    task_id = await enqueue(store, delay=5.0)
    d = await claim(store, NOW + at)  # no sweep in between: claim promotes it itself
    assert d.task.id == task_id
    assert d.task.attempts == 1
    assert d.task.available_at == NOW + 5.0
    assert d.deadline == NOW + at + LEASE
    await expect(store, handed_out=1, enqueued=1, delivered=1)


async def test_claim_promotes_due_delayed_tasks_in_order_of_their_time(store: Store) -> None:
    late = await enqueue(store, delay=3.0)
    early = await enqueue(store, delay=1.0)
    middle = await enqueue(store, delay=2.0)
    not_yet = await enqueue(store, delay=10.0)
    got = [(await claim(store, NOW + 5.0)).task.id for _ in range(3)]
    assert got == [early, middle, late]
    assert await store.claim(lease=LEASE, now=NOW + 5.0) is None
    await expect(store, handed_out=3, delayed=1, enqueued=4, delivered=3)
    assert (await claim(store, NOW + 10.0)).task.id == not_yet


async def test_zero_delay_is_ready_at_once(store: Store) -> None:
    await enqueue(store, delay=0.0)
    await expect(store, ready=1, enqueued=1)
    assert (await claim(store)).task.attempts == 1


async def test_enqueue_many_accepts_tasks_in_order(store: Store) -> None:
    before = await enqueue(store)
    done = await store.enqueue_many(
        [NewTask(b'{"n": 1}', 3, 0.0), NewTask(b'{"n": 2}', 1, 2.0), NewTask(b'{"n": 3}', 5, 0.0)],
        now=NOW + 1,
    )
    views = tasks_of(done)
    assert [v.payload for v in views] == [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}']
    assert [v.max_attempts for v in views] == [3, 1, 5]
    assert [v.available_at for v in views] == [NOW + 1, NOW + 3, NOW + 1]
    assert all(v.attempts == 0 and v.created_at == NOW + 1 for v in views)
    assert len({before, *(v.id for v in views)}) == 4
    await expect(store, ready=3, delayed=1, enqueued=4)
    # to the tail of ready, in the order given; the delayed one when its time comes
    got = [(await claim(store, NOW + 1)).task.id for _ in range(3)]
    assert got == [before, views[0].id, views[2].id]
    assert (await claim(store, NOW + 3)).task.id == views[1].id
    await expect(store, handed_out=4, enqueued=4, delivered=4)


async def test_enqueue_many_of_nothing_changes_nothing(store: Store) -> None:
    assert await store.enqueue_many([], now=NOW) == []
    await expect(store)


# -- claim ------------------------------------------------------------------------------------


async def test_claim_on_an_empty_store_returns_none(store: Store) -> None:
    assert await store.claim(lease=LEASE, now=NOW) is None
    await expect(store)


async def test_claim_hands_out_under_a_lease(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=5)
    d = await store.claim(lease=12.5, now=NOW + 1.0)
    assert d is not None
    assert d.task.id == task_id
    assert d.task.payload == PAYLOAD
    assert d.task.attempts == 1
    assert d.task.max_attempts == 5
    assert d.task.created_at == NOW
    assert d.deadline == NOW + 1.0 + 12.5
    assert isinstance(d.lease_id, str)
    assert d.lease_id
    await expect(store, handed_out=1, enqueued=1, delivered=1)
    assert await store.claim(lease=LEASE, now=NOW + 1.0) is None
    await expect(store, handed_out=1, enqueued=1, delivered=1)


async def test_claim_is_fifo_oldest_first(store: Store) -> None:
    ids = [await enqueue(store, now=NOW + i) for i in range(10)]
    got = [(await claim(store, NOW + 20)).task.id for _ in range(10)]
    assert got == ids
    await expect(store, handed_out=10, enqueued=10, delivered=10)


async def test_every_claim_gets_a_fresh_lease(store: Store) -> None:
    for _ in range(20):
        await enqueue(store, max_attempts=100)
    leases = [(await claim(store)).lease_id for _ in range(20)]
    # the same task handed out again and again: release, nack+retry, reclaim+retry
    now = NOW
    task_id = await enqueue(store, max_attempts=100)
    for _ in range(10):
        d = await claim(store, now)
        assert d.task.id == task_id
        leases.append(d.lease_id)
        assert await store.release(d.task.id, d.lease_id, now=now)
    for _ in range(5):
        d = await claim(store, now)
        leases.append(d.lease_id)
        failure = await store.nack(d.task.id, d.lease_id, "again", now=now)
        assert failure.retry_at is not None
        now = failure.retry_at
    assert len(set(leases)) == len(leases)


async def test_claim_many_hands_out_the_oldest_tasks_each_under_its_own_lease(
    store: Store,
) -> None:
    ids = [await enqueue(store, now=NOW + i) for i in range(3)]
    got = await store.claim_many([10.0, 20.0], now=NOW + 5)
    assert [d.task.id for d in got] == ids[:2]
    assert [d.deadline for d in got] == [NOW + 15.0, NOW + 25.0]
    assert [d.task.attempts for d in got] == [1, 1]
    assert got[0].lease_id != got[1].lease_id
    await expect(store, ready=1, handed_out=2, enqueued=3, delivered=2)
    # fewer ready than asked for: what there is
    rest = await store.claim_many([1.0, 2.0, 3.0], now=NOW + 5)
    assert [(d.task.id, d.deadline) for d in rest] == [(ids[2], NOW + 6.0)]
    assert await store.claim_many([1.0], now=NOW + 5) == []
    assert await store.claim_many([], now=NOW + 5) == []
    await expect(store, handed_out=3, enqueued=3, delivered=3)
    for d in [*got, *rest]:
        await store.ack(d.task.id, d.lease_id, now=NOW + 5)
    await expect(store, enqueued=3, delivered=3, acked=3)


async def test_claim_many_promotes_due_delayed_tasks(store: Store) -> None:
    later = await enqueue(store, delay=2.0)
    sooner = await enqueue(store, delay=1.0)
    assert await store.claim_many([LEASE, LEASE], now=NOW + 0.5) == []
    got = await store.claim_many([LEASE, LEASE, LEASE], now=NOW + 2.0)
    assert [d.task.id for d in got] == [sooner, later]
    await expect(store, handed_out=2, enqueued=2, delivered=2)


async def test_attempts_count_deliveries(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=5)
    now = NOW
    for n in range(1, 5):
        d = await claim(store, now)
        assert (d.task.id, d.task.attempts) == (task_id, n)
        failure = await store.nack(d.task.id, d.lease_id, None, now=now)
        now = assert_backoff(failure, n, now)
    d = await claim(store, now)
    assert d.task.attempts == 5
    await expect(store, handed_out=1, enqueued=1, delivered=5, nacked=4, retried=4)


# -- ack --------------------------------------------------------------------------------------


async def test_ack_forgets_the_task(store: Store) -> None:
    task_id = await enqueue(store)
    d = await claim(store)
    await store.ack(task_id, d.lease_id, now=NOW + 1)
    await expect(store, enqueued=1, delivered=1, acked=1)
    assert await store.claim(lease=LEASE, now=NOW + 100) is None
    assert await store.dead_letters() == []
    with pytest.raises(NotFound):
        await store.ack(task_id, d.lease_id, now=NOW + 1)
    with pytest.raises(NotFound):
        await store.nack(task_id, d.lease_id, "late", now=NOW + 1)
    with pytest.raises(NotFound):
        await store.requeue(task_id, now=NOW + 1)
    assert await store.release(task_id, d.lease_id, now=NOW) is False
    result, next_due = await store.sweep(now=NOW + 1000)
    assert result.reclaimed == []
    assert result.promoted == 0
    assert next_due is None
    await expect(store, enqueued=1, delivered=1, acked=1)


async def test_ack_only_touches_its_own_task(store: Store) -> None:
    a, b = await enqueue(store), await enqueue(store)
    da, db = await claim(store), await claim(store)
    await store.ack(a, da.lease_id, now=NOW)
    await expect(store, handed_out=1, enqueued=2, delivered=2, acked=1)
    await store.ack(b, db.lease_id, now=NOW)
    await expect(store, enqueued=2, delivered=2, acked=2)


@pytest.mark.parametrize("op", ["ack", "nack", "reclaim"])
async def test_wrong_lease_on_a_held_task_is_a_lease_mismatch(store: Store, op: str) -> None:
    task_id = await enqueue(store)
    d = await claim(store)
    with pytest.raises(LeaseLost):
        await finish(store, op, task_id, "not-the-lease")
    # nothing moved, and the real lease still works
    await expect(store, handed_out=1, enqueued=1, delivered=1)
    await store.ack(task_id, d.lease_id, now=NOW)
    await expect(store, enqueued=1, delivered=1, acked=1)


async def finish(store: Store, op: str, task_id: str, lease_id: str, now: float = NOW) -> Any:
    if op == "ack":
        return await store.ack(task_id, lease_id, now=now)
    if op == "nack":
        return await store.nack(task_id, lease_id, "err", now=now)
    return await store.reclaim(task_id, lease_id, "err", now=now)


async def _unheld(store: Store, situation: str) -> tuple[str, str, dict[str, int]]:
    """A task nobody holds, a lease id to try on it, and the stats expected to stay put."""
    if situation == "unknown id":
        await enqueue(store)
        return "no-such-task", "no-such-lease", dict(ready=1, enqueued=1)
    if situation == "ready":
        task_id = await enqueue(store)
        return task_id, "some-lease", dict(ready=1, enqueued=1)
    if situation == "delayed":
        task_id = await enqueue(store, delay=60.0)
        return task_id, "some-lease", dict(delayed=1, enqueued=1)
    if situation == "acked":
        task_id = await enqueue(store)
        d = await claim(store)
        await store.ack(task_id, d.lease_id, now=NOW)
        return task_id, d.lease_id, dict(enqueued=1, delivered=1, acked=1)
    if situation == "dead":
        task_id = await enqueue(store, max_attempts=1)
        d = await claim(store)
        await store.nack(task_id, d.lease_id, "x", now=NOW)
        return task_id, d.lease_id, dict(dead=1, enqueued=1, delivered=1, nacked=1, buried=1)
    if situation == "nacked, waiting to retry":
        task_id = await enqueue(store)
        d = await claim(store)
        await store.nack(task_id, d.lease_id, "x", now=NOW)
        return task_id, d.lease_id, dict(delayed=1, enqueued=1, delivered=1, nacked=1, retried=1)
    if situation == "reclaimed by sweep":
        task_id = await enqueue(store)
        d = await claim(store, lease=5.0)
        result, _ = await store.sweep(now=NOW + 5.0)
        assert result.reclaimed == [(task_id, d.lease_id)]
        return task_id, d.lease_id, dict(delayed=1, enqueued=1, delivered=1, reclaimed=1, retried=1)
    if situation == "reclaimed":
        task_id = await enqueue(store)
        d = await claim(store)
        await store.reclaim(task_id, d.lease_id, "gone", now=NOW)
        return task_id, d.lease_id, dict(delayed=1, enqueued=1, delivered=1, reclaimed=1, retried=1)
    assert situation == "released"
    task_id = await enqueue(store)
    d = await claim(store)
    assert await store.release(task_id, d.lease_id, now=NOW)
    return task_id, d.lease_id, dict(ready=1, enqueued=1)


UNHELD = [
    "unknown id",
    "ready",
    "delayed",
    "acked",
    "dead",
    "nacked, waiting to retry",
    "reclaimed by sweep",
    "reclaimed",
    "released",
]


@pytest.mark.parametrize("situation", UNHELD)
@pytest.mark.parametrize("op", ["ack", "nack", "reclaim"])
async def test_finishing_a_task_nobody_holds_is_not_found(
    store: Store, op: str, situation: str
) -> None:
    task_id, lease_id, unchanged = await _unheld(store, situation)
    with pytest.raises(NotFound):
        await finish(store, op, task_id, lease_id)
    await expect(store, **unchanged)


@pytest.mark.parametrize("situation", UNHELD)
async def test_release_of_a_task_nobody_holds_is_false(store: Store, situation: str) -> None:
    task_id, lease_id, unchanged = await _unheld(store, situation)
    assert await store.release(task_id, lease_id, now=NOW) is False
    await expect(store, **unchanged)


@pytest.mark.parametrize("op", ["ack", "nack", "reclaim"])
async def test_a_stale_lease_on_a_task_handed_out_again_is_a_lease_mismatch(
    store: Store, op: str
) -> None:
    task_id = await enqueue(store)
    old = await claim(store, lease=5.0)
    result, _ = await store.sweep(now=NOW + 5.0)  # the worker went silent
    assert result.reclaimed == [(task_id, old.lease_id)]
    new = await claim(store, NOW + 10.0)  # backoff after attempt 1 is at most 1 s
    assert new.task.id == task_id
    assert new.task.attempts == 2
    assert new.lease_id != old.lease_id
    with pytest.raises(LeaseLost):
        await finish(store, op, task_id, old.lease_id, NOW + 10.0)
    assert await store.release(task_id, old.lease_id, now=NOW) is False
    stats = dict(enqueued=1, delivered=2, reclaimed=1, retried=1)
    await expect(store, handed_out=1, **stats)
    await store.ack(task_id, new.lease_id, now=NOW + 10.0)
    await expect(store, **stats, acked=1)


# -- nack -------------------------------------------------------------------------------------


async def test_nack_with_attempts_left_delays_the_task(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=2)
    d = await claim(store, NOW)
    failure = await store.nack(task_id, d.lease_id, "boom", now=NOW + 2.0)
    assert failure.task_id == task_id
    retry_at = assert_backoff(failure, 1, NOW + 2.0)
    await expect(store, delayed=1, enqueued=1, delivered=1, nacked=1, retried=1)
    # not claimable before its time, even by a sweep
    assert await store.claim(lease=LEASE, now=retry_at - 0.01) is None
    result, next_due = await store.sweep(now=retry_at - 0.01)
    assert result.promoted == 0
    assert result.reclaimed == []
    assert next_due == retry_at
    await expect(store, delayed=1, enqueued=1, delivered=1, nacked=1, retried=1)
    d2 = await claim(store, retry_at)
    assert d2.task.id == task_id
    assert d2.task.attempts == 2
    assert d2.task.available_at == retry_at
    assert d2.task.last_error == "boom"
    await expect(store, handed_out=1, enqueued=1, delivered=2, nacked=1, retried=1)


async def test_backoff_grows_1_2_4_8_16_then_caps_at_30_seconds(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=12)
    now = NOW
    for attempts in range(1, 12):
        d = await claim(store, now)
        assert (d.task.id, d.task.attempts) == (task_id, attempts)
        failure = await store.nack(task_id, d.lease_id, f"fail {attempts}", now=now)
        now = assert_backoff(failure, attempts, now)
    d = await claim(store, now)
    failure = await store.nack(task_id, d.lease_id, "last", now=now)
    assert failure == Failure(task_id, True, None)
    await expect(store, dead=1, enqueued=1, delivered=12, nacked=12, retried=11, buried=1)


async def test_backoff_is_jittered_across_tasks(store: Store) -> None:
    ids = [await enqueue(store) for _ in range(20)]
    retry_at = []
    for _ in ids:
        d = await claim(store)
        failure = await store.nack(d.task.id, d.lease_id, None, now=NOW)
        retry_at.append(assert_backoff(failure, 1, NOW))
    assert len(set(retry_at)) > 1  # tasks that failed together don't all retry together
    await expect(store, delayed=20, enqueued=20, delivered=20, nacked=20, retried=20)


async def test_nack_with_no_attempts_left_buries_the_task(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=1)
    d = await claim(store)
    failure = await store.nack(task_id, d.lease_id, "out of luck", now=NOW + 1)
    assert failure == Failure(task_id, True, None)
    await expect(store, dead=1, enqueued=1, delivered=1, nacked=1, buried=1)
    [view] = await store.dead_letters()
    assert view.id == task_id
    assert view.last_error == "out of luck"
    assert view.attempts == 1
    assert view.max_attempts == 1
    assert view.payload == PAYLOAD
    # the dead are not handed out and nothing is scheduled for them
    assert await store.claim(lease=LEASE, now=NOW + 10_000) is None
    result, next_due = await store.sweep(now=NOW + 10_000)
    assert (result.reclaimed, result.promoted, next_due) == ([], 0, None)


async def test_nack_without_an_error_records_none(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=2)
    d = await claim(store)
    failure = await store.nack(task_id, d.lease_id, "first", now=NOW)
    assert failure.retry_at is not None
    d = await claim(store, failure.retry_at)
    assert d.task.last_error == "first"
    await store.nack(task_id, d.lease_id, None, now=failure.retry_at)
    [view] = await store.dead_letters()
    assert view.last_error is None


async def test_the_last_failure_wins_as_last_error(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=3)
    now = NOW
    for error in ["one", "two"]:
        d = await claim(store, now)
        failure = await store.nack(task_id, d.lease_id, error, now=now)
        assert failure.retry_at is not None
        now = failure.retry_at
    d = await claim(store, now)
    assert d.task.last_error == "two"
    await store.reclaim(task_id, d.lease_id, "three", now=now)
    [view] = await store.dead_letters()
    assert (view.attempts, view.last_error) == (3, "three")
    await expect(store, dead=1, enqueued=1, delivered=3, nacked=2, reclaimed=1, retried=2, buried=1)


# -- sweep ------------------------------------------------------------------------------------


async def test_sweep_with_nothing_scheduled(store: Store) -> None:
    result, next_due = await store.sweep(now=NOW)
    assert (result.reclaimed, result.promoted, next_due) == ([], 0, None)
    await enqueue(store)
    result, next_due = await store.sweep(now=NOW)
    assert (result.reclaimed, result.promoted, next_due) == ([], 0, None)
    await expect(store, ready=1, enqueued=1)


async def test_sweep_reclaims_a_lease_once_its_deadline_is_reached(store: Store) -> None:
    task_id = await enqueue(store)
    d = await claim(store, lease=10.0)
    result, next_due = await store.sweep(now=NOW + 9.5)
    assert (result.reclaimed, result.promoted) == ([], 0)
    assert next_due == d.deadline == NOW + 10.0
    await expect(store, handed_out=1, enqueued=1, delivered=1)

    result, next_due = await store.sweep(now=NOW + 10.0)  # deadline <= now
    assert result.reclaimed == [(task_id, d.lease_id)]
    assert result.promoted == 0
    await expect(store, delayed=1, enqueued=1, delivered=1, reclaimed=1, retried=1)
    assert next_due is not None
    assert NOW + 10.5 <= next_due <= NOW + 11.0  # the retry, after a 0.5-1 s backoff

    with pytest.raises(NotFound):  # the silent worker comes back too late
        await store.ack(task_id, d.lease_id, now=NOW + 10.0)

    result, after = await store.sweep(now=next_due)
    assert (result.reclaimed, result.promoted, after) == ([], 1, None)
    await expect(store, ready=1, enqueued=1, delivered=1, reclaimed=1, retried=1)
    d2 = await claim(store, next_due)
    assert (d2.task.id, d2.task.attempts, d2.task.last_error) == (task_id, 2, "lease expired")


async def test_sweep_buries_an_expired_task_with_no_attempts_left(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=1)
    d = await claim(store, lease=1.0)
    result, next_due = await store.sweep(now=NOW + 3.0)
    assert result.reclaimed == [(task_id, d.lease_id)]
    assert next_due is None
    await expect(store, dead=1, enqueued=1, delivered=1, reclaimed=1, buried=1)
    [view] = await store.dead_letters()
    assert (view.id, view.last_error, view.attempts) == (task_id, "lease expired", 1)


async def test_sweep_reclaims_only_what_is_due(store: Store) -> None:
    ids = [await enqueue(store, max_attempts=1) for _ in range(4)]
    leases = [await claim(store, lease=float(n)) for n in (1, 2, 3, 4)]
    result, next_due = await store.sweep(now=NOW + 2.0)
    assert sorted(result.reclaimed) == sorted(
        [(ids[0], leases[0].lease_id), (ids[1], leases[1].lease_id)]
    )
    assert next_due == NOW + 3.0
    await expect(store, handed_out=2, dead=2, enqueued=4, delivered=4, reclaimed=2, buried=2)
    # an acked lease is neither reclaimed nor reported as due
    await store.ack(ids[2], leases[2].lease_id, now=NOW + 2.0)
    result, next_due = await store.sweep(now=NOW + 2.0)
    assert (result.reclaimed, next_due) == ([], NOW + 4.0)
    result, next_due = await store.sweep(now=NOW + 100.0)
    assert result.reclaimed == [(ids[3], leases[3].lease_id)]
    assert next_due is None
    await expect(store, dead=3, enqueued=4, delivered=4, acked=1, reclaimed=3, buried=3)


async def test_sweep_promotes_due_delayed_tasks(store: Store) -> None:
    a = await enqueue(store, delay=1.0)
    b = await enqueue(store, delay=2.0)
    c = await enqueue(store, delay=7.0)
    result, next_due = await store.sweep(now=NOW + 0.5)
    assert (result.promoted, next_due) == (0, NOW + 1.0)
    result, next_due = await store.sweep(now=NOW + 2.0)
    assert (result.reclaimed, result.promoted, next_due) == ([], 2, NOW + 7.0)
    await expect(store, ready=2, delayed=1, enqueued=3)
    assert [(await claim(store, NOW + 2.0)).task.id for _ in range(2)] == [a, b]
    result, next_due = await store.sweep(now=NOW + 7.0)
    assert result.promoted == 1
    assert next_due == NOW + 2.0 + LEASE  # the two leases are what is due next
    assert (await claim(store, NOW + 7.0)).task.id == c


async def test_sweep_reports_the_earliest_of_leases_and_delayed(store: Store) -> None:
    await enqueue(store)
    await claim(store, lease=10.0)
    await enqueue(store, delay=5.0)
    _, next_due = await store.sweep(now=NOW)
    assert next_due == NOW + 5.0
    await enqueue(store, delay=2.0)
    _, next_due = await store.sweep(now=NOW)
    assert next_due == NOW + 2.0
    result, next_due = await store.sweep(now=NOW + 6.0)
    assert result.promoted == 2
    assert next_due == NOW + 10.0
    await expect(store, ready=2, handed_out=1, enqueued=3, delivered=1)


async def test_an_expired_lease_not_yet_swept_can_still_be_acked(store: Store) -> None:
    # Reclaiming is the sweeper's job; until it runs, the holder's lease is still current.
    task_id = await enqueue(store)
    d = await claim(store, lease=1.0)
    await store.ack(task_id, d.lease_id, now=NOW + 5.0)
    result, _ = await store.sweep(now=NOW + 5.0)
    assert result.reclaimed == []
    await expect(store, enqueued=1, delivered=1, acked=1)


# -- reclaim ----------------------------------------------------------------------------------


async def test_reclaim_takes_a_task_back_before_its_lease_runs_out(store: Store) -> None:
    task_id = await enqueue(store)
    d = await claim(store, lease=300.0)
    failure = await store.reclaim(task_id, d.lease_id, "worker stream ended", now=NOW + 1.0)
    assert failure.task_id == task_id
    retry_at = assert_backoff(failure, 1, NOW + 1.0)
    await expect(store, delayed=1, enqueued=1, delivered=1, reclaimed=1, retried=1)
    # its old deadline is no longer due anything
    result, next_due = await store.sweep(now=retry_at)
    assert (result.reclaimed, result.promoted, next_due) == ([], 1, None)
    d2 = await claim(store, retry_at)
    assert (d2.task.attempts, d2.task.last_error) == (2, "worker stream ended")


async def test_reclaim_buries_when_no_attempts_are_left(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=1)
    d = await claim(store)
    failure = await store.reclaim(task_id, d.lease_id, "worker gone", now=NOW)
    assert failure == Failure(task_id, True, None)
    await expect(store, dead=1, enqueued=1, delivered=1, reclaimed=1, buried=1)
    [view] = await store.dead_letters()
    assert view.last_error == "worker gone"


# -- release ----------------------------------------------------------------------------------


async def test_release_puts_the_task_back_at_the_head_of_ready(store: Store) -> None:
    a, b, c = [await enqueue(store, now=NOW + i) for i in range(3)]
    da = await claim(store, NOW + 5)
    assert da.task.id == a
    await expect(store, ready=2, handed_out=1, enqueued=3, delivered=1)
    assert await store.release(a, da.lease_id, now=NOW) is True
    await expect(store, ready=3, enqueued=3)
    again = await claim(store, NOW + 5)
    assert again.task.id == a
    assert again.task.attempts == 1  # the undone hand-out did not burn an attempt
    assert again.lease_id != da.lease_id
    assert [(await claim(store, NOW + 5)).task.id for _ in range(2)] == [b, c]
    await expect(store, handed_out=3, enqueued=3, delivered=3)


async def test_release_goes_ahead_of_older_ready_tasks(store: Store) -> None:
    first = await enqueue(store, now=NOW)
    second = await enqueue(store, now=NOW + 1)
    d1 = await claim(store, NOW + 2)
    d2 = await claim(store, NOW + 2)
    third = await enqueue(store, now=NOW + 3)
    assert await store.release(second, d2.lease_id, now=NOW)
    assert await store.release(first, d1.lease_id, now=NOW)
    got = [(await claim(store, NOW + 4)).task.id for _ in range(3)]
    assert got == [first, second, third]


async def test_release_undoes_the_attempt_and_the_delivery(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=1)
    for _ in range(5):
        d = await claim(store)
        assert d.task.attempts == 1
        assert await store.release(task_id, d.lease_id, now=NOW)
    await expect(store, ready=1, enqueued=1)
    d = await claim(store)
    await store.nack(task_id, d.lease_id, "real failure", now=NOW)
    await expect(store, dead=1, enqueued=1, delivered=1, nacked=1, buried=1)


async def test_release_returns_false_for_a_stale_lease(store: Store) -> None:
    task_id = await enqueue(store)
    d = await claim(store)
    assert await store.release(task_id, "some-other-lease", now=NOW) is False
    await expect(store, handed_out=1, enqueued=1, delivered=1)
    assert await store.release(task_id, d.lease_id, now=NOW) is True
    assert await store.release(task_id, d.lease_id, now=NOW) is False  # twice
    await expect(store, ready=1, enqueued=1)
    d2 = await claim(store)
    assert await store.release(task_id, d.lease_id, now=NOW) is False  # an earlier hand-out's lease
    await expect(store, handed_out=1, enqueued=1, delivered=1)
    await store.ack(task_id, d2.lease_id, now=NOW)


async def test_a_release_after_work_began_gives_back_only_that_attempt(store: Store) -> None:
    # A worker that stops hands its task back (Service.release): after it extended the lease
    # with progress, on the task's second attempt.
    task_id = await enqueue(store, max_attempts=2)
    first = await claim(store)
    await store.nack(task_id, first.lease_id, "first failure", now=NOW, delay=0.0)
    second = await claim(store, NOW + 1)
    assert second.task.attempts == 2  # its last: a nack would bury it
    await store.extend(task_id, second.lease_id, lease=LEASE, now=NOW + 2, progress=b"50")
    assert await store.release(task_id, second.lease_id, now=NOW) is True
    held = await store.lookup(task_id)
    assert held is not None
    assert held.state == "ready"
    assert held.task.attempts == 1
    assert held.task.last_error == "first failure"  # (a release records nothing)
    assert held.task.progress is None
    await expect(store, ready=1, enqueued=1, delivered=1, nacked=1, retried=1)
    assert await store.release(task_id, second.lease_id, now=NOW) is False  # no longer current
    third = await claim(store, NOW + 3)
    assert (third.task.id, third.task.attempts) == (task_id, 2)


async def test_a_released_lease_is_no_longer_due(store: Store) -> None:
    task_id = await enqueue(store)
    d = await claim(store, lease=1.0)
    assert await store.release(task_id, d.lease_id, now=NOW)
    result, next_due = await store.sweep(now=NOW + 5.0)
    assert (result.reclaimed, next_due) == ([], None)
    await expect(store, ready=1, enqueued=1)


# -- requeue and the dead-letter queue --------------------------------------------------------


async def test_requeue_gives_a_dead_task_a_clean_start(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=2)
    now = NOW
    for error in ["e1", "e2"]:
        d = await claim(store, now)
        failure = await store.nack(task_id, d.lease_id, error, now=now)
        now = failure.retry_at if failure.retry_at is not None else now
    await expect(store, dead=1, enqueued=1, delivered=2, nacked=2, retried=1, buried=1)
    other = await enqueue(store, now=now)

    await store.requeue(task_id, now=now + 1)
    await expect(store, ready=2, enqueued=2, delivered=2, nacked=2, retried=1, buried=1, requeued=1)
    assert await store.dead_letters() == []
    # to the tail of ready
    assert (await claim(store, now + 1)).task.id == other
    d = await claim(store, now + 1)
    assert d.task.id == task_id
    assert d.task.attempts == 1
    assert d.task.last_error is None
    assert d.task.payload == PAYLOAD
    # a full fresh set of attempts: one retry, then burial
    failure = await store.nack(task_id, d.lease_id, "e3", now=now + 1)
    assert not failure.buried
    assert failure.retry_at is not None
    d = await claim(store, failure.retry_at)
    assert d.task.attempts == 2
    failure = await store.nack(task_id, d.lease_id, "e4", now=failure.retry_at)
    assert failure.buried
    await expect(
        store,
        handed_out=1,
        dead=1,
        enqueued=2,
        delivered=5,
        nacked=4,
        retried=2,
        buried=2,
        requeued=1,
    )
    [view] = await store.dead_letters()
    assert view.last_error == "e4"


@pytest.mark.parametrize("situation", [*UNHELD, "handed out"])
async def test_requeue_of_a_task_that_is_not_dead_is_not_found(
    store: Store, situation: str
) -> None:
    if situation == "handed out":
        task_id = await enqueue(store)
        await claim(store)
        unchanged = dict(handed_out=1, enqueued=1, delivered=1)
    elif situation == "dead":
        task_id, _, _ = await _unheld(store, "dead")
        await store.requeue(task_id, now=NOW)  # it is dead: this one works ...
        unchanged = dict(ready=1, enqueued=1, delivered=1, nacked=1, buried=1, requeued=1)
    else:
        task_id, _, unchanged = await _unheld(store, situation)
    with pytest.raises(NotFound):  # ... but not twice
        await store.requeue(task_id, now=NOW)
    await expect(store, **unchanged)


async def test_dead_lists_in_burial_order_and_honours_limit(store: Store) -> None:
    ids = [await enqueue(store, max_attempts=1) for _ in range(5)]
    got = [await claim(store) for _ in ids]
    for n in [3, 0, 4, 1, 2]:
        await store.nack(ids[n], got[n].lease_id, f"error {n}", now=NOW)
    order = [ids[n] for n in [3, 0, 4, 1, 2]]
    views = await store.dead_letters()
    assert [v.id for v in views] == order
    assert [v.last_error for v in views] == ["error 3", "error 0", "error 4", "error 1", "error 2"]
    assert [v.id for v in await store.dead_letters(limit=2)] == order[:2]
    assert await store.dead_letters(limit=0) == []
    assert [v.id for v in await store.dead_letters(limit=50)] == order
    await store.requeue(ids[4], now=NOW)
    assert [v.id for v in await store.dead_letters()] == [ids[3], ids[0], ids[1], ids[2]]
    await expect(store, ready=1, dead=4, enqueued=5, delivered=5, nacked=5, buried=5, requeued=1)


async def test_a_requeued_task_buried_again_goes_to_the_end(store: Store) -> None:
    a, b = await enqueue(store, max_attempts=1), await enqueue(store, max_attempts=1)
    await bury(store, a, "a1")
    await bury(store, b, "b1")
    await store.requeue(a, now=NOW)
    await bury(store, a, "a2")
    views = await store.dead_letters()
    assert [(v.id, v.last_error) for v in views] == [(b, "b1"), (a, "a2")]


# -- a longer mixed run ----------------------------------------------------------------------


async def test_a_mixed_workload_keeps_the_books_balanced(store: Store) -> None:
    rng = random.Random(99)
    now = NOW
    held: list[Delivery] = []
    for step in range(400):
        choice = rng.random()
        if choice < 0.3:
            await enqueue(store, max_attempts=rng.randint(1, 3), delay=rng.choice([0, 0, 2]))
        elif choice < 0.55:
            d = await store.claim(lease=rng.choice([1.0, 5.0]), now=now)
            if d is not None:
                held.append(d)
        elif choice < 0.7 and held:
            d = held.pop(rng.randrange(len(held)))
            try:
                await store.ack(d.task.id, d.lease_id, now=now)
            except NotFound:
                pass  # reclaimed meanwhile
        elif choice < 0.85 and held:
            d = held.pop(rng.randrange(len(held)))
            try:
                await store.nack(d.task.id, d.lease_id, f"step {step}", now=now)
            except NotFound:
                pass
        else:
            now += rng.choice([0.5, 1.0, 3.0])
            await store.sweep(now=now)
        stats = await store.stats()
        t = stats.totals
        assert t.nacked + t.reclaimed == t.retried + t.buried
        live = stats.ready + stats.handed_out + stats.delayed + stats.dead
        assert live == t.enqueued - t.acked
        assert t.delivered >= t.acked + t.nacked


# -- transactions -----------------------------------------------------------------------------


async def test_each_batch_call_is_one_transaction(store: Store) -> None:
    """A batch enqueue, a batch claim and a batch of settlements each commit once, however many
    tasks they touch (all or none)."""
    before = store.transactions
    await store.enqueue_many([NewTask(PAYLOAD, 1, 0.0)] * 100, now=NOW)
    assert store.transactions == before + 1
    deliveries = await store.claim_many([LEASE] * 100, now=NOW)
    assert len(deliveries) == 100
    assert store.transactions == before + 2
    acks = [(d.task.id, d.lease_id) for d in deliveries[:60]]
    nacks = [NackItem(d.task.id, d.lease_id, "no") for d in deliveries[60:]]
    acked, nacked = await store.settle_many(acks, nacks, now=NOW)
    assert acked == [None] * 60
    assert all(isinstance(n, Failure) and n.buried for n in nacked)
    assert store.transactions == before + 3
    await expect(store, dead=40, enqueued=100, delivered=100, acked=60, nacked=40, buried=40)


async def test_a_call_that_changes_nothing_commits_nothing(store: Store) -> None:
    before = store.transactions
    assert await store.claim_many([LEASE] * 10, now=NOW) == []
    with pytest.raises(NotFound):
        await store.ack("0123456789abcdef", "fedcba9876543210", now=NOW)
    assert await store.release("0123456789abcdef", "fedcba9876543210", now=NOW) is False
    await store.stats()
    await store.dead_letters()
    assert store.transactions == before


# == queues, priorities, extension, nack options, keys, lookup, bulk DLQ, pauses ===============


async def expect_queue(
    store: Store,
    name: str,
    *,
    ready: int = 0,
    handed_out: int = 0,
    delayed: int = 0,
    dead: int = 0,
    **totals: int,
) -> Stats:
    """As ``expect``, for one queue's stats."""
    stats = await store.stats(name)
    gauges = (stats.ready, stats.handed_out, stats.delayed, stats.dead)
    assert gauges == (ready, handed_out, delayed, dead), (name, stats)
    assert stats.totals == Totals(**{n: totals.get(n, 0) for n in TOTALS}), (name, stats)
    t = stats.totals
    assert t.nacked + t.reclaimed == t.retried + t.buried, stats
    assert sum(gauges) == t.enqueued - t.acked - t.purged, stats
    return stats


async def claim_from(
    store: Store, queues: list[str], now: float = NOW, lease: float = LEASE
) -> Delivery | None:
    return await store.claim(lease=lease, now=now, queues=queues)


async def bury_from(store: Store, queue: str, task_id: str) -> None:
    """Claim ``task_id`` (a task with max_attempts=1 at the head of ``queue``), nack it to death."""
    d = await claim_from(store, [queue])
    assert d is not None
    assert d.task.id == task_id
    assert (await store.nack(task_id, d.lease_id, "x", now=NOW)).buried


async def claimed_ids(store: Store, n: int, queues: list[str], now: float = NOW) -> list[str]:
    out = []
    for _ in range(n):
        d = await claim_from(store, queues, now)
        assert d is not None
        out.append(d.task.id)
    return out


# -- queues -----------------------------------------------------------------------------------


async def test_a_task_goes_to_its_queue_and_a_claim_takes_from_the_listed_ones(
    store: Store,
) -> None:
    a = await enqueue(store, queue="a")
    b = await enqueue(store, queue="b")
    plain = await enqueue(store)
    d = await claim(store)  # no queues named: the default queue alone
    assert (d.task.id, d.task.queue) == (plain, DEFAULT_QUEUE)
    assert await store.claim(lease=LEASE, now=NOW) is None
    # the first listed queue with a ready task wins
    db = await claim_from(store, ["b", "a"])
    assert db is not None
    assert (db.task.id, db.task.queue) == (b, "b")
    da = await claim_from(store, ["never", "b", "a"])
    assert da is not None
    assert (da.task.id, da.task.queue) == (a, "a")
    assert await claim_from(store, ["a", "b", DEFAULT_QUEUE]) is None
    await expect(store, handed_out=3, enqueued=3, delivered=3)


async def test_a_claim_prefers_its_first_queue_while_it_has_tasks(store: Store) -> None:
    firsts = [await enqueue(store, queue="first", now=NOW + i) for i in range(5)]
    seconds = [await enqueue(store, queue="second", now=NOW + i) for i in range(5)]
    got = await store.claim_many([LEASE] * 7, now=NOW + 10, queues=["first", "second"])
    assert [d.task.id for d in got] == firsts + seconds[:2]
    assert await claimed_ids(store, 3, ["second", "first"], NOW + 10) == seconds[2:]


async def test_stats_per_queue_and_for_the_whole_store(store: Store) -> None:
    a1 = await enqueue(store, queue="a", max_attempts=1)
    await enqueue(store, queue="a", delay=5.0)
    b1 = await enqueue(store, queue="b")
    await enqueue(store, queue="b")
    da = await claim_from(store, ["a"])
    db = await claim_from(store, ["b"])
    assert da is not None
    assert db is not None
    assert (da.task.id, db.task.id) == (a1, b1)
    await store.nack(a1, da.lease_id, "no", now=NOW)
    await store.ack(b1, db.lease_id, now=NOW)
    await expect_queue(store, "a", delayed=1, dead=1, enqueued=2, delivered=1, nacked=1, buried=1)
    await expect_queue(store, "b", ready=1, enqueued=2, delivered=1, acked=1)
    await expect(
        store, ready=1, delayed=1, dead=1, enqueued=4, delivered=2, acked=1, nacked=1, buried=1
    )
    assert await store.stats("never") == Stats()
    assert await store.stats(DEFAULT_QUEUE) == Stats()  # nothing went to it


async def test_queue_rows_are_every_queue_known_by_name(store: Store) -> None:
    assert await store.queues() == []
    await enqueue(store, queue="zeta")
    await enqueue(store, queue="alpha", delay=1.0)
    await enqueue(store)
    held = await claim(store)
    await store.set_paused("paused-only", True)  # pausing a queue never seen creates it
    assert await store.queues() == [
        QueueStats("alpha", 0, 0, 1, 0, False),
        QueueStats(DEFAULT_QUEUE, 0, 1, 0, 0, False),
        QueueStats("paused-only", 0, 0, 0, 0, True),
        QueueStats("zeta", 1, 0, 0, 0, False),
    ]
    await store.ack(held.task.id, held.lease_id, now=NOW)
    assert [r.name for r in await store.queues()] == ["alpha", DEFAULT_QUEUE, "paused-only", "zeta"]


async def oldest_ready(store: Store) -> dict[str, float | None]:
    """Each queue's oldest ready time, from queue_report (checked against stats and queues)."""
    reports = await store.queue_report()
    assert [r.queue for r in reports] == await store.queues()
    for r in reports:
        assert r.totals == (await store.stats(r.queue.name)).totals, r
    return {r.queue.name: r.oldest_ready for r in reports}


async def test_queue_report_has_the_oldest_ready_task_of_each_queue(store: Store) -> None:
    assert await store.queue_report() == []
    a = [await enqueue(store, queue="a", now=NOW + i) for i in range(3)]
    # Past three ready tasks an SQLite store in the tests keeps the rest cold (ids only): "b"
    # has a lane whose head is cold.
    await enqueue(store, queue="b", priority=5, now=NOW + 3)
    await enqueue(store, queue="b", now=NOW + 4)
    await enqueue(store, queue="c", delay=5.0, now=NOW)
    await enqueue(store, queue="p", now=NOW - 10)
    await store.set_paused("p", True)  # paused: its tasks still wait, and age
    assert await oldest_ready(store) == {"a": NOW, "b": NOW + 3, "c": None, "p": NOW - 10}
    first = await claim_from(store, ["a"], now=NOW + 5)
    assert first is not None
    assert first.task.id == a[0]
    await enqueue(store, queue="a", priority=9, now=NOW + 7)  # a newer head, of another lane
    assert (await oldest_ready(store))["a"] == NOW + 1
    # back to the head of its lane
    assert await store.release(first.task.id, first.lease_id, now=NOW)
    assert (await oldest_ready(store))["a"] == NOW
    for _ in range(5):  # every ready task of "a" and "b"
        d = await claim_from(store, ["a", "b"], now=NOW + 8)
        assert d is not None
        await store.ack(d.task.id, d.lease_id, now=NOW + 8)
    await store.sweep(now=NOW + 6)  # "c"'s delayed task is ready since NOW + 5
    assert await oldest_ready(store) == {"a": None, "b": NOW + 4, "c": NOW + 5, "p": NOW - 10}


async def test_a_paused_queue_takes_tasks_but_hands_none_out(store: Store) -> None:
    await store.set_paused("a", True)
    a = [await enqueue(store, queue="a", now=NOW + i) for i in range(4)]
    b = await enqueue(store, queue="b")
    await expect_queue(store, "a", ready=4, enqueued=4)
    assert await claim_from(store, ["a"]) is None
    d = await claim_from(store, ["a", "b"])  # skipped, not waited on
    assert d is not None
    assert d.task.id == b
    assert await store.claim_many([LEASE] * 3, now=NOW, queues=["a", "b"]) == []
    await store.set_paused("a", True)  # twice: no change
    assert [r.paused for r in await store.queues()] == [True, False]
    await store.set_paused("a", False)
    assert [r.paused for r in await store.queues()] == [False, False]
    assert await claimed_ids(store, 4, ["a"], NOW + 5) == a
    await expect(store, handed_out=5, enqueued=5, delivered=5)


async def test_pausing_leaves_handed_out_and_delayed_tasks_alone(store: Store) -> None:
    task_id = await enqueue(store, queue="a", max_attempts=2)
    d = await claim_from(store, ["a"])
    assert d is not None
    await store.set_paused("a", True)
    failure = await store.nack(task_id, d.lease_id, "x", now=NOW)  # settling still works
    assert failure.retry_at is not None
    result, _ = await store.sweep(now=failure.retry_at)
    assert result.promoted == 1  # promoted to ready, not handed out
    assert await claim_from(store, ["a"], failure.retry_at) is None
    await expect_queue(store, "a", ready=1, enqueued=1, delivered=1, nacked=1, retried=1)


async def test_dead_letters_of_one_queue(store: Store) -> None:
    a = await enqueue(store, queue="a", max_attempts=1)
    b = await enqueue(store, queue="b", max_attempts=1)
    a2 = await enqueue(store, queue="a", max_attempts=1)
    for task_id, queue in ((a, "a"), (b, "b"), (a2, "a")):
        d = await claim_from(store, [queue])
        assert d is not None
        assert d.task.id == task_id
        await store.nack(task_id, d.lease_id, "x", now=NOW)
    assert [v.id for v in await store.dead_letters()] == [a, b, a2]
    assert [(v.id, v.queue) for v in await store.dead_letters(queue="a")] == [(a, "a"), (a2, "a")]
    assert [v.id for v in await store.dead_letters(queue="a", limit=1)] == [a]
    assert [v.id for v in await store.dead_letters(queue="b")] == [b]
    assert await store.dead_letters(queue="never") == []


# -- priorities -------------------------------------------------------------------------------


async def test_higher_priority_first_and_oldest_first_within_one(store: Store) -> None:
    spec = [0, 9, 5, 0, 9, 5, 3, 0]
    ids = [await enqueue(store, priority=p, now=NOW + i) for i, p in enumerate(spec)]
    expected = [ids[i] for i in sorted(range(len(spec)), key=lambda i: (-spec[i], i))]
    got = [(await claim(store, NOW + 10)) for _ in ids]
    assert [d.task.id for d in got] == expected
    assert [d.task.priority for d in got] == sorted(spec, reverse=True)
    await expect(store, handed_out=8, enqueued=8, delivered=8)


async def test_priorities_are_per_queue_and_the_listed_order_comes_first(store: Store) -> None:
    low_a = await enqueue(store, queue="a", priority=0)
    high_b = await enqueue(store, queue="b", priority=9)
    # the first listed queue with a ready task wins, even over a higher priority elsewhere
    assert await claimed_ids(store, 2, ["a", "b"]) == [low_a, high_b]


async def test_a_given_back_task_returns_to_the_head_of_its_lane(store: Store) -> None:
    a, b = await enqueue(store, priority=5), await enqueue(store, priority=5, now=NOW + 1)
    low = await enqueue(store, priority=0)
    da = await claim(store, NOW + 2)
    assert da.task.id == a
    high = await enqueue(store, priority=9, now=NOW + 2)
    assert await store.release(a, da.lease_id, now=NOW)
    assert await claimed_ids(store, 4, [DEFAULT_QUEUE], NOW + 3) == [high, a, b, low]


async def test_a_retried_task_goes_to_the_tail_of_its_lane(store: Store) -> None:
    first = await enqueue(store, priority=2)
    d = await claim(store)
    failure = await store.nack(first, d.lease_id, "x", now=NOW, delay=1.0)
    second = await enqueue(store, priority=2, now=NOW + 0.5)
    low = await enqueue(store, priority=1, now=NOW + 0.5)
    assert await claimed_ids(store, 3, [DEFAULT_QUEUE], NOW + 1.0) == [second, first, low]
    assert failure.retry_at == NOW + 1.0


async def test_priority_order_holds_past_the_hot_window(store: Store) -> None:
    # More ready tasks than SQLite keeps in memory in tests (3): most of them are cold.
    lows = [await enqueue(store, priority=0, now=NOW + i) for i in range(6)]
    highs = [await enqueue(store, priority=7, now=NOW + 10 + i) for i in range(6)]
    mids = [await enqueue(store, queue="q", priority=4, now=NOW + 20 + i) for i in range(4)]
    got = await store.claim_many([LEASE] * 8, now=NOW + 30, queues=["q", DEFAULT_QUEUE])
    assert [d.task.id for d in got] == mids + highs[:4]
    assert [d.task.payload for d in got] == [PAYLOAD] * 8
    assert await claimed_ids(store, 8, [DEFAULT_QUEUE], NOW + 30) == highs[4:] + lows
    await expect(store, handed_out=16, enqueued=16, delivered=16)


# -- extending a lease ------------------------------------------------------------------------


async def test_extend_moves_the_deadline_and_the_reclaim(store: Store) -> None:
    task_id = await enqueue(store)
    d = await claim(store, lease=10.0)
    deadline = await store.extend(task_id, d.lease_id, lease=60.0, now=NOW + 5.0)
    assert deadline == NOW + 65.0
    await expect(store, handed_out=1, enqueued=1, delivered=1)  # no counter moves
    result, next_due = await store.sweep(now=NOW + 10.0)  # the old deadline: nothing due
    assert result.reclaimed == []
    assert next_due == NOW + 65.0
    result, next_due = await store.sweep(now=NOW + 64.5)
    assert result.reclaimed == []
    result, _ = await store.sweep(now=NOW + 65.0)
    assert result.reclaimed == [(task_id, d.lease_id)]
    await expect(store, delayed=1, enqueued=1, delivered=1, reclaimed=1, retried=1)


async def test_extend_can_shorten_a_lease(store: Store) -> None:
    task_id = await enqueue(store)
    d = await claim(store, lease=300.0)
    assert await store.extend(task_id, d.lease_id, lease=2.0, now=NOW + 1.0) == NOW + 3.0
    result, next_due = await store.sweep(now=NOW + 2.0)
    assert (result.reclaimed, next_due) == ([], NOW + 3.0)
    result, _ = await store.sweep(now=NOW + 3.0)
    assert result.reclaimed == [(task_id, d.lease_id)]
    result, next_due = await store.sweep(now=NOW + 300.0)  # the first deadline is stale
    assert result.reclaimed == []


async def test_extend_again_and_again_then_ack(store: Store) -> None:
    task_id = await enqueue(store)
    d = await claim(store, lease=1.0)
    now = NOW
    for _ in range(20):
        now += 0.5
        assert await store.extend(task_id, d.lease_id, lease=1.0, now=now) == now + 1.0
        result, _ = await store.sweep(now=now + 0.75)
        assert result.reclaimed == []
    await store.ack(task_id, d.lease_id, now=now)
    result, next_due = await store.sweep(now=now + 100)
    assert (result.reclaimed, next_due) == ([], None)
    await expect(store, enqueued=1, delivered=1, acked=1)


async def test_extend_with_a_wrong_lease_is_a_lease_mismatch(store: Store) -> None:
    task_id = await enqueue(store)
    d = await claim(store, lease=10.0)
    with pytest.raises(LeaseLost):
        await store.extend(task_id, "not-the-lease", lease=60.0, now=NOW)
    result, _ = await store.sweep(now=NOW + 10.0)  # the deadline did not move
    assert result.reclaimed == [(task_id, d.lease_id)]


@pytest.mark.parametrize("situation", UNHELD)
async def test_extending_a_task_nobody_holds_is_not_found(store: Store, situation: str) -> None:
    task_id, lease_id, unchanged = await _unheld(store, situation)
    with pytest.raises(NotFound):
        await store.extend(task_id, lease_id, lease=60.0, now=NOW)
    await expect(store, **unchanged)


# -- nack options -----------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [0.0, 0.25, 7.0, 3600.0])
async def test_nack_with_a_delay_retries_after_exactly_that(store: Store, delay: float) -> None:
    task_id = await enqueue(store, max_attempts=3)
    d = await claim(store)
    failure = await store.nack(task_id, d.lease_id, "later", now=NOW + 1.0, delay=delay)
    assert failure == Failure(task_id, False, NOW + 1.0 + delay)
    await expect(store, delayed=1, enqueued=1, delivered=1, nacked=1, retried=1)
    if delay:
        assert await store.claim(lease=LEASE, now=NOW + 1.0 + delay - 0.125) is None
    d = await claim(store, NOW + 1.0 + delay)
    assert (d.task.id, d.task.attempts, d.task.last_error) == (task_id, 2, "later")
    assert d.task.available_at == NOW + 1.0 + delay


async def test_nack_with_a_delay_still_buries_when_no_attempts_remain(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=2)
    d = await claim(store)
    failure = await store.nack(task_id, d.lease_id, "one", now=NOW, delay=0.5)
    d = await claim(store, NOW + 0.5)
    failure = await store.nack(task_id, d.lease_id, "two", now=NOW + 0.5, delay=0.5)
    assert failure == Failure(task_id, True, None)
    await expect(store, dead=1, enqueued=1, delivered=2, nacked=2, retried=1, buried=1)
    [view] = await store.dead_letters()
    assert (view.id, view.attempts, view.last_error) == (task_id, 2, "two")


async def test_a_terminal_nack_buries_whatever_attempts_remain(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=10, queue="q")
    d = await claim_from(store, ["q"])
    assert d is not None
    failure = await store.nack(task_id, d.lease_id, "bad input", now=NOW, terminal=True)
    assert failure == Failure(task_id, True, None)
    await expect(store, dead=1, enqueued=1, delivered=1, nacked=1, buried=1)
    await expect_queue(store, "q", dead=1, enqueued=1, delivered=1, nacked=1, buried=1)
    [view] = await store.dead_letters()
    assert (view.id, view.attempts, view.max_attempts, view.last_error) == (
        task_id,
        1,
        10,
        "bad input",
    )
    result, next_due = await store.sweep(now=NOW + 10_000)
    assert (result.reclaimed, result.promoted, next_due) == ([], 0, None)


async def test_settle_many_takes_nack_options(store: Store) -> None:
    ids = [await enqueue(store, max_attempts=3) for _ in range(4)]
    ds = await store.claim_many([LEASE] * 4, now=NOW)
    assert [d.task.id for d in ds] == ids
    nacks = [
        NackItem(ids[0], ds[0].lease_id, "plain"),
        NackItem(ids[1], ds[1].lease_id, "delayed", delay=5.0),
        NackItem(ids[2], ds[2].lease_id, "terminal", terminal=True),
        NackItem(ids[3], "wrong-lease", "nope", terminal=True),
    ]
    acked, nacked = await store.settle_many([], nacks, now=NOW)
    assert acked == []
    assert isinstance(nacked[0], Failure)
    assert_backoff(nacked[0], 1, NOW)
    assert nacked[1] == Failure(ids[1], False, NOW + 5.0)
    assert nacked[2] == Failure(ids[2], True, None)
    assert isinstance(nacked[3], LeaseLost)
    await expect(
        store,
        handed_out=1,
        delayed=2,
        dead=1,
        enqueued=4,
        delivered=4,
        nacked=3,
        retried=2,
        buried=1,
    )


async def test_settle_claim_settles_then_claims_in_one_transaction(store: Store) -> None:
    ids = [await enqueue(store) for _ in range(6)]
    first = await store.claim_many([LEASE] * 2, now=NOW)
    before = store.transactions
    acked, nacked, claimed = await store.settle_claim(
        [(first[0].task.id, first[0].lease_id), (first[1].task.id, "wrong-lease")],
        [],
        [LEASE * 2] * 3,
        now=NOW + 1,
    )
    assert acked[0] is None
    assert isinstance(acked[1], LeaseLost)
    assert nacked == []
    # The claims do not wait on the outcomes: as many as asked, in order, each its own lease.
    assert [d.task.id for d in claimed] == ids[2:5]
    assert all(d.deadline == NOW + 1 + LEASE * 2 for d in claimed)
    assert store.transactions - before == 1
    await expect(store, ready=1, handed_out=4, enqueued=6, delivered=5, acked=1)
    # Nothing to settle that can be, nothing left to claim but one: still answered.
    acked, _, claimed = await store.settle_claim(
        [("0" * 16, "x")], [], [LEASE] * 3, now=NOW + 2, queues=("default", "other")
    )
    assert isinstance(acked[0], NotFound)
    assert [d.task.id for d in claimed] == ids[5:]


# -- idempotency keys -------------------------------------------------------------------------


async def test_a_key_seen_within_its_window_is_a_duplicate(store: Store) -> None:
    first = await enqueue_one(
        store, PAYLOAD, max_attempts=3, delay=0.0, now=NOW, key="k", key_until=NOW + 300.0
    )
    assert not first.duplicate
    assert first.task is not None
    before = store.transactions
    again = await enqueue_one(
        store,
        b'"other"',
        max_attempts=1,
        delay=0.0,
        now=NOW + 299.5,
        key="k",
        key_until=NOW + 599.5,
    )
    assert again == Enqueued(first.id, True, None)
    assert store.transactions == before  # a duplicate creates nothing, commits nothing
    await expect(store, ready=1, enqueued=1)
    # even once the first task is gone (acked)
    d = await claim(store, NOW + 299.5)
    await store.ack(first.id, d.lease_id, now=NOW + 299.5)
    again = await enqueue_one(
        store, PAYLOAD, max_attempts=3, delay=5.0, now=NOW + 299.75, key="k", key_until=NOW + 600.0
    )
    assert again == Enqueued(first.id, True, None)
    await expect(store, enqueued=1, delivered=1, acked=1)


async def test_a_key_whose_window_is_over_makes_a_new_task(store: Store) -> None:
    first = await enqueue(store, key="k", key_until=NOW + 10.0)
    # at the end of the window (until <= now), with no sweep in between
    second = await enqueue_one(
        store, PAYLOAD, max_attempts=3, delay=0.0, now=NOW + 10.0, key="k", key_until=NOW + 20.0
    )
    assert not second.duplicate
    assert second.id != first
    # the new window holds, a sweep forgets the old one and not the new
    await store.sweep(now=NOW + 15.0)
    third = await enqueue_one(
        store, PAYLOAD, max_attempts=3, delay=0.0, now=NOW + 15.0, key="k", key_until=NOW + 25.0
    )
    assert third == Enqueued(second.id, True, None)
    await store.sweep(now=NOW + 20.0)
    fourth = await enqueue(store, now=NOW + 20.0, key="k", key_until=NOW + 30.0)
    assert fourth not in (first, second.id)
    await expect(store, ready=3, enqueued=3)


async def test_keys_are_per_queue(store: Store) -> None:
    a = await enqueue(store, queue="a", key="k", key_until=NOW + 60)
    b = await enqueue(store, queue="b", key="k", key_until=NOW + 60)
    plain = await enqueue(store, key="k", key_until=NOW + 60)
    assert len({a, b, plain}) == 3
    dup = await enqueue_one(
        store, PAYLOAD, max_attempts=3, delay=0.0, now=NOW, queue="b", key="k", key_until=NOW + 60
    )
    assert dup == Enqueued(b, True, None)
    # a key is not a payload: another key, the same payload, is a new task
    other = await enqueue(store, queue="b", key="K", key_until=NOW + 60)
    assert other != b
    await expect_queue(store, "b", ready=2, enqueued=2)


async def test_keys_within_one_batch(store: Store) -> None:
    until = NOW + 60
    done = await store.enqueue_many(
        [
            NewTask(b"1", 3, 0.0, key="x", key_until=until),
            NewTask(b"2", 3, 0.0, key="y", key_until=until),
            NewTask(b"3", 3, 0.0, key="x", key_until=until),
            NewTask(b"4", 3, 0.0),
            NewTask(b"5", 3, 0.0, queue="other", key="x", key_until=until),
        ],
        now=NOW,
    )
    assert [e.duplicate for e in done] == [False, False, True, False, False]
    assert done[2] == Enqueued(done[0].id, True, None)
    assert len({e.id for e in done}) == 4
    await expect(store, ready=4, enqueued=4)
    # a batch of duplicates only commits nothing
    before = store.transactions
    again = await store.enqueue_many(
        [NewTask(b"6", 3, 0.0, key="y", key_until=until)] * 2, now=NOW + 1
    )
    assert again == [Enqueued(done[1].id, True, None)] * 2
    assert store.transactions == before


# -- lookup -----------------------------------------------------------------------------------


async def test_lookup_in_each_state(store: Store) -> None:
    ready = await enqueue(store, queue="q", priority=4)
    delayed = await enqueue(store, delay=30.0)
    held = await enqueue(store, max_attempts=2)
    dead = await enqueue(store, max_attempts=1)
    d_held = await claim(store)
    d_dead = await claim(store)
    assert (d_held.task.id, d_dead.task.id) == (held, dead)
    await store.nack(dead, d_dead.lease_id, "gone wrong", now=NOW)

    found = await store.lookup(ready)
    assert found == TaskState(Task(ready, PAYLOAD, 0, 3, NOW, NOW, None, "q", 4), "ready")
    found = await store.lookup(delayed)
    assert found == TaskState(Task(delayed, PAYLOAD, 0, 3, NOW, NOW + 30.0), "delayed")
    found = await store.lookup(held)
    assert found == TaskState(Task(held, PAYLOAD, 1, 2, NOW, NOW), "handed_out")
    found = await store.lookup(dead)
    assert found == TaskState(
        Task(dead, PAYLOAD, 1, 1, NOW, NOW, "gone wrong", buried_at=NOW), "dead"
    )

    failure = await store.nack(held, d_held.lease_id, "retry me", now=NOW + 1.0, delay=2.0)
    found = await store.lookup(held)
    assert found == TaskState(Task(held, PAYLOAD, 1, 2, NOW, NOW + 3.0, "retry me"), "delayed")
    assert failure.retry_at == NOW + 3.0
    await store.sweep(now=NOW + 3.0)
    found = await store.lookup(held)
    assert found is not None
    assert (found.state, found.task.last_error) == ("ready", "retry me")


async def test_lookup_of_a_cold_ready_task(store: Store) -> None:
    # past the hot window of the SQLite store in tests (3 ready tasks): ids only in memory
    ids = [await enqueue(store, priority=n % 3, now=NOW + n) for n in range(8)]
    for n, task_id in enumerate(ids):
        found = await store.lookup(task_id)
        assert found == TaskState(
            Task(task_id, PAYLOAD, 0, 3, NOW + n, NOW + n, None, DEFAULT_QUEUE, n % 3), "ready"
        )


async def test_lookup_after_ack_purge_or_never(store: Store) -> None:
    acked = await enqueue(store)
    d = await claim(store)
    await store.ack(acked, d.lease_id, now=NOW)
    assert await store.lookup(acked) is None
    purged = await enqueue(store, max_attempts=1)
    await bury(store, purged, "x")
    await store.purge(purged)
    assert await store.lookup(purged) is None
    for unknown in ("no-such-task", "0123456789abcdef", "", "0123456789ABCDEF", "zz" * 8):
        assert await store.lookup(unknown) is None


# -- requeue_all and purge --------------------------------------------------------------------


async def test_requeue_all_requeues_every_dead_task(store: Store) -> None:
    await enqueue(store, queue="b", delay=60.0)  # not dead: stays where it is
    queues_of = ("a", "b", "a", "c")
    ids = [await enqueue(store, queue=q, max_attempts=1) for q in queues_of]
    for task_id, queue in zip(ids, queues_of, strict=True):
        await bury_from(store, queue, task_id)
    assert [v.id for v in await store.dead_letters()] == ids
    count, queues = await store.requeue_all(now=NOW + 1)
    assert count == 4
    assert sorted(queues) == ["a", "b", "c"]
    assert await store.dead_letters() == []
    await expect(store, ready=4, delayed=1, enqueued=5, delivered=4, nacked=4, buried=4, requeued=4)
    for task_id in ids:
        view = await store.lookup(task_id)
        assert view is not None
        assert (view.state, view.task.attempts, view.task.last_error) == ("ready", 0, None)
        assert view.task.available_at == NOW + 1
    assert await store.requeue_all(now=NOW + 1) == (0, [])
    # to the tail of ready, in the order they were buried
    got = await claimed_ids(store, 4, ["c", "b", "a"], NOW + 1)
    assert got == [ids[3], ids[1], ids[0], ids[2]]


async def test_requeue_all_of_one_queue(store: Store) -> None:
    ids = {q: await enqueue(store, queue=q, max_attempts=1) for q in ("a", "b")}
    extra = await enqueue(store, queue="a", max_attempts=1, now=NOW + 1)
    for _ in range(3):
        d = await claim_from(store, ["a", "b"], NOW + 1)
        assert d is not None
        await store.nack(d.task.id, d.lease_id, "x", now=NOW + 1)
    assert await store.requeue_all(queue="a", now=NOW + 2) == (2, ["a"])
    assert [v.id for v in await store.dead_letters()] == [ids["b"]]
    await expect_queue(store, "a", ready=2, enqueued=2, delivered=2, nacked=2, buried=2, requeued=2)
    await expect_queue(store, "b", dead=1, enqueued=1, delivered=1, nacked=1, buried=1)
    # to the tail of ready, in the order they were buried
    assert await claimed_ids(store, 2, ["a"], NOW + 2) == [ids["a"], extra]
    assert await store.requeue_all(queue="never", now=NOW + 2) == (0, [])
    assert await store.requeue_all(queue="a", now=NOW + 2) == (0, [])


async def test_requeue_past_the_hot_window(store: Store) -> None:
    # SQLite keeps 3 ready tasks in memory in tests: a requeued task behind them goes cold.
    doomed = await enqueue(store, max_attempts=1)
    await bury(store, doomed, "x")
    ready = [await enqueue(store, now=NOW + 1 + i) for i in range(5)]
    assert await store.requeue(doomed, now=NOW + 10) == DEFAULT_QUEUE
    await bury_from(store, "q", await enqueue(store, queue="q", max_attempts=1))
    assert await store.requeue_all(now=NOW + 10) == (1, ["q"])
    assert await claimed_ids(store, 6, [DEFAULT_QUEUE], NOW + 10) == [*ready, doomed]
    found = await store.lookup(doomed)
    assert found is not None
    assert (found.state, found.task.attempts, found.task.last_error) == ("handed_out", 1, None)


async def test_purge_drops_a_dead_task_for_good(store: Store) -> None:
    keep = await enqueue(store, max_attempts=1)
    gone = await enqueue(store, max_attempts=1, queue="q")
    await bury(store, keep, "k")
    d = await claim_from(store, ["q"])
    assert d is not None
    await store.nack(gone, d.lease_id, "g", now=NOW)
    await store.purge(gone)
    stats = await expect(store, dead=1, enqueued=2, delivered=2, nacked=2, buried=2, purged=1)
    assert stats.ready + stats.handed_out + stats.delayed + stats.dead == 2 - 0 - 1
    await expect_queue(store, "q", enqueued=1, delivered=1, nacked=1, buried=1, purged=1)
    assert [v.id for v in await store.dead_letters()] == [keep]
    with pytest.raises(NotFound):
        await store.purge(gone)  # twice
    with pytest.raises(NotFound):
        await store.requeue(gone, now=NOW)
    assert await store.requeue_all(now=NOW) == (1, [DEFAULT_QUEUE])


@pytest.mark.parametrize("situation", [*UNHELD, "handed out"])
async def test_purge_of_a_task_that_is_not_dead_is_not_found(store: Store, situation: str) -> None:
    if situation == "handed out":
        task_id = await enqueue(store)
        await claim(store)
        unchanged = dict(handed_out=1, enqueued=1, delivered=1)
    elif situation == "dead":
        task_id, _, _ = await _unheld(store, "dead")
        await store.requeue(task_id, now=NOW)
        unchanged = dict(ready=1, enqueued=1, delivered=1, nacked=1, buried=1, requeued=1)
    else:
        task_id, _, unchanged = await _unheld(store, situation)
    with pytest.raises(NotFound):
        await store.purge(task_id)
    await expect(store, **unchanged)


async def test_queue_and_dlq_calls_that_change_nothing_commit_nothing(store: Store) -> None:
    await store.set_paused("a", True)
    before = store.transactions
    await store.set_paused("a", True)
    assert await store.requeue_all(now=NOW) == (0, [])
    with pytest.raises(NotFound):
        await store.purge("0123456789abcdef")
    with pytest.raises(NotFound):
        await store.extend("0123456789abcdef", "fedcba9876543210", lease=1.0, now=NOW)
    await store.lookup("0123456789abcdef")
    await store.queues()
    await store.stats("a")
    assert store.transactions == before


# == memory backend internals (not part of the contract) =====================================
# These build a MemoryStore directly and use its test hook check_invariants(), which asserts its
# heaps, deque and dicts agree with each other.


def memory_store() -> MemoryStore:
    rng = random.Random(5)
    return MemoryStore(Backoff(1.0, 30.0, rng), rng)


async def test_memory_internals_stay_consistent_through_every_transition() -> None:
    s = memory_store()
    s.check_invariants()
    a = await enqueue(s, max_attempts=2)
    b = await enqueue(s, max_attempts=1, delay=0.25)
    s.check_invariants()
    da = await claim(s, lease=2.0)
    s.check_invariants()
    assert await s.release(a, da.lease_id, now=NOW)
    s.check_invariants()
    da = await claim(s, lease=2.0)
    failure = await s.nack(a, da.lease_id, "x", now=NOW)
    s.check_invariants()
    assert failure.retry_at is not None
    db = await claim(s, NOW + 0.25, lease=2.0)  # a waits 0.5-1 s
    assert db.task.id == b
    s.check_invariants()
    await s.sweep(now=NOW + 3.0)  # reclaims b (buried), promotes a
    s.check_invariants()
    da = await claim(s, NOW + 3.0)
    await s.ack(a, da.lease_id, now=NOW + 3.0)
    s.check_invariants()
    await s.requeue(b, now=NOW + 3.0)
    s.check_invariants()
    db = await claim(s, NOW + 3.0)
    await s.reclaim(b, db.lease_id, "gone", now=NOW + 3.0)
    s.check_invariants()
    totals = dict(acked=1, nacked=1, reclaimed=2, retried=1, buried=2, requeued=1)
    await expect(s, dead=1, enqueued=2, delivered=4, **totals)


async def test_memory_lease_heap_compaction_keeps_the_books() -> None:
    # Acked leases stay in the lease heap as stale entries until they surface or the heap is
    # rebuilt (at 4096 stale entries, once they outnumber the live ones).
    s = memory_store()
    ids = [await enqueue(s) for _ in range(6000)]
    held = [await claim(s, lease=100.0) for _ in ids]
    for d in held[:5000]:
        await s.ack(d.task.id, d.lease_id, now=NOW)
    s.check_invariants()
    result, _ = await s.sweep(now=NOW + 100.0)
    assert len(result.reclaimed) == 1000
    s.check_invariants()
    totals = dict(enqueued=6000, delivered=6000, acked=5000, reclaimed=1000, retried=1000)
    await expect(s, delayed=1000, **totals)


async def test_memory_lease_heap_compaction_during_a_sweep_keeps_the_books() -> None:
    # A sweep that reclaims leases while the heap holds 4096 stale entries crosses the rebuild
    # threshold part-way through. Whenever the heap is rebuilt, the books must stay straight.
    # (A rebuild into a new list mid-sweep, while the sweep kept popping the old one, once left
    # the stale-entry count wrong.)
    s = memory_store()
    short, long_ = 20, 8190
    for _ in range(short + long_):
        await enqueue(s)
    expiring = [await claim(s, lease=1.0) for _ in range(short)]
    lasting = [await claim(s, lease=1000.0) for _ in range(long_)]
    for d in lasting[:4096]:  # 4096 stale entries, not yet outnumbering the live ones
        await s.ack(d.task.id, d.lease_id, now=NOW)
    s.check_invariants()
    result, _ = await s.sweep(now=NOW + 1.0)  # the 20 short leases
    assert sorted(result.reclaimed) == sorted((d.task.id, d.lease_id) for d in expiring)
    s.check_invariants()
    result, _ = await s.sweep(now=NOW + 1000.0)
    assert len(result.reclaimed) == long_ - 4096
    s.check_invariants()
