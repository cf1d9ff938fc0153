"""Results and workflows (issue 27) end to end: wqclient against a real in-process broker on port 0,
over HTTP and over gRPC, with the same meanings on both: acks with results (the client's, a
stream's, a Worker's), result waits, ``after`` and a batch's indices, parents on deliveries,
lookups with parents and children, the gauges and the listings; results that cross protocols
byte for byte.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.helpers import running_broker
from wqbroker.broker import Broker
from wqclient import (
    AsyncClient,
    Delivery,
    EnqueueItem,
    InvalidArgument,
    NotFound,
    ParentResult,
    Task,
    TaskResult,
)
from wqclient.worker import Worker

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ["http", "grpc"]
MAX_BODY = 4096  # the broker's request (and result) limit here


def url_for(broker: Broker, transport: str) -> str:
    return broker.http_url if transport == "http" else "grpc://" + broker.grpc_target


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async with running_broker(max_body=MAX_BODY) as b:
        yield b


@pytest.fixture
async def client(broker: Broker, transport: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(url_for(broker, transport)) as c:
        yield c


@pytest.fixture
async def other(broker: Broker, transport: str) -> AsyncIterator[AsyncClient]:
    """A client over the other protocol."""
    async with AsyncClient(url_for(broker, "grpc" if transport == "http" else "http")) as c:
        yield c


async def claimed(client: AsyncClient) -> Delivery:
    delivery = await client.claim(wait_ms=0)
    assert delivery is not None
    return delivery


async def test_a_result_is_kept_byte_for_byte_and_read_over_either_protocol(
    client: AsyncClient, other: AsyncClient
) -> None:
    text = b'{"total": 1.10, "big": 1e400, "name": "\\u00e9t\\u00e9", "list": [ 1 ,2 ]}'
    task_id = await client.enqueue({"job": 1}, result_ttl_ms=60_000)
    await client.ack(await claimed(client), result=text)
    for reader in (client, other):
        view = await reader.get_task(task_id)
        answer = await reader.wait_result(task_id, timeout=0)
        assert (view.state, view.result_json, view.result_ttl_ms) == ("succeeded", text, 60_000)
        assert view.finished_at is not None
        assert answer == TaskResult(task_id, "succeeded", text, view.finished_at)
        assert view.result["big"] == float("inf")


async def test_acks_with_and_without_results(client: AsyncClient) -> None:
    kept, forgotten, nothing_kept, null = [await client.enqueue(n) for n in range(3)] + [
        await client.enqueue(3, result_ttl_ms=0)
    ]
    await client.ack(await claimed(client), result={"n": 0})
    await client.ack(await claimed(client))
    await client.ack(await claimed(client), result=None)  # JSON null is a result
    await client.ack(await claimed(client), result="dropped")  # a TTL of 0 keeps none
    assert (await client.get_task(kept)).result == {"n": 0}
    assert (await client.wait_result(nothing_kept, timeout=0)) == TaskResult(
        nothing_kept,
        "succeeded",
        b"null",
        (await client.get_task(nothing_kept)).finished_at,
    )
    for gone in (forgotten, null):
        with pytest.raises(NotFound):
            await client.get_task(gone)
        with pytest.raises(NotFound):
            await client.wait_result(gone, timeout=0)
    stats = await client.stats()
    assert (stats.succeeded, stats.totals.acked) == (2, 4)


async def test_a_wait_is_woken_by_the_end_and_says_how_it_ended(
    client: AsyncClient, other: AsyncClient
) -> None:
    ok, plain, doomed, broken = [
        await client.enqueue(name, max_attempts=1) for name in ("ok", "plain", "doomed", "broken")
    ]
    waits = [asyncio.ensure_future(client.wait_result(i, timeout=20)) for i in (ok, plain, doomed)]
    dead = asyncio.ensure_future(client.wait_result(broken, timeout=20))
    await asyncio.sleep(0.05)
    assert not any(w.done() for w in [*waits, dead])
    # Ended over the other protocol: the waiters are woken all the same.
    await other.ack(await claimed(other), result=[1])
    await other.ack(await claimed(other))
    await other.cancel(doomed)
    await other.nack(await claimed(other), error="it broke")
    succeeded, acked, cancelled = await asyncio.gather(*waits)
    assert succeeded is not None
    assert (succeeded.state, succeeded.result) == ("succeeded", [1])
    assert acked is not None
    assert (acked.state, acked.result_json) == ("succeeded", None)
    assert cancelled is not None
    assert cancelled.state == "cancelled"
    assert await dead == TaskResult(broken, "dead", last_error="it broke", attempts=1)
    assert await client.wait_result(broken, timeout=0) == await dead  # (dead stays)
    pending = await client.enqueue("not yet")
    assert await client.wait_result(pending, timeout=0) is None
    assert await client.wait_result(pending, timeout=0.05) is None


async def test_a_graph_in_one_batch_and_its_parents_on_delivery(
    client: AsyncClient, other: AsyncClient
) -> None:
    outside = await client.enqueue("outside")
    a, b, join = await client.enqueue_many(
        [
            EnqueueItem(b'"a"'),
            EnqueueItem(b'"b"', after=[0]),
            EnqueueItem(b'"join"', after=[1, 0, outside]),
        ]
    )
    view = await client.get_task(join)
    assert (view.state, view.after, view.waiting_for) == ("waiting", (b, a, outside), 3)
    first = await claimed(client)
    assert (first.id, first.parents) == (outside, None)
    await client.ack(first)  # (no result: the child's delivery names it without one)
    second = await claimed(other)
    assert second.id == a
    await other.ack(second, result={"from": "a"})
    third = await claimed(client)
    assert third.id == b
    assert third.parents == (ParentResult(a, b'{"from":"a"}'),)
    await client.ack(third, result=b"2.50")  # (JSON text: sent as it is)
    last = await claimed(other)
    assert last.id == join
    assert last.parents == (
        ParentResult(b, b"2.50"),
        ParentResult(a, b'{"from":"a"}'),
        ParentResult(outside, None),
    )
    assert last.task.parents == last.parents
    assert last.task.after == (b, a, outside)
    parent = await client.get_task(a)
    assert (parent.children, parent.children_count) == ((b, join), 2)


async def test_an_unknown_parent_refuses_the_whole_batch_naming_the_item(
    client: AsyncClient,
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        await client.enqueue_many(["fine", EnqueueItem(b'"orphan"', after=["0123456789abcdef"])])
    assert refused.value.message.startswith("tasks[1].after[0]")
    with pytest.raises(InvalidArgument) as refused:
        await client.enqueue("orphan", after=["0123456789abcdef"])
    assert refused.value.message.startswith("after[0]")
    assert (await client.stats()).totals.enqueued == 0


async def test_the_gauges_and_listings_of_waiting_and_succeeded(client: AsyncClient) -> None:
    root = await client.enqueue("root", queue="flow")
    children = [await client.enqueue(n, queue="flow", after=[root]) for n in range(3)]
    assert [t.id for t in await client.list_tasks("flow", "waiting")] == children
    stats = await client.stats("flow")
    assert (stats.waiting, stats.ready, stats.succeeded) == (3, 1, 0)
    await client.ack(await claimed_from(client, "flow"), result="root done")
    [row] = [q for q in await client.queues() if q.name == "flow"]
    assert (row.waiting, row.ready, row.succeeded) == (0, 3, 1)
    [done] = await client.list_tasks("flow", "succeeded")
    assert (done.id, done.state, done.result) == (root, "succeeded", "root done")


async def claimed_from(client: AsyncClient, queue: str) -> Delivery:
    delivery = await client.claim(wait_ms=0, queues=queue)
    assert delivery is not None
    return delivery


async def test_a_workers_return_values_are_the_results(
    client: AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    def handler(task: Task) -> Any:
        kind = task.payload
        if kind == "sum":
            return sum(p.result for p in task.parents or ())
        if kind == "set":
            return {1}
        if kind == "huge":
            return "x" * (2 * MAX_BODY)  # over the broker's limit: refused
        if kind == "nothing":
            return None
        return len(kind)

    ids = await client.enqueue_many(
        [
            EnqueueItem(b'"abc"'),
            EnqueueItem(b'"abcde"'),
            EnqueueItem(b'"sum"', after=[0, 1]),
            EnqueueItem(b'"nothing"'),
            EnqueueItem(b'"set"', max_attempts=3),
            EnqueueItem(b'"huge"', max_attempts=3),
        ]
    )
    caplog.set_level(logging.WARNING, logger="wqclient.worker")
    worker = Worker(client, handler, concurrency=2)
    run = asyncio.ensure_future(worker.run())
    try:
        summed = await client.wait_result(ids[2], timeout=20)
        unencodable = await client.wait_result(ids[4], timeout=20)
        refused = await client.wait_result(ids[5], timeout=20)
    finally:
        worker.stop()
        await asyncio.wait_for(run, 10)
    assert summed is not None
    assert summed.result == 3 + 5
    assert [(await client.get_task(i)).result for i in ids[:2]] == [3, 5]
    with pytest.raises(NotFound):
        await client.get_task(ids[3])  # None: acked without a result, as always
    assert unencodable is not None
    assert unencodable.state == "dead"
    assert (unencodable.last_error or "").startswith("result is not JSON: ")
    assert unencodable.attempts == 1  # buried at once: running it again would fail the same way
    assert refused is not None
    assert refused.state == "dead"
    assert (refused.last_error or "").startswith("result refused by the broker: ")
    assert refused.attempts == 1
    assert (worker.succeeded, worker.failed) == (4, 2)
