"""The store contract's schedules (docs/design/schedules.md), checked against every backend: a
schedule's row put, replaced (what a replace keeps), left as it stands when unchanged, listed,
deleted, paused and resumed (each change a new revision); the due ones and the earliest of the
others; a fire, a compare-and-set on the next fire time and the revision that enqueues the task
as any enqueue does (gauges, counters, the queue made) with its schedule and scheduled time in
every view of it (the answer, a lookup, a listing, a delivery, the dead-letter queue; an SQLite
task gone cold and read back too), and moves the row on, in one transaction; fires racing for
one time (exactly one wins); a fire refused by the broker (``skip_schedule``: only the next fire
time moves). As the other contract suites: an explicit ``now`` everywhere, ``expect`` checks
every gauge and counter and the invariant."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from tests.helpers import SQLITE_HOT
from tests.store.test_contract import LEASE, NOW, PAYLOAD, expect
from wqbroker.models import (
    DEFAULT_QUEUE,
    NewTask,
    Schedule,
    ScheduleTask,
)
from wqbroker.store import Store

TASK = ScheduleTask(b'{"report": "nightly"}', "reports", 3, 5, None, None, None)


@pytest.fixture(autouse=True)
async def _structures_agree(store: Store) -> AsyncIterator[None]:
    yield
    check = getattr(store, "check_invariants", None)
    if check is not None:
        checked = check()
        if inspect.isawaitable(checked):
            await checked


def schedule(
    name: str = "nightly",
    *,
    cron: str | None = "0 3 * * *",
    timezone: str = "UTC",
    every: float | None = None,
    task: ScheduleTask = TASK,
    paused: bool = False,
    next_fire_at: float | None = NOW + 60,
) -> Schedule:
    """A schedule as the service hands it to put_schedule (times: the store's to set)."""
    if every is not None:
        cron = None
    return Schedule(
        name,
        task,
        cron,
        timezone,
        every,
        paused,
        created_at=NOW,
        updated_at=NOW,
        next_fire_at=None if paused else next_fire_at,
    )


def fired(s: Schedule, scheduled_for: float, now: float = NOW) -> NewTask:
    """The task a fire of ``s`` enqueues (as the service makes it)."""
    t = s.task
    new = NewTask(
        t.payload,
        t.max_attempts,
        0.0,
        t.queue,
        t.priority,
        schedule=s.name,
        scheduled_for=scheduled_for,
    )
    if t.result_ttl is not None:
        new.result_ttl, new.result_ttl_given = t.result_ttl, True
    if t.expires_in is not None:
        new.expires_at = now + t.expires_in
    new.timeout = t.timeout
    return new


async def fire(store: Store, s: Schedule, following: float, now: float | None = None) -> str | None:
    """Fire ``s`` as read (for its next fire time): the task's id, or None if the
    compare-and-set failed."""
    assert s.next_fire_at is not None
    at = s.next_fire_at if now is None else now
    done = await store.fire_schedule(
        s.name,
        s.next_fire_at,
        s.next_fire_at,
        following,
        fired(s, s.next_fire_at, at),
        now=at,
        revision=s.revision,
    )
    if done is None:
        return None
    assert not done.duplicate
    assert done.task is not None
    return done.id


async def stored(store: Store, name: str = "nightly") -> Schedule:
    found = await store.get_schedule(name)
    assert found is not None, f"no schedule {name}"
    return found


# -- the rows -------------------------------------------------------------------------------------


async def test_a_new_schedule_is_stored_as_given_with_its_times(store: Store) -> None:
    assert await store.get_schedule("nightly") is None
    put = await store.put_schedule(schedule(), now=NOW + 1)
    assert (put.name, put.cron, put.timezone, put.every, put.task) == (
        "nightly",
        "0 3 * * *",
        "UTC",
        None,
        TASK,
    )
    assert (put.paused, put.created_at, put.updated_at, put.next_fire_at) == (
        False,
        NOW + 1,
        NOW + 1,
        NOW + 60,
    )
    assert (put.last_fire_at, put.last_task_id, put.fires) == (None, None, 0)
    assert put.revision > 0
    assert await stored(store) == put
    every = await store.put_schedule(schedule("tick", every=1.5), now=NOW)
    assert (every.cron, every.every) == (None, 1.5)
    await expect(store)  # (no task, no counter: a schedule is no task)


async def test_every_task_member_is_kept(store: Store) -> None:
    task = ScheduleTask(b'[1, "\\u00e9", null]', "q.1", 9, 2**31 - 1, 60.5, 0.25, 0.0)
    await store.put_schedule(schedule(task=task, timezone="Europe/Berlin"), now=NOW)
    got = await stored(store)
    assert got.task == task
    assert got.timezone == "Europe/Berlin"


async def test_schedules_are_listed_by_name(store: Store) -> None:
    assert await store.list_schedules() == []
    for name in ("b", "c", "a"):
        await store.put_schedule(schedule(name), now=NOW)
    assert [s.name for s in await store.list_schedules()] == ["a", "b", "c"]


async def test_a_replace_keeps_the_history_and_with_the_same_rule_the_next_fire(
    store: Store,
) -> None:
    first = await store.put_schedule(schedule(), now=NOW)
    task_id = await fire(store, first, NOW + 120)
    assert task_id is not None
    # The same rule, another task: the next fire time kept (the one given is ignored).
    other = replace(TASK, payload=b'"other"', priority=1)
    again = await store.put_schedule(schedule(task=other, next_fire_at=NOW + 999), now=NOW + 10)
    assert (again.created_at, again.updated_at, again.next_fire_at) == (NOW, NOW + 10, NOW + 120)
    assert (again.fires, again.last_fire_at, again.last_task_id) == (1, NOW + 60, task_id)
    assert again.task == other
    assert again.revision > first.revision
    # Another rule: the next fire time given.
    third = await store.put_schedule(
        schedule(cron="0 4 * * *", task=other, next_fire_at=NOW + 500), now=NOW + 20
    )
    assert (third.cron, third.next_fire_at, third.created_at, third.fires) == (
        "0 4 * * *",
        NOW + 500,
        NOW,
        1,
    )
    assert third.revision > again.revision
    # Another zone is another rule too.
    fourth = await store.put_schedule(
        schedule(cron="0 4 * * *", timezone="Asia/Tokyo", task=other, next_fire_at=NOW + 700),
        now=NOW + 30,
    )
    assert fourth.next_fire_at == NOW + 700
    assert await stored(store) == fourth


async def test_a_put_the_same_as_stored_leaves_it_as_it_stands(store: Store) -> None:
    first = await store.put_schedule(schedule(), now=NOW)
    same = await store.put_schedule(schedule(next_fire_at=NOW + 999), now=NOW + 50)
    assert same == first  # (not written: the same revision, updated_at, next fire time)
    assert await stored(store) == first


async def test_a_paused_put_has_no_next_fire_and_a_resuming_put_the_one_given(
    store: Store,
) -> None:
    await store.put_schedule(schedule(), now=NOW)
    paused = await store.put_schedule(schedule(paused=True), now=NOW + 1)
    assert (paused.paused, paused.next_fire_at) == (True, None)
    again = await store.put_schedule(schedule(next_fire_at=NOW + 300), now=NOW + 2)
    assert (again.paused, again.next_fire_at) == (False, NOW + 300)
    assert again.revision > paused.revision


async def test_a_schedule_is_deleted(store: Store) -> None:
    await store.put_schedule(schedule(), now=NOW)
    assert await store.delete_schedule("nightly") is True
    assert await store.get_schedule("nightly") is None
    assert await store.delete_schedule("nightly") is False
    assert await store.list_schedules() == []
    assert await store.due_schedules(NOW + 3600) == (NOW + 3600, [], None)


async def test_pause_and_resume(store: Store) -> None:
    assert await store.set_schedule_paused("nope", True, None, now=NOW) is None
    put = await store.put_schedule(schedule(), now=NOW)
    paused = await store.set_schedule_paused("nightly", True, None, now=NOW + 5)
    assert paused is not None
    assert (paused.paused, paused.next_fire_at, paused.updated_at) == (True, None, NOW + 5)
    assert paused.revision > put.revision
    # Paused already: left as it stands.
    again = await store.set_schedule_paused("nightly", True, None, now=NOW + 6)
    assert again == paused
    resumed = await store.set_schedule_paused("nightly", False, NOW + 400, now=NOW + 7)
    assert resumed is not None
    assert (resumed.paused, resumed.next_fire_at, resumed.updated_at) == (False, NOW + 400, NOW + 7)
    assert resumed.revision > paused.revision
    # Not paused: left as it stands (its next fire time too).
    assert await store.set_schedule_paused("nightly", False, NOW + 9, now=NOW + 8) == resumed
    assert await stored(store) == resumed


# -- due ------------------------------------------------------------------------------------------


async def test_the_due_schedules_and_the_earliest_of_the_others(store: Store) -> None:
    assert await store.due_schedules(NOW) == (NOW, [], None)
    await store.put_schedule(schedule("late", next_fire_at=NOW + 30), now=NOW)
    await store.put_schedule(schedule("early", next_fire_at=NOW + 10), now=NOW)
    await store.put_schedule(schedule("later", next_fire_at=NOW + 50), now=NOW)
    await store.put_schedule(schedule("off", paused=True), now=NOW)
    now, due, later = await store.due_schedules(NOW + 5)
    assert (now, due, later) == (NOW + 5, [], NOW + 10)
    now, due, later = await store.due_schedules(NOW + 30)
    assert now == NOW + 30
    assert [s.name for s in due] == ["early", "late"]  # (earliest first; at the time: due)
    assert due[0] == await stored(store, "early")
    assert later == NOW + 50
    now, due, later = await store.due_schedules(NOW + 1000)
    assert ([s.name for s in due], later) == (["early", "late", "later"], None)


async def test_a_paused_schedule_is_never_due(store: Store) -> None:
    await store.put_schedule(schedule(), now=NOW)
    await store.set_schedule_paused("nightly", True, None, now=NOW)
    assert await store.due_schedules(NOW + 10**6) == (NOW + 10**6, [], None)


# -- fires ----------------------------------------------------------------------------------------


async def test_a_fire_enqueues_the_task_and_moves_the_schedule_on(store: Store) -> None:
    s = await store.put_schedule(schedule(), now=NOW)
    done = await store.fire_schedule(
        "nightly",
        NOW + 60,
        NOW + 60,
        NOW + 120,
        fired(s, NOW + 60),
        now=NOW + 61,
        revision=s.revision,
    )
    assert done is not None
    assert done.task is not None
    assert not done.duplicate
    task = done.task
    assert (task.payload, task.queue, task.priority, task.max_attempts, task.attempts) == (
        TASK.payload,
        "reports",
        3,
        5,
        0,
    )
    assert (task.schedule, task.scheduled_for) == ("nightly", NOW + 60)
    assert task.created_at == pytest.approx(NOW + 61)
    await expect(store, ready=1, enqueued=1)
    assert [q.name for q in await store.queues()] == ["reports"]  # (the queue made)
    after = await stored(store)
    assert (after.next_fire_at, after.last_fire_at, after.last_task_id, after.fires) == (
        NOW + 120,
        NOW + 60,
        done.id,
        1,
    )
    assert (after.revision, after.updated_at) == (s.revision, s.updated_at)  # (a fire: no change)
    # Its next fire, from the row as it now stands.
    assert await fire(store, after, NOW + 180) is not None
    await expect(store, ready=2, enqueued=2)
    assert (await stored(store)).fires == 2


async def test_a_fired_task_shows_its_schedule_in_every_view(store: Store) -> None:
    s = await store.put_schedule(schedule(), now=NOW)
    task_id = await fire(store, s, NOW + 120)
    assert task_id is not None
    found = await store.lookup(task_id)
    assert found is not None
    assert (found.state, found.task.schedule, found.task.scheduled_for) == (
        "ready",
        "nightly",
        NOW + 60,
    )
    page = await store.list_tasks("reports", "ready", limit=10)
    assert [(t.task.id, t.task.schedule, t.task.scheduled_for) for t in page.tasks] == [
        (task_id, "nightly", NOW + 60)
    ]
    d = await store.claim(lease=LEASE, now=NOW + 70, queues=("reports",))
    assert d is not None
    assert (d.task.id, d.task.schedule, d.task.scheduled_for) == (task_id, "nightly", NOW + 60)
    assert d.task.payload == TASK.payload
    handed = await store.list_tasks("reports", "handed_out", limit=10)
    assert [t.task.schedule for t in handed.tasks] == ["nightly"]
    await store.nack(task_id, d.lease_id, "no", now=NOW + 71, terminal=True)
    (dead,) = await store.dead_letters()
    assert (dead.id, dead.schedule, dead.scheduled_for, dead.last_error) == (
        task_id,
        "nightly",
        NOW + 60,
        "no",
    )
    listed = await store.list_tasks("reports", "dead", limit=10)
    assert [t.task.scheduled_for for t in listed.tasks] == [NOW + 60]
    # Requeued, claimed again: still its schedule's.
    await store.requeue(task_id, now=NOW + 72)
    again = await store.claim(lease=LEASE, now=NOW + 73, queues=("reports",))
    assert again is not None
    assert (again.task.schedule, again.task.scheduled_for) == ("nightly", NOW + 60)
    await store.ack(task_id, again.lease_id, now=NOW + 74)
    await expect(store, enqueued=1, delivered=2, nacked=1, buried=1, requeued=1, acked=1)


async def test_ordinary_tasks_have_no_schedule(store: Store) -> None:
    (done,) = await store.enqueue_many([NewTask(PAYLOAD, 3, 0.0)], now=NOW)
    assert done.task is not None
    assert (done.task.schedule, done.task.scheduled_for) == (None, None)
    found = await store.lookup(done.id)
    assert found is not None
    assert found.task.schedule is None
    d = await store.claim(lease=LEASE, now=NOW)
    assert d is not None
    assert (d.task.schedule, d.task.scheduled_for) == (None, None)


async def test_a_fired_tasks_options_are_the_schedules(store: Store) -> None:
    task = ScheduleTask(b'"x"', DEFAULT_QUEUE, 0, 1, 30.0, 5.0, 120.0)
    s = await store.put_schedule(schedule(task=task), now=NOW)
    done = await store.fire_schedule(
        "nightly",
        NOW + 60,
        NOW + 60,
        NOW + 120,
        fired(s, NOW + 60, NOW + 60),
        now=NOW + 60,
        revision=s.revision,
    )
    assert done is not None
    found = await store.lookup(done.id)
    assert found is not None
    t = found.task
    assert (t.max_attempts, t.expires_at, t.timeout, t.result_ttl) == (1, NOW + 90, 5.0, 120.0)
    # It expires as any task: not handed out at or after its expiry.
    assert await store.claim(lease=LEASE, now=NOW + 90) is None
    await expect(store, enqueued=1, expired=1)


@pytest.mark.parametrize("why", ["expected", "revision", "paused", "unknown", "deleted", "changed"])
async def test_a_fire_of_a_schedule_not_as_read_does_nothing(store: Store, why: str) -> None:
    s = await store.put_schedule(schedule(), now=NOW)
    expected, revision, name = NOW + 60, s.revision, "nightly"
    if why == "expected":
        expected = NOW + 59
    elif why == "revision":
        revision += 1000
    elif why == "paused":
        await store.set_schedule_paused("nightly", True, None, now=NOW)
        expected = NOW + 60
    elif why == "unknown":
        name = "other"
    elif why == "deleted":
        await store.delete_schedule("nightly")
    else:  # another task, the same rule: the same next fire time, a new revision
        changed = await store.put_schedule(schedule(task=replace(TASK, priority=0)), now=NOW)
        assert changed.next_fire_at == expected
    done = await store.fire_schedule(
        name, expected, NOW + 60, NOW + 120, fired(s, NOW + 60), now=NOW + 60, revision=revision
    )
    assert done is None
    await expect(store)
    assert await store.queues() == []
    found = await store.get_schedule("nightly")
    if found is not None:
        assert (found.fires, found.last_task_id) == (0, None)


async def test_a_time_fires_once(store: Store) -> None:
    s = await store.put_schedule(schedule(), now=NOW)
    assert await fire(store, s, NOW + 120) is not None
    assert await fire(store, s, NOW + 120) is None  # (the same read again: moved on)
    await expect(store, ready=1, enqueued=1)


async def test_fires_racing_for_one_time_enqueue_one_task(store: Store) -> None:
    s = await store.put_schedule(schedule(), now=NOW)
    got = await asyncio.gather(*(fire(store, s, NOW + 120) for _ in range(8)))
    assert len([g for g in got if g is not None]) == 1
    await expect(store, ready=1, enqueued=1)
    assert (await stored(store)).fires == 1


async def test_a_refused_fire_only_moves_on(store: Store) -> None:
    s = await store.put_schedule(schedule(), now=NOW)
    assert await store.skip_schedule("nightly", NOW + 59, NOW + 120, revision=s.revision) is False
    assert (
        await store.skip_schedule("nightly", NOW + 60, NOW + 120, revision=s.revision + 9) is False
    )
    assert await store.skip_schedule("nightly", NOW + 60, NOW + 120, revision=s.revision) is True
    after = await stored(store)
    assert (after.next_fire_at, after.fires, after.last_fire_at, after.last_task_id) == (
        NOW + 120,
        0,
        None,
        None,
    )
    assert after.revision == s.revision
    assert await store.skip_schedule("nightly", NOW + 60, NOW + 180, revision=s.revision) is False
    assert await store.skip_schedule("other", NOW + 60, NOW + 180, revision=s.revision) is False
    await expect(store)


async def test_many_fired_tasks_past_the_hot_ones_keep_their_schedules(store: Store) -> None:
    """More fired tasks than an SQLite store keeps hot in the tests (the rest go cold: ids only,
    read back from the file when their turn comes)."""
    s = await store.put_schedule(schedule(every=1.0, next_fire_at=NOW + 1), now=NOW)
    n = SQLITE_HOT * 3
    for i in range(n):
        assert await fire(store, s, NOW + i + 2, now=NOW + i + 1) is not None
        s = await stored(store)
    await expect(store, ready=n, enqueued=n)
    page = await store.list_tasks("reports", "ready", limit=n)
    assert [t.task.scheduled_for for t in page.tasks] == [NOW + i + 1 for i in range(n)]
    for i in range(n):
        d = await store.claim(lease=LEASE, now=NOW + 100, queues=("reports",))
        assert d is not None
        assert (d.task.schedule, d.task.scheduled_for) == ("nightly", NOW + i + 1)
        assert d.task.payload == TASK.payload
        found = await store.lookup(d.task.id)
        assert found is not None
        assert found.task.scheduled_for == NOW + i + 1
