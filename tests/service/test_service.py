"""The service on a fake clock: defaults, caps and validation, long-polling, the sweeper, streams,
and a contention run. Nothing here sleeps: time moves only when the test advances the FakeClock,
and ``settle()`` lets the event loop run whatever became runnable.

A durable store may suspend (a commit on a writer thread), so where a test expects something to
happen after the clock moves it waits for it with ``wait_until()`` (polling, bounded) rather than
assuming a fixed number of loop rounds is enough."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from tests.helpers import invariant_holds, settle, wait_until
from wqbroker.clock import FakeClock
from wqbroker.dispatch import BatchPoller, Poller, Stream
from wqbroker.errors import InvalidArgument, LeaseLost, NotFound, Overloaded
from wqbroker.models import DEFAULT_QUEUE, Delivery, Enqueued, Stats, Task
from wqbroker.service import Service, Submission
from wqbroker.store import Store
from wqbroker.store.memory import MemoryStore

PAYLOAD = b'{"line": "hello"}'


def payload(n: int) -> bytes:
    return b'{"n": %d}' % n


def task_of(done: Enqueued) -> Task:
    """The new task of an enqueue (not a duplicate)."""
    assert not done.duplicate
    assert done.task is not None
    assert done.task.id == done.id
    return done.task


async def answer(claim: asyncio.Task[Delivery | None]) -> Delivery | None:
    """What a claim (or a stream's next()) answered, once it has answered."""
    await wait_until(claim.done, what="an answer")
    return claim.result()


def reclaimed_more_than(n: int) -> Callable[[Stats], bool]:
    return lambda stats: stats.totals.reclaimed > n


async def park(service: Service, **kw: Any) -> asyncio.Task[Delivery | None]:
    """Start a long-polling claim and let it park."""
    before = service.waiting
    task = asyncio.ensure_future(service.claim(**kw))
    await wait_until(lambda: task.done() or service.waiting > before, what="the claim to park")
    assert not task.done(), "the claim should be parked, waiting for a task"
    return task


async def gauges(service: Service) -> tuple[int, int, int, int]:
    s = await service.stats()
    return s.ready, s.handed_out, s.delayed, s.dead


async def balanced(service: Service) -> Stats:
    stats = await service.stats()
    assert invariant_holds(stats), stats
    return stats


async def pending_next(stream: Stream) -> asyncio.Task[Delivery | None]:
    task = asyncio.ensure_future(stream.next())
    await settle()
    return task


# -- enqueue: defaults and validation ---------------------------------------------------------


async def test_enqueue_defaults(service: Service, clock: FakeClock) -> None:
    view = task_of(await service.enqueue(PAYLOAD))
    assert view.max_attempts == 3
    assert view.attempts == 0
    assert view.available_at == clock.now()
    assert view.payload == PAYLOAD
    assert await gauges(service) == (1, 0, 0, 0)


async def test_the_default_max_attempts_buries_after_three_deliveries(
    service: Service, clock: FakeClock
) -> None:
    task = await service.enqueue(PAYLOAD)
    for attempt in (1, 2, 3):
        clock.advance(31.0)  # past any backoff
        await settle()
        # (a wait: on a shared store the sweeper may be promoting it right now, and a claim
        # skips rows another transaction holds; the sweep hands it to the waiting claim)
        d = await service.claim(wait_ms=1000)
        assert d is not None
        assert (d.task.id, d.task.attempts) == (task.id, attempt)
        await service.nack(d.task.id, d.lease_id, f"failure {attempt}")
    assert await gauges(service) == (0, 0, 0, 1)
    [dead] = await service.dead_letters()
    assert (dead.id, dead.attempts, dead.last_error) == (task.id, 3, "failure 3")


BAD_INTEGERS = [True, False, "3", "", 3.0, 2.5, None, [3], {"n": 3}]


@pytest.mark.parametrize("value", [v for v in BAD_INTEGERS if v is not None] + [0, -1, 2**31])
async def test_max_attempts_must_be_a_positive_integer(service: Service, value: object) -> None:
    with pytest.raises(InvalidArgument) as err:
        await service.enqueue(PAYLOAD, max_attempts=value)
    assert "max_attempts" in err.value.message
    assert (await service.stats()).totals.enqueued == 0


@pytest.mark.parametrize("value", [1, 7, 2**31 - 1])
async def test_max_attempts_accepts_positive_integers(service: Service, value: int) -> None:
    view = task_of(await service.enqueue(PAYLOAD, max_attempts=value))
    assert view.max_attempts == value


@pytest.mark.parametrize(
    "value", [v for v in BAD_INTEGERS if v is not None] + [-1, 365 * 24 * 3600 * 1000 + 1]
)
async def test_delay_ms_must_be_a_non_negative_integer(service: Service, value: object) -> None:
    with pytest.raises(InvalidArgument) as err:
        await service.enqueue(PAYLOAD, delay_ms=value)
    assert "delay_ms" in err.value.message
    assert (await service.stats()).totals.enqueued == 0


async def test_delay_ms_zero_is_ready_at_once(service: Service) -> None:
    await service.enqueue(PAYLOAD, delay_ms=0)
    assert await gauges(service) == (1, 0, 0, 0)
    assert await service.claim(wait_ms=0) is not None


async def test_delay_ms_holds_the_task_back(service: Service, clock: FakeClock) -> None:
    view = task_of(await service.enqueue(PAYLOAD, delay_ms=1500))
    assert view.available_at == clock.now() + 1.5
    assert await gauges(service) == (0, 0, 1, 0)
    assert await service.claim(wait_ms=0) is None
    clock.advance(1.5)
    await settle()
    d = await service.claim(wait_ms=1000)  # due: by its own promotion, or the sweep's
    assert d is not None
    assert d.task.id == view.id


async def test_enqueue_many_is_all_or_nothing(service: Service) -> None:
    items = [
        Submission(payload(1), None, None),
        Submission(payload(2), True, None),
        Submission(payload(3), 2, None),
    ]
    with pytest.raises(InvalidArgument) as err:
        await service.enqueue_many(items)
    assert "tasks[1]" in err.value.message
    assert "max_attempts" in err.value.message
    with pytest.raises(InvalidArgument) as err:
        await service.enqueue_many([Submission(payload(1)), Submission(payload(2), None, -5)])
    assert "tasks[1]" in err.value.message
    assert "delay_ms" in err.value.message
    assert (await service.stats()).totals.enqueued == 0


async def test_enqueue_many_feeds_parked_claims_and_schedules_delayed_tasks(
    service: Service, clock: FakeClock
) -> None:
    first = await park(service, wait_ms=20_000)
    second = await park(service, wait_ms=20_000)
    done = await service.enqueue_many(
        [Submission(payload(1)), Submission(payload(2), 5, 1500), Submission(payload(3), 1, 0)]
    )
    views = [task_of(e) for e in done]
    assert [v.max_attempts for v in views] == [3, 5, 1]
    d1, d2 = await answer(first), await answer(second)
    assert d1 is not None
    assert d2 is not None
    assert (d1.task.id, d2.task.id) == (views[0].id, views[2].id)
    third = await park(service, wait_ms=20_000)
    clock.advance(1.5)
    d3 = await answer(third)
    assert d3 is not None
    assert d3.task.id == views[1].id


# -- claim: defaults, caps and validation ----------------------------------------------------


@pytest.mark.parametrize("value", [v for v in BAD_INTEGERS if v is not None] + [-1])
async def test_wait_ms_must_be_a_non_negative_integer(service: Service, value: object) -> None:
    await service.enqueue(PAYLOAD)
    with pytest.raises(InvalidArgument) as err:
        await service.claim(wait_ms=value)
    assert "wait_ms" in err.value.message
    assert await gauges(service) == (1, 0, 0, 0)  # nothing was handed out


@pytest.mark.parametrize("value", [v for v in BAD_INTEGERS if v is not None] + [0, -1])
async def test_lease_ms_must_be_a_positive_integer(service: Service, value: object) -> None:
    await service.enqueue(PAYLOAD)
    with pytest.raises(InvalidArgument) as err:
        await service.claim(wait_ms=0, lease_ms=value)
    assert "lease_ms" in err.value.message
    assert await gauges(service) == (1, 0, 0, 0)


async def test_lease_defaults_to_30_seconds(service: Service, clock: FakeClock) -> None:
    await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0)
    assert d is not None
    assert d.deadline == clock.now() + 30.0


@pytest.mark.parametrize(
    ("lease_ms", "seconds"), [(1, 0.001), (45_000, 45.0), (300_000, 300.0), (300_001, 300.0)]
)
async def test_lease_ms_is_honoured_up_to_five_minutes(
    service: Service, clock: FakeClock, lease_ms: int, seconds: float
) -> None:
    await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0, lease_ms=lease_ms)
    assert d is not None
    assert d.deadline == clock.now() + seconds


