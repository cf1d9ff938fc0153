"""The store contract's control over tasks (docs/design/control.md), checked against every
backend: cancel, listing pages, expiry, time limits, unique keys, progress, emptying and deleting
queues. As in test_contract.py, every call passes an explicit ``now`` and every gauge and counter
is checked after each step (``expect`` also checks that the four gauges add up to
``enqueued - acked - purged - cancelled - expired``)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from tests.store.test_contract import LEASE, NOW, PAYLOAD, claim, enqueue, expect
from wqbroker.errors import Cancelled, Conflict, LeaseLost, NotFound, TimeLimitReached
from wqbroker.models import (
    CANCELLED,
    CANCELLING,
    DEFAULT_QUEUE,
    PURGED,
    CancelResult,
    Failure,
    NackItem,
    NewTask,
)
from wqbroker.store import Store
from wqbroker.store.memory import MemoryStore


@pytest.fixture(autouse=True)
async def _structures_agree(store: Store) -> AsyncIterator[None]:
    """After each test, the memory store's own structures agree with each other (its lines,
    heaps, per-queue collections and totals: Index.check_invariants)."""
    yield
    if isinstance(store, MemoryStore):
        store.check_invariants()


async def submit(
    store: Store,
    now: float = NOW,
    *,
    delay: float = 0.0,
    max_attempts: int = 3,
    queue: str = DEFAULT_QUEUE,
    priority: int = 0,
    expires_at: float | None = None,
    timeout: float | None = None,
) -> str:
    """One task with the options of NewTask (``delay`` in seconds, ``expires_at`` absolute)."""
    new = NewTask(
        PAYLOAD, max_attempts, delay, queue, priority, expires_at=expires_at, timeout=timeout
    )
    (done,) = await store.enqueue_many([new], now=now)
    return done.id


async def page_ids(
    store: Store, state: str, queue: str = DEFAULT_QUEUE, limit: int = 1000
) -> list[str]:
    """Every task id of a listing, page after page of ``limit``."""
    out: list[str] = []
    after = None
    while True:
        page = await store.list_tasks(queue, state, limit=limit, after=after)
        assert len(page.tasks) <= limit
        out += [t.task.id for t in page.tasks]
        assert all(t.state == state for t in page.tasks)
        if page.after is None:
            return out
        assert len(page.tasks) == limit
        after = page.after


# -- cancel ---------------------------------------------------------------------------------------


async def test_a_ready_task_cancelled_is_gone(store: Store) -> None:
    keep = await enqueue(store)
    gone = await enqueue(store)
    result = await store.cancel(gone, now=NOW)
    assert result == CancelResult(gone, CANCELLED, DEFAULT_QUEUE)
    assert await store.lookup(gone) is None
    await expect(store, ready=1, enqueued=2, cancelled=1)
    d = await claim(store)
    assert d.task.id == keep
    assert await store.claim(lease=LEASE, now=NOW) is None
    with pytest.raises(NotFound):
        await store.cancel(gone, now=NOW)


async def test_a_delayed_task_cancelled_is_gone_and_never_comes_back(store: Store) -> None:
    task_id = await enqueue(store, delay=10.0)
    assert (await store.cancel(task_id, now=NOW)).state == CANCELLED
    await expect(store, enqueued=1, cancelled=1)
    swept, _ = await store.sweep(now=NOW + 60)
    assert swept.promoted == 0
    assert await store.claim(lease=LEASE, now=NOW + 60) is None
    await expect(store, enqueued=1, cancelled=1)


async def test_an_unknown_task_cannot_be_cancelled(store: Store) -> None:
    with pytest.raises(NotFound):
        await store.cancel("0123456789abcdef", now=NOW)
    with pytest.raises(NotFound):
        await store.cancel("not an id", now=NOW)
    acked = await enqueue(store)
    d = await claim(store)
    await store.ack(d.task.id, d.lease_id, now=NOW)
    with pytest.raises(NotFound):
        await store.cancel(acked, now=NOW)
    await expect(store, enqueued=1, delivered=1, acked=1)


async def test_a_dead_task_cancelled_is_purged(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=1)
    d = await claim(store)
    await store.nack(d.task.id, d.lease_id, "bad", now=NOW)
    assert (await store.cancel(task_id, now=NOW)) == CancelResult(task_id, PURGED, DEFAULT_QUEUE)
    assert await store.dead_letters() == []
    await expect(store, enqueued=1, delivered=1, nacked=1, buried=1, purged=1)


async def test_a_handed_out_task_cancelled_is_cancelling_until_its_holder_acks(
    store: Store,
) -> None:
    await enqueue(store)
    d = await claim(store)
    result = await store.cancel(d.task.id, now=NOW)
    assert result == CancelResult(d.task.id, CANCELLING, DEFAULT_QUEUE, d.lease_id)
    again = await store.cancel(d.task.id, now=NOW + 1)
    assert again == result
    found = await store.lookup(d.task.id)
    assert found is not None
    assert (found.state, found.task.cancelling) == ("handed_out", True)
    await expect(store, handed_out=1, enqueued=1, delivered=1)
    await store.ack(d.task.id, d.lease_id, now=NOW + 2)  # the ack counts as usual
    await expect(store, enqueued=1, delivered=1, acked=1)


@pytest.mark.parametrize("how", ["nack", "terminal", "delayed", "reclaim", "settle"])
async def test_a_cancelling_task_let_go_by_its_holder_is_gone_not_retried(
    store: Store, how: str
) -> None:
    await enqueue(store, max_attempts=5)
    d = await claim(store)
    await store.cancel(d.task.id, now=NOW)
    if how == "nack":
        failure = await store.nack(d.task.id, d.lease_id, "boom", now=NOW)
    elif how == "terminal":
        failure = await store.nack(d.task.id, d.lease_id, "boom", now=NOW, terminal=True)
    elif how == "delayed":
        failure = await store.nack(d.task.id, d.lease_id, None, now=NOW, delay=1.0)
    elif how == "reclaim":
        failure = await store.reclaim(d.task.id, d.lease_id, "gone", now=NOW)
    else:
        _, (out,) = await store.settle_many([], [NackItem(d.task.id, d.lease_id)], now=NOW)
        assert isinstance(out, Failure)
        failure = out
    assert failure == Failure(d.task.id, False, None, cancelled=True)
    assert await store.lookup(d.task.id) is None
    await expect(store, enqueued=1, delivered=1, cancelled=1)
    await store.sweep(now=NOW + 3600)
    assert await store.claim(lease=LEASE, now=NOW + 3600) is None
    assert await store.dead_letters() == []


async def test_a_cancelling_task_whose_lease_runs_out_is_gone(store: Store) -> None:
    await enqueue(store)
    d = await claim(store, lease=5.0)
    await store.cancel(d.task.id, now=NOW)
    swept, _ = await store.sweep(now=NOW + 10)
    assert swept.reclaimed == [(d.task.id, d.lease_id)]  # (its lease ended: a stream's slot)
    await expect(store, enqueued=1, delivered=1, cancelled=1)
    assert await store.claim(lease=LEASE, now=NOW + 100) is None


async def test_a_cancelling_task_cannot_be_extended(store: Store) -> None:
    await enqueue(store)
    d = await claim(store)
    await store.cancel(d.task.id, now=NOW)
    with pytest.raises(Cancelled) as e:
        await store.extend(d.task.id, d.lease_id, lease=LEASE, now=NOW + 1)
    assert isinstance(e.value, LeaseLost)
    assert "cancel" in e.value.message
    with pytest.raises(LeaseLost):  # another lease is still another lease
        await store.extend(d.task.id, "0" * 16, lease=LEASE, now=NOW + 1)
    await expect(store, handed_out=1, enqueued=1, delivered=1)


async def test_a_handed_back_cancelling_task_is_gone(store: Store) -> None:
    await enqueue(store)
    d = await claim(store)
    await store.cancel(d.task.id, now=NOW)
    assert await store.release(d.task.id, d.lease_id, now=NOW) is True
    assert await store.claim(lease=LEASE, now=NOW) is None
    await expect(store, enqueued=1, delivered=1, cancelled=1)


async def test_cancel_only_touches_its_task_and_keeps_the_order(store: Store) -> None:
    ids = [await enqueue(store) for _ in range(6)]
    for task_id in ids[1::2]:
        await store.cancel(task_id, now=NOW)
    got = [(await claim(store)).task.id for _ in range(3)]
    assert got == ids[0::2]
    await expect(store, handed_out=3, enqueued=6, delivered=3, cancelled=3)


# -- listing --------------------------------------------------------------------------------------


async def test_ready_tasks_are_listed_in_the_order_claims_take_them(store: Store) -> None:
    ids = {}
    for n, priority in enumerate([0, 5, 0, 9, 5, 0]):
        ids[n] = await submit(store, priority=priority)
    expected = [ids[3], ids[1], ids[4], ids[0], ids[2], ids[5]]
    assert await page_ids(store, "ready") == expected
    assert await page_ids(store, "ready", limit=1) == expected
    assert await page_ids(store, "ready", limit=4) == expected
    claimed = [(await claim(store)).task.id for _ in range(6)]
    assert claimed == expected


async def test_a_page_shows_each_task_as_a_view_without_its_lease(store: Store) -> None:
    await enqueue(store)
    d = await claim(store)
    page = await store.list_tasks(DEFAULT_QUEUE, "handed_out", limit=10)
    (shown,) = page.tasks
    assert shown.state == "handed_out"
    assert shown.task.id == d.task.id
    assert shown.task.payload == PAYLOAD
    assert shown.task.attempts == 1
    assert d.lease_id not in repr(shown)
    assert page.after is None


async def test_delayed_tasks_are_listed_by_due_time(store: Store) -> None:
    late = await enqueue(store, delay=30.0)
    soon = await enqueue(store, delay=5.0)
    tie_a = await enqueue(store, delay=10.0)
    tie_b = await enqueue(store, delay=10.0)
    await enqueue(store)  # ready: not listed
    assert await page_ids(store, "delayed") == [soon, tie_a, tie_b, late]
    assert await page_ids(store, "delayed", limit=1) == [soon, tie_a, tie_b, late]


async def test_handed_out_tasks_are_listed_by_deadline(store: Store) -> None:
    a = await enqueue(store)
    b = await enqueue(store)
    c = await enqueue(store)
    da = await claim(store, lease=60.0)
    db = await claim(store, lease=10.0)
    dc = await claim(store, lease=30.0)
    assert (da.task.id, db.task.id, dc.task.id) == (a, b, c)
    assert await page_ids(store, "handed_out") == [b, c, a]
    assert await page_ids(store, "handed_out", limit=2) == [b, c, a]
    await store.extend(b, db.lease_id, lease=100.0, now=NOW)  # moves to its new deadline
    assert await page_ids(store, "handed_out") == [c, a, b]


async def test_dead_tasks_are_listed_by_burial(store: Store) -> None:
    ids = [await enqueue(store, max_attempts=1) for _ in range(4)]
    order = [ids[2], ids[0], ids[3], ids[1]]
    deliveries = {d.task.id: d for d in [await claim(store) for _ in range(4)]}
    for n, task_id in enumerate(order):
        await store.nack(task_id, deliveries[task_id].lease_id, "x", now=NOW + n)
    assert await page_ids(store, "dead") == order
    assert await page_ids(store, "dead", limit=3) == order
    await store.requeue(ids[0], now=NOW + 10)
    assert await page_ids(store, "dead", limit=1) == [ids[2], ids[3], ids[1]]


async def test_listings_are_per_queue_and_empty_for_an_unknown_queue(store: Store) -> None:
    a = await submit(store, queue="a")
    await submit(store, queue="b")
    assert await page_ids(store, "ready", queue="a") == [a]
    page = await store.list_tasks("nope", "ready", limit=10)
    assert (page.tasks, page.after) == ([], None)
    assert await page_ids(store, "dead", queue="a") == []


async def test_a_page_of_exactly_the_rest_says_nothing_follows(store: Store) -> None:
    for _ in range(3):
        await enqueue(store)
    page = await store.list_tasks(DEFAULT_QUEUE, "ready", limit=3)
    assert len(page.tasks) == 3
    assert page.after is None
    page = await store.list_tasks(DEFAULT_QUEUE, "ready", limit=2)
    assert page.after is not None
    rest = await store.list_tasks(DEFAULT_QUEUE, "ready", limit=2, after=page.after)
    assert len(rest.tasks) == 1
    assert rest.after is None


@pytest.mark.parametrize("state", ["ready", "delayed", "dead"])
async def test_paging_never_repeats_nor_skips_a_task_that_stayed_in_its_state(
    store: Store, state: str, rng: random.Random
) -> None:
    """While a caller pages, others' tasks come and go (enqueued, claimed, cancelled,
    buried): every task that was in the state throughout is seen exactly once."""
    now = NOW
    delayed = state == "delayed"
    staying: list[str] = []
    others: list[str] = []
    for n in range(40):
        task_id = await submit(
            store,
            now=now,
            delay=1000.0 + n if delayed else 0.0,
            max_attempts=1,
            priority=rng.randint(0, 3),
        )
        if state == "dead":
            d = await claim(store, now=now)
            await store.nack(d.task.id, d.lease_id, "x", now=now)
        (staying if rng.random() < 0.5 else others).append(task_id)
    seen: list[str] = []
    after = None
    while True:
        page = await store.list_tasks(DEFAULT_QUEUE, state, limit=7, after=after)
        seen += [t.task.id for t in page.tasks]
        # Meanwhile: some of the others leave, new ones come.
        for _ in range(2):
            if others:
                await store.cancel(others.pop(rng.randrange(len(others))), now=now)
        await submit(
            store, now=now, delay=1000.0 + rng.random() * 40 if delayed else 0.0, max_attempts=1
        )
        if page.after is None:
            break
        after = page.after
    assert len(seen) == len(set(seen)), "a task was listed twice"
    assert set(staying) <= set(seen), "a task that stayed was skipped"


# -- expiry ---------------------------------------------------------------------------------------


async def test_a_task_met_by_a_claim_after_its_expiry_is_dropped(store: Store) -> None:
    old = await submit(store, expires_at=NOW + 5)
    new = await enqueue(store)
    d = await claim(store, now=NOW + 5)  # at its expiry: never handed out
    assert d.task.id == new
    assert await store.lookup(old) is None
    await expect(store, handed_out=1, enqueued=2, delivered=1, expired=1)


async def test_the_sweep_drops_ready_and_delayed_tasks_at_their_expiry(store: Store) -> None:
    ready = await submit(store, expires_at=NOW + 5)
    delayed = await submit(store, delay=2.0, expires_at=NOW + 6)
    late = await submit(store, delay=20.0, expires_at=NOW + 10)  # due after its expiry
    keep = await submit(store, expires_at=NOW + 100)
    swept, due = await store.sweep(now=NOW + 1)
    assert swept.expired == 0
    assert due is not None
    assert due <= NOW + 2
    await store.sweep(now=NOW + 3)  # the delayed one becomes ready, still not expired
    swept, _ = await store.sweep(now=NOW + 7)
    assert swept.expired == 2
    swept, _ = await store.sweep(now=NOW + 30)
    assert swept.expired == 1  # never delivered: it expired while delayed
    for task_id in (ready, delayed, late):
        assert await store.lookup(task_id) is None
    found = await store.lookup(keep)
    assert found is not None
    assert found.task.expires_at == pytest.approx(NOW + 100)
    await expect(store, ready=1, enqueued=4, expired=3)


async def test_a_handed_out_task_runs_its_course_past_its_expiry(store: Store) -> None:
    task_id = await submit(store, expires_at=NOW + 5, max_attempts=3)
    d = await claim(store, now=NOW + 1)
    await store.sweep(now=NOW + 10)
    await expect(store, handed_out=1, enqueued=1, delivered=1)
    await store.ack(task_id, d.lease_id, now=NOW + 11)
    await expect(store, enqueued=1, delivered=1, acked=1)


async def test_a_retry_due_after_the_expiry_is_never_handed_out(store: Store) -> None:
    task_id = await submit(store, expires_at=NOW + 5, max_attempts=3)
    d = await claim(store, now=NOW + 1)
    await store.nack(task_id, d.lease_id, "x", now=NOW + 6, delay=1.0)
    assert await store.claim(lease=LEASE, now=NOW + 8) is None
    await store.sweep(now=NOW + 9)
    await expect(store, enqueued=1, delivered=1, nacked=1, retried=1, expired=1)


async def test_dead_tasks_never_expire_and_a_requeue_clears_the_expiry(store: Store) -> None:
    task_id = await submit(store, expires_at=NOW + 5, max_attempts=1)
    d = await claim(store, now=NOW)
    await store.nack(task_id, d.lease_id, "x", now=NOW)
    await store.sweep(now=NOW + 100)
    await expect(store, dead=1, enqueued=1, delivered=1, nacked=1, buried=1)
    await store.requeue(task_id, now=NOW + 200)
    d = await claim(store, now=NOW + 201)
    assert d.task.id == task_id
    assert d.task.expires_at is None


# -- time limits ----------------------------------------------------------------------------------


async def test_a_claim_cuts_the_lease_to_the_time_limit(store: Store) -> None:
    await submit(store, timeout=5.0)
    d = await claim(store, lease=30.0)
    assert d.deadline == pytest.approx(NOW + 5)
    assert d.task.timeout == pytest.approx(5.0)


async def test_extensions_stop_at_the_time_limit_and_the_task_is_retried(store: Store) -> None:
    task_id = await submit(store, timeout=50.0, max_attempts=2)
    d = await claim(store, lease=20.0)
    assert await store.extend(task_id, d.lease_id, lease=20.0, now=NOW + 10) == pytest.approx(
        NOW + 30
    )
    assert await store.extend(task_id, d.lease_id, lease=30.0, now=NOW + 25) == pytest.approx(
        NOW + 50
    )  # cut to the limit
    with pytest.raises(TimeLimitReached) as e:
        await store.extend(task_id, d.lease_id, lease=30.0, now=NOW + 40)
    assert "50000 ms" in e.value.message
    assert isinstance(e.value, LeaseLost)
    swept, _ = await store.sweep(now=NOW + 51)
    assert swept.reclaimed == [(task_id, d.lease_id)]
    await expect(store, delayed=1, enqueued=1, delivered=1, reclaimed=1, retried=1)
    await store.sweep(now=NOW + 100)
    again = await claim(store, now=NOW + 100, lease=300.0)
    assert again.deadline == pytest.approx(NOW + 150)  # a fresh limit for the new attempt
    # The lease ran out at the limit: the worker never said, the broker names the limit.
    assert again.task.last_error == "timed out after 50000 ms"


async def test_a_lease_that_ends_before_the_time_limit_is_only_expired(store: Store) -> None:
    task_id = await submit(store, timeout=50.0, max_attempts=3)
    d = await claim(store, lease=20.0)
    swept, _ = await store.sweep(now=NOW + 21)  # the holder went silent long before its limit
    assert swept.reclaimed == [(task_id, d.lease_id)]
    await store.sweep(now=NOW + 100)
    again = await claim(store, now=NOW + 100, lease=5.0)
    assert again.task.last_error == "lease expired"
    await store.sweep(now=NOW + 106)  # a 5 s lease under a 50 s limit: expired, not timed out
    view = await store.lookup(task_id)
    assert view is not None
    assert view.task.last_error == "lease expired"


async def test_without_a_time_limit_a_task_is_extended_as_long_as_asked(store: Store) -> None:
    task_id = await enqueue(store)
    d = await claim(store)
    deadline = 0.0
    for n in range(1, 6):
        deadline = await store.extend(task_id, d.lease_id, lease=300.0, now=NOW + n * 200)
    assert deadline == pytest.approx(NOW + 1300)


# -- unique while active --------------------------------------------------------------------------


async def unique(
    store: Store, key: str = "k", now: float = NOW, queue: str = DEFAULT_QUEUE
) -> tuple[str, bool]:
    new = NewTask(PAYLOAD, 1, 0.0, queue, 0, key, 0.0, unique=True)
    (done,) = await store.enqueue_many([new], now=now)
    return done.id, done.duplicate


@pytest.mark.parametrize("end", ["ack", "dead", "cancel", "expire", "empty"])
async def test_a_unique_key_holds_while_its_task_is_active(store: Store, end: str) -> None:
    first, dup = await unique(store)
    assert not dup
    assert await unique(store, now=NOW + 1000) == (first, True)  # no window: while it lives
    assert store.key_hint(DEFAULT_QUEUE, "k", NOW) in (True, None)
    other, dup = await unique(store, queue="elsewhere")
    assert not dup
    assert other != first
    if end == "ack":
        d = await claim(store)
        assert await unique(store) == (first, True)  # handed out: still active
        await store.ack(d.task.id, d.lease_id, now=NOW)
    elif end == "dead":
        d = await claim(store)
        await store.nack(d.task.id, d.lease_id, "x", now=NOW)
    elif end == "cancel":
        await store.cancel(first, now=NOW)
    elif end == "empty":
        assert await store.empty_queue(DEFAULT_QUEUE, now=NOW) == 1
    else:
        (done,) = await store.enqueue_many(
            [NewTask(PAYLOAD, 1, 0.0, "x", 0, "e", 0.0, expires_at=NOW + 1, unique=True)], now=NOW
        )
        await store.sweep(now=NOW + 2)
        again, dup = await unique(store, key="e", queue="x", now=NOW + 2)
        assert (dup, again != done.id) == (False, True)
        return
    second, dup = await unique(store, now=NOW + 1)
    assert not dup
    assert second != first


async def test_a_unique_key_is_not_a_window_key(store: Store) -> None:
    first, _ = await unique(store)
    d = await claim(store)
    await store.ack(first, d.lease_id, now=NOW)
    # A plain key in its window is not touched by the unique one, and the other way round.
    window = NewTask(PAYLOAD, 1, 0.0, DEFAULT_QUEUE, 0, "k", NOW + 300)
    (plain,) = await store.enqueue_many([window], now=NOW + 1)
    assert not plain.duplicate
    (again,) = await store.enqueue_many([window], now=NOW + 2)
    assert (again.id, again.duplicate) == (plain.id, True)


async def test_a_requeued_dead_task_no_longer_holds_its_unique_key(store: Store) -> None:
    first, _ = await unique(store)
    d = await claim(store)
    await store.nack(first, d.lease_id, "x", now=NOW)
    second, dup = await unique(store, now=NOW + 1)
    assert not dup
    await store.requeue(first, now=NOW + 2)  # two active tasks; the key is the second's
    assert await unique(store, now=NOW + 3) == (second, True)
    await expect(store, ready=2, enqueued=2, delivered=1, nacked=1, buried=1, requeued=1)


async def test_duplicates_in_one_batch_make_one_task(store: Store) -> None:
    items = [NewTask(PAYLOAD, 1, 0.0, DEFAULT_QUEUE, 0, "b", 0.0, unique=True) for _ in range(3)]
    done = await store.enqueue_many(items, now=NOW)
    assert [d.duplicate for d in done] == [False, True, True]
    assert len({d.id for d in done}) == 1
    await expect(store, ready=1, enqueued=1)


# -- progress -------------------------------------------------------------------------------------


async def test_progress_is_shown_while_the_task_is_handed_out(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=3)
    d = await claim(store)
    assert d.task.progress is None
    await store.extend(task_id, d.lease_id, lease=LEASE, now=NOW + 1, progress=b'{"done": 0.5}')
    found = await store.lookup(task_id)
    assert found is not None
    assert found.task.progress == b'{"done": 0.5}'
    (listed,) = (await store.list_tasks(DEFAULT_QUEUE, "handed_out", limit=5)).tasks
    assert listed.task.progress == b'{"done": 0.5}'
    await store.extend(task_id, d.lease_id, lease=LEASE, now=NOW + 2)  # none: kept
    found = await store.lookup(task_id)
    assert found is not None
    assert found.task.progress == b'{"done": 0.5}'
    await store.nack(task_id, d.lease_id, "x", now=NOW + 3)
    found = await store.lookup(task_id)
    assert found is not None
    assert found.task.progress is None  # cleared once it is no longer handed out


# -- emptying and deleting a queue ----------------------------------------------------------------


async def test_emptying_a_queue_cancels_its_ready_and_delayed_tasks(store: Store) -> None:
    for _ in range(3):
        await submit(store, queue="q")
    await submit(store, queue="q", delay=10.0)
    other = await submit(store, queue="other")
    d = await store.claim(lease=LEASE, now=NOW, queues=("q",))
    assert d is not None
    assert await store.empty_queue("q", now=NOW) == 3  # two ready, one delayed
    await expect(store, ready=1, handed_out=1, enqueued=5, delivered=1, cancelled=3)
    assert (await store.stats("q")).handed_out == 1
    await store.ack(d.task.id, d.lease_id, now=NOW)  # the handed-out one ran its course
    assert await page_ids(store, "ready", queue="other") == [other]
    assert await store.empty_queue("q", now=NOW) == 0
    with pytest.raises(NotFound):
        await store.empty_queue("never", now=NOW)


async def test_a_queue_is_deleted_only_once_it_holds_nothing(store: Store) -> None:
    keep = await submit(store, queue="keep")
    await submit(store, queue="q")
    await store.set_paused("q", True)
    with pytest.raises(Conflict) as e:
        await store.delete_queue("q")
    assert "1 ready" in e.value.message
    with pytest.raises(NotFound):
        await store.delete_queue("never")
    await store.empty_queue("q", now=NOW)
    await store.delete_queue("q")
    assert [q.name for q in await store.queues()] == ["keep"]
    gone = await store.stats("q")
    assert (gone.ready, gone.totals.enqueued) == (0, 0)
    with pytest.raises(NotFound):
        await store.delete_queue("q")
    # The broker's totals keep what the queue counted; a task to it makes it anew, unpaused.
    await expect(store, ready=1, enqueued=2, cancelled=1)
    again = await submit(store, queue="q")
    (row,) = [q for q in await store.queues() if q.name == "q"]
    assert (row.ready, row.paused) == (1, False)
    assert keep != again


async def test_a_queue_with_dead_or_handed_out_tasks_is_not_deleted(store: Store) -> None:
    await submit(store, queue="q", max_attempts=1)
    d = await store.claim(lease=LEASE, now=NOW, queues=("q",))
    assert d is not None
    with pytest.raises(Conflict) as e:
        await store.delete_queue("q")
    assert "1 handed-out" in e.value.message
    await store.nack(d.task.id, d.lease_id, "x", now=NOW)
    with pytest.raises(Conflict) as e:
        await store.delete_queue("q")
    assert "1 dead" in e.value.message
    await store.purge(d.task.id)
    await store.delete_queue("q")
    assert await store.queues() == []
