"""wqclient against real brokers: AsyncClient, the blocking Client, gRPC streams, the Worker
runner and LogFileHandler.

Every broker here runs in-process on 127.0.0.1 (port 0 unless a test needs a fixed one) and every
operation that both transports offer is exercised over both. Nothing sleeps for a fixed time to
synchronise: tests poll for the condition they wait for, with a short interval and a time-out.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fake_transport import FakeStreamingTransport, FakeTransport
from tests.helpers import running_broker, wait_until
from tests.procs import free_port
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqclient import (
    AsyncClient,
    AsyncStream,
    Client,
    Delivery,
    InvalidArgument,
    LeaseLost,
    NotFound,
    PayloadTooLarge,
    ProtocolError,
    Stats,
    StreamEnded,
    Task,
    Totals,
    Unavailable,
    WqError,
)
from wqclient.cli.worker import LogFileHandler
from wqclient.client import grpc_target
from wqclient.worker import TaskFailed, Worker

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ["http", "grpc"]
WORKER_LOG = "wqclient.worker"


# -- helpers ------------------------------------------------------------------------------------


def url_for(broker: Broker, transport: str) -> str:
    return broker.http_url if transport == "http" else "grpc://" + broker.grpc_target


def closed_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago and where nothing listens now (from below
    the ephemeral range, so no outgoing connection takes it meanwhile)."""
    return free_port()


async def next_delivery(stream: AsyncStream, timeout: float = 5.0) -> Delivery:
    return await asyncio.wait_for(anext(stream), timeout)


@asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``worker`` in the background; stop it and wait for run() to return on the way out."""
    task = asyncio.ensure_future(worker.run())
    try:
        yield task
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)


def logged(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == WORKER_LOG and text in r.getMessage()]


def broker_config_on(transport: str, addr: str) -> dict[str, Any]:
    """Config for a broker whose ``transport`` listens on the fixed ``addr``."""
    if transport == "http":
        return {"addr": addr, "grpc_addr": "127.0.0.1:0"}
    return {"addr": "127.0.0.1:0", "grpc_addr": addr}


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    # A small backoff base so retried tasks come back within milliseconds.
    async with running_broker(backoff_base=0.01, max_body=256 * 1024) as b:
        yield b


@pytest.fixture
async def client(broker: Broker, transport: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(url_for(broker, transport)) as c:
        yield c


@pytest.fixture
async def grpc_client(broker: Broker) -> AsyncIterator[AsyncClient]:
    async with AsyncClient("grpc://" + broker.grpc_target) as c:
        yield c


# -- AsyncClient: enqueue -----------------------------------------------------------------------

PAYLOADS: list[Any] = [
    None,
    True,
    0,
    -1.5,
    "text",
    "héllo ✓ 中文",
    [],
    [1, "two", None],
    {},
    {"nested": {"list": [1, {"deep": [None, False]}], "s": "x"}},
]


async def test_enqueue_returns_an_id_and_any_json_payload_comes_back(client: AsyncClient) -> None:
    ids = [await client.enqueue(p) for p in PAYLOADS]
    assert all(isinstance(i, str) and i for i in ids)
    assert len(set(ids)) == len(ids)
    for task_id, payload in zip(ids, PAYLOADS, strict=True):
        delivery = await client.claim(wait_ms=0)
        assert delivery is not None
        assert delivery.id == task_id
        assert delivery.payload == payload
        assert type(delivery.payload) is type(payload)
        await client.ack(delivery)


async def test_pre_encoded_json_bytes_are_taken_as_the_payload(client: AsyncClient) -> None:
    first = await client.enqueue(b'{"b": 2, "a": ["h\xc3\xa9", 1.5e3]}')
    second = await client.enqueue(bytearray(b"[1, 2]"))
    d1 = await client.claim(wait_ms=0)
    d2 = await client.claim(wait_ms=0)
    assert d1 is not None
    assert d2 is not None
    assert (d1.id, d1.payload) == (first, {"b": 2, "a": ["hé", 1500.0]})
    assert (d2.id, d2.payload) == (second, [1, 2])


async def test_pre_encoded_bytes_that_are_not_json_are_rejected_by_the_broker(
    client: AsyncClient,
) -> None:
    with pytest.raises(InvalidArgument) as e:
        await client.enqueue(b'{"unterminated": ')
    assert "not valid JSON" in e.value.message
    assert (await client.stats()).totals.enqueued == 0


async def test_a_claimed_payload_json_is_the_text_that_was_enqueued(client: AsyncClient) -> None:
    # The broker keeps payloads as the bytes it received and sends them back verbatim; the
    # client's Task.payload_json should be that text, so it can be forwarded or enqueued again.
    text = b'{"b": 2,  "a": ["h\xc3\xa9", 1e400]}'
    await client.enqueue(text)
    delivery = await client.claim(wait_ms=0)
    assert delivery is not None
    assert delivery.task.payload_json == text
    assert await client.enqueue(delivery.task.payload_json)


async def test_enqueue_many_returns_ids_in_order(client: AsyncClient) -> None:
    payloads = [{"n": i} for i in range(5)]
    ids = await client.enqueue_many(payloads, max_attempts=4)
    assert len(ids) == 5
    assert len(set(ids)) == 5
    for task_id, payload in zip(ids, payloads, strict=True):
        delivery = await client.claim(wait_ms=0)
        assert delivery is not None
        assert (delivery.id, delivery.payload, delivery.task.max_attempts) == (task_id, payload, 4)
    assert await client.enqueue_many([]) == []
    assert (await client.stats()).totals.enqueued == 5


async def test_enqueue_many_with_a_delay_holds_every_task_back(client: AsyncClient) -> None:
    await client.enqueue_many(["a", "b"], delay_ms=60_000)
    stats = await client.stats()
    assert (stats.ready, stats.delayed) == (0, 2)
    assert await client.claim(wait_ms=0) is None


async def test_enqueue_many_over_grpc_is_all_or_nothing(grpc_client: AsyncClient) -> None:
    with pytest.raises(InvalidArgument) as e:
        await grpc_client.enqueue_many([1, b"{oops", 3])
    assert "tasks[1]" in e.value.message
    stats = await grpc_client.stats()
    assert stats.totals.enqueued == 0
    assert stats.ready == 0


# -- AsyncClient: claim -------------------------------------------------------------------------


async def test_claim_on_an_empty_queue_returns_none(client: AsyncClient) -> None:
    assert await client.claim(wait_ms=0) is None
    assert await client.claim(wait_ms=20) is None


async def test_claim_returns_a_typed_delivery(client: AsyncClient) -> None:
    before = datetime.now(UTC)
    task_id = await client.enqueue({"line": "hi"}, max_attempts=5)
    delivery = await client.claim(wait_ms=0, lease_ms=10_000)
    after = datetime.now(UTC)
    assert isinstance(delivery, Delivery)
    task = delivery.task
    assert isinstance(task, Task)
    assert task.id == delivery.id == task_id
    assert task.payload == delivery.payload == {"line": "hi"}
    assert json.loads(task.payload_json) == {"line": "hi"}
    assert (task.attempts, task.max_attempts, task.last_error) == (1, 5, None)
    assert isinstance(delivery.lease_id, str)
    assert delivery.lease_id
    for moment in (task.created_at, task.available_at, delivery.deadline):
        assert isinstance(moment, datetime)
        assert moment.tzinfo is not None
        assert moment.utcoffset() == timedelta(0)
    slack = timedelta(seconds=1)
    assert before - slack <= task.created_at <= task.available_at <= after + slack
    lease = timedelta(seconds=10)
    assert before + lease - slack <= delivery.deadline <= after + lease + slack


async def test_a_delayed_task_is_available_later(client: AsyncClient) -> None:
    await client.enqueue("later", delay_ms=60_000)
    assert (await client.stats()).delayed == 1
    assert await client.claim(wait_ms=0) is None


async def test_long_poll_is_woken_by_an_enqueue_from_another_client(
    broker: Broker, client: AsyncClient, transport: str
) -> None:
    claim = asyncio.ensure_future(client.claim(wait_ms=10_000))
    await wait_until(lambda: broker.service.waiting == 1, what="the claim to park")
    assert not claim.done()
    other = "grpc" if transport == "http" else "http"
    async with AsyncClient(url_for(broker, other)) as producer:
        task_id = await producer.enqueue("wake up")
    delivery = await asyncio.wait_for(claim, 5)
    assert delivery is not None
    assert (delivery.id, delivery.payload) == (task_id, "wake up")


async def test_a_long_poll_may_outlast_the_client_timeout(transport: str, clock: FakeClock) -> None:
    """A claim lasts as long as the broker holds it, whatever the client's own time-out. On a
    FakeClock the broker holds it until the test moves the clock; a plain request with the same
    0.1 s time-out, sent after the claim, shows when that time-out has passed."""
    async with (
        running_broker(clock=clock) as broker,
        AsyncClient(url_for(broker, transport), timeout=0.1) as c,
    ):
        claim = asyncio.ensure_future(c.claim(wait_ms=400))
        await wait_until(lambda: broker.service.waiting == 1, what="the claim to park")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.1)) as session:
            with pytest.raises(TimeoutError):
                async with session.get(broker.http_url + "/jobs/next?wait_ms=400"):
                    pass
        assert not claim.done()  # past the client's 0.1 s, still waiting
        clock.advance(0.4)
        assert await asyncio.wait_for(claim, 5) is None


async def test_cancelling_a_waiting_claim_loses_no_task(
    broker: Broker, client: AsyncClient
) -> None:
    claim = asyncio.ensure_future(client.claim(wait_ms=10_000))
    await wait_until(lambda: broker.service.waiting == 1, what="the claim to park")
    claim.cancel()
    task_id = await client.enqueue("keep me")
    delivery = await client.claim(wait_ms=3_000)
    assert delivery is not None
    assert delivery.id == task_id


# -- AsyncClient: ack, nack, stats, dead letters, requeue ------------------------------------------


@pytest.mark.parametrize("by", ["delivery", "id and lease"])
async def test_ack_settles_the_task(client: AsyncClient, by: str) -> None:
    await client.enqueue("work")
    delivery = await client.claim(wait_ms=0)
    assert delivery is not None
    if by == "delivery":
        await client.ack(delivery)
    else:
        await client.ack(delivery.id, delivery.lease_id)
    stats = await client.stats()
    assert stats.totals.acked == 1
    assert stats.handed_out == 0
    assert stats.idle


@pytest.mark.parametrize("by", ["delivery", "id and lease"])
async def test_nack_retries_with_the_error_then_buries(client: AsyncClient, by: str) -> None:
    async def nack(delivery: Delivery, error: str) -> None:
        if by == "delivery":
            await client.nack(delivery, error=error)
        else:
            await client.nack(delivery.id, delivery.lease_id, error=error)

    task_id = await client.enqueue({"job": 1}, max_attempts=2)
    first = await client.claim(wait_ms=0)
    assert first is not None
    await nack(first, "first failure")
    second = await client.claim(wait_ms=5_000)  # back after a short backoff
    assert second is not None
    assert (second.id, second.task.attempts) == (task_id, 2)
    assert second.lease_id != first.lease_id
    await nack(second, "second failure")
    stats = await client.stats()
    assert (stats.dead, stats.handed_out, stats.delayed, stats.ready) == (1, 0, 0, 0)
    assert (stats.totals.nacked, stats.totals.retried, stats.totals.buried) == (2, 1, 1)
    [dead] = await client.dead_letters()
    assert (dead.id, dead.last_error, dead.attempts) == (task_id, "second failure", 2)


async def test_ack_or_nack_by_id_needs_a_lease(client: AsyncClient) -> None:
    with pytest.raises(InvalidArgument) as e:
        await client.ack("some-id")
    assert "lease_id" in e.value.message
    with pytest.raises(InvalidArgument):
        await client.nack("some-id", error="x")


async def test_stats_are_typed_gauges_and_totals(client: AsyncClient) -> None:
    empty = await client.stats()
    assert isinstance(empty, Stats)
    assert isinstance(empty.totals, Totals)
    assert empty == Stats()
    assert empty.idle
    await client.enqueue("doomed", max_attempts=1)
    await client.enqueue("held")
    await client.enqueue("later", delay_ms=60_000)
    doomed = await client.claim(wait_ms=0)
    assert doomed is not None
    await client.nack(doomed, error="no")
    assert await client.claim(wait_ms=0) is not None
    stats = await client.stats()
    assert stats == Stats(
        ready=0,
        handed_out=1,
        delayed=1,
        dead=1,
        totals=Totals(enqueued=3, delivered=2, nacked=1, buried=1),
    )
    assert not stats.idle


async def test_dead_letters_lists_buried_tasks_oldest_first(client: AsyncClient) -> None:
    ids = []
    for i in range(3):
        ids.append(await client.enqueue({"n": i}, max_attempts=1))
        delivery = await client.claim(wait_ms=0)
        assert delivery is not None
        await client.nack(delivery, error=f"failure {i}")
    dead = await client.dead_letters()
    assert all(isinstance(t, Task) for t in dead)
    assert [t.id for t in dead] == ids
    assert [t.payload for t in dead] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert [t.last_error for t in dead] == ["failure 0", "failure 1", "failure 2"]
    assert all((t.attempts, t.max_attempts) == (1, 1) for t in dead)
    assert all(t.created_at.tzinfo is not None for t in dead)
    # When each was buried (in burial order), over either protocol; lookups say the same.
    buried = [t.buried_at for t in dead]
    assert all(b is not None and b.tzinfo is not None for b in buried)
    assert buried == sorted(buried)  # type: ignore[type-var]
    assert [(await client.get_task(i)).buried_at for i in ids] == buried
    assert [t.id for t in await client.dead_letters(limit=2)] == ids[:2]
    assert await client.dead_letters(limit=0) == []


async def test_requeue_gives_a_dead_task_a_fresh_start(client: AsyncClient) -> None:
    task_id = await client.enqueue("again", max_attempts=1)
    delivery = await client.claim(wait_ms=0)
    assert delivery is not None
    await client.nack(delivery, error="boom")
    await client.requeue(task_id)
    stats = await client.stats()
    assert (stats.dead, stats.ready, stats.totals.requeued) == (0, 1, 1)
    assert await client.dead_letters() == []
    fresh = await client.claim(wait_ms=0)
    assert fresh is not None
    assert (fresh.id, fresh.task.attempts, fresh.task.last_error) == (task_id, 1, None)
    with pytest.raises(NotFound):
        await client.requeue(task_id)  # held, not dead


# -- AsyncClient: the error tree ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_attempts", 0),
        ("max_attempts", -1),
        ("max_attempts", 2**31),
        ("max_attempts", 2**63),
        ("max_attempts", 2.5),
        ("delay_ms", -1),
        ("delay_ms", 10**13),
        ("delay_ms", 2**63),
    ],
)
async def test_a_bad_max_attempts_or_delay_is_invalid_argument_naming_the_field(
    client: AsyncClient, field: str, value: Any
) -> None:
    with pytest.raises(InvalidArgument) as e:
        await client.enqueue("x", **{field: value})
    assert field in e.value.message
    assert str(e.value) == e.value.message
    assert (await client.stats()).totals.enqueued == 0


async def test_an_oversized_payload_is_payload_too_large(transport: str) -> None:
    async with (
        running_broker(max_body=1024) as broker,
        AsyncClient(url_for(broker, transport)) as c,
    ):
        with pytest.raises(PayloadTooLarge) as e:
            await c.enqueue("x" * 2000)
        assert isinstance(e.value, InvalidArgument)
        assert "1024" in e.value.message
        assert (await c.stats()).totals.enqueued == 0
        assert await c.enqueue("x" * 500)


async def test_unknown_ids_are_not_found_with_the_broker_message(client: AsyncClient) -> None:
    with pytest.raises(NotFound) as e:
        await client.ack("no-such-task", "some-lease")
    assert e.value.message == "task no-such-task is not held by anyone"
    with pytest.raises(NotFound) as e:
        await client.nack("no-such-task", "some-lease", error="x")
    assert "no-such-task" in e.value.message
    with pytest.raises(NotFound) as e:
        await client.requeue("no-such-task")
    assert e.value.message == "task no-such-task is not in the dead-letter queue"


async def test_a_second_ack_is_not_found(client: AsyncClient) -> None:
    await client.enqueue("once")
    delivery = await client.claim(wait_ms=0)
    assert delivery is not None
    await client.ack(delivery)
    with pytest.raises(NotFound) as e:
        await client.ack(delivery)
    assert delivery.id in e.value.message
    with pytest.raises(NotFound):
        await client.nack(delivery)
    assert (await client.stats()).totals.acked == 1


async def test_a_wrong_lease_on_a_held_task_is_lease_lost(client: AsyncClient) -> None:
    await client.enqueue("mine")
    delivery = await client.claim(wait_ms=0)
    assert delivery is not None
    with pytest.raises(LeaseLost) as e:
        await client.ack(delivery.id, "not-the-lease")
    assert e.value.message == f"task {delivery.id} is held under a different lease"
    with pytest.raises(LeaseLost):
        await client.nack(delivery.id, "not-the-lease", error="x")
    assert (await client.stats()).handed_out == 1  # still held by the real lease
    await client.ack(delivery)


async def test_a_lease_that_ran_out_cannot_settle_the_next_holders_task(
    client: AsyncClient,
) -> None:
    await client.enqueue("slow worker")
    stale = await client.claim(wait_ms=0, lease_ms=50)
    assert stale is not None
    fresh = await client.claim(wait_ms=5_000)  # reclaimed by the sweeper, then retried
    assert fresh is not None
    assert fresh.id == stale.id
    assert fresh.lease_id != stale.lease_id
    with pytest.raises(LeaseLost):
        await client.ack(stale)
    await client.ack(fresh)
    stats = await client.stats()
    assert (stats.totals.reclaimed, stats.totals.acked, stats.handed_out) == (1, 1, 0)


async def test_a_broker_that_is_not_running_is_unavailable(transport: str) -> None:
    port = closed_port()
    async with AsyncClient(f"{transport}://127.0.0.1:{port}", timeout=5) as c:
        calls: list[Callable[[], Any]] = [
            lambda: c.enqueue("x"),
            lambda: c.enqueue_many(["x", "y"]),
            lambda: c.claim(wait_ms=0),
            lambda: c.ack("id", "lease"),
            lambda: c.nack("id", "lease"),
            c.stats,
            c.dead_letters,
            lambda: c.requeue("id"),
        ]
        for call in calls:
            with pytest.raises(Unavailable) as e:
                await call()
            assert f"127.0.0.1:{port}" in e.value.message


async def test_an_unavailable_error_reads_the_same_as_its_message(transport: str) -> None:
    # What a traceback or ``print(e)`` shows should be the message the client composed.
    port = closed_port()
    async with AsyncClient(f"{transport}://127.0.0.1:{port}", timeout=5) as c:
        with pytest.raises(Unavailable) as e:
            await c.stats()
    assert "cannot reach the broker" in e.value.message
    assert str(e.value) == e.value.message


@pytest.mark.parametrize(
    "payload",
    [float("nan"), float("inf"), object(), {"a": {1, 2}}, [1, 2j]],
    ids=["nan", "inf", "object", "set", "complex"],
)
async def test_a_payload_that_cannot_be_json_is_invalid_argument_before_any_request(
    transport: str, payload: Any
) -> None:
    # Nothing listens on the port: any request would fail with Unavailable instead.
    async with AsyncClient(f"{transport}://127.0.0.1:{closed_port()}") as c:
        with pytest.raises(InvalidArgument) as e:
            await c.enqueue(payload)
        assert "JSON" in e.value.message
        with pytest.raises(InvalidArgument):
            await c.enqueue_many(["fine", payload])


async def test_a_url_with_another_scheme_or_no_address_is_refused() -> None:
    with pytest.raises(WqError) as e:
        AsyncClient("ftp://localhost:8080")
    assert "http://host:port or grpc://host:port" in e.value.message
    with pytest.raises(WqError):
        AsyncClient("grpc://")
    async with AsyncClient("localhost:1") as c:  # no scheme: HTTP, which cannot stream
        assert not c.can_stream
    async with AsyncClient("grpc://localhost:1") as c:
        assert c.can_stream


def test_several_brokers_in_a_grpc_url_are_one_balanced_target() -> None:
    assert grpc_target("127.0.0.1:50051") == "127.0.0.1:50051"
    assert grpc_target("10.0.0.1:1,10.0.0.2:2") == "ipv4:10.0.0.1:1,10.0.0.2:2"
    assert grpc_target("[::1]:1,[::2]:2") == "ipv6:[::1]:1,[::2]:2"
    with pytest.raises(WqError, match="IP addresses"):
        grpc_target("a.example:1,b.example:1")
    with pytest.raises(WqError, match="IP addresses"):
        grpc_target("10.0.0.1:1,10.0.0.2")


# -- the blocking Client ------------------------------------------------------------------------


async def test_blocking_client_does_the_basics(broker: Broker, transport: str) -> None:
    url = url_for(broker, transport)

    def scenario() -> None:
        with Client(url) as c:
            first = c.enqueue({"a": 1})
            batch = c.enqueue_many(["b", "c"], max_attempts=1)
            assert len(batch) == 2
            d = c.claim(wait_ms=0)
            assert isinstance(d, Delivery)
            assert (d.id, d.payload) == (first, {"a": 1})
            c.ack(d)
            with pytest.raises(NotFound):
                c.ack(d)
            d = c.claim(wait_ms=0)
            assert d is not None
            assert d.id == batch[0]
            c.nack(d.id, d.lease_id, error="no good")
            d = c.claim(wait_ms=0)
            assert d is not None
            assert d.id == batch[1]
            with pytest.raises(LeaseLost):
                c.ack(d.id, "wrong")
            c.nack(d)
            stats = c.stats()
            assert isinstance(stats, Stats)
            assert (stats.dead, stats.totals.acked, stats.totals.buried) == (2, 1, 2)
            dead = c.dead_letters(limit=1)
            assert [(t.id, t.last_error) for t in dead] == [(batch[0], "no good")]
            c.requeue(batch[0])
            assert c.stats().ready == 1
            assert c.claim(wait_ms=0, lease_ms=5_000) is not None
            assert c.claim(wait_ms=0) is None

    await asyncio.to_thread(scenario)


async def test_blocking_client_close_is_idempotent_and_final(
    broker: Broker, transport: str
) -> None:
    url = url_for(broker, transport)

    def scenario() -> None:
        before = threading.active_count()
        c = Client(url)
        c.enqueue("x")
        c.close()
        c.close()
        with pytest.raises(Unavailable) as e:
            c.stats()
        assert "closed" in e.value.message
        assert threading.active_count() == before  # its loop thread is gone

    await asyncio.to_thread(scenario)
    async with AsyncClient(url) as check:
        assert (await check.stats()).ready == 1


def test_calling_a_closed_blocking_client_raises_without_warnings() -> None:
    c = Client(f"http://127.0.0.1:{closed_port()}")
    c.close()
    gc.collect()  # (what earlier tests left unreachable is not this client's)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Unavailable):
            c.enqueue("x")
        gc.collect()
    assert [str(w.message) for w in caught] == []


def test_a_blocking_client_with_a_bad_url_leaves_no_thread_behind() -> None:
    before = set(threading.enumerate())
    with pytest.raises(WqError):
        Client("ftp://localhost:8080")
    leaked = [t.name for t in threading.enumerate() if t not in before]
    assert leaked == []


async def test_blocking_client_streams_over_grpc(broker: Broker) -> None:
    url = "grpc://" + broker.grpc_target

    def scenario() -> None:
        with Client(url) as c:
            ids = c.enqueue_many(["a", "b", "c"], max_attempts=1)
            stream = c.stream(prefetch=2)
            seen = []
            for delivery in stream:
                seen.append(delivery.id)
                if delivery.payload == "b":
                    stream.nack(delivery, "bad b", confirm=True)
                else:
                    stream.ack(delivery, confirm=True)
                if len(seen) == 3:
                    break
            stream.drain()
            stream.close()
            assert list(stream) == []  # a closed stream yields nothing more
            assert seen == ids
            stats = c.stats()
            assert (stats.totals.acked, stats.dead, stats.handed_out) == (2, 1, 0)
            assert [t.last_error for t in c.dead_letters()] == ["bad b"]

    await asyncio.to_thread(scenario)


async def test_blocking_http_client_cannot_stream(broker: Broker) -> None:
    def scenario() -> None:
        with Client(broker.http_url) as c, pytest.raises(WqError) as e:
            c.stream()
        assert "grpc://" in e.value.message

    await asyncio.to_thread(scenario)


# -- streams (gRPC) -----------------------------------------------------------------------------


async def test_stream_pushes_at_most_prefetch_unsettled_tasks(grpc_client: AsyncClient) -> None:
    ids = await grpc_client.enqueue_many([{"n": i} for i in range(5)])
    stream = await grpc_client.stream(prefetch=2)
    try:
        got = [await next_delivery(stream), await next_delivery(stream)]
        stats = await grpc_client.stats()
        assert (stats.handed_out, stats.ready) == (2, 3)
        for delivery in got:
            await stream.ack(delivery, confirm=True)
        async for delivery in stream:
            got.append(delivery)
            await stream.ack(delivery, confirm=True)
            if len(got) == 5:
                break
        assert [d.id for d in got] == ids  # oldest first
        assert [d.payload for d in got] == [{"n": i} for i in range(5)]
        assert all(d.deadline.tzinfo is not None for d in got)
        stats = await grpc_client.stats()
        assert stats.totals.acked == 5
        assert stats.idle
    finally:
        await stream.close()


async def test_stream_nack_records_the_error(grpc_client: AsyncClient) -> None:
    task_id = await grpc_client.enqueue("fragile", max_attempts=1)
    stream = await grpc_client.stream()
    try:
        delivery = await next_delivery(stream)
        await stream.nack(delivery, "handler exploded", confirm=True)
    finally:
        await stream.close()
    dead = await grpc_client.dead_letters()
    assert [(t.id, t.last_error) for t in dead] == [(task_id, "handler exploded")]


async def test_stream_ack_of_a_stale_lease_raises(grpc_client: AsyncClient) -> None:
    await grpc_client.enqueue("slow")
    stream = await grpc_client.stream(prefetch=1, lease_ms=100)
    try:
        stale = await next_delivery(stream)
        assert await stream.drain() == 1  # so the retried task goes to the other consumer
        fresh = await grpc_client.claim(wait_ms=5_000)
        assert fresh is not None
        assert fresh.id == stale.id
        assert fresh.lease_id != stale.lease_id
        with pytest.raises(LeaseLost) as e:
            await grpc_client.ack(stale)
        assert stale.id in e.value.message
        # Drained, with its last delivery taken back, the stream has ended.
        assert [d async for d in stream] == []
        with pytest.raises(StreamEnded):
            await stream.ack(stale, confirm=True)
        await grpc_client.ack(fresh)
        with pytest.raises(NotFound):
            await grpc_client.nack(stale, error="too late")
    finally:
        await stream.close()
    stats = await grpc_client.stats()
    assert (stats.totals.acked, stats.totals.reclaimed, stats.handed_out) == (1, 1, 0)


async def test_stream_drain_stops_new_deliveries(grpc_client: AsyncClient) -> None:
    await grpc_client.enqueue_many(list(range(5)))
    stream = await grpc_client.stream(prefetch=2)
    try:
        first, second = await next_delivery(stream), await next_delivery(stream)
        assert await stream.drain() == 2  # both still to settle
        await stream.ack(first, confirm=True)
        await stream.ack(second, confirm=True)
        stats = await grpc_client.stats()
        assert (stats.handed_out, stats.ready, stats.totals.acked) == (0, 3, 2)
        # The last one settled, the broker ends the stream.
        assert [d async for d in stream] == []
        with pytest.raises(NotFound):
            await grpc_client.ack(first)  # already settled
    finally:
        await stream.close()
    assert [d async for d in stream] == []
    assert (await grpc_client.stats()).ready == 3


async def test_stream_close_returns_unsettled_tasks_at_once(grpc_client: AsyncClient) -> None:
    ids = await grpc_client.enqueue_many(["a", "b", "c"])
    stream = await grpc_client.stream(prefetch=2)  # the default 30 s lease
    held = [await next_delivery(stream), await next_delivery(stream)]
    await stream.close()
    # Well within the 30 s lease: the stream's end gave them back.
    stats = await wait_until(
        grpc_client.stats, lambda s: s.handed_out == 0, what="stats with s.handed_out == 0"
    )
    assert stats.totals.reclaimed == 2
    with pytest.raises(Unavailable):
        await stream.ack(held[0], confirm=True)
    # Back for somebody else, without waiting for the lease to run out.
    again = [await grpc_client.claim(wait_ms=5_000) for _ in ids]
    assert sorted(d.id for d in again if d is not None) == sorted(ids)
    assert {d.id: d.task.attempts for d in again if d is not None} == {
        held[0].id: 2,
        held[1].id: 2,
        ids[2]: 1,
    }


async def test_stream_with_a_bad_prefetch_raises_invalid_argument(
    grpc_client: AsyncClient,
) -> None:
    # The broker refuses the stream as it opens: stream() itself raises.
    with pytest.raises(InvalidArgument) as e:
        await grpc_client.stream(prefetch=0)
    assert "prefetch" in e.value.message


async def test_stream_to_a_broker_that_is_not_running_is_unavailable() -> None:
    async with AsyncClient(f"grpc://127.0.0.1:{closed_port()}", timeout=5) as c:
        with pytest.raises(Unavailable) as e:
            await c.stream()
        assert "cannot reach the broker" in e.value.message


async def test_http_client_cannot_stream(broker: Broker) -> None:
    async with AsyncClient(broker.http_url) as c:
        with pytest.raises(WqError) as e:
            await c.stream(prefetch=4)
        assert "grpc://" in e.value.message


# -- the Worker runner ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_worker_runs_the_handler_and_acks_each_task(
    broker: Broker, client: AsyncClient, transport: str, kind: str
) -> None:
    payloads = [{"n": i} for i in range(10)]
    ids = await client.enqueue_many(payloads)
    seen: list[tuple[str, Any]] = []
    threads: set[str] = set()

    def record(task: Task) -> None:
        seen.append((task.id, task.payload))
        threads.add(threading.current_thread().name)

    async def async_handler(task: Task) -> None:
        record(task)

    worker = Worker(
        url_for(broker, transport),
        record if kind == "sync" else async_handler,
        concurrency=3,
        wait_ms=1_000,
    )
    async with running(worker) as run:
        stats = await wait_until(
            client.stats, lambda s: s.totals.acked == 10, what="stats with s.totals.acked == 10"
        )
        assert (stats.ready, stats.handed_out, stats.totals.nacked) == (0, 0, 0)
    assert run.done()
    assert run.exception() is None
    assert sorted(seen) == sorted(zip(ids, payloads, strict=True))
    assert (worker.succeeded, worker.failed) == (10, 0)
    main = threading.current_thread().name
    assert (main in threads) is (kind == "async")  # sync handlers run in a thread pool


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_worker_runs_exactly_concurrency_handlers_at_once(
    broker: Broker, client: AsyncClient, transport: str, kind: str
) -> None:
    concurrency, n = 3, 9
    lock = threading.Lock()
    now_running = peak = 0
    full = threading.Event()
    release = threading.Event()

    def enter() -> None:
        nonlocal now_running, peak
        with lock:
            now_running += 1
            peak = max(peak, now_running)
            if now_running == concurrency:
                full.set()

    def leave() -> None:
        nonlocal now_running
        with lock:
            now_running -= 1

    def sync_handler(task: Task) -> None:
        enter()
        try:
            assert release.wait(10)
        finally:
            leave()

    async def async_handler(task: Task) -> None:
        enter()
        try:
            await wait_until(release.is_set, what="the release")
        finally:
            leave()

    await client.enqueue_many(list(range(n)))
    worker = Worker(
        url_for(broker, transport),
        sync_handler if kind == "sync" else async_handler,
        concurrency=concurrency,
        wait_ms=1_000,
    )
    async with running(worker):
        await wait_until(full.is_set, what=f"{concurrency} handlers at once")
        # In hand: one task per handler, and over a stream as many again waiting for one.
        held = 2 * concurrency if transport == "grpc" else concurrency
        stats = await wait_until(
            client.stats, lambda s: s.handed_out == held, what=f"{held} tasks in hand"
        )
        assert (stats.handed_out, stats.ready, peak) == (held, n - held, concurrency)
        release.set()
        await wait_until(
            client.stats, lambda s: s.totals.acked == n, what="stats with s.totals.acked == n"
        )
    assert peak == concurrency
    assert worker.succeeded == n


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_raising_handler_nacks_the_task_with_the_exception_text(
    broker: Broker, client: AsyncClient, transport: str, kind: str
) -> None:
    plain = await client.enqueue({"raise": "value"}, max_attempts=2)
    failed = await client.enqueue({"raise": "task-failed"}, max_attempts=2)

    def sync_handler(task: Task) -> None:
        if task.payload["raise"] == "value":
            raise ValueError("bad value 42")
        raise TaskFailed("disk full")

    async def async_handler(task: Task) -> None:
        sync_handler(task)

    worker = Worker(
        url_for(broker, transport),
        sync_handler if kind == "sync" else async_handler,
        concurrency=2,
        wait_ms=1_000,
    )
    async with running(worker):
        stats = await wait_until(client.stats, lambda s: s.dead == 2, what="stats with s.dead == 2")
    assert (stats.totals.nacked, stats.totals.retried, stats.totals.acked) == (4, 2, 0)
    dead = {t.id: t for t in await client.dead_letters()}
    assert dead[plain].last_error == "ValueError: bad value 42"
    assert dead[failed].last_error == "disk full"
    assert dead[plain].attempts == dead[failed].attempts == 2
    assert (worker.succeeded, worker.failed) == (0, 4)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_stop_lets_the_tasks_in_hand_finish_and_acks_them(
    broker: Broker, client: AsyncClient, transport: str, kind: str
) -> None:
    first = await client.enqueue("in hand")
    started = threading.Event()
    release = threading.Event()
    finished: list[str] = []
    finished_when_run_returned: list[list[str]] = []

    def sync_handler(task: Task) -> None:
        started.set()
        assert release.wait(10)
        finished.append(task.id)

    async def async_handler(task: Task) -> None:
        started.set()
        await wait_until(release.is_set, what="the release")
        finished.append(task.id)

    # Two slots: one works on the task, the other waits at the broker for another.
    worker = Worker(
        url_for(broker, transport),
        sync_handler if kind == "sync" else async_handler,
        concurrency=2,
        wait_ms=10_000,
    )
    run = asyncio.ensure_future(worker.run())
    run.add_done_callback(lambda _: finished_when_run_returned.append(list(finished)))
    try:
        await wait_until(
            lambda: started.is_set() and broker.service.waiting == 1,
            what="one task in hand and one slot waiting for more",
        )
        worker.stop()
        # The worker gives up its idle slot (its parked claim is cancelled, or its stream
        # drained): it has acted on stop(). It is still running, finishing the task in hand,
        # and a task enqueued now is not taken.
        await wait_until(lambda: broker.service.waiting == 0, what="the idle slot given up")
        assert not run.done()
        await client.enqueue("never started")
        release.set()
        await asyncio.wait_for(run, 10)
    finally:
        release.set()
        worker.stop()
        await asyncio.wait_for(run, 10)
    assert finished_when_run_returned == [[first]]  # run() returned after the task finished
    assert finished == [first]
    stats = await client.stats()
    assert (stats.totals.acked, stats.handed_out, stats.ready) == (1, 0, 1)


async def test_worker_keeps_retrying_an_unreachable_broker_and_warns_once(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    port = closed_port()
    attempts = 0

    class CountingClient(AsyncClient):
        async def claim(self, **kw: Any) -> Delivery | None:
            nonlocal attempts
            attempts += 1
            return await super().claim(**kw)

        async def claim_many(self, max_tasks: int, **kw: Any) -> list[Delivery]:
            nonlocal attempts
            attempts += 1
            return await super().claim_many(max_tasks, **kw)

        async def stream(self, **kw: Any) -> AsyncStream:
            nonlocal attempts
            attempts += 1
            return await super().stream(**kw)

    async def handler(task: Task) -> None:
        raise AssertionError("no task can come from a broker that is not there")

    concurrency = 3
    client = CountingClient(f"{transport}://127.0.0.1:{port}", timeout=2)
    try:
        worker = Worker(client, handler, concurrency=concurrency, wait_ms=1_000)
        run = asyncio.ensure_future(worker.run())
        # Three rounds of attempts: one batch claim at a time over HTTP, one stream over gRPC.
        rounds = 3
        await wait_until(lambda: attempts >= rounds, what="the worker to retry")
        assert not run.done()
        warnings_seen = logged(caplog, "broker unavailable")
        assert len(warnings_seen) == 1
        assert warnings_seen[0].levelno == logging.WARNING
        assert f"127.0.0.1:{port}" in warnings_seen[0].getMessage()
        worker.stop()
        await asyncio.wait_for(run, 5)
        assert run.exception() is None
        assert logged(caplog, "reachable again") == []
    finally:
        await client.close()


async def test_worker_picks_up_a_broker_that_starts_later(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    addr = f"127.0.0.1:{closed_port()}"
    seen: list[Any] = []

    async def handler(task: Task) -> None:
        seen.append(task.payload)

    worker = Worker(f"{transport}://{addr}", handler, concurrency=2, wait_ms=1_000)
    async with running(worker) as run:
        await wait_until(lambda: logged(caplog, "broker unavailable"), what="the warning")
        async with running_broker(backoff_base=0.01, **broker_config_on(transport, addr)) as b:
            # The producer talks HTTP: a new gRPC channel to the same address would share the
            # worker's connection, which may still be backing off.
            async with AsyncClient(b.http_url) as producer:
                await producer.enqueue_many(["one", "two", "three"])
                await wait_until(
                    producer.stats,
                    lambda s: s.totals.acked == 3,
                    what="stats with s.totals.acked == 3",
                    timeout=10,
                )
            assert logged(caplog, "reachable again")
            worker.stop()
            await asyncio.wait_for(run, 10)
    assert sorted(seen) == ["one", "three", "two"]
    assert len(logged(caplog, "broker unavailable")) == 1


async def test_worker_survives_a_broker_restart(transport: str) -> None:
    addr = f"127.0.0.1:{closed_port()}"
    config = broker_config_on(transport, addr)
    seen: list[Any] = []

    async def handler(task: Task) -> None:
        seen.append(task.payload)

    worker = Worker(f"{transport}://{addr}", handler, concurrency=2, wait_ms=1_000)
    run: asyncio.Task[None] | None = None
    try:
        async with running_broker(**config) as first, AsyncClient(first.http_url) as producer:
            run = asyncio.ensure_future(worker.run())
            await producer.enqueue("before")
            await wait_until(
                producer.stats, lambda s: s.totals.acked == 1, what="stats with s.totals.acked == 1"
            )
        # The broker restarts (same address, empty memory store).
        async with running_broker(**config) as second, AsyncClient(second.http_url) as producer:
            await producer.enqueue("after")
            assert not run.done(), "Worker.run() returned when the broker went away"
            await wait_until(
                producer.stats,
                lambda s: s.totals.acked == 1,
                what="stats with s.totals.acked == 1",
                timeout=8,
            )
            worker.stop()
            await asyncio.wait_for(run, 10)
    finally:
        worker.stop()
        if run is not None:
            await asyncio.wait_for(run, 10)
    assert seen == ["before", "after"]


async def test_a_task_in_hand_when_the_stream_ends_does_not_hold_up_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The broker reclaims a stream's unsettled tasks as soon as the stream ends, so a worker
    # that finishes such a task afterwards has nothing left to report and no reason to wait.
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    addr = f"127.0.0.1:{closed_port()}"
    started = asyncio.Event()
    release = asyncio.Event()

    async def handler(task: Task) -> None:
        started.set()
        await release.wait()

    # A lease far longer than this test may run: a worker that kept trying to report the task
    # until its lease ran out would not stop in time.
    worker = Worker(f"grpc://{addr}", handler, concurrency=1, lease_ms=300_000)
    async with running_broker(**broker_config_on("grpc", addr)) as broker:
        run = asyncio.ensure_future(worker.run())
        async with AsyncClient(broker.http_url) as producer:
            await producer.enqueue("in hand")
            await asyncio.wait_for(started.wait(), 5)
    release.set()
    worker.stop()
    try:
        await asyncio.wait_for(run, 30)
    except TimeoutError:
        raise AssertionError("Worker.run() kept retrying an ack on an ended stream") from None
    assert logged(caplog, "the stream ended before its outcome was sent")


# -- LogFileHandler (wq-worker's handler) -------------------------------------------------------


def make_task(payload: Any, task_id: str = "t1", attempts: int = 1) -> Task:
    now = datetime.now(UTC)
    return Task(
        id=task_id,
        payload_json=json.dumps(payload).encode(),
        attempts=attempts,
        max_attempts=3,
        created_at=now,
        available_at=now,
    )


async def test_log_file_handler_appends_one_json_line_per_task(tmp_path: Path) -> None:
    path = tmp_path / "jobs.log"
    path.write_text("an earlier line\n")
    handler = LogFileHandler(str(path))
    try:
        await handler(make_task({"line": "hello"}, "a"))
        await handler(make_task(["ü ✓", None], "b", attempts=2))
        await handler(make_task({"fail": False}, "c"))
    finally:
        handler.close()
    text = path.read_text("utf-8")
    assert text.endswith("\n")
    first, *lines = text.splitlines()
    assert first == "an earlier line"
    records = [json.loads(line) for line in lines]
    assert [(r["id"], r["attempts"], r["payload"]) for r in records] == [
        ("a", 1, {"line": "hello"}),
        ("b", 2, ["ü ✓", None]),
        ("c", 1, {"fail": False}),
    ]
    for r in records:
        assert r["done_at"].endswith("Z")
        done_at = datetime.fromisoformat(r["done_at"].replace("Z", "+00:00"))
        assert abs(datetime.now(UTC) - done_at) < timedelta(minutes=1)


async def test_log_file_handler_fails_a_task_that_asks_to(tmp_path: Path) -> None:
    path = tmp_path / "jobs.log"
    handler = LogFileHandler(str(path))
    try:
        with pytest.raises(TaskFailed) as e:
            await handler(make_task({"fail": True, "n": 1}))
        assert str(e.value)
    finally:
        handler.close()
    assert path.read_text() == ""


async def test_wq_worker_logs_good_tasks_and_buries_failing_ones(
    broker: Broker, client: AsyncClient, transport: str, tmp_path: Path
) -> None:
    path = tmp_path / "jobs.log"
    handler = LogFileHandler(str(path))
    good = await client.enqueue({"line": "ok"}, max_attempts=2)
    bad = await client.enqueue({"fail": True}, max_attempts=2)
    try:
        async with running(Worker(url_for(broker, transport), handler, wait_ms=1_000)):
            await wait_until(
                client.stats,
                lambda s: s.totals.acked == 1 and s.dead == 1,
                what="stats with s.totals.acked == 1 and s.dead == 1",
            )
    finally:
        handler.close()
    [record] = [json.loads(line) for line in path.read_text().splitlines()]
    assert (record["id"], record["payload"]) == (good, {"line": "ok"})
    [dead] = await client.dead_letters()
    assert (dead.id, dead.last_error, dead.attempts) == (bad, "the payload asked to fail", 2)


async def test_log_file_lines_never_interleave_under_concurrency(
    broker: Broker, client: AsyncClient, transport: str, tmp_path: Path
) -> None:
    n = 500
    payloads = [{"n": i, "blob": f"{i}:" + "x" * 8_000 + "✓"} for i in range(n)]
    ids = await client.enqueue_many(payloads)
    path = tmp_path / "jobs.log"
    handler = LogFileHandler(str(path))
    try:
        worker = Worker(url_for(broker, transport), handler, concurrency=50, wait_ms=1_000)
        async with running(worker):
            await wait_until(
                client.stats,
                lambda s: s.totals.acked == n,
                what="stats with s.totals.acked == n",
                timeout=30,
            )
    finally:
        handler.close()
    data = path.read_bytes()
    assert data.endswith(b"\n")
    records = [json.loads(line) for line in data.split(b"\n")[:-1]]
    assert len(records) == n
    by_id = {r["id"]: r["payload"] for r in records}
    assert by_id == dict(zip(ids, payloads, strict=True))


def test_log_file_handlers_sharing_a_file_never_tear_lines(tmp_path: Path) -> None:
    # "several worker processes may share one file": one handler per thread, each on its own
    # event loop, all appending large lines to the same file at once.
    path = tmp_path / "jobs.log"
    threads_n, per_thread = 4, 100
    blob = "y" * 64_000

    def writer(k: int) -> None:
        handler = LogFileHandler(str(path))

        async def go() -> None:
            await asyncio.gather(
                *(handler(make_task({"k": k, "blob": blob}, f"{k}-{i}")) for i in range(per_thread))
            )

        try:
            asyncio.run(go())
        finally:
            handler.close()

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    records = [json.loads(line) for line in lines[:-1]]
    assert sorted(r["id"] for r in records) == sorted(
        f"{k}-{i}" for k in range(threads_n) for i in range(per_thread)
    )
    assert all(r["payload"]["blob"] == blob for r in records)


# -- the transport seam, without a broker -------------------------------------------------------


async def test_an_injected_transport_is_used_as_it_is_and_closed_with_the_client() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as c:
        assert c.transport is fake
        assert c.url is None
        task_id = await c.enqueue({"a": 1}, max_attempts=2)
        d = await c.claim(wait_ms=0, lease_ms=1_000)
        assert d is not None
        assert (d.id, d.payload, d.task.attempts) == (task_id, {"a": 1}, 1)
        await c.ack(d)
        assert (await c.stats()).totals.acked == 1
    assert fake.closed
    assert [call.op for call in fake.calls] == ["enqueue", "claim", "ack", "stats", "close"]


async def test_a_timeout_with_an_injected_transport_is_refused() -> None:
    # The timeout configures the transport made from a URL; silently ignoring it would mislead.
    with pytest.raises(WqError) as e:
        AsyncClient(transport=FakeTransport(), timeout=5)
    assert "timeout" in e.value.message
    with pytest.raises(WqError):
        Client(transport=FakeTransport(), timeout=5)


async def test_blocking_client_on_an_injected_transport() -> None:
    fake = FakeStreamingTransport()

    def scenario() -> None:
        with Client(transport=fake) as c:
            assert c.can_stream
            c.enqueue_many(["a", "b"])
            stream = c.stream(prefetch=2)
            first, second = next(stream), next(stream)
            stream.ack(first, confirm=True)
            stream.nack(second, "bad b", confirm=True)
            stream.close()
        with Client(transport=FakeTransport()) as c, pytest.raises(WqError) as e:
            c.stream()
        assert "cannot stream" in e.value.message

    await asyncio.to_thread(scenario)
    assert fake.acked == ["t1"]
    assert fake.nacked == [("t2", "bad b")]
    assert fake.closed


def test_an_answer_missing_a_field_is_a_protocol_error_naming_it() -> None:
    task = {
        "id": "t1",
        "payload": b"{}",
        "attempts": 1,
        "max_attempts": 3,
        "created_at": "2026-11-29T23:14:20.774938Z",
        "available_at": "2026-11-29T23:14:20.774938Z",
    }
    d = Delivery.from_mapping(
        {"task": task, "lease_id": "l1", "deadline": "2026-11-29T23:14:50.782998Z"}
    )
    assert (d.id, d.payload, d.task.last_error, d.deadline.tzinfo) == ("t1", {}, None, UTC)
    with pytest.raises(ProtocolError) as e:
        Delivery.from_mapping({"task": task, "lease_id": "l1"})
    assert "deadline" in e.value.message
    with pytest.raises(ProtocolError) as e:
        Task.from_mapping({**task, "created_at": "yesterday"})
    assert "yesterday" in e.value.message


def test_stats_are_read_field_by_field_whatever_else_comes() -> None:
    stats = Stats.from_mapping(
        {"ready": 1, "dead": 2, "future_gauge": 9, "totals": {"buried": 2, "future": 1}}
    )
    assert stats == Stats(ready=1, dead=2, totals=Totals(buried=2))
