"""Hostile input at the gRPC edge: whatever a client sends, it gets a clear status naming the
problem (never UNKNOWN or INTERNAL, never a hang or a traceback in the broker's log), and one
broken call hurts nobody else.

Every test runs one real broker (HTTP and gRPC on port 0; the memory store, and SQLite too for
the enqueue and ack/nack properties) on a FakeClock, shared by all its Hypothesis examples, and
drives it with real grpc.aio clients with gRPC's default limits; raw calls send arbitrary bytes
where a message belongs. After each call the broker must still be healthy: health SERVING, a
normal Enqueue/NextJob/Ack works, and its books balance (``nacked + reclaimed == retried +
buried``, and every task enqueued is acked or in exactly one gauge).

1. undecodable requests: INVALID_ARGUMENT, on every method and mid-stream;
2. streamed responses: each under 2 MiB encoded, whatever fills it;
3. status details and Settled messages: at most 1 KiB;
4. the property suite: random bytes and random messages to every method, random stream
   sessions; and what the service bounds (error texts, quoted ids).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.helpers import examples, invariant_holds, make_store, running_broker, settle, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqbroker.errors import NotFound
from wqbroker.grpc.server import (
    MAX_DETAILS_BYTES,
    TRUNCATED,
    _bound,
    _Outcome,
    _settled,
    _StreamCall,
    delivery_pb,
    details,
    stream_responses,
    task_pb,
    timestamp,
    utf8,
)
from wqbroker.limits import MAX_BATCH, MAX_DELAY_MS, MAX_LEASE_MS, MAX_MAX_ATTEMPTS, MAX_WAIT_MS
from wqbroker.models import Delivery, Task
from wqbroker.retry import Backoff
from wqbroker.service import Service
from wqbroker.store.memory import MemoryStore
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)

Code = grpc.StatusCode
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # not in grpc-stubs

SERVICE = pb.DESCRIPTOR.services_by_name["Broker"]
METHODS = [m.name for m in SERVICE.methods]
UNARY = [m.name for m in SERVICE.methods if not m.client_streaming]
REQUEST: dict[str, type[Message]] = {
    m.name: getattr(pb, m.input_type.name) for m in SERVICE.methods
}
# What no call may ever end with, whatever it sent.
NEVER = {Code.UNKNOWN, Code.INTERNAL, Code.DEADLINE_EXCEEDED}
UNDECODABLE = "could not be decoded"
CALL_TIMEOUT = 10.0

# Hypothesis: one broker per test, shared by its examples; bounded, no deadline (real I/O).
HOSTILE = settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# -- fixtures and helpers -----------------------------------------------------------------------


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[Broker]:
    async with running_broker(clock=clock, rng=random.Random(11)) as b:
        yield b


@pytest.fixture
async def channel(broker: Broker) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(broker.grpc_target) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> pb_grpc.BrokerAsyncStub:
    return pb_grpc.BrokerStub(channel)


def path(method: str) -> str:
    return f"/{SERVICE.full_name}/{method}"


def decodes(method: str, data: bytes) -> bool:
    """Whether ``data`` is a valid request message for ``method`` (parsed as the broker does)."""
    try:
        REQUEST[method].FromString(data)
    except DecodeError:
        return False
    return True


async def raw_unary(channel: grpc.aio.Channel, method: str, data: bytes) -> tuple[Code, str, bytes]:
    """Send ``data`` as the request of a unary method; its status code, details and response."""
    call = channel.unary_unary(path(method), request_serializer=None, response_deserializer=None)
    try:
        body = await call(data, timeout=CALL_TIMEOUT)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", b""
    assert isinstance(body, bytes)
    return Code.OK, "", body


async def unary(
    broker: Broker, clock: FakeClock, channel: grpc.aio.Channel, method: str, data: bytes
) -> tuple[Code, str, bytes]:
    """:func:`raw_unary`; a NextJob that parks is ended by moving the clock past its wait."""
    waiting = broker.service.waiting
    task = asyncio.create_task(raw_unary(channel, method, data))
    await wait_until(
        lambda: task.done() or broker.service.waiting > waiting, what=f"{method} to answer or park"
    )
    if not task.done():
        clock.advance(MAX_WAIT_MS / 1000 + 1)
    return await asyncio.wait_for(task, CALL_TIMEOUT)


RawStream = grpc.aio.StreamStreamCall[bytes, bytes]


def open_raw_call(channel: grpc.aio.Channel, method: str) -> RawStream:
    """A call of ``method`` that may send any number of messages (a client-streaming call on
    the wire, whatever the method is)."""
    start = channel.stream_stream(path(method), request_serializer=None, response_deserializer=None)
    call: RawStream = start(None)
    return call


def open_raw_stream(channel: grpc.aio.Channel) -> RawStream:
    """A StreamJobs call that sends and receives bytes as they are."""
    return open_raw_call(channel, "StreamJobs")


async def raw_stream(
    channel: grpc.aio.Channel, frames: list[bytes], *, half_close: bool = True
) -> tuple[Code, str, list[bytes]]:
    """Send ``frames`` on a StreamJobs call, then half-close (or not: when the last frame ends
    the call); its responses and how it ended.

    Nothing is written after a frame that ends the call: grpc.aio's client would report the failed
    write as INTERNAL in place of the broker's status."""
    call = open_raw_stream(channel)
    responses: list[bytes] = []
    try:
        for frame in frames:
            await call.write(frame)
        if half_close:
            await call.done_writing()
        while isinstance(response := await asyncio.wait_for(call.read(), CALL_TIMEOUT), bytes):
            responses.append(response)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", responses
    code = await asyncio.wait_for(call.code(), CALL_TIMEOUT)
    return code, await call.details() or "", responses


