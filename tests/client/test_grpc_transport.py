"""wqclient's gRPC transport (``wqclient._grpc``) against a real broker on port 0: every
operation of the Transport seam and of its stream, with the models and errors it returns."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from tests.helpers import running_broker, settle, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqclient._grpc import GrpcStream, GrpcTransport
from wqclient.errors import InvalidArgument, LeaseLost, NotFound, StreamEnded
from wqclient.models import Delivery, Enqueued, EnqueueItem, QueueInfo
from wqclient.transport import StreamingTransport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[Broker]:
    async with running_broker(clock=clock, rng=random.Random(5)) as b:
        yield b


@pytest.fixture
async def transport(broker: Broker) -> AsyncIterator[GrpcTransport]:
    t = GrpcTransport(broker.grpc_target)
    yield t
    await t.close()


def at(clock: FakeClock, seconds: float = 0.0) -> datetime:
    return datetime.fromtimestamp(clock.now() + seconds, UTC)


def near(a: datetime, b: datetime) -> bool:
    return abs(a - b) < timedelta(milliseconds=1)


async def held(transport: GrpcTransport, *queues: str, lease_ms: int | None = None) -> Delivery:
    delivery = await transport.claim(0, lease_ms, list(queues) or None)
    assert delivery is not None
    return delivery


async def buried(transport: GrpcTransport, queue: str | None = None) -> str:
    task_id = await transport.enqueue(b"1", 1, None, queue=queue)
    d = await held(transport, queue or "default")
    await transport.nack(d.task.id, d.lease_id, "boom")
    return str(task_id)


async def test_the_grpc_transport_streams(transport: GrpcTransport) -> None:
    assert isinstance(transport, StreamingTransport)


async def test_enqueue_with_queue_priority_and_key(transport: GrpcTransport) -> None:
    first = await transport.enqueue(b'{"a": 1}', None, None, queue="q", priority=4)
    assert isinstance(first, Enqueued)
    assert not first.duplicate
    keyed = await transport.enqueue(b"1", None, None, queue="q", idempotency_key="k")
    again = await transport.enqueue(b"2", None, None, queue="q", idempotency_key="k")
    assert (again, again.duplicate) == (keyed, True)
    d = await held(transport, "q")
    assert (d.task.id, d.task.queue, d.task.priority, d.task.payload) == (first, "q", 4, {"a": 1})
    with pytest.raises(InvalidArgument, match="priority"):
        await transport.enqueue(b"1", None, None, priority=10)
    with pytest.raises(InvalidArgument, match="queue"):
        await transport.enqueue(b"1", None, None, queue="not valid")


async def test_enqueue_many_reports_duplicates_per_item(transport: GrpcTransport) -> None:
    existing = await transport.enqueue(b"0", None, None, idempotency_key="x")
    results = await transport.enqueue_many(
        [
            EnqueueItem(b"1", idempotency_key="x"),
            EnqueueItem(b"2", max_attempts=2, delay_ms=0, queue="b", priority=9),
            EnqueueItem(b"3"),
        ]
    )
    assert [r.duplicate for r in results] == [True, False, False]
    assert results[0] == existing
    d = await held(transport, "b")
    assert (d.task.id, d.task.priority, d.task.max_attempts) == (results[1], 9, 2)


async def test_claim_from_queues_in_order(transport: GrpcTransport) -> None:
    b = await transport.enqueue(b"1", None, None, queue="b")
    a = await transport.enqueue(b"1", None, None, queue="a")
    assert await transport.claim(0, None) is None  # the default queue is empty
    assert (await held(transport, "a", "b")).task.id == a
    assert (await held(transport, "a", "b")).task.id == b


async def test_nack_options(transport: GrpcTransport, clock: FakeClock) -> None:
    await transport.enqueue(b"1", 5, None)
    d = await held(transport)
    await transport.nack(d.task.id, d.lease_id, "wait", delay_ms=2000)
    assert (await transport.get_task(d.task.id)).state == "delayed"
    clock.advance(2.0)
    await settle()
    d = await held(transport)
    await transport.nack(d.task.id, d.lease_id, "fatal", terminal=True)
    task = await transport.get_task(d.task.id)
    assert (task.state, task.last_error, task.attempts) == ("dead", "fatal", 2)
    assert (await transport.stats()).totals.buried == 1


async def test_extend(transport: GrpcTransport, clock: FakeClock) -> None:
    await transport.enqueue(b"1", None, None)
    d = await held(transport, lease_ms=1000)
    deadline = await transport.extend(d.task.id, d.lease_id, 60_000)
    assert near(deadline, at(clock, 60))
    assert near(await transport.extend(d.task.id, d.lease_id, None), at(clock, 30))
    with pytest.raises(LeaseLost):
        await transport.extend(d.task.id, "other", 1000)
    with pytest.raises(InvalidArgument, match="lease_ms"):
        await transport.extend(d.task.id, d.lease_id, 0)
    await transport.ack(d.task.id, d.lease_id)
    with pytest.raises(NotFound):
        await transport.extend(d.task.id, d.lease_id, 1000)


async def test_get_task(transport: GrpcTransport) -> None:
    task_id = await transport.enqueue(b'"x"', 2, None, queue="q", priority=1)
    task = await transport.get_task(task_id)
    assert (task.id, task.payload, task.state, task.queue, task.priority) == (
        task_id,
        "x",
        "ready",
        "q",
        1,
    )
    assert task.max_attempts == 2
    d = await held(transport, "q")
    assert (await transport.get_task(task_id)).state == "handed_out"
    await transport.ack(d.task.id, d.lease_id)
    with pytest.raises(NotFound):
        await transport.get_task(task_id)


async def test_stats_queues_pause_and_resume(transport: GrpcTransport) -> None:
    a = await transport.enqueue(b"1", None, None, queue="a")
    b = await transport.enqueue(b"1", None, None, queue="b")
    await transport.enqueue(b"1", None, 5000, queue="b")
    await transport.pause("a")
    assert await transport.claim(0, None, ["a"]) is None
    a_at, b_at = [(await transport.get_task(t)).available_at for t in (a, b)]
    assert await transport.queues() == [
        QueueInfo("a", ready=1, paused=True, oldest_ready_at=a_at),
        QueueInfo("b", ready=1, delayed=1, oldest_ready_at=b_at),
    ]
    assert (await transport.stats("b")).delayed == 1
    assert (await transport.stats()).ready == 2
    await transport.resume("a")
    assert (await transport.queues())[0].paused is False
    assert (await held(transport, "a")).task.queue == "a"
    with pytest.raises(InvalidArgument, match="queue"):
        await transport.pause("")


async def test_dead_letters_requeue_all_and_purge(transport: GrpcTransport) -> None:
    a = await buried(transport, "a")
    b1 = await buried(transport, "b")
    b2 = await buried(transport, "b")
    assert [t.id for t in await transport.dead_letters(None, "b")] == [b1, b2]
    assert [t.queue for t in await transport.dead_letters(None)] == ["a", "b", "b"]
    await transport.purge(b1)
    with pytest.raises(NotFound):
        await transport.purge(b1)
    assert await transport.requeue_all("b") == 1
    assert await transport.requeue_all() == 1
    assert await transport.requeue_all() == 0
    totals = (await transport.stats()).totals
    assert (totals.purged, totals.requeued, totals.buried) == (1, 2, 3)
    assert {(await transport.get_task(i)).state for i in (a, b2)} == {"ready"}


# -- the stream ---------------------------------------------------------------------------------


async def open_stream(
    transport: GrpcTransport, prefetch: int = 1, lease_ms: int | None = None, *queues: str
) -> GrpcStream:
    return await transport.stream(prefetch, lease_ms, list(queues) or None)


async def test_stream_queues_extend_and_nack_options(
    transport: GrpcTransport, clock: FakeClock
) -> None:
    await transport.enqueue(b'"a"', 5, None, queue="a")
    b = await transport.enqueue(b'"b"', 5, None, queue="b")
    stream = await open_stream(transport, 2, 1000, "b")
    d = await anext(stream)
    assert (d.task.id, d.task.queue) == (b, "b")
    deadline = await stream.extend(d, 60_000)
    assert near(deadline, at(clock, 60))
    with pytest.raises(InvalidArgument):
        await stream.extend(d, -1)
    await stream.nack(d, "later", delay_ms=3000, confirm=True)
    assert (await transport.get_task(b)).state == "delayed"
    clock.advance(3.0)
    again = await anext(stream)
    assert (again.task.id, again.task.attempts) == (b, 2)
    await stream.nack(again, "fatal", terminal=True, confirm=True)
    assert (await transport.get_task(b)).state == "dead"
    with pytest.raises(NotFound):
        await stream.extend(again, None)  # dead: nobody holds it
    assert await stream.drain() == 0
    assert [x async for x in stream] == []  # the broker ended the stream
    await stream.close()
    assert (await transport.stats("a")).ready == 1


async def test_stream_drain_counts_what_is_held_and_ends_once_settled(
    transport: GrpcTransport,
) -> None:
    for i in range(3):
        await transport.enqueue(str(i).encode(), None, None)
    stream = await open_stream(transport, 2)
    first, second = await anext(stream), await anext(stream)
    assert await stream.drain() == 2
    assert await stream.drain() == 2  # the same answer: one drain
    await stream.ack(first, confirm=True)
    await stream.ack(second, confirm=True)
    assert [x async for x in stream] == []
    with pytest.raises(StreamEnded):
        await stream.ack(first, confirm=True)
    await stream.close()
    stats = await transport.stats()
    assert (stats.ready, stats.totals.acked) == (1, 2)


async def test_extends_acks_and_nacks_together_resolve_in_order(
    transport: GrpcTransport, clock: FakeClock, broker: Broker
) -> None:
    for i in range(3):
        await transport.enqueue(str(i).encode(), None, None)
    stream = await open_stream(transport, 3, 10_000)
    a, b, c = [await anext(stream) for _ in range(3)]
    # Issued together: the client keeps them in the order the broker answers them (a request's
    # extends, then its acks, then its nacks), so each gets its own outcome.
    results = await asyncio.gather(
        stream.ack(a, confirm=True),
        stream.extend(b, 20_000),
        stream.nack(c, "x", confirm=True),
        stream.extend(a, 1000),
        return_exceptions=True,
    )
    assert results[0] is None
    assert isinstance(results[1], datetime)
    assert near(results[1], at(clock, 20))
    assert results[2] is None
    assert isinstance(results[3], NotFound)  # a was acked before it
    await stream.ack(b, confirm=True)
    assert await stream.drain() == 0
    await stream.close()
    await wait_until(lambda: broker.service.waiting == 0, what="the stream gone")


async def test_a_drained_stream_ends_when_its_last_lease_runs_out(
    transport: GrpcTransport, clock: FakeClock
) -> None:
    await transport.enqueue(b"1", None, None)
    stream = await open_stream(transport, 1, 1000)
    d = await anext(stream)
    assert await stream.drain() == 1
    clock.advance(1.5)  # the lease runs out: reclaimed, and the broker ends the stream
    assert [x async for x in stream] == []
    with pytest.raises(StreamEnded):
        await stream.ack(d, confirm=True)
    with pytest.raises(NotFound):
        await transport.ack(d.task.id, d.lease_id)  # the unary call says why: nobody holds it
    assert (await transport.get_task(d.task.id)).state == "delayed"  # retried after a backoff
    await stream.close()
