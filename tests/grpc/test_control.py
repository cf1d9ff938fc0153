"""Control over every task (docs/design/control.md) over gRPC, against a real broker on port 0:
CancelTask, ListTasks, EmptyQueue, DeleteQueue, the new EnqueueRequest fields (Enqueue,
EnqueueBatch, Produce) and Task fields (10-13), ExtendLease's progress, the refusal of a cancelled
task's extension (``wq-cancelled`` trailing metadata; ``Settled.cancelled`` on a stream), and the
``cancels`` a stream sends its worker (never before the delivery they are about). A client that
sends none of it sees nothing new.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from tests.helpers import wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqbroker.errors import Conflict
from wqbroker.grpc.server import CODES, code_for
from wqwire.defaults import CANCELLED_KEY
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

Code = grpc.StatusCode
StreamCall = grpc.aio.StreamStreamCall[pb.StreamJobsRequest, pb.StreamJobsResponse]
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # not in grpc-stubs


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def trailing(error: grpc.aio.AioRpcError) -> dict[str, str]:
    """A refusal's trailing metadata, by key."""
    metadata: Any = error.trailing_metadata()  # a grpc.aio.Metadata (the stubs say otherwise)
    return {str(key): str(value) for key, value in (metadata or ())}


async def enqueue(stub: pb_grpc.BrokerAsyncStub, payload: bytes = b"1", **fields: Any) -> str:
    return (await stub.Enqueue(pb.EnqueueRequest(payload=payload, **fields))).id


async def held(stub: pb_grpc.BrokerAsyncStub, queue: str = "", **fields: Any) -> pb.Delivery:
    task_id = await enqueue(stub, queue=queue, **fields)
    response = await stub.NextJob(pb.NextJobRequest(wait_ms=0, queues=[queue] if queue else []))
    assert response.HasField("delivery")
    assert response.delivery.task.id == task_id
    return response.delivery


async def dead(stub: pb_grpc.BrokerAsyncStub, queue: str = "") -> str:
    d = await held(stub, queue, max_attempts=1)
    await stub.Nack(pb.NackRequest(id=d.task.id, lease_id=d.lease_id, error="no"))
    return d.task.id


async def totals(stub: pb_grpc.BrokerAsyncStub, queue: str = "") -> pb.Totals:
    return (await stub.Stats(pb.StatsRequest(queue=queue))).totals


async def read(call: StreamCall, timeout: float = 5.0) -> pb.StreamJobsResponse:
    response = await asyncio.wait_for(call.read(), timeout)
    assert isinstance(response, pb.StreamJobsResponse), "the stream ended"
    return response


async def open_stream(stub: pb_grpc.BrokerAsyncStub, prefetch: int = 4) -> StreamCall:
    call = stub.StreamJobs(None)
    await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=prefetch)))
    assert await read(call) == pb.StreamJobsResponse()  # open accepted
    return call


# The fields a task has set when none of the new options was given (attempts is 0 until it is
# handed out, which protobuf does not send).
PLAIN_FIELDS = {
    "id",
    "payload",
    "max_attempts",
    "created_at",
    "available_at",
    "queue",
}


def fields_set(message: Any) -> set[str]:
    return {f.name for f, _ in message.ListFields()}


def test_conflict_maps_as_documented() -> None:
    assert code_for(Conflict("holds 1 ready task")) == Code.FAILED_PRECONDITION
    assert CODES[Conflict] == Code.FAILED_PRECONDITION


# -- CancelTask ---------------------------------------------------------------------------------


async def test_cancel_answers_what_it_did(stub: pb_grpc.BrokerAsyncStub) -> None:
    ready = await enqueue(stub)
    assert (await stub.CancelTask(pb.CancelTaskRequest(id=ready))).state == "cancelled"
    d = await held(stub)
    assert (await stub.CancelTask(pb.CancelTaskRequest(id=d.task.id))).state == "cancelling"
    assert (await stub.CancelTask(pb.CancelTaskRequest(id=d.task.id))).state == "cancelling"
    found = await stub.GetTask(pb.GetTaskRequest(id=d.task.id))
    assert (found.state, found.task.cancelling) == ("handed_out", True)
    buried = await dead(stub)
    assert (await stub.CancelTask(pb.CancelTaskRequest(id=buried))).state == "purged"
    error = await rpc_error(stub.CancelTask(pb.CancelTaskRequest(id=ready)))
    assert error.code() == Code.NOT_FOUND
    error = await rpc_error(stub.CancelTask(pb.CancelTaskRequest(id="")))
    assert error.code() == Code.INVALID_ARGUMENT
    t = await totals(stub)
    assert (t.cancelled, t.purged) == (1, 1)