def assert_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing worse than a line at INFO in the log: no warning, no error, no traceback."""
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]


async def assert_healthy(channel: grpc.aio.Channel) -> None:
    """Health SERVING, a normal Enqueue/NextJob/Ack works, and the books balance."""
    stub: pb_grpc.BrokerAsyncStub = pb_grpc.BrokerStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE.full_name):
        response = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING, name
    await stub.Enqueue(pb.EnqueueRequest(payload=b'{"still": "fine"}'), timeout=5)
    got = await stub.NextJob(pb.NextJobRequest(wait_ms=0), timeout=5)
    assert got.HasField("delivery")
    d = got.delivery
    await stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id), timeout=5)
    await assert_books_balance(stub)


async def ack_all_ready(stub: pb_grpc.BrokerAsyncStub) -> None:
    while (got := await stub.NextJob(pb.NextJobRequest(wait_ms=0))).HasField("delivery"):
        await stub.Ack(pb.AckRequest(id=got.delivery.task.id, lease_id=got.delivery.lease_id))


async def assert_books_balance(stub: pb_grpc.BrokerAsyncStub) -> None:
    s = await stub.Stats(pb.StatsRequest(), timeout=5)
    t = s.totals
    assert invariant_holds(s), t
    assert s.ready + s.handed_out + s.delayed + s.dead + t.acked == t.enqueued, s


# -- 1. undecodable requests --------------------------------------------------------------------

# Bytes that are not a valid message of any request type: a length running past the end, a tag
# of field 0, wire types 6 and 7 (which do not exist), a varint longer than ten bytes, a group
# that never ends, and plain garbage.
CORRUPT = [
    b"\x0a\x05ab",
    b"\x00",
    b"\x0e",
    b"\x0f\x01",
    b"\x08" + b"\xff" * 10 + b"\x01",
    b"\x0b",
    b"\xff\xff\xff",
]
# Invalid UTF-8 in a `string` field (which clients in other languages can send), for each request
# type that has one, directly or in a nested message.
BAD_UTF8 = {
    "NextJob": [b"\x1a\x03\x0a\x01\xff", b"\x1a\x05\x12\x03ok\xc0"],  # acks[0].id, .lease_id
    "Ack": [b"\x0a\x01\xff", b"\x12\x02\xed\xa0"],  # id; lease_id (half a surrogate)
    "Nack": [b"\x0a\x01\xff", b"\x1a\x03\xed\xa0\x80"],  # id; error (a lone surrogate)
    "Requeue": [b"\x0a\x02\xc3\x28"],
    "StreamJobs": [
        b"\x12\x03\x0a\x01\xff",
        b"\x1a\x04\x1a\x02\xe2\x82",
    ],  # acks[0].id; nacks[0].error
}
UNDECODABLE_CASES = [
    pytest.param(method, data, id=f"{method}-{i}")
    for method in METHODS
    for i, data in enumerate(CORRUPT + BAD_UTF8.get(method, []))
]


async def _undecodable_answer(
    broker: Broker, clock: FakeClock, channel: grpc.aio.Channel, method: str, data: bytes
) -> tuple[Code, str]:
    if method == "Produce":
        # Answered like a refused batch, and the stream goes on: the batch after it is taken.
        good = pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"7")])
        call = open_raw_call(channel, "Produce")
        await call.write(data)
        await call.write(good.SerializeToString())
        await call.done_writing()
        answers = []
        for _ in range(2):
            raw: object = await asyncio.wait_for(call.read(), CALL_TIMEOUT)
            assert isinstance(raw, bytes)
            answers.append(pb.ProduceResponse.FromString(raw))
        assert await asyncio.wait_for(call.read(), CALL_TIMEOUT) is EOF
        assert await call.code() == Code.OK
        assert answers[1].code == 0, answers[1]
        assert len(answers[1].ids) == 1
        assert not answers[0].ids
        return next(c for c in Code if c.value[0] == answers[0].code), answers[0].message
    if method == "StreamJobs":
        code, details, responses = await raw_stream(channel, [data], half_close=False)
        assert responses == []
        return code, details
    code, details, _ = await unary(broker, clock, channel, method, data)
    return code, details


@pytest.mark.parametrize(("method", "data"), UNDECODABLE_CASES)
async def test_an_undecodable_request_is_invalid_argument(
    broker: Broker,
    clock: FakeClock,
    channel: grpc.aio.Channel,
    stub: pb_grpc.BrokerAsyncStub,
    caplog: pytest.LogCaptureFixture,
    method: str,
    data: bytes,
) -> None:
    assert not decodes(method, data)
    code, details = await _undecodable_answer(broker, clock, channel, method, data)
    assert code == Code.INVALID_ARGUMENT, details
    assert UNDECODABLE in details
    assert REQUEST[method].DESCRIPTOR.full_name in details
    assert_no_traceback(caplog)
    await assert_healthy(channel)


async def test_an_undecodable_request_is_logged_in_one_line_at_debug(
    broker: Broker,
    clock: FakeClock,
    channel: grpc.aio.Channel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    code, _, _ = await unary(broker, clock, channel, "Ack", b"\x0a\x01\xff")
    assert code == Code.INVALID_ARGUMENT
    about = [r for r in caplog.records if "decoded" in r.getMessage()]
    assert len(about) == 1
    assert about[0].levelno == logging.DEBUG
    assert about[0].exc_info is None
    assert "\n" not in about[0].getMessage()


async def test_a_corrupt_frame_mid_stream_ends_it_and_reclaims_its_tasks(
    broker: Broker,
    channel: grpc.aio.Channel,
    stub: pb_grpc.BrokerAsyncStub,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"1")] * 3))
    call = open_raw_stream(channel)
    await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=2)).SerializeToString())
    deliveries: list[pb.Delivery] = []
    while len(deliveries) < 2:
        raw = await asyncio.wait_for(call.read(), 5)
        assert isinstance(raw, bytes), "the stream ended"
        deliveries += pb.StreamJobsResponse.FromString(raw).deliveries
    first = deliveries[0]
    ack = pb.StreamJobsRequest(acks=[pb.AckRequest(id=first.task.id, lease_id=first.lease_id)])
    await call.write(ack.SerializeToString())
    await call.write(b"\x12\x03\x0a\x01\xff")  # acks[0].id is not UTF-8
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _read_to_the_end(call)
    assert info.value.code() == Code.INVALID_ARGUMENT
    assert UNDECODABLE in (info.value.details() or "")
    # The ack before the bad frame counted; what the stream still held was reclaimed at once.
    s = await wait_until(
        lambda: stub.Stats(pb.StatsRequest()),
        lambda s: s.handed_out == 0,
        what="the stream's unfinished tasks to be reclaimed",
    )
    # (The ack freed a slot, and the third task was pushed into it before the bad frame.)
    assert (s.totals.acked, s.totals.reclaimed, s.totals.retried, s.delayed) == (1, 2, 2, 2)
    assert_no_traceback(caplog)
    await assert_healthy(channel)


async def _read_to_the_end(call: RawStream) -> None:
    while isinstance(await asyncio.wait_for(call.read(), 5), bytes):
        pass


@pytest.mark.parametrize("method", UNARY)
async def test_a_unary_call_without_a_request_is_invalid_argument(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture, method: str
) -> None:
    """A client that half-closes without sending its request: answered at once (grpc.aio alone
    would never answer it, and the caller would wait for its deadline, or forever)."""
    call = open_raw_call(channel, method)
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(_read_to_the_end(call), 5)
    assert info.value.code() == Code.INVALID_ARGUMENT
    assert "no request" in (info.value.details() or "")
    assert_no_traceback(caplog)
    await assert_healthy(channel)


@pytest.mark.parametrize("method", UNARY)
@HOSTILE
@given(data=st.binary(max_size=64))
async def test_random_bytes_to_a_unary_method(
    broker: Broker,
    clock: FakeClock,
    channel: grpc.aio.Channel,
    stub: pb_grpc.BrokerAsyncStub,
    caplog: pytest.LogCaptureFixture,
    method: str,
    data: bytes,
) -> None:
    code, details, _ = await unary(broker, clock, channel, method, data)
    _assert_answer(method, data, code, details)
    assert_no_traceback(caplog)
    await assert_books_balance(stub)


@HOSTILE
@given(frames=st.lists(st.binary(max_size=48), max_size=4))
async def test_random_frames_on_a_stream(
    broker: Broker,
    channel: grpc.aio.Channel,
    stub: pb_grpc.BrokerAsyncStub,
    caplog: pytest.LogCaptureFixture,
    frames: list[bytes],
) -> None:
    await stub.Enqueue(pb.EnqueueRequest(payload=b'"for the stream"'))
    sent, expected, needle = _stream_end(frames)
    code, details, _ = await raw_stream(channel, sent, half_close=expected == Code.OK)
    assert code == expected, (code, details)
    assert needle in details
    assert_no_traceback(caplog)
    await wait_until(
        lambda: stub.Stats(pb.StatsRequest()),
        lambda s: s.handed_out == 0,
        what="the stream's tasks to be given back",
    )
    await assert_healthy(channel)


def _stream_end(frames: list[bytes]) -> tuple[list[bytes], Code, str]:
    """Of ``frames``, the ones up to the first that ends a StreamJobs call; how the call ends
    (after a half-close if none does), and a word of its details."""
    for i, frame in enumerate(frames):
        sent = frames[: i + 1]
        if not decodes("StreamJobs", frame):
            return sent, Code.INVALID_ARGUMENT, UNDECODABLE
        request = pb.StreamJobsRequest.FromString(frame)
        if request.HasField("open") != (i == 0):
            return sent, Code.INVALID_ARGUMENT, "open"
        for name in ("prefetch", "lease_ms"):
            if i == 0 and request.open.HasField(name) and getattr(request.open, name) < 1:
                return sent, Code.INVALID_ARGUMENT, name
    return frames, Code.OK, ""


def _assert_answer(method: str, data: bytes, code: Code, details: str) -> None:
    if decodes(method, data):
        # A valid message: the normal rules apply.
        assert code not in NEVER, (code, details)
        assert UNDECODABLE not in details
    else:
        assert (code, UNDECODABLE in details) == (Code.INVALID_ARGUMENT, True), (code, details)


# -- 2. stream responses sized by the encoded message --------------------------------------------

MIB = 1024 * 1024
STREAM_BOUND = 2 * MIB  # the documented bound on a streamed response (README, .proto)


async def failed_once(broker: Broker, clock: FakeClock, tasks: list[tuple[bytes, int]]) -> None:
    """A task per (payload, error size), each failed once with an error of that many bytes and
    ready again. The errors are written through the store, so no cap on error texts applies."""
    service = broker.service
    for payload, _ in tasks:
        await service.enqueue(payload)
    for _, size in tasks:
        d = await service.claim(0)
        assert d is not None
        error = (d.task.id + ":").ljust(size, "e")
        await broker.store.nack(d.task.id, d.lease_id, error, now=clock.now())
    clock.advance(3600)  # past any backoff
    await service.sweep()
    assert (await service.stats()).ready == len(tasks)


class Reader:
    """A StreamJobs call on a client with gRPC's default limits (4 MiB received), and what came."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = pb_grpc.BrokerStub(channel).StreamJobs(None)
        self.sizes: list[int] = []
        self.deliveries: list[pb.Delivery] = []
        self.settled: list[pb.Settled] = []

    async def read_until(self, deliveries: int = 0, settled: int = 0) -> None:
        while len(self.deliveries) < deliveries or len(self.settled) < settled:
            response = await asyncio.wait_for(self.call.read(), CALL_TIMEOUT)
            assert isinstance(response, pb.StreamJobsResponse), "the stream ended"
            self.sizes.append(response.ByteSize())
            self.deliveries += response.deliveries
            self.settled += response.settled


