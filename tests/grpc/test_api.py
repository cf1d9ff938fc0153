"""The gRPC API against a real grpc.aio server on port 0, driven by a real grpc.aio client.

Every test runs a whole broker (HTTP and gRPC) in this event loop. Most inject a FakeClock, so lease
deadlines, long-poll time-outs, backoff and delays are exact and nothing sleeps; the only real waits
are short polls for network I/O to land (``wait_until``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import aiohttp
import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.helpers import Http, http_client, invariant_holds, running_broker, settle, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

Code = grpc.StatusCode


# -- fixtures and helpers -----------------------------------------------------------------------


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


StreamCall = grpc.aio.StreamStreamCall[pb.StreamJobsRequest, pb.StreamJobsResponse]
# What a stream's read() returns at its end (grpc-stubs 1.53.0.6 does not declare it).
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # not in grpc-stubs


async def read(call: StreamCall, timeout: float = 5.0) -> pb.StreamJobsResponse:
    """The stream's next response (it must not have ended)."""
    response = await asyncio.wait_for(call.read(), timeout)
    assert isinstance(response, pb.StreamJobsResponse), "the stream ended"
    return response


def background(call: Awaitable[Any]) -> asyncio.Task[Any]:
    """Run a gRPC call (an awaitable, not a coroutine) as a task."""

    async def run() -> Any:
        return await call

    return asyncio.create_task(run())


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def stats(stub: pb_grpc.BrokerAsyncStub) -> pb.StatsResponse:
    response: pb.StatsResponse = await stub.Stats(pb.StatsRequest())
    return response


def stats_dict(s: pb.StatsResponse) -> dict[str, Any]:
    """A StatsResponse in the shape of GET /stats."""
    t = s.totals
    return {
        "ready": s.ready,
        "handed_out": s.handed_out,
        "delayed": s.delayed,
        "dead": s.dead,
        "waiting": s.waiting,  # docs/design/results.md
        "succeeded": s.succeeded,
        "totals": {
            "enqueued": t.enqueued,
            "delivered": t.delivered,
            "acked": t.acked,
            "nacked": t.nacked,
            "reclaimed": t.reclaimed,
            "retried": t.retried,
            "buried": t.buried,
            "requeued": t.requeued,
            "purged": t.purged,
            "cancelled": t.cancelled,
            "expired": t.expired,
        },
    }


def gauges(s: pb.StatsResponse) -> tuple[int, int, int, int]:
    return (s.ready, s.handed_out, s.delayed, s.dead)


def seconds(ts: Timestamp) -> float:
    return ts.seconds + ts.nanos / 1e9


async def enqueue(stub: pb_grpc.BrokerAsyncStub, payload: bytes = b"{}", **fields: Any) -> str:
    response = await stub.Enqueue(pb.EnqueueRequest(payload=payload, **fields))
    return str(response.id)


async def claim(stub: pb_grpc.BrokerAsyncStub, **fields: Any) -> pb.Delivery:
    """NextJob with wait_ms=0 (unless given) that must hand out a task."""
    fields.setdefault("wait_ms", 0)
    response = await stub.NextJob(pb.NextJobRequest(**fields))
    assert response.HasField("delivery"), "expected a task"
    return response.delivery


async def nothing_ready(stub: pb_grpc.BrokerAsyncStub) -> bool:
    response = await stub.NextJob(pb.NextJobRequest(wait_ms=0))
    return not response.HasField("delivery")


def ack_of(d: pb.Delivery) -> pb.AckRequest:
    return pb.AckRequest(id=d.task.id, lease_id=d.lease_id)


def nack_of(d: pb.Delivery, error: str | None = None) -> pb.NackRequest:
    return pb.NackRequest(id=d.task.id, lease_id=d.lease_id, error=error)