async def test_a_huge_lease_ms_is_clamped_not_rejected(service: Service, clock: FakeClock) -> None:
    await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0, lease_ms=10**15)
    assert d is not None
    assert d.deadline == clock.now() + 300.0


async def test_wait_defaults_to_20_seconds(service: Service, clock: FakeClock) -> None:
    claim = await park(service)
    clock.advance(19.5)
    await settle()
    assert not claim.done()
    clock.advance(0.5)
    await settle()
    assert claim.done()
    assert claim.result() is None


@pytest.mark.parametrize("wait_ms", [30_001, 60_000, 10**15])
async def test_a_huge_wait_ms_is_clamped_to_30_seconds(
    service: Service, clock: FakeClock, wait_ms: int
) -> None:
    claim = await park(service, wait_ms=wait_ms)
    clock.advance(29.5)
    await settle()
    assert not claim.done()
    clock.advance(0.5)
    await settle()
    assert claim.result() is None


async def test_wait_ms_below_the_cap_is_honoured(service: Service, clock: FakeClock) -> None:
    claim = await park(service, wait_ms=2500)
    clock.advance(2.0)
    await settle()
    assert not claim.done()
    clock.advance(0.5)
    await settle()
    assert claim.result() is None


# -- long-polling -----------------------------------------------------------------------------


async def test_claim_takes_a_ready_task_at_once(service: Service) -> None:
    view = await service.enqueue(PAYLOAD)
    d = await service.claim()  # default wait, but a task is ready: no waiting
    assert d is not None
    assert (d.task.id, d.task.attempts, d.task.payload) == (view.id, 1, PAYLOAD)
    assert await gauges(service) == (0, 1, 0, 0)


async def test_wait_ms_zero_answers_none_at_once(service: Service) -> None:
    assert await service.claim(wait_ms=0) is None
    assert service.waiting == 0
    await service.enqueue(PAYLOAD)  # nobody is waiting for it
    assert await gauges(service) == (1, 0, 0, 0)


async def test_a_parked_claim_is_woken_by_an_enqueue(service: Service) -> None:
    claim = await park(service, wait_ms=20_000)
    assert service.waiting == 1
    view = await service.enqueue(PAYLOAD)
    d = await answer(claim)
    assert d is not None
    assert (d.task.id, d.task.attempts) == (view.id, 1)
    assert await gauges(service) == (0, 1, 0, 0)
    assert service.waiting == 0
    await service.ack(d.task.id, d.lease_id)
    assert await gauges(service) == (0, 0, 0, 0)


async def test_a_parked_claim_times_out_with_none(service: Service, clock: FakeClock) -> None:
    claim = await park(service, wait_ms=5000)
    clock.advance(5.0)
    await settle()
    assert claim.done()
    assert claim.result() is None
    assert service.waiting == 0
    # a task enqueued afterwards is not handed to the claim that gave up
    await service.enqueue(PAYLOAD)
    assert await gauges(service) == (1, 0, 0, 0)


async def test_parked_claims_are_served_first_come_first_served(service: Service) -> None:
    claims = [await park(service, wait_ms=20_000) for _ in range(4)]
    ids = []
    for n in range(3):
        ids.append((await service.enqueue(payload(n))).id)
        served = n + 1
        await wait_until(
            lambda: sum(c.done() for c in claims) >= served,  # noqa: B023 (awaited here)
            what="a claim served",
        )
        await settle()
        done = [c.done() for c in claims]
        assert done == [True] * (n + 1) + [False] * (3 - n)
    got = [c.result() for c in claims[:3]]
    assert [d.task.id for d in got if d is not None] == ids
    assert not claims[3].done()
    assert await gauges(service) == (0, 3, 0, 0)


async def test_a_new_claim_queues_behind_parked_ones(service: Service) -> None:
    first = await park(service, wait_ms=20_000)
    second = await park(service, wait_ms=20_000)
    await service.enqueue(payload(1))
    await wait_until(first.done, what="the first claim served")
    await settle()
    assert not second.done()
    await service.enqueue(payload(2))
    await wait_until(second.done, what="the second claim served")


async def test_a_cancelled_parked_claim_is_never_handed_a_task(service: Service) -> None:
    claim = await park(service, wait_ms=20_000)
    claim.cancel()
    await settle()
    assert claim.cancelled()
    view = await service.enqueue(PAYLOAD)
    await settle()
    assert await gauges(service) == (1, 0, 0, 0)
    d = await service.claim(wait_ms=0)
    assert d is not None
    assert (d.task.id, d.task.attempts) == (view.id, 1)


async def test_a_claim_cancelled_just_before_an_enqueue_gets_nothing(service: Service) -> None:
    claim = await park(service, wait_ms=20_000)
    claim.cancel()  # the client went away; its coroutine has not run yet
    await service.enqueue(PAYLOAD)
    await settle()
    assert claim.cancelled()
    assert await gauges(service) == (1, 0, 0, 0)
    assert (await service.stats()).totals.delivered == 0


async def test_a_task_handed_to_a_claim_cancelled_before_it_ran_goes_back(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = await park(service, wait_ms=20_000)
    deliver = Poller.deliver

    def deliver_then_disconnect(self: Poller, delivery: Delivery) -> None:
        deliver(self, delivery)  # the task is handed to the parked claim ...
        claim.cancel()  # ... whose client disconnects before the claim could return it

    monkeypatch.setattr(Poller, "deliver", deliver_then_disconnect)
    view = await service.enqueue(PAYLOAD)
    await wait_until(claim.done, what="the claim to end")
    assert claim.cancelled()
    stats = await wait_until(service.stats, lambda s: s.handed_out == 0, what="the release")
    assert (stats.ready, stats.handed_out) == (1, 0)
    assert stats.totals.delivered == 0  # the hand-out nobody saw is undone
    d = await service.claim(wait_ms=0)
    assert d is not None
    assert (d.task.id, d.task.attempts) == (view.id, 1)


async def test_a_cancelled_claim_does_not_hold_up_the_next_one(service: Service) -> None:
    gone = await park(service, wait_ms=20_000)
    alive = await park(service, wait_ms=20_000)
    gone.cancel()
    view = await service.enqueue(PAYLOAD)
    d = await answer(alive)
    assert gone.cancelled()
    assert d is not None
    assert d.task.id == view.id
    assert await gauges(service) == (0, 1, 0, 0)


async def test_a_released_task_goes_to_the_next_parked_claim(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await park(service, wait_ms=20_000)
    second = await park(service, wait_ms=20_000)
    deliver = Poller.deliver

    def deliver_then_disconnect(self: Poller, delivery: Delivery) -> None:
        deliver(self, delivery)
        if not first.done():
            first.cancel()  # the first claim's client goes away as the task reaches it

    monkeypatch.setattr(Poller, "deliver", deliver_then_disconnect)
    view = await service.enqueue(PAYLOAD)
    d = await answer(second)
    assert first.cancelled()
    assert d is not None
    assert (d.task.id, d.task.attempts) == (view.id, 1)
    assert await gauges(service) == (0, 1, 0, 0)


# -- ack / nack through the service -----------------------------------------------------------


async def test_ack_and_nack_validate_their_arguments(service: Service) -> None:
    await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0)
    assert d is not None
    for bad_id in ["", None, 5]:
        with pytest.raises(InvalidArgument) as err:
            await service.ack(bad_id, d.lease_id)
        assert "id" in err.value.message
    with pytest.raises(InvalidArgument) as err:
        await service.ack(d.task.id, "")
    assert "lease_id" in err.value.message
    with pytest.raises(InvalidArgument) as err:
        await service.nack(d.task.id, d.lease_id, error=42)
    assert "error" in err.value.message
    assert await gauges(service) == (0, 1, 0, 0)
    await service.nack(d.task.id, d.lease_id, error="bad input")
    assert await gauges(service) == (0, 0, 1, 0)


async def test_a_nacked_task_is_retried_to_a_parked_claim_after_its_backoff(
    service: Service, clock: FakeClock
) -> None:
    view = await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0)
    assert d is not None
    await service.nack(d.task.id, d.lease_id, "try again")
    assert await gauges(service) == (0, 0, 1, 0)
    claim = await park(service, wait_ms=20_000)
    clock.advance(0.49)  # the backoff after a first failure is 0.5 - 1 s
    await settle()
    assert not claim.done()
    clock.advance(0.52)
    again = await answer(claim)
    assert again is not None
    assert (again.task.id, again.task.attempts, again.task.last_error) == (view.id, 2, "try again")


# -- the sweeper ------------------------------------------------------------------------------


