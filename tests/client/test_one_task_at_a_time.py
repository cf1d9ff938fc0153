"""The library used one task at a time, over gRPC (and over HTTP, where the broker has POST
/jobs/batch): concurrent one-task enqueues go to the broker
together (wqclient's coalescer), each caller keeping the answer its own call would have had; a
sequential stream loop's acks go out together, without a round trip each, and a caller who must
know an ack landed still can. Real brokers, real clients; the calls the client makes are counted
on its stub."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import running_broker, wait_until
from wqbroker.broker import Broker
from wqclient import (
    AsyncClient,
    Client,
    Delivery,
    Enqueued,
    InvalidArgument,
    LeaseLost,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    ProtocolError,
    Task,
    Unavailable,
    Worker,
)
from wqclient._grpc import GrpcStream, GrpcTransport, _delivery, _Fields
from wqclient._http import HttpTransport
from wqwire.pb import broker_pb2 as pb


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async with running_broker(max_body=4096, max_tasks=0) as b:
        yield b


def counted(client: AsyncClient) -> Counter[str]:
    """Counts of the client's Enqueue and EnqueueBatch calls and of the batches it sends over
    its producing stream ('Produce'; the tasks of all batches under 'tasks')."""
    transport = client.transport
    assert isinstance(transport, GrpcTransport)
    stub: Any = transport._stub
    calls: Counter[str] = Counter()
    one, many, produce = stub.Enqueue, stub.EnqueueBatch, transport._produce

    async def produced(request: Any) -> Any:
        calls["Produce"] += 1
        calls["tasks"] += len(request.tasks)
        response = await produce(request)
        if response is None:  # the broker has no Produce: an EnqueueBatch call follows
            calls["Produce"] -= 1
            calls["tasks"] -= len(request.tasks)
        return response

    def enqueue(request: Any, **kwargs: Any) -> Any:
        calls["Enqueue"] += 1
        return one(request, **kwargs)

    def enqueue_batch(request: Any, **kwargs: Any) -> Any:
        calls["EnqueueBatch"] += 1
        calls["tasks"] += len(request.tasks)
        return many(request, **kwargs)

    stub.Enqueue, stub.EnqueueBatch = enqueue, enqueue_batch
    transport._produce = produced  # type: ignore[method-assign]
    return calls


async def test_concurrent_enqueues_go_in_few_batches_each_with_its_own_id(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        calls = counted(wq)
        ids = await asyncio.gather(*(wq.enqueue({"n": i}) for i in range(200)))
        assert len(set(ids)) == 200
        assert calls == Counter({"Produce": 1, "tasks": 200})  # one turn, one batch
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
        assert calls["Enqueue"] + calls["EnqueueBatch"] + calls["Produce"] < 32 * 25 // 8
        assert (await wq.stats()).ready == 32 * 25


async def test_a_lone_caller_sends_one_task_at_a_time_over_the_stream(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        calls = counted(wq)
        ids = [await wq.enqueue({"i": i}) for i in range(5)]
        assert calls == Counter({"Produce": 5, "tasks": 5})  # a batch of one each, no call
        assert [(await wq.get_task(i)).payload for i in ids] == [{"i": i} for i in range(5)]
        again = await wq.enqueue({"k": 1}, idempotency_key="k")
        duplicate = await wq.enqueue({"k": 2}, idempotency_key="k")
        assert duplicate == again
        assert duplicate.duplicate


async def test_a_lone_task_refused_gets_the_error_its_own_call_gives(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        calls = counted(wq)
        with pytest.raises(InvalidArgument) as e:
            await wq.enqueue({"i": 1}, queue="no spaces allowed")
        # Refused as a batch of one ("tasks[0].queue ..."), then sent again as an Enqueue call,
        # whose answer is the caller's: as it always was.
        assert e.value.message.startswith("queue ")
        assert calls == Counter({"Produce": 1, "tasks": 1, "Enqueue": 1})
        with pytest.raises(PayloadTooLarge):
            await wq.enqueue({"big": "x" * 5000})
        assert (await wq.stats()).totals.enqueued == 0


@pytest.mark.parametrize("transport", ["grpc", "http"])
async def test_a_bad_task_fails_only_its_caller(broker: Broker, transport: str) -> None:
    url = "grpc://" + broker.grpc_target if transport == "grpc" else broker.http_url
    async with AsyncClient(url) as wq:
        calls = counted(wq) if transport == "grpc" else http_calls(wq)
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
        # tried together first, then one by one
        assert calls["Produce" if transport == "grpc" else "POST /jobs/batch"] >= 1
        stats = await wq.stats()
        assert stats.ready == 9


async def test_duplicate_keys_in_one_batch_are_answered_as_duplicates(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        calls = counted(wq)
        results = await asyncio.gather(
            *(wq.enqueue({"i": i}, idempotency_key=f"k{i % 3}") for i in range(9))
        )
        assert calls["Produce"] == 1
        firsts = results[:3]
        assert [r.duplicate for r in results] == [False] * 3 + [True] * 6
        assert all(results[i] == firsts[i % 3] for i in range(9))


@pytest.mark.parametrize("transport", ["grpc", "http"])
async def test_a_full_broker_refuses_only_the_tasks_that_do_not_fit(transport: str) -> None:
    async with running_broker(max_tasks=5) as broker:
        url = "grpc://" + broker.grpc_target if transport == "grpc" else broker.http_url
        wq = AsyncClient(url)
        async with wq:
            results = await asyncio.gather(
                *(wq.enqueue({"i": i}) for i in range(8)), return_exceptions=True
            )
        assert sum(isinstance(r, str) for r in results) == 5
        refused = [r for r in results if not isinstance(r, str)]
        assert len(refused) == 3
        assert all(isinstance(r, Overloaded) for r in refused)


@pytest.mark.parametrize("transport", ["grpc", "http"])
async def test_an_unreachable_broker_fails_every_caller(transport: str) -> None:
    async with running_broker() as broker:
        url = "grpc://" + broker.grpc_target if transport == "grpc" else broker.http_url
    async with AsyncClient(url, timeout=2) as wq:
        results = await asyncio.gather(
            *(wq.enqueue({"i": i}) for i in range(10)), return_exceptions=True
        )
        assert all(isinstance(r, Unavailable) for r in results), results


# -- acks on a stream ------------------------------------------------------------------------------


def ack_requests(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the stream requests that carry acks, and the acks in them."""
    sent: Counter[str] = Counter()
    flush = GrpcStream._flush

    def counting(self: GrpcStream) -> None:
        batch = self._batch  # the request being gathered, about to be queued
        if batch is not None and batch.acks:
            sent["requests"] += 1
            sent["acks"] += len(batch.acks)
        flush(self)

    monkeypatch.setattr(GrpcStream, "_flush", counting)
    return sent