class Worker:
    """A StreamJobs call and the worker's own bookkeeping of its unfinished tasks.

    Each response's ``settled`` is processed before its ``deliveries``, as the .proto asks.
    """

    def __init__(self, stub: pb_grpc.BrokerAsyncStub) -> None:
        self.call = stub.StreamJobs(None)
        self.held: dict[str, pb.Delivery] = {}  # lease_id -> delivery, not yet finished
        self.received: list[pb.Delivery] = []
        self.settled: list[pb.Settled] = []
        self.max_unfinished = 0
        self.ended = False

    async def open(self, prefetch: int | None = None, lease_ms: int | None = None) -> Worker:
        await self.call.write(
            pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=prefetch, lease_ms=lease_ms))
        )
        return self

    async def send(
        self,
        acks: Iterable[pb.AckRequest] = (),
        nacks: Iterable[pb.NackRequest] = (),
        drain: bool = False,
    ) -> None:
        await self.call.write(pb.StreamJobsRequest(acks=acks, nacks=nacks, drain=drain))

    def forget(self, d: pb.Delivery) -> None:
        """The task was finished some other way (unary Ack/Nack, lease expiry)."""
        self.held.pop(d.lease_id, None)

    @property
    def unfinished(self) -> int:
        return len(self.held)

    async def read(self, timeout: float = 5.0) -> pb.StreamJobsResponse | None:
        response = await asyncio.wait_for(self.call.read(), timeout)
        if response is EOF:
            self.ended = True
            return None
        assert isinstance(response, pb.StreamJobsResponse)
        for s in response.settled:
            self.settled.append(s)
            if s.code == 0:
                self.held.pop(s.lease_id, None)
        for d in response.deliveries:
            self.received.append(d)
            self.held[d.lease_id] = d
        self.max_unfinished = max(self.max_unfinished, len(self.held))
        return response

    async def until(self, predicate: Callable[[Worker], bool], timeout: float = 5.0) -> None:
        """Read responses until ``predicate(self)`` holds."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while not predicate(self):
            assert not self.ended, "the stream ended first"
            await self.read(max(0.01, give_up - loop.time()))

    async def receive(self, n: int) -> list[pb.Delivery]:
        """Read until n more deliveries arrived; return them."""
        start = len(self.received)
        await self.until(lambda w: len(w.received) >= start + n)
        return self.received[start : start + n]

    async def outcomes(self, n: int) -> list[pb.Settled]:
        """Read until n more settled outcomes arrived; return them."""
        start = len(self.settled)
        await self.until(lambda w: len(w.settled) >= start + n)
        return self.settled[start : start + n]

    async def finish(self) -> None:
        """Half-close and read to the end of the stream."""
        await self.call.done_writing()
        while not self.ended:
            await self.read()
        assert await self.call.code() == Code.OK


# -- Enqueue ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        b'{"line": "hello"}',
        b'  {"a" : [1, 2.0, 3e5, -0.0, true, false, null], "b": {"c": "\\u00e9\\n"}}  \n',
        b'"just a string"',
        b"12345678901234567890123456789012345678901234567890",
        b"1.10",
        b"null",
        b"[]",
        '{"emoji": "🐍", "jp": "日本"}'.encode(),
    ],
)
async def test_enqueue_payload_round_trips_byte_for_byte(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock, payload: bytes
) -> None:
    now = clock.now()
    task_id = await enqueue(stub, payload)
    d = await claim(stub)
    assert d.task.id == task_id
    assert d.task.payload == payload  # not re-encoded, not even whitespace
    assert d.task.attempts == 1
    assert d.task.max_attempts == 3  # the default
    assert not d.task.HasField("last_error")
    assert seconds(d.task.created_at) == pytest.approx(now, abs=1e-6)
    assert seconds(d.task.available_at) == pytest.approx(now, abs=1e-6)
    assert seconds(d.deadline) == pytest.approx(now + 30, abs=1e-6)
    assert d.lease_id


async def test_enqueue_ids_are_unique(stub: pb_grpc.BrokerAsyncStub) -> None:
    ids = await asyncio.gather(*(enqueue(stub, b"1") for _ in range(100)))
    assert len(set(ids)) == 100
    assert all(ids)


async def test_enqueue_max_attempts_and_delay_ms_are_honoured(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    created = clock.now()
    task_id = await enqueue(stub, b'{"n": 1}', max_attempts=7, delay_ms=5000)
    assert gauges(await stats(stub)) == (0, 0, 1, 0)
    assert await nothing_ready(stub)
    clock.advance(4.9)
    await settle()
    assert await nothing_ready(stub)
    clock.advance(0.2)
    await settle()
    d = await claim(stub)
    assert d.task.id == task_id
    assert d.task.max_attempts == 7
    assert seconds(d.task.created_at) == pytest.approx(created, abs=1e-6)
    assert seconds(d.task.available_at) == pytest.approx(created + 5, abs=1e-6)


async def test_a_delayed_task_wakes_a_parked_next_job(
    stub: pb_grpc.BrokerAsyncStub, broker: Broker, clock: FakeClock
) -> None:
    await enqueue(stub, b"1", delay_ms=2000)
    poll = background(stub.NextJob(pb.NextJobRequest(wait_ms=10_000)))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    clock.advance(2.0)
    response = await asyncio.wait_for(poll, 5)
    assert response.delivery.task.payload == b"1"


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"payload": b""}, "payload"),
        ({"payload": b"   \n"}, "payload"),
        ({"payload": b"{not json"}, "payload"),
        ({"payload": b"1 2"}, "payload"),
        ({"payload": b'"\xff\xfe"'}, "UTF-8"),
        ({"payload": b"NaN"}, "payload"),
        ({"payload": b'{"x": NaN}'}, "payload"),
        ({"payload": b"[Infinity]"}, "payload"),
        ({"payload": b"1", "max_attempts": 0}, "max_attempts"),
        ({"payload": b"1", "max_attempts": -1}, "max_attempts"),
        ({"payload": b"1", "max_attempts": 2**31}, "max_attempts"),
        ({"payload": b"1", "delay_ms": -1}, "delay_ms"),
        ({"payload": b"1", "delay_ms": 365 * 24 * 3600 * 1000 + 1}, "delay_ms"),
    ],
)
async def test_enqueue_rejects_a_bad_request_naming_the_field(
    stub: pb_grpc.BrokerAsyncStub, fields: dict[str, Any], needle: str
) -> None:
    err = await rpc_error(stub.Enqueue(pb.EnqueueRequest(**fields)))
    assert err.code() == Code.INVALID_ARGUMENT
    assert needle in (err.details() or "")
    if needle == "UTF-8":
        assert "payload" in (err.details() or "")
    assert (await stats(stub)).totals.enqueued == 0


async def test_enqueue_accepts_the_extremes_of_its_ranges(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1", max_attempts=1)
    await enqueue(stub, b"2", max_attempts=2**31 - 1, delay_ms=365 * 24 * 3600 * 1000)
    await enqueue(stub, b"3", delay_ms=0)
    assert gauges(await stats(stub)) == (2, 0, 1, 0)


async def test_payload_over_max_body_is_resource_exhausted(clock: FakeClock) -> None:
    async with (
        running_broker(clock=clock, max_body=1024) as broker,
        grpc.aio.insecure_channel(broker.grpc_target) as channel,
    ):
        stub = pb_grpc.BrokerStub(channel)
        exactly = b'"' + b"x" * 1022 + b'"'
        assert len(exactly) == 1024
        await enqueue(stub, exactly)
        err = await rpc_error(stub.Enqueue(pb.EnqueueRequest(payload=b'"' + b"x" * 1023 + b'"')))
        assert err.code() == Code.RESOURCE_EXHAUSTED
        assert "payload" in (err.details() or "")
        assert "1024" in (err.details() or "")
        # In a batch, the error names the offending entry, and nothing is enqueued.
        batch = [pb.EnqueueRequest(payload=b"1"), pb.EnqueueRequest(payload=b"[" + b"0," * 600)]
        err = await rpc_error(stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=batch)))
        assert err.code() == Code.RESOURCE_EXHAUSTED
        assert "tasks[1]" in (err.details() or "")
        assert (await stats(stub)).totals.enqueued == 1
        assert (await claim(stub)).task.payload == exactly


async def test_message_over_the_grpc_receive_limit_is_resource_exhausted(
    clock: FakeClock,
) -> None:
    async with (
        running_broker(clock=clock, max_body=1024) as broker,
        grpc.aio.insecure_channel(broker.grpc_target) as channel,
    ):
        stub = pb_grpc.BrokerStub(channel)
        huge = b'"' + b"x" * (5 * 1024 * 1024) + b'"'
        err = await rpc_error(stub.Enqueue(pb.EnqueueRequest(payload=huge)))
        assert err.code() == Code.RESOURCE_EXHAUSTED
        # The broker and the channel are fine afterwards.
        await enqueue(stub, b"1")
        assert (await stats(stub)).totals.enqueued == 1


# -- EnqueueBatch -------------------------------------------------------------------------------


async def test_enqueue_batch_returns_ids_in_request_order(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    payloads = [json.dumps({"n": i}).encode() for i in range(6)]
    requests = [pb.EnqueueRequest(payload=p, max_attempts=i + 1) for i, p in enumerate(payloads)]
    requests.append(pb.EnqueueRequest(payload=b'"later"', delay_ms=1000))
    response = await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=requests))
    ids = list(response.ids)
    assert len(ids) == 7
    assert len(set(ids)) == 7
    assert gauges(await stats(stub)) == (6, 0, 1, 0)
    for i, payload in enumerate(payloads):
        d = await claim(stub)
        assert (d.task.id, d.task.payload, d.task.max_attempts) == (ids[i], payload, i + 1)
    assert await nothing_ready(stub)
    clock.advance(1.0)
    await settle()
    d = await claim(stub)
    assert (d.task.id, d.task.payload) == (ids[6], b'"later"')


async def test_enqueue_batch_of_nothing_is_fine(stub: pb_grpc.BrokerAsyncStub) -> None:
    response = await stub.EnqueueBatch(pb.EnqueueBatchRequest())
    assert list(response.ids) == []
    assert (await stats(stub)).totals.enqueued == 0


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (pb.EnqueueRequest(payload=b"{nope"), "tasks[2].payload"),
        (pb.EnqueueRequest(payload=b""), "tasks[2].payload"),
        (pb.EnqueueRequest(payload=b"1", max_attempts=0), "tasks[2].max_attempts"),
        (pb.EnqueueRequest(payload=b"1", delay_ms=-1), "tasks[2].delay_ms"),
    ],
)
async def test_enqueue_batch_is_all_or_nothing(
    stub: pb_grpc.BrokerAsyncStub, bad: pb.EnqueueRequest, needle: str
) -> None:
    good = [pb.EnqueueRequest(payload=b"1"), pb.EnqueueRequest(payload=b"2")]
    tasks = [*good, bad, pb.EnqueueRequest(payload=b"3")]
    err = await rpc_error(stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=tasks)))
    assert err.code() == Code.INVALID_ARGUMENT
    assert needle in (err.details() or "")
    s = await stats(stub)
    assert s.totals.enqueued == 0
    assert gauges(s) == (0, 0, 0, 0)


async def test_enqueue_batch_over_10000_is_refused(stub: pb_grpc.BrokerAsyncStub) -> None:
    tasks = [pb.EnqueueRequest(payload=b"1")] * 10_001
    err = await rpc_error(stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=tasks)))
    assert err.code() == Code.INVALID_ARGUMENT
    assert "tasks" in (err.details() or "")
    assert "10000" in (err.details() or "")
    assert (await stats(stub)).totals.enqueued == 0


# -- NextJob ------------------------------------------------------------------------------------


async def test_next_job_answers_unset_delivery_at_once_when_idle(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    response = await stub.NextJob(pb.NextJobRequest(wait_ms=0))
    assert not response.HasField("delivery")


async def test_next_job_hands_out_oldest_first(stub: pb_grpc.BrokerAsyncStub) -> None:
    ids = [await enqueue(stub, str(i).encode()) for i in range(5)]
    assert [(await claim(stub)).task.id for _ in range(5)] == ids


async def test_long_poll_is_woken_by_an_enqueue(
    stub: pb_grpc.BrokerAsyncStub, broker: Broker, clock: FakeClock
) -> None:
    poll = background(stub.NextJob(pb.NextJobRequest(wait_ms=30_000)))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    task_id = await enqueue(stub, b'{"wake": true}')
    response = await asyncio.wait_for(poll, 5)  # the clock never moved
    assert response.delivery.task.id == task_id
    assert response.delivery.task.payload == b'{"wake": true}'
    s = await stats(stub)
    assert gauges(s) == (0, 1, 0, 0)
    assert broker.service.waiting == 0


@pytest.mark.parametrize(("wait_ms", "expected"), [(None, 20.0), (5000, 5.0), (120_000, 30.0)])
async def test_long_poll_times_out_on_the_clock(
    stub: pb_grpc.BrokerAsyncStub,
    broker: Broker,
    clock: FakeClock,
    wait_ms: int | None,
    expected: float,
) -> None:
    """wait_ms defaults to 20 s and is clamped to 30 s."""
    poll = background(stub.NextJob(pb.NextJobRequest(wait_ms=wait_ms)))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    clock.advance(expected - 0.1)
    await settle()
    assert broker.service.waiting == 1
    assert not poll.done()
    clock.advance(0.2)
    response = await asyncio.wait_for(poll, 5)
    assert not response.HasField("delivery")
    assert broker.service.waiting == 0
    # A task enqueued afterwards is not lost to the timed-out poll.
    await enqueue(stub, b"1")
    assert (await stats(stub)).ready == 1


@pytest.mark.parametrize(
    ("lease_ms", "expected"),
    [(None, 30.0), (1, 0.001), (1500, 1.5), (300_000, 300.0), (10**9, 300.0)],
)
async def test_lease_default_and_cap_show_in_the_deadline(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock, lease_ms: int | None, expected: float
) -> None:
    clock.advance(0.25)
    now = clock.now()
    await enqueue(stub, b"1")
    d = await claim(stub, lease_ms=lease_ms)
    assert seconds(d.deadline) == pytest.approx(now + expected, abs=1e-6)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"wait_ms": -1}, "wait_ms"),
        ({"lease_ms": 0}, "lease_ms"),
        ({"lease_ms": -5}, "lease_ms"),
    ],
)
async def test_next_job_rejects_bad_numbers(
    stub: pb_grpc.BrokerAsyncStub, fields: dict[str, int], needle: str
) -> None:
    await enqueue(stub, b"1")
    request = pb.NextJobRequest(wait_ms=fields.get("wait_ms"), lease_ms=fields.get("lease_ms"))
    err = await rpc_error(stub.NextJob(request))
    assert err.code() == Code.INVALID_ARGUMENT
    assert needle in (err.details() or "")
    assert gauges(await stats(stub)) == (1, 0, 0, 0)  # nothing was handed out


async def _settled_with_task_ready(stub: pb_grpc.BrokerAsyncStub, task_id: str) -> None:
    """The one task is ready and nobody holds it; a fresh claim gets it on its first attempt."""

    await wait_until(
        lambda: stats(stub), lambda s: gauges(s) == (1, 0, 0, 0), what="the one task ready"
    )
    d = await claim(stub)
    assert (d.task.id, d.task.attempts) == (task_id, 1)
    assert (await stats(stub)).totals.delivered == 1


async def test_cancelled_next_job_is_never_handed_a_task(
    stub: pb_grpc.BrokerAsyncStub, broker: Broker
) -> None:
    call = stub.NextJob(pb.NextJobRequest(wait_ms=30_000))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    assert call.cancel()
    await wait_until(lambda: broker.service.waiting == 0, what="no parked claim")
    task_id = await enqueue(stub, b"1")
    await _settled_with_task_ready(stub, task_id)


async def test_next_job_cancelled_just_before_an_enqueue_is_never_handed_a_task(
    stub: pb_grpc.BrokerAsyncStub, broker: Broker
) -> None:
    """The enqueue races the broker's handling of the cancellation. It goes over the same
    connection, so the cancellation reaches the broker first; whichever the broker's event loop
    gets to first, the task must stay ready and unclaimed (the FakeClock never moves, so no lease
    expiry can tidy up after a lost task)."""
    for round_ in range(30):
        call = stub.NextJob(pb.NextJobRequest(wait_ms=30_000))
        await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
        call.cancel()
        task_id = await enqueue(stub, json.dumps({"round": round_}).encode())

        await wait_until(
            lambda: stats(stub), lambda s: gauges(s) == (1, 0, 0, 0), what="the one task ready"
        )
        d = await claim(stub)
        assert (d.task.id, d.task.attempts) == (task_id, 1), round_
        await stub.Ack(ack_of(d))


async def test_next_job_whose_client_deadline_passes_is_never_handed_a_task(
    stub: pb_grpc.BrokerAsyncStub, broker: Broker
) -> None:
    err = await rpc_error(stub.NextJob(pb.NextJobRequest(wait_ms=30_000), timeout=0.05))
    assert err.code() == Code.DEADLINE_EXCEEDED
    await wait_until(lambda: broker.service.waiting == 0, what="no parked claim")
    task_id = await enqueue(stub, b"1")
    await _settled_with_task_ready(stub, task_id)


async def test_stopping_the_broker_answers_parked_calls(clock: FakeClock) -> None:
    async with running_broker(clock=clock) as broker:
        async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
            stub = pb_grpc.BrokerStub(channel)
            await enqueue(stub, b"1")
            worker = await Worker(stub).open(prefetch=1)
            await worker.receive(1)
            poll = background(stub.NextJob(pb.NextJobRequest(wait_ms=30_000)))
            await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
            stopping = asyncio.create_task(broker.stop())
            response = await asyncio.wait_for(poll, 5)
            assert not response.HasField("delivery")  # the idle answer, not an error
            await asyncio.wait_for(worker.until(lambda w: w.ended), 5)
            assert await worker.call.code() == Code.OK
            await asyncio.wait_for(stopping, 5)
        s = await broker.service.stats()  # the stream's task was given back, not left held
        assert (s.handed_out, s.delayed, s.totals.reclaimed) == (0, 1, 1)


# -- Ack and Nack -------------------------------------------------------------------------------


async def test_ack_finishes_the_task(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1")
    d = await claim(stub)
    assert isinstance(await stub.Ack(ack_of(d)), pb.AckResponse)
    s = await stats(stub)
    assert gauges(s) == (0, 0, 0, 0)
    assert (s.totals.delivered, s.totals.acked) == (1, 1)
    # Acked is final: nobody holds it any more.
    err = await rpc_error(stub.Ack(ack_of(d)))
    assert err.code() == Code.NOT_FOUND
    assert d.task.id in (err.details() or "")
    err = await rpc_error(stub.Nack(nack_of(d)))
    assert err.code() == Code.NOT_FOUND


@pytest.mark.parametrize("method", ["Ack", "Nack"])
async def test_ack_and_nack_of_unknown_or_unheld_task_is_not_found(
    stub: pb_grpc.BrokerAsyncStub, method: str
) -> None:
    rpc = getattr(stub, method)
    request = pb.AckRequest if method == "Ack" else pb.NackRequest
    err = await rpc_error(rpc(request(id="does-not-exist", lease_id="x")))
    assert err.code() == Code.NOT_FOUND
    assert "does-not-exist" in (err.details() or "")
    ready_id = await enqueue(stub, b"1")  # ready, held by nobody
    err = await rpc_error(rpc(request(id=ready_id, lease_id="x")))
    assert err.code() == Code.NOT_FOUND
    assert gauges(await stats(stub)) == (1, 0, 0, 0)


@pytest.mark.parametrize("method", ["Ack", "Nack"])
async def test_ack_and_nack_with_a_wrong_lease_is_failed_precondition(
    stub: pb_grpc.BrokerAsyncStub, method: str
) -> None:
    rpc = getattr(stub, method)
    request = pb.AckRequest if method == "Ack" else pb.NackRequest
    await enqueue(stub, b"1")
    d = await claim(stub)
    err = await rpc_error(rpc(request(id=d.task.id, lease_id="not-" + d.lease_id)))
    assert err.code() == Code.FAILED_PRECONDITION
    assert d.task.id in (err.details() or "")
    # The holder is unaffected and can still finish it.
    assert (await stats(stub)).handed_out == 1
    await stub.Ack(ack_of(d))
    assert (await stats(stub)).totals.acked == 1


@pytest.mark.parametrize(
    ("fields", "needle"),
    [({"id": "", "lease_id": "l"}, "id"), ({"id": "t", "lease_id": ""}, "lease_id")],
)
@pytest.mark.parametrize("method", ["Ack", "Nack"])
async def test_ack_and_nack_require_id_and_lease_id(
    stub: pb_grpc.BrokerAsyncStub, method: str, fields: dict[str, str], needle: str
) -> None:
    request: Any = pb.AckRequest if method == "Ack" else pb.NackRequest
    err = await rpc_error(getattr(stub, method)(request(**fields)))
    assert err.code() == Code.INVALID_ARGUMENT
    assert (err.details() or "").startswith(needle + " ")


async def test_a_lease_that_ran_out_cannot_be_used(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    await enqueue(stub, b"1")
    first = await claim(stub, lease_ms=1000)
    clock.advance(1.5)
    await settle()

    await wait_until(lambda: stats(stub), lambda s: s.totals.reclaimed == 1, what="the reclaim")
    err = await rpc_error(stub.Ack(ack_of(first)))
    assert err.code() == Code.NOT_FOUND  # nobody holds it: it waits out its backoff
    clock.advance(1.0)
    await settle()
    second = await claim(stub)
    assert second.task.id == first.task.id
    assert second.lease_id != first.lease_id
    assert (second.task.attempts, second.task.last_error) == (2, "lease expired")
    err = await rpc_error(stub.Ack(ack_of(first)))
    assert err.code() == Code.FAILED_PRECONDITION  # somebody else holds it now
    await stub.Ack(ack_of(second))


async def test_nack_retries_with_backoff_then_buries_with_last_error(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    task_id = await enqueue(stub, b'{"fail": true}', max_attempts=2)
    d = await claim(stub)
    failed_at = clock.now()
    await stub.Nack(nack_of(d, "boom"))
    s = await stats(stub)
    assert gauges(s) == (0, 0, 1, 0)
    assert (s.totals.nacked, s.totals.retried) == (1, 1)
    assert await nothing_ready(stub)  # waiting out the backoff (0.5 s to 1 s after one failure)
    clock.advance(0.49)
    await settle()
    assert await nothing_ready(stub)
    clock.advance(0.51)
    await settle()
    d = await claim(stub)
    assert d.task.id == task_id
    assert (d.task.attempts, d.task.last_error) == (2, "boom")
    assert failed_at + 0.5 <= seconds(d.task.available_at) <= failed_at + 1.0
    await stub.Nack(nack_of(d, "bang"))
    s = await stats(stub)
    assert gauges(s) == (0, 0, 0, 1)
    assert (s.totals.nacked, s.totals.retried, s.totals.buried) == (2, 1, 1)
    dead = (await stub.ListDead(pb.ListDeadRequest())).tasks
    assert [(t.id, t.attempts, t.last_error, t.payload) for t in dead] == [
        (task_id, 2, "bang", b'{"fail": true}')
    ]


async def test_nack_without_an_error_leaves_last_error_unset(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1", max_attempts=1)
    await stub.Nack(nack_of(await claim(stub)))
    (dead,) = (await stub.ListDead(pb.ListDeadRequest())).tasks
    assert not dead.HasField("last_error")


# -- Stats, ListDead, Requeue -------------------------------------------------------------------


async def test_stats_reports_every_gauge_and_total(
    stub: pb_grpc.BrokerAsyncStub, http: Http, clock: FakeClock
) -> None:
    a = await enqueue(stub, b'"a"', max_attempts=1)
    await stub.Nack(nack_of(await claim(stub), "no"))  # a: buried
    await stub.Requeue(pb.RequeueRequest(id=a))  # a: ready again
    await enqueue(stub, b'"b"')
    d = await claim(stub, lease_ms=1000)
    assert d.task.id == a
    clock.advance(1.5)  # a's lease runs out: reclaimed and, out of attempts, buried again
    await settle()

    await wait_until(lambda: stats(stub), lambda s: s.totals.reclaimed == 1, what="the reclaim")
    await stub.Nack(nack_of(await claim(stub), "b failed"))  # b: delayed for a retry
    await enqueue(stub, b'"c"')
    await stub.Ack(ack_of(await claim(stub)))  # c: done
    await enqueue(stub, b'"e"', delay_ms=60_000)  # e: delayed
    await enqueue(stub, b'"f"')
    await enqueue(stub, b'"g"')
    f = await claim(stub)  # f: handed out; g: ready
    assert f.task.payload == b'"f"'

    s = await stats(stub)
    expected = {
        "ready": 1,
        "handed_out": 1,
        "delayed": 2,
        "dead": 1,
        "waiting": 0,
        "succeeded": 0,
        "totals": {
            "enqueued": 6,
            "delivered": 5,
            "acked": 1,
            "nacked": 2,
            "reclaimed": 1,
            "retried": 1,
            "buried": 2,
            "requeued": 1,
            "purged": 0,
            "cancelled": 0,
            "expired": 0,
        },
    }
    assert stats_dict(s) == expected
    assert await http.stats() == expected
    assert invariant_holds(stats_dict(s))


async def test_list_dead_in_burial_order_with_last_error_and_limit(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    ids = [await enqueue(stub, f'"{n}"'.encode(), max_attempts=1) for n in "xyz"]
    held = {d.task.id: d for d in [await claim(stub) for _ in range(3)]}
    order = [ids[2], ids[0], ids[1]]
    for task_id in order:
        await stub.Nack(nack_of(held[task_id], "failed " + task_id))
    dead = (await stub.ListDead(pb.ListDeadRequest())).tasks
    assert [t.id for t in dead] == order
    assert [t.last_error for t in dead] == ["failed " + i for i in order]
    assert [t.payload for t in dead] == [b'"z"', b'"x"', b'"y"']
    assert all((t.attempts, t.max_attempts) == (1, 1) for t in dead)
    limited = (await stub.ListDead(pb.ListDeadRequest(limit=2))).tasks
    assert [t.id for t in limited] == order[:2]
    assert list((await stub.ListDead(pb.ListDeadRequest(limit=0))).tasks) == []
    assert len((await stub.ListDead(pb.ListDeadRequest(limit=10))).tasks) == 3
    err = await rpc_error(stub.ListDead(pb.ListDeadRequest(limit=-1)))
    assert err.code() == Code.INVALID_ARGUMENT
    assert "limit" in (err.details() or "")


async def test_a_dead_task_carries_when_it_was_buried(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    task_id = await enqueue(stub, b'"x"', max_attempts=1)
    d = await claim(stub)
    assert not d.task.HasField("buried_at")  # (not dead: unset)
    clock.advance(3.0)
    buried = clock.now()
    await stub.Nack(nack_of(d, "no"))
    clock.advance(30.0)
    [dead] = (await stub.ListDead(pb.ListDeadRequest())).tasks
    assert seconds(dead.buried_at) == pytest.approx(buried, abs=1e-6)
    found = await stub.GetTask(pb.GetTaskRequest(id=task_id))
    assert seconds(found.task.buried_at) == pytest.approx(buried, abs=1e-6)
    await stub.Requeue(pb.RequeueRequest(id=task_id))
    found = await stub.GetTask(pb.GetTaskRequest(id=task_id))
    assert not found.task.HasField("buried_at")


async def test_list_dead_is_empty_at_first(stub: pb_grpc.BrokerAsyncStub) -> None:
    assert list((await stub.ListDead(pb.ListDeadRequest())).tasks) == []


async def test_requeue_gives_a_dead_task_a_clean_start(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    task_id = await enqueue(stub, b'{"n": 1}', max_attempts=2)
    await stub.Nack(nack_of(await claim(stub), "one"))
    clock.advance(1.0)
    await settle()
    await stub.Nack(nack_of(await claim(stub), "two"))
    assert (await stats(stub)).dead == 1
    clock.advance(10)
    await settle()
    now = clock.now()
    assert isinstance(await stub.Requeue(pb.RequeueRequest(id=task_id)), pb.RequeueResponse)
    s = await stats(stub)
    assert gauges(s) == (1, 0, 0, 0)
    assert s.totals.requeued == 1
    assert list((await stub.ListDead(pb.ListDeadRequest())).tasks) == []
    d = await claim(stub)
    assert d.task.id == task_id
    assert (d.task.attempts, d.task.max_attempts) == (1, 2)
    assert not d.task.HasField("last_error")
    assert seconds(d.task.available_at) == pytest.approx(now, abs=1e-6)
    assert d.task.payload == b'{"n": 1}'
    # It is not dead any more (it is handed out), so it cannot be requeued again.
    err = await rpc_error(stub.Requeue(pb.RequeueRequest(id=task_id)))
    assert err.code() == Code.NOT_FOUND
    assert task_id in (err.details() or "")


async def test_requeue_of_a_task_that_is_not_dead(stub: pb_grpc.BrokerAsyncStub) -> None:
    ready_id = await enqueue(stub, b"1")
    for task_id in (ready_id, "no-such-task"):
        err = await rpc_error(stub.Requeue(pb.RequeueRequest(id=task_id)))
        assert err.code() == Code.NOT_FOUND
    err = await rpc_error(stub.Requeue(pb.RequeueRequest(id="")))
    assert err.code() == Code.INVALID_ARGUMENT
    assert "id" in (err.details() or "")
    s = await stats(stub)
    assert gauges(s) == (1, 0, 0, 0)
    assert s.totals.requeued == 0


# -- health and reflection ----------------------------------------------------------------------


async def test_health_service_reports_serving(broker: Broker) -> None:
    async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        async def check(service: str) -> str:
            try:
                response = await health.Check(health_pb2.HealthCheckRequest(service=service))
            except grpc.aio.AioRpcError as e:
                return f"error {e.code().name}"
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

        assert {name: await check(name) for name in ("", "wq.v1.Broker")} == {
            "": "SERVING",
            "wq.v1.Broker": "SERVING",
        }
        assert await check("nope.Nope") == "error NOT_FOUND"


async def _reflect(
    broker: Broker, request: reflection_pb2.ServerReflectionRequest
) -> reflection_pb2.ServerReflectionResponse:
    async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = [r async for r in stub.ServerReflectionInfo(iter([request]))]
    assert len(responses) == 1
    response: reflection_pb2.ServerReflectionResponse = responses[0]
    return response


async def test_reflection_lists_the_services(broker: Broker) -> None:
    response = await _reflect(broker, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in response.list_services_response.service}
    assert {
        "wq.v1.Broker",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names


async def test_reflection_describes_the_broker_service(broker: Broker) -> None:
    response = await _reflect(
        broker, reflection_pb2.ServerReflectionRequest(file_containing_symbol="wq.v1.Broker")
    )
    assert response.HasField("file_descriptor_response"), response
    files = {}
    for raw in response.file_descriptor_response.file_descriptor_proto:
        fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
        files[fd.name] = fd
    fd = files["wqwire/pb/broker.proto"]
    assert fd.package == "wq.v1"
    (service,) = fd.service
    assert service.name == "Broker"
    methods = {m.name: m for m in service.method}
    assert set(methods) == {
        "Enqueue",
        "EnqueueBatch",
        "NextJob",
        "Ack",
        "Nack",
        "Stats",
        "ListDead",
        "Requeue",
        "StreamJobs",
        "ExtendLease",
        "Release",  # a stopping worker's hand-back, not counted as an attempt
        "GetTask",
        "ListQueues",
        "PauseQueue",
        "ResumeQueue",
        "RequeueAll",
        "PurgeDead",
        "Produce",
        "CancelTask",
        "ListTasks",
        "EmptyQueue",
        "DeleteQueue",
        "WaitResult",  # docs/design/results.md
        # docs/design/schedules.md
        "PutSchedule",
        "GetSchedule",
        "ListSchedules",
        "DeleteSchedule",
        "PauseSchedule",
        "ResumeSchedule",
        "SetQueueLimits",
    }
    assert methods["StreamJobs"].client_streaming
    assert methods["StreamJobs"].server_streaming
    assert methods["Produce"].client_streaming
    assert methods["Produce"].server_streaming
    assert not methods["NextJob"].client_streaming
    assert not methods["NextJob"].server_streaming
    # A client can resolve every message type from what reflection returns.
    assert "google/protobuf/timestamp.proto" in fd.dependency
    err_response = await _reflect(
        broker, reflection_pb2.ServerReflectionRequest(file_containing_symbol="wq.v1.Nope")
    )
    assert err_response.error_response.error_code == Code.NOT_FOUND.value[0]


# -- across protocols ---------------------------------------------------------------------------


async def test_enqueue_over_http_stream_over_grpc_ack_over_http(
    stub: pb_grpc.BrokerAsyncStub, http: Http
) -> None:
    payload = b'{"a": [1, 2.0, "\\u00e9", "\xc3\xa9"], "b": null}'
    status, body = await http.request("POST", "/jobs", data=b'{"payload": ' + payload + b"}")
    assert status == 201
    first_id = body["id"]
    second_id = await http.enqueue({"second": True})
    worker = await Worker(stub).open(prefetch=1)
    (d,) = await worker.receive(1)
    assert d.task.id == first_id
    assert d.task.payload == payload  # the exact bytes POSTed
    assert await http.ack(first_id, d.lease_id) == 204
    (d2,) = await worker.receive(1)  # the HTTP ack freed the stream's only slot
    assert d2.task.id == second_id
    assert json.loads(d2.task.payload) == {"second": True}
    assert await http.ack(second_id, d2.lease_id) == 204
    assert worker.settled == []  # only acks sent on the stream are answered on it
    await worker.finish()
    s = await http.stats()
    assert s["totals"]["acked"] == 2
    assert s["handed_out"] == 0
    assert s == stats_dict(await stats(stub))


async def test_enqueue_over_grpc_claim_over_http_ack_over_grpc(
    stub: pb_grpc.BrokerAsyncStub, http: Http
) -> None:
    payload = '  {"k": "日本", "n": 1.50, "e": 1E+2}'.encode()
    task_id = await enqueue(stub, payload, max_attempts=4)
    async with http.session.get(http.base + "/jobs/next?wait_ms=0") as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert b'"payload":' + payload + b"," in raw  # the exact bytes enqueued over gRPC
    body = json.loads(raw)
    assert body["task"]["id"] == task_id
    assert body["task"]["max_attempts"] == 4
    await stub.Ack(pb.AckRequest(id=task_id, lease_id=body["lease_id"]))
    s = await http.stats()
    assert s["totals"]["acked"] == 1
    assert s["handed_out"] == 0
    # The HTTP side now agrees that nobody holds it.
    assert await http.ack(task_id, body["lease_id"]) == 404


async def test_http_and_grpc_share_one_set_of_statistics(
    stub: pb_grpc.BrokerAsyncStub, http: Http
) -> None:
    for i in range(3):
        await http.enqueue({"http": i}, max_attempts=1)
        await enqueue(stub, json.dumps({"grpc": i}).encode(), max_attempts=2)
    body = await http.claim()
    await stub.Nack(pb.NackRequest(id=body["task"]["id"], lease_id=body["lease_id"], error="x"))
    d = await claim(stub)
    assert await http.nack(d.task.id, d.lease_id, "y") == 204
    d = await claim(stub)
    assert await http.ack(d.task.id, d.lease_id) == 204
    worker = await Worker(stub).open(prefetch=2)
    await worker.receive(2)
    worker.call.cancel()  # the stream's two tasks are reclaimed

    await wait_until(lambda: stats(stub), lambda s: s.handed_out == 0, what="nothing handed out")
    via_grpc = stats_dict(await stats(stub))
    via_http = await http.stats()
    assert via_http == via_grpc
    assert via_http["totals"]["enqueued"] == 6
    assert via_http["totals"]["nacked"] == 2
    assert via_http["totals"]["reclaimed"] == 2
    assert invariant_holds(via_http)


# -- StreamJobs ---------------------------------------------------------------------------------


async def test_stream_first_request_must_carry_open(stub: pb_grpc.BrokerAsyncStub) -> None:
    task_id = await enqueue(stub, b"1")
    call = stub.StreamJobs(None)
    await call.write(pb.StreamJobsRequest(acks=[pb.AckRequest(id=task_id, lease_id="x")]))
    err = await rpc_error(call.read())
    assert err.code() == Code.INVALID_ARGUMENT
    assert "open" in (err.details() or "")
    assert gauges(await stats(stub)) == (1, 0, 0, 0)


async def test_stream_open_only_in_the_first_request(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1")
    worker = await Worker(stub).open(prefetch=1)
    await worker.receive(1)
    await worker.call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=5)))
    err = await rpc_error(worker.until(lambda w: False))
    assert err.code() == Code.INVALID_ARGUMENT
    assert "open" in (err.details() or "")

    # The stream is over, and so is its hold on the task.
    await wait_until(
        lambda: stats(stub),
        lambda s: (s.handed_out, s.totals.reclaimed) == (0, 1),
        what="the stream's task to be reclaimed",
    )


@pytest.mark.parametrize(
    ("fields", "needle"), [({"prefetch": 0}, "prefetch"), ({"lease_ms": 0}, "lease_ms")]
)
async def test_stream_open_rejects_bad_settings(
    stub: pb_grpc.BrokerAsyncStub, fields: dict[str, Any], needle: str
) -> None:
    await enqueue(stub, b"1")
    call = stub.StreamJobs(None)
    await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(**fields)))
    err = await rpc_error(call.read())
    assert err.code() == Code.INVALID_ARGUMENT
    assert needle in (err.details() or "")
    assert gauges(await stats(stub)) == (1, 0, 0, 0)


async def test_stream_that_half_closes_at_once_ends_cleanly(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1")
    call = stub.StreamJobs(None)
    await call.done_writing()
    assert await call.read() is EOF
    assert await call.code() == Code.OK
    assert gauges(await stats(stub)) == (1, 0, 0, 0)


async def test_stream_open_is_answered_with_an_empty_response(
    stub: pb_grpc.BrokerAsyncStub, broker: Broker
) -> None:
    call = stub.StreamJobs(None)
    await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=2)))
    first = await read(call)
    assert first == pb.StreamJobsResponse()  # connected, nothing to do yet
    assert broker.service.waiting == 1  # registered by the time it answered
    task_id = await enqueue(stub, b"1")
    second = await read(call)
    assert [d.task.id for d in second.deliveries] == [task_id]
    call.cancel()


async def test_stream_open_is_answered_before_any_delivery(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1")
    call = stub.StreamJobs(None)
    await call.write(pb.StreamJobsRequest(open=pb.StreamOpen()))
    assert await read(call) == pb.StreamJobsResponse()
    second = await read(call)
    assert len(second.deliveries) == 1
    call.cancel()


async def test_stream_defaults_prefetch_1_and_lease_30s(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    ids = [await enqueue(stub, str(i).encode()) for i in range(3)]
    worker = await Worker(stub).open()
    (d,) = await worker.receive(1)
    assert d.task.id == ids[0]
    assert d.task.attempts == 1
    assert seconds(d.deadline) == pytest.approx(clock.now() + 30, abs=1e-6)
    assert gauges(await stats(stub)) == (2, 1, 0, 0)  # prefetch 1: nothing more was pushed
    await worker.send(acks=[ack_of(d)])
    (d2,) = await worker.receive(1)
    assert d2.task.id == ids[1]
    assert gauges(await stats(stub)) == (1, 1, 0, 0)
    await worker.send(acks=[ack_of(d2)])
    await worker.until(lambda w: len(w.settled) == 2 and len(w.received) == 3)
    await worker.send(acks=[ack_of(worker.received[2])])
    await worker.until(lambda w: len(w.settled) == 3)
    await worker.finish()
    assert [s.code for s in worker.settled] == [0, 0, 0]
    assert stats_dict(await stats(stub))["totals"]["acked"] == 3


async def test_stream_lease_cap_and_prefetch_cap(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    batch = [pb.EnqueueRequest(payload=b"1")] * 10_000
    await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=batch))
    await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=batch[:5]))
    worker = await Worker(stub).open(prefetch=50_000, lease_ms=10**9)
    await worker.until(lambda w: len(w.received) >= 10_000, timeout=20)
    assert len(worker.received) == 10_000  # clamped to 10000 unfinished
    s = await stats(stub)
    assert (s.ready, s.handed_out) == (5, 10_000)
    assert seconds(worker.received[0].deadline) == pytest.approx(clock.now() + 300, abs=1e-6)
    worker.call.cancel()


async def test_stream_never_holds_more_than_prefetch_unfinished(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    ids = (
        await stub.EnqueueBatch(
            pb.EnqueueBatchRequest(
                tasks=[pb.EnqueueRequest(payload=str(i).encode()) for i in range(40)]
            )
        )
    ).ids
    prefetch = 4
    worker = await Worker(stub).open(prefetch=prefetch)
    acked: list[str] = []
    while len(acked) < 40:
        await worker.until(lambda w: w.unfinished > 0)
        assert worker.unfinished <= prefetch
        if len(acked) < 36:  # while there is a backlog, the worker is kept full
            await worker.until(lambda w: w.unfinished == prefetch)
            assert (await stats(stub)).handed_out == prefetch
        # Finish the oldest held task, slowly: one ack per round trip.
        oldest = next(iter(worker.held.values()))
        await worker.send(acks=[ack_of(oldest)])
        (outcome,) = await worker.outcomes(1)
        assert (outcome.id, outcome.code) == (oldest.task.id, 0)
        acked.append(oldest.task.id)
        assert len(worker.settled) == len(acked)  # one outcome per ack
        assert worker.max_unfinished <= prefetch
    assert acked == list(ids)  # pushed oldest first, each exactly once
    assert [d.task.id for d in worker.received] == list(ids)
    assert worker.max_unfinished == prefetch
    await worker.finish()
    s = await stats(stub)
    assert gauges(s) == (0, 0, 0, 0)
    assert s.totals.acked == 40


async def test_every_ack_and_nack_on_the_stream_is_answered_in_order(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"1")] * 4))
    worker = await Worker(stub).open(prefetch=4)
    a, b, c, d = await worker.receive(4)
    await worker.send(
        acks=[
            ack_of(a),
            pb.AckRequest(id=b.task.id, lease_id="wrong"),
            pb.AckRequest(id="no-such-task", lease_id="x"),
            pb.AckRequest(id="", lease_id="x"),
            ack_of(a),  # a second time: nobody holds it now
        ],
        nacks=[nack_of(c, "nope"), pb.NackRequest(id=d.task.id, lease_id="wrong")],
    )
    await worker.until(lambda w: len(w.settled) == 7)
    outcomes = [(s.id, s.nack, s.code, bool(s.message)) for s in worker.settled]
    assert outcomes == [
        (a.task.id, False, 0, False),
        (b.task.id, False, Code.FAILED_PRECONDITION.value[0], True),
        ("no-such-task", False, Code.NOT_FOUND.value[0], True),
        ("", False, Code.INVALID_ARGUMENT.value[0], True),
        (a.task.id, False, Code.NOT_FOUND.value[0], True),
        (c.task.id, True, 0, False),
        (d.task.id, True, Code.FAILED_PRECONDITION.value[0], True),
    ]
    assert worker.settled[1].lease_id == "wrong"
    assert worker.settled[3].message.startswith("id ")
    # The messages are what the unary call reports.
    err = await rpc_error(stub.Ack(pb.AckRequest(id=b.task.id, lease_id="wrong")))
    assert worker.settled[1].message == err.details()
    s = await stats(stub)
    assert (s.handed_out, s.delayed, s.totals.acked, s.totals.nacked) == (2, 1, 1, 1)
    assert worker.unfinished == 2  # b and d: bad acks free no slot
    await worker.send(acks=[ack_of(b), ack_of(d)])
    await worker.until(lambda w: len(w.settled) == 9)
    assert [s.code for s in worker.settled[7:]] == [0, 0]
    await worker.finish()


async def test_unary_ack_and_nack_of_a_streamed_task_free_its_slot(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    ids = [await enqueue(stub, str(i).encode()) for i in range(3)]
    worker = await Worker(stub).open(prefetch=1)
    (d,) = await worker.receive(1)
    await stub.Ack(ack_of(d))
    worker.forget(d)
    (d,) = await worker.receive(1)
    assert d.task.id == ids[1]
    await stub.Nack(nack_of(d, "unary"))
    worker.forget(d)
    (d,) = await worker.receive(1)
    assert d.task.id == ids[2]
    assert worker.settled == []
    s = await stats(stub)
    assert (s.handed_out, s.totals.acked, s.totals.nacked) == (1, 1, 1)
    await worker.send(acks=[ack_of(d)])
    await worker.finish()
    assert [s.code for s in worker.settled] == [0]


async def test_settled_arrives_no_later_than_the_deliveries_it_made_room_for(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    """Big payloads make the broker split deliveries over several responses; the outcomes that
    freed the slots must not come after deliveries that filled them."""
    big = b'"' + b"x" * 1_048_400 + b'"'  # just under the default 1 MiB limit
    for _ in range(4):
        await enqueue(stub, big)
    worker = await Worker(stub).open(prefetch=2)
    held = await worker.receive(2)
    assert worker.max_unfinished == 2
    await worker.send(acks=[ack_of(d) for d in held])
    await worker.until(lambda w: len(w.settled) == 2 and len(w.received) == 4)
    assert all(d.task.payload == big for d in worker.received)
    assert worker.max_unfinished <= 2, (
        f"counting settled before deliveries, the worker held {worker.max_unfinished} tasks "
        "with prefetch 2"
    )
    await worker.send(acks=[ack_of(d) for d in worker.received[2:]])
    await worker.until(lambda w: len(w.settled) == 4)
    await worker.finish()


async def test_acks_on_the_stream_can_finish_tasks_claimed_elsewhere(
    stub: pb_grpc.BrokerAsyncStub, http: Http
) -> None:
    await http.enqueue({"polled": True})
    body = await http.claim()
    await enqueue(stub, b"2")
    await enqueue(stub, b"3")
    worker = await Worker(stub).open(prefetch=1)
    (d,) = await worker.receive(1)
    polled = pb.AckRequest(id=body["task"]["id"], lease_id=body["lease_id"])
    await worker.send(acks=[polled])
    await worker.until(lambda w: len(w.settled) == 1)
    assert (worker.settled[0].id, worker.settled[0].code) == (body["task"]["id"], 0)
    s = await stats(stub)  # the stream's own slot is still taken by d
    assert (s.ready, s.handed_out, s.totals.acked) == (1, 1, 1)
    await worker.send(acks=[ack_of(d)])
    await worker.receive(1)
    await worker.send(acks=[ack_of(worker.received[-1])])
    await worker.until(lambda w: len(w.settled) == 3)
    await worker.finish()
    assert (await http.stats())["totals"]["acked"] == 3


async def test_drain_stops_new_pushes(stub: pb_grpc.BrokerAsyncStub) -> None:
    await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"1")] * 5))
    worker = await Worker(stub).open(prefetch=2)
    held = await worker.receive(2)
    await worker.send(drain=True)
    await worker.send(acks=[ack_of(held[0])])
    await worker.until(lambda w: len(w.settled) == 1)
    await worker.send(acks=[ack_of(held[1])])
    await worker.until(lambda w: len(w.settled) == 2)
    await enqueue(stub, b"2")
    s = await stats(stub)
    assert gauges(s) == (4, 0, 0, 0)  # the freed slots were not refilled
    assert s.totals.delivered == 2
    await worker.finish()
    assert len(worker.received) == 2
    assert [x.code for x in worker.settled] == [0, 0]


async def test_drain_sent_with_the_last_acks_still_stops_pushes(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"1")] * 5))
    worker = await Worker(stub).open(prefetch=2)
    held = await worker.receive(2)
    await worker.send(acks=[ack_of(d) for d in held], drain=True)
    await worker.finish()
    assert [(x.id, x.code) for x in worker.settled] == [(d.task.id, 0) for d in held]
    assert len(worker.received) == 2
    s = await stats(stub)
    assert gauges(s) == (3, 0, 0, 0)
    assert (s.totals.acked, s.totals.reclaimed) == (2, 0)
    # The three left are untouched: their first claim is their first attempt.
    assert (await claim(stub)).task.attempts == 1


async def _ended_stream_returns_tasks(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock, end: Callable[[Worker], Awaitable[None]]
) -> None:
    start = clock.now()
    ids = [await enqueue(stub, str(i).encode()) for i in range(6)]
    worker = await Worker(stub).open(prefetch=3, lease_ms=60_000)
    first = await worker.receive(3)
    await worker.send(acks=[ack_of(first[0])])
    await worker.until(lambda w: len(w.settled) == 1 and len(w.received) == 4)
    unfinished = list(worker.held.values())
    assert len(unfinished) == 3
    await end(worker)

    await wait_until(lambda: stats(stub), lambda s: s.handed_out == 0, what="the tasks given back")
    assert clock.now() == start  # no lease ran out: the stream's end gave them back
    s = await stats(stub)
    assert s.totals.reclaimed == 3
    assert s.totals.retried == 3
    assert (s.ready, s.delayed, s.totals.acked) == (2, 3, 1)
    assert invariant_holds(stats_dict(s))
    # The reclaimed tasks are retried after their backoff, with the reason as last_error.
    clock.advance(1.0)
    await settle()
    retried = [await claim(stub) for _ in range(5)]
    by_id = {d.task.id: d for d in retried}
    assert set(by_id) == set(ids[1:])
    for d in unfinished:
        again = by_id[d.task.id]
        assert again.task.attempts == 2
        assert again.task.HasField("last_error")
        assert again.task.last_error
    assert by_id[ids[5]].task.attempts == 1  # never sent to the stream


async def test_cancelling_the_stream_returns_its_unfinished_tasks_at_once(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    async def cancel(worker: Worker) -> None:
        assert worker.call.cancel()

    await _ended_stream_returns_tasks(stub, clock, cancel)


async def test_half_closing_the_stream_returns_its_unfinished_tasks_at_once(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    async def half_close(worker: Worker) -> None:
        await worker.finish()  # the server ends the call with OK

    await _ended_stream_returns_tasks(stub, clock, half_close)


async def test_stream_task_whose_lease_expires_is_reclaimed_and_frees_the_slot(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    ids = [await enqueue(stub, str(i).encode()) for i in range(2)]
    worker = await Worker(stub).open(prefetch=1, lease_ms=1000)
    (first,) = await worker.receive(1)
    assert seconds(first.deadline) == pytest.approx(clock.now() + 1, abs=1e-6)
    clock.advance(1.5)
    await settle()
    (second,) = await worker.receive(1)  # the slot was freed by the reclaim
    assert second.task.id == ids[1]
    worker.forget(first)
    s = await stats(stub)
    assert (s.handed_out, s.delayed, s.totals.reclaimed, s.totals.retried) == (1, 1, 1, 1)
    await worker.send(acks=[ack_of(first), ack_of(second)])
    await worker.until(lambda w: len(w.settled) == 2)
    assert [x.code for x in worker.settled] == [Code.NOT_FOUND.value[0], 0]
    # The reclaimed task comes back to the same stream after its backoff.
    clock.advance(1.0)
    await settle()
    (again,) = await worker.receive(1)
    assert again.task.id == ids[0]
    assert (again.task.attempts, again.task.last_error) == (2, "lease expired")
    await worker.send(acks=[ack_of(again)])
    await worker.finish()
    assert stats_dict(await stats(stub))["totals"]["acked"] == 2


async def test_streams_and_long_pollers_take_turns(
    stub: pb_grpc.BrokerAsyncStub, http: Http, broker: Broker
) -> None:
    worker = await Worker(stub).open(prefetch=5)
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    poll = asyncio.create_task(http.claim(wait_ms=30_000))
    await wait_until(lambda: broker.service.waiting == 2, what="2 parked claims")
    ids = (
        await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"1")] * 2))
    ).ids
    body = await asyncio.wait_for(poll, 5)
    (d,) = await worker.receive(1)
    assert (d.task.id, body["task"]["id"]) == (ids[0], ids[1])
    await worker.send(acks=[ack_of(d)])
    assert await http.ack(body["task"]["id"], body["lease_id"]) == 204
    await worker.until(lambda w: len(w.settled) == 1)
    await worker.finish()


class Share:
    """The books of many consumers sharing one queue: who got what, and when all were acked."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.acked = 0
        self.done = asyncio.Event()
        self.workers: list[tuple[int, Worker, list[pb.Delivery]]] = []  # (prefetch, worker, got)
        self.by_poller: list[list[dict[str, Any]]] = []

    def finished_one(self) -> None:
        self.acked += 1
        if self.acked == self.total:
            self.done.set()