async def test_a_cancelled_task_s_extension_is_refused_with_wq_cancelled(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    d = await held(stub)
    await stub.CancelTask(pb.CancelTaskRequest(id=d.task.id))
    error = await rpc_error(
        stub.ExtendLease(pb.ExtendLeaseRequest(id=d.task.id, lease_id=d.lease_id))
    )
    assert error.code() == Code.FAILED_PRECONDITION
    assert "cancelled" in (error.details() or "")
    assert trailing(error)[CANCELLED_KEY] == "1"
    # Another lease's refusal says nothing of the kind.
    other = await held(stub, "other")
    error = await rpc_error(stub.ExtendLease(pb.ExtendLeaseRequest(id=other.task.id, lease_id="x")))
    assert error.code() == Code.FAILED_PRECONDITION
    assert CANCELLED_KEY not in trailing(error)
    # The nack drops it, counted cancelled only.
    await stub.Nack(pb.NackRequest(id=d.task.id, lease_id=d.lease_id, error="stopped"))
    t = await totals(stub)
    assert (t.cancelled, t.nacked, t.retried) == (1, 0, 0)


async def test_a_time_limit_refusal_is_a_failed_precondition(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    await enqueue(stub, timeout_ms=1000)
    d = (await stub.NextJob(pb.NextJobRequest(wait_ms=0, lease_ms=500))).delivery
    assert d.task.timeout_ms == 1000
    request = pb.ExtendLeaseRequest(id=d.task.id, lease_id=d.lease_id, lease_ms=60_000)
    await stub.ExtendLease(request)  # cut to the limit
    error = await rpc_error(stub.ExtendLease(request))
    assert error.code() == Code.FAILED_PRECONDITION
    assert "time limit" in (error.details() or "")
    assert CANCELLED_KEY not in trailing(error)


# -- ListTasks ------------------------------------------------------------------------------------


async def test_tasks_are_listed_a_page_at_a_time(stub: pb_grpc.BrokerAsyncStub) -> None:
    low = [await enqueue(stub, b"1", queue="l") for _ in range(3)]
    high = await enqueue(stub, b"2", queue="l", priority=5)
    seen: list[str] = []
    cursor = ""
    while True:
        page = await stub.ListTasks(pb.ListTasksRequest(queue="l", limit=2, cursor=cursor))
        assert all(t.state == "ready" for t in page.tasks)
        seen += [t.task.id for t in page.tasks]
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    assert seen == [high, *low]
    # Defaults: the default queue, ready, 100.
    mine = await enqueue(stub)
    page = await stub.ListTasks(pb.ListTasksRequest())
    assert [t.task.id for t in page.tasks] == [mine]
    assert page.next_cursor == ""
    d = await held(stub, "h")
    page = await stub.ListTasks(pb.ListTasksRequest(queue="h", state="handed_out"))
    assert [(t.task.id, t.state) for t in page.tasks] == [(d.task.id, "handed_out")]


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"state": "gone"}, "state"),
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"queue": "no spaces"}, "queue"),
        ({"cursor": "not-a-cursor"}, "cursor"),
    ],
)
async def test_a_bad_listing_request_is_invalid_naming_the_field(
    stub: pb_grpc.BrokerAsyncStub, request_fields: dict[str, Any], field: str
) -> None:
    error = await rpc_error(stub.ListTasks(pb.ListTasksRequest(**request_fields)))
    assert error.code() == Code.INVALID_ARGUMENT
    assert field in (error.details() or "")


async def test_a_cursor_is_for_its_state(stub: pb_grpc.BrokerAsyncStub) -> None:
    for _ in range(2):
        await enqueue(stub)
    cursor = (await stub.ListTasks(pb.ListTasksRequest(limit=1))).next_cursor
    assert cursor
    error = await rpc_error(stub.ListTasks(pb.ListTasksRequest(state="dead", cursor=cursor)))
    assert error.code() == Code.INVALID_ARGUMENT
    assert "cursor" in (error.details() or "")


# -- EmptyQueue and DeleteQueue -----------------------------------------------------------------


async def test_empty_and_delete_a_queue(stub: pb_grpc.BrokerAsyncStub) -> None:
    for _ in range(2):
        await enqueue(stub, queue="e")
    await enqueue(stub, queue="e", delay_ms=60_000)
    error = await rpc_error(stub.DeleteQueue(pb.DeleteQueueRequest(queue="e")))
    assert error.code() == Code.FAILED_PRECONDITION
    assert "3" in (error.details() or "") or "2" in (error.details() or "")
    assert (await stub.EmptyQueue(pb.EmptyQueueRequest(queue="e"))).cancelled == 3
    assert (await stub.EmptyQueue(pb.EmptyQueueRequest(queue="e"))).cancelled == 0
    await stub.DeleteQueue(pb.DeleteQueueRequest(queue="e"))
    names = [q.name for q in (await stub.ListQueues(pb.ListQueuesRequest())).queues]
    assert "e" not in names
    for call in (
        stub.DeleteQueue(pb.DeleteQueueRequest(queue="e")),
        stub.EmptyQueue(pb.EmptyQueueRequest(queue="never-seen")),
    ):
        assert (await rpc_error(call)).code() == Code.NOT_FOUND
    for call in (  # the queue is required: "" is no default
        stub.DeleteQueue(pb.DeleteQueueRequest()),
        stub.EmptyQueue(pb.EmptyQueueRequest()),
    ):
        assert (await rpc_error(call)).code() == Code.INVALID_ARGUMENT


