"""The service's events (``wqbroker.events``), as a listener hears them, over every store: each
store call that changes something timed once (a failed one too; a sweep only when it did
something), hand-outs and settlements told once per batch with the leases they concern, leases
that end unsettled told gone. The broker's metrics are such a listener
(``tests/broker/test_metrics.py`` checks what they make of it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from tests.helpers import wait_until
from wqbroker.clock import FakeClock
from wqbroker.errors import NotFound
from wqbroker.events import Events, Fanout, Operation
from wqbroker.models import Delivery, Enqueued
from wqbroker.service import Service, Submission
from wqbroker.store import Store

PAYLOAD = b'{"n": 1}'


class Recorder(Events):
    """Every event, in order (store calls apart, by operation)."""

    def __init__(self) -> None:
        self.heard: list[tuple[object, ...]] = []
        self.timed: list[Operation] = []

    def enqueued(self, done: Sequence[Enqueued]) -> None:
        self.heard.append(("enqueued", *(e.id for e in done)))

    def handed_out(self, deliveries: Sequence[Delivery]) -> None:
        self.heard.append(("handed_out", *(d.lease_id for d in deliveries)))

    def settled(self, acked: Sequence[str], nacked: Sequence[str]) -> None:
        self.heard.append(("settled", tuple(acked), tuple(nacked)))

    def leases_gone(self, lease_ids: Sequence[str]) -> None:
        self.heard.append(("leases_gone", *lease_ids))

    def store_call(self, operation: Operation, seconds: float) -> None:
        assert seconds >= 0
        self.timed.append(operation)

    def taken(self) -> tuple[list[tuple[object, ...]], list[Operation]]:
        """What was heard since the last call."""
        heard, timed = self.heard, self.timed
        self.heard, self.timed = [], []
        return heard, timed


class Untimed(Events):
    """A listener of hand-outs only."""

    def __init__(self) -> None:
        self.handed_out_count = 0

    def handed_out(self, deliveries: Sequence[Delivery]) -> None:
        self.handed_out_count += len(deliveries)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def heard(store: Store, clock: FakeClock, recorder: Recorder) -> AsyncIterator[Service]:
    """A service (its sweeper not started: the tests sweep) whose listener is ``recorder``."""
    service = Service(store, clock, events=recorder)
    yield service
    await service.close()


async def test_every_store_call_that_changes_something_is_timed_once(
    heard: Service, recorder: Recorder
) -> None:
    service = heard
    await service.enqueue(PAYLOAD)
    await service.enqueue_many([Submission(PAYLOAD)] * 4)
    one = await service.claim(wait_ms=0)
    assert one is not None
    two = await service.claim_batch(0, None, 2)
    await service.extend(one.task.id, one.lease_id)
    await service.ack(one.task.id, one.lease_id)
    await service.nack(two[0].task.id, two[0].lease_id, "no", terminal=True)
    await service.settle_many([(two[1].task.id, two[1].lease_id)], ())
    with pytest.raises(NotFound):
        await service.ack("nope", "x")  # refused: timed all the same
    assert recorder.taken()[1] == [
        "enqueue",
        "enqueue",
        "claim",
        "claim",
        "extend",
        "settle",
        "settle",
        "settle",
        "settle",
    ]
    (dead,) = await service.dead_letters()
    await service.requeue(dead.id)
    await service.requeue_all()
    last = await service.claim(wait_ms=0)
    assert last is not None
    await service.nack(last.task.id, last.lease_id, "no", terminal=True)
    await service.purge(last.task.id)
    await service.pause("q")
    await service.resume("q")
    await service.sweep()  # nothing due: nothing changed, nothing timed
    timed = recorder.taken()[1]
    assert timed == ["requeue", "requeue", "claim", "settle", "purge", "pause", "pause"]


async def test_hand_outs_and_settlements_are_told_once_per_batch(
    heard: Service, recorder: Recorder
) -> None:
    service = heard
    done = await service.enqueue_many([Submission(PAYLOAD)] * 4)
    assert recorder.taken()[0] == [("enqueued", *(d.id for d in done))]
    got = await service.claim_batch(0, None, 4)
    assert recorder.taken()[0] == [("handed_out", *(d.lease_id for d in got))]
    a, b, c, d = got
    acked, nacked = await service.settle_many(
        [(a.task.id, a.lease_id), (b.task.id, "not its lease"), (c.task.id, c.lease_id)],
        [(d.task.id, d.lease_id, "it broke"), ("nope", "x", None)],
    )
    assert acked[1] is not None  # refused: not settled
    assert nacked[1] is not None
    assert recorder.taken()[0] == [("settled", (a.lease_id, c.lease_id), (d.lease_id,))]
    await service.ack(b.task.id, b.lease_id)
    assert recorder.taken()[0] == [("settled", (b.lease_id,), ())]
    # A claim parked for a task: the pump's hand-out is told, as a claim's is.
    parked = asyncio.ensure_future(service.claim(wait_ms=60_000))
    await wait_until(lambda: service.parked_polls, lambda n: n == 1, what="the claim to park")
    (new,) = await service.enqueue_many([Submission(PAYLOAD)])
    delivery = await asyncio.wait_for(parked, 10)
    assert delivery is not None
    await service.nack(delivery.task.id, delivery.lease_id, "no")
    heard_now = recorder.taken()[0]
    assert heard_now == [
        ("enqueued", new.id),
        ("handed_out", delivery.lease_id),
        ("settled", (), (delivery.lease_id,)),
    ]


async def test_leases_that_end_unsettled_are_told_gone(
    heard: Service, recorder: Recorder, clock: FakeClock
) -> None:
    service = heard
    await service.enqueue_many([Submission(PAYLOAD)] * 3)
    # Handed back: nobody saw the task.
    first = await service.claim(wait_ms=0)
    assert first is not None
    recorder.taken()
    await service.give_back(first)
    assert recorder.taken() == ([("leases_gone", first.lease_id)], ["release"])
    # Reclaimed when its stream ends.
    stream = await service.open_stream(1, None)
    sent = await asyncio.wait_for(stream.next(), 10)
    assert sent is not None
    assert recorder.taken() == ([("handed_out", sent.lease_id)], ["claim"])
    await stream.close()
    assert recorder.taken() == ([("leases_gone", sent.lease_id)], ["reclaim"])
    # Reclaimed by a sweep once its lease ran out.
    expiring = await service.claim(wait_ms=0, lease_ms=1000)
    assert expiring is not None
    recorder.taken()
    clock.advance(2.0)
    await wait_until(
        service.sweep,
        lambda _: ("leases_gone", expiring.lease_id) in recorder.heard,
        what="the sweep to reclaim the lease",
    )
    heard_now, timed = recorder.taken()
    assert heard_now == [("leases_gone", expiring.lease_id)]
    assert "sweep" in timed


async def test_a_hand_out_whose_caller_went_away_is_told_then_gone(
    heard: Service, recorder: Recorder
) -> None:
    service = heard
    await service.enqueue(PAYLOAD)
    recorder.taken()
    claim = asyncio.ensure_future(service.claim(wait_ms=0))
    await asyncio.sleep(0)
    claim.cancel()
    await wait_until(claim.done, what="the claim to end")
    if claim.cancelled():  # a store that suspends: the hand-out committed, then undone
        await wait_until(
            lambda: len(recorder.timed), lambda n: n >= 2, what="the hand-out to be undone"
        )
        heard_now, timed = recorder.taken()
        (_, lease_id), gone = heard_now
        assert gone == ("leases_gone", lease_id)
        assert timed == ["claim", "release"]
    else:  # a store that never waits: the claim was done before the cancel could land
        delivery = claim.result()
        assert delivery is not None
        assert recorder.taken() == ([("handed_out", delivery.lease_id)], ["claim"])


@pytest.mark.parametrize("backend", ["memory"])
async def test_a_fanout_tells_every_listener(backend: str, store: Store, clock: FakeClock) -> None:
    first, second, untimed = Recorder(), Recorder(), Untimed()
    service = Service(store, clock, events=Fanout(first, untimed, second))
    try:
        await service.enqueue(PAYLOAD)
        delivery = await service.claim(wait_ms=0)
        assert delivery is not None
        await service.ack(delivery.task.id, delivery.lease_id)
    finally:
        await service.close()
    assert first.heard == second.heard
    assert [event[0] for event in first.heard] == ["enqueued", "handed_out", "settled"]
    assert first.timed == second.timed == ["enqueue", "claim", "settle"]
    assert untimed.handed_out_count == 1
    # Store calls are timed only for a listener that hears them.
    assert not untimed.times_store_calls
    assert not Fanout(untimed, Events()).times_store_calls
    assert Fanout(untimed, first).times_store_calls
