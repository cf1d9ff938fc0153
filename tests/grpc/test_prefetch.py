"""A stream's prefetch changed while it runs (StreamJobsRequest.prefetch), on every store, over a
real gRPC connection: a larger one is pushed at once, a smaller one takes nothing back and holds
the pushes until fewer tasks than it are unfinished, a bad one ends the call; the worker's count of
its unfinished tasks (outcomes first) never goes above the prefetch in force."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc import StatusCode as Code

from tests.grpc.test_api import Worker, ack_of
from tests.helpers import make_store, running_broker, wait_until
from wqbroker.retry import Backoff
from wqbroker.store import Store
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def store(
    request: pytest.FixtureRequest, rng: random.Random, tmp_path: Path
) -> AsyncIterator[Store]:
    s = await make_store(str(request.param), Backoff(1.0, 30.0, rng), rng, tmp_path)
    yield s
    await s.close()


@pytest.fixture
async def stub(store: Store) -> AsyncIterator[pb_grpc.BrokerAsyncStub]:
    async with (
        running_broker(store=store) as broker,
        grpc.aio.insecure_channel(broker.grpc_target) as channel,
    ):
        yield pb_grpc.BrokerStub(channel)


async def fill(stub: pb_grpc.BrokerAsyncStub, n: int) -> list[str]:
    tasks = [pb.EnqueueRequest(payload=b"%d" % i) for i in range(n)]
    return list((await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=tasks))).ids)


async def handed_out(stub: pb_grpc.BrokerAsyncStub) -> int:
    return (await stub.Stats(pb.StatsRequest())).handed_out


async def test_a_larger_prefetch_is_pushed_at_once(stub: pb_grpc.BrokerAsyncStub) -> None:
    ids = await fill(stub, 20)
    worker = await Worker(stub).open(prefetch=2)
    await worker.until(lambda w: w.unfinished == 2)
    await worker.call.write(pb.StreamJobsRequest(prefetch=7))
    await worker.until(lambda w: w.unfinished == 7)
    assert await handed_out(stub) == 7
    assert [d.task.id for d in worker.received] == ids[:7]  # in order, each once
    # Kept full at the new size while a backlog lasts.
    await worker.send(acks=[ack_of(d) for d in worker.received[:3]])
    await worker.until(lambda w: len(w.received) == 10)
    assert worker.unfinished == 7
    assert worker.max_unfinished == 7
    await worker.send(drain=True)


async def test_a_smaller_prefetch_takes_nothing_back_and_holds_the_pushes(
    stub: pb_grpc.BrokerAsyncStub,
) -> None:
    await fill(stub, 20)
    worker = await Worker(stub).open(prefetch=6)
    await worker.until(lambda w: w.unfinished == 6)
    # Lowered to 2 in the same request as three acks: applied first, so the acks free no slot
    # (3 unfinished, more than 2).
    first = worker.received[:3]
    await worker.call.write(pb.StreamJobsRequest(prefetch=2, acks=[ack_of(d) for d in first]))
    outcomes = await worker.outcomes(3)
    assert [o.code for o in outcomes] == [0, 0, 0]
    assert worker.unfinished == 3
    assert len(worker.received) == 6  # nothing pushed for the freed slots
    assert await handed_out(stub) == 3
    # Two more acks: one unfinished, below 2: one push fills the stream to 2.
    await worker.send(acks=[ack_of(d) for d in worker.received[3:5]])
    await worker.until(lambda w: len(w.received) == 7)
    assert worker.unfinished == 2
    await worker.outcomes(0)
    assert await handed_out(stub) == 2
    # And it stays at 2 from then on.
    await worker.send(acks=[ack_of(d) for d in worker.received[5:7]])
    await worker.until(lambda w: len(w.received) == 9)
    assert worker.unfinished == 2
    assert worker.max_unfinished == 6
    await worker.send(drain=True)


async def test_a_stream_resized_while_draining_a_backlog_holds_what_its_prefetch_allows(
    stub: pb_grpc.BrokerAsyncStub, rng: random.Random
) -> None:
    """Rounds of acks of some held tasks, the prefetch changed at random in some: after each
    round the stream holds exactly what the prefetch in force allows (a lowered one takes
    nothing back), the broker agrees, the worker (outcomes first) never counted more than the
    larger of the prefetches before and after, and every task is delivered exactly once."""
    n = 200
    for _ in range(n // 100):
        await fill(stub, 100)
    prefetch = 8
    worker = await Worker(stub).open(prefetch=prefetch, lease_ms=60_000)
    await worker.until(lambda w: w.unfinished == prefetch)
    while len(worker.received) < n or worker.held:
        held = list(worker.held.values())
        acks = rng.sample(held, rng.randint(1, len(held))) if held else []
        new = rng.randint(1, 24) if rng.random() < 0.4 else None
        before = len(worker.settled)
        await worker.call.write(pb.StreamJobsRequest(prefetch=new, acks=[ack_of(d) for d in acks]))
        bound = max(prefetch, new or 0)
        prefetch = new or prefetch
        left = len(held) - len(acks)
        remaining = n - len(worker.received)
        expected = left if left >= prefetch else min(prefetch, left + remaining)
        while len(worker.settled) < before + len(acks) or worker.unfinished != expected:
            await worker.read()
            assert worker.unfinished <= bound
        assert all(s.code == 0 for s in worker.settled[before:])
        assert await handed_out(stub) == expected
    ids = [d.task.id for d in worker.received]
    assert len(set(ids)) == len(ids) == n
    stats = await stub.Stats(pb.StatsRequest())
    assert (stats.ready, stats.handed_out, stats.totals.acked) == (0, 0, n)
    await worker.send(drain=True)


@pytest.mark.parametrize("bad", [0, -3])
async def test_a_bad_prefetch_ends_the_call_with_invalid_argument(
    stub: pb_grpc.BrokerAsyncStub, bad: int
) -> None:
    await fill(stub, 3)
    worker = await Worker(stub).open(prefetch=1)
    await worker.until(lambda w: w.unfinished == 1)
    await worker.call.write(pb.StreamJobsRequest(prefetch=bad))

    async def read_to_the_end() -> None:
        while await worker.read() is not None:
            pass

    with pytest.raises(grpc.aio.AioRpcError) as e:
        await read_to_the_end()
    assert e.value.code() == Code.INVALID_ARGUMENT
    assert "prefetch" in (e.value.details() or "")
    # The call's task goes back (reclaimed, as for any stream that ends).
    stats = await wait_until(
        lambda: stub.Stats(pb.StatsRequest()),
        lambda s: s.handed_out == 0,
        what="the ended stream's task reclaimed",
    )
    assert (stats.ready + stats.delayed, stats.totals.reclaimed) == (3, 1)


async def test_a_prefetch_above_the_cap_is_clamped(stub: pb_grpc.BrokerAsyncStub) -> None:
    await fill(stub, 30)
    worker = await Worker(stub).open(prefetch=1)
    await worker.until(lambda w: w.unfinished == 1)
    await worker.call.write(pb.StreamJobsRequest(prefetch=2**62))
    await worker.until(lambda w: w.unfinished == 30)
    await worker.send(drain=True)
