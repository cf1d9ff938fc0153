"""When a dead task was buried (``buried_at``), on every store: set by every way to the
dead-letter queue (a nack with no attempts left, a terminal nack, a reclaim or a lease run out
with none left, a child buried with its dead parent, a child born dead), the same in a lookup,
the dead-letter queue and the dead listing, cleared by a requeue, and set again at a second
burial. Times are the ``now`` the calls pass (the fake clock's)."""

from __future__ import annotations

from tests.store.test_contract import LEASE, NOW, claim, enqueue
from tests.store.test_contract_results import add, kill, take
from wqbroker.store import Store


async def buried_at(store: Store, task_id: str) -> float | None:
    """The task's burial time as a lookup, the dead-letter queue and the dead listing show it
    (all three must agree); the task must be dead."""
    found = await store.lookup(task_id)
    assert found is not None
    assert found.state == "dead", found
    [dlq] = [t for t in await store.dead_letters() if t.id == task_id]
    page = await store.list_tasks(found.task.queue, "dead", limit=1000)
    [listed] = [s.task for s in page.tasks if s.task.id == task_id]
    assert found.task.buried_at == dlq.buried_at == listed.buried_at
    return found.task.buried_at


async def test_a_nack_with_no_attempts_left_keeps_its_burial_time(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=1)
    d = await claim(store, NOW + 1)
    assert d.task.buried_at is None  # (not dead: never set)
    await store.nack(task_id, d.lease_id, "boom", now=NOW + 5)
    assert await buried_at(store, task_id) == NOW + 5


async def test_a_terminal_nack_keeps_its_burial_time(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=5)
    d = await claim(store)
    failure = await store.nack(task_id, d.lease_id, "no", now=NOW + 7, terminal=True)
    assert failure.buried
    assert await buried_at(store, task_id) == NOW + 7


async def test_a_reclaim_with_none_left_keeps_its_burial_time(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=1)
    d = await claim(store)
    failure = await store.reclaim(task_id, d.lease_id, "gone", now=NOW + 3)
    assert failure.buried
    assert await buried_at(store, task_id) == NOW + 3


async def test_a_lease_run_out_with_none_left_is_buried_at_the_sweep(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=1)
    await claim(store)
    await store.sweep(now=NOW + LEASE + 2)
    assert await buried_at(store, task_id) == NOW + LEASE + 2


async def test_waiting_children_are_buried_with_their_parent(store: Store) -> None:
    parent = await add(store)
    child = await add(store, after=[parent])
    grandchild = await add(store, after=[child])
    await kill(store, now=NOW + 9)
    assert await buried_at(store, parent) == NOW + 9
    assert await buried_at(store, child) == NOW + 9
    assert await buried_at(store, grandchild) == NOW + 9


async def test_a_child_of_a_dead_parent_is_born_dead_at_its_enqueue(store: Store) -> None:
    parent = await add(store)
    await kill(store, now=NOW + 2)
    child = await add(store, now=NOW + 4, after=[parent])
    assert await buried_at(store, child) == NOW + 4


async def test_a_requeue_clears_it_and_a_second_burial_sets_it_again(store: Store) -> None:
    task_id = await enqueue(store, max_attempts=1)
    d = await claim(store)
    await store.nack(task_id, d.lease_id, "first", now=NOW + 1)
    await store.requeue(task_id, now=NOW + 2)
    found = await store.lookup(task_id)
    assert found is not None
    assert (found.state, found.task.buried_at) == ("ready", None)
    d = await take(store, now=NOW + 3)
    assert d.task.buried_at is None
    await store.nack(task_id, d.lease_id, "second", now=NOW + 20)
    assert await buried_at(store, task_id) == NOW + 20
    all_ = await store.requeue_all(now=NOW + 21)
    assert all_[0] == 1
    found = await store.lookup(task_id)
    assert found is not None
    assert (found.state, found.task.buried_at) == ("ready", None)


async def test_children_of_a_cancelled_parent_are_buried_at_the_cancel(store: Store) -> None:
    parent = await add(store)
    child = await add(store, after=[parent])
    await store.cancel(parent, now=NOW + 6)
    assert await buried_at(store, child) == NOW + 6


async def test_children_of_an_emptied_queue_s_task_are_buried_at_the_empty(store: Store) -> None:
    parent = await add(store, queue="a")
    child = await add(store, after=[parent], queue="b")
    assert await store.empty_queue("a", now=NOW + 8) == 1
    assert await buried_at(store, child) == NOW + 8


async def test_children_of_a_released_cancelling_parent_are_buried_at_the_release(
    store: Store,
) -> None:
    parent = await add(store)
    child = await add(store, after=[parent])
    d = await take(store, task_id=parent)
    await store.cancel(parent, now=NOW + 1)  # (handed out: cancelling)
    assert await store.release(parent, d.lease_id, now=NOW + 4)
    assert await buried_at(store, child) == NOW + 4


async def test_children_of_an_expired_parent_are_buried_at_the_sweep(store: Store) -> None:
    parent = await add(store, expires_at=NOW + 10)
    child = await add(store, after=[parent])
    await store.sweep(now=NOW + 12)
    assert await buried_at(store, child) == NOW + 12
