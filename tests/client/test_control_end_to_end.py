"""Task control (issue 26) end to end: wqclient against a real in-process broker, over HTTP and over
gRPC, with the same meanings on both. Cancel in every state, listing and paging, emptying and
deleting queues, expiry, time limits, unique keys, progress; and the Worker stopping a handler
whose task is cancelled (told on its gRPC stream, or refused an extension over HTTP) or reaches its
time limit.

The broker runs on a :class:`wqbroker.clock.FakeClock` and the Worker on a fake clock of its own
(tests/fake_clock.py), so nothing here sleeps to let time pass.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.fake_clock import FakeClock as WorkerClock
from tests.helpers import running_broker, settle, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqclient import (
    AsyncClient,
    Cancelled,
    Client,
    Conflict,
    Delivery,
    EnqueueItem,
    InvalidArgument,
    LeaseLost,
    NotFound,
    Task,
    TimeLimitReached,
)
from wqclient.worker import Worker

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


async def buried(client: AsyncClient, queue: str | None = None) -> str:
    task_id = await client.enqueue("doomed", max_attempts=1, queue=queue)
    delivery = await claimed(client, queues=queue)
    await client.nack(delivery, error="boom")
    return str(task_id)


# -- cancel ---------------------------------------------------------------------------------------


async def test_cancel_in_every_state(client: AsyncClient) -> None:
    dead = await buried(client)
    held = await client.enqueue("running")
    delivery = await claimed(client)
    ready = await client.enqueue("waiting")
    delayed = await client.enqueue("later", delay_ms=60_000)
    assert await client.cancel(ready) == "cancelled"
    assert await client.cancel(delayed) == "cancelled"
    assert await client.cancel(dead) == "purged"
    assert await client.cancel(held) == "cancelling"
    assert await client.cancel(held) == "cancelling"
    for gone in (ready, delayed, dead):
        with pytest.raises(NotFound):
            await client.get_task(gone)
        with pytest.raises(NotFound):
            await client.cancel(gone)
    with pytest.raises(NotFound):
        await client.cancel("f" * 32)
    looked_up = await client.get_task(held)
    assert (looked_up.state, looked_up.cancelling) == ("handed_out", True)
    with pytest.raises(Cancelled):
        await client.extend(delivery, 10_000)
    await client.nack(delivery, error="stopped")  # dropped, not retried
    with pytest.raises(NotFound):
        await client.get_task(held)
    stats = await client.stats()
    assert (stats.ready, stats.handed_out, stats.delayed, stats.dead) == (0, 0, 0, 0)
    assert (stats.totals.cancelled, stats.totals.purged, stats.totals.retried) == (3, 1, 0)


async def test_a_cancelling_task_acked_counts_as_acked(client: AsyncClient) -> None:
    task_id = await client.enqueue("nearly done")
    delivery = await claimed(client)
    assert await client.cancel(task_id) == "cancelling"
    await client.ack(delivery)
    totals = (await client.stats()).totals
    assert (totals.acked, totals.cancelled) == (1, 0)


async def test_a_cancelling_task_whose_lease_runs_out_is_dropped(
    client: AsyncClient, clock: FakeClock
) -> None:
    task_id = await client.enqueue("abandoned")
    await claimed(client, lease_ms=1_000)
    await client.cancel(task_id)
    clock.advance(2)
    await wait_until(client.stats, lambda s: s.totals.cancelled == 1, what="the drop")
    with pytest.raises(NotFound):
        await client.get_task(task_id)
    assert await client.claim(wait_ms=0) is None


# -- listing --------------------------------------------------------------------------------------


async def test_listing_pages_through_a_queue_in_claim_order(client: AsyncClient) -> None:
    low = [await client.enqueue({"n": n}, queue="list", priority=1) for n in range(5)]
    high = [await client.enqueue({"n": n}, queue="list", priority=8) for n in range(3)]
    await client.enqueue("other queue")
    first = await client.list_tasks("list", limit=3)
    assert [t.id for t in first] == high
    assert all(t.state == "ready" for t in first)
    assert first.next_cursor is not None
    rest = [t.id async for t in client.iter_tasks("list", cursor=first.next_cursor, limit=2)]
    assert rest == low
    every = [t.id async for t in client.iter_tasks("list", limit=1)]
    assert every == high + low
    last = await client.list_tasks("list", limit=8)
    assert (
        last.next_cursor is None
        or (await client.list_tasks("list", cursor=last.next_cursor)).tasks == []
    )


async def test_listing_each_state(client: AsyncClient) -> None:
    dead = await buried(client, "states")
    later = await client.enqueue("later", queue="states", delay_ms=60_000)
    held = await client.enqueue({"run": 1}, queue="states", timeout_ms=600_000)
    delivery = await claimed(client, queues="states")
    await client.extend(delivery, progress={"pct": 25})
    ready = await client.enqueue("now", queue="states", expires_in_ms=3_600_000)
    by_state = {
        state: (await client.list_tasks("states", state)).tasks
        for state in ("ready", "delayed", "handed_out", "dead")
    }
    assert {state: [t.id for t in tasks] for state, tasks in by_state.items()} == {
        "ready": [ready],
        "delayed": [later],
        "handed_out": [held],
        "dead": [dead],
    }
    [running] = by_state["handed_out"]
    assert (running.state, running.progress_value, running.timeout_ms) == (
        "handed_out",
        {"pct": 25},
        600_000,
    )
    [waiting] = by_state["ready"]
    assert waiting.expires_at is not None
    assert by_state["dead"][0].last_error == "boom"


async def test_bad_listings_are_invalid_arguments(client: AsyncClient) -> None:
    with pytest.raises(InvalidArgument, match="state"):
        await client.list_tasks(state="running")
    with pytest.raises(InvalidArgument, match="limit"):
        await client.list_tasks(limit=1001)
    with pytest.raises(InvalidArgument, match="cursor"):
        await client.list_tasks(cursor="not-a-cursor")
    await client.enqueue(1)
    await client.enqueue(2)
    page = await client.list_tasks(limit=1)
    assert page.next_cursor is not None
    with pytest.raises(InvalidArgument, match="cursor"):
        await client.list_tasks(state="dead", cursor=page.next_cursor)  # another state's


# -- queues ---------------------------------------------------------------------------------------


async def test_empty_and_delete_a_queue(client: AsyncClient) -> None:
    for n in range(3):
        await client.enqueue(n, queue="doomed")
    await client.enqueue("later", queue="doomed", delay_ms=60_000)
    await client.pause("doomed")
    with pytest.raises(Conflict):
        await client.delete_queue("doomed")
    assert await client.empty_queue("doomed") == 4
    await client.delete_queue("doomed")
    assert "doomed" not in [q.name for q in await client.queues()]
    with pytest.raises(NotFound):
        await client.delete_queue("doomed")
    with pytest.raises(NotFound):
        await client.empty_queue("never-seen")
    await client.enqueue("again", queue="doomed")  # makes it again, new: not paused
    [queue] = [q for q in await client.queues() if q.name == "doomed"]
    assert (queue.ready, queue.paused) == (1, False)
    assert (await client.stats()).totals.cancelled == 4


async def test_a_queue_with_a_running_task_is_emptied_but_not_deleted(client: AsyncClient) -> None:
    await client.enqueue("running", queue="busy")
    delivery = await claimed(client, queues="busy")
    await client.enqueue("waiting", queue="busy")
    assert await client.empty_queue("busy") == 1
    with pytest.raises(Conflict, match="1 handed-out"):
        await client.delete_queue("busy")
    await client.ack(delivery)  # it ran its course
    await client.delete_queue("busy")


# -- enqueue options ------------------------------------------------------------------------------


async def test_a_task_not_handed_out_in_time_expires(client: AsyncClient, clock: FakeClock) -> None:
    soon = await client.enqueue("soon", expires_in_ms=5_000)
    batch = await client.enqueue_many(["a", "b"], expires_in_ms=5_000)
    kept = await client.enqueue("kept")
    view = await client.get_task(soon)
    assert view.expires_at is not None
    clock.advance(6)
    delivery = await claimed(client)
    assert delivery.id == kept
    assert await client.claim(wait_ms=0) is None
    for task_id in (soon, *batch):
        with pytest.raises(NotFound):
            await client.get_task(task_id)
    assert (await client.stats()).totals.expired == 3


async def test_a_time_limit_caps_the_lease_and_refuses_extensions_past_it(
    client: AsyncClient, clock: FakeClock
) -> None:
    task_id = await client.enqueue("limited", timeout_ms=3_000, max_attempts=2)
    delivery = await claimed(client, lease_ms=1_000)
    assert delivery.task.timeout_ms == 3_000
    clock.advance(0.5)
    deadline = await client.extend(delivery, 60_000)  # cut to the limit: 3 s from hand-out
    assert abs((deadline - delivery.deadline).total_seconds() - 2.0) < 0.01
    with pytest.raises(TimeLimitReached) as refused:
        await client.extend(delivery, 60_000)  # at the limit: it cannot move
    assert isinstance(refused.value, LeaseLost)
    claimed_at_limit = await client.claim(wait_ms=0, lease_ms=60_000)
    assert claimed_at_limit is None
    clock.advance(3)  # the lease runs out at the limit: retried
    await wait_until(client.stats, lambda s: s.totals.reclaimed == 1, what="the reclaim")
    assert (await client.get_task(task_id)).state in ("ready", "delayed")
    clock.advance(60)  # (past the retry's backoff)
    again = await claimed(client, lease_ms=60_000)
    assert again.id == task_id
    # A claim's lease too is cut to the limit.
    now = datetime.fromtimestamp(clock.now(), UTC)
    assert abs((again.deadline - now).total_seconds() - 3) < 0.01


async def test_a_unique_key_holds_while_its_task_is_active(client: AsyncClient) -> None:
    first = await client.enqueue("one", idempotency_key="order-1", unique=True)
    again = await client.enqueue("two", idempotency_key="order-1", unique=True)
    assert (again, again.duplicate) == (first, True)
    [item] = await client.enqueue_many(
        [EnqueueItem(b'"three"', idempotency_key="order-1", unique=True)]
    )
    assert (item, item.duplicate) == (first, True)
    await client.ack(await claimed(client))
    after = await client.enqueue("four", idempotency_key="order-1", unique=True)
    assert after != first
    assert after.duplicate is False
    with pytest.raises(InvalidArgument, match="unique"):
        await client.enqueue("no key", unique=True)


async def test_progress_is_shown_while_handed_out(client: AsyncClient) -> None:
    task_id = await client.enqueue("work")
    delivery = await claimed(client)
    await client.extend(delivery, progress={"done": 3, "of": 10, "note": "ünïcode"})
    assert (await client.get_task(task_id)).progress_value == {
        "done": 3,
        "of": 10,
        "note": "ünïcode",
    }
    await client.extend(delivery, progress=b"1.10")  # kept as it is
    assert (await client.get_task(task_id)).progress_json == b"1.10"
    with pytest.raises(InvalidArgument, match="progress"):
        await client.extend(delivery, progress="x" * 5000)
    await client.nack(delivery, error="again")
    assert (await client.get_task(task_id)).progress_json is None  # cleared


# -- the Worker -----------------------------------------------------------------------------------


class Hold:
    """An asyncio handler that holds each task until released, noting the cancelled ones."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled: list[str] = []

    async def __call__(self, task: Task) -> None:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(task.id)
            raise


