"""wqclient's queues, priorities, keys and the rest end to end: a real in-process broker, over HTTP
and over gRPC.

Named queues and priorities, idempotency keys, lease extension, nack options, task lookup, the
queue and DLQ operations, the Worker extending a lease and mapping Retry/Fail, and the commands'
new flags. The broker runs on a :class:`wqbroker.clock.FakeClock` (leases run out, delays end,
only when a test moves it) and the Worker on a fake clock of its own (tests/fake_clock.py), so
nothing here sleeps to let time pass.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.fake_clock import FakeClock as WorkerClock
from tests.helpers import running_broker, settle, wait_until
from tests.procs import producer_command, worker_command
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqclient import (
    AsyncClient,
    Client,
    Delivery,
    EnqueueItem,
    InvalidArgument,
    LeaseLost,
    NotFound,
    QueueInfo,
    Task,
)
from wqclient.worker import Fail, Retry, Worker

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ["http", "grpc"]


def url_for(broker: Broker, transport: str) -> str:
    return broker.http_url if transport == "http" else "grpc://" + broker.grpc_target


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[Broker]:
    async with running_broker(clock=clock, backoff_base=0.01) as b:
        yield b


@pytest.fixture
async def client(broker: Broker, transport: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(url_for(broker, transport)) as c:
        yield c


async def claimed(client: AsyncClient, **options: Any) -> Delivery:
    delivery = await client.claim(wait_ms=0, **options)
    assert delivery is not None
    return delivery


# -- queues and priorities -----------------------------------------------------------------------


async def test_claims_take_from_their_queues_in_order_and_by_priority(client: AsyncClient) -> None:
    low = await client.enqueue("low", queue="work", priority=1)
    high = await client.enqueue("high", queue="work", priority=8)
    urgent = await client.enqueue("urgent", queue="urgent")
    default = await client.enqueue("default")
    assert await client.claim(wait_ms=0, queues="nothing-here") is None
    order = [(await claimed(client, queues="urgent,work")).id for _ in range(3)]
    assert order == [urgent, high, low]
    delivery = await claimed(client)  # no queues: the default queue
    assert delivery.id == default
    assert (delivery.task.queue, delivery.task.priority) == ("default", 0)


async def test_a_task_view_carries_its_queue_and_priority(client: AsyncClient) -> None:
    await client.enqueue({"n": 1}, queue="emails", priority=5)
    delivery = await claimed(client, queues=["emails"])
    assert (delivery.task.queue, delivery.task.priority, delivery.payload) == (
        "emails",
        5,
        {"n": 1},
    )


async def test_bad_queue_and_priority_are_the_brokers_invalid_argument(
    client: AsyncClient,
) -> None:
    with pytest.raises(InvalidArgument) as e:
        await client.enqueue("x", priority=10)
    assert "priority" in e.value.message
    with pytest.raises(InvalidArgument) as e:
        await client.enqueue("x", queue="has space")
    assert "queue" in e.value.message
    with pytest.raises(InvalidArgument):
        await client.claim(wait_ms=0, queues="ok,not ok")


async def test_pause_resume_and_the_queue_list(client: AsyncClient) -> None:
    task_id = await client.enqueue("a", queue="jobs")
    await client.pause("jobs")
    assert await client.claim(wait_ms=0, queues="jobs") is None
    rows = {q.name: q for q in await client.queues()}
    ready_at = (await client.get_task(task_id)).available_at
    assert rows["jobs"] == QueueInfo("jobs", ready=1, paused=True, oldest_ready_at=ready_at)
    await client.resume("jobs")
    delivery = await claimed(client, queues="jobs")
    assert {q.name: q for q in await client.queues()}["jobs"] == QueueInfo("jobs", handed_out=1)
    await client.ack(delivery)


async def test_stats_of_one_queue(client: AsyncClient) -> None:
    await client.enqueue("a", queue="q1")
    await client.enqueue_many(["b", "c"], queue="q2")
    assert (await client.stats()).ready == 3
    q2 = await client.stats("q2")
    assert (q2.ready, q2.totals.enqueued) == (2, 2)
    assert (await client.stats(queue="never-seen")).ready == 0


# -- idempotency keys -----------------------------------------------------------------------------


async def test_an_idempotency_key_returns_the_first_id_as_a_duplicate(client: AsyncClient) -> None:
    first = await client.enqueue("x", idempotency_key="order-1")
    again = await client.enqueue("y", idempotency_key="order-1")
    other_queue = await client.enqueue("z", queue="other", idempotency_key="order-1")
    assert (first.duplicate, again.duplicate, other_queue.duplicate) == (False, True, False)
    assert again == first
    await client.ack(await claimed(client))
    assert (await client.enqueue("w", idempotency_key="order-1")).duplicate  # even after the ack
    assert (await client.stats()).totals.enqueued == 2


async def test_a_batch_reports_duplicates_per_item(client: AsyncClient) -> None:
    ids = await client.enqueue_many(
        [
            EnqueueItem(b'"a"', idempotency_key="k1"),
            EnqueueItem(b'"b"', idempotency_key="k2", priority=3),
            EnqueueItem(b'"c"', idempotency_key="k1"),
        ]
    )
    assert [i.duplicate for i in ids] == [False, False, True]
    assert ids[2] == ids[0]
    task = await client.get_task(ids[1])
    assert task.priority == 3


# -- lookup, extension, nack options -------------------------------------------------------------


async def test_get_task_follows_the_states(client: AsyncClient, clock: FakeClock) -> None:
    task_id = await client.enqueue("x", max_attempts=2, queue="q", priority=2)
    task = await client.get_task(task_id)
    assert (task.state, task.queue, task.priority, task.payload) == ("ready", "q", 2, "x")
    delivery = await claimed(client, queues="q")
    assert (await client.get_task(task_id)).state == "handed_out"
    await client.nack(delivery, error="later", delay_ms=60_000)
    delayed = await client.get_task(task_id)
    assert (delayed.state, delayed.last_error, delayed.attempts) == ("delayed", "later", 1)
    clock.advance(61)
    await settle()
    assert (await client.get_task(task_id)).state == "ready"
    await client.nack(await claimed(client, queues="q"), error="no", terminal=True)
    assert (await client.get_task(task_id)).state == "dead"
    await client.requeue(task_id)
    await client.ack(await claimed(client, queues="q"))
    with pytest.raises(NotFound):
        await client.get_task(task_id)
    with pytest.raises(NotFound):
        await client.get_task("no-such-task")


async def test_terminal_buries_with_attempts_left(client: AsyncClient) -> None:
    task_id = await client.enqueue("x", max_attempts=5)
    await client.nack(await claimed(client), error="bad input", terminal=True)
    [dead] = await client.dead_letters()
    assert (dead.id, dead.attempts, dead.last_error) == (task_id, 1, "bad input")


async def test_delay_and_terminal_together_are_refused(client: AsyncClient) -> None:
    await client.enqueue("x")
    delivery = await claimed(client)
    with pytest.raises(InvalidArgument):
        await client.nack(delivery, delay_ms=5, terminal=True)
    await client.ack(delivery)  # the refused nack changed nothing


async def test_extend_keeps_a_task_past_its_first_deadline(
    client: AsyncClient, clock: FakeClock
) -> None:
    task_id = await client.enqueue("x")
    delivery = await claimed(client, lease_ms=10_000)
    clock.advance(8)
    deadline = await client.extend(delivery, 10_000)
    assert deadline > delivery.deadline + timedelta(seconds=7)
    clock.advance(8)  # past the first deadline, not the new one
    await settle()
    assert (await client.get_task(task_id)).state == "handed_out"
    await client.ack(delivery)


async def test_extending_a_lost_lease_is_lease_lost(client: AsyncClient, clock: FakeClock) -> None:
    await client.enqueue("x")
    first = await claimed(client, lease_ms=1_000)
    clock.advance(2)  # the lease runs out; the task is reclaimed (and retried after a backoff)
    await settle()
    clock.advance(1)
    await settle()
    second = await claimed(client)
    assert second.id == first.id
    with pytest.raises(LeaseLost):
        await client.extend(first, 10_000)
    await client.ack(second)
    with pytest.raises(NotFound):
        await client.extend(second, 10_000)


# -- DLQ ------------------------------------------------------------------------------------------


async def test_dlq_by_queue_requeue_all_and_purge(client: AsyncClient) -> None:
    for queue in ("a", "a", "b"):
        await client.enqueue(queue, queue=queue, max_attempts=1)
        await client.nack(await claimed(client, queues=queue), error="boom")
    assert [t.queue for t in await client.dead_letters()] == ["a", "a", "b"]
    [b] = await client.dead_letters(queue="b")
    assert len(await client.dead_letters(1, queue="a")) == 1
    await client.purge(b.id)
    with pytest.raises(NotFound):
        await client.purge(b.id)
    assert await client.requeue_all("b") == 0
    assert await client.requeue_all(queue="a") == 2
    stats = await client.stats()
    assert (stats.ready, stats.dead, stats.totals.purged, stats.totals.requeued) == (2, 0, 1, 2)


# -- the gRPC stream ------------------------------------------------------------------------------


async def test_a_stream_subscribes_to_queues_extends_nacks_with_options_and_drains(
    broker: Broker, clock: FakeClock
) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as c:
        await c.enqueue("elsewhere", queue="other")
        a = await c.enqueue("a", queue="jobs", max_attempts=5)
        b = await c.enqueue("b", queue="jobs", max_attempts=5)
        stream = await c.stream(prefetch=2, lease_ms=10_000, queues=["jobs"])
        first = await asyncio.wait_for(anext(stream), 5)
        second = await asyncio.wait_for(anext(stream), 5)
        assert {first.id, second.id} == {a, b}
        deadline = await stream.extend(first, 20_000)
        assert deadline > first.deadline
        await stream.nack(first, "later", delay_ms=30_000, confirm=True)
        assert await stream.drain() == 1  # the second is still unsettled
        await stream.nack(second, "never", terminal=True, confirm=True)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(stream), 5)  # the stream ends: nothing left unsettled
        await stream.close()
        assert (await c.get_task(first.id)).state == "delayed"
        assert (await c.get_task(second.id)).state == "dead"
        assert (await c.stats("other")).ready == 1


# -- the Worker -----------------------------------------------------------------------------------


class Hold:
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, task: Task) -> None:
        self.started.set()
        await self.release.wait()


async def test_the_worker_extends_a_long_task_past_many_leases(
    client: AsyncClient, clock: FakeClock
) -> None:
    task_id = await client.enqueue("long", queue="slow")
    hold = Hold()
    worker_clock = WorkerClock()
    worker = Worker(client, hold, concurrency=1, lease_ms=10_000, queues="slow", clock=worker_clock)
    run = asyncio.ensure_future(worker.run())
    try:
        await asyncio.wait_for(hold.started.wait(), 5)
        for _ in range(6):  # half a minute of broker time on 10-second leases
            await worker_clock.sleeping()
            await worker_clock.advance(5)
            await wait_until(lambda: worker_clock.parked == 1, what="the next extension")
            clock.advance(5)
            await settle()
            assert (await client.get_task(task_id)).state == "handed_out"
        hold.release.set()
        await wait_until(lambda: worker.succeeded == 1, what="the ack")
    finally:
        worker.stop()
        await asyncio.wait_for(run, 10)
    with pytest.raises(NotFound):
        await client.get_task(task_id)
    assert (await client.stats()).totals.reclaimed == 0


async def test_a_task_waiting_for_a_handler_keeps_its_lease(
    client: AsyncClient, clock: FakeClock, transport: str
) -> None:
    """Over a stream the worker holds twice its concurrency: the task that waits for the one
    handler has its lease kept all the while, as the running one has (over HTTP it is not
    claimed until the handler is free)."""
    first = await client.enqueue("long", queue="slow")
    second = await client.enqueue("next", queue="slow")
    hold = Hold()
    worker_clock = WorkerClock()
    worker = Worker(client, hold, concurrency=1, lease_ms=10_000, queues="slow", clock=worker_clock)
    held = 2 if transport == "grpc" else 1
    run = asyncio.ensure_future(worker.run())
    try:
        await asyncio.wait_for(hold.started.wait(), 5)
        await wait_until(client.stats, lambda s: s.handed_out == held, what="the tasks in hand")
        for _ in range(6):  # half a minute of broker time on 10-second leases
            await worker_clock.sleeping()
            await worker_clock.advance(5)
            # Every task in hand extended (each keeper asleep again until its next turn).
            await wait_until(lambda: worker_clock.parked >= held, what="the next extensions")
            await settle()
            clock.advance(5)
            await settle()
            assert (await client.stats()).handed_out == held
        hold.release.set()
        await wait_until(lambda: worker.succeeded == 2, what="both acks")
    finally:
        worker.stop()
        await asyncio.wait_for(run, 10)
    for task_id in (first, second):
        with pytest.raises(NotFound):
            await client.get_task(task_id)
    assert (await client.stats()).totals.reclaimed == 0


async def test_on_real_clocks_the_worker_keeps_leases_shorter_than_its_tasks(
    transport: str,
) -> None:
    """The production path end to end: the broker's clock and the worker's are the system's
    (event-loop timers start the lease keepers). Handlers that run twice as long as their one-second
    leases are kept, their tasks acked once and never reclaimed; quick ones set no keeper going."""
    async with running_broker() as real, AsyncClient(url_for(real, transport)) as wq:
        await wq.enqueue_many([{"slow": True}] * 2 + [{"slow": False}] * 20)
        done: list[bool] = []

        async def handler(task: Task) -> None:
            if task.payload["slow"]:
                await asyncio.sleep(2.2)
            done.append(task.payload["slow"])
            if len(done) == 22:
                worker.stop()

        worker = Worker(wq, handler, concurrency=4, lease_ms=1_000)
        await asyncio.wait_for(worker.run(), 20)
        stats = await wq.stats()
    assert sorted(done) == [False] * 20 + [True] * 2
    assert (worker.succeeded, worker.discarded) == (22, 0)
    assert (stats.totals.acked, stats.totals.reclaimed, stats.totals.delivered) == (22, 0, 22)


async def test_the_worker_discards_the_result_of_a_lost_lease(
    client: AsyncClient, clock: FakeClock
) -> None:
    task_id = await client.enqueue("long")
    hold = Hold()
    worker_clock = WorkerClock()
    worker = Worker(client, hold, concurrency=1, lease_ms=10_000, clock=worker_clock)
    run = asyncio.ensure_future(worker.run())
    try:
        await asyncio.wait_for(hold.started.wait(), 5)
        clock.advance(11)  # the broker takes the task back before the worker extends
        await settle()
        await worker_clock.sleeping()
        await worker_clock.advance(5)
        hold.release.set()
        await wait_until(lambda: worker.discarded == 1, what="the result to be discarded")
    finally:
        worker.stop()
        await asyncio.wait_for(run, 10)
    stats = await client.stats()
    assert (stats.totals.acked, stats.totals.reclaimed) == (0, 1)
    assert (await client.get_task(task_id)).state in ("ready", "delayed")


async def test_retry_and_fail_reach_the_broker(client: AsyncClient) -> None:
    retried = await client.enqueue({"do": "retry"}, max_attempts=5)
    failed = await client.enqueue({"do": "fail"}, max_attempts=5)

    def handler(task: Task) -> None:
        if task.payload["do"] == "retry":
            raise Retry(delay_ms=3_600_000, error="in an hour")
        raise Fail("no such account")

    worker = Worker(client, handler, concurrency=1, wait_ms=1_000)
    run = asyncio.ensure_future(worker.run())
    try:
        await wait_until(lambda: worker.failed == 2, what="both failures to be settled")
    finally:
        worker.stop()
        await asyncio.wait_for(run, 10)
    later = await client.get_task(retried)
    assert (later.state, later.last_error) == ("delayed", "in an hour")
    assert later.available_at >= later.created_at + timedelta(hours=1)
    dead = await client.get_task(failed)
    assert (dead.state, dead.attempts, dead.last_error) == ("dead", 1, "no such account")


# -- the blocking client --------------------------------------------------------------------------


async def test_the_blocking_client_end_to_end(broker: Broker, transport: str) -> None:
    url = url_for(broker, transport)

    def scenario() -> None:
        with Client(url) as c:
            first = c.enqueue("a", queue="q", priority=3, idempotency_key="k")
            assert c.enqueue("a", queue="q", idempotency_key="k").duplicate
            delivery = c.claim(wait_ms=0, queues=["q"])
            assert delivery is not None
            assert delivery.id == first
            assert c.extend(delivery, 60_000) == delivery.deadline + timedelta(seconds=30)
            c.nack(delivery, error="x", terminal=True)
            assert [t.id for t in c.dead_letters(queue="q")] == [first]
            c.purge(first)
            c.pause("q")
            assert [q.paused for q in c.queues() if q.name == "q"] == [True]
            c.resume("q")
            assert c.stats("q").totals.purged == 1

    await asyncio.to_thread(scenario)


# -- the commands ---------------------------------------------------------------------------------


def run_command(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


async def test_the_producer_enqueues_to_a_queue_at_a_priority_with_keys(
    broker: Broker, transport: str
) -> None:
    argv = producer_command(
        "-broker",
        url_for(broker, transport),
        "-n",
        "3",
        "-queue",
        "mail",
        "-priority",
        "6",
        "-idempotency-key",
        "run-1",
    )
    first = await asyncio.to_thread(run_command, argv)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("enqueued 3, failed 0")
    again = await asyncio.to_thread(run_command, argv)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("enqueued 0, duplicates 3, failed 0")
    async with AsyncClient(url_for(broker, transport)) as c:
        assert (await c.stats("mail")).ready == 3
        delivery = await claimed(c, queues="mail")
        assert (delivery.task.priority, delivery.payload["n"]) == (6, 1)


async def test_the_worker_command_takes_from_its_queues(
    broker: Broker, transport: str, tmp_path: Path
) -> None:
    url = url_for(broker, transport)
    async with AsyncClient(url) as c:
        wanted = [await c.enqueue({"n": n}, queue=q) for n, q in enumerate(["a", "b", "a"])]
        other = await c.enqueue({"n": 9}, queue="c")
    log_file = tmp_path / "jobs.log"
    argv = worker_command("-broker", url, "-log-file", str(log_file), "-queue", "a,b", "-quiet")
    proc = await asyncio.create_subprocess_exec(*argv)
    try:
        lines = await wait_until(
            lambda: log_file.read_text().splitlines() if log_file.exists() else [],
            lambda ls: len(ls) == 3,
            what="three tasks worked",
            timeout=20,
        )
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
    assert sorted(json.loads(line)["id"] for line in lines) == sorted(wanted)
    async with AsyncClient(url) as c:
        assert (await c.get_task(other)).state == "ready"
