"""The service's schedules (docs/design/schedules.md), on a fake clock and every store: the calls
(checked, NotFound for unknown names), and the firing: exactly once per scheduled time, at that
time (the sweeper wakes for it), once for the most recent missed time after a downtime, never for
a time before the schedule was put, not while paused, with a replaced rule or task, a fire the
broker's limits refuse moving on, the events told; SQLite: schedules and their next fire times
survive a restart; PostgreSQL: three brokers on one database racing to fire the same schedules
make exactly one task per (schedule, scheduled time), and a restarted one fires nothing twice."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests import pg
from tests.helpers import make_store, wait_until
from wqbroker.clock import FakeClock
from wqbroker.errors import InvalidArgument, NotFound, Overloaded, StoreError
from wqbroker.events import Events
from wqbroker.models import Schedule, Task
from wqbroker.retry import Backoff
from wqbroker.schedules import Rule
from wqbroker.service import ScheduleSubmission, Service
from wqbroker.store import Store
from wqbroker.store.postgres import PostgresStore
from wqbroker.store.sqlite import SqliteStore

PAYLOAD = b'{"job": "tick"}'
Q = "ticks"


class Fired(Events):
    """The fires told (name, late, failed)."""

    def __init__(self) -> None:
        self.fires: list[tuple[str, float, bool]] = []

    def fired(self, schedule: str, late: float, failed: bool = False) -> None:
        self.fires.append((schedule, late, failed))


@pytest.fixture
def fired() -> Fired:
    return Fired()


@pytest.fixture
async def svc(store: Store, clock: FakeClock, fired: Fired) -> AsyncIterator[Service]:
    """A service not started: no sweeper, nothing runs but what a test calls (sweep())."""
    service = Service(store, clock, events=fired)
    yield service
    await service.close()


def every(ms: int, **members: object) -> ScheduleSubmission:
    members.setdefault("queue", Q)
    return ScheduleSubmission(PAYLOAD, every_ms=ms, **members)


def cron(expr: str, **members: object) -> ScheduleSubmission:
    members.setdefault("queue", Q)
    return ScheduleSubmission(PAYLOAD, cron=expr, **members)


async def tasks(store: Store, queue: str = Q) -> list[Task]:
    """Every ready task of ``queue``, in order."""
    out: list[Task] = []
    after = None
    while True:
        page = await store.list_tasks(queue, "ready", limit=500, after=after)
        out += [t.task for t in page.tasks]
        if page.after is None:
            return out
        after = page.after


async def times(store: Store, queue: str = Q) -> list[float]:
    return [t.scheduled_for or 0.0 for t in await tasks(store, queue)]


async def step(svc: Service, clock: FakeClock, seconds: float) -> float | None:
    clock.advance(seconds)
    return await svc.sweep()


# -- the calls -------------------------------------------------------------------------------------


async def test_a_put_schedule_fires_first_at_its_rules_first_time_after_now(
    svc: Service, clock: FakeClock
) -> None:
    s = await svc.put_schedule("tick", every(10_000))
    assert (s.name, s.every, s.cron, s.next_fire_at, s.created_at) == (
        "tick",
        10.0,
        None,
        clock.now() + 10,
        clock.now(),
    )
    hourly = await svc.put_schedule("hourly", cron("@hourly", timezone="Asia/Kolkata"))
    assert hourly.next_fire_at == Rule.parse("0 * * * *", "Asia/Kolkata").next_after(clock.now())
    assert (hourly.cron, hourly.timezone) == ("@hourly", "Asia/Kolkata")
    assert await svc.get_schedule("tick") == s
    assert [x.name for x in await svc.list_schedules()] == ["hourly", "tick"]


@pytest.mark.parametrize(
    ("name", "sub", "named"),
    [
        ("bad name", every(1000), "name"),
        ("s", cron("0 0 * * * *"), "cron"),
        ("s", cron("nope"), "cron"),
        ("s", cron("0 * * * *", timezone="Mars/Base"), "timezone"),
        ("s", every(10), "every_ms"),
        ("s", every(1000, priority=11), "priority"),
        ("s", every(1000, queue="a/b"), "queue"),
        ("s", ScheduleSubmission(None, every_ms=1000), "payload"),
        ("s", ScheduleSubmission(PAYLOAD), "cron or every_ms"),
    ],
)
async def test_a_bad_schedule_is_refused_naming_the_member(
    svc: Service, name: str, sub: ScheduleSubmission, named: str
) -> None:
    with pytest.raises(InvalidArgument) as e:
        await svc.put_schedule(name, sub)
    assert e.value.message.startswith(named)
    assert await svc.list_schedules() == []


async def test_new_schedules_past_the_limit_are_refused_and_replaces_are_not(
    svc: Service,
) -> None:
    svc.max_schedules = 2
    await svc.put_schedule("a", every(1000))
    await svc.put_schedule("b", every(1000))
    with pytest.raises(Overloaded, match="at most 2 schedules and has 2"):
        await svc.put_schedule("c", every(1000))
    assert [s.name for s in await svc.list_schedules()] == ["a", "b"]
    replaced = await svc.put_schedule("b", every(2000))  # a replace always has room
    assert replaced.every == 2.0
    await svc.delete_schedule("a")
    await svc.put_schedule("c", every(1000))
    assert [s.name for s in await svc.list_schedules()] == ["b", "c"]
    assert await svc.store.schedule_count() == 2


async def test_unknown_names_are_not_found(svc: Service) -> None:
    for call in (svc.get_schedule, svc.delete_schedule, svc.pause_schedule, svc.resume_schedule):
        with pytest.raises(NotFound, match="schedule nope does not exist"):
            await call("nope")
    with pytest.raises(InvalidArgument, match="name"):
        await svc.get_schedule(7)


async def test_a_deleted_schedule_fires_no_more(svc: Service, clock: FakeClock) -> None:
    await svc.put_schedule("tick", every(1000))
    await svc.delete_schedule("tick")
    await step(svc, clock, 5)
    assert await svc.list_schedules() == []
    assert (await svc.stats()).totals.enqueued == 0


# -- firing ----------------------------------------------------------------------------------------


async def test_each_time_fires_exactly_once(
    svc: Service, store: Store, clock: FakeClock, fired: Fired
) -> None:
    start = clock.now()
    await svc.put_schedule("tick", every(10_000))
    for _ in range(200):  # 100 s, looked at twice a second (and twice at once, now and then)
        clock.advance(0.5)
        await asyncio.gather(svc.sweep(), svc.sweep())
    assert await times(store) == [start + 10 * k for k in range(1, 11)]
    got = await tasks(store)
    assert {(t.schedule, t.payload, t.queue) for t in got} == {("tick", PAYLOAD, Q)}
    assert len(fired.fires) == 10
    assert all(name == "tick" and not failed and late < 0.5 for name, late, failed in fired.fires)
    s = await svc.get_schedule("tick")
    assert (s.fires, s.last_fire_at, s.last_task_id, s.next_fire_at) == (
        10,
        start + 100,
        got[-1].id,
        start + 110,
    )


async def test_the_sweeper_wakes_at_the_next_fire_time(
    store: Store, clock: FakeClock, fired: Fired
) -> None:
    service = Service(store, clock, events=fired)
    await service.start()
    try:
        start = clock.now()
        s = await service.put_schedule("tick", every(7_000))
        assert s.next_fire_at == start + 7
        clock.advance(6.999)
        clock.advance(0.001)  # (7 s: the sweeper's timer is set for the fire, not a tick later)
        got = await wait_until(lambda: times(store), lambda ts: ts != [], what="the fire")
        assert got == [start + 7]
        assert fired.fires == [("tick", 0.0, False)]
        (task,) = await tasks(store)
        assert task.created_at == pytest.approx(start + 7)
    finally:
        await service.close()


async def test_after_a_downtime_a_schedule_fires_once_for_the_most_recent_missed_time(
    svc: Service, store: Store, clock: FakeClock, fired: Fired
) -> None:
    start = clock.now()
    await svc.put_schedule("tick", every(60_000))
    await svc.put_schedule("minutely", cron("* * * * *", queue="m"))
    clock.advance(3 * 86400 + 30.5)  # three days away, no sweep
    await svc.sweep()
    assert await times(store) == [start + 3 * 86400]  # (every: its chain from the put)
    minute = Rule.parse("* * * * *").latest_at_or_before(clock.now(), start)
    assert await times(store, "m") == [minute]
    assert sorted(name for name, _, _ in fired.fires) == ["minutely", "tick"]
    late = dict((name, late) for name, late, _ in fired.fires)
    assert late["tick"] == pytest.approx(30.5)
    # Then on from there, as usual.
    assert (await svc.get_schedule("tick")).next_fire_at == start + 3 * 86400 + 60
    await step(svc, clock, 30)
    assert await times(store) == [start + 3 * 86400, start + 3 * 86400 + 60]


async def test_a_schedule_never_fires_for_a_time_before_it_was_put(
    svc: Service, store: Store, clock: FakeClock
) -> None:
    hour = Rule.parse("0 * * * *").next_after(clock.now())
    clock.advance(hour - clock.now() - 0.5)  # half a second before the hour
    await svc.sweep()
    s = await svc.put_schedule("hourly", cron("0 * * * *"))
    assert s.next_fire_at == hour
    await svc.sweep()
    await step(svc, clock, 0.25)
    assert await times(store) == []
    await step(svc, clock, 0.25)
    assert await times(store) == [hour]
    (task,) = await tasks(store)
    assert task.scheduled_for is not None
    assert task.scheduled_for > s.created_at


async def test_a_paused_schedule_does_not_fire_and_resumes_from_now(
    svc: Service, store: Store, clock: FakeClock
) -> None:
    start = clock.now()
    await svc.put_schedule("tick", every(10_000))
    await step(svc, clock, 10)
    paused = await svc.pause_schedule("tick")
    assert (paused.paused, paused.next_fire_at) == (True, None)
    assert await svc.pause_schedule("tick") == paused  # (again: as it stands)
    for _ in range(10):
        await step(svc, clock, 10)
    assert await times(store) == [start + 10]
    clock.advance(3)
    resumed = await svc.resume_schedule("tick")
    assert (resumed.paused, resumed.next_fire_at) == (False, start + 113 + 10)
    assert await svc.resume_schedule("tick") == resumed  # (not paused: as it stands)
    await step(svc, clock, 9.5)
    assert await times(store) == [start + 10]
    await step(svc, clock, 0.5)
    assert await times(store) == [start + 10, start + 123]


async def test_a_paused_put_does_not_fire_and_a_put_resumes_it(
    svc: Service, store: Store, clock: FakeClock
) -> None:
    start = clock.now()
    s = await svc.put_schedule("tick", every(10_000, paused=True))
    assert (s.paused, s.next_fire_at) == (True, None)
    await step(svc, clock, 30)
    assert await times(store) == []
    s = await svc.put_schedule("tick", every(10_000))
    assert s.next_fire_at == start + 40
    await step(svc, clock, 10)
    assert await times(store) == [start + 40]


async def test_a_replace_with_the_same_rule_keeps_the_next_fire_and_takes_the_new_task(
    svc: Service, store: Store, clock: FakeClock
) -> None:
    start = clock.now()
    await svc.put_schedule("tick", every(10_000))
    clock.advance(6)
    s = await svc.put_schedule("tick", every(10_000, priority=4, max_attempts=9))
    assert s.next_fire_at == start + 10  # (not start + 16)
    unchanged = await svc.put_schedule("tick", every(10_000, priority=4, max_attempts=9))
    assert unchanged == s
    await step(svc, clock, 4)
    (task,) = await tasks(store)
    assert (task.scheduled_for, task.priority, task.max_attempts) == (start + 10, 4, 9)


async def test_a_replace_with_another_rule_fires_from_the_put(
    svc: Service, store: Store, clock: FakeClock
) -> None:
    start = clock.now()
    await svc.put_schedule("tick", every(10_000))
    clock.advance(6)
    s = await svc.put_schedule("tick", every(3_000))
    assert s.next_fire_at == start + 9
    await step(svc, clock, 3)
    await step(svc, clock, 1)
    await step(svc, clock, 2)
    assert await times(store) == [start + 9, start + 12]


async def test_a_fire_computed_before_a_change_does_nothing(
    svc: Service, store: Store, clock: FakeClock
) -> None:
    """The revision in the compare-and-set: a fire whose schedule was read before a put that kept
    its next fire time (the same rule, another task) enqueues nothing; the next look fires the
    new task for that time."""
    start = clock.now()
    await svc.put_schedule("tick", every(10_000))
    clock.advance(10)
    _, (read,), _ = await store.due_schedules(clock.now())
    await svc.put_schedule("tick", every(10_000, priority=7))
    new = svc._fired_task(read, start + 10, clock.now())
    assert await svc._fire(read, clock.now(), clock.now()) is None
    assert new.priority == 0
    assert await times(store) == []
    await svc.sweep()
    (task,) = await tasks(store)
    assert (task.scheduled_for, task.priority) == (start + 10, 7)


async def test_a_fired_task_is_an_enqueue_of_the_schedules_task(
    store: Store, clock: FakeClock
) -> None:
    service = Service(store, clock, result_ttl=77.0)
    try:
        await service.put_schedule("a", every(1_000, expires_in_ms=5_000, timeout_ms=2_000))
        await service.put_schedule("b", every(1_000, queue="b", result_ttl_ms=9_000))
        clock.advance(1.5)
        await service.sweep()
        (a,) = await tasks(store)
        assert (a.expires_at, a.timeout, a.result_ttl) == (clock.now() + 5, 2.0, None)
        (b,) = await tasks(store, "b")
        assert b.result_ttl == 9.0
        # The broker's default result TTL: a result is kept as long as it says.
        d = await service.claim(0, queues=Q)
        assert d is not None
        await service.ack(d.task.id, d.lease_id, b'"done"')
        kept = await service.lookup(d.task.id)
        assert kept.task.result == b'"done"'
        clock.advance(76)
        await store.sweep(now=clock.now())
        assert (await service.lookup(d.task.id)).state == "succeeded"
    finally:
        await service.close()


async def test_a_fire_the_broker_refuses_moves_on_and_is_told(
    store: Store, clock: FakeClock, fired: Fired, caplog: pytest.LogCaptureFixture
) -> None:
    service = Service(store, clock, events=fired, max_tasks=2)
    try:
        start = clock.now()
        await service.put_schedule("tick", every(10_000))
        await service.enqueue(PAYLOAD, queue="other")
        await service.enqueue(PAYLOAD, queue="other")  # the broker is full
        await step(service, clock, 10)
        await step(service, clock, 5)  # (not again: it moved on)
        assert await times(store) == []
        assert fired.fires == [("tick", 0.0, True)]
        assert "schedule tick: its fire for" in caplog.text
        assert "enqueued nothing: the broker holds 2 tasks" in caplog.text
        s = await service.get_schedule("tick")
        assert (s.next_fire_at, s.fires, s.last_task_id) == (start + 20, 0, None)
        # Room again: the next time fires.
        d = await service.claim(0, queues="other")
        assert d is not None
        await service.ack(d.task.id, d.lease_id)
        await step(service, clock, 5)
        assert await times(store) == [start + 20]
        assert fired.fires[1:] == [("tick", 0.0, False)]
        # A payload the broker's limit has since shrunk below: refused, moves on.
        service.max_payload = 4
        await step(service, clock, 10)
        assert await times(store) == [start + 20]
        assert fired.fires[2:] == [("tick", 0.0, True)]
        assert "payload is larger than the limit of 4 bytes" in caplog.text
    finally:
        await service.close()


async def test_a_fire_to_a_new_queue_past_the_queue_limit_is_refused(
    store: Store, clock: FakeClock, fired: Fired
) -> None:
    service = Service(store, clock, events=fired, max_queues=1)
    try:
        await service.enqueue(PAYLOAD, queue="only")
        await service.put_schedule("tick", every(1_000, queue="another"))
        await step(service, clock, 1)
        assert fired.fires == [("tick", 0.0, True)]
        assert [q.name for q in await service.queues()] == ["only"]
    finally:
        await service.close()


async def test_a_store_that_fails_a_look_is_looked_at_again(
    store: Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = Service(store, clock)
    try:
        start = clock.now()
        await service.put_schedule("tick", every(1_000))
        real = store.due_schedules

        async def away(now: float) -> tuple[float, list[Schedule], float | None]:
            raise StoreError("the store is unavailable: away")

        monkeypatch.setattr(store, "due_schedules", away)
        clock.advance(1)
        with pytest.raises(StoreError):
            await service.sweep()
        monkeypatch.setattr(store, "due_schedules", real)
        await step(service, clock, 0.25)
        assert await times(store) == [start + 1]
    finally:
        await service.close()


# -- SQLite: a restart ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_sqlite_keeps_schedules_and_their_next_fire_across_a_restart(
    store: Store, clock: FakeClock, rng: random.Random
) -> None:
    assert isinstance(store, SqliteStore)
    start = clock.now()
    service = Service(store, clock)
    await service.put_schedule("tick", every(10_000))
    await service.put_schedule("off", every(10_000, paused=True))
    await step(service, clock, 10)
    before = await service.list_schedules()
    await service.close()
    await store.close()
    again = await SqliteStore.open(store.path, Backoff(1.0, 30.0, rng), rng, sync="normal")
    try:
        assert await again.list_schedules() == before
        tick = await again.get_schedule("tick")
        assert tick is not None
        assert (tick.next_fire_at, tick.fires) == (start + 20, 1)
        restarted = Service(again, clock)
        await restarted.sweep()  # (at the same time: nothing fired twice)
        assert await times(again) == [start + 10]
        # A put of the same schedule at start-up (-schedule-file) keeps its next fire time.
        same = await restarted.put_schedule("tick", every(10_000))
        assert same.next_fire_at == start + 20
        await step(restarted, clock, 10)
        assert await times(again) == [start + 10, start + 20]
        (fired_task,) = [t for t in await tasks(again) if t.scheduled_for == start + 10]
        found = await again.lookup(fired_task.id)
        assert found is not None
        assert (found.task.schedule, found.task.scheduled_for) == ("tick", start + 10)
        await restarted.close()
    finally:
        await again.close()


# -- PostgreSQL: brokers racing -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_brokers_racing_on_one_database_fire_each_time_once(
    store: Store, clock: FakeClock, rng: random.Random
) -> None:
    assert isinstance(store, PostgresStore)
    dsn = await pg.database()
    others = [
        await PostgresStore.open(dsn, Backoff(1.0, 30.0, rng), random.Random(i), pool_size=4)
        for i in range(2)
    ]
    services = [Service(s, clock) for s in (store, *others)]
    try:
        start = clock.now()
        names = [f"s{i}" for i in range(6)]
        for i, name in enumerate(names):
            await services[i % 3].put_schedule(name, every(1_000 + 1_000 * (i % 2)))
        rounds = 40
        for r in range(rounds):
            clock.advance(0.5)
            # All three look at once, now and then a broker twice.
            await asyncio.gather(*(s.sweep() for s in services), services[r % 3].sweep())
        # A broker restarted on the database at the same moment fires nothing twice.
        await services[2].close()
        await others[1].close()
        others[1] = await PostgresStore.open(dsn, Backoff(1.0, 30.0, rng), random.Random(9))
        services[2] = Service(others[1], clock)
        await asyncio.gather(*(s.sweep() for s in services))
        got = await tasks(store)
        seen = Counter((t.schedule, t.scheduled_for) for t in got)
        assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1]
        end = clock.now()
        expected = {
            (name, start + k * (1 + i % 2))
            for i, name in enumerate(names)
            for k in range(1, int((end - start) / (1 + i % 2)) + 1)
        }
        assert set(seen) == expected
        for name in names:
            s = await store.get_schedule(name)
            assert s is not None
            assert s.fires == sum(1 for n, _ in seen if n == name)
        await store.check_invariants()
    finally:
        for service in services:
            await service.close()
        for o in others:
            await o.close()


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_postgres_due_schedules_reads_the_databases_clock(store: Store) -> None:
    """With db_clock (what the broker uses), the time is the database's, whatever the broker's
    clock says; the tests' stores (db_clock off) use the time given."""
    assert isinstance(store, PostgresStore)
    assert (await store.due_schedules(123.0))[0] == 123.0
    dsn = await pg.database()
    db = await PostgresStore.open(dsn, pool_size=1, db_clock=True)
    try:
        now, due, later = await db.due_schedules(123.0)
        assert abs(now - time.time()) < 60
        assert (due, later) == ([], None)
    finally:
        await db.close()


async def test_make_store_still_makes_fresh_stores(
    backend: str, rng: random.Random, tmp_path: Path
) -> None:
    """(Each test's store starts with no schedule: the PostgreSQL wipe drops them too.)"""
    s = await make_store(backend, Backoff(1.0, 30.0, rng), rng, tmp_path)
    try:
        assert await s.list_schedules() == []
    finally:
        await s.close()
