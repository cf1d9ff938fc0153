"""gRPC Release (an extension): the holder hands its task back without counting the attempt, as a
worker that is stopping does. A real broker on port 0, a grpc.aio stub and wqclient; and two
brokers on one PostgreSQL database."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest

from tests import pg
from tests.grpc.test_api import Worker, ack_of, claim, enqueue, rpc_error, stats, stats_dict
from tests.helpers import invariant_holds, make_store, running_broker, wait_until
from wqbroker.broker import Broker
from wqbroker.retry import Backoff
from wqbroker.store.postgres import PostgresStore
from wqclient import AsyncClient, LeaseLost, NotFound
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

Code = grpc.StatusCode


def release_of(d: pb.Delivery) -> pb.ReleaseRequest:
    return pb.ReleaseRequest(id=d.task.id, lease_id=d.lease_id)


async def test_a_released_task_is_ready_at_the_head_with_its_attempt_not_counted(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    first = await enqueue(stub, b'"first"', max_attempts=1)
    second = await enqueue(stub, b'"second"')
    d = await claim(stub)
    assert (d.task.id, d.task.attempts) == (first, 1)
    assert await stub.Release(release_of(d)) == pb.ReleaseResponse()
    looked = await stub.GetTask(pb.GetTaskRequest(id=first))
    assert (looked.state, looked.task.attempts, looked.task.last_error) == ("ready", 0, "")
    again = await claim(stub)
    assert (again.task.id, again.task.attempts) == (first, 1)  # ahead of the older one
    await stub.Ack(ack_of(again))
    assert (await claim(stub)).task.id == second
    s = await stats(stub)
    assert (s.totals.nacked, s.totals.retried, s.totals.buried) == (0, 0, 0)
    assert s.totals.delivered == 2  # the attempt given back is not counted
    assert invariant_holds(stats_dict(s))


async def test_a_release_is_refused_as_a_nack_is(stub: pb_grpc.BrokerAsyncStub) -> None:
    task_id = await enqueue(stub, b"1")
    err = await rpc_error(stub.Release(pb.ReleaseRequest(id=task_id, lease_id="x")))
    assert err.code() == Code.NOT_FOUND  # ready, held by nobody
    assert task_id in (err.details() or "")
    d = await claim(stub)
    err = await rpc_error(stub.Release(pb.ReleaseRequest(id=task_id, lease_id="x" + d.lease_id)))
    assert err.code() == Code.FAILED_PRECONDITION
    err = await rpc_error(stub.Release(pb.ReleaseRequest(id="does-not-exist", lease_id="x")))
    assert err.code() == Code.NOT_FOUND
    err = await rpc_error(stub.Release(pb.ReleaseRequest(id=task_id)))
    assert err.code() == Code.INVALID_ARGUMENT
    assert "lease_id" in (err.details() or "")
    assert (await stats(stub)).handed_out == 1  # the holder still has it
    await stub.Release(release_of(d))
    err = await rpc_error(stub.Release(release_of(d)))  # twice: no longer held
    assert err.code() == Code.NOT_FOUND


async def test_a_released_cancelling_task_is_gone(stub: pb_grpc.BrokerAsyncStub) -> None:
    await enqueue(stub, b"1")
    d = await claim(stub)
    answer = await stub.CancelTask(pb.CancelTaskRequest(id=d.task.id))
    assert answer.state == "cancelling"
    await stub.Release(release_of(d))
    err = await rpc_error(stub.GetTask(pb.GetTaskRequest(id=d.task.id)))
    assert err.code() == Code.NOT_FOUND
    s = await stats(stub)
    assert (s.totals.cancelled, s.ready, s.handed_out) == (1, 0, 0)


async def test_a_stream_s_task_released_frees_its_slot(stub: pb_grpc.BrokerAsyncStub) -> None:
    # A stream worker with prefetch 1 hands its task back by the unary call: its slot is free,
    # and the task (at the head) comes to it again, its attempt still the first.
    task_id = await enqueue(stub, b"1")
    other = await enqueue(stub, b"2")
    worker = await Worker(stub).open(prefetch=1)
    await worker.until(lambda w: len(w.received) == 1)
    first = worker.received[0]
    assert first.task.id == task_id
    await stub.Release(release_of(first))
    worker.forget(first)
    await worker.until(lambda w: len(w.received) == 2)
    again = worker.received[1]
    assert (again.task.id, again.task.attempts) == (task_id, 1)
    await worker.send(acks=[ack_of(again)])
    await worker.until(lambda w: len(w.received) == 3)
    assert worker.received[2].task.id == other
    worker.call.cancel()


async def test_the_client_releases_over_grpc(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        task_id = (await wq.enqueue({"n": 1}, max_attempts=1)).id
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        await wq.release(delivery)
        task = await wq.get_task(task_id)
        assert (task.state, task.attempts) == ("ready", 0)
        with pytest.raises(NotFound):
            await wq.release(delivery)
        again = await wq.claim(wait_ms=0)
        assert again is not None
        with pytest.raises(LeaseLost):
            await wq.release(task_id, delivery.lease_id)
        await wq.release(again)


# -- two brokers, one PostgreSQL database ---------------------------------------------------------


@pytest.mark.pg
async def test_a_consumer_waiting_on_another_broker_gets_the_released_task(
    rng: random.Random, tmp_path: Path
) -> None:
    backoff = Backoff(1.0, 30.0, rng)
    first = await make_store("postgres", backoff, rng, tmp_path)  # (the database emptied)
    second = await PostgresStore.open(await pg.database(), backoff, rng, pool_size=4)
    try:
        async with (
            running_broker(store=first) as a,
            running_broker(store=second) as b,
            grpc.aio.insecure_channel(a.grpc_target) as channel_a,
            grpc.aio.insecure_channel(b.grpc_target) as channel_b,
        ):
            stub_a, stub_b = pb_grpc.BrokerStub(channel_a), pb_grpc.BrokerStub(channel_b)
            task_id = await enqueue(stub_a, b"1", max_attempts=1)
            d = await claim(stub_a)
            waiting = asyncio.ensure_future(stub_b.NextJob(pb.NextJobRequest(wait_ms=20_000)))
            await wait_until(lambda: b.service.parked_polls == 1, what="B's claim to park")
            await stub_a.Release(release_of(d))
            got = await asyncio.wait_for(waiting, 15)
            assert got.HasField("delivery")
            assert (got.delivery.task.id, got.delivery.task.attempts) == (task_id, 1)
            await stub_b.Ack(ack_of(got.delivery))
    finally:
        await first.close()
        await second.close()