async def test_deliveries_with_long_last_errors_reach_a_default_client(
    broker: Broker, clock: FakeClock, channel: grpc.aio.Channel
) -> None:
    """30 tasks failed with 300 KB errors: 9 MB of deliveries, split so each response is under
    the bound (one 9 MB response would be refused by the client, and every task reclaimed)."""
    await failed_once(broker, clock, [(b'"small payload"', 300 * 1024)] * 30)
    reader = Reader(channel)
    await reader.call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=30)))
    await reader.read_until(deliveries=30)
    assert all(d.task.attempts == 2 for d in reader.deliveries)
    assert all(len(d.task.last_error) == 300 * 1024 for d in reader.deliveries)
    assert all(d.task.last_error.startswith(d.task.id + ":") for d in reader.deliveries)
    assert max(reader.sizes) <= STREAM_BOUND
    assert len(reader.sizes) >= 1 + 5  # the open's answer, then at least 9 MB / 2 MiB responses
    s = await broker.service.stats()
    assert (s.handed_out, s.totals.reclaimed) == (30, 0)
    reader.call.cancel()


async def test_a_delivery_over_the_bound_comes_alone(
    broker: Broker, clock: FakeClock, channel: grpc.aio.Channel
) -> None:
    """Deliveries over the bound (a long error, with a payload as large as the broker accepts or
    a small one) each come alone in a response, which a default client still accepts."""
    largest = b'"' + b"p" * (MIB - 2) + b'"'  # the broker's default -max-body-bytes
    small = b'"small"'
    tasks = [(largest, 1536 * 1024)] * 2 + [(small, 2560 * 1024)] * 4 + [(largest, 100)]
    await failed_once(broker, clock, tasks)
    reader = Reader(channel)
    await reader.call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=7)))
    await reader.read_until(deliveries=7)
    got = sorted((len(d.task.payload), len(d.task.last_error)) for d in reader.deliveries)
    assert got == sorted((len(p), e) for p, e in tasks)
    over = [n for n in reader.sizes if n > STREAM_BOUND]
    assert len(over) == 6, reader.sizes  # the six over the bound, one per response
    assert all(n < 4 * MIB for n in over)
    reader.call.cancel()


async def test_many_long_outcomes_reach_a_default_client(
    broker: Broker, clock: FakeClock, channel: grpc.aio.Channel
) -> None:
    """10,000 acks of unknown tasks with long ids in one request (under 4 MiB): their outcomes,
    which echo the ids and add a message each, come in responses under the bound."""
    await failed_once(broker, clock, [(b"1", 20)])
    reader = Reader(channel)
    await reader.call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=1)))
    await reader.read_until(deliveries=1)
    held = reader.deliveries[0]
    acks = [pb.AckRequest(id=f"{i:05}".ljust(200, "i"), lease_id="l" * 190) for i in range(9_999)]
    acks.append(pb.AckRequest(id=held.task.id, lease_id=held.lease_id))
    request = pb.StreamJobsRequest(acks=acks)
    assert request.ByteSize() < 4 * MIB
    await reader.call.write(request)
    await reader.read_until(settled=10_000)
    assert [s.id for s in reader.settled] == [a.id for a in acks]  # in order, none lost
    assert [s.code for s in reader.settled[:-1]] == [Code.NOT_FOUND.value[0]] * 9_999
    assert reader.settled[-1].code == 0
    assert sum(s.ByteSize() for s in reader.settled) > 4 * MIB
    assert max(reader.sizes) <= STREAM_BOUND
    await reader.call.done_writing()
    assert await asyncio.wait_for(reader.call.read(), CALL_TIMEOUT) is EOF
    assert await reader.call.code() == Code.OK
    s = await broker.service.stats()
    assert (s.handed_out, s.totals.acked, s.totals.reclaimed) == (0, 1, 0)


@settings(max_examples=examples(200), deadline=None)
@given(
    settled=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300)), max_size=30),
    deliveries=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 400)), max_size=30),
    limit=st.integers(50, 2000),
)
def test_stream_responses_are_packed_by_encoded_size(
    settled: list[tuple[int, int]], deliveries: list[tuple[int, int]], limit: int
) -> None:
    """Outcomes, then deliveries, in order; each response at most ``limit`` bytes encoded unless
    it carries a single entry larger than that."""
    outcomes = [_Outcome("i" * n, "l", NotFound("m" * m) if m else None) for n, m in settled]
    tasks = [
        Delivery(Task(f"{i}", b"p" * p, 1, 3, 0.0, 0.0, "e" * e if e else None), "lease", 30.0)
        for i, (p, e) in enumerate(deliveries)
    ]
    responses = stream_responses(tasks, outcomes, limit)
    assert [s for r in responses for s in r.settled] == [_settled(o) for o in outcomes]
    assert [d.task.id for r in responses for d in r.deliveries] == [t.task.id for t in tasks]
    seen_delivery = False
    for r in responses:
        entries = len(r.settled) + len(r.deliveries)
        assert r.ByteSize() <= limit or entries == 1, (r.ByteSize(), entries)
        assert not (seen_delivery and r.settled), "an outcome after a delivery"
        seen_delivery |= bool(r.deliveries)
    # Packed, not scattered: no two neighbours would have fitted in one response.
    for a, b in itertools.pairwise(responses):
        assert a.ByteSize() + b.ByteSize() > limit