async def test_the_sweeper_reclaims_an_expired_lease(service: Service, clock: FakeClock) -> None:
    view = await service.enqueue(PAYLOAD, max_attempts=1)
    d = await service.claim(wait_ms=0, lease_ms=1000)
    assert d is not None
    clock.advance(0.5)
    await settle()
    assert await gauges(service) == (0, 1, 0, 0)
    clock.advance(0.5)
    await wait_until(service.stats, lambda s: s.totals.reclaimed == 1, what="the reclaim")
    stats = await balanced(service)
    assert (stats.ready, stats.handed_out, stats.dead) == (0, 0, 1)
    assert (stats.totals.reclaimed, stats.totals.buried) == (1, 1)
    [dead] = await service.dead_letters()
    assert (dead.id, dead.last_error) == (view.id, "lease expired")
    with pytest.raises(NotFound):  # the silent worker comes back too late
        await service.ack(d.task.id, d.lease_id)


async def test_a_reclaimed_task_is_retried_by_somebody_else(
    service: Service, clock: FakeClock
) -> None:
    view = await service.enqueue(PAYLOAD)
    crashed = await service.claim(wait_ms=0, lease_ms=2000)
    assert crashed is not None
    rescuer = await park(service, wait_ms=30_000)
    clock.advance(2.0)  # the lease runs out: reclaimed, delayed by 0.5 - 1 s
    await wait_until(service.stats, lambda s: s.totals.reclaimed == 1, what="the reclaim")
    stats = await balanced(service)
    assert (stats.handed_out, stats.delayed, stats.totals.reclaimed) == (0, 1, 1)
    assert not rescuer.done()
    clock.advance(1.0)
    d = await answer(rescuer)
    assert d is not None
    assert (d.task.id, d.task.attempts, d.task.last_error) == (view.id, 2, "lease expired")
    assert d.lease_id != crashed.lease_id
    await service.ack(d.task.id, d.lease_id)
    with pytest.raises(NotFound):
        await service.ack(crashed.task.id, crashed.lease_id)


async def test_the_sweeper_keeps_reclaiming_later_leases(
    service: Service, clock: FakeClock
) -> None:
    for n in range(3):
        await service.enqueue(payload(n), max_attempts=1)
    for lease_ms in (1000, 5000, 60_000):
        assert await service.claim(wait_ms=0, lease_ms=lease_ms) is not None
    for before, step in enumerate((1.0, 4.0, 55.0)):  # each step runs out one more lease
        clock.advance(step)
        stats = await wait_until(
            service.stats, reclaimed_more_than(before), what="the next reclaim"
        )
        assert stats.totals.reclaimed == before + 1
    assert await gauges(service) == (0, 0, 0, 3)


async def test_a_delayed_task_is_handed_to_a_parked_claim_when_its_time_comes(
    service: Service, clock: FakeClock
) -> None:
    claim = await park(service, wait_ms=20_000)
    view = await service.enqueue(PAYLOAD, delay_ms=5000)
    assert await gauges(service) == (0, 0, 1, 0)
    clock.advance(4.5)
    await settle()
    assert not claim.done()
    assert await gauges(service) == (0, 0, 1, 0)
    clock.advance(0.5)
    d = await answer(claim)
    assert d is not None
    assert d.task.id == view.id
    assert await gauges(service) == (0, 1, 0, 0)


async def test_a_delayed_task_due_between_ticks_is_not_held_to_the_next_tick(
    service: Service, clock: FakeClock
) -> None:
    claim = await park(service, wait_ms=20_000)
    clock.advance(0.25)  # one ordinary tick
    await settle()
    view = await service.enqueue(PAYLOAD, delay_ms=10)  # due 10 ms from now, before the next tick
    clock.advance(0.01)
    d = await answer(claim)
    assert d is not None
    assert d.task.id == view.id


async def test_the_sweeper_wakes_when_something_is_due_not_only_on_its_interval(
    store: Store, clock: FakeClock
) -> None:
    # With a one-minute safety-net interval, a delayed task, a retry and an expiring lease must
    # still be acted on the moment they are due.
    service = Service(store, clock, sweep_interval=60.0)
    await service.start()
    try:
        claim = await park(service, wait_ms=30_000)
        await service.enqueue(payload(1), delay_ms=2000)
        clock.advance(2.0)
        d = await answer(claim)
        assert d is not None

        await service.nack(d.task.id, d.lease_id, "again")  # retried after 0.5 - 1 s
        claim = await park(service, wait_ms=30_000)
        clock.advance(1.0)
        d = await answer(claim)
        assert d is not None
        assert d.task.attempts == 2

        await service.enqueue(payload(2))
        held = await service.claim(wait_ms=0, lease_ms=3000)
        assert held is not None
        clock.advance(3.0)
        await wait_until(service.stats, lambda s: s.totals.reclaimed == 1, what="the reclaim")
    finally:
        await service.close()


async def test_sweep_can_be_called_directly(service: Service, clock: FakeClock) -> None:
    await service.enqueue(PAYLOAD, delay_ms=2000)
    assert await service.sweep() == clock.now() + 2.0
    assert await gauges(service) == (0, 0, 1, 0)


# -- streams ----------------------------------------------------------------------------------


async def test_a_stream_never_has_more_than_prefetch_unfinished(service: Service) -> None:
    ids = [(await service.enqueue(payload(n))).id for n in range(6)]
    stream = await service.open_stream(2, 60_000)
    await settle()
    assert await gauges(service) == (4, 2, 0, 0)
    first = await stream.next()
    second = await stream.next()
    assert first is not None
    assert second is not None
    assert [first.task.id, second.task.id] == ids[:2]
    third = await pending_next(stream)
    assert not third.done()  # two unfinished: no more until one is finished
    assert await gauges(service) == (4, 2, 0, 0)

    await service.ack(first.task.id, first.lease_id)  # an ack frees a slot
    d3 = await answer(third)
    assert d3 is not None
    assert d3.task.id == ids[2]
    assert await gauges(service) == (3, 2, 0, 0)

    fourth = await pending_next(stream)
    assert not fourth.done()
    await service.nack(second.task.id, second.lease_id, "nope")  # so does a nack
    d4 = await answer(fourth)
    assert d4 is not None
    assert d4.task.id == ids[3]
    assert await gauges(service) == (2, 2, 1, 0)
    await stream.close()


async def test_a_stream_gets_tasks_as_they_are_enqueued(service: Service) -> None:
    stream = await service.open_stream(3, None)
    waiting = await pending_next(stream)
    assert not waiting.done()
    view = await service.enqueue(PAYLOAD)
    d = await answer(waiting)
    assert d is not None
    assert d.task.id == view.id
    assert d.task.attempts == 1
    await service.ack(d.task.id, d.lease_id)
    assert await gauges(service) == (0, 0, 0, 0)
    await stream.close()


async def test_stream_arguments_are_validated(service: Service) -> None:
    for prefetch in [0, -1, "2", 1.5, True]:
        with pytest.raises(InvalidArgument) as err:
            await service.open_stream(prefetch, None)
        assert "prefetch" in err.value.message
    with pytest.raises(InvalidArgument) as err:
        await service.open_stream(1, 0)
    assert "lease_ms" in err.value.message
    assert service.waiting == 0


async def test_closing_a_stream_reclaims_sent_tasks_and_releases_untaken_ones(
    service: Service,
) -> None:
    ids = [(await service.enqueue(payload(n))).id for n in range(4)]
    stream = await service.open_stream(3, 60_000)
    await settle()
    taken = await stream.next()
    assert taken is not None
    assert taken.task.id == ids[0]
    assert await gauges(service) == (1, 3, 0, 0)

    await stream.close()
    stats = await balanced(service)
    # the one the worker took is reclaimed at once (not at its deadline) and retried later
    assert (stats.totals.reclaimed, stats.totals.retried, stats.delayed) == (1, 1, 1)
    # the two it never took are back in ready, as if never handed out
    assert (stats.ready, stats.handed_out) == (3, 0)
    assert stats.totals.delivered == 1
    assert await stream.next() is None
    with pytest.raises(NotFound):
        await service.ack(taken.task.id, taken.lease_id)
    got = [await service.claim(wait_ms=0) for _ in range(3)]
    assert sorted((d.task.id, d.task.attempts) for d in got if d is not None) == sorted(
        [(ids[1], 1), (ids[2], 1), (ids[3], 1)]
    )


async def test_closing_a_stream_keeps_its_untaken_tasks_in_their_order(service: Service) -> None:
    # The stream was handed the three oldest tasks and the worker took none of them: after the
    # close they must still come out oldest first, ahead of the task that stayed in ready.
    ids = [(await service.enqueue(payload(n))).id for n in range(4)]
    stream = await service.open_stream(3, None)
    await settle()
    await stream.close()
    got = [await service.claim(wait_ms=0) for _ in range(4)]
    assert [d.task.id for d in got if d is not None] == ids


