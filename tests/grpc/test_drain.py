"""A worker's stream draining a backlog on a durable store (SQLite, PostgreSQL), over a real
gRPC connection: each round's acks and the claim of their successors share a commit (see
tests/service/test_drain.py), and what the worker sees keeps the .proto's promise: the outcomes
that freed its slots come no later than the deliveries that fill them, so a worker counting its
unfinished tasks (outcomes first) never counts more than its prefetch."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.grpc.test_api import Worker, ack_of
from tests.helpers import make_store, running_broker
from wqbroker.retry import Backoff
from wqbroker.store import Store
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc


@pytest.fixture(params=["sqlite", "postgres"])
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


async def test_a_stream_draining_a_backlog_never_holds_more_than_its_prefetch(
    stub: pb_grpc.BrokerAsyncStub, store: Store
) -> None:
    n, prefetch = 200, 8
    for start in range(0, n, 100):
        batch = [pb.EnqueueRequest(payload=b'{"n":%d}' % i) for i in range(start, start + 100)]
        await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=batch))
    worker = await Worker(stub).open(prefetch=prefetch, lease_ms=60_000)
    acked = 0
    while acked < n:
        response = await worker.read(timeout=10)
        assert response is not None
        assert worker.unfinished <= prefetch
        acked += sum(1 for s in response.settled if s.code == 0)
        assert all(s.code == 0 for s in response.settled)
        if response.deliveries:
            await worker.send(acks=[ack_of(d) for d in response.deliveries])
    assert worker.max_unfinished <= prefetch
    ids = [d.task.id for d in worker.received]
    assert len(ids) == n
    assert len(set(ids)) == n
    stats = await stub.Stats(pb.StatsRequest())
    assert (stats.ready, stats.handed_out, stats.totals.acked) == (0, 0, n)
    await worker.send(drain=True)