async def test_the_worker_stops_the_handler_of_a_cancelled_task(
    client: AsyncClient, transport: str, broker: Broker
) -> None:
    task_id = await client.enqueue("long")
    hold = Hold()
    worker_clock = WorkerClock()
    worker = Worker(client, hold, concurrency=1, lease_ms=10_000, clock=worker_clock)
    run = asyncio.ensure_future(worker.run())
    try:
        await asyncio.wait_for(hold.started.wait(), 5)
        async with AsyncClient(url_for(broker, transport)) as admin:
            assert await admin.cancel(task_id) == "cancelling"
        if transport == "http":  # told when its next extension is refused
            await worker_clock.sleeping()
            await worker_clock.advance(5)
        await wait_until(lambda: worker.cancelled == 1, what="the cancel")
        await wait_until(client.stats, lambda s: s.totals.cancelled == 1, what="the nack")
    finally:
        worker.stop()
        await asyncio.wait_for(run, 10)
    assert hold.cancelled == [task_id]
    assert (worker.succeeded, worker.failed) == (0, 0)
    stats = await client.stats()
    assert (stats.handed_out, stats.ready, stats.totals.retried) == (0, 0, 0)


async def test_a_sync_handler_sees_its_task_cancelled(client: AsyncClient, transport: str) -> None:
    task_id = await client.enqueue("long")
    started, saw = threading.Event(), threading.Event()

    def handler(task: Task) -> None:
        started.set()
        for _ in range(10_000):
            if task.cancelled:
                saw.set()
                return
            threading.Event().wait(0.001)

    worker_clock = WorkerClock()
    worker = Worker(client, handler, concurrency=1, lease_ms=10_000, clock=worker_clock)
    run = asyncio.ensure_future(worker.run())
    try:
        await asyncio.to_thread(started.wait, 5)
        await client.cancel(task_id)
        if transport == "http":
            await worker_clock.sleeping()
            await worker_clock.advance(5)
        await asyncio.to_thread(saw.wait, 5)
        await wait_until(client.stats, lambda s: s.totals.cancelled == 1, what="the nack")
    finally:
        worker.stop()
        await asyncio.wait_for(run, 10)
    assert saw.is_set()
    assert (worker.cancelled, worker.succeeded) == (1, 0)