_times = st.floats(0, 4e9, allow_nan=False)


@settings(max_examples=examples(300), deadline=None)
@given(
    task_id=st.text(max_size=20),
    payload=st.binary(max_size=50),
    attempts=st.integers(0, 2**31 - 1),
    created=_times,
    available=_times | st.none(),
    last_error=st.none() | st.text(max_size=20),
    queue=st.text(max_size=10),
    priority=st.integers(0, 9),
    deadline=_times,
)
def test_a_delivery_made_in_place_is_the_one_built_from_its_fields(
    task_id: str,
    payload: bytes,
    attempts: int,
    created: float,
    available: float | None,
    last_error: str | None,
    queue: str,
    priority: int,
    deadline: float,
) -> None:
    """Deliveries and tasks are set field by field (a stream's in the response that carries
    them): the same message as one built from its fields, for any text and any time."""
    at = created if available is None else available
    task = Task(task_id, payload, attempts, 3, created, at, last_error, queue, priority)
    built = pb.Task(
        id=task_id,
        payload=payload,
        attempts=attempts,
        max_attempts=3,
        created_at=timestamp(created),
        available_at=timestamp(at),
        last_error=None if last_error is None else utf8(last_error),
        queue=queue,
        priority=priority,
    )
    assert task_pb(task) == built
    expected = pb.Delivery(task=built, lease_id="lease", deadline=timestamp(deadline))
    assert delivery_pb(Delivery(task, "lease", deadline)) == expected
    [response] = stream_responses([Delivery(task, "lease", deadline)], [])
    assert list(response.deliveries) == [expected]
    ns = timestamp(deadline).ToNanoseconds()
    assert abs(ns - deadline * 1e9) <= max(1.0, deadline * 1e9 * 2**-52)


# Error texts may hold lone surrogates (JSON sent to the HTTP API can smuggle them in); ids,
# leases and queue names never do.
_texts = st.text(max_size=30)
_errors = _texts | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=30)


@settings(max_examples=examples(300), deadline=None)
@given(
    deliveries=st.lists(
        st.tuples(
            _texts,
            st.binary(max_size=300),
            st.integers(-(2**31), 2**31 - 1),
            st.none() | _errors,
            _texts,
            st.integers(-(2**31), 2**31 - 1),
            st.floats(-1e10, 1e10),
        ),
        max_size=5,
    ),
    outcomes=st.lists(
        st.tuples(_texts, _texts, st.none() | _errors, st.booleans(), st.none() | _times),
        max_size=5,
    ),
)
def test_the_bound_of_a_response_is_never_below_its_size(
    deliveries: list[tuple[str, bytes, int, str | None, str, int, float]],
    outcomes: list[tuple[str, str, str | None, bool, float | None]],
) -> None:
    """stream_responses sends everything in one response, sizes untaken, when the bound says it
    fits: the bound must hold for any text (lone surrogates grow sixfold), number and time."""
    made = [Delivery(Task(i, p, a, a, t, t, e, q, pr), i, t) for i, p, a, e, q, pr, t in deliveries]
    told = [
        _Outcome(i, lease, None if e is None else NotFound(e), nack, deadline is not None, deadline)
        for i, lease, e, nack, deadline in outcomes
    ]
    [response] = stream_responses(made, told, limit=2**40)
    assert _bound(made, told) >= response.ByteSize()


async def test_a_next_job_whose_answer_a_default_client_would_refuse_hands_out_nothing(
    broker: Broker, channel: grpc.aio.Channel, stub: pb_grpc.BrokerAsyncStub
) -> None:
    """NextJob acking 10,000 unknown tasks with long ids: the outcomes alone make an answer over
    the 4 MiB a default client accepts. The caller loses its answer (its own doing), but the
    ready task must not go down with it, handed out to nobody until its lease runs out."""
    await stub.Enqueue(pb.EnqueueRequest(payload=b'"innocent"'))
    acks = [pb.AckRequest(id=f"{i:05}".ljust(200, "i"), lease_id="l" * 190) for i in range(10_000)]
    request = pb.NextJobRequest(wait_ms=0, acks=acks)
    assert request.ByteSize() < 4 * MIB
    code, _, _ = await raw_unary(channel, "NextJob", request.SerializeToString())
    assert code == Code.RESOURCE_EXHAUSTED  # refused by the client, over its limit
    s = await stub.Stats(pb.StatsRequest())
    assert (s.ready, s.handed_out, s.totals.delivered) == (1, 0, 0)
    # 10,000 acks of ordinary ids (failing or not) leave plenty of room for the task.
    acks = [pb.AckRequest(id=f"{i:016x}", lease_id=f"{i:016x}") for i in range(10_000)]
    got = await stub.NextJob(pb.NextJobRequest(wait_ms=0, acks=acks))
    assert (got.delivery.task.payload, got.delivery.task.attempts) == (b'"innocent"', 1)
    assert [s.code for s in got.settled] == [Code.NOT_FOUND.value[0]] * 10_000


# -- 3. bounded status details -------------------------------------------------------------------

MAX_DETAILS = 1024  # the documented bound on status details and Settled.message (UTF-8 bytes)
assert MAX_DETAILS == MAX_DETAILS_BYTES
# 64 KB ids: plain ASCII; two-byte characters (each byte is tripled by gRPC's percent-encoding of
# the details); and what metadata must never carry raw (NUL, CR, LF, the escape character).
LONG_IDS = [
    pytest.param("x" * 65536, id="ascii"),
    pytest.param("é" * 32768, id="two-byte"),
    pytest.param("\x00\r\n%" * 16384, id="control"),
]


@pytest.mark.parametrize("long_id", LONG_IDS)
@pytest.mark.parametrize("method", ["Ack", "Nack", "Requeue"])
async def test_a_long_id_gets_a_short_not_found(
    broker: Broker,
    channel: grpc.aio.Channel,
    stub: pb_grpc.BrokerAsyncStub,
    caplog: pytest.LogCaptureFixture,
    method: str,
    long_id: str,
) -> None:
    request: Message
    if method == "Requeue":
        request = pb.RequeueRequest(id=long_id)
    else:
        request = REQUEST[method](id=long_id, lease_id=long_id)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await getattr(stub, method)(request, timeout=CALL_TIMEOUT)
    details = info.value.details() or ""
    assert info.value.code() == Code.NOT_FOUND, details
    assert 0 < len(details.encode()) <= MAX_DETAILS
    assert details.startswith("task ")
    assert_no_traceback(caplog)
    await assert_healthy(channel)