async def test_closing_a_stream_hands_its_untaken_tasks_to_parked_claims(
    service: Service,
) -> None:
    stream = await service.open_stream(1, None)
    view = await service.enqueue(PAYLOAD)
    await settle()
    claim = await park(service, wait_ms=20_000)
    await stream.close()
    d = await answer(claim)
    assert d is not None
    assert (d.task.id, d.task.attempts) == (view.id, 1)


async def test_closing_a_stream_wakes_its_pending_next(service: Service) -> None:
    stream = await service.open_stream(2, None)
    waiting = await pending_next(stream)
    await stream.close()
    assert await answer(waiting) is None
    await service.enqueue(PAYLOAD)
    assert await gauges(service) == (1, 0, 0, 0)  # a closed stream takes nothing


async def test_draining_a_stream_returns_untaken_tasks_and_takes_no_new_ones(
    service: Service,
) -> None:
    ids = [(await service.enqueue(payload(n))).id for n in range(4)]
    stream = await service.open_stream(3, None)
    await settle()
    taken = await stream.next()
    assert taken is not None
    assert taken.task.id == ids[0]
    await stream.drain()
    stats = await service.stats()
    assert (stats.ready, stats.handed_out, stats.totals.delivered) == (3, 1, 1)
    # the worker can still finish what it took, and that frees no slot for new work
    await service.ack(taken.task.id, taken.lease_id)
    await settle()
    assert await gauges(service) == (3, 0, 0, 0)
    assert stream.take_ready() == []
    got = [await service.claim(wait_ms=0) for _ in range(3)]
    assert sorted(d.task.id for d in got if d is not None) == sorted(ids[1:])
    await stream.close()
    assert await gauges(service) == (0, 3, 0, 0)


async def test_draining_a_stream_keeps_its_untaken_tasks_in_their_order(
    service: Service,
) -> None:
    ids = [(await service.enqueue(payload(n))).id for n in range(4)]
    stream = await service.open_stream(3, None)
    await settle()
    await stream.drain()
    got = [await service.claim(wait_ms=0) for _ in range(4)]
    assert [d.task.id for d in got if d is not None] == ids
    await stream.close()


async def test_a_stream_slot_is_freed_when_its_lease_is_reclaimed(
    service: Service, clock: FakeClock
) -> None:
    a = await service.enqueue(payload(1))
    b = await service.enqueue(payload(2))
    stream = await service.open_stream(1, 1000)
    first = await stream.next()
    assert first is not None
    assert first.task.id == a.id
    clock.advance(1.0)  # the worker went silent
    await wait_until(service.stats, lambda s: s.totals.reclaimed == 1, what="the reclaim")
    second = await stream.next()
    assert second is not None
    assert second.task.id == b.id
    await service.ack(second.task.id, second.lease_id)
    await stream.close()


async def test_a_stream_never_passes_on_a_delivery_whose_lease_was_reclaimed(
    service: Service, clock: FakeClock
) -> None:
    a = await service.enqueue(payload(1))
    b = await service.enqueue(payload(2))
    stream = await service.open_stream(1, 1000)
    await settle()  # a is pushed to the stream, but the worker does not take it in time
    clock.advance(1.0)
    await wait_until(service.stats, lambda s: s.totals.reclaimed == 1, what="the reclaim")
    # (With a shared store the reclaim is visible before the broker has freed the stream's slot,
    # which is what b's coming shows.)
    await wait_until(lambda: stream.pending, lambda n: n == 2, what="b pushed after a")
    d = await stream.next()
    assert d is not None
    assert d.task.id == b.id
    await service.ack(d.task.id, d.lease_id)
    clock.advance(1.0)  # a's retry comes round (0.5 - 1 s) and is pushed to the stream again
    again = await asyncio.wait_for(stream.next(), timeout=5)
    assert again is not None
    assert (again.task.id, again.task.attempts, again.task.last_error) == (
        a.id,
        2,
        "lease expired",
    )
    await service.ack(again.task.id, again.lease_id)
    assert await gauges(service) == (0, 0, 0, 0)
    await stream.close()


async def test_streams_and_parked_claims_share_tasks_fairly(service: Service) -> None:
    stream = await service.open_stream(5, None)
    c1 = await park(service, wait_ms=20_000)
    c2 = await park(service, wait_ms=20_000)
    ids = []
    for n in range(5):
        ids.append((await service.enqueue(payload(n))).id)

        # Handed out before the next comes (on a shared store the hand-out runs in the background
        # and takes round trips: a few turns of the loop are not always enough under load).
        def all_out(s: Stats, count: int = n + 1) -> bool:
            return s.handed_out == count

        await wait_until(service.stats, all_out, what=f"task {n} handed out")
    d1, d2 = await answer(c1), await answer(c2)
    assert d1 is not None
    assert d2 is not None
    assert (d1.task.id, d2.task.id) == (ids[1], ids[2])
    streamed = [await stream.next() for _ in range(3)]
    assert [d.task.id for d in streamed if d is not None] == [ids[0], ids[3], ids[4]]
    await stream.close()


async def test_two_streams_take_turns(service: Service) -> None:
    s1 = await service.open_stream(10, None)
    s2 = await service.open_stream(10, None)
    ids = [(await service.enqueue(payload(n))).id for n in range(6)]
    await wait_until(lambda: s1.pending + s2.pending, lambda n: n == 6, what="six pushed")
    got1 = [d.task.id for d in s1.take_ready()]
    got2 = [d.task.id for d in s2.take_ready()]
    assert got1 == ids[0::2]
    assert got2 == ids[1::2]
    await s1.close()
    await s2.close()


async def test_closing_the_service_answers_parked_claims_and_ends_streams(
    service: Service,
) -> None:
    claim = await park(service, wait_ms=20_000)
    stream = await service.open_stream(1, None)
    waiting = await pending_next(stream)
    await service.close()
    assert await answer(claim) is None
    assert await answer(waiting) is None
    assert await service.claim(wait_ms=20_000) is None  # answered at once, not parked
    await service.enqueue(PAYLOAD)
    assert await gauges(service) == (1, 0, 0, 0)


# -- a claim that read the store before a task came --------------------------------------------


class _SlowClaims(MemoryStore):
    """A store whose claims read the index at once, then take their time to answer (as a
    durable store's round trip does): what becomes ready meanwhile, the answer does not have."""

    never_suspends = False

    def __init__(self) -> None:
        super().__init__()
        self.answering = asyncio.Event()  # set: claims answer (the gate is open)
        self.asked = asyncio.Event()  # a claim has read the index, and waits at the gate

    async def claim(self, **kw: Any) -> Delivery | None:
        found = await super().claim(**kw)
        self.asked.set()
        await self.answering.wait()
        return found

    async def claim_many(self, leases: Sequence[float], **kw: Any) -> list[Delivery]:
        found = await super().claim_many(leases, **kw)
        self.asked.set()
        await self.answering.wait()
        return found


@pytest.mark.parametrize("batch", [False, True], ids=["claim", "claim_batch"])
async def test_a_task_enqueued_while_a_claim_reads_an_empty_store_is_handed_to_it(
    clock: FakeClock, batch: bool
) -> None:
    store = _SlowClaims()
    service = Service(store, clock)
    await service.start()
    try:
        if batch:
            claim: asyncio.Task[Any] = asyncio.ensure_future(
                service.claim_batch(wait_ms=20_000, max_tasks=5)
            )
        else:
            claim = asyncio.ensure_future(service.claim(wait_ms=20_000))
        await store.asked.wait()  # it found nothing, and is on its way back ...
        enqueued = await service.enqueue(PAYLOAD)  # ... when a task comes (nobody is parked)
        store.answering.set()
        await wait_until(claim.done, what="the answer")  # no further enqueue, poll or clock move
        delivered = claim.result()[0] if batch else claim.result()
        assert delivered is not None
        assert delivered.task.id == enqueued.id
    finally:
        await service.close()


# -- contention -------------------------------------------------------------------------------