async def test_the_worker_stops_a_handler_at_its_tasks_time_limit(
    client: AsyncClient, clock: FakeClock
) -> None:
    task_id = await client.enqueue("hangs", timeout_ms=4_000, max_attempts=1)
    hold = Hold()
    worker_clock = WorkerClock()
    worker = Worker(client, hold, concurrency=1, lease_ms=10_000, clock=worker_clock)
    run = asyncio.ensure_future(worker.run())
    try:
        await asyncio.wait_for(hold.started.wait(), 5)
        await worker_clock.sleeping(2)
        await worker_clock.advance(4)
        await wait_until(client.stats, lambda s: s.dead == 1, what="the nack")
    finally:
        worker.stop()
        await asyncio.wait_for(run, 10)
    assert hold.cancelled == [task_id]
    [dead] = await client.dead_letters()
    assert (dead.id, dead.last_error) == (task_id, "timed out after 4000 ms")
    assert (worker.failed, worker.timed_out) == (1, 1)


async def test_a_handler_reports_progress_through_the_worker(client: AsyncClient) -> None:
    task_id = await client.enqueue("work")
    seen: list[Any] = []
    release = asyncio.Event()

    async def handler(task: Task) -> None:
        await task.progress({"step": 1})
        seen.append((await client.get_task(task.id)).progress_value)
        await release.wait()

    worker = Worker(client, handler, concurrency=1)
    run = asyncio.ensure_future(worker.run())
    try:
        await wait_until(lambda: seen, what="the progress")
        release.set()
        await wait_until(lambda: worker.succeeded == 1, what="the ack")
    finally:
        worker.stop()
        await asyncio.wait_for(run, 10)
    assert seen == [{"step": 1}]
    with pytest.raises(NotFound):
        await client.get_task(task_id)