async def test_outcomes_of_long_ids_carry_short_messages(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub, channel: grpc.aio.Channel
) -> None:
    """Settled.message is what the unary call would report: bounded the same way (the ids are
    echoed in full, in Settled.id: the worker needs them to match outcomes to its acks)."""
    acks = [pb.AckRequest(id="é" * 32768, lease_id="l" * 65536), pb.AckRequest(id="x" * 65536)]
    response = await stub.NextJob(pb.NextJobRequest(wait_ms=0, acks=acks), timeout=CALL_TIMEOUT)
    stream = stub.StreamJobs(None)
    await stream.write(pb.StreamJobsRequest(open=pb.StreamOpen()))
    await stream.write(pb.StreamJobsRequest(acks=acks[:1], nacks=[pb.NackRequest(id="n" * 65536)]))
    streamed: list[pb.Settled] = []
    while len(streamed) < 2:
        got = await asyncio.wait_for(stream.read(), CALL_TIMEOUT)
        assert isinstance(got, pb.StreamJobsResponse)
        streamed += got.settled
    for outcome in [*response.settled, *streamed]:
        assert outcome.code in (Code.NOT_FOUND.value[0], Code.INVALID_ARGUMENT.value[0])
        assert 0 < len(outcome.message.encode()) <= MAX_DETAILS
    assert [s.id for s in response.settled] == [a.id for a in acks]
    assert [s.id for s in streamed] == [acks[0].id, "n" * 65536]
    stream.cancel()
    await assert_healthy(channel)


# Any text, lone surrogates included (st.characters() never draws them).
ANY_TEXT = st.text(st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)))


@settings(max_examples=examples(300), deadline=None)
@given(message=st.one_of(ANY_TEXT, ANY_TEXT.map(lambda t: t * 200)))
def test_details_are_bounded_utf8(message: str) -> None:
    out = details(message)
    data = out.encode()  # strict: always valid UTF-8
    assert len(data) <= MAX_DETAILS
    encodable = not any(0xD800 <= ord(c) <= 0xDFFF for c in message)
    if len(message.encode("utf-8", "backslashreplace")) <= MAX_DETAILS:
        assert out == message or not encodable
    else:
        assert out.endswith(TRUNCATED)
        if encodable:
            assert message.startswith(out.removesuffix(TRUNCATED))


# -- 4. the hostile-input suite ------------------------------------------------------------------


async def test_a_last_error_with_a_lone_surrogate_is_carried_escaped(
    broker: Broker,
    clock: FakeClock,
    channel: grpc.aio.Channel,
    stub: pb_grpc.BrokerAsyncStub,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """gRPC clients cannot send a lone surrogate (protobuf refuses invalid UTF-8), but the HTTP
    API decodes one from JSON ("\\ud800"), and the error is stored. A gRPC worker or admin must
    still get the task: the error comes escaped, rather than the call failing (and a stream with
    it, over and over). (Written through the store: whether the service lets one in is not the
    point.)"""
    service = broker.service
    for n in range(3):
        await service.enqueue(f'{{"n": {n}}}'.encode(), max_attempts=1 if n == 0 else 2)
    for _ in range(3):
        d = await service.claim(0)
        assert d is not None
        await broker.store.nack(d.task.id, d.lease_id, "bad \ud800 error", now=clock.now())
    clock.advance(3600)
    await service.sweep()
    (dead,) = (await stub.ListDead(pb.ListDeadRequest(), timeout=CALL_TIMEOUT)).tasks
    assert dead.last_error == "bad \\ud800 error"
    got = await stub.NextJob(pb.NextJobRequest(wait_ms=0), timeout=CALL_TIMEOUT)
    assert got.delivery.task.last_error == "bad \\ud800 error"
    reader = Reader(channel)
    await reader.call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=5)))
    await reader.read_until(deliveries=1)
    assert reader.deliveries[0].task.last_error == "bad \\ud800 error"
    acks = [pb.AckRequest(id=d.task.id, lease_id=d.lease_id) for d in reader.deliveries]
    await reader.call.write(pb.StreamJobsRequest(acks=acks))
    await reader.read_until(settled=1)
    await stub.Ack(pb.AckRequest(id=got.delivery.task.id, lease_id=got.delivery.lease_id))
    reader.call.cancel()
    assert_no_traceback(caplog)
    await assert_healthy(channel)


# Random messages with random field values: the strategies.

INT64 = st.one_of(
    st.none(),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, MAX_DELAY_MS, MAX_DELAY_MS + 1]),
    st.sampled_from([MAX_WAIT_MS, MAX_LEASE_MS + 1, 2**63 - 1, -(2**63)]),
    st.integers(-(2**63), 2**63 - 1),
)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
# Payloads no JSON parser accepts (or too large: RESOURCE_EXHAUSTED).
BAD_PAYLOADS = [
    b"",
    b" \n\t",
    b"{",
    b"not json",
    b"{'single': 'quotes'}",
    b"1 2",
    b"NaN",
    b"[Infinity]",
    b"-Infinity",
    b'"\xff"',
    b'"\xed\xa0\x80"',
    b'"a\x00b"',
    b"\xef\xbb\xbf{}",
    b"[" * 100_000 + b"]" * 100_000,
    b'"' + b"x" * MIB + b'"',
]
# (True: valid, False: invalid, None: who knows) and the bytes.
PAYLOADS: st.SearchStrategy[tuple[bool | None, bytes]] = st.one_of(
    JSON_VALUES.map(lambda v: (True, json.dumps(v, ensure_ascii=False).encode())),
    st.sampled_from([b"null", b"0", b'""', b"[]", b"{}", b'"\\ud800"', b"1e999"]).map(
        lambda p: (True, p)
    ),
    st.sampled_from(BAD_PAYLOADS).map(lambda p: (False, p)),
    st.binary(max_size=24).map(lambda p: (None, p)),
)
IDS = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", " ", "\x00", "é" * 100, "x" * 65536, "🐍" * 1000, "../../etc", "%00"]),
)
ERRORS = st.one_of(
    st.none(), st.text(max_size=64), st.sampled_from(["", "\x00", "é" * 5000, "e" * 300_000])
)


def enqueue_valid(
    payload: bool | None, max_attempts: int | None, delay_ms: int | None
) -> bool | None:
    """Whether an EnqueueRequest is valid (None: it depends on bytes we did not classify)."""
    if max_attempts is not None and not 1 <= max_attempts <= MAX_MAX_ATTEMPTS:
        return False
    if delay_ms is not None and not 0 <= delay_ms <= MAX_DELAY_MS:
        return False
    return payload


@st.composite
def enqueue_requests(draw: st.DrawFn) -> tuple[bool | None, pb.EnqueueRequest]:
    valid, payload = draw(PAYLOADS)
    max_attempts, delay_ms = draw(INT64), draw(INT64)
    request = pb.EnqueueRequest(payload=payload, max_attempts=max_attempts, delay_ms=delay_ms)
    return enqueue_valid(valid, max_attempts, delay_ms), request


def assert_refusal(code: Code, details: str) -> None:
    """A refusal: a clear status other than UNKNOWN/INTERNAL, with a short message."""
    assert code not in NEVER, (code, details)
    assert code != Code.OK
    assert details
    assert len(details.encode()) <= MAX_DETAILS


@pytest.fixture
async def any_broker(backend: str, clock: FakeClock, tmp_path: Path) -> AsyncIterator[Broker]:
    """A broker over each store backend (memory, SQLite)."""
    rng = random.Random(13)
    store = await make_store(backend, Backoff(1.0, 30.0, rng), rng, tmp_path)
    async with running_broker(clock=clock, rng=rng, store=store) as b:
        yield b


@pytest.fixture
async def any_channel(any_broker: Broker) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(any_broker.grpc_target) as ch:
        yield ch