async def test_2000_tasks_50_producers_3_workers(service: Service, clock: FakeClock) -> None:
    producers, per_producer, workers = 50, 40, 3
    enqueued: list[str] = []
    acked: list[str] = []
    handled_by: dict[int, int] = {}

    async def producer(p: int) -> None:
        for n in range(per_producer):
            view = await service.enqueue(payload(p * per_producer + n))
            enqueued.append(view.id)
            await asyncio.sleep(0)  # yield, so producers interleave

    async def worker(w: int) -> None:
        while True:
            d = await service.claim(wait_ms=20_000, lease_ms=30_000)
            if d is None:
                return
            await asyncio.sleep(0)  # "work"
            await service.ack(d.task.id, d.lease_id)
            acked.append(d.task.id)
            handled_by[w] = handled_by.get(w, 0) + 1

    consumers = [asyncio.ensure_future(worker(w)) for w in range(workers)]
    await settle()
    await asyncio.gather(*(producer(p) for p in range(producers)))
    await wait_until(lambda: len(acked) == len(enqueued), what="every task to be acked")

    def idle_polls_run_out() -> bool:
        # (A worker whose claim was still on its way to the store when the clock moved parks
        # afresh, on the moved clock: it needs the clock to move again.)
        clock.advance(20.0)
        return all(c.done() for c in consumers)

    await wait_until(idle_polls_run_out, what="the idle workers' long-polls to run out")
    await asyncio.gather(*consumers)

    total = producers * per_producer
    assert len(enqueued) == len(set(enqueued)) == total
    assert len(acked) == total
    assert sorted(acked) == sorted(enqueued)  # every task acked exactly once
    assert len(handled_by) == workers  # every worker got work
    stats = await balanced(service)
    assert (stats.ready, stats.handed_out, stats.delayed, stats.dead) == (0, 0, 0, 0)
    t = stats.totals
    assert (t.enqueued, t.delivered, t.acked) == (total, total, total)
    assert (t.nacked, t.reclaimed, t.retried, t.buried) == (0, 0, 0, 0)


# -- a caller that goes away half-way ------------------------------------------------------------
# With a durable store an operation waits for its commit; if its caller is cancelled then (the
# client went away), what the operation changed must still be followed through.


async def test_an_enqueue_whose_caller_went_away_still_feeds_the_parked_claim(
    service: Service,
) -> None:
    claim = await park(service, wait_ms=20_000)
    enqueue = asyncio.ensure_future(service.enqueue(PAYLOAD))
    await asyncio.sleep(0)  # it has started (and, with a durable store, waits for its commit)
    enqueue.cancel()
    d = await answer(claim)
    assert d is not None
    assert json.loads(d.task.payload) == json.loads(PAYLOAD)
    assert await gauges(service) == (0, 1, 0, 0)


async def test_an_ack_whose_caller_went_away_still_frees_the_stream_slot(
    service: Service,
) -> None:
    for n in range(2):
        await service.enqueue(payload(n))
    stream = await service.open_stream(1, None)
    first = await asyncio.wait_for(stream.next(), 5)
    assert first is not None
    ack = asyncio.ensure_future(service.ack(first.task.id, first.lease_id))
    await asyncio.sleep(0)
    ack.cancel()
    second = await asyncio.wait_for(stream.next(), 5)  # the slot came free: the next one arrives
    assert second is not None
    assert second.task.id != first.task.id
    stats = await wait_until(service.stats, lambda s: s.totals.acked == 1, what="the ack")
    assert (stats.ready, stats.handed_out) == (0, 1)
    await stream.close()


async def test_a_claim_whose_caller_went_away_during_the_hand_out_gives_the_task_back(
    service: Service,
) -> None:
    view = await service.enqueue(PAYLOAD)
    committed = service.store.transactions
    claim = asyncio.ensure_future(service.claim(wait_ms=0))
    await asyncio.sleep(0)
    claim.cancel()
    await wait_until(claim.done, what="the claim to end")
    # A store whose calls never wait completes the claim before the cancel can land.
    assert claim.cancelled() is not service.store.never_suspends
    if claim.cancelled():  # it was cut short: the hand-out must have been undone
        # (the claim's commit and the release's: before them, the gauges would look the same)
        await wait_until(
            lambda: service.store.transactions, lambda n: n >= committed + 2, what="the release"
        )
        stats = await service.stats()
        assert (stats.ready, stats.totals.delivered) == (1, 0)
        d = await service.claim(wait_ms=0)
        assert d is not None
        assert (d.task.id, d.task.attempts) == (view.id, 1)
    else:
        d = claim.result()
        assert d is not None
        assert d.task.id == view.id


# == queues, priorities, keys, extension, nack options, lookup, bulk DLQ, pauses ===============


async def test_enqueue_with_a_queue_priority_and_key(service: Service, clock: FakeClock) -> None:
    done = await service.enqueue(PAYLOAD, queue="emails.v2-x_Y", priority=7, key="order-17")
    view = task_of(done)
    assert (view.queue, view.priority) == ("emails.v2-x_Y", 7)
    plain = task_of(await service.enqueue(PAYLOAD))
    assert (plain.queue, plain.priority) == ("default", 0)
    assert [q.name for q in await service.queues()] == ["default", "emails.v2-x_Y"]
    for name in ("a", "A" * 64, "0", "._-"):
        assert task_of(await service.enqueue(PAYLOAD, queue=name)).queue == name
    for priority in range(10):
        assert task_of(await service.enqueue(PAYLOAD, priority=priority)).priority == priority


BAD_QUEUES = ["", "a b", "a/b", "a,b", "é", "a" * 65, "x\n", 3, True, ["a"], {"a": 1}]


@pytest.mark.parametrize("value", BAD_QUEUES)
async def test_a_bad_queue_name_is_refused(service: Service, value: object) -> None:
    with pytest.raises(InvalidArgument) as err:
        await service.enqueue(PAYLOAD, queue=value)
    assert err.value.message.startswith("queue ")
    with pytest.raises(InvalidArgument) as err:
        await service.stats(value)
    assert "queue" in err.value.message
    for call in (service.pause, service.resume, service.requeue_all):
        with pytest.raises(InvalidArgument):
            await call(value)
    with pytest.raises(InvalidArgument):
        await service.dead_letters(queue=value)
    assert (await service.stats()).totals.enqueued == 0
    assert await service.queues() == []


@pytest.mark.parametrize("value", [10, -1, 100, True, False, "1", 1.0, [1]])
async def test_a_bad_priority_is_refused(service: Service, value: object) -> None:
    with pytest.raises(InvalidArgument) as err:
        await service.enqueue(PAYLOAD, priority=value)
    assert err.value.message.startswith("priority ")
    assert (await service.stats()).totals.enqueued == 0


@pytest.mark.parametrize("value", ["", "k" * 257, "a\nb", "tab\there", "\x00", "del\x7f", 5, True])
async def test_a_bad_idempotency_key_is_refused(service: Service, value: object) -> None:
    with pytest.raises(InvalidArgument) as err:
        await service.enqueue(PAYLOAD, key=value)
    assert err.value.message.startswith("idempotency key ")
    assert (await service.stats()).totals.enqueued == 0


async def test_keys_of_256_characters_and_any_printable_text_are_taken(service: Service) -> None:
    for key in ("k" * 256, "x", "clé ünïcode ✓", "a b/c:d"):
        first = task_of(await service.enqueue(PAYLOAD, key=key))
        assert await service.enqueue(PAYLOAD, key=key) == Enqueued(first.id, True, None)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("queue", "no spaces", "tasks[2].queue 'no spaces' is not a queue name"),
        ("priority", 10, "tasks[2].priority must be from 0 to 9, got 10"),
        ("priority", "1", "tasks[2].priority must be an integer, got a string"),
        ("key", "", "tasks[2].idempotency key must not be empty"),
    ],
)
async def test_a_bad_item_in_a_batch_is_named_and_nothing_is_enqueued(
    service: Service, field: str, value: object, message: str
) -> None:
    items = [Submission(payload(1)), Submission(payload(2), key="k1")]
    items.append(Submission(payload(3), **{field: value}))
    with pytest.raises(InvalidArgument) as err:
        await service.enqueue_many(items)
    assert err.value.message.startswith(message), err.value.message
    assert (await service.stats()).totals.enqueued == 0
    # nothing was remembered either: the key is new
    assert not (await service.enqueue(PAYLOAD, key="k1")).duplicate


async def test_enqueue_many_reports_duplicates_per_item(service: Service) -> None:
    first = await service.enqueue(PAYLOAD, key="a")
    done = await service.enqueue_many(
        [
            Submission(payload(1), key="a"),
            Submission(payload(2), key="b", queue="q", priority=3),
            Submission(payload(3), key="b", queue="q"),
            Submission(payload(4), key="b"),
        ]
    )
    assert [e.duplicate for e in done] == [True, False, True, False]
    assert done[0] == Enqueued(first.id, True, None)
    assert done[2] == Enqueued(done[1].id, True, None)
    assert (task_of(done[1]).queue, task_of(done[1]).priority) == ("q", 3)
    assert (await service.stats()).totals.enqueued == 3


async def test_the_dedup_window_is_the_services(service: Service, clock: FakeClock) -> None:
    assert service.dedup_window == 300.0  # the default, five minutes
    service.dedup_window = 10.0
    first = await service.enqueue(PAYLOAD, key="k")
    clock.advance(9.5)
    await settle()
    assert await service.enqueue(PAYLOAD, key="k") == Enqueued(first.id, True, None)
    clock.advance(0.5)  # the window (from the first enqueue) is over
    await settle()
    second = await service.enqueue(PAYLOAD, key="k")
    assert not second.duplicate
    assert second.id != first.id
    clock.advance(9.5)
    await settle()
    assert await service.enqueue(PAYLOAD, key="k") == Enqueued(second.id, True, None)


