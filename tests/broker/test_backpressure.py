"""Backpressure: -max-tasks refuses enqueues (429 + Retry-After / RESOURCE_EXHAUSTED with
retry-after-ms) once that many tasks are held, a batch whole; -max-waiters refuses long-polls and
streams beyond that many at once instead of parking them. Over HTTP, gRPC, wqclient and the CLI;
nothing accepted is ever dropped."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from tests.helpers import Http, http_client, invariant_holds, running_broker, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqclient import AsyncClient, Overloaded, PayloadTooLarge
from wqclient.cli.producer import build_parser, produce
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc


@pytest.fixture
async def small() -> AsyncIterator[Broker]:
    """At most 3 tasks held, at most 2 consumers waiting; a fake clock keeps polls parked."""
    async with running_broker(clock=FakeClock(), max_tasks=3, max_waiters=2) as broker:
        yield broker


async def refused(http: Http, method: str, path: str, **kw: object) -> str:
    async with http.session.request(method, http.base + path, **kw) as resp:  # type: ignore[arg-type]
        body = await resp.json()
        assert resp.status == 429, body
        assert resp.headers["Retry-After"] == "1"
        return str(body["error"])


async def test_enqueues_past_the_task_limit_get_429_until_room_is_made(small: Broker) -> None:
    async with http_client(small.http_url) as http:
        await http.enqueue("a", max_attempts=1)
        await http.enqueue("b", delay_ms=60_000)  # delayed tasks are held too
        await http.enqueue("c")
        message = await refused(http, "POST", "/jobs", json={"payload": "d"})
        assert "holds 3 tasks" in message
        assert "at most 3" in message
        stats = await http.stats()
        assert (stats["ready"], stats["delayed"], stats["totals"]["enqueued"]) == (2, 1, 3)
        # A handed-out task is still held; a dead one is not.
        delivery = await http.claim()
        await refused(http, "POST", "/jobs", json={"payload": "d"})
        assert await http.nack(delivery["task"]["id"], delivery["lease_id"], "no") == 204
        assert (await http.stats())["dead"] == 1
        await http.enqueue("d")
        assert invariant_holds(await http.stats())


async def test_a_batch_that_does_not_fit_is_refused_whole_over_grpc(small: Broker) -> None:
    async with grpc.aio.insecure_channel(small.grpc_target) as channel:
        stub = pb_grpc.BrokerStub(channel)
        await stub.Enqueue(pb.EnqueueRequest(payload=b"1"))
        batch = pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"2")] * 3)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.EnqueueBatch(batch)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        metadata: Any = e.value.trailing_metadata()
        assert metadata["retry-after-ms"] == "1000"
        stats = await stub.Stats(pb.StatsRequest())
        assert (stats.ready, stats.totals.enqueued) == (1, 1)  # nothing of the batch
        two = pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"2")] * 2)
        assert len((await stub.EnqueueBatch(two)).ids) == 2


@pytest.mark.parametrize("scheme", ["http", "grpc"])
async def test_the_client_raises_overloaded_with_the_wait_and_payload_too_large_stays_apart(
    scheme: str,
) -> None:
    async with running_broker(max_tasks=1, max_body=1024) as broker:
        url = broker.http_url if scheme == "http" else f"grpc://{broker.grpc_target}"
        async with AsyncClient(url) as wq:
            with pytest.raises(PayloadTooLarge):  # a size limit is not a busy broker
                await wq.enqueue("x" * 2000)
            await wq.enqueue(1)
            with pytest.raises(Overloaded) as e:
                await wq.enqueue(2)
            assert e.value.retry_after == 1.0
            assert not isinstance(e.value, PayloadTooLarge)


async def test_waiters_past_the_limit_are_refused_at_once_not_parked(small: Broker) -> None:
    async with http_client(small.http_url) as http:
        parked = [
            asyncio.ensure_future(http.request("GET", "/jobs/next?wait_ms=30000")) for _ in range(2)
        ]
        await wait_until(lambda: small.service.waiting == 2, what="two parked polls")
        message = await refused(http, "GET", "/jobs/next?wait_ms=30000")
        assert "2 consumers are already waiting" in message
        # A claim that would not wait is no waiter: it is answered as ever.
        status, _ = await http.request("GET", "/jobs/next?wait_ms=0")
        assert status == 204
        async with grpc.aio.insecure_channel(small.grpc_target) as channel:
            stream = pb_grpc.BrokerStub(channel).StreamJobs(
                iter([pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=1))])
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stream:
                    pass
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # One of the parked polls gets a task and leaves: there is room again.
        await http.enqueue("work")
        done, _ = await asyncio.wait(parked, return_when=asyncio.FIRST_COMPLETED)
        assert [t.result()[0] for t in done] == [200]
        again = asyncio.ensure_future(http.request("GET", "/jobs/next?wait_ms=30000"))
        await wait_until(lambda: small.service.waiting == 2, what="a poll parked again")
        for task in [*parked, again]:
            task.cancel()
        await asyncio.gather(*parked, again, return_exceptions=True)


async def test_the_producer_waits_out_the_task_limit_and_loses_nothing() -> None:
    async with running_broker(max_tasks=5) as broker:
        args = build_parser().parse_args(["-broker", broker.http_url, "-n", "12"])
        out, err = io.StringIO(), io.StringIO()
        producing = asyncio.ensure_future(produce(args, out, err))
        async with http_client(broker.http_url) as http:
            # Nothing is taken until the producer has been told the broker is full.
            await wait_until(lambda: "retrying" in err.getvalue(), what="the limit's refusal")
            assert (await http.stats())["ready"] == 5
            acked = 0
            while acked < 12:
                delivery = await http.claim(wait_ms=5000)
                assert await http.ack(delivery["task"]["id"], delivery["lease_id"]) == 204
                acked += 1
            assert await producing == 0
            stats = await http.stats()
        assert stats["totals"]["enqueued"] == 12
        assert "enqueued 12, failed 0" in out.getvalue()
        [line] = [x for x in err.getvalue().splitlines() if "retrying" in x]
        assert "at most 5" in line