@HOSTILE
@given(batch=st.lists(enqueue_requests(), max_size=6), single=st.booleans())
async def test_random_enqueues(
    any_broker: Broker,
    clock: FakeClock,
    any_channel: grpc.aio.Channel,
    caplog: pytest.LogCaptureFixture,
    batch: list[tuple[bool | None, pb.EnqueueRequest]],
    single: bool,
) -> None:
    """Enqueue (the first of the batch) or EnqueueBatch: valid requests are taken whole,
    anything else is refused whole, naming the offending entry."""
    stub = pb_grpc.BrokerStub(any_channel)
    before = (await stub.Stats(pb.StatsRequest())).totals.enqueued
    if single and batch:
        valid: bool | None = batch[0][0]
        code, details, body = await unary(
            any_broker, clock, any_channel, "Enqueue", batch[0][1].SerializeToString()
        )
        n, ids = 1, [pb.EnqueueResponse.FromString(body).id] if code == Code.OK else []
    else:
        verdicts = [v for v, _ in batch]
        valid = False if False in verdicts else (None if None in verdicts else True)
        request = pb.EnqueueBatchRequest(tasks=[r for _, r in batch])
        code, details, body = await unary(
            any_broker, clock, any_channel, "EnqueueBatch", request.SerializeToString()
        )
        n, ids = len(batch), list(pb.EnqueueBatchResponse.FromString(body).ids)
        if request.ByteSize() > 4 * MIB:  # over the broker's receive limit: gRPC refuses it
            assert code == Code.RESOURCE_EXHAUSTED, (code, details)
        elif code != Code.OK:
            assert "tasks[" in details, details  # names the offending entry
    after = (await stub.Stats(pb.StatsRequest())).totals.enqueued
    if code == Code.OK:
        assert valid is not False, batch
        assert len(ids) == n == after - before
        assert all(ids)
    else:
        assert valid is not True, (code, details)
        assert_refusal(code, details)
        assert code in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED)
        assert after == before  # all or nothing
    assert_no_traceback(caplog)
    await assert_healthy(any_channel)


def _verdict(batch: list[tuple[bool | None, pb.EnqueueRequest]]) -> bool | None:
    """A batch is valid if every task is, invalid if any is (None: it depends on the broker)."""
    verdicts = [v for v, _ in batch]
    return False if False in verdicts else (None if None in verdicts else True)


@HOSTILE
@given(
    frames=st.lists(
        st.one_of(
            st.lists(enqueue_requests(), max_size=4).map(lambda b: (b, None)),
            st.binary(max_size=32).map(lambda data: (None, data)),
        ),
        max_size=6,
    )
)
async def test_random_batches_on_one_produce_stream(
    any_broker: Broker,
    any_channel: grpc.aio.Channel,
    caplog: pytest.LogCaptureFixture,
    frames: list[tuple[list[tuple[bool | None, pb.EnqueueRequest]] | None, bytes | None]],
) -> None:
    """Every frame, valid batch, invalid batch or random bytes, all sent before any answer is
    read, gets one answer, in order: its ids, or a refusal with nothing of it enqueued; the
    stream ends OK and only what was answered with ids is in the broker."""
    stub = pb_grpc.BrokerStub(any_channel)
    before = (await stub.Stats(pb.StatsRequest())).totals.enqueued
    sent: list[tuple[list[tuple[bool | None, pb.EnqueueRequest]] | None, bytes]] = []
    for batch, raw_bytes in frames:
        if batch is None:
            assert raw_bytes is not None
            data = raw_bytes
        else:
            data = pb.EnqueueBatchRequest(tasks=[r for _, r in batch]).SerializeToString()
            if len(data) > 3 * MIB:
                continue  # (over the broker's receive limit gRPC ends the call: not this test)
        sent.append((batch, data))
    call = open_raw_call(any_channel, "Produce")
    for _, data in sent:
        await call.write(data)
    await call.done_writing()
    answers = []
    while isinstance(raw := await asyncio.wait_for(call.read(), CALL_TIMEOUT), bytes):
        answers.append(pb.ProduceResponse.FromString(raw))
    assert await call.code() == Code.OK
    assert len(answers) == len(sent)
    taken = 0
    for (batch, data), answer in zip(sent, answers, strict=True):
        event(f"produce answer code {answer.code}")
        if not decodes("Produce", data):
            assert answer.code == Code.INVALID_ARGUMENT.value[0]
            assert UNDECODABLE in answer.message
            continue
        n = len(pb.EnqueueBatchRequest.FromString(data).tasks)
        verdict = None if batch is None else _verdict(batch)  # (random bytes: no model)
        if answer.code == 0:
            assert verdict is not False, batch
            assert len(answer.ids) == len(answer.duplicates) == n
            assert all(answer.ids)
            taken += n
        else:
            assert verdict is not True, answer
            assert not answer.ids
            assert answer.code in (
                Code.INVALID_ARGUMENT.value[0],
                Code.RESOURCE_EXHAUSTED.value[0],
            )
            assert "tasks[" in answer.message, answer.message
            assert_refusal(Code.INVALID_ARGUMENT, answer.message)
    after = (await stub.Stats(pb.StatsRequest())).totals.enqueued
    assert after - before == taken
    assert_no_traceback(caplog)
    await assert_healthy(any_channel)


@st.composite
def settle_ops(draw: st.DrawFn) -> tuple[str, str, int, str, str, str | None]:
    """(ack or nack, what it targets, which held task, an id, a lease id, an error)."""
    kind = draw(st.sampled_from(["ack", "nack"]))
    target = draw(st.sampled_from(["held", "held", "wrong_lease", "unknown", "no_id", "no_lease"]))
    return kind, target, draw(st.integers(0, 2)), draw(IDS), draw(IDS), draw(ERRORS)


def settle_request(
    op: tuple[str, str, int, str, str, str | None], held: list[pb.Delivery]
) -> tuple[str, Message]:
    kind, target, i, some_id, some_lease, error = op
    d = held[i]
    task_id, lease_id = {
        "held": (d.task.id, d.lease_id),
        "wrong_lease": (d.task.id, d.lease_id + "-not"),
        "unknown": (some_id or "x", some_lease or "y"),
        "no_id": ("", some_lease or "y"),
        "no_lease": (some_id or "x", ""),
    }[target]
    if kind == "ack":
        return "Ack", pb.AckRequest(id=task_id, lease_id=lease_id)
    return "Nack", pb.NackRequest(id=task_id, lease_id=lease_id, error=error)


def settle_expected(target: str, finished: bool) -> Code:
    """The status of an ack or nack (the model): ``finished`` if its task was already settled."""
    if target in ("no_id", "no_lease"):
        return Code.INVALID_ARGUMENT
    if target == "unknown" or finished:
        return Code.NOT_FOUND
    return Code.OK if target == "held" else Code.FAILED_PRECONDITION