async def stream_consumer(stub: pb_grpc.BrokerAsyncStub, share: Share, prefetch: int) -> None:
    """Ack every delivery on a stream until the stream ends."""
    got: list[pb.Delivery] = []
    worker = await Worker(stub).open(prefetch=prefetch, lease_ms=300_000)
    share.workers.append((prefetch, worker, got))
    while (response := await worker.read(timeout=30)) is not None:
        # Worker.read counts the outcomes before the deliveries, as the .proto says.
        assert worker.unfinished <= prefetch
        for outcome in response.settled:
            assert outcome.code == 0, outcome
            share.finished_one()
        if response.deliveries:
            got.extend(response.deliveries)
            await worker.send(acks=[ack_of(d) for d in response.deliveries])


async def http_poller(http: Http, share: Share) -> None:
    """Long-poll and ack over HTTP until cancelled."""
    got: list[dict[str, Any]] = []
    share.by_poller.append(got)
    while True:
        body = await http.claim(wait_ms=30_000)
        if body is None:
            continue
        got.append(body)
        assert await http.ack(body["task"]["id"], body["lease_id"]) == 204
        share.finished_one()


async def mixed_producer(
    stub: pb_grpc.BrokerAsyncStub, http: Http, k: int, total: int
) -> list[str]:
    """Enqueue every 20th task from k on, over HTTP (odd k) or gRPC (even k)."""
    ids = []
    for i in range(k, total, 20):
        if k % 2:
            ids.append(await http.enqueue({"n": i}))
        else:
            ids.append(await enqueue(stub, json.dumps({"n": i}).encode()))
    return ids


