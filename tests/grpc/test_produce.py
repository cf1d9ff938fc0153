"""Produce, the producing stream (an extension): batches enqueued all or none as EnqueueBatch
enqueues them, answered in order, a refused batch answered with its status while the stream goes
on; how it ends (half-close, shutdown, a token withdrawn); and wqclient's use of it: every batch
(its own, or the one-task enqueues of concurrent callers) over one stream, EnqueueBatch for a
broker without Produce, and exactly what a caller is told when the stream ends or stalls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

import wqclient._grpc
from tests.authkit import ONLY, ROOT, metadata, rewrite, write_token_file
from tests.helpers import running_broker, wait_until
from wqbroker.broker import Broker
from wqbroker.config import Config
from wqbroker.grpc.decoding import guarded, handler_table
from wqbroker.grpc.server import SERVICE_NAME, BrokerServicer, abort
from wqclient import AsyncClient, Client, Enqueued, InvalidArgument, Overloaded, Unavailable
from wqclient._grpc import _PRODUCE_STREAMS, GrpcTransport
from wqclient.models import EnqueueItem
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

Code = grpc.StatusCode
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # not in grpc-stubs
WAIT = 5.0


def batch(*payloads: bytes) -> pb.EnqueueBatchRequest:
    return pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=p) for p in payloads])


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async with running_broker(max_tasks=0) as b:
        yield b


async def read(call: Any) -> Any:
    return await asyncio.wait_for(call.read(), WAIT)


async def ready_payloads(stub: pb_grpc.BrokerAsyncStub) -> list[bytes]:
    """The ready tasks' payloads, in the order they are handed out (each acked)."""
    out = []
    while (got := await stub.NextJob(pb.NextJobRequest(wait_ms=0))).HasField("delivery"):
        out.append(got.delivery.task.payload)
        await stub.Ack(pb.AckRequest(id=got.delivery.task.id, lease_id=got.delivery.lease_id))
    return out