@HOSTILE
@given(
    ops=st.lists(settle_ops(), max_size=8),
    max_attempts=st.lists(st.integers(1, 3), min_size=3, max_size=3),
)
async def test_random_acks_and_nacks(
    any_broker: Broker,
    clock: FakeClock,
    any_channel: grpc.aio.Channel,
    caplog: pytest.LogCaptureFixture,
    ops: list[tuple[str, str, int, str, str, str | None]],
    max_attempts: list[int],
) -> None:
    """Acks and nacks of held tasks, under wrong leases, of unknown ids, without ids; with
    errors long, empty, unicode or none: each answered as the model says."""
    stub = pb_grpc.BrokerStub(any_channel)
    await stub.EnqueueBatch(
        pb.EnqueueBatchRequest(
            tasks=[pb.EnqueueRequest(payload=b"{}", max_attempts=n) for n in max_attempts]
        )
    )
    held = [(await stub.NextJob(pb.NextJobRequest(wait_ms=0))).delivery for _ in range(3)]
    finished: set[str] = set()
    for op in ops:
        method, request = settle_request(op, held)
        code, details, _ = await unary(
            any_broker, clock, any_channel, method, request.SerializeToString()
        )
        expected = settle_expected(op[1], held[op[2]].task.id in finished)
        error = op[5]
        if expected == Code.OK and method == "Nack" and error and len(error) > 4096:
            # Someone may cap error texts by refusing long ones: then nothing happened.
            if code == Code.INVALID_ARGUMENT and "error" in details:
                expected = code
        assert code == expected, (op, code, details)
        if code != Code.OK:
            assert_refusal(code, details)
        elif op[1] == "held":
            finished.add(held[op[2]].task.id)
    for d in held:
        if d.task.id not in finished:
            await stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id))
    assert_no_traceback(caplog)
    await assert_healthy(any_channel)


@HOSTILE
@given(
    wait_ms=INT64,
    lease_ms=INT64,
    acks=st.lists(st.tuples(IDS, IDS), max_size=4),
    real_at=st.integers(0, 4),
)
async def test_random_next_jobs(
    broker: Broker,
    clock: FakeClock,
    channel: grpc.aio.Channel,
    stub: pb_grpc.BrokerAsyncStub,
    caplog: pytest.LogCaptureFixture,
    wait_ms: int | None,
    lease_ms: int | None,
    acks: list[tuple[str, str]],
    real_at: int,
) -> None:
    """NextJob with any wait and lease, acking anything: refused whole when a number is out of
    range (nothing is acked then), or every ack answered, in order."""
    await stub.Enqueue(pb.EnqueueRequest(payload=b"1"))
    mine = (await stub.NextJob(pb.NextJobRequest(wait_ms=0))).delivery
    requests = [pb.AckRequest(id=i, lease_id=lease) for i, lease in acks]
    requests.insert(
        min(real_at, len(requests)), pb.AckRequest(id=mine.task.id, lease_id=mine.lease_id)
    )
    request = pb.NextJobRequest(wait_ms=wait_ms, lease_ms=lease_ms, acks=requests)
    code, details, body = await unary(
        broker, clock, channel, "NextJob", request.SerializeToString()
    )
    bad = (wait_ms is not None and wait_ms < 0) or (lease_ms is not None and lease_ms < 1)
    if bad:
        assert code == Code.INVALID_ARGUMENT, (code, details)
        assert_refusal(code, details)
        assert ("wait_ms" if wait_ms is not None and wait_ms < 0 else "lease_ms") in details
        await stub.Ack(pb.AckRequest(id=mine.task.id, lease_id=mine.lease_id))
    else:
        assert code == Code.OK, (code, details)
        response = pb.NextJobResponse.FromString(body)
        assert [(s.id, s.lease_id) for s in response.settled] == [
            (r.id, r.lease_id) for r in requests
        ]
        for s, r in zip(response.settled, requests, strict=True):
            assert s.code == (0 if r.id == mine.task.id else s.code)
            assert s.code in (0, 3, 5, 9)
            assert len(s.message.encode()) <= MAX_DETAILS
            assert (s.code == 0) == (not s.message)
        if response.HasField("delivery"):
            d = response.delivery
            await stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id))
    assert_no_traceback(caplog)
    await assert_healthy(channel)


@HOSTILE
@given(
    calls=st.lists(
        st.one_of(
            st.tuples(st.just("Stats"), st.none()),
            st.tuples(st.just("ListDead"), INT64),
            st.tuples(st.just("Requeue"), st.one_of(IDS, st.just("dead"))),
        ),
        max_size=5,
    )
)
async def test_random_admin_calls(
    broker: Broker,
    clock: FakeClock,
    channel: grpc.aio.Channel,
    stub: pb_grpc.BrokerAsyncStub,
    caplog: pytest.LogCaptureFixture,
    calls: list[tuple[str, Any]],
) -> None:
    """Stats, ListDead with any limit, Requeue of anything (a dead task among them)."""
    await ack_all_ready(stub)  # what earlier examples requeued
    await stub.Enqueue(pb.EnqueueRequest(payload=b"1", max_attempts=1))
    d = (await stub.NextJob(pb.NextJobRequest(wait_ms=0))).delivery
    await stub.Nack(pb.NackRequest(id=d.task.id, lease_id=d.lease_id, error="buried"))
    requeued = False
    for method, value in calls:
        request: Message
        if method == "Stats":
            request, expected = pb.StatsRequest(), Code.OK
        elif method == "ListDead":
            request = pb.ListDeadRequest(limit=value)
            expected = Code.INVALID_ARGUMENT if value is not None and value < 0 else Code.OK
        else:
            task_id = d.task.id if value == "dead" else value
            request = pb.RequeueRequest(id=task_id)
            if task_id == d.task.id and not requeued:
                expected, requeued = Code.OK, True
            else:
                expected = Code.INVALID_ARGUMENT if not task_id else Code.NOT_FOUND
        code, details, body = await unary(
            broker, clock, channel, method, request.SerializeToString()
        )
        assert code == expected, (method, value, code, details)
        if code != Code.OK:
            assert_refusal(code, details)
        elif method == "ListDead":
            tasks = pb.ListDeadResponse.FromString(body).tasks
            assert len(tasks) <= (value if value is not None else len(tasks))
    assert_no_traceback(caplog)
    await assert_healthy(channel)


STREAM_ACTIONS = st.one_of(
    st.tuples(st.sampled_from(["ack", "nack", "ack_twice"]), st.integers(0, 9), ERRORS),
    st.tuples(st.just("ack_unknown"), IDS, IDS),
    st.tuples(st.sampled_from(["drain", "open", "enqueue", "nothing"]), st.none(), st.none()),
)