async def test_a_sequential_stream_loop_sends_its_acks_together(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = ack_requests(monkeypatch)
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        await wq.enqueue_many([{"i": i} for i in range(300)])
        stream = await wq.stream(prefetch=50)
        seen = []
        async for d in stream:
            await stream.ack(d)
            seen.append(d.task.payload["i"])
            if len(seen) == 300:
                break
        assert await stream.flush() == []  # every ack answered, none refused
        stats = await wq.stats()
        assert (stats.totals.acked, stats.handed_out, stats.ready) == (300, 0, 0)
        await stream.close()
    assert sorted(seen) == list(range(300))
    assert sent["acks"] == 300
    assert sent["requests"] <= 300 // 10  # not one message per ack


async def lost_lease(wq: AsyncClient) -> tuple[GrpcStream, Delivery]:
    """A stream holding a delivery whose lease the broker has reclaimed."""
    await wq.enqueue("slow")
    stream = await wq.stream(prefetch=2, lease_ms=100)
    assert isinstance(stream, GrpcStream)
    stale = await anext(stream)
    await wait_until(wq.stats, lambda s: s.totals.reclaimed >= 1, what="the lease to be reclaimed")
    return stream, stale


async def test_an_unconfirmed_ack_that_is_refused_is_logged_and_flushed(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        stream, stale = await lost_lease(wq)
        await stream.ack(stale)  # queued: no error here
        refused = await stream.flush()
        assert [(d.task.id, type(e)) for d, e in refused] in (
            [(stale.task.id, LeaseLost)],
            [(stale.task.id, NotFound)],
        )
        assert await stream.flush() == []  # handed over once
        assert any(
            stale.task.id in r.getMessage() and "refused" in r.getMessage() for r in caplog.records
        )
        await stream.close()


async def test_a_confirmed_ack_raises_its_refusal(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        stream, stale = await lost_lease(wq)
        with pytest.raises((LeaseLost, NotFound)):
            await stream.ack(stale, confirm=True)
        with pytest.raises((LeaseLost, NotFound)):
            await stream.nack(stale, "late", confirm=True)
        assert await stream.flush() == []  # confirmed refusals were raised, not kept
        await stream.close()


async def test_the_blocking_stream_acks_without_a_round_trip_and_flushes(broker: Broker) -> None:
    def scenario() -> None:
        with Client("grpc://" + broker.grpc_target) as wq:
            wq.enqueue_many([{"i": i} for i in range(20)])
            stream = wq.stream(prefetch=20)
            for n, d in enumerate(stream, 1):
                stream.ack(d)
                if n == 20:
                    break
            assert stream.flush() == []
            assert wq.stats().totals.acked == 20
            stream.close()

    await asyncio.to_thread(scenario)


# -- reading deliveries ---------------------------------------------------------------------------


@given(
    last_error=st.none() | st.text(max_size=20),
    queue=st.sampled_from(["", "default", "emails"]),
    priority=st.integers(0, 9),
    attempts=st.integers(0, 10**6),
    seconds=st.integers(0, 4 * 10**9),
    nanos=st.integers(0, 999_999_999),
)
def test_a_delivery_read_directly_is_the_one_the_generic_reader_makes(
    last_error: str | None, queue: str, priority: int, attempts: int, seconds: int, nanos: int
) -> None:
    when = Timestamp(seconds=seconds, nanos=nanos)
    task = pb.Task(
        id="00ab",
        payload=b'{"a": 1}',
        attempts=attempts,
        max_attempts=attempts + 1,
        created_at=when,
        available_at=when,
        queue=queue,
        priority=priority,
    )
    if last_error is not None:
        task.last_error = last_error
    d = pb.Delivery(task=task, lease_id="l1", deadline=when)
    assert _delivery(d) == Delivery.from_mapping(_Fields(d))


def test_a_delivery_missing_a_field_is_a_protocol_error() -> None:
    when = Timestamp(seconds=1)
    whole = pb.Delivery(
        task=pb.Task(id="1", payload=b"1", created_at=when, available_at=when),
        lease_id="l",
        deadline=when,
    )
    cuts: list[Callable[[pb.Delivery], None]] = [
        lambda d: d.ClearField("task"),
        lambda d: d.ClearField("deadline"),
        lambda d: d.task.ClearField("created_at"),
        lambda d: d.task.ClearField("available_at"),
    ]
    for cut in cuts:
        d = pb.Delivery()
        d.CopyFrom(whole)
        cut(d)
        with pytest.raises(ProtocolError):
            _delivery(d)


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` served on a port of its own (a broker of another kind: an older one, say); its
    URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


# -- over HTTP: concurrent enqueues in one POST /jobs/batch ---------------------------------------


def http_calls(client: AsyncClient) -> Counter[str]:
    """Counts the client's POST /jobs and POST /jobs/batch requests (tasks per batch under
    'tasks')."""
    transport = client.transport
    assert isinstance(transport, HttpTransport)
    calls: Counter[str] = Counter()
    call = transport._call

    async def counting(method: str, path: str, **kwargs: Any) -> tuple[int, bytes]:
        if (method, path) == ("POST", "/jobs"):
            calls["POST /jobs"] += 1
        elif (method, path) == ("POST", "/jobs/batch"):
            calls["POST /jobs/batch"] += 1
            calls["tasks"] += kwargs["body"].count(b'{"payload":')
        return await call(method, path, **kwargs)

    transport._call = counting  # type: ignore[method-assign]
    return calls


async def test_over_http_concurrent_enqueues_go_in_one_request_each_with_its_own_id() -> None:
    async with running_broker(grpc_addr="off") as broker, AsyncClient(broker.http_url) as wq:
        calls = http_calls(wq)
        ids = await asyncio.gather(
            *(
                wq.enqueue({"n": i}, priority=i % 10, idempotency_key=f"k{i % 150}")
                for i in range(200)
            )
        )
        assert calls == Counter({"POST /jobs/batch": 1, "tasks": 200})
        assert len(set(ids)) == 150
        assert [i.duplicate for i in ids] == [False] * 150 + [True] * 50
        for i, task_id in enumerate(ids[:150]):
            task = await wq.get_task(task_id)
            assert (task.payload, task.priority) == ({"n": i}, i % 10)


async def test_over_http_a_lone_caller_posts_one_task_per_request() -> None:
    async with running_broker(grpc_addr="off") as broker, AsyncClient(broker.http_url) as wq:
        calls = http_calls(wq)
        for i in range(5):
            await wq.enqueue({"i": i})
        assert calls == Counter({"POST /jobs": 5})


async def test_over_http_enqueue_many_is_one_request_or_parts_of_it_when_too_large() -> None:
    async with (
        running_broker(grpc_addr="off", max_body=4096) as broker,
        AsyncClient(broker.http_url) as wq,
    ):
        calls = http_calls(wq)
        ids = await wq.enqueue_many([{"i": i} for i in range(10)])
        assert calls == Counter({"POST /jobs/batch": 1, "tasks": 10})
        calls.clear()
        # 20 tasks of 1 KB: a body over the broker's 4096 bytes, sent in parts (each a batch).
        more = await wq.enqueue_many([{"i": i, "pad": "x" * 1000} for i in range(20)])
        assert calls["POST /jobs"] == 0
        assert calls["POST /jobs/batch"] > 1
        for i, task_id in enumerate(ids + more):
            assert (await wq.get_task(task_id)).payload["i"] == (i if i < 10 else i - 10)
        order = [(await wq.claim(wait_ms=0)) for _ in range(30)]
        assert [d.id for d in order if d is not None] == ids + more  # in the order given


async def test_over_http_an_older_broker_without_batches_gets_one_task_per_request() -> None:
    # A broker from before POST /jobs/batch: it answers it as aiohttp does a path it has under
    # another method (405), and takes POST /jobs.
    taken: list[bytes] = []

    async def enqueue(request: web.Request) -> web.Response:
        taken.append(await request.read())
        return web.json_response({"id": f"t{len(taken)}"}, status=201)

    async def lookup(request: web.Request) -> web.Response:
        return web.json_response({"error": "no"}, status=404)

    app = web.Application()
    app.router.add_post("/jobs", enqueue)
    app.router.add_get("/jobs/{id}", lookup)
    async with serving(app) as url:
        async with AsyncClient(url) as wq:
            calls = http_calls(wq)
            ids = await asyncio.gather(*(wq.enqueue({"i": i}) for i in range(5)))
            assert sorted(ids) == [f"t{i}" for i in range(1, 6)]
            assert calls == Counter({"POST /jobs/batch": 1, "tasks": 5, "POST /jobs": 5})
            calls.clear()
            assert await wq.enqueue_many([1, 2, 3]) == ["t6", "t7", "t8"]
            assert calls == Counter({"POST /jobs": 3})  # it is not asked again
        assert taken[-3:] == [b'{"payload":1}', b'{"payload":2}', b'{"payload":3}']


# -- over HTTP: acks and nacks together, claims for many ------------------------------------------


def settle_calls(client: AsyncClient) -> Counter[str]:
    """Counts the client's settling and claiming requests, by route."""
    transport = client.transport
    assert isinstance(transport, HttpTransport)
    calls: Counter[str] = Counter()
    call = transport._call

    async def counting(method: str, path: str, **kwargs: Any) -> tuple[int, bytes]:
        route = path.partition("?")[0]
        if route.endswith(("/ack", "/nack")):
            route = "/jobs/{id}/" + route.rsplit("/", 1)[1]
        calls[f"{method} {route}"] += 1
        return await call(method, path, **kwargs)

    transport._call = counting  # type: ignore[method-assign]
    return calls


async def test_over_http_concurrent_acks_and_nacks_go_in_one_request_each_with_its_outcome() -> (
    None
):
    async with running_broker(grpc_addr="off") as broker, AsyncClient(broker.http_url) as wq:
        await wq.enqueue_many([{"i": i} for i in range(30)])
        held = await wq.claim_many(30, wait_ms=0)
        assert len(held) == 30
        calls = settle_calls(wq)
        stale = held[0]
        await wq.ack(stale)  # (alone: its own request)
        assert calls == Counter({"POST /jobs/{id}/ack": 1})
        calls.clear()
        results = await asyncio.gather(
            wq.ack(stale),  # a second time: refused, for this caller only
            *(wq.ack(d) for d in held[1:20]),
            *(wq.nack(d, error="boom", delay_ms=0) for d in held[20:]),
            return_exceptions=True,
        )
        assert calls == Counter({"POST /jobs/settle": 1})
        assert isinstance(results[0], NotFound)
        assert results[1:] == [None] * 29
        stats = await wq.stats()
        assert (stats.totals.acked, stats.totals.nacked) == (20, 10)


async def test_over_http_a_malformed_ack_among_concurrent_ones_fails_only_its_caller() -> None:
    async with running_broker(grpc_addr="off") as broker, AsyncClient(broker.http_url) as wq:
        await wq.enqueue_many([{"i": i} for i in range(6)])
        held = await wq.claim_many(6, wait_ms=0)
        calls = settle_calls(wq)
        results = await asyncio.gather(
            wq.ack(held[0].id, ""),  # malformed: the broker refuses the whole batch for it
            *(wq.ack(d) for d in held[1:4]),
            *(wq.nack(d, error="boom", delay_ms=0) for d in held[4:]),
            return_exceptions=True,
        )
        assert isinstance(results[0], InvalidArgument)
        assert "lease_id" in str(results[0])
        assert results[1:] == [None] * 5
        # the batch, then each again alone
        assert calls == Counter(
            {"POST /jobs/settle": 1, "POST /jobs/{id}/ack": 4, "POST /jobs/{id}/nack": 2}
        )
        stats = await wq.stats()
        assert (stats.totals.acked, stats.totals.nacked) == (3, 2)
        assert stats.handed_out == 1  # the one whose ack was malformed is still held


async def test_over_http_very_many_concurrent_acks_go_in_a_few_requests() -> None:
    async with running_broker(grpc_addr="off") as broker, AsyncClient(broker.http_url) as wq:
        await wq.enqueue_many([{"i": i} for i in range(1200)])
        held = await wq.claim_many(1000, wait_ms=0)
        held += await wq.claim_many(1000, wait_ms=0)
        assert len(held) == 1200
        calls = settle_calls(wq)
        await asyncio.gather(*(wq.ack(d) for d in held))
        assert calls == Counter({"POST /jobs/settle": 3})  # 500 at most, each
        assert (await wq.stats()).totals.acked == 1200


async def test_over_http_claim_many_takes_up_to_max_in_one_request() -> None:
    async with running_broker(grpc_addr="off") as broker, AsyncClient(broker.http_url) as wq:
        ids = await wq.enqueue_many([{"i": i} for i in range(7)])
        calls = settle_calls(wq)
        got = await wq.claim_many(5, wait_ms=0)
        assert [d.id for d in got] == ids[:5]
        assert [d.id for d in await wq.claim_many(5, wait_ms=0)] == ids[5:]
        assert await wq.claim_many(5, wait_ms=0) == []
        assert calls == Counter({"GET /jobs/next/batch": 3})
        with pytest.raises(InvalidArgument):
            await wq.claim_many(0)


async def test_the_blocking_client_claims_many_too() -> None:
    async with running_broker(grpc_addr="off") as broker:

        def scenario() -> list[Enqueued]:
            with Client(broker.http_url) as wq:
                ids = wq.enqueue_many([1, 2, 3])
                got = wq.claim_many(5, wait_ms=0)
                for d in got:
                    wq.ack(d)
                assert wq.stats().totals.acked == 3
                assert [d.id for d in got] == ids
                return ids

        assert len(await asyncio.to_thread(scenario)) == 3


async def test_over_grpc_claim_many_takes_one() -> None:
    async with running_broker() as broker, AsyncClient("grpc://" + broker.grpc_target) as wq:
        ids = await wq.enqueue_many([1, 2])
        assert not wq.claims_many
        assert [d.id for d in await wq.claim_many(5, wait_ms=0)] == ids[:1]


async def test_over_http_a_worker_claims_for_all_its_free_slots_at_once() -> None:
    async with running_broker(grpc_addr="off") as broker, AsyncClient(broker.http_url) as wq:
        await wq.enqueue_many([{"i": i} for i in range(200)])
        calls = settle_calls(wq)
        seen: list[int] = []
        worker: Worker | None = None

        async def handler(task: Task) -> None:
            seen.append(task.payload["i"])
            if len(seen) == 200 and worker is not None:
                worker.stop()

        worker = Worker(wq, handler, concurrency=20, wait_ms=1000)
        await asyncio.wait_for(worker.run(), 30)
        assert sorted(seen) == list(range(200))
        stats = await wq.stats()
        assert (stats.totals.acked, stats.handed_out, stats.ready) == (200, 0, 0)
        # Far fewer requests than tasks: claims for many, acks together.
        assert calls["GET /jobs/next/batch"] < 100
        assert calls["POST /jobs/settle"] + calls["POST /jobs/{id}/ack"] < 100
        assert calls["GET /jobs/next"] == 0


async def test_over_http_an_older_broker_without_batch_claims_gets_the_claim_loops() -> None:
    # A broker from before GET /jobs/next/batch and POST /jobs/settle: both answered 404.
    tasks = {f"t{i}": {"payload": i} for i in range(6)}
    acked: list[str] = []
    when = "2026-12-01T00:00:00.000000Z"

    async def claim(request: web.Request) -> web.Response:
        if not tasks:
            await asyncio.sleep(0.05)
            return web.Response(status=204)
        task_id, task = tasks.popitem()
        body = {
            "task": {"id": task_id, **task, "attempts": 1, "max_attempts": 3,
                     "created_at": when, "available_at": when, "last_error": None},
            "lease_id": "l" + task_id,
            "deadline": "2099-01-01T00:00:00.000000Z",
        }  # fmt: skip
        return web.json_response(body)

    async def ack(request: web.Request) -> web.Response:
        acked.append(request.match_info["id"])
        return web.Response(status=204)

    app = web.Application()
    app.router.add_get("/jobs/next", claim)
    app.router.add_post("/jobs/{id}/ack", ack)
    async with serving(app) as url:
        async with AsyncClient(url) as wq:
            calls = settle_calls(wq)
            done: list[str] = []
            worker: Worker | None = None

            async def handler(task: Task) -> None:
                done.append(task.id)
                if len(done) == 6 and worker is not None:
                    worker.stop()

            worker = Worker(wq, handler, concurrency=3, wait_ms=100)
            await asyncio.wait_for(worker.run(), 20)
            assert sorted(done) == sorted(f"t{i}" for i in range(6))
            assert sorted(acked) == sorted(done)
            assert not wq.claims_many
            assert calls["GET /jobs/next/batch"] == 1  # asked once
            assert calls["POST /jobs/settle"] <= 1