# -- the new fields -------------------------------------------------------------------------------


async def test_the_new_task_fields_are_set_only_when_given(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    plain = await enqueue(stub, b'{"a":1}')
    found = await stub.GetTask(pb.GetTaskRequest(id=plain))
    assert fields_set(found.task) == PLAIN_FIELDS
    assert not found.task.HasField("expires_at")
    assert not found.task.HasField("timeout_ms")
    controlled = await enqueue(stub, b"2", expires_in_ms=60_000, timeout_ms=2500)
    task = (await stub.GetTask(pb.GetTaskRequest(id=controlled))).task
    assert task.expires_at.ToMicroseconds() == round((clock.now() + 60) * 1e6)
    assert task.timeout_ms == 2500
    assert fields_set(task) == PLAIN_FIELDS | {"expires_at", "timeout_ms"}


async def test_progress_is_recorded_as_sent(stub: pb_grpc.BrokerAsyncStub) -> None:
    d = await held(stub)
    progress = b' {"done": 1.10} '
    await stub.ExtendLease(
        pb.ExtendLeaseRequest(id=d.task.id, lease_id=d.lease_id, progress=progress)
    )
    task = (await stub.GetTask(pb.GetTaskRequest(id=d.task.id))).task
    assert task.progress == progress
    listed = await stub.ListTasks(pb.ListTasksRequest(state="handed_out"))
    assert listed.tasks[0].task.progress == progress
    # Without progress the last one stays.
    await stub.ExtendLease(pb.ExtendLeaseRequest(id=d.task.id, lease_id=d.lease_id))
    assert (await stub.GetTask(pb.GetTaskRequest(id=d.task.id))).task.progress == progress


@pytest.mark.parametrize("progress", [b"{not json", b"\xff", b'"' + b"x" * 4095 + b'"', b" "])
async def test_bad_progress_is_invalid(stub: pb_grpc.BrokerAsyncStub, progress: bytes) -> None:
    d = await held(stub)
    request = pb.ExtendLeaseRequest(id=d.task.id, lease_id=d.lease_id, progress=progress)
    error = await rpc_error(stub.ExtendLease(request))
    assert error.code() == Code.INVALID_ARGUMENT
    assert "progress" in (error.details() or "")


@pytest.mark.parametrize("field", ["expires_in_ms", "timeout_ms"])
@pytest.mark.parametrize("value", [0, -5, 31_536_000_001])
async def test_bad_durations_are_invalid(
    stub: pb_grpc.BrokerAsyncStub, field: str, value: int
) -> None:
    bad = pb.EnqueueRequest(payload=b"1")
    setattr(bad, field, value)
    error = await rpc_error(stub.Enqueue(bad))
    assert error.code() == Code.INVALID_ARGUMENT
    assert field in (error.details() or "")
    batch = pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"1"), bad])
    error = await rpc_error(stub.EnqueueBatch(batch))
    assert f"tasks[1].{field}" in (error.details() or "")


async def test_unique_keys_over_every_enqueue(stub: pb_grpc.BrokerAsyncStub) -> None:
    request = pb.EnqueueRequest(payload=b"1", idempotency_key="k", unique=True)
    first = await stub.Enqueue(request)
    again = await stub.Enqueue(request)
    assert (again.id, again.duplicate) == (first.id, True)
    batch = await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=[request]))
    assert (list(batch.ids), list(batch.duplicates)) == ([first.id], [True])
    call: Any = stub.Produce(None)
    await call.write(pb.EnqueueBatchRequest(tasks=[request]))
    produced = await asyncio.wait_for(call.read(), 5)
    assert (produced.code, list(produced.ids), list(produced.duplicates)) == (0, [first.id], [True])
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 5) is EOF
    await stub.CancelTask(pb.CancelTaskRequest(id=first.id))
    assert not (await stub.Enqueue(request)).duplicate  # the key is free once the task is gone
    error = await rpc_error(stub.Enqueue(pb.EnqueueRequest(payload=b"1", unique=True)))
    assert error.code() == Code.INVALID_ARGUMENT
    assert "unique" in (error.details() or "")