class Session:
    """One StreamJobs call driven by random actions; a reader takes in what comes meanwhile."""

    def __init__(self, stub: pb_grpc.BrokerAsyncStub) -> None:
        self.stub = stub
        self.call = stub.StreamJobs(None)
        self.received: list[pb.Delivery] = []
        self.settled: list[pb.Settled] = []
        self.sent = 0  # acks and nacks sent on the stream
        # After a drain, the broker ends the call (OK) as soon as nothing it sent is unsettled,
        # which may be before the requests that follow reach it.
        self.drained = False
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> tuple[Code, str]:
        try:
            while isinstance(response := await self.call.read(), pb.StreamJobsResponse):
                assert response.ByteSize() <= STREAM_BOUND
                self.settled += response.settled
                self.received += response.deliveries
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        except asyncio.CancelledError:
            return Code.CANCELLED, "cancelled by the client"
        return await self.call.code(), await self.call.details() or ""

    def target(self, i: int) -> pb.Delivery | None:
        return self.received[i % len(self.received)] if self.received else None

    async def act(self, action: tuple[str, Any, Any]) -> bool:
        """Do ``action``; False if it ends the call (a second open)."""
        name, a, b = action
        if name == "open":
            await self.call.write(pb.StreamJobsRequest(open=pb.StreamOpen()))
            return False
        if name == "enqueue":
            await self.stub.Enqueue(pb.EnqueueRequest(payload=b'"more"'))
        elif name == "drain":
            await self.call.write(pb.StreamJobsRequest(drain=True))
            self.drained = True
        elif name == "ack_unknown":
            await self.send(acks=[pb.AckRequest(id=a, lease_id=b)])
        elif name in ("ack", "nack", "ack_twice"):
            d = self.target(a)
            task_id, lease_id = (d.task.id, d.lease_id) if d else ("gone", "gone")
            if name == "nack":
                await self.send(nacks=[pb.NackRequest(id=task_id, lease_id=lease_id, error=b)])
            else:
                ack = pb.AckRequest(id=task_id, lease_id=lease_id)
                await self.send(acks=[ack] * (2 if name == "ack_twice" else 1))
        return True

    async def run(self, actions: list[tuple[str, Any, Any]], end: str) -> Code:
        """Do the actions, then ``end`` the call (unless an action ended it); how it must end."""
        try:
            for action in actions:
                if not await self.act(action):
                    return Code.INVALID_ARGUMENT
            if end == "cancel":
                self.call.cancel()
                return Code.CANCELLED
            if end == "drain_and_half_close":
                await self.call.write(pb.StreamJobsRequest(drain=True))
            await self.call.done_writing()
        except asyncio.InvalidStateError:
            # Drained with nothing unsettled, the broker ends the call OK as soon as it can:
            # a write after the drain may find it over.
            if not self.drained:
                raise
        return Code.OK

    async def send(
        self, acks: Sequence[pb.AckRequest] = (), nacks: Sequence[pb.NackRequest] = ()
    ) -> None:
        await self.call.write(pb.StreamJobsRequest(acks=acks, nacks=nacks))
        self.sent += len(acks) + len(nacks)


@HOSTILE
@given(
    prefetch=INT64,
    lease_ms=INT64,
    actions=st.lists(STREAM_ACTIONS, max_size=8),
    end=st.sampled_from(["half_close", "cancel", "drain_and_half_close"]),
)
async def test_random_stream_sessions(
    broker: Broker,
    stub: pb_grpc.BrokerAsyncStub,
    channel: grpc.aio.Channel,
    caplog: pytest.LogCaptureFixture,
    prefetch: int | None,
    lease_ms: int | None,
    actions: list[tuple[str, Any, Any]],
    end: str,
) -> None:
    """Open with any settings, then ack, nack, ack twice, ack unknown ids, drain, open again,
    enqueue, and end by half-closing (after a drain or not) or cancelling, at any point. The call
    ends as it should; every outcome sent is answered; nothing stays handed out."""
    await stub.Enqueue(pb.EnqueueRequest(payload=b'"for the stream"'))
    session = Session(stub)
    await session.call.write(
        pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=prefetch, lease_ms=lease_ms))
    )
    bad_open = (prefetch is not None and prefetch < 1) or (lease_ms is not None and lease_ms < 1)
    expected = Code.INVALID_ARGUMENT if bad_open else await session.run(actions, end)
    code, details = await asyncio.wait_for(session.reader, CALL_TIMEOUT)
    if session.drained and expected == Code.INVALID_ARGUMENT and code == Code.OK:
        expected = Code.OK  # drained and done before the second open came
    assert code == expected, (code, details)
    event(f"ended {code.name}, {len(session.received)} received, {session.sent} sent")
    if code == Code.INVALID_ARGUMENT:
        assert_refusal(code, details)
        assert "open" in details or "prefetch" in details or "lease_ms" in details
    if code == Code.OK and not session.drained:
        assert len(session.settled) == session.sent
    if code == Code.OK:  # (drained: what came after the end was not read)
        assert len(session.settled) <= session.sent
    await wait_until(
        lambda: stub.Stats(pb.StatsRequest()),
        lambda s: s.handed_out == 0,
        what="the stream's unfinished tasks to be reclaimed",
    )
    await wait_until(lambda: broker.service.waiting == 0, what="the stream to be gone")
    assert_no_traceback(caplog)
    await assert_healthy(channel)


# -- what the service bounds: error texts, quoted ids --------------------------------------------


async def test_the_service_caps_error_texts(
    stub: pb_grpc.BrokerAsyncStub, channel: grpc.aio.Channel
) -> None:
    await stub.Enqueue(pb.EnqueueRequest(payload=b"1", max_attempts=1))
    d = (await stub.NextJob(pb.NextJobRequest(wait_ms=0))).delivery
    error = "e" * MIB
    code, details, _ = await raw_unary(
        channel,
        "Nack",
        pb.NackRequest(id=d.task.id, lease_id=d.lease_id, error=error).SerializeToString(),
    )
    if code == Code.OK:
        (dead,) = (await stub.ListDead(pb.ListDeadRequest())).tasks
        assert len(dead.last_error) < len(error)
    else:  # refused, naming the field: a cap too
        assert (code, "error" in details) == (Code.INVALID_ARGUMENT, True)
    await assert_healthy(channel)


@pytest.mark.parametrize("method", ["Ack", "Nack", "Requeue"])
async def test_service_messages_quote_long_ids_briefly(
    stub: pb_grpc.BrokerAsyncStub, method: str
) -> None:
    long_id = "x" * 65536
    request: Message
    if method == "Requeue":
        request = pb.RequeueRequest(id=long_id)
    else:
        request = REQUEST[method](id=long_id, lease_id=long_id)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await getattr(stub, method)(request, timeout=CALL_TIMEOUT)
    assert info.value.code() == Code.NOT_FOUND
    assert not (info.value.details() or "").endswith(TRUNCATED)


# -- a worker that stops reading -----------------------------------------------------------------


class _Unread:
    """A StreamJobs call's context whose worker stopped reading: the answer to open goes out,
    then every write waits, as gRPC's flow control makes it wait."""

    def __init__(self) -> None:
        self.writes = 0
        self.stuck = False

    async def write(self, response: pb.StreamJobsResponse) -> None:
        self.writes += 1
        if self.writes > 1:
            self.stuck = True
            await asyncio.Event().wait()

    def done(self) -> bool:
        return False


async def test_a_worker_that_stops_reading_cannot_make_the_broker_hoard_outcomes(
    clock: FakeClock,
) -> None:
    """A worker that keeps sending acks (10,000 a request) but reads nothing: the broker stops
    reading its requests once a bound of outcomes waits to be written (gRPC's flow control then
    holds the worker back), rather than settling everything and keeping every outcome."""
    rng = random.Random(5)
    service = Service(MemoryStore(Backoff(1.0, 30.0, rng), rng), clock)
    await service.start()
    stream = await service.open_stream(1, None)
    context = _Unread()
    read = 0

    async def requests() -> AsyncIterator[pb.StreamJobsRequest]:
        nonlocal read
        for i in range(20):
            read += 1
            acks = [pb.AckRequest(id=f"{i}-{j}", lease_id="x") for j in range(MAX_BATCH)]
            yield pb.StreamJobsRequest(acks=acks)

    first = pb.StreamJobsRequest(open=pb.StreamOpen())
    call = asyncio.create_task(_StreamCall(service, stream, context).run(first, requests()))  # type: ignore[arg-type]
    await wait_until(lambda: context.stuck, what="the writer to wait for the worker")
    await settle(50)
    assert read <= 3, f"{read} requests of 10,000 acks read while the worker read nothing"
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await service.close()