async def test_a_duplicate_wakes_nobody_and_is_not_counted(service: Service) -> None:
    first = await service.enqueue(PAYLOAD, key="k")
    d = await service.claim(wait_ms=0)
    assert d is not None
    await service.ack(d.task.id, d.lease_id)
    parked = await park(service, wait_ms=20_000)
    assert await service.enqueue(PAYLOAD, key="k") == Enqueued(first.id, True, None)
    await settle()
    assert not parked.done()
    assert (await service.stats()).totals.enqueued == 1
    parked.cancel()


async def test_claim_takes_from_the_listed_queues_in_order(service: Service) -> None:
    a = await service.enqueue(payload(1), queue="a")
    b = await service.enqueue(payload(2), queue="b")
    plain = await service.enqueue(payload(3))
    got = []
    for queues in ("b,a", ["a", "b"], None):
        d = await service.claim(wait_ms=0, queues=queues)
        assert d is not None
        got.append(d.task.id)
    assert got == [b.id, a.id, plain.id]
    assert await service.claim(wait_ms=0, queues="a,b,default") is None


@pytest.mark.parametrize(
    "queues", ["a,,b", "a, b", ",", "x" * 65, 5, [3], ["a b"], ",".join(["q"] * 65)]
)
async def test_a_bad_list_of_queues_is_refused(service: Service, queues: object) -> None:
    with pytest.raises(InvalidArgument) as err:
        await service.claim(wait_ms=0, queues=queues)
    assert "queue" in err.value.message
    with pytest.raises(InvalidArgument):
        await service.next_job(0, None, queues=queues)
    with pytest.raises(InvalidArgument):
        await service.open_stream(1, None, queues=queues)
    assert service.waiting == 0


async def test_a_list_of_queues_may_repeat_a_name_and_be_empty(service: Service) -> None:
    await service.enqueue(payload(1))
    d = await service.claim(wait_ms=0, queues=[])  # the gRPC repeated field left empty
    assert d is not None
    await service.enqueue(payload(2), queue="a")
    d = await service.claim(wait_ms=0, queues="a,a,a")
    assert d is not None
    assert d.task.queue == "a"


async def test_priorities_through_the_service(service: Service) -> None:
    ids = [(await service.enqueue(payload(n), priority=p)).id for n, p in enumerate([1, 9, 1, 5])]
    got = []
    for _ in ids:
        d = await service.claim(wait_ms=0)
        assert d is not None
        got.append(d.task.id)
    assert got == [ids[1], ids[3], ids[0], ids[2]]


async def test_a_parked_claim_is_woken_only_by_its_queues(service: Service) -> None:
    on_b = await park(service, wait_ms=20_000, queues="b")
    await service.enqueue(payload(1), queue="a")
    await settle()
    assert not on_b.done()
    assert await gauges(service) == (1, 0, 0, 0)
    b = await service.enqueue(payload(2), queue="b")
    d = await answer(on_b)
    assert d is not None
    assert d.task.id == b.id
    on_either = await park(service, wait_ms=20_000, queues="c,b")
    await service.enqueue(payload(3), queue="b")
    d = await answer(on_either)
    assert d is not None
    assert d.task.queue == "b"
    assert await gauges(service) == (1, 2, 0, 0)  # a's task is still waiting


async def test_a_delayed_task_wakes_a_claim_on_its_queue(
    service: Service, clock: FakeClock
) -> None:
    on_a = await park(service, wait_ms=20_000, queues="a")
    later = await service.enqueue(payload(1), queue="a", delay_ms=2000)
    clock.advance(2.0)
    d = await answer(on_a)
    assert d is not None
    assert d.task.id == later.id


async def test_pause_and_resume(service: Service) -> None:
    await service.pause("a")
    task = await service.enqueue(payload(1), queue="a")  # a paused queue takes tasks
    assert await service.claim(wait_ms=0, queues="a") is None
    parked = await park(service, wait_ms=20_000, queues="a")
    assert [(q.name, q.ready, q.paused) for q in await service.queues()] == [("a", 1, True)]
    await service.pause("a")  # idempotent
    await settle()
    assert not parked.done()
    await service.resume("a")  # wakes the parked claim
    d = await answer(parked)
    assert d is not None
    assert d.task.id == task.id
    await service.resume("a")
    await service.resume("new")  # an unknown queue is created
    assert [(q.name, q.paused) for q in await service.queues()] == [("a", False), ("new", False)]


async def test_a_stream_subscribes_to_its_queues(service: Service) -> None:
    stream = await service.open_stream(5, None, queues=["b", "a"])
    waiting = await pending_next(stream)
    await service.enqueue(payload(1))  # default: not for this stream
    await settle()
    assert not waiting.done()
    a = await service.enqueue(payload(2), queue="a")
    d = await answer(waiting)
    assert d is not None
    assert d.task.id == a.id
    # when both have tasks, the stream's first queue comes first
    await service.pause("b")
    b = await service.enqueue(payload(3), queue="b")
    a2 = await service.enqueue(payload(4), queue="a")
    d = await stream.next()
    assert d is not None
    assert d.task.id == a2.id
    await service.resume("b")
    d = await stream.next()
    assert d is not None
    assert d.task.id == b.id
    assert stream.unsettled == 3
    await stream.close()


@pytest.mark.parametrize("delay_ms", [0, 1500, 365 * 24 * 3600 * 1000])
async def test_nack_with_a_delay(service: Service, clock: FakeClock, delay_ms: int) -> None:
    task = await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0)
    assert d is not None
    await service.nack(d.task.id, d.lease_id, "later", delay_ms=delay_ms)
    found = await service.lookup(task.id)
    assert found.task.available_at == clock.now() + delay_ms / 1000
    stats = await service.stats()
    assert (stats.totals.nacked, stats.totals.retried) == (1, 1)
    if delay_ms == 1500:
        parked = await park(service, wait_ms=20_000)
        clock.advance(1.5)  # the sweeper wakes at exactly the retry time
        again = await answer(parked)
        assert again is not None
        assert (again.task.id, again.task.attempts) == (task.id, 2)


async def test_nack_terminal_buries_at_once(service: Service) -> None:
    task = await service.enqueue(PAYLOAD, max_attempts=5)
    d = await service.claim(wait_ms=0)
    assert d is not None
    await service.nack(d.task.id, d.lease_id, "poison", terminal=True)
    [dead] = await service.dead_letters()
    assert (dead.id, dead.attempts, dead.last_error) == (task.id, 1, "poison")
    assert (await service.lookup(task.id)).state == "dead"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"delay_ms": 10, "terminal": True}, "terminal"),
        ({"delay_ms": 0, "terminal": True}, "terminal"),
        ({"delay_ms": -1}, "delay_ms"),
        ({"delay_ms": "5"}, "delay_ms"),
        ({"delay_ms": True}, "delay_ms"),
        ({"terminal": 1}, "terminal"),
        ({"terminal": "true"}, "terminal"),
    ],
)
async def test_bad_nack_options_are_refused(
    service: Service, options: dict[str, Any], field: str
) -> None:
    await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0)
    assert d is not None
    with pytest.raises(InvalidArgument) as err:
        await service.nack(d.task.id, d.lease_id, "x", **options)
    assert field in err.value.message
    assert await gauges(service) == (0, 1, 0, 0)  # nothing moved
    await service.nack(d.task.id, d.lease_id, "x", delay_ms=None, terminal=False)
    assert await gauges(service) == (0, 0, 1, 0)


async def test_settle_many_takes_nack_options(service: Service, clock: FakeClock) -> None:
    ids = [(await service.enqueue(payload(n))).id for n in range(3)]
    ds = [await service.claim(wait_ms=0) for _ in ids]
    assert all(d is not None for d in ds)
    a, b, c = (d for d in ds if d is not None)
    acked, nacked = await service.settle_many(
        [],
        [
            (a.task.id, a.lease_id, "short", 250, None),
            (b.task.id, b.lease_id, "fatal", None, True),
            (c.task.id, c.lease_id, "both", 5, True),
        ],
    )
    assert acked == []
    assert nacked[:2] == [None, None]
    assert isinstance(nacked[2], InvalidArgument)
    assert (await service.lookup(ids[0])).task.available_at == clock.now() + 0.25
    assert (await service.lookup(ids[1])).state == "dead"
    assert (await service.lookup(ids[2])).state == "handed_out"


