"""The store contract's results and workflows (docs/design/results.md), checked against every
backend: acks with results (kept as succeeded for their TTL, pruned by the sweep, pinned by their
children), tasks that wait for others (``after``: waiting, released by their last parent's ack,
born dead, buried or cancelled with their parents, transitively), their deliveries' ``parents``,
watching tasks end (``watch``, ``on_finished``), ``take_released``, ``children``, the listings of
the two new states, and the extended invariant. As in test_contract.py every call passes an
explicit ``now``, and ``expect`` checks every gauge and counter, ``nacked + reclaimed == retried +
buried`` and ``ready + handed_out + delayed + dead + waiting == enqueued - acked - purged -
cancelled - expired``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Sequence

import pytest

from tests.store.test_contract import LEASE, NOW, PAYLOAD, expect
from wqbroker import limits
from wqbroker.errors import Conflict, NotFound, UnknownParent
from wqbroker.models import (
    CANCELLED,
    DEFAULT_QUEUE,
    Delivery,
    Enqueued,
    Failure,
    NackItem,
    NewTask,
    ParentResult,
    Released,
    Task,
    TaskState,
)
from wqbroker.store import Store

# Queues that keep parents and children apart, so that a test claims exactly the one it means.
P = "parents"
C = "children"
G = "grandchildren"
UNKNOWN = "0123456789abcdef"


@pytest.fixture(autouse=True)
async def _structures_agree(store: Store) -> AsyncIterator[None]:
    """After each test, the store finds its own structures in agreement (an Index, memory and
    SQLite: its lines, heaps, parents and children, pins, totals; PostgreSQL: its counters and
    its tasks)."""
    yield
    check = getattr(store, "check_invariants", None)
    if check is not None:
        checked = check()
        if inspect.isawaitable(checked):
            await checked


def new(
    *,
    after: Sequence[str | int] = (),
    queue: str = DEFAULT_QUEUE,
    delay: float = 0.0,
    priority: int = 0,
    max_attempts: int = 3,
    ttl: float | None = None,
    expires_at: float | None = None,
    key: str | None = None,
    payload: bytes = PAYLOAD,
) -> NewTask:
    """A task to enqueue; ``ttl``: its result TTL (seconds), given (None: the default)."""
    task = NewTask(
        payload,
        max_attempts,
        delay,
        queue,
        priority,
        key,
        NOW + 3600 if key is not None else 0.0,
        expires_at=expires_at,
        after=tuple(after),
    )
    if ttl is not None:
        task.result_ttl, task.result_ttl_given = ttl, True
    return task


async def add(store: Store, now: float = NOW, **kw: object) -> str:
    """One task (the options of :func:`new`): its id."""
    (done,) = await store.enqueue_many([new(**kw)], now=now)  # type: ignore[arg-type]
    assert not done.duplicate
    return done.id


async def add_many(store: Store, items: Sequence[NewTask], now: float = NOW) -> list[str]:
    done = await store.enqueue_many(items, now=now)
    assert not any(d.duplicate for d in done)
    return [d.id for d in done]


async def take(
    store: Store, queue: str = DEFAULT_QUEUE, now: float = NOW, task_id: str | None = None
) -> Delivery:
    """Claim the next task of ``queue`` (it must be ``task_id`` if given)."""
    delivery = await store.claim(lease=LEASE, now=now, queues=(queue,))
    assert delivery is not None, f"nothing ready in {queue}"
    if task_id is not None:
        assert delivery.task.id == task_id
    return delivery


async def run(
    store: Store,
    queue: str = DEFAULT_QUEUE,
    result: bytes | None = None,
    now: float = NOW,
    task_id: str | None = None,
) -> Delivery:
    """Claim the next task of ``queue`` and ack it (with ``result``)."""
    delivery = await take(store, queue, now, task_id)
    await store.ack(delivery.task.id, delivery.lease_id, now=now, result=result)
    return delivery


async def kill(
    store: Store, queue: str = DEFAULT_QUEUE, error: str = "boom", now: float = NOW
) -> Delivery:
    """Claim the next task of ``queue`` and nack it terminally (to the dead-letter queue)."""
    delivery = await take(store, queue, now)
    failure = await store.nack(delivery.task.id, delivery.lease_id, error, now=now, terminal=True)
    assert failure.buried
    return delivery


async def state_of(store: Store, task_id: str) -> str | None:
    found = await store.lookup(task_id)
    return None if found is None else found.state


async def view(store: Store, task_id: str) -> TaskState:
    found = await store.lookup(task_id)
    assert found is not None, f"task {task_id} is gone"
    return found


async def ids(store: Store, queue: str, state: str, limit: int = 1000) -> list[str]:
    """Every task id of a listing, page after page of ``limit``."""
    out: list[str] = []
    after = None
    while True:
        page = await store.list_tasks(queue, state, limit=limit, after=after)
        assert len(page.tasks) <= limit
        assert all(t.state == state for t in page.tasks)
        out += [t.task.id for t in page.tasks]
        if page.after is None:
            return out
        assert len(page.tasks) == limit
        after = page.after


class Told:
    """What ``on_finished``'s callback was told, and a way to wait for it (a shared store may
    tell of an end a moment after the call that made it returns)."""

    def __init__(self, store: Store) -> None:
        self.pairs: list[tuple[str, str]] = []
        store.on_finished(self.pairs.extend)

    async def wait_for(self, *pairs: tuple[str, str]) -> None:
        for _ in range(500):
            if all(p in self.pairs for p in pairs):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never told of {pairs}: told {self.pairs}")


# -- acks with results ----------------------------------------------------------------------------


async def test_an_ack_with_a_result_keeps_the_task_succeeded(store: Store) -> None:
    task_id = await add(store, max_attempts=4)
    d = await take(store)
    await store.ack(task_id, d.lease_id, now=NOW + 5, result=b'{"sum": 3, "x": [1.50]}')
    found = await view(store, task_id)
    assert found.state == "succeeded"
    task = found.task
    assert task.result == b'{"sum": 3, "x": [1.50]}'  # byte for byte
    assert task.finished_at == NOW + 5
    assert (task.payload, task.attempts, task.max_attempts) == (PAYLOAD, 1, 4)
    assert task.created_at == NOW
    assert task.result_ttl is None  # the default: not shown
    assert task.after is None
    assert task.waiting_for == 0
    await expect(store, succeeded=1, enqueued=1, delivered=1, acked=1)
    assert await store.claim(lease=LEASE, now=NOW + 5) is None
    # It is no longer held: its lease is gone with the hand-out.
    with pytest.raises(NotFound):
        await store.ack(task_id, d.lease_id, now=NOW + 6)


async def test_a_null_result_is_a_result(store: Store) -> None:
    task_id = await add(store)
    await run(store, result=b"null")
    found = await view(store, task_id)
    assert (found.state, found.task.result) == ("succeeded", b"null")


async def test_an_ack_without_a_result_forgets_the_task_as_before(store: Store) -> None:
    task_id = await add(store, ttl=60.0)
    await run(store)
    assert await store.lookup(task_id) is None
    await expect(store, enqueued=1, delivered=1, acked=1)


async def test_a_result_ttl_of_0_keeps_nothing(store: Store) -> None:
    task_id = await add(store, ttl=0.0)
    assert (await view(store, task_id)).task.result_ttl == 0.0
    await run(store, result=b"1")
    assert await store.lookup(task_id) is None
    await expect(store, enqueued=1, delivered=1, acked=1)


async def test_a_given_result_ttl_is_shown(store: Store) -> None:
    (done,) = await store.enqueue_many([new(ttl=90.0)], now=NOW)
    assert done.task is not None
    assert done.task.result_ttl == 90.0
    given = done.id
    default = await add(store)
    assert (await view(store, given)).task.result_ttl == 90.0
    assert (await view(store, default)).task.result_ttl is None
    await run(store, result=b"1", task_id=given)
    assert (await view(store, given)).task.result_ttl == 90.0


async def test_a_result_is_kept_for_its_ttl_then_pruned_by_the_sweep(store: Store) -> None:
    short = await add(store, ttl=10.0)
    long = await add(store, ttl=100.0)
    await run(store, result=b'"a"', now=NOW + 1, task_id=short)
    await run(store, result=b'"b"', now=NOW + 2, task_id=long)
    await expect(store, succeeded=2, enqueued=2, delivered=2, acked=2)
    swept, due = await store.sweep(now=NOW + 10.5)
    assert swept.pruned == 0
    assert due is not None
    assert due <= NOW + 11
    assert await state_of(store, short) == "succeeded"
    swept, due = await store.sweep(now=NOW + 11)
    assert swept.pruned == 1
    assert await store.lookup(short) is None
    assert await state_of(store, long) == "succeeded"
    assert due is not None
    assert due <= NOW + 102
    swept, due = await store.sweep(now=NOW + 102)
    assert swept.pruned == 1
    assert due is None
    assert await store.lookup(long) is None
    await expect(store, enqueued=2, delivered=2, acked=2)


async def test_settle_many_and_settle_claim_take_results_by_task(store: Store) -> None:
    a, b, c, d = [await add(store) for _ in range(4)]
    first = await take(store, task_id=a)
    second = await take(store, task_id=b)
    acked, nacked = await store.settle_many(
        [(a, first.lease_id), (b, second.lease_id)],
        [],
        now=NOW + 1,
        results={a: b"[1]"},
    )
    assert acked == [None, None]
    assert nacked == []
    assert (await view(store, a)).task.result == b"[1]"
    assert await store.lookup(b) is None
    third = await take(store, task_id=c)
    acked, _, claimed = await store.settle_claim(
        [(c, third.lease_id)], [], [LEASE], now=NOW + 2, results={c: b'{"c": true}'}
    )
    assert acked == [None]
    assert [x.task.id for x in claimed] == [d]
    assert (await view(store, c)).task.result == b'{"c": true}'
    await expect(store, handed_out=1, succeeded=2, enqueued=4, delivered=4, acked=3)


async def test_a_result_given_to_a_failed_ack_is_not_kept(store: Store) -> None:
    task_id = await add(store)
    d = await take(store)
    acked, _ = await store.settle_many(
        [(task_id, "not-the-lease")], [], now=NOW, results={task_id: b"1"}
    )
    assert acked[0] is not None
    assert await state_of(store, task_id) == "handed_out"
    await store.ack(task_id, d.lease_id, now=NOW)
    assert await store.lookup(task_id) is None


async def test_results_count_in_the_held_hint(store: Store) -> None:
    if store.held_hint() is None:
        pytest.skip("this store cannot tell without I/O")
    await add(store, ttl=30.0)
    parent = await add(store, queue=P)
    await add(store, after=[parent], queue=C)
    assert store.held_hint() == 3  # ready, ready, waiting
    await run(store, result=b"1")
    assert store.held_hint() == 3  # succeeded, ready, waiting
    await store.sweep(now=NOW + 31)
    assert store.held_hint() == 2


async def test_the_succeeded_listing_is_in_finish_order_page_by_page(store: Store) -> None:
    made = [await add(store) for _ in range(7)]
    order = [made[i] for i in (3, 0, 6, 1, 5, 2, 4)]
    deliveries = {d.task.id: d for d in [await take(store) for _ in range(7)]}
    for i, task_id in enumerate(order):
        await store.ack(task_id, deliveries[task_id].lease_id, now=NOW + i, result=b"0")
    for limit in (1, 2, 3, 7, 100):
        assert await ids(store, DEFAULT_QUEUE, "succeeded", limit) == order
    page = await store.list_tasks(DEFAULT_QUEUE, "succeeded", limit=3)
    assert [t.task.result for t in page.tasks] == [b"0"] * 3
    assert [t.task.finished_at for t in page.tasks] == [NOW, NOW + 1, NOW + 2]
    # A page's cursor still holds when tasks before or at it are pruned meanwhile.
    assert page.after is not None
    await store.sweep(now=NOW + 3600 + 2.5)  # the first three finished at NOW .. NOW + 2
    rest = await store.list_tasks(DEFAULT_QUEUE, "succeeded", limit=10, after=page.after)
    assert [t.task.id for t in rest.tasks] == order[3:]
    assert rest.after is None


async def test_the_waiting_listing_is_in_enqueue_order_page_by_page(store: Store) -> None:
    parent = await add(store, queue=P)
    waiting = [await add(store, after=[parent], priority=i % 3) for i in range(7)]
    await add(store)  # ready: not listed
    for limit in (1, 2, 3, 7, 100):
        assert await ids(store, DEFAULT_QUEUE, "waiting", limit) == waiting
    page = await store.list_tasks(DEFAULT_QUEUE, "waiting", limit=3)
    assert [t.task.waiting_for for t in page.tasks] == [1, 1, 1]
    assert all(t.task.after == (parent,) for t in page.tasks)
    assert page.after is not None
    await store.cancel(waiting[1], now=NOW)  # one before the cursor goes: the next page holds
    rest = await store.list_tasks(DEFAULT_QUEUE, "waiting", limit=10, after=page.after)
    assert [t.task.id for t in rest.tasks] == waiting[3:]
    assert await ids(store, P, "waiting") == []
    assert await ids(store, "nowhere", "waiting") == []
    assert await ids(store, "nowhere", "succeeded") == []


# -- workflows: after -----------------------------------------------------------------------------


async def test_a_task_after_pending_parents_waits(store: Store) -> None:
    a = await add(store, queue=P)
    b = await add(store, queue=P, delay=30.0)
    (done,) = await store.enqueue_many([new(after=[a, b], queue=C)], now=NOW)
    task = done.task
    assert task is not None
    assert task.after == (a, b)
    assert task.waiting_for == 2
    child = done.id
    found = await view(store, child)
    assert found.state == "waiting"
    assert (found.task.after, found.task.waiting_for) == ((a, b), 2)
    assert found.task.payload == PAYLOAD
    assert await store.claim(lease=LEASE, now=NOW, queues=(C,)) is None
    await expect(store, ready=1, delayed=1, waiting=1, enqueued=3)
    stats = await store.stats(C)
    assert (stats.waiting, stats.ready) == (1, 0)
    rows = {q.name: q for q in await store.queues()}
    assert rows[C].waiting == 1
    assert rows[P].waiting == 0
    assert await store.children(a, limit=10) == ([child], 1)
    assert await store.children(child, limit=10) == ([], 0)
    assert await store.children(UNKNOWN, limit=10) == ([], 0)
    assert store.take_released() is None


async def test_the_last_parents_ack_releases_the_child_to_the_back_of_its_line(
    store: Store,
) -> None:
    a = await add(store, queue=P)
    b = await add(store, queue=P)
    child = await add(store, after=[a, b], queue=C, priority=5)
    earlier = await add(store, queue=C, priority=5)
    await run(store, P, result=b'"A"', now=NOW + 1, task_id=a)
    assert (await view(store, child)).task.waiting_for == 1
    assert store.take_released() is None
    later = await add(store, queue=C, priority=5, now=NOW + 1)
    await run(store, P, now=NOW + 2, task_id=b)  # (without a result: it counts as well)
    assert store.take_released() == Released({C}, None)
    assert store.take_released() is None
    found = await view(store, child)
    assert found.state == "ready"
    assert found.task.waiting_for == 0
    assert found.task.available_at == NOW + 2
    await expect(store, ready=3, succeeded=1, enqueued=5, delivered=2, acked=2)
    got = [(await take(store, C, NOW + 2)).task.id for _ in range(3)]
    assert got == [earlier, later, child]  # released after ``later`` was enqueued


async def test_a_released_child_with_a_delay_is_delayed_from_its_release(store: Store) -> None:
    parent = await add(store, queue=P)
    child = await add(store, after=[parent], queue=C, delay=20.0)
    assert await state_of(store, child) == "waiting"
    await run(store, P, now=NOW + 100, task_id=parent)
    assert store.take_released() == Released(set(), NOW + 120)
    found = await view(store, child)
    assert (found.state, found.task.available_at) == ("delayed", NOW + 120)
    await expect(store, delayed=1, enqueued=2, delivered=1, acked=1)
    assert await store.claim(lease=LEASE, now=NOW + 119, queues=(C,)) is None
    swept, _ = await store.sweep(now=NOW + 120)
    assert swept.promoted == 1
    await take(store, C, NOW + 120, child)


async def test_a_child_whose_parents_all_succeeded_is_ready_at_once(store: Store) -> None:
    a = await add(store, queue=P)
    b = await add(store, queue=P)
    await run(store, P, result=b'{"a": 1}', task_id=a)
    await run(store, P, result=b'{"b": 2}', task_id=b)
    (done,) = await store.enqueue_many([new(after=[b, a], queue=C)], now=NOW)
    assert done.task is not None
    assert done.task.waiting_for == 0
    assert await state_of(store, done.id) == "ready"
    delayed = await add(store, after=[a], queue=C, delay=5.0)
    assert await state_of(store, delayed) == "delayed"
    d = await take(store, C, task_id=done.id)
    assert d.parents == [ParentResult(b, b'{"b": 2}'), ParentResult(a, b'{"a": 1}')]
    await expect(store, handed_out=1, delayed=1, succeeded=2, enqueued=4, delivered=3, acked=2)


async def test_a_delivery_carries_its_parents_results_in_the_order_of_after(
    store: Store,
) -> None:
    a, b, c = [await add(store, queue=P) for _ in range(3)]
    child = await add(store, after=[c, a, b], queue=C, max_attempts=2)
    plain = await add(store, queue=C)
    await run(store, P, result=b'"a"', task_id=a)
    await run(store, P, task_id=b)  # no result: none to pass on
    await run(store, P, result=b'{"c": [3]}', task_id=c)
    assert (await take(store, C, task_id=plain)).parents is None  # no parents: None
    d = await take(store, C, task_id=child)
    want = [ParentResult(c, b'{"c": [3]}'), ParentResult(a, b'"a"'), ParentResult(b, None)]
    assert d.parents == want
    assert d.task.after == (c, a, b)
    # Every hand-out carries them, a retry's too.
    failure = await store.nack(child, d.lease_id, "again", now=NOW, delay=0.0)
    assert not failure.buried
    await store.sweep(now=NOW)
    again = await take(store, C, task_id=child)
    assert again.parents == want
    many = await store.claim_many([LEASE], now=NOW, queues=(C,))
    assert many == []


async def test_a_parent_named_by_its_index_in_the_same_call(store: Store) -> None:
    done = await store.enqueue_many(
        [new(queue=P), new(queue=P), new(after=[0, 1], queue=C), new(after=[2], queue=G)],
        now=NOW,
    )
    a, b, c, g = (x.id for x in done)
    assert done[2].task is not None
    assert done[2].task.after == (a, b)
    assert done[3].task is not None
    assert done[3].task.after == (c,)
    assert [await state_of(store, x) for x in (a, b, c, g)] == [
        "ready",
        "ready",
        "waiting",
        "waiting",
    ]
    await expect(store, ready=2, waiting=2, enqueued=4)
    await run(store, P, task_id=a)
    await run(store, P, task_id=b)
    await run(store, C, result=b"1", task_id=c)
    d = await take(store, G, task_id=g)
    assert d.parents == [ParentResult(c, b"1")]


async def test_an_index_may_name_a_duplicate_whose_task_is_live(store: Store) -> None:
    first = await add(store, queue=P, key="k")
    done = await store.enqueue_many([new(queue=P, key="k"), new(after=[0], queue=C)], now=NOW)
    assert (done[0].id, done[0].duplicate) == (first, True)
    child = done[1].id
    assert (await view(store, child)).task.after == (first,)
    assert await store.children(first, limit=5) == ([child], 1)


@pytest.mark.parametrize("how", ["unknown", "not an id", "acked", "cancelled", "expired"])
async def test_a_parent_that_is_not_live_refuses_the_whole_call(store: Store, how: str) -> None:
    ok = await add(store, queue=P)
    if how == "unknown":
        missing = UNKNOWN
    elif how == "not an id":
        missing = "nope"
    elif how == "acked":
        missing = await add(store, queue=G)
        await run(store, G, task_id=missing)
    elif how == "cancelled":
        missing = await add(store, queue=G)
        await store.cancel(missing, now=NOW)
    else:
        missing = await add(store, queue=G, expires_at=NOW + 1)
        await store.sweep(now=NOW + 1)
    assert await store.lookup(missing) is None
    before = await store.stats()
    items = [new(queue=C), new(after=[ok], queue=C), new(after=[0, ok, missing], queue=C)]
    with pytest.raises(UnknownParent) as raised:
        await store.enqueue_many(items, now=NOW)
    assert (raised.value.item, raised.value.position, raised.value.task_id) == (2, 2, missing)
    # Nothing of the call was enqueued.
    assert await store.stats() == before
    assert await store.children(ok, limit=10) == ([], 0)
    assert await ids(store, C, "ready") == []
    assert await ids(store, C, "waiting") == []


async def test_an_unknown_parent_of_a_lone_task_is_named(store: Store) -> None:
    with pytest.raises(UnknownParent) as raised:
        await store.enqueue_many([new(after=[UNKNOWN])], now=NOW)
    assert (raised.value.item, raised.value.position, raised.value.task_id) == (0, 0, UNKNOWN)
    await expect(store)


async def test_a_pruned_parent_is_not_live(store: Store) -> None:
    parent = await add(store, ttl=1.0)
    await run(store, result=b"1")
    await store.sweep(now=NOW + 1)
    with pytest.raises(UnknownParent):
        await store.enqueue_many([new(after=[parent])], now=NOW + 1)


async def test_a_child_of_a_dead_parent_is_born_dead(store: Store) -> None:
    parent = await add(store, queue=P)
    pending = await add(store, queue=P)
    await kill(store, P, "it broke")
    (done,) = await store.enqueue_many([new(after=[pending, parent], queue=C)], now=NOW)
    child = done.id
    found = await view(store, child)
    assert found.state == "dead"
    assert found.task.last_error == f"parent {parent} is dead: it broke"
    assert found.task.waiting_for == 0
    assert found.task.attempts == 0
    # Dead, but not counted buried: it never ran.
    await expect(store, ready=1, dead=2, enqueued=3, delivered=1, nacked=1, buried=1)
    assert [t.id for t in await store.dead_letters(queue=C)] == [child]
    assert await store.children(parent, limit=10) == ([child], 1)


async def test_a_dead_parent_buries_its_waiting_children_transitively(store: Store) -> None:
    parent = await add(store, queue=P)
    other = await add(store, queue=G)
    done = await store.enqueue_many(
        [new(after=[parent], queue=C), new(after=[0, other], queue=G), new(after=[1], queue=G)],
        now=NOW,
    )
    child, grandchild, great = (x.id for x in done)
    unrelated = await add(store, after=[other], queue=C)
    await kill(store, P, "disk full")
    child_error = f"parent {parent} is dead: disk full"
    grand_error = f"parent {child} is dead: {child_error}"
    assert (await view(store, child)).task.last_error == child_error
    assert (await view(store, grandchild)).task.last_error == grand_error
    assert (await view(store, great)).task.last_error == f"parent {grandchild} is dead: " + (
        grand_error
    )
    assert all([await state_of(store, x) == "dead" for x in (parent, child, grandchild, great)])
    assert await state_of(store, unrelated) == "waiting"
    # Only the parent is counted buried; the children moved from waiting to dead.
    await expect(store, ready=1, dead=4, waiting=1, enqueued=6, delivered=1, nacked=1, buried=1)
    dead_order = [t.id for t in await store.dead_letters()]
    assert dead_order == [parent, child, grandchild, great]


@pytest.mark.parametrize("how", ["reclaim", "sweep", "nack"])
async def test_a_parent_dying_any_way_buries_its_children(store: Store, how: str) -> None:
    parent = await add(store, queue=P, max_attempts=1)
    child = await add(store, after=[parent], queue=C)
    d = await take(store, P)
    if how == "reclaim":
        await store.reclaim(parent, d.lease_id, "worker gone", now=NOW)
        error = "worker gone"
        counts = {"reclaimed": 1}
    elif how == "sweep":
        swept, _ = await store.sweep(now=NOW + LEASE)
        assert swept.reclaimed == [(parent, d.lease_id)]
        error = "lease expired"
        counts = {"reclaimed": 1}
    else:
        await store.nack(parent, d.lease_id, "bad input", now=NOW)  # its last attempt
        error = "bad input"
        counts = {"nacked": 1}
    found = await view(store, child)
    assert found.state == "dead"
    assert found.task.last_error == f"parent {parent} is dead: {error}"
    await expect(store, dead=2, enqueued=2, delivered=1, buried=1, **counts)


async def test_a_parent_retried_does_not_bury_its_children(store: Store) -> None:
    parent = await add(store, queue=P, max_attempts=2)
    child = await add(store, after=[parent], queue=C)
    d = await take(store, P)
    failure = await store.nack(parent, d.lease_id, "once", now=NOW)
    assert not failure.buried
    assert await state_of(store, child) == "waiting"


@pytest.mark.parametrize("error", [None, ""])
async def test_a_dead_parent_without_an_error(store: Store, error: str | None) -> None:
    parent = await add(store, queue=P)
    child = await add(store, after=[parent], queue=C)
    d = await take(store, P)
    await store.nack(parent, d.lease_id, error, now=NOW, terminal=True)
    assert (await view(store, child)).task.last_error == f"parent {parent} is dead"
    born = await add(store, after=[parent], queue=C)
    assert (await view(store, born)).task.last_error == f"parent {parent} is dead"


async def test_a_childs_error_is_cut_to_the_usual_size(store: Store) -> None:
    parent = await add(store, queue=P)
    child = await add(store, after=[parent], queue=C)
    grandchild = await add(store, after=[child], queue=G)
    long = limits.error_value("é" * limits.MAX_ERROR_BYTES)
    assert long is not None
    await kill(store, P, long)
    for task_id in (child, grandchild):
        error = (await view(store, task_id)).task.last_error
        assert error is not None
        assert error.startswith("parent ")
        assert len(error.encode()) <= limits.MAX_ERROR_BYTES
        assert "truncated" in error


@pytest.mark.parametrize("how", ["ready", "delayed", "cancelling-nack", "cancelling-sweep"])
async def test_a_parent_cancelled_buries_its_waiting_children(store: Store, how: str) -> None:
    parent = await add(store, queue=P, delay=10.0 if how == "delayed" else 0.0)
    child = await add(store, after=[parent], queue=C)
    grandchild = await add(store, after=[child], queue=G)
    totals: dict[str, int] = {}
    if how in ("ready", "delayed"):
        assert (await store.cancel(parent, now=NOW)).state == CANCELLED
    else:
        d = await take(store, P)
        await store.cancel(parent, now=NOW)
        assert await state_of(store, child) == "waiting"  # (cancelling: not yet gone)
        if how == "cancelling-nack":
            failure = await store.nack(parent, d.lease_id, "stopped", now=NOW)
            assert failure == Failure(parent, False, None, cancelled=True)
        else:
            await store.sweep(now=NOW + LEASE)
        totals = {"delivered": 1}
    error = f"parent {parent} was cancelled"
    assert (await view(store, child)).task.last_error == error
    assert (await view(store, grandchild)).task.last_error == (f"parent {child} is dead: {error}")
    await expect(store, dead=2, enqueued=3, cancelled=1, **totals)


async def test_a_parent_that_expires_buries_its_waiting_children(store: Store) -> None:
    parent = await add(store, queue=P, expires_at=NOW + 5)
    child = await add(store, after=[parent], queue=C)
    swept, _ = await store.sweep(now=NOW + 5)
    assert swept.expired == 1
    found = await view(store, child)
    assert (found.state, found.task.last_error) == ("dead", f"parent {parent} expired")
    await expect(store, dead=1, enqueued=2, expired=1)


async def test_a_waiting_task_expires_and_buries_its_children(store: Store) -> None:
    parent = await add(store, queue=P)
    child = await add(store, after=[parent], queue=C, expires_at=NOW + 5)
    grandchild = await add(store, after=[child], queue=G)
    _, due = await store.sweep(now=NOW)
    assert due is not None
    assert due <= NOW + 5
    swept, _ = await store.sweep(now=NOW + 5)
    assert swept.expired == 1
    assert await store.lookup(child) is None
    found = await view(store, grandchild)
    assert (found.state, found.task.last_error) == ("dead", f"parent {child} expired")
    await expect(store, ready=1, dead=1, enqueued=3, expired=1)
    assert await store.children(parent, limit=5) == ([], 0)
    await run(store, P, task_id=parent)  # nothing left to release
    assert store.take_released() is None


async def test_a_waiting_task_cancelled_cancels_its_waiting_children(store: Store) -> None:
    parent = await add(store, queue=P)
    done = await store.enqueue_many(
        [new(after=[parent], queue=C), new(after=[0], queue=G), new(after=[1], queue=G)],
        now=NOW,
    )
    child, grandchild, great = (x.id for x in done)
    sibling = await add(store, after=[parent], queue=C)
    result = await store.cancel(child, now=NOW)
    assert (result.task_id, result.state, result.queue) == (child, CANCELLED, C)
    for task_id in (child, grandchild, great):
        assert await store.lookup(task_id) is None
    assert await state_of(store, sibling) == "waiting"
    await expect(store, ready=1, waiting=1, enqueued=5, cancelled=3)
    assert await store.children(parent, limit=5) == ([sibling], 1)
    with pytest.raises(NotFound):
        await store.cancel(child, now=NOW)


async def test_emptying_a_queue_cancels_its_waiting_tasks_too(store: Store) -> None:
    parent = await add(store, queue=P)
    waiting = [await add(store, after=[parent], queue=C) for _ in range(3)]
    await add(store, queue=C)
    await add(store, queue=C, delay=5.0)
    elsewhere = await add(store, after=[waiting[0]], queue=G)
    n = await store.empty_queue(C, now=NOW)
    assert n == 6  # three waiting, one ready, one delayed, and the child elsewhere
    assert await store.lookup(elsewhere) is None
    await expect(store, ready=1, enqueued=7, cancelled=6)
    assert await ids(store, C, "waiting") == []
    await run(store, P, task_id=parent)
    assert store.take_released() is None


async def test_emptying_a_parents_queue_buries_the_children_waiting_elsewhere(
    store: Store,
) -> None:
    parent = await add(store, queue=P)
    child = await add(store, after=[parent], queue=C)
    assert await store.empty_queue(P, now=NOW) == 1
    found = await view(store, child)
    assert (found.state, found.task.last_error) == ("dead", f"parent {parent} was cancelled")
    await expect(store, dead=1, enqueued=2, cancelled=1)


async def test_a_queue_with_waiting_tasks_is_not_deleted_and_its_results_go_with_it(
    store: Store,
) -> None:
    parent = await add(store, queue=P)
    child = await add(store, after=[parent], queue=C)
    with pytest.raises(Conflict, match="1 waiting"):
        await store.delete_queue(C)
    kept = await add(store, queue=G)
    await run(store, G, result=b"1", task_id=kept)
    await store.delete_queue(G)  # results held do not keep a queue
    assert await store.lookup(kept) is None
    assert G not in [q.name for q in await store.queues()]
    await run(store, P, result=b"2", task_id=parent)
    await run(store, C, result=b"3", task_id=child)
    await store.delete_queue(C)
    await store.delete_queue(P)
    assert await store.lookup(parent) is None
    await expect(store, enqueued=3, delivered=3, acked=3)


async def test_a_buried_child_requeued_runs_without_waiting_again(store: Store) -> None:
    good = await add(store, queue=P)
    bad = await add(store, queue=P)
    child = await add(store, after=[good, bad], queue=C)
    await run(store, P, result=b'"good"', task_id=good)
    await kill(store, P, "bad")
    assert await state_of(store, child) == "dead"
    await store.requeue(child, now=NOW + 1)
    found = await view(store, child)
    assert (found.state, found.task.waiting_for, found.task.last_error) == ("ready", 0, None)
    d = await take(store, C, NOW + 1, child)
    assert d.parents == [ParentResult(good, b'"good"'), ParentResult(bad, None)]
    await store.ack(child, d.lease_id, now=NOW + 1)
    await expect(
        store,
        dead=1,
        succeeded=1,
        enqueued=3,
        delivered=3,
        acked=2,
        nacked=1,
        buried=1,
        requeued=1,
    )


async def test_fan_out_one_parent_releases_ten_thousand_children_at_once(store: Store) -> None:
    parent = await add(store, queue=P)
    n = 10_000
    children = await add_many(store, [new(after=[parent], queue=C) for _ in range(n)])
    await expect(store, ready=1, waiting=n, enqueued=n + 1)
    names, count = await store.children(parent, limit=limits.MAX_CHILDREN_SHOWN)
    assert (names, count) == (children[: limits.MAX_CHILDREN_SHOWN], n)
    await run(store, P, result=b'"go"', now=NOW + 1, task_id=parent)
    assert store.take_released() == Released({C}, None)
    await expect(store, ready=n, succeeded=1, enqueued=n + 1, delivered=1, acked=1)
    got = await store.claim_many([LEASE] * 3, now=NOW + 1, queues=(C,))
    assert [d.task.id for d in got] == children[:3]
    assert all(d.parents == [ParentResult(parent, b'"go"')] for d in got)


async def test_fan_in_ten_thousand_parents_release_their_child_once(store: Store) -> None:
    n = 10_000
    parents = await add_many(store, [new(queue=P) for _ in range(n)])
    child = await add(store, after=parents, queue=C)
    assert (await view(store, child)).task.waiting_for == n
    for start in range(0, n, 1000):
        claimed = await store.claim_many([LEASE] * 1000, now=NOW, queues=(P,))
        acks = [(d.task.id, d.lease_id) for d in claimed]
        results = {d.task.id: b"1" for d in claimed[::2]}
        acked, _ = await store.settle_many(acks, [], now=NOW + 1, results=results)
        assert acked == [None] * len(acks)
        if start + 1000 < n:
            assert store.take_released() is None
            assert (await view(store, child)).task.waiting_for == n - start - 1000
    assert store.take_released() == Released({C}, None)
    d = await take(store, C, NOW + 1, child)
    assert d.parents is not None
    assert [p.id for p in d.parents] == parents
    assert [p.result for p in d.parents[:4]] == [b"1", None, b"1", None]
    await expect(store, handed_out=1, succeeded=n // 2, enqueued=n + 1, delivered=n + 1, acked=n)


# -- pins ----------------------------------------------------------------------------------------


async def test_a_result_pinned_by_a_child_outlives_its_ttl(store: Store) -> None:
    parent = await add(store, queue=P, ttl=10.0)
    other = await add(store, queue=P)
    child = await add(store, after=[parent, other], queue=C)
    await run(store, P, result=b'"p"', now=NOW, task_id=parent)
    swept, _ = await store.sweep(now=NOW + 100)
    assert swept.pruned == 0
    assert (await view(store, parent)).task.result == b'"p"'
    await run(store, P, now=NOW + 100, task_id=other)
    d = await take(store, C, NOW + 100, child)
    assert d.parents == [ParentResult(parent, b'"p"'), ParentResult(other, None)]
    await store.ack(child, d.lease_id, now=NOW + 101)
    await store.sweep(now=NOW + 102)  # (a store may prune it at once, or at the next sweep)
    assert await store.lookup(parent) is None
    await expect(store, enqueued=3, delivered=3, acked=3)


async def test_a_dead_child_pins_until_purged_and_a_requeued_one_until_it_ends(
    store: Store,
) -> None:
    parent = await add(store, queue=P, ttl=1.0)
    child = await add(store, after=[parent], queue=C, max_attempts=1)
    await run(store, P, result=b"7", task_id=parent)
    await kill(store, C, "no")
    await store.sweep(now=NOW + 50)
    assert await state_of(store, parent) == "succeeded"  # the dead child may be requeued
    await store.requeue(child, now=NOW + 50)
    await store.sweep(now=NOW + 60)
    assert await state_of(store, parent) == "succeeded"
    await kill(store, C, "still no", now=NOW + 60)
    await store.purge(child)
    await store.sweep(now=NOW + 61)
    assert await store.lookup(parent) is None
    assert await store.children(parent, limit=5) == ([], 0)


async def test_a_succeeded_child_no_longer_pins_but_is_still_listed(store: Store) -> None:
    parent = await add(store, queue=P, ttl=10.0)
    first = await add(store, after=[parent], queue=C, ttl=1000.0)
    second = await add(store, after=[parent], queue=C)
    await run(store, P, result=b"1", task_id=parent)
    await run(store, C, result=b"2", task_id=first)
    assert await store.children(parent, limit=5) == ([first, second], 2)
    assert await store.children(parent, limit=1) == ([first], 2)
    await store.sweep(now=NOW + 20)
    assert await state_of(store, parent) == "succeeded"  # ``second`` still pins it
    await run(store, C, task_id=second, now=NOW + 20)  # acked without a result: gone
    assert await store.children(parent, limit=5) in (([first], 1), ([], 0))
    await store.sweep(now=NOW + 21)
    assert await store.lookup(parent) is None
    assert (await view(store, first)).task.after == (parent,)  # it still names it


async def test_a_cancelled_child_unpins_its_parent(store: Store) -> None:
    parent = await add(store, queue=P, ttl=5.0)
    child = await add(store, after=[parent], queue=C, delay=60.0)
    await run(store, P, result=b"1", task_id=parent)
    assert await state_of(store, child) == "delayed"
    await store.sweep(now=NOW + 10)
    assert await state_of(store, parent) == "succeeded"
    await store.cancel(child, now=NOW + 10)
    await store.sweep(now=NOW + 11)
    assert await store.lookup(parent) is None


# -- watch and on_finished -----------------------------------------------------------------------


async def test_watch_answers_the_state_and_refuses_an_unknown_task(store: Store) -> None:
    with pytest.raises(NotFound):
        await store.watch(UNKNOWN)
    with pytest.raises(NotFound):
        await store.watch("nope")
    task_id = await add(store)
    assert (await store.watch(task_id)).state == "ready"
    await run(store, result=b'"r"')
    found = await store.watch(task_id)
    assert (found.state, found.task.result) == ("succeeded", b'"r"')


@pytest.mark.parametrize("how", ["succeeded", "acked", "ttl0", "settled"])
async def test_a_watched_task_acked_is_told(store: Store, how: str) -> None:
    told = Told(store)
    unwatched = await add(store, ttl=0.0 if how == "ttl0" else None)
    task_id = await add(store, ttl=0.0 if how == "ttl0" else None)
    assert (await store.watch(task_id)).state == "ready"
    first = await take(store, task_id=unwatched)
    d = await take(store, task_id=task_id)
    result = None if how == "acked" else b"1"
    await store.ack(unwatched, first.lease_id, now=NOW, result=result)
    if how == "settled":
        await store.settle_many([(task_id, d.lease_id)], [], now=NOW, results={task_id: b"1"})
    else:
        await store.ack(task_id, d.lease_id, now=NOW, result=result)
    state = "succeeded" if how in ("succeeded", "settled") else "acked"
    await told.wait_for((task_id, state))
    assert all(tid != unwatched for tid, _ in told.pairs)


async def test_a_watched_task_handed_out_and_waiting_ones_are_told(store: Store) -> None:
    told = Told(store)
    parent = await add(store, queue=P)
    child = await add(store, after=[parent], queue=C)
    d = await take(store, P)
    assert (await store.watch(parent)).state == "handed_out"
    assert (await store.watch(child)).state == "waiting"
    await store.ack(parent, d.lease_id, now=NOW, result=b"1")
    await told.wait_for((parent, "succeeded"))
    await run(store, C, task_id=child)
    await told.wait_for((child, "acked"))


async def test_watched_tasks_that_die_are_told_dead(store: Store) -> None:
    told = Told(store)
    parent = await add(store, queue=P)
    child = await add(store, after=[parent], queue=C)
    grandchild = await add(store, after=[child], queue=G)
    for task_id in (parent, child, grandchild):
        await store.watch(task_id)
    await kill(store, P)
    await told.wait_for((parent, "dead"), (child, "dead"), (grandchild, "dead"))


async def test_a_watched_task_reclaimed_to_death_by_the_sweep_is_told(store: Store) -> None:
    told = Told(store)
    task_id = await add(store, max_attempts=1)
    await store.watch(task_id)
    await take(store)
    await store.sweep(now=NOW + LEASE)
    await told.wait_for((task_id, "dead"))


async def test_a_watched_task_retried_is_not_told_until_it_ends(store: Store) -> None:
    told = Told(store)
    task_id = await add(store, max_attempts=2)
    marker = await add(store, queue=P)
    await store.watch(task_id)
    await store.watch(marker)
    d = await take(store)
    await store.nack(task_id, d.lease_id, "again", now=NOW, delay=0.0)
    await run(store, P, task_id=marker)
    await told.wait_for((marker, "acked"))
    assert all(tid != task_id for tid, _ in told.pairs)


@pytest.mark.parametrize("how", ["cancel", "cancel-waiting", "empty", "cancelling"])
async def test_watched_tasks_cancelled_are_told(store: Store, how: str) -> None:
    told = Told(store)
    parent = await add(store, queue=P)
    child = await add(store, after=[parent], queue=C)
    grandchild = await add(store, after=[child], queue=G)
    for task_id in (parent, child, grandchild):
        await store.watch(task_id)
    if how == "cancel":
        await store.cancel(parent, now=NOW)
        await told.wait_for((parent, "cancelled"), (child, "dead"), (grandchild, "dead"))
    elif how == "cancel-waiting":
        await store.cancel(child, now=NOW)
        await told.wait_for((child, "cancelled"), (grandchild, "cancelled"))
    elif how == "empty":
        await store.empty_queue(C, now=NOW)
        await told.wait_for((child, "cancelled"), (grandchild, "cancelled"))
    else:
        d = await take(store, P)
        await store.cancel(parent, now=NOW)
        await store.nack(parent, d.lease_id, None, now=NOW)
        await told.wait_for((parent, "cancelled"), (child, "dead"))


@pytest.mark.parametrize("state", ["ready", "waiting"])
async def test_watched_tasks_that_expire_are_told(store: Store, state: str) -> None:
    told = Told(store)
    parent = await add(store, queue=P)
    task_id = await add(
        store, after=[parent] if state == "waiting" else [], queue=C, expires_at=NOW + 1
    )
    assert (await store.watch(task_id)).state == state
    await store.sweep(now=NOW + 1)
    await told.wait_for((task_id, "expired"))


async def test_a_watch_of_an_ended_task_marks_nothing(store: Store) -> None:
    told = Told(store)
    task_id = await add(store, max_attempts=1)
    await kill(store)
    assert (await store.watch(task_id)).state == "dead"
    await store.requeue(task_id, now=NOW)
    marker = await add(store, queue=P)
    await store.watch(marker)
    await kill(store)
    await run(store, P, task_id=marker)
    await told.wait_for((marker, "acked"))
    assert (task_id, "dead") not in told.pairs  # watched before it was requeued: not now


# -- views and shapes ----------------------------------------------------------------------------


async def test_tasks_that_use_none_of_it_look_as_before(store: Store) -> None:
    (done,) = await store.enqueue_many([new()], now=NOW)
    assert done.task is not None
    assert (done.task.after, done.task.waiting_for, done.task.result_ttl) == (None, 0, None)
    d = await take(store)
    assert d.parents is None
    task: Task = d.task
    assert (task.result, task.finished_at, task.after, task.waiting_for) == (None, None, None, 0)
    await store.ack(d.task.id, d.lease_id, now=NOW)
    assert store.take_released() is None
    assert await store.lookup(d.task.id) is None


async def test_enqueue_answers_are_in_order_with_children_among_them(store: Store) -> None:
    done: list[Enqueued] = await store.enqueue_many(
        [new(queue=P), new(after=[0], queue=C, delay=3.0), new(queue=P, delay=2.0)], now=NOW
    )
    assert [d.task.queue for d in done if d.task is not None] == [P, C, P]
    child = done[1].task
    assert child is not None
    assert (child.after, child.waiting_for) == ((done[0].id,), 1)
    await expect(store, ready=1, delayed=1, waiting=1, enqueued=3)


async def test_requeue_all_and_nack_batches_keep_the_invariant(store: Store) -> None:
    parents = await add_many(store, [new(queue=P, max_attempts=1) for _ in range(3)])
    await add_many(store, [new(after=[p], queue=C) for p in parents])
    claimed = await store.claim_many([LEASE] * 3, now=NOW, queues=(P,))
    nacks = [NackItem(d.task.id, d.lease_id, "x") for d in claimed]
    _, failures = await store.settle_many([], nacks, now=NOW)
    assert all(isinstance(f, Failure) and f.buried for f in failures)
    await expect(store, dead=6, enqueued=6, delivered=3, nacked=3, buried=3)
    n, queues = await store.requeue_all(now=NOW)
    assert n == 6
    assert sorted(queues) == [C, P]
    await expect(store, ready=6, enqueued=6, delivered=3, nacked=3, buried=3, requeued=6)


async def test_a_diamond_of_waiting_tasks_cancelled_cancels_each_once(store: Store) -> None:
    parent = await add(store, queue=P)
    done = await store.enqueue_many(
        [
            new(after=[parent], queue=C),  # 0: cancelled
            new(after=[0], queue=C),  # 1
            new(after=[0], queue=G),  # 2
            new(after=[1, 2], queue=G),  # 3: a child of both
        ],
        now=NOW,
    )
    await store.cancel(done[0].id, now=NOW)
    for enqueued in done:
        assert await store.lookup(enqueued.id) is None
    await expect(store, ready=1, enqueued=5, cancelled=4)


async def test_a_cancelling_task_acked_with_a_result_succeeds_and_is_not_cancelling(
    store: Store,
) -> None:
    task_id = await add(store)
    d = await take(store)
    await store.cancel(task_id, now=NOW)
    await store.ack(task_id, d.lease_id, now=NOW, result=b"1")
    found = await view(store, task_id)
    assert (found.state, found.task.cancelling, found.task.result) == ("succeeded", False, b"1")


async def test_a_succeeded_task_cannot_be_cancelled_nor_requeued_nor_purged(store: Store) -> None:
    task_id = await add(store)
    await run(store, result=b"1")
    with pytest.raises(NotFound):
        await store.cancel(task_id, now=NOW)
    with pytest.raises(NotFound):
        await store.requeue(task_id, now=NOW)
    with pytest.raises(NotFound):
        await store.purge(task_id)
    assert await state_of(store, task_id) == "succeeded"