def held_enqueues(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> tuple[asyncio.Event, list[int]]:
    """The broker's store holds every enqueue until the event is set; the list has the size of
    each batch that came in meanwhile."""
    store: Any = broker.service._store
    enqueue_many, gate, inside = store.enqueue_many, asyncio.Event(), list[int]()

    async def held(items: Any, *, now: float) -> Any:
        inside.append(len(items))
        await gate.wait()
        return await enqueue_many(items, now=now)

    monkeypatch.setattr(store, "enqueue_many", held)
    return gate, inside


# -- the broker ---------------------------------------------------------------------------------


async def test_batches_sent_ahead_are_answered_in_order_and_enqueued_in_that_order(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub
) -> None:
    call: Any = stub.Produce(None)
    sent = [[f"{b}.{i}".encode() for i in range(b + 1)] for b in range(6)]
    for payloads in sent:  # all written before any answer is read
        await call.write(batch(*payloads))
    answers = [await read(call) for _ in sent]
    await call.done_writing()
    assert await read(call) is EOF
    assert await call.code() == Code.OK
    for payloads, answer in zip(sent, answers, strict=True):
        assert answer.code == 0
        assert answer.message == ""
        assert len(answer.ids) == len(payloads)
        assert list(answer.duplicates) == [False] * len(payloads)
        for task_id, payload in zip(answer.ids, payloads, strict=True):
            got = await stub.GetTask(pb.GetTaskRequest(id=task_id))
            assert got.task.payload == payload
    assert await ready_payloads(stub) == [p for payloads in sent for p in payloads]


async def test_batches_sent_ahead_are_enqueued_side_by_side_and_answered_in_order(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a distant database a batch would otherwise wait for the round trips of every batch
    # before it on its stream: the broker enqueues the batches it has read at once.
    gate, inside = held_enqueues(broker, monkeypatch)
    call: Any = stub.Produce(None)
    for k in range(3):
        await call.write(batch(*[f"{k}.{i}".encode() for i in range(k + 1)]))
    await wait_until(lambda: len(inside) == 3, what="three batches enqueued at once")
    assert inside == [1, 2, 3]
    gate.set()
    answers = [await read(call) for _ in range(3)]
    assert [len(a.ids) for a in answers] == [1, 2, 3]
    await call.done_writing()
    assert await read(call) is EOF
    assert await call.code() == Code.OK
    assert await ready_payloads(stub) == [
        f"{k}.{i}".encode() for k in range(3) for i in range(k + 1)
    ]


async def test_a_broker_stopping_answers_every_batch_it_was_enqueueing_then_ends_ok(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with running_broker(max_tasks=0) as broker:
        gate, inside = held_enqueues(broker, monkeypatch)
        async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
            call: Any = pb_grpc.BrokerStub(channel).Produce(None)
            for k in range(3):
                await call.write(batch(*[b"1"] * (k + 1)))
            await wait_until(lambda: len(inside) == 3, what="three batches enqueued at once")
            stopping = asyncio.ensure_future(broker.stop())
            await asyncio.sleep(0.1)  # (the stop under way, waiting for the stream)
            gate.set()
            answers = [await read(call) for _ in range(3)]
            assert [(a.code, len(a.ids)) for a in answers] == [(0, 1), (0, 2), (0, 3)]
            assert await read(call) is EOF
            assert await call.code() == Code.OK
            await stopping


async def test_a_refused_batch_is_answered_with_its_status_and_the_stream_goes_on(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub
) -> None:
    call: Any = stub.Produce(None)
    await call.write(batch(b"1"))
    await call.write(batch(b"2", b"{not json", b"3"))  # all or none: none
    await call.write(pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"4", priority=99)]))
    await call.write(batch(b"5"))
    first, bad_json, bad_priority, last = [await read(call) for _ in range(4)]
    await call.done_writing()
    assert await read(call) is EOF
    assert first.code == last.code == 0
    assert bad_json.code == Code.INVALID_ARGUMENT.value[0]
    assert bad_json.message.startswith("tasks[1].payload")
    assert not bad_json.ids
    assert bad_json.retry_after_ms == 0
    assert bad_priority.code == Code.INVALID_ARGUMENT.value[0]
    assert "tasks[0].priority" in bad_priority.message
    # The same batch through EnqueueBatch ends with the same status and message.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.EnqueueBatch(batch(b"2", b"{not json", b"3"))
    assert (e.value.code(), e.value.details()) == (Code.INVALID_ARGUMENT, bad_json.message)
    assert await ready_payloads(stub) == [b"1", b"5"]


async def test_a_full_broker_answers_resource_exhausted_with_when_to_retry() -> None:
    async with (
        running_broker(max_tasks=3) as broker,
        grpc.aio.insecure_channel(broker.grpc_target) as channel,
    ):
        call: Any = pb_grpc.BrokerStub(channel).Produce(None)
        await call.write(batch(b"1", b"2", b"3", b"4"))
        await call.write(batch(b"1", b"2"))
        full, fits = await read(call), await read(call)
        assert full.code == Code.RESOURCE_EXHAUSTED.value[0]
        assert "at most 3" in full.message
        assert full.retry_after_ms > 0
        assert fits.code == 0
        assert len(fits.ids) == 2
        call.cancel()