async def test_extend_defaults_and_caps(service: Service, clock: FakeClock) -> None:
    task = await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0, lease_ms=1000)
    assert d is not None
    clock.advance(0.5)
    await settle()
    assert await service.extend(d.task.id, d.lease_id) == clock.now() + 30.0
    assert await service.extend(d.task.id, d.lease_id, 45_000) == clock.now() + 45.0
    assert await service.extend(d.task.id, d.lease_id, 10**12) == clock.now() + 300.0
    assert await service.extend(d.task.id, d.lease_id, 1) == clock.now() + 0.001
    for bad in (0, -1, "100", True, 1.5):
        with pytest.raises(InvalidArgument) as err:
            await service.extend(d.task.id, d.lease_id, bad)
        assert "lease_ms" in err.value.message
    with pytest.raises(LeaseLost):
        await service.extend(d.task.id, "0" * 16)
    # the last extension stands
    deadline = await service.extend(d.task.id, d.lease_id, 2000)
    clock.advance(1.5)
    await settle()
    assert (await service.lookup(task.id)).state == "handed_out"
    clock.advance(deadline - clock.now())
    await wait_until(service.stats, reclaimed_more_than(0), what="the reclaim")
    with pytest.raises(NotFound):
        await service.extend(d.task.id, d.lease_id)  # reclaimed: nobody holds it
    with pytest.raises(InvalidArgument):
        await service.extend(d.task.id, "")


async def test_an_extended_lease_outlives_its_first_deadline(
    service: Service, clock: FakeClock
) -> None:
    await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0, lease_ms=2000)
    assert d is not None
    for _ in range(10):  # a handler that runs 10 s on a 2 s lease, extending each second
        clock.advance(1.0)
        await settle()
        await service.extend(d.task.id, d.lease_id, 2000)
    await service.ack(d.task.id, d.lease_id)
    stats = await service.stats()
    assert (stats.totals.reclaimed, stats.totals.acked) == (0, 1)


async def test_lookup_through_the_service(service: Service) -> None:
    task = await service.enqueue(PAYLOAD, queue="q", priority=2)
    found = await service.lookup(task.id)
    assert (found.state, found.task.queue, found.task.priority) == ("ready", "q", 2)
    d = await service.claim(wait_ms=0, queues="q")
    assert d is not None
    assert (await service.lookup(task.id)).state == "handed_out"
    await service.ack(d.task.id, d.lease_id)
    with pytest.raises(NotFound):
        await service.lookup(task.id)
    with pytest.raises(NotFound):
        await service.lookup("no-such-task")
    for bad in ("", 5, None):
        with pytest.raises(InvalidArgument):
            await service.lookup(bad)


async def test_requeue_all_and_purge(service: Service) -> None:
    ids = []
    for queue in ("a", "b", "a"):
        ids.append((await service.enqueue(PAYLOAD, queue=queue, max_attempts=1)).id)
        d = await service.claim(wait_ms=0, queues=queue)
        assert d is not None
        await service.nack(d.task.id, d.lease_id, "x")
    assert [t.id for t in await service.dead_letters(queue="a")] == [ids[0], ids[2]]
    on_a = await park(service, wait_ms=20_000, queues="a")
    assert await service.requeue_all("a") == 2
    d = await answer(on_a)  # requeued tasks feed waiting claims
    assert d is not None
    assert d.task.id == ids[0]
    assert await service.requeue_all("a") == 0
    await service.purge(ids[1])
    with pytest.raises(NotFound):
        await service.purge(ids[1])
    with pytest.raises(NotFound):
        await service.purge(ids[2])  # ready, not dead
    stats = await service.stats()
    assert (stats.totals.purged, stats.totals.requeued) == (1, 2)
    gauges_sum = stats.ready + stats.handed_out + stats.delayed + stats.dead
    assert gauges_sum == stats.totals.enqueued - stats.totals.acked - stats.totals.purged
    assert await service.requeue_all() == 0
    assert (await service.stats("b")).totals.purged == 1


async def test_a_shortened_lease_is_reclaimed_at_its_new_deadline(
    store: Store, clock: FakeClock
) -> None:
    # A sweeper that ticks only once a minute as a safety net: the reclaim must come from the
    # service telling it when the new deadline is, not from a tick.
    svc = Service(store, clock, sweep_interval=60.0)
    await svc.start()
    try:
        task = await svc.enqueue(PAYLOAD)
        d = await svc.claim(wait_ms=0, lease_ms=300_000)
        assert d is not None
        clock.advance(1.0)
        await settle()
        assert await svc.extend(d.task.id, d.lease_id, 2000) == clock.now() + 2.0
        clock.advance(2.0)
        await wait_until(svc.stats, reclaimed_more_than(0), what="the reclaim at the new deadline")
        assert (await svc.lookup(task.id)).state == "delayed"
    finally:
        await svc.close()


