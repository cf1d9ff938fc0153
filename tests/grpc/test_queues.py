"""Queues, priorities, keys and the rest of a task's life over gRPC, against a real grpc.aio server
on port 0 and a real grpc.aio client: named queues, priorities, idempotency keys, lease extension
(unary and on the stream), nack options, task lookup, queue pause/resume, DLQ bulk operations, and
the answer to a stream's drain.

The helpers (the raw stream ``Worker``, ``enqueue``, ``claim``, ...) are those of grpc/test_api.py.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from tests.grpc.test_api import (
    Code,
    Worker,
    ack_of,
    background,
    claim,
    enqueue,
    gauges,
    nack_of,
    rpc_error,
    seconds,
    stats,
    stats_dict,
)
from tests.helpers import invariant_holds, running_broker, settle, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[Broker]:
    async with running_broker(clock=clock, rng=random.Random(11)) as b:
        yield b


async def next_job(stub: pb_grpc.BrokerAsyncStub, *queues: str) -> pb.Delivery | None:
    response = await stub.NextJob(pb.NextJobRequest(wait_ms=0, queues=queues))
    return response.delivery if response.HasField("delivery") else None


async def dead(stub: pb_grpc.BrokerAsyncStub, queue: str = "", payload: bytes = b"1") -> str:
    """A task of ``queue`` buried in the dead-letter queue (one attempt, nacked)."""
    task_id = await enqueue(stub, payload, max_attempts=1, queue=queue)
    d = await next_job(stub, queue or "default")
    assert d is not None
    assert d.task.id == task_id
    await stub.Nack(nack_of(d, "boom"))
    return task_id


async def state_of(stub: pb_grpc.BrokerAsyncStub, task_id: str) -> str:
    response = await stub.GetTask(pb.GetTaskRequest(id=task_id))
    return str(response.state)


# -- queues and priorities ----------------------------------------------------------------------


async def test_a_task_is_in_the_default_queue_at_priority_0_unless_told(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    await enqueue(stub, b"1")
    d = await claim(stub)
    assert (d.task.queue, d.task.priority) == ("default", 0)


async def test_a_claim_takes_only_from_its_queues(stub: pb_grpc.BrokerAsyncStub) -> None:
    a = await enqueue(stub, b'"a"', queue="a")
    assert await next_job(stub) is None  # no queue listed: "default"
    assert await next_job(stub, "b") is None
    d = await next_job(stub, "a")
    assert d is not None
    assert (d.task.id, d.task.queue) == (a, "a")


async def test_a_claim_prefers_the_queues_in_the_order_listed(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    b = await enqueue(stub, b"1", queue="b")
    a = await enqueue(stub, b"2", queue="a")
    first = await next_job(stub, "a", "b")
    second = await next_job(stub, "a", "b")
    assert first is not None
    assert second is not None
    assert (first.task.id, second.task.id) == (a, b)


async def test_higher_priority_first_then_oldest(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    ids = {}
    for name, priority in [("p0", 0), ("p5a", 5), ("p9", 9), ("p5b", 5), ("unset", None)]:
        ids[name] = await enqueue(stub, b"1", priority=priority)
        clock.advance(0.001)
    order = [(await claim(stub)).task for _ in range(5)]
    assert [t.id for t in order] == [ids[n] for n in ("p9", "p5a", "p5b", "p0", "unset")]
    assert [t.priority for t in order] == [9, 5, 5, 0, 0]


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        (pb.EnqueueRequest(payload=b"1", queue="no spaces"), "queue"),
        (pb.EnqueueRequest(payload=b"1", queue="x" * 65), "queue"),
        (pb.EnqueueRequest(payload=b"1", queue="é"), "queue"),
        (pb.EnqueueRequest(payload=b"1", priority=-1), "priority"),
        (pb.EnqueueRequest(payload=b"1", priority=10), "priority"),
        (pb.EnqueueRequest(payload=b"1", idempotency_key="k" * 257), "idempotency"),
        (pb.EnqueueRequest(payload=b"1", idempotency_key="a\nb"), "idempotency"),
    ],
)
async def test_enqueue_refuses_a_bad_queue_priority_or_key(
    stub: pb_grpc.BrokerAsyncStub, request_: pb.EnqueueRequest, needle: str
) -> None:
    err = await rpc_error(stub.Enqueue(request_))
    assert err.code() == Code.INVALID_ARGUMENT
    assert needle in (err.details() or "")
    batch = pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"1"), request_])
    err = await rpc_error(stub.EnqueueBatch(batch))
    assert err.code() == Code.INVALID_ARGUMENT
    assert "tasks[1]" in (err.details() or "")
    assert (await stats(stub)).totals.enqueued == 0


async def test_the_extremes_of_queue_and_priority_are_accepted(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    name = "A-z_0.9" + "q" * 57
    assert len(name) == 64
    await enqueue(stub, b"1", queue=name, priority=9)
    await enqueue(stub, b"2", queue="x", priority=0)
    d = await next_job(stub, name)
    assert d is not None
    assert (d.task.queue, d.task.priority) == (name, 9)


@pytest.mark.parametrize(
    "queues", [["bad queue"], ["ok", ""], ["x" * 65], [f"q{i}" for i in range(65)]]
)
async def test_next_job_refuses_bad_queues(
    stub: pb_grpc.BrokerAsyncStub, queues: list[str]
) -> None:
    err = await rpc_error(stub.NextJob(pb.NextJobRequest(wait_ms=0, queues=queues)))
    assert err.code() == Code.INVALID_ARGUMENT
    assert "queue" in (err.details() or "")


async def test_batch_items_carry_queue_and_priority(stub: pb_grpc.BrokerAsyncStub) -> None:
    response = await stub.EnqueueBatch(
        pb.EnqueueBatchRequest(
            tasks=[
                pb.EnqueueRequest(payload=b"1", queue="a", priority=1),
                pb.EnqueueRequest(payload=b"2", queue="a", priority=7),
                pb.EnqueueRequest(payload=b"3"),
            ]
        )
    )
    assert len(response.ids) == 3
    assert list(response.duplicates) == [False, False, False]
    d = await next_job(stub, "a")
    assert d is not None
    assert (d.task.id, d.task.priority) == (response.ids[1], 7)
    d = await next_job(stub)
    assert d is not None
    assert d.task.id == response.ids[2]


# -- idempotency keys ---------------------------------------------------------------------------


async def test_a_second_enqueue_with_the_same_key_creates_nothing(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    first = await stub.Enqueue(pb.EnqueueRequest(payload=b"1", idempotency_key="k1"))
    assert not first.duplicate
    again = await stub.Enqueue(pb.EnqueueRequest(payload=b"2", idempotency_key="k1"))
    assert (again.id, again.duplicate) == (first.id, True)
    # The key is per queue; no key is no deduplication.
    other = await stub.Enqueue(pb.EnqueueRequest(payload=b"3", idempotency_key="k1", queue="q"))
    assert (other.id != first.id, other.duplicate) == (True, False)
    plain = [await stub.Enqueue(pb.EnqueueRequest(payload=b"4")) for _ in range(2)]
    assert plain[0].id != plain[1].id
    assert not any(p.duplicate for p in plain)
    assert (await stats(stub)).totals.enqueued == 4


async def test_a_key_still_matches_after_the_task_was_acked(stub: pb_grpc.BrokerAsyncStub) -> None:
    first = await stub.Enqueue(pb.EnqueueRequest(payload=b"1", idempotency_key="once"))
    await stub.Ack(ack_of(await claim(stub)))
    again = await stub.Enqueue(pb.EnqueueRequest(payload=b"1", idempotency_key="once"))
    assert (again.id, again.duplicate) == (first.id, True)
    assert gauges(await stats(stub)) == (0, 0, 0, 0)


async def test_a_key_is_forgotten_after_the_window(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    first = await stub.Enqueue(pb.EnqueueRequest(payload=b"1", idempotency_key="w"))
    clock.advance(301)  # the default window is 300 s
    await settle()
    again = await stub.Enqueue(pb.EnqueueRequest(payload=b"1", idempotency_key="w"))
    assert again.id != first.id
    assert not again.duplicate


async def test_duplicates_in_a_batch_are_reported_per_item(stub: pb_grpc.BrokerAsyncStub) -> None:
    first = await stub.Enqueue(pb.EnqueueRequest(payload=b"1", idempotency_key="a"))
    response = await stub.EnqueueBatch(
        pb.EnqueueBatchRequest(
            tasks=[
                pb.EnqueueRequest(payload=b"1", idempotency_key="a"),
                pb.EnqueueRequest(payload=b"2", idempotency_key="b"),
                pb.EnqueueRequest(payload=b"3"),
            ]
        )
    )
    assert list(response.duplicates) == [True, False, False]
    assert response.ids[0] == first.id
    assert len(set(response.ids)) == 3
    assert (await stats(stub)).totals.enqueued == 3


# -- nack options -------------------------------------------------------------------------------


async def test_nack_with_delay_ms_retries_after_exactly_that(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    await enqueue(stub, b"1", max_attempts=5)
    d = await claim(stub)
    await stub.Nack(pb.NackRequest(id=d.task.id, lease_id=d.lease_id, error="later", delay_ms=7000))
    assert gauges(await stats(stub)) == (0, 0, 1, 0)
    clock.advance(6.9)
    await settle()
    assert await next_job(stub) is None
    clock.advance(0.2)
    await settle()
    again = await claim(stub)
    assert (again.task.attempts, again.task.last_error) == (2, "later")
    s = await stats(stub)
    assert (s.totals.nacked, s.totals.retried) == (1, 1)


async def test_nack_with_delay_ms_0_retries_at_once(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1")
    d = await claim(stub)
    await stub.Nack(pb.NackRequest(id=d.task.id, lease_id=d.lease_id, delay_ms=0))
    assert (await claim(stub)).task.attempts == 2


async def test_nack_with_delay_ms_and_no_attempts_left_buries(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    await enqueue(stub, b"1", max_attempts=1)
    d = await claim(stub)
    await stub.Nack(pb.NackRequest(id=d.task.id, lease_id=d.lease_id, delay_ms=1000))
    assert gauges(await stats(stub)) == (0, 0, 0, 1)


async def test_terminal_nack_buries_at_once(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1", max_attempts=10)
    d = await claim(stub)
    await stub.Nack(pb.NackRequest(id=d.task.id, lease_id=d.lease_id, error="fatal", terminal=True))
    s = await stats(stub)
    assert gauges(s) == (0, 0, 0, 1)
    assert (s.totals.nacked, s.totals.buried, s.totals.retried) == (1, 1, 0)
    assert invariant_holds(stats_dict(s))
    (task,) = (await stub.ListDead(pb.ListDeadRequest())).tasks
    assert (task.id, task.last_error, task.attempts) == (d.task.id, "fatal", 1)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [({"delay_ms": -1}, "delay_ms"), ({"delay_ms": 5, "terminal": True}, "terminal")],
)
async def test_nack_refuses_bad_options(
    stub: pb_grpc.BrokerAsyncStub, fields: dict[str, Any], needle: str
) -> None:
    await enqueue(stub, b"1")
    d = await claim(stub)
    err = await rpc_error(stub.Nack(pb.NackRequest(id=d.task.id, lease_id=d.lease_id, **fields)))
    assert err.code() == Code.INVALID_ARGUMENT
    assert needle in (err.details() or "")
    assert (await stats(stub)).handed_out == 1  # still held


# -- ExtendLease --------------------------------------------------------------------------------


async def test_extend_lease_moves_the_deadline(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    await enqueue(stub, b"1")
    d = await claim(stub, lease_ms=10_000)
    clock.advance(8)
    response = await stub.ExtendLease(
        pb.ExtendLeaseRequest(id=d.task.id, lease_id=d.lease_id, lease_ms=10_000)
    )
    assert seconds(response.deadline) == pytest.approx(clock.now() + 10, abs=1e-6)
    clock.advance(5)  # past the first deadline
    await settle()
    s = await stats(stub)
    assert (s.handed_out, s.totals.reclaimed) == (1, 0)
    default = await stub.ExtendLease(pb.ExtendLeaseRequest(id=d.task.id, lease_id=d.lease_id))
    assert seconds(default.deadline) == pytest.approx(clock.now() + 30, abs=1e-6)
    capped = await stub.ExtendLease(
        pb.ExtendLeaseRequest(id=d.task.id, lease_id=d.lease_id, lease_ms=10**9)
    )
    assert seconds(capped.deadline) == pytest.approx(clock.now() + 300, abs=1e-6)
    await stub.Ack(ack_of(d))


async def test_an_extended_lease_still_runs_out(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    await enqueue(stub, b"1")
    d = await claim(stub, lease_ms=1000)
    await stub.ExtendLease(pb.ExtendLeaseRequest(id=d.task.id, lease_id=d.lease_id, lease_ms=2000))
    clock.advance(2.5)
    await wait_until(lambda: stats(stub), lambda s: s.totals.reclaimed == 1, what="the reclaim")
    err = await rpc_error(stub.Ack(ack_of(d)))
    assert err.code() == Code.NOT_FOUND


async def test_extend_lease_refusals_are_those_of_ack(stub: pb_grpc.BrokerAsyncStub) -> None:
    err = await rpc_error(stub.ExtendLease(pb.ExtendLeaseRequest(id="nope", lease_id="x")))
    assert err.code() == Code.NOT_FOUND
    await enqueue(stub, b"1")
    d = await claim(stub)
    wrong = pb.ExtendLeaseRequest(id=d.task.id, lease_id="not-" + d.lease_id)
    err = await rpc_error(stub.ExtendLease(wrong))
    assert err.code() == Code.FAILED_PRECONDITION
    for lease_ms in (0, -5):
        bad = pb.ExtendLeaseRequest(id=d.task.id, lease_id=d.lease_id, lease_ms=lease_ms)
        err = await rpc_error(stub.ExtendLease(bad))
        assert err.code() == Code.INVALID_ARGUMENT
        assert "lease_ms" in (err.details() or "")


# -- GetTask ------------------------------------------------------------------------------------


async def test_get_task_reports_each_state(stub: pb_grpc.BrokerAsyncStub, clock: FakeClock) -> None:
    ready = await enqueue(stub, b'{"r": 1}', queue="q", priority=3)
    delayed = await enqueue(stub, b"1", delay_ms=5000)
    held = await enqueue(stub, b"1")
    gone = await dead(stub, queue="z")
    d = await next_job(stub)
    assert d is not None
    assert d.task.id == held
    response = await stub.GetTask(pb.GetTaskRequest(id=ready))
    assert response.state == "ready"
    task = response.task
    assert (task.id, task.payload, task.queue, task.priority) == (ready, b'{"r": 1}', "q", 3)
    assert (task.attempts, task.max_attempts) == (0, 3)
    assert await state_of(stub, delayed) == "delayed"
    assert await state_of(stub, held) == "handed_out"
    assert await state_of(stub, gone) == "dead"
    dead_task = (await stub.GetTask(pb.GetTaskRequest(id=gone))).task
    assert dead_task.last_error == "boom"
    await stub.Ack(ack_of(d))
    err = await rpc_error(stub.GetTask(pb.GetTaskRequest(id=held)))
    assert err.code() == Code.NOT_FOUND
    err = await rpc_error(stub.GetTask(pb.GetTaskRequest(id="unknown")))
    assert err.code() == Code.NOT_FOUND


# -- Stats, ListQueues, pause and resume ---------------------------------------------------------


async def test_stats_of_one_queue(stub: pb_grpc.BrokerAsyncStub) -> None:
    await dead(stub, queue="b")
    await enqueue(stub, b"1", queue="a")
    await enqueue(stub, b"1", queue="a", delay_ms=1000)
    await enqueue(stub, b"1", queue="b")
    a = await stub.Stats(pb.StatsRequest(queue="a"))
    b = await stub.Stats(pb.StatsRequest(queue="b"))
    assert gauges(a) == (1, 0, 1, 0)
    assert gauges(b) == (1, 0, 0, 1)
    assert (a.totals.enqueued, b.totals.enqueued, b.totals.buried) == (2, 2, 1)
    assert gauges(await stats(stub)) == (2, 0, 1, 1)  # no queue: the whole broker
    never = await stub.Stats(pb.StatsRequest(queue="never-seen"))
    assert stats_dict(never) == stats_dict(pb.StatsResponse(totals=pb.Totals()))
    err = await rpc_error(stub.Stats(pb.StatsRequest(queue="bad queue")))
    assert err.code() == Code.INVALID_ARGUMENT
    assert "queue" in (err.details() or "")


async def test_list_queues_sorted_with_gauges_and_paused(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1", queue="b")
    await enqueue(stub, b"1", queue="b")
    await enqueue(stub, b"1", queue="a", delay_ms=1000)
    await dead(stub, queue="a")
    await enqueue(stub, b"1")
    assert await next_job(stub, "b") is not None
    await stub.PauseQueue(pb.PauseQueueRequest(queue="b"))
    response = await stub.ListQueues(pb.ListQueuesRequest())
    rows = [(q.name, q.ready, q.handed_out, q.delayed, q.dead, q.paused) for q in response.queues]
    assert rows == [
        ("a", 0, 0, 1, 1, False),
        ("b", 1, 1, 0, 0, True),
        ("default", 1, 0, 0, 0, False),
    ]


async def test_a_paused_queue_accepts_tasks_and_hands_none_out(
    stub: pb_grpc.BrokerAsyncStub, broker: Broker
) -> None:
    await stub.PauseQueue(pb.PauseQueueRequest(queue="p"))
    await stub.PauseQueue(pb.PauseQueueRequest(queue="p"))  # idempotent
    task_id = await enqueue(stub, b"1", queue="p")
    other = await enqueue(stub, b"2", queue="o")
    assert await next_job(stub, "p") is None
    d = await next_job(stub, "p", "o")  # a paused queue is passed over
    assert d is not None
    assert d.task.id == other
    poll = background(stub.NextJob(pb.NextJobRequest(wait_ms=10_000, queues=["p"])))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    await stub.ResumeQueue(pb.ResumeQueueRequest(queue="p"))
    response = await asyncio.wait_for(poll, 5)
    assert response.delivery.task.id == task_id  # resuming wakes the parked claim
    await stub.ResumeQueue(pb.ResumeQueueRequest(queue="p"))  # idempotent


@pytest.mark.parametrize("queue", ["", "bad queue", "x" * 65])
async def test_pause_and_resume_need_a_valid_queue(
    stub: pb_grpc.BrokerAsyncStub, queue: str
) -> None:
    for call in (
        stub.PauseQueue(pb.PauseQueueRequest(queue=queue)),
        stub.ResumeQueue(pb.ResumeQueueRequest(queue=queue)),
    ):
        err = await rpc_error(call)
        assert err.code() == Code.INVALID_ARGUMENT
        assert "queue" in (err.details() or "")


# -- the dead-letter queue ----------------------------------------------------------------------


async def test_list_dead_of_one_queue(stub: pb_grpc.BrokerAsyncStub) -> None:
    a = await dead(stub, queue="a")
    b = await dead(stub, queue="b")
    everything = await stub.ListDead(pb.ListDeadRequest())
    assert [t.id for t in everything.tasks] == [a, b]
    only_b = await stub.ListDead(pb.ListDeadRequest(queue="b"))
    assert [(t.id, t.queue) for t in only_b.tasks] == [(b, "b")]
    assert not (await stub.ListDead(pb.ListDeadRequest(queue="c"))).tasks


async def test_requeue_all_of_one_queue_then_all(stub: pb_grpc.BrokerAsyncStub) -> None:
    a = [await dead(stub, queue="a") for _ in range(2)]
    b = await dead(stub, queue="b")
    response = await stub.RequeueAll(pb.RequeueAllRequest(queue="a"))
    assert response.requeued == 2
    s = await stats(stub)
    assert (s.ready, s.dead, s.totals.requeued) == (2, 1, 2)
    d = await next_job(stub, "a")
    assert d is not None
    assert d.task.id in a
    assert (d.task.attempts, d.task.HasField("last_error")) == (1, False)  # a clean start
    response = await stub.RequeueAll(pb.RequeueAllRequest())
    assert response.requeued == 1
    assert await state_of(stub, b) == "ready"
    assert (await stub.RequeueAll(pb.RequeueAllRequest())).requeued == 0


async def test_purge_dead_drops_a_dead_task_for_good(stub: pb_grpc.BrokerAsyncStub) -> None:
    gone = await dead(stub)
    kept = await dead(stub)
    await stub.PurgeDead(pb.PurgeDeadRequest(id=gone))
    s = await stats(stub)
    assert (s.dead, s.totals.buried, s.totals.purged) == (1, 2, 1)
    assert [t.id for t in (await stub.ListDead(pb.ListDeadRequest())).tasks] == [kept]
    for task_id in (gone, "unknown"):
        err = await rpc_error(stub.PurgeDead(pb.PurgeDeadRequest(id=task_id)))
        assert err.code() == Code.NOT_FOUND
    err = await rpc_error(stub.GetTask(pb.GetTaskRequest(id=gone)))
    assert err.code() == Code.NOT_FOUND
    ready = await enqueue(stub, b"1")  # not dead: nothing to purge
    err = await rpc_error(stub.PurgeDead(pb.PurgeDeadRequest(id=ready)))
    assert err.code() == Code.NOT_FOUND
    assert await state_of(stub, ready) == "ready"
    assert invariant_holds(stats_dict(await stats(stub)))


# -- the stream: queues, extends, nack options ----------------------------------------------------


async def test_a_stream_gets_only_its_queues(stub: pb_grpc.BrokerAsyncStub) -> None:
    worker = Worker(stub)
    await worker.call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=5, queues=["b"])))
    assert await worker.read() is not None  # the open is accepted
    await enqueue(stub, b'"a"', queue="a")
    await enqueue(stub, b'"default"')
    b = await enqueue(stub, b'"b"', queue="b")
    (d,) = await worker.receive(1)
    assert (d.task.id, d.task.queue) == (b, "b")
    assert gauges(await stats(stub)) == (2, 1, 0, 0)  # a's and default's tasks were not pushed
    await worker.send(acks=[ack_of(d)])
    await worker.finish()
    assert len(worker.received) == 1


async def test_a_stream_serves_its_queues_in_order_and_priorities(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    ids = [
        await enqueue(stub, b"1", queue="low"),
        await enqueue(stub, b"2", queue="high", priority=1),
        await enqueue(stub, b"3", queue="high", priority=5),
    ]
    worker = Worker(stub)
    opening = pb.StreamOpen(prefetch=1, queues=["high", "low"])
    await worker.call.write(pb.StreamJobsRequest(open=opening))
    got = []
    for _ in range(3):
        (d,) = await worker.receive(1)
        got.append(d.task.id)
        await worker.send(acks=[ack_of(d)])
    assert got == [ids[2], ids[1], ids[0]]
    await worker.until(lambda w: len(w.settled) == 3)
    await worker.finish()


async def test_a_stream_refuses_bad_queues(stub: pb_grpc.BrokerAsyncStub) -> None:
    call = stub.StreamJobs(None)
    await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(queues=["no good"])))
    err = await rpc_error(call.read())
    assert err.code() == Code.INVALID_ARGUMENT
    assert "queue" in (err.details() or "")


async def test_extend_on_the_stream_answers_with_the_deadline(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    await enqueue(stub, b"1")
    worker = await Worker(stub).open(prefetch=1, lease_ms=10_000)
    (d,) = await worker.receive(1)
    clock.advance(8)
    extend = pb.ExtendLeaseRequest(id=d.task.id, lease_id=d.lease_id, lease_ms=20_000)
    await worker.call.write(pb.StreamJobsRequest(extends=[extend]))
    (outcome,) = await worker.outcomes(1)
    assert (outcome.id, outcome.lease_id, outcome.code) == (d.task.id, d.lease_id, 0)
    assert (outcome.extend, outcome.nack) == (True, False)
    assert seconds(outcome.deadline) == pytest.approx(clock.now() + 20, abs=1e-6)
    clock.advance(15)  # past the first deadline, not the new one
    await settle()
    assert (await stats(stub)).totals.reclaimed == 0
    bad = pb.ExtendLeaseRequest(id=d.task.id, lease_id="not-" + d.lease_id)
    unknown = pb.ExtendLeaseRequest(id="unknown", lease_id="x")
    await worker.call.write(pb.StreamJobsRequest(extends=[bad, unknown]))
    wrong, missing = await worker.outcomes(2)
    assert (wrong.code, wrong.extend) == (Code.FAILED_PRECONDITION.value[0], True)
    assert not wrong.HasField("deadline")
    assert wrong.message
    assert missing.code == Code.NOT_FOUND.value[0]
    await worker.send(acks=[ack_of(d)])
    await worker.outcomes(1)
    await worker.finish()


async def test_stream_outcomes_come_extends_acks_nacks(stub: pb_grpc.BrokerAsyncStub) -> None:
    for _ in range(3):
        await enqueue(stub, b"1")
    worker = await Worker(stub).open(prefetch=3)
    a, b, c = await worker.receive(3)
    request = pb.StreamJobsRequest(
        nacks=[nack_of(c)],
        acks=[ack_of(b)],
        extends=[pb.ExtendLeaseRequest(id=a.task.id, lease_id=a.lease_id)],
    )
    await worker.call.write(request)
    outcomes = await worker.outcomes(3)
    assert [(o.id, o.extend, o.nack, o.code) for o in outcomes] == [
        (a.task.id, True, False, 0),
        (b.task.id, False, False, 0),
        (c.task.id, False, True, 0),
    ]
    await worker.send(acks=[ack_of(a)])
    await worker.outcomes(1)
    await worker.finish()


async def test_nack_options_on_the_stream(stub: pb_grpc.BrokerAsyncStub, clock: FakeClock) -> None:
    await enqueue(stub, b"1", max_attempts=5)
    await enqueue(stub, b"2", max_attempts=5)
    worker = await Worker(stub).open(prefetch=2)
    first, second = await worker.receive(2)
    later = pb.NackRequest(id=first.task.id, lease_id=first.lease_id, delay_ms=4000)
    fatal = pb.NackRequest(id=second.task.id, lease_id=second.lease_id, terminal=True)
    both = pb.NackRequest(id=second.task.id, lease_id=second.lease_id, terminal=True, delay_ms=1)
    await worker.send(nacks=[both, later, fatal])
    refused, ok1, ok2 = await worker.outcomes(3)
    assert refused.code == Code.INVALID_ARGUMENT.value[0]
    assert (ok1.code, ok2.code) == (0, 0)
    s = await stats(stub)
    assert (s.delayed, s.dead, s.totals.buried) == (1, 1, 1)
    await worker.send(drain=True)
    await worker.until(lambda w: w.ended)
    clock.advance(4.0)
    await settle()
    assert (await claim(stub)).task.id == first.task.id


# -- the answer to a drain ----------------------------------------------------------------------


async def read_until_drained(worker: Worker) -> tuple[pb.Drained, int]:
    """Read responses until one carries `drained`; it and how many deliveries came with or before
    it."""
    while True:
        response = await worker.read()
        assert response is not None, "the stream ended with no Drained"
        if response.HasField("drained"):
            return response.drained, len(worker.received)


async def assert_ends_ok(worker: Worker) -> None:
    """The broker ends the call by itself (the worker has not half-closed)."""
    response = await worker.read()
    assert response is None, f"expected the end of the stream, got {response}"
    assert await worker.call.code() == Code.OK


async def test_drain_holding_nothing_is_answered_0_and_the_stream_ends(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    worker = await Worker(stub).open(prefetch=4)
    assert await worker.read() is not None  # the open is accepted
    await worker.send(drain=True)
    answer, received = await read_until_drained(worker)
    assert (answer.unsettled, received) == (0, 0)
    await assert_ends_ok(worker)
    await enqueue(stub, b"1")  # nothing goes to the ended stream
    assert (await stats(stub)).ready == 1


async def test_drain_holding_two_ends_once_both_are_settled(
    stub: pb_grpc.BrokerAsyncStub, broker: Broker
) -> None:
    for i in range(3):
        await enqueue(stub, str(i).encode())
    worker = await Worker(stub).open(prefetch=2)
    held = await worker.receive(2)
    await worker.send(drain=True)
    answer, received = await read_until_drained(worker)
    assert (answer.unsettled, received) == (2, 2)
    await worker.send(acks=[ack_of(held[0])])
    (outcome,) = await worker.outcomes(1)
    assert outcome.code == 0
    assert not worker.ended
    # The second is settled over unary Ack: the stream learns of it too.
    await stub.Ack(ack_of(held[1]))
    await assert_ends_ok(worker)
    assert len(worker.received) == 2  # nothing pushed after the drain
    s = await stats(stub)
    assert (s.ready, s.handed_out, s.totals.acked, s.totals.reclaimed) == (1, 0, 2, 0)
    await wait_until(lambda: broker.service.waiting == 0, what="the stream gone")


async def test_drain_with_the_last_acks_counts_after_them(stub: pb_grpc.BrokerAsyncStub) -> None:
    for i in range(3):
        await enqueue(stub, str(i).encode())
    worker = await Worker(stub).open(prefetch=3)
    held = await worker.receive(3)
    await worker.send(acks=[ack_of(d) for d in held[:2]], drain=True)
    answer, _ = await read_until_drained(worker)
    assert len(worker.settled) == 2  # the outcomes of the acks came no later than the answer
    assert answer.unsettled == 1
    await worker.send(nacks=[nack_of(held[2], "x")])
    await worker.outcomes(1)
    await assert_ends_ok(worker)
    assert [s.code for s in worker.settled] == [0, 0, 0]


async def test_a_second_drain_is_not_answered_again(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1")
    worker = await Worker(stub).open(prefetch=1)
    (d,) = await worker.receive(1)
    await worker.send(drain=True)
    await worker.send(drain=True)
    answer, _ = await read_until_drained(worker)
    assert answer.unsettled == 1
    await worker.send(acks=[ack_of(d)])
    while (response := await worker.read()) is not None:
        assert not response.HasField("drained")
        assert not response.deliveries
    assert await worker.call.code() == Code.OK


async def test_a_drained_stream_ends_when_its_last_lease_runs_out(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    await enqueue(stub, b"1")
    worker = await Worker(stub).open(prefetch=1, lease_ms=1000)
    await worker.receive(1)
    await worker.send(drain=True)
    answer, _ = await read_until_drained(worker)
    assert answer.unsettled == 1
    clock.advance(1.5)
    await assert_ends_ok(worker)
    assert (await stats(stub)).totals.reclaimed == 1


async def test_drain_then_half_close_still_ends_ok(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1")
    worker = await Worker(stub).open(prefetch=1)
    (d,) = await worker.receive(1)
    await worker.send(acks=[ack_of(d)], drain=True)
    await worker.finish()
    assert [s.code for s in worker.settled] == [0]


async def test_a_queue_past_max_queues_is_resource_exhausted(clock: FakeClock) -> None:
    async with (
        running_broker(clock=clock, max_queues=2) as broker,
        grpc.aio.insecure_channel(broker.grpc_target) as channel,
    ):
        stub = pb_grpc.BrokerStub(channel)
        await enqueue(stub, b"1", queue="one")
        await enqueue(stub, b"1", queue="two")
        err = await rpc_error(stub.Enqueue(pb.EnqueueRequest(payload=b"1", queue="three")))
        assert err.code() == Code.RESOURCE_EXHAUSTED
        metadata: Any = err.trailing_metadata()  # a grpc.aio.Metadata (the stubs say otherwise)
        assert str(metadata.get("retry-after-ms", "")).isdigit()  # a limit, not a size
        await enqueue(stub, b"1", queue="two")  # a known queue still takes tasks
        assert [q.name for q in (await stub.ListQueues(pb.ListQueuesRequest())).queues] == [
            "one",
            "two",
        ]
