"""The service's side of limits per queue (docs/design/schedules.md), on a fake clock and every
store: what set_limits checks (each refusal an InvalidArgument naming the member), and the
dispatcher's waking: a claim parked on a rate-limited queue is served when a token comes (one
timer, no polling, as many consumers as there are tokens), a freed concurrency slot (ack, nack,
lease run out) wakes exactly one parked consumer, a stream with prefetch is fed only what the
limits allow, and raising or clearing a limit feeds the consumers waiting."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

from tests.helpers import settle, wait_until
from wqbroker.clock import FakeClock, SystemClock
from wqbroker.errors import InvalidArgument, Overloaded
from wqbroker.models import Delivery, Limits, RateLimit
from wqbroker.service import Service, Submission
from wqbroker.store import Store

PAYLOAD = b'{"job": 1}'
Q = "limited"
OTHER = "other"


async def fill(service: Service, n: int, queue: str = Q) -> None:
    for _ in range(n):
        await service.enqueue(PAYLOAD, queue=queue)


def park(service: Service, n: int = 1, queue: str = Q) -> list[asyncio.Task[Delivery | None]]:
    """``n`` long-polling claims of ``queue`` (waiting up to 30 s of the fake clock)."""
    return [
        asyncio.get_running_loop().create_task(service.claim(30_000, 60_000, queues=queue))
        for _ in range(n)
    ]


async def parked(service: Service, n: int) -> None:
    await wait_until(lambda: service.parked_polls == n, what=f"{n} claims to park")


def served(tasks: Sequence[asyncio.Task[Delivery | None]]) -> list[Delivery]:
    return [d for t in tasks if t.done() and (d := t.result()) is not None]


async def done_count(tasks: Sequence[asyncio.Task[Delivery | None]], n: int) -> None:
    await wait_until(lambda: len(served(tasks)) == n, what=f"{n} claims served")


async def quiet() -> None:
    """Long enough for any background pump of a store that suspends to have run."""
    for _ in range(5):
        await settle()
        await asyncio.sleep(0.01)


class Calls:
    """Counts the claims the store is asked for (claim, claim_many, settle_claim)."""

    def __init__(self, store: Store) -> None:
        self.n = 0
        for name in ("claim", "claim_many", "settle_claim"):
            setattr(store, name, self._counted(getattr(store, name)))

    def _counted(self, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            return await call(*args, **kwargs)

        return counted


@pytest.fixture
async def cleanup(service: Service) -> AsyncIterator[list[asyncio.Task[Any]]]:
    """Tasks the test leaves parked: cancelled at its end."""
    left: list[asyncio.Task[Any]] = []
    yield left
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


# -- what is checked -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "concurrency", "named"),
    [
        ({"tasks": 0, "per_ms": 1000}, None, "rate.tasks"),
        ({"tasks": -3, "per_ms": 1000}, None, "rate.tasks"),
        ({"tasks": 1_000_001, "per_ms": 1000}, None, "rate.tasks"),
        ({"tasks": 1.5, "per_ms": 1000}, None, "rate.tasks"),
        ({"tasks": True, "per_ms": 1000}, None, "rate.tasks"),
        ({"tasks": "5", "per_ms": 1000}, None, "rate.tasks"),
        ({"per_ms": 1000}, None, "rate.tasks"),
        ({"tasks": 5, "per_ms": 0}, None, "rate.per_ms"),
        ({"tasks": 5, "per_ms": 86_400_001}, None, "rate.per_ms"),
        ({"tasks": 5}, None, "rate.per_ms"),
        ({"tasks": 5, "per_ms": 1000, "burst": 0}, None, "rate.burst"),
        ({"tasks": 5, "per_ms": 1000, "burst": 1_000_001}, None, "rate.burst"),
        ({"tasks": 5, "per_ms": 1000, "burst": False}, None, "rate.burst"),
        ({"tasks": 5, "per_ms": 1000, "every": 2, "size": 1}, None, "'every', 'size'"),
        ("20/s", None, "rate"),
        ([20, 1000], None, "rate"),
        (None, 0, "concurrency"),
        (None, -1, "concurrency"),
        (None, 1_000_001, "concurrency"),
        (None, "4", "concurrency"),
        (None, True, "concurrency"),
        (None, 2.0, "concurrency"),
    ],
)
async def test_limits_are_checked(
    service: Service, rate: object, concurrency: object, named: str
) -> None:
    with pytest.raises(InvalidArgument) as e:
        await service.set_limits(Q, rate, concurrency)
    assert named in e.value.message
    assert Q not in {r.name for r in await service.queues()}  # nothing made


async def test_the_queue_name_is_checked(service: Service) -> None:
    with pytest.raises(InvalidArgument) as e:
        await service.set_limits("no spaces", None, 3)
    assert "queue" in e.value.message
    with pytest.raises(InvalidArgument):
        await service.clear_limits(42)


async def test_set_limits_answers_the_limits_in_force(service: Service) -> None:
    limits = await service.set_limits(Q, {"tasks": 20, "per_ms": 1000}, 4)
    assert limits == Limits(RateLimit(20, 1.0, 20), 4)  # burst: tasks when absent
    (found,) = [r for r in await service.queues() if r.name == Q]
    assert found.limits == limits
    assert found.tokens == pytest.approx(20.0)
    assert await service.set_limits(Q, {"tasks": 5, "per_ms": 60_000, "burst": 1}, None) == (
        Limits(RateLimit(5, 60.0, 1))
    )
    assert await service.set_limits(Q, None, None) is None  # both absent: none
    (found,) = [r for r in await service.queues() if r.name == Q]
    assert found.limits is None
    assert found.tokens is None
    await service.set_limits(Q, None, 2)
    await service.clear_limits(Q)
    assert [r.limits for r in await service.queues() if r.name == Q] == [None]
    (report,) = [r for r in await service.queue_report() if r.queue.name == Q]
    assert report.queue.limits is None


async def test_limits_on_a_new_queue_count_against_max_queues(
    store: Store, clock: FakeClock
) -> None:
    service = Service(store, clock, max_queues=2)
    await service.start()
    try:
        await service.set_limits("a", None, 1)
        await service.set_limits("b", {"tasks": 1, "per_ms": 1000}, None)
        with pytest.raises(Overloaded):
            await service.set_limits("c", None, 1)
        with pytest.raises(Overloaded):
            await service.clear_limits("c")
        await service.set_limits("a", None, 5)  # an existing one: no new room needed
    finally:
        await service.close()


# -- a rate limit: parked claims served when tokens come ------------------------------------------


async def test_a_parked_claim_is_served_when_a_token_comes(
    service: Service, clock: FakeClock, cleanup: list[asyncio.Task[Any]]
) -> None:
    await service.set_limits(Q, {"tasks": 2, "per_ms": 1000, "burst": 1}, None)
    await fill(service, 3)
    assert await service.claim(0, queues=Q) is not None  # the burst
    assert await service.claim(0, queues=Q) is None
    waiting = park(service)
    cleanup += waiting
    await parked(service, 1)
    clock.advance(0.25)
    await quiet()
    assert served(waiting) == []
    clock.advance(0.25)  # a token every half second
    await done_count(waiting, 1)
    assert service.parked_polls == 0


async def test_tokens_serve_as_many_parked_claims_as_they_allow_and_no_more(
    service: Service, clock: FakeClock, cleanup: list[asyncio.Task[Any]]
) -> None:
    await service.set_limits(Q, {"tasks": 2, "per_ms": 1000, "burst": 2}, None)
    await fill(service, 10)
    assert len(await service.claim_batch(0, max_tasks=10, queues=Q)) == 2
    waiting = park(service, 5)
    cleanup += waiting
    await parked(service, 5)
    clock.advance(0.25)  # (a shared store's first poll for ready tasks: PostgreSQL)
    await quiet()  # (and the claims made as they parked are done)
    assert served(waiting) == []
    calls = Calls(service.store)
    for _ in range(3):  # nothing is due: nothing is asked of the store (no polling)
        clock.advance(0.0625)
        await quiet()
    assert calls.n == 0
    assert served(waiting) == []
    clock.advance(0.0625)  # one token (every half second)
    await done_count(waiting, 1)
    await quiet()
    assert len(served(waiting)) == 1
    assert service.parked_polls == 4
    assert calls.n == 1  # one claim, for the one consumer a token serves
    clock.advance(1.0)  # two more (the burst): two more served
    await done_count(waiting, 3)
    await quiet()
    assert len(served(waiting)) == 3
    assert service.parked_polls == 2


async def test_a_batch_claim_parked_on_a_rate_limit_gets_what_the_tokens_allow(
    service: Service, clock: FakeClock
) -> None:
    await service.set_limits(Q, {"tasks": 4, "per_ms": 1000, "burst": 3}, None)
    await fill(service, 10)
    assert len(await service.claim_batch(0, max_tasks=10, queues=Q)) == 3
    batch = asyncio.get_running_loop().create_task(
        service.claim_batch(30_000, max_tasks=10, queues=Q)
    )
    await parked(service, 1)
    clock.advance(0.25)
    got = await asyncio.wait_for(batch, 10)
    assert len(got) == 1  # one token after 250 ms


async def test_a_claim_over_several_queues_takes_the_other_when_the_limited_one_is_spent(
    service: Service,
) -> None:
    await service.set_limits(Q, {"tasks": 1, "per_ms": 60_000}, None)
    await fill(service, 2, Q)
    await fill(service, 2, OTHER)
    queues = [Q, OTHER]
    got = [await service.claim(0, queues=queues) for _ in range(3)]
    assert [d.task.queue if d else None for d in got] == [Q, OTHER, OTHER]
    assert await service.claim(0, queues=queues) is None


# -- a concurrency limit: a freed slot wakes one ---------------------------------------------------


@pytest.mark.parametrize("how", ["ack", "nack", "settle", "lease"])
async def test_a_freed_slot_wakes_exactly_one_parked_claim(
    service: Service, clock: FakeClock, cleanup: list[asyncio.Task[Any]], how: str
) -> None:
    await service.set_limits(Q, None, 1)
    await fill(service, 5)
    held = await service.claim(0, 10_000, queues=Q)
    assert held is not None
    waiting = park(service, 3)
    cleanup += waiting
    await parked(service, 3)
    await quiet()
    assert served(waiting) == []
    if how == "ack":
        await service.ack(held.task.id, held.lease_id)
    elif how == "nack":
        await service.nack(held.task.id, held.lease_id, "again", delay_ms=60_000)
    elif how == "settle":
        await service.settle_many([(held.task.id, held.lease_id)], [])
    else:
        clock.advance(10.5)  # its lease runs out: the sweeper reclaims it
    await done_count(waiting, 1)
    await quiet()
    assert len(served(waiting)) == 1
    assert service.parked_polls == 2
    assert (await service.stats(Q)).handed_out == 1


async def test_raising_or_clearing_a_limit_feeds_the_consumers_waiting(
    service: Service, cleanup: list[asyncio.Task[Any]]
) -> None:
    await service.set_limits(Q, None, 1)
    await fill(service, 5)
    assert await service.claim(0, queues=Q) is not None
    waiting = park(service, 4)
    cleanup += waiting
    await parked(service, 4)
    await service.set_limits(Q, None, 3)
    await done_count(waiting, 2)
    await quiet()
    assert len(served(waiting)) == 2
    await service.clear_limits(Q)
    await done_count(waiting, 4)


async def test_a_rate_limited_queue_parks_nothing_forever_once_cleared(
    service: Service, cleanup: list[asyncio.Task[Any]]
) -> None:
    await service.set_limits(Q, {"tasks": 1, "per_ms": 3_600_000}, None)
    await fill(service, 3)
    assert await service.claim(0, queues=Q) is not None
    waiting = park(service, 2)
    cleanup += waiting
    await parked(service, 2)
    await service.clear_limits(Q)
    await done_count(waiting, 2)


async def test_tokens_keep_coming_on_the_system_clock(store: Store) -> None:
    # (On a real clock, a store that waits for its commits sees time pass between a claim and
    # the question of when the next token comes: it may have come already.)
    service = Service(store, SystemClock())
    await service.start()
    try:
        await service.set_limits(Q, {"tasks": 50, "per_ms": 1000, "burst": 5}, None)
        await service.enqueue_many([Submission(PAYLOAD, queue=Q) for _ in range(100)])
        stream = await service.open_stream(prefetch=20, queues=Q)
        got = 0
        stop = time.monotonic() + 0.6
        while time.monotonic() < stop:
            with contextlib.suppress(TimeoutError):
                d = await asyncio.wait_for(stream.next(), 0.1)
                assert d is not None
                got += 1
                await service.settle_many([(d.task.id, d.lease_id)], [])
        await stream.close()
        assert 5 + 50 * 0.3 <= got <= 5 + 50 * 0.7
    finally:
        await service.close()


# -- streams -------------------------------------------------------------------------------------


async def test_a_stream_holds_no_more_than_the_concurrency(service: Service) -> None:
    await service.set_limits(Q, None, 2)
    await fill(service, 6)
    stream = await service.open_stream(prefetch=5, queues=Q)
    try:
        first = [await stream.next(), await stream.next()]
        await quiet()
        assert stream.pending == 0
        assert stream.take_ready() == []
        assert (await service.stats(Q)).handed_out == 2
        d = first[0]
        assert d is not None
        await service.settle_many([(d.task.id, d.lease_id)], [])  # (a stream's refill path)
        await wait_until(lambda: stream.pending == 1, what="the freed slot refilled")
        await quiet()
        assert stream.pending == 1
        assert (await service.stats(Q)).handed_out == 2
    finally:
        await stream.close()


async def test_two_streams_share_a_concurrency_limit(service: Service) -> None:
    await service.set_limits(Q, None, 3)
    await fill(service, 10)
    a = await service.open_stream(prefetch=4, queues=Q)
    b = await service.open_stream(prefetch=4, queues=Q)
    try:
        await quiet()
        assert a.pending + b.pending == 3
        (d,) = (a if a.pending else b).take_ready(limit=1)
        await service.ack(d.task.id, d.lease_id)
        await wait_until(lambda: a.pending + b.pending == 3, what="the freed slot refilled")
        assert (await service.stats(Q)).handed_out == 3
    finally:
        await a.close()
        await b.close()


async def test_a_stream_is_fed_as_tokens_come(service: Service, clock: FakeClock) -> None:
    await service.set_limits(Q, {"tasks": 1, "per_ms": 1000, "burst": 2}, None)
    await fill(service, 10)
    stream = await service.open_stream(prefetch=10, queues=Q)
    try:
        await wait_until(lambda: stream.pending == 2, what="the burst")
        await quiet()
        assert stream.pending == 2
        clock.advance(0.5)
        await quiet()
        assert stream.pending == 2
        clock.advance(0.5)
        await wait_until(lambda: stream.pending == 3, what="a token's task")
        clock.advance(3.0)
        await wait_until(lambda: stream.pending == 5, what="the burst again")
        await quiet()
        assert stream.pending == 5
    finally:
        await stream.close()