async def test_produce_takes_the_new_fields(stub: pb_grpc.BrokerAsyncStub) -> None:
    call: Any = stub.Produce(None)
    await call.write(
        pb.EnqueueBatchRequest(
            tasks=[pb.EnqueueRequest(payload=b"1", timeout_ms=10, expires_in_ms=0)]
        )
    )
    refused = await asyncio.wait_for(call.read(), 5)
    assert refused.code == Code.INVALID_ARGUMENT.value[0]
    assert "expires_in_ms" in refused.message
    await call.write(pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"1", timeout_ms=10)]))
    done = await asyncio.wait_for(call.read(), 5)
    assert done.code == 0
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 5) is EOF
    task = (await stub.GetTask(pb.GetTaskRequest(id=done.ids[0]))).task
    assert task.timeout_ms == 10


async def test_the_totals_carry_cancelled_and_expired(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock, broker: Broker
) -> None:
    await enqueue(stub, expires_in_ms=1000)
    cancelled = await enqueue(stub)
    await stub.CancelTask(pb.CancelTaskRequest(id=cancelled))
    clock.advance(2)
    await broker.service.sweep()
    stats = await stub.Stats(pb.StatsRequest())
    assert (stats.totals.cancelled, stats.totals.expired) == (1, 1)
    assert stats.ready == 0


# -- streams --------------------------------------------------------------------------------------


async def test_a_stream_is_told_of_a_cancel_at_once(stub: pb_grpc.BrokerAsyncStub) -> None:
    call = await open_stream(stub)
    task_id = await enqueue(stub)
    response = await read(call)
    [delivery] = response.deliveries
    assert delivery.task.id == task_id
    assert not delivery.task.cancelling
    assert (await stub.CancelTask(pb.CancelTaskRequest(id=task_id))).state == "cancelling"
    told = await read(call)
    assert list(told.cancels) == [pb.Cancel(id=task_id, lease_id=delivery.lease_id)]
    assert not told.deliveries
    # An extension on the stream is refused, saying so; the nack drops the task.
    extend = pb.ExtendLeaseRequest(id=task_id, lease_id=delivery.lease_id)
    await call.write(pb.StreamJobsRequest(extends=[extend]))
    [outcome] = (await read(call)).settled
    assert (outcome.extend, outcome.code, outcome.cancelled) == (True, 9, True)
    await call.write(
        pb.StreamJobsRequest(nacks=[pb.NackRequest(id=task_id, lease_id=delivery.lease_id)])
    )
    [nacked] = (await read(call)).settled
    assert (nacked.nack, nacked.code) == (True, 0)
    assert (await totals(stub)).cancelled == 1
    # Told once: a second cancel sends nothing more.
    other = await enqueue(stub)
    [delivery] = (await read(call)).deliveries
    await stub.CancelTask(pb.CancelTaskRequest(id=other))
    assert [c.id for c in (await read(call)).cancels] == [other]
    await stub.CancelTask(pb.CancelTaskRequest(id=other))
    await call.write(
        pb.StreamJobsRequest(acks=[pb.AckRequest(id=other, lease_id=delivery.lease_id)])
    )
    after = await read(call)
    assert not after.cancels
    assert [s.code for s in after.settled] == [0]
    call.cancel()


async def test_a_cancel_never_comes_before_its_delivery(
    stub: pb_grpc.BrokerAsyncStub, broker: Broker
) -> None:
    """A task cancelled as it is pushed (in the same turn of the loop: its delivery not yet
    written) is told in the response that carries its delivery, or a later one."""
    call = await open_stream(stub, prefetch=8)
    await wait_until(lambda: broker.service.waiting == 1, what="the stream to wait")
    ids = []
    for n in range(5):
        enqueued = await broker.service.enqueue(b"%d" % n)
        await broker.service.cancel(enqueued.id)  # (no turn of the loop in between)
        ids.append(enqueued.id)
    delivered: set[str] = set()
    told: list[str] = []
    while len(told) < len(ids):
        response = await read(call)
        delivered |= {d.task.id for d in response.deliveries}
        for cancel in response.cancels:
            assert cancel.id in delivered, "a cancel came before its delivery"
            told.append(cancel.id)
    assert told == ids
    call.cancel()


async def test_a_stream_without_cancels_sees_nothing_new(stub: pb_grpc.BrokerAsyncStub) -> None:
    call = await open_stream(stub)
    task_id = await enqueue(stub, b'{"a":1}')
    response = await read(call)
    assert fields_set(response) == {"deliveries"}
    assert fields_set(response.deliveries[0].task) == PLAIN_FIELDS | {"attempts"}
    lease = response.deliveries[0].lease_id
    await call.write(
        pb.StreamJobsRequest(extends=[pb.ExtendLeaseRequest(id=task_id, lease_id=lease)])
    )
    [outcome] = (await read(call)).settled
    assert outcome.code == 0
    assert not outcome.cancelled
    call.cancel()