async def test_half_closing_gets_every_batch_answered_then_ok(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    call: Any = stub.Produce(None)
    for i in range(20):
        await call.write(batch(str(i).encode()))
    await call.done_writing()
    answers = [await read(call) for _ in range(20)]
    assert await read(call) is EOF
    assert await call.code() == Code.OK
    assert all(a.code == 0 and len(a.ids) == 1 for a in answers)
    assert len({a.ids[0] for a in answers}) == 20


async def test_a_stream_that_sends_nothing_and_half_closes_ends_ok(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    call: Any = stub.Produce(None)
    await call.done_writing()
    assert await read(call) is EOF
    assert await call.code() == Code.OK


async def test_a_producer_gone_mid_stream_leaves_the_broker_whole(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub
) -> None:
    for _ in range(10):
        call: Any = stub.Produce(None)
        await call.write(batch(b"1", b"2"))
        await read(call)
        await call.write(batch(b"3"))
        call.cancel()  # an answer unread, perhaps a batch unread
    s = await stub.Stats(pb.StatsRequest())
    assert s.totals.enqueued in range(20, 31)
    assert s.ready == s.totals.enqueued
    assert len(await ready_payloads(stub)) == s.totals.enqueued


async def test_a_producer_that_writes_and_never_reads_then_goes_leaves_no_trace(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub, caplog: pytest.LogCaptureFixture
) -> None:
    for wait in (0.0, 0.001, 0.005, 0.02) * 3:
        call: Any = stub.Produce(None)
        for _ in range(1000):  # no answer read, and the call cancelled while the broker answers
            await call.write(batch(b"1"))
        await asyncio.sleep(wait)
        call.cancel()
    await wait_until(
        lambda: stub.Stats(pb.StatsRequest()),
        lambda s: s.totals.enqueued == s.ready,
        what="the broker to settle down",
    )
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    assert (await stub.Enqueue(pb.EnqueueRequest(payload=b"1"))).id  # still serving


async def test_shutting_down_ends_an_idle_stream_ok_at_once() -> None:
    async with running_broker() as broker, grpc.aio.insecure_channel(broker.grpc_target) as ch:
        stub = pb_grpc.BrokerStub(ch)
        call: Any = stub.Produce(None)
        await call.write(batch(b"1"))
        assert (await read(call)).code == 0
        started = time.monotonic()
        stopping = asyncio.create_task(broker.stop())
        assert await read(call) is EOF
        assert await call.code() == Code.OK
        await stopping
        assert time.monotonic() - started < 1.5  # not held for the server's 2 s of grace


async def test_a_batch_sent_while_the_broker_shuts_down_is_not_taken(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub
) -> None:
    await broker.service.close()  # (as Broker.stop does first)
    call: Any = stub.Produce(None)
    await call.write(batch(b"1"))
    assert await read(call) is EOF  # ended OK, the batch unanswered: not enqueued
    assert await call.code() == Code.OK
    assert (await stub.Stats(pb.StatsRequest())).totals.enqueued == 0
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        # Sent on two streams, taken on neither: then in an EnqueueBatch call, which this broker
        # still answers (its server has not begun to stop), so the tasks are enqueued once.
        ids = await wq.enqueue_many([1, 2])
        assert [(await wq.get_task(i)).payload for i in ids] == [1, 2]
    assert (await stub.Stats(pb.StatsRequest())).totals.enqueued == 2


async def test_a_token_withdrawn_ends_the_stream_at_its_next_batch(tmp_path: Path) -> None:
    token_file = write_token_file(tmp_path)
    async with (
        running_broker(token_file=str(token_file)) as broker,
        grpc.aio.insecure_channel(broker.grpc_target) as channel,
    ):
        stub = pb_grpc.BrokerStub(channel)
        call: Any = stub.Produce(None, metadata=metadata(ONLY["produce"]))
        await call.write(batch(b"1"))
        assert (await read(call)).code == 0
        rewrite(token_file, f"{ROOT} produce, consume, admin\n")
        assert broker.tokens is not None
        assert broker.tokens.reload()
        await call.write(batch(b"2"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await read(call)
        assert e.value.code() == Code.UNAUTHENTICATED
        s = await stub.Stats(pb.StatsRequest(), metadata=metadata(ROOT))
        assert s.totals.enqueued == 1  # the batch after the reload was not taken


async def test_a_consumer_token_cannot_produce(tmp_path: Path) -> None:
    async with (
        running_broker(token_file=str(write_token_file(tmp_path))) as broker,
        grpc.aio.insecure_channel(broker.grpc_target) as channel,
    ):
        call: Any = pb_grpc.BrokerStub(channel).Produce(None, metadata=metadata(ONLY["consume"]))
        await call.write(batch(b"1"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await read(call)
        assert e.value.code() == Code.PERMISSION_DENIED
        assert "produce" in (e.value.details() or "")


# -- wqclient -----------------------------------------------------------------------------------


def streams_opened(client: AsyncClient) -> list[int]:
    """A counter (one element) of the Produce calls the client opens."""
    transport = client.transport
    assert isinstance(transport, GrpcTransport)
    stub: Any = transport._stub
    opened = [0]
    produce = stub.Produce

    def counting(*args: Any, **kwargs: Any) -> Any:
        opened[0] += 1
        return produce(*args, **kwargs)

    stub.Produce = counting
    return opened


async def test_the_client_sends_its_batches_round_a_few_streams(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        opened = streams_opened(wq)
        ids = await wq.enqueue_many([{"b": 0, "i": i} for i in range(50)])
        more = await asyncio.gather(*(wq.enqueue({"one": i}) for i in range(40)))
        for k in range(10):
            ids += await wq.enqueue_many([{"b": k + 1}])
        assert len(set(ids + more)) == 50 + 40 + 10
        assert opened == [4]  # 12 batches, round four streams
        assert (await wq.get_task(more[7])).payload == {"one": 7}
        assert (await wq.stats()).ready == 100


async def test_a_client_given_two_brokers_produces_to_both_and_outlives_one() -> None:
    async with running_broker() as a, running_broker() as b:
        async with AsyncClient(f"grpc://{a.grpc_target},{b.grpc_target}") as wq:
            for i in range(40):
                await wq.enqueue({"i": i})
            got = [(await x.service.stats()).totals.enqueued for x in (a, b)]
            assert sum(got) == 40
            assert min(got) >= 10, got  # both served, as calls are (round robin)
            await a.stop()
            for i in range(10):  # the streams to the one gone end: the other takes every batch
                await wq.enqueue({"after": i})
            assert (await b.service.stats()).totals.enqueued == got[1] + 10


async def test_a_producing_stream_is_replaced_once_it_is_old(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wqclient._grpc, "_PRODUCE_STREAMS", 1)
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        transport = wq.transport
        assert isinstance(transport, GrpcTransport)
        opened = streams_opened(wq)
        await wq.enqueue(1)
        await wq.enqueue(2)
        assert opened == [1]  # young: used again
        first = asyncio.create_task(wq.enqueue_many([3, 4]))
        await asyncio.sleep(0)  # (a turn of the loop: its batch is on the old stream)
        old = transport._producers[0]
        assert old is not None
        old.born -= wqclient._grpc._PRODUCE_STREAM_AGE  # it has grown old (no clock waited on)
        later = [asyncio.create_task(wq.enqueue_many([5, 6])) for _ in range(2)]
        assert len(await first) == 2  # the old stream answers what it was sent, then ends
        assert [len(ids) for ids in await asyncio.gather(*later)] == [2, 2]
        assert opened == [2]
        assert old.over
        assert (await wq.stats()).totals.enqueued == 8


async def test_the_blocking_client_produces_over_the_stream_too(broker: Broker) -> None:
    def produce() -> tuple[list[Enqueued], int]:
        with Client("grpc://" + broker.grpc_target) as wq:
            ids = wq.enqueue_many([{"i": i} for i in range(30)])
            return ids, wq.stats().ready

    ids, ready = await asyncio.to_thread(produce)
    assert len(set(ids)) == 30
    assert ready == 30


async def test_a_batch_too_large_for_the_stream_goes_in_a_call_of_its_own() -> None:
    async with (
        running_broker(max_tasks=0, max_body=2 * 1024 * 1024) as broker,
        AsyncClient("grpc://" + broker.grpc_target) as wq,
    ):
        opened = streams_opened(wq)
        big = ["x" * (512 * 1024)] * 7  # 3.5 MiB in all: over the stream's 3 MiB
        ids = await wq.enqueue_many(big)
        assert len(ids) == 7
        assert opened == [0]
        assert (await wq.stats()).ready == 7


@asynccontextmanager
async def grpc_server(
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]],
) -> AsyncIterator[str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"grpc://127.0.0.1:{port}"
    finally:
        await server.stop(None)


@asynccontextmanager
async def broker_without_produce(broker: Broker) -> AsyncIterator[str]:
    """The broker's own gRPC methods, but for Produce (as an older broker serves them)."""
    table = guarded(
        handler_table(pb_grpc.add_BrokerServicer_to_server, BrokerServicer(broker.service)),
        pb.DESCRIPTOR.services_by_name["Broker"],
        abort,
    )
    del table["Produce"]
    async with grpc_server(table) as url:
        yield url


async def test_a_broker_without_produce_gets_enqueue_batch_calls(broker: Broker) -> None:
    async with broker_without_produce(broker) as url, AsyncClient(url) as wq:
        opened = streams_opened(wq)
        first = await asyncio.gather(*(wq.enqueue({"i": i}) for i in range(10)))
        # (Tried once, or once per batch in flight at the time, up to one per producing stream:
        # under load the ten may go in two batches at once, before the first refusal is back.)
        tried = opened[0]
        assert 1 <= tried <= _PRODUCE_STREAMS
        second = await wq.enqueue_many([{"j": j} for j in range(10)])
        third = await asyncio.gather(*(wq.enqueue({"k": k}) for k in range(10)))
        assert len(set(first + second + third)) == 30
        assert opened == [tried]  # then never again
        assert (await wq.stats()).ready == 30
        assert (await wq.stats()).totals.enqueued == 30  # none twice


Behaviour = Callable[[AsyncIterator[bytes], Any], Awaitable[None]]


@asynccontextmanager
async def fake_produce(behaviour: Behaviour) -> AsyncIterator[str]:
    """A server whose Produce (bytes in, bytes out) is ``behaviour``."""
    handler = grpc.stream_stream_rpc_method_handler(behaviour)
    async with grpc_server({"Produce": handler}) as url:
        yield url


def answer(n: int) -> bytes:
    return pb.ProduceResponse(ids=[f"id{i}" for i in range(n)]).SerializeToString()


def tasks_in(data: bytes) -> int:
    return len(pb.EnqueueBatchRequest.FromString(data).tasks)


def items(n: int) -> list[EnqueueItem]:
    return [EnqueueItem(b"1", None, None) for _ in range(n)]


async def test_a_batch_the_broker_did_not_read_before_ending_ok_is_sent_again() -> None:
    # Every other stream ends OK at once, unread (a broker shutting down between batches). The
    # client's batch races that end: its write may go out before it (unread: the stream ends OK)
    # or fail after it (grpc.aio then reports INTERNAL, not OK); either way nothing was taken,
    # and the batch is sent again on a new stream. Many clients, so both orders come up.
    calls = 0

    async def produce(requests: AsyncIterator[bytes], context: Any) -> None:
        nonlocal calls
        calls += 1
        if calls % 2 == 1:
            return
        async for request in requests:
            await context.write(answer(tasks_in(request)))

    async with fake_produce(produce) as url:
        for _ in range(30):
            async with AsyncClient(url) as wq:
                assert await wq.enqueue_many([1, 2, 3]) == ["id0", "id1", "id2"]
    assert calls == 60


async def test_a_batch_left_unread_by_two_streams_goes_in_an_enqueue_batch_call() -> None:
    got: list[int] = []

    async def produce(requests: AsyncIterator[bytes], context: Any) -> None:
        return

    async def enqueue_batch(request: bytes, context: Any) -> bytes:
        got.append(tasks_in(request))
        return pb.EnqueueBatchResponse(ids=["a", "b"]).SerializeToString()

    handlers = {
        "Produce": grpc.stream_stream_rpc_method_handler(produce),
        "EnqueueBatch": grpc.unary_unary_rpc_method_handler(enqueue_batch),
    }
    async with grpc_server(handlers) as url, AsyncClient(url) as wq:
        assert await wq.enqueue_many([1, 2]) == ["a", "b"]
    assert got == [2]


async def test_a_stream_broken_with_batches_unanswered_fails_them_as_unavailable() -> None:
    got: list[int] = []

    async def produce(requests: AsyncIterator[bytes], context: Any) -> None:
        async for request in requests:
            got.append(tasks_in(request))
            if len(got) == 2:
                await context.abort(Code.INTERNAL, "boom")  # the second batch: in doubt
            await context.write(answer(tasks_in(request)))

    async with fake_produce(produce) as url, AsyncClient(url) as wq:
        transport = wq.transport
        assert isinstance(transport, GrpcTransport)
        assert len(await transport.enqueue_many(items(2))) == 2
        with pytest.raises(Unavailable, match="the producing stream broke: boom") as e:
            await transport.enqueue_many(items(3))
        assert not isinstance(e.value, Overloaded)
        # The next batch opens a new stream.
        got.clear()
        assert len(await transport.enqueue_many(items(4))) == 4


async def test_a_stream_that_stalls_times_out_and_the_next_batch_opens_another() -> None:
    streams = 0

    async def produce(requests: AsyncIterator[bytes], context: Any) -> None:
        nonlocal streams
        streams += 1
        async for request in requests:
            if streams == 1:
                await asyncio.sleep(60)  # never answers
            await context.write(answer(tasks_in(request)))

    async with fake_produce(produce) as url, AsyncClient(url, timeout=0.5) as wq:
        started = time.monotonic()
        with pytest.raises(Unavailable, match=r"no answer to a batch in 0\.5 s"):
            await wq.enqueue_many([1, 2])
        assert time.monotonic() - started < 3
        assert await wq.enqueue_many([1, 2]) == ["id0", "id1"]
        assert streams == 2


async def test_refusals_over_the_stream_are_the_errors_enqueue_batch_raises() -> None:
    refusals = [
        pb.ProduceResponse(code=Code.INVALID_ARGUMENT.value[0], message="tasks[1].payload bad"),
        pb.ProduceResponse(
            code=Code.RESOURCE_EXHAUSTED.value[0], message="full", retry_after_ms=1500
        ),
        pb.ProduceResponse(code=Code.RESOURCE_EXHAUSTED.value[0], message="too large"),
        pb.ProduceResponse(code=Code.UNAVAILABLE.value[0], message="store down"),
    ]

    answered = 0  # (over every stream: the client's batches go round several)

    async def produce(requests: AsyncIterator[bytes], context: Any) -> None:
        nonlocal answered
        async for _ in requests:
            answered += 1
            await context.write(refusals[answered - 1].SerializeToString())

    async with fake_produce(produce) as url, AsyncClient(url) as wq:
        transport = wq.transport
        assert isinstance(transport, GrpcTransport)
        with pytest.raises(InvalidArgument, match=r"tasks\[1\]\.payload bad"):
            await transport.enqueue_many(items(2))
        with pytest.raises(Overloaded) as full:
            await transport.enqueue_many(items(2))
        assert full.value.retry_after == 1.5
        with pytest.raises(InvalidArgument, match="too large") as large:  # PayloadTooLarge
            await transport.enqueue_many(items(2))
        assert type(large.value).__name__ == "PayloadTooLarge"
        with pytest.raises(Unavailable, match="store down"):
            await transport.enqueue_many(items(2))


def echo(data: bytes) -> bytes:
    """An answer whose ids are the batch's payloads."""
    tasks = pb.EnqueueBatchRequest.FromString(data).tasks
    return pb.ProduceResponse(ids=[t.payload.decode() for t in tasks]).SerializeToString()


async def test_a_caller_gone_before_its_answer_leaves_the_others_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wqclient._grpc, "_PRODUCE_STREAMS", 1)  # every batch on the one stream
    first_read = asyncio.Event()
    go_on = asyncio.Event()

    async def produce(requests: AsyncIterator[bytes], context: Any) -> None:
        async for request in requests:
            if not first_read.is_set():
                first_read.set()
                await go_on.wait()
            await context.write(echo(request))

    async with fake_produce(produce) as url, AsyncClient(url) as wq:
        transport = wq.transport
        assert isinstance(transport, GrpcTransport)

        def batch_of(*ids: str) -> list[EnqueueItem]:
            return [EnqueueItem(i.encode(), None, None) for i in ids]

        gone = asyncio.create_task(transport.enqueue_many(batch_of("1", "2")))
        await asyncio.wait_for(first_read.wait(), WAIT)
        behind = [
            asyncio.create_task(transport.enqueue_many(batch_of(f"{k}a", f"{k}b")))
            for k in range(3, 6)
        ]
        producer = transport._producers[0]
        assert producer is not None
        await wait_until(
            lambda: len(producer._waiting) == 4, what="the three behind the first to be written"
        )
        gone.cancel()
        go_on.set()
        for k, task in zip(range(3, 6), behind, strict=True):
            assert await asyncio.wait_for(task, WAIT) == [f"{k}a", f"{k}b"]
        assert await transport.enqueue_many(batch_of("9")) == ["9"]
        with pytest.raises(asyncio.CancelledError):
            await gone


async def test_closing_the_client_fails_its_unanswered_batches_and_ends_the_stream() -> None:
    read_one = asyncio.Event()
    ended = asyncio.Event()

    async def produce(requests: AsyncIterator[bytes], context: Any) -> None:
        try:
            async for _ in requests:
                read_one.set()
                await asyncio.sleep(60)
        finally:
            ended.set()

    async with fake_produce(produce) as url:
        wq = AsyncClient(url)
        pending = asyncio.create_task(wq.enqueue_many([1]))
        await asyncio.wait_for(read_one.wait(), WAIT)
        await wq.close()
        with pytest.raises(Unavailable):
            await pending
        await asyncio.wait_for(ended.wait(), WAIT)


@asynccontextmanager
async def sqlite_broker(db: Path, grpc_addr: str = "127.0.0.1:0") -> AsyncIterator[Broker]:
    broker = Broker(Config(addr="127.0.0.1:0", grpc_addr=grpc_addr, store=f"sqlite:{db}"))
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop()


async def test_producers_through_a_broker_restart_lose_nothing_they_were_told_was_enqueued(
    tmp_path: Path,
) -> None:
    db = tmp_path / "wq.db"
    async with sqlite_broker(db) as first:
        target = first.grpc_target
        wq = AsyncClient("grpc://" + target)
        told = set(await asyncio.gather(*(wq.enqueue({"i": i}) for i in range(50))))
    # The broker is gone, and the client's stream with it. A new one on the same port takes over.
    port = int(target.rpartition(":")[2])
    async with sqlite_broker(db, f"127.0.0.1:{port}") as second:

        async def enqueued() -> str | None:
            try:
                return await wq.enqueue({"after": 1})
            except Unavailable:
                return None

        after = await wait_until(enqueued, what="the client to reach the new broker")
        assert after is not None
        stats = await second.service.stats()
        assert stats.ready >= len(told) + 1
        for task_id in [*told, after]:
            assert (await wq.get_task(task_id)).id == task_id
        await wq.close()


class _Context:
    """A servicer context whose write fails as grpc.aio's does once the call is over."""

    def __init__(self, done: bool) -> None:
        self._done = done

    async def write(self, message: object) -> None:
        raise RuntimeError("Failed execute_batch")  # (grpc.aio raises its ExecuteBatchError)

    def done(self) -> bool:
        return self._done


async def test_a_write_on_a_call_that_is_over_ends_the_servicer_quietly() -> None:
    from wqbroker.grpc.server import _written

    assert await _written(_Context(done=True), pb.ProduceResponse()) is False  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):  # a call still on: the failure is a real one
        await _written(_Context(done=False), pb.ProduceResponse())  # type: ignore[arg-type]
