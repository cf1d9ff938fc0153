"""Concurrent one-task enqueues over gRPC go to the broker together (wqclient's coalescer), each
caller keeping the answer its own call would have had. Real brokers, real clients; the calls the
client makes are counted on its stub."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.helpers import running_broker
from wqbroker.broker import Broker
from wqclient import AsyncClient, InvalidArgument, Overloaded, PayloadTooLarge, Unavailable
from wqclient._grpc import GrpcTransport


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async with running_broker(max_body=4096, max_tasks=0) as b:
        yield b


def counted(client: AsyncClient) -> Counter[str]:
    """Counts of the client's Enqueue and EnqueueBatch calls (tasks per batch under 'tasks')."""
    transport = client.transport
    assert isinstance(transport, GrpcTransport)
    stub: Any = transport._stub
    calls: Counter[str] = Counter()
    one, many = stub.Enqueue, stub.EnqueueBatch

    def enqueue(request: Any, **kwargs: Any) -> Any:
        calls["Enqueue"] += 1
        return one(request, **kwargs)

    def enqueue_batch(request: Any, **kwargs: Any) -> Any:
        calls["EnqueueBatch"] += 1
        calls["tasks"] += len(request.tasks)
        return many(request, **kwargs)

    stub.Enqueue, stub.EnqueueBatch = enqueue, enqueue_batch
    return calls


async def test_concurrent_enqueues_go_in_few_batches_each_with_its_own_id(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        calls = counted(wq)
        ids = await asyncio.gather(*(wq.enqueue({"n": i}) for i in range(200)))
        assert len(set(ids)) == 200
        assert calls == Counter({"EnqueueBatch": 1, "tasks": 200})  # one turn, one batch
        # each id is its caller's task
        for i, task_id in enumerate(ids):
            assert (await wq.get_task(task_id)).payload == {"n": i}


async def test_producers_in_a_loop_keep_sending_batches(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        calls = counted(wq)

        async def producer(k: int) -> list[str]:
            return [await wq.enqueue({"k": k, "i": i}) for i in range(25)]

        ids = await asyncio.gather(*(producer(k) for k in range(32)))
        assert len({i for batch in ids for i in batch}) == 32 * 25
        assert calls["Enqueue"] + calls["EnqueueBatch"] < 32 * 25 // 8
        assert (await wq.stats()).ready == 32 * 25


async def test_a_lone_caller_sends_one_task_per_call(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        calls = counted(wq)
        for i in range(5):
            await wq.enqueue({"i": i})
        assert calls == Counter({"Enqueue": 5})


async def test_a_bad_task_fails_only_its_caller(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        calls = counted(wq)
        results = await asyncio.gather(
            *(wq.enqueue({"i": i}) for i in range(5)),
            wq.enqueue({"big": "x" * 5000}),  # over the broker's 4096 bytes
            wq.enqueue({"i": 5}, queue="no spaces allowed"),
            *(wq.enqueue({"i": i}) for i in range(6, 10)),
            return_exceptions=True,
        )
        assert isinstance(results[5], PayloadTooLarge)
        assert isinstance(results[6], InvalidArgument)
        assert "queue" in results[6].message
        good = [r for r in results if isinstance(r, str)]
        assert len(good) == len(set(good)) == 9
        assert calls["EnqueueBatch"] >= 1  # tried together first, then one by one
        stats = await wq.stats()
        assert stats.ready == 9


async def test_duplicate_keys_in_one_batch_are_answered_as_duplicates(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        calls = counted(wq)
        results = await asyncio.gather(
            *(wq.enqueue({"i": i}, idempotency_key=f"k{i % 3}") for i in range(9))
        )
        assert calls["EnqueueBatch"] == 1
        firsts = results[:3]
        assert [r.duplicate for r in results] == [False] * 3 + [True] * 6
        assert all(results[i] == firsts[i % 3] for i in range(9))


async def test_a_full_broker_refuses_only_the_tasks_that_do_not_fit() -> None:
    async with (
        running_broker(max_tasks=5) as broker,
        AsyncClient("grpc://" + broker.grpc_target) as wq,
    ):
        results = await asyncio.gather(
            *(wq.enqueue({"i": i}) for i in range(8)), return_exceptions=True
        )
        assert sum(isinstance(r, str) for r in results) == 5
        refused = [r for r in results if not isinstance(r, str)]
        assert len(refused) == 3
        assert all(isinstance(r, Overloaded) for r in refused)


async def test_an_unreachable_broker_fails_every_caller() -> None:
    async with running_broker() as broker:
        target = broker.grpc_target
    async with AsyncClient("grpc://" + target, timeout=2) as wq:
        results = await asyncio.gather(
            *(wq.enqueue({"i": i}) for i in range(10)), return_exceptions=True
        )
        assert all(isinstance(r, Unavailable) for r in results), results