async def test_many_streams_and_http_long_pollers_share_2000_tasks_exactly_once(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub
) -> None:
    total = 2000
    share = Share(total)
    async with aiohttp.ClientSession() as session:
        http = Http(session, broker.http_url)
        streams = [asyncio.create_task(stream_consumer(stub, share, p)) for p in (1, 4, 16)]
        pollers = [asyncio.create_task(http_poller(http, share)) for _ in range(3)]
        await wait_until(lambda: broker.service.waiting == 6, what="6 parked claims")
        produced = await asyncio.gather(*(mixed_producer(stub, http, k, total) for k in range(20)))
        await asyncio.wait_for(share.done.wait(), 30)
        for p in pollers:
            p.cancel()
        for _, worker, _ in share.workers:
            await worker.call.done_writing()
        await asyncio.wait_for(asyncio.gather(*streams), 10)
        ended = await asyncio.gather(*pollers, return_exceptions=True)
        assert all(isinstance(e, asyncio.CancelledError) for e in ended), ended
    workers, by_poller = share.workers, share.by_poller

    enqueued = [i for ids in produced for i in ids]
    assert len(set(enqueued)) == total
    streamed = [d.task.id for _, _, got in workers for d in got]
    polled = [b["task"]["id"] for got in by_poller for b in got]
    delivered = streamed + polled
    assert len(delivered) == total  # nothing delivered twice...
    assert set(delivered) == set(enqueued)  # ...and nothing missing
    assert all(d.task.attempts == 1 for _, _, got in workers for d in got)
    assert all(b["task"]["attempts"] == 1 for got in by_poller for b in got)
    # Both kinds of consumer, and indeed every consumer, got a share.
    assert streamed
    assert polled
    assert all(got for _, _, got in workers)
    assert all(by_poller)
    for prefetch, worker, got in workers:
        assert await worker.call.code() == Code.OK
        assert worker.max_unfinished <= prefetch
        assert len(worker.settled) == len(got)
        assert all(s.code == 0 for s in worker.settled)
    await wait_until(lambda: broker.service.waiting == 0, what="no parked claim")
    s = await stats(stub)
    assert gauges(s) == (0, 0, 0, 0)
    assert stats_dict(s)["totals"] == {
        "enqueued": total,
        "delivered": total,
        "acked": total,
        "nacked": 0,
        "reclaimed": 0,
        "retried": 0,
        "buried": 0,
        "requeued": 0,
        "purged": 0,
        "cancelled": 0,
        "expired": 0,
    }