async def test_a_sync_handler_reports_progress_through_the_worker(client: AsyncClient) -> None:
    task_id = await client.enqueue("work")
    reported, release = threading.Event(), threading.Event()

    def handler(task: Task) -> None:
        task.report_progress({"rows": 500})
        reported.set()
        release.wait(10)

    worker = Worker(client, handler, concurrency=1)
    run = asyncio.ensure_future(worker.run())
    try:
        await asyncio.to_thread(reported.wait, 5)
        assert (await client.get_task(task_id)).progress_value == {"rows": 500}
        release.set()
        await wait_until(lambda: worker.succeeded == 1, what="the ack")
    finally:
        release.set()
        worker.stop()
        await asyncio.wait_for(run, 10)


async def test_the_blocking_client_end_to_end(broker: Broker, transport: str) -> None:
    def scene() -> None:
        with Client(url_for(broker, transport)) as wq:
            ids = [wq.enqueue(n, queue="sync", timeout_ms=60_000) for n in range(3)]
            assert [t.id for t in wq.iter_tasks("sync", limit=2)] == ids
            delivery = wq.claim(wait_ms=0, queues="sync")
            assert delivery is not None
            wq.extend(delivery, progress="half")
            assert wq.get_task(delivery.id).progress_value == "half"
            assert wq.cancel(delivery) == "cancelling"
            assert wq.cancel(ids[1]) == "cancelled"
            with pytest.raises(Conflict):
                wq.delete_queue("sync")
            assert wq.empty_queue("sync") == 1
            wq.nack(delivery)
            wq.delete_queue("sync")
            assert wq.stats().totals.cancelled == 3

    await asyncio.to_thread(scene)
    await settle()