class GatedStore(MemoryStore):
    """A memory store whose batch claims suspend until the test opens the gate, as a durable
    store's do while they commit."""

    never_suspends = False

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Event | None = None
        self.held_up = 0  # claims waiting at the gate

    async def claim_many(
        self, leases: Sequence[float], *, now: float, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> list[Delivery]:
        got = await super().claim_many(leases, now=now, queues=queues)
        if self.gate is not None:
            self.held_up += 1
            await self.gate.wait()
            self.held_up -= 1
        return got


async def test_a_stream_drained_while_a_claim_for_it_commits_gets_nothing_new(
    clock: FakeClock,
) -> None:
    store = GatedStore()
    svc = Service(store, clock)
    await svc.start()
    try:
        stream = await svc.open_stream(2, None)
        store.gate = gate = asyncio.Event()
        enqueue = asyncio.ensure_future(svc.enqueue(PAYLOAD))
        await wait_until(lambda: store.held_up == 1, what="the pump's claim to be under way")
        await stream.drain()
        gate.set()
        await enqueue
        await settle()
        # the task claimed for it went back to ready, and the stream is out of line for good
        assert (stream.pending, stream.unsettled) == (0, 0)
        assert await gauges(svc) == (1, 0, 0, 0)
        assert svc.waiting == 0
        store.gate = None
        await svc.enqueue(PAYLOAD)
        await settle()
        assert stream.pending == 0
        assert await gauges(svc) == (2, 0, 0, 0)
        await stream.close()
    finally:
        await svc.close()


async def test_a_stream_whose_caller_goes_away_while_it_opens_is_closed(
    clock: FakeClock,
) -> None:
    """The caller of open_stream is cancelled while the store claims for the new stream (a
    gRPC client that cancels at once, on PostgreSQL): it never gets the stream, so the broker
    closes it. Before, the stream stayed open and went on taking tasks nobody would read."""
    store = GatedStore()
    svc = Service(store, clock)
    await svc.start()
    try:
        await svc.enqueue(PAYLOAD)
        store.gate = gate = asyncio.Event()
        opening = asyncio.ensure_future(svc.open_stream(4, None))
        await wait_until(lambda: store.held_up, what="the claim for the new stream to commit")
        assert svc.open_streams == 1
        opening.cancel()
        await wait_until(opening.done, what="the cancelled open_stream to end")
        assert opening.cancelled()
        assert svc.open_streams == 0
        gate.set()  # the claim commits: its task goes back, to be handed out again
        store.gate = None
        await wait_until(
            lambda: gauges(svc), lambda g: g == (1, 0, 0, 0), what="the task to be ready again"
        )
        later = await svc.open_stream(4, None)
        delivery = await asyncio.wait_for(later.next(), 5)
        assert delivery is not None
        await svc.ack(delivery.task.id, delivery.lease_id)
        await later.close()
        assert svc.open_streams == 0
    finally:
        await svc.close()


async def test_the_dedup_window_comes_from_the_constructor(store: Store, clock: FakeClock) -> None:
    svc = Service(store, clock, dedup_window=2.0)
    await svc.start()
    try:
        first = await svc.enqueue(PAYLOAD, key="k", queue="q")
        clock.advance(1.75)
        await settle()
        assert await svc.enqueue(PAYLOAD, key="k", queue="q") == Enqueued(first.id, True, None)
        assert not (await svc.enqueue(PAYLOAD, key="k")).duplicate  # another queue
        clock.advance(0.25)
        await settle()
        assert not (await svc.enqueue(PAYLOAD, key="k", queue="q")).duplicate
    finally:
        await svc.close()


# -- limits of queues and keys: duplicates take no room; the number of queues is bounded -------


async def test_a_duplicate_at_the_task_limit_is_still_answered_as_a_duplicate(
    service: Service,
) -> None:
    first = await service.enqueue(PAYLOAD, key="k-1")
    service.max_tasks = 1  # full: the one task above
    with pytest.raises(Overloaded):
        await service.enqueue(PAYLOAD, key="k-2")
    again = await service.enqueue(PAYLOAD, key="k-1")
    assert again.duplicate
    assert again.id == first.id
    done = await service.enqueue_many([Submission(PAYLOAD, key="k-1")] * 3)
    assert [d.duplicate for d in done] == [True, True, True]
    assert (await service.stats()).totals.enqueued == 1


async def test_a_batch_counts_a_key_repeated_within_it_once(service: Service) -> None:
    service.max_tasks = 1
    done = await service.enqueue_many([Submission(PAYLOAD, key="same")] * 2)
    assert [d.duplicate for d in done] == [False, True]
    assert done[1].id == done[0].id


async def test_new_queues_past_the_limit_are_refused_and_existing_ones_still_work(
    service: Service,
) -> None:
    service.max_queues = 3
    await service.enqueue(PAYLOAD)  # default
    await service.enqueue(PAYLOAD, queue="a")
    await service.pause("b")
    with pytest.raises(Overloaded, match="at most 3 queues") as e:
        await service.enqueue(PAYLOAD, queue="c")
    assert "queue c would be a new one" in e.value.message
    with pytest.raises(Overloaded):
        await service.pause("d")
    with pytest.raises(Overloaded):
        await service.enqueue_many([Submission(PAYLOAD, queue="a"), Submission(PAYLOAD, queue="e")])
    assert (await service.stats()).totals.enqueued == 2  # the refused batch left nothing
    await service.enqueue(PAYLOAD, queue="a")
    await service.resume("b")
    assert [q.name for q in await service.queues()] == ["a", "b", "default"]
    service.max_queues = 0  # no limit
    await service.enqueue(PAYLOAD, queue="c")
    assert len(await service.queues()) == 4


# -- batch claims (GET /jobs/next/batch) -----------------------------------------------------------


async def park_batch(service: Service, **kw: Any) -> asyncio.Task[list[Delivery]]:
    """Start a batch claim and let it park."""
    before = service.waiting
    task = asyncio.ensure_future(service.claim_batch(**kw))
    await wait_until(lambda: task.done() or service.waiting > before, what="the claim to park")
    assert not task.done(), "the claim should be parked, waiting for a task"
    return task


async def batch_answer(claim: asyncio.Task[list[Delivery]]) -> list[Delivery]:
    await wait_until(claim.done, what="an answer")
    return claim.result()


async def test_a_batch_claim_takes_up_to_max_of_what_is_ready(service: Service) -> None:
    ids = [e.id for e in await service.enqueue_many([Submission(payload(n)) for n in range(5)])]
    got = await service.claim_batch(wait_ms=0, max_tasks=3)
    assert [d.task.id for d in got] == ids[:3]
    assert all(d.task.attempts == 1 for d in got)
    assert len({d.lease_id for d in got}) == 3
    rest = await service.claim_batch(wait_ms=0, max_tasks=10)
    assert [d.task.id for d in rest] == ids[3:]
    assert await service.claim_batch(wait_ms=0, max_tasks=10) == []
    assert await gauges(service) == (0, 5, 0, 0)


async def test_a_batch_claim_takes_by_priority_and_queue_order(service: Service) -> None:
    low = (await service.enqueue(payload(1), queue="b")).id
    high = (await service.enqueue(payload(2), queue="b", priority=9)).id
    other = (await service.enqueue(payload(3), queue="a")).id
    got = await service.claim_batch(wait_ms=0, max_tasks=5, queues="a,b")
    assert [d.task.id for d in got] == [other, high, low]


async def test_a_parked_batch_claim_takes_what_comes_with_the_first(service: Service) -> None:
    claim = await park_batch(service, wait_ms=20_000, max_tasks=3)
    ids = [e.id for e in await service.enqueue_many([Submission(payload(n)) for n in range(5)])]
    got = await batch_answer(claim)
    assert [d.task.id for d in got] == ids[:3]  # no more than max, in order
    assert await gauges(service) == (2, 3, 0, 0)


async def test_a_parked_batch_claim_answers_with_one_that_comes_alone(service: Service) -> None:
    claim = await park_batch(service, wait_ms=20_000, max_tasks=10)
    view = await service.enqueue(PAYLOAD)
    got = await batch_answer(claim)
    assert [d.task.id for d in got] == [view.id]  # it does not wait for company


async def test_a_parked_batch_claim_times_out_with_none(service: Service, clock: FakeClock) -> None:
    claim = await park_batch(service, wait_ms=1000, max_tasks=4)
    clock.advance(1.0)
    assert await wait_until(claim.done, what="the time-out")
    assert claim.result() == []
    assert service.waiting == 0


async def test_a_cancelled_batch_claim_gives_back_what_it_was_handed(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = await park_batch(service, wait_ms=20_000, max_tasks=5)
    deliver = BatchPoller.deliver

    def deliver_then_disconnect(self: BatchPoller, delivery: Delivery) -> None:
        deliver(self, delivery)
        claim.cancel()  # its client goes away as its tasks are handed to it

    monkeypatch.setattr(BatchPoller, "deliver", deliver_then_disconnect)
    ids = [e.id for e in await service.enqueue_many([Submission(payload(n)) for n in range(3)])]
    await wait_until(claim.done, what="the claim to end")
    assert claim.cancelled()
    stats = await wait_until(service.stats, lambda s: s.ready == 3, what="the tasks back")
    assert (stats.handed_out, stats.totals.delivered) == (0, 0)
    again = await service.claim_batch(wait_ms=0, max_tasks=5)
    assert [(d.task.id, d.task.attempts) for d in again] == [(i, 1) for i in ids]


async def test_a_batch_claim_whose_answer_cannot_be_written_gives_all_back(
    service: Service,
) -> None:
    ids = [e.id for e in await service.enqueue_many([Submission(payload(n)) for n in range(3)])]

    async def broken(deliveries: list[Delivery]) -> None:
        raise ConnectionResetError("the client went away")

    assert await service.claim_batch(wait_ms=0, max_tasks=5, hand_over=broken) == []
    stats = await wait_until(service.stats, lambda s: s.ready == 3, what="the tasks back")
    assert stats.handed_out == 0
    again = await service.claim_batch(wait_ms=0, max_tasks=5)
    assert [d.task.id for d in again] == ids


async def test_batch_claims_share_tasks_with_single_ones_in_turn(service: Service) -> None:
    batch = await park_batch(service, wait_ms=20_000, max_tasks=2)
    single = await park(service, wait_ms=20_000)
    ids = [e.id for e in await service.enqueue_many([Submission(payload(n)) for n in range(3)])]
    got = await batch_answer(batch)
    one = await answer(single)
    assert one is not None
    # Round robin: the batch claim (first in line), then the single one, then the batch again.
    assert [d.task.id for d in got] == [ids[0], ids[2]]
    assert one.task.id == ids[1]


@pytest.mark.parametrize("value", [0, -1, "3", True, 2.5])
async def test_a_batch_claim_refuses_a_bad_max(service: Service, value: object) -> None:
    with pytest.raises(InvalidArgument, match="max"):
        await service.claim_batch(wait_ms=0, max_tasks=value)


async def test_a_batch_claim_clamps_a_huge_max(service: Service) -> None:
    await service.enqueue_many([Submission(payload(n)) for n in range(3)])
    assert len(await service.claim_batch(wait_ms=0, max_tasks=10**30)) == 3


async def test_a_closing_service_answers_parked_batch_claims_with_none(service: Service) -> None:
    claim = await park_batch(service, wait_ms=20_000, max_tasks=3)
    await service.close()
    assert await wait_until(claim.done, what="an answer")
    assert claim.result() == []
    assert await service.claim_batch(wait_ms=20_000, max_tasks=3) == []


# -- strict settles (POST /jobs/settle) ------------------------------------------------------------


async def test_a_strict_settle_refuses_all_for_one_malformed(service: Service) -> None:
    await service.enqueue_many([Submission(payload(n)) for n in range(2)])
    a, b = await service.claim_batch(wait_ms=0, max_tasks=2)
    with pytest.raises(InvalidArgument, match=r"^nacks\[0\]\.error must be a string"):
        await service.settle_many(
            [(a.task.id, a.lease_id)], [(b.task.id, b.lease_id, 12)], strict=True
        )
    with pytest.raises(InvalidArgument, match=r"^acks\[1\]\.lease_id must be a string"):
        await service.settle_many([(a.task.id, a.lease_id), ("x", None)], [], strict=True)
    assert await gauges(service) == (0, 2, 0, 0)  # nothing was settled
    acked, nacked = await service.settle_many(
        [(a.task.id, a.lease_id), (a.task.id, a.lease_id)], [(b.task.id, "other", "e")], strict=True
    )
    assert acked[0] is None
    assert isinstance(acked[1], NotFound)  # settled once: a refusal, not a malformed one
    assert isinstance(nacked[0], LeaseLost)
    assert await gauges(service) == (0, 1, 0, 0)
