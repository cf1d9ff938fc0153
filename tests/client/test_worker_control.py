"""The Worker's side of task control (issue 26), without a broker: a task cancelled while a
handler runs it, a task's time limit, and progress reports.

Each test runs over both of the worker's paths where both apply: claim loops on a unary transport
(as over HTTP: the worker learns of a cancel when its next extension is refused) and one stream on
a streaming transport (as over gRPC: the stream tells it at once), with an asyncio handler and a
synchronous one. Time is a :class:`FakeClock` moved on by hand; nothing sleeps to let time pass.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.fake_clock import FakeClock
from tests.fake_transport import FakeStreamingTransport, FakeTransport, Nack
from tests.helpers import wait_until
from wqclient import AsyncClient, Cancelled, Task, TimeLimitReached, WqError
from wqclient.worker import Worker

pytestmark = pytest.mark.timeout(30)

WORKER_LOG = "wqclient.worker"
LEASE_MS = 10_000
HALF = LEASE_MS / 2000  # seconds


@pytest.fixture(params=["unary", "stream"])
def fake(request: pytest.FixtureRequest) -> FakeTransport:
    return FakeStreamingTransport() if request.param == "stream" else FakeTransport()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@asynccontextmanager
async def running(
    fake: FakeTransport, handler: Callable[[Task], Any], clock: FakeClock, **options: Any
) -> AsyncIterator[Worker]:
    async with AsyncClient(transport=fake) as client:
        options.setdefault("lease_ms", LEASE_MS)
        options.setdefault("concurrency", 1)
        worker = Worker(client, handler, clock=clock, **options)
        run = asyncio.ensure_future(worker.run())
        try:
            yield worker
        finally:
            worker.stop()
            await asyncio.wait_for(run, 10)


def logged(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == WORKER_LOG and text in r.getMessage()]


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == WORKER_LOG and r.levelno >= logging.WARNING
    ]


class Held:
    """An asyncio handler that holds each task until released, noting the ones it was
    cancelled in (``swallow``: it then returns as if nothing happened)."""

    def __init__(self, swallow: bool = False) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.seen: list[str] = []
        self.cancelled: list[str] = []
        self.swallow = swallow

    async def __call__(self, task: Task) -> None:
        self.seen.append(task.id)
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(task.id)
            if not self.swallow:
                raise


class Polling:
    """A synchronous handler that works until ``task.cancelled`` says to stop (or it is
    released), then waits for ``finish`` before it returns."""

    def __init__(self, finish_at_once: bool = True) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.finish = threading.Event()
        if finish_at_once:
            self.finish.set()
        self.seen: list[str] = []
        self.saw_cancelled: list[str] = []
        self.returned: list[str] = []

    def __call__(self, task: Task) -> None:
        self.seen.append(task.id)
        self.started.set()
        deadline = time.monotonic() + 10
        while not task.cancelled and not self.release.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        if task.cancelled:
            self.saw_cancelled.append(task.id)
        self.finish.wait(10)
        self.returned.append(task.id)


async def started(handler: Held | Polling) -> None:
    if isinstance(handler, Held):
        await asyncio.wait_for(handler.started.wait(), 5)
    else:
        await asyncio.to_thread(handler.started.wait, 5)


async def cancel_told(fake: FakeTransport, clock: FakeClock, task_id: str) -> None:
    """Cancel a task a handler runs, and let the worker learn of it: a stream is told at once;
    over unary calls, the next extension (half a lease later) is refused."""
    assert await fake.cancel(task_id) == "cancelling"
    if not isinstance(fake, FakeStreamingTransport):
        await clock.sleeping()
        await clock.advance(HALF)


# -- cancel ---------------------------------------------------------------------------------------


async def test_a_cancelled_task_has_its_asyncio_handler_cancelled_and_is_nacked_once(
    fake: FakeTransport, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    task_id = fake.add("long")
    hold = Held()
    async with running(fake, hold, clock) as worker:
        await started(hold)
        await cancel_told(fake, clock, task_id)
        await fake.wait_until(lambda: bool(fake.nacks))
        after = fake.add("next")  # the worker carries on
        await wait_until(lambda: after in hold.seen, what="the next task to be handled")
        hold.release.set()
        await fake.wait_until(lambda: fake.acked == [after])
    assert hold.cancelled == [task_id]
    assert fake.nacks == [Nack(task_id, "cancelled")]
    assert task_id in fake.gone  # the broker dropped it: no retry
    assert fake.counters.cancelled == 1
    assert fake.acked == [after]
    assert (worker.succeeded, worker.failed, worker.cancelled) == (1, 0, 1)
    [record] = logged(caplog, "was cancelled")
    assert record.levelno == logging.INFO
    assert task_id in record.getMessage()
    assert warnings(caplog) == []  # not reported as a failure
    if isinstance(fake, FakeStreamingTransport):
        assert fake.calls_to("extend") == []  # told by the stream, not by a refusal


async def test_a_cancelled_task_is_seen_by_a_sync_handler_and_nacked_without_waiting_for_it(
    fake: FakeTransport, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    task_id = fake.add("long")
    handler = Polling(finish_at_once=False)
    async with running(fake, handler, clock) as worker:
        await started(handler)
        await cancel_told(fake, clock, task_id)
        await fake.wait_until(lambda: bool(fake.nacks))
        assert handler.returned == []  # nacked while the thread still runs
        await wait_until(
            lambda: handler.saw_cancelled == [task_id], what="the handler to see the cancel"
        )
        handler.finish.set()
        await wait_until(lambda: handler.returned == [task_id], what="the handler to return")
    assert fake.nacks == [Nack(task_id, "cancelled")]
    assert fake.calls_to("ack") == []  # its return is not an ack
    assert (worker.succeeded, worker.failed, worker.cancelled) == (0, 0, 1)
    assert len(logged(caplog, "was cancelled")) == 1
    assert warnings(caplog) == []


async def test_a_handler_that_swallows_the_cancel_is_still_nacked_and_the_worker_goes_on(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("long")
    hold = Held(swallow=True)
    async with running(fake, hold, clock) as worker:
        await started(hold)
        await cancel_told(fake, clock, task_id)
        await fake.wait_until(lambda: bool(fake.nacks))
        hold.release.set()
        # The worker's own task (a claim loop's, over unary calls) is not left cancelled.
        later = [fake.add(n) for n in range(3)]
        await fake.wait_until(lambda: fake.acked == later)
    assert hold.cancelled == [task_id]
    assert fake.nacks == [Nack(task_id, "cancelled")]
    assert (worker.succeeded, worker.cancelled) == (3, 1)


async def test_a_task_cancelled_while_it_waits_for_a_handler_is_never_handled(
    clock: FakeClock,
) -> None:
    fake = FakeStreamingTransport()
    first, second = fake.add("first"), fake.add("second")
    hold = Held()
    async with running(fake, hold, clock, concurrency=1, prefetch=2) as worker:
        await started(hold)
        await fake.wait_until(lambda: second in fake.held)  # prefetched, waiting
        assert await fake.cancel(second) == "cancelling"
        await fake.wait_until(lambda: fake.nacks == [Nack(second, "cancelled")])
        hold.release.set()
        await fake.wait_until(lambda: fake.acked == [first])
    assert hold.seen == [first]
    assert (worker.succeeded, worker.cancelled) == (1, 1)


async def test_a_cancel_told_once_the_handler_has_ended_changes_nothing(
    clock: FakeClock,
) -> None:
    fake = FakeStreamingTransport()
    task_id = fake.add("quick")
    async with running(fake, lambda task: None, clock) as worker:
        await fake.wait_until(lambda: fake.acked == [task_id])
        [stream] = fake.streams
        stream.tell_cancel(task_id, "lease1")  # crossed the ack on the wire
        after = fake.add("next")
        await fake.wait_until(lambda: fake.acked == [task_id, after])
    assert fake.nacks == []
    assert worker.cancelled == 0


async def test_cancels_told_before_the_worker_listens_are_not_lost(clock: FakeClock) -> None:
    fake = FakeStreamingTransport()
    [stream_task] = [fake.add("x")]
    stream = await fake.stream(1, None)
    delivery = await stream.__anext__()
    await fake.cancel(stream_task)
    assert stream.take_cancels() == [(stream_task, delivery.lease_id)]
    assert stream.take_cancels() == []  # each once


# -- time limits ----------------------------------------------------------------------------------


async def test_an_asyncio_handler_is_cancelled_at_its_tasks_time_limit_and_nacked(
    fake: FakeTransport, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    task_id = fake.add("slow", timeout_ms=3_000, max_attempts=1)
    hold = Held()
    async with running(fake, hold, clock) as worker:
        await started(hold)
        await clock.sleeping(2)  # the half-lease timer and the limit's
        await clock.advance(2.9)
        assert hold.cancelled == []
        await clock.advance(0.1)
        await fake.wait_until(lambda: bool(fake.nacks))
    assert hold.cancelled == [task_id]
    assert fake.nacks == [Nack(task_id, "timed out after 3000 ms")]
    assert fake.calls_to("extend") == []  # the limit came before half the lease
    assert (worker.failed, worker.timed_out, worker.cancelled) == (1, 1, 0)
    [record] = logged(caplog, "timed out after 3000 ms")
    assert record.levelno == logging.WARNING


async def test_a_sync_handler_at_its_time_limit_is_told_and_the_task_nacked_at_once(
    fake: FakeTransport, clock: FakeClock
) -> None:
    slow = fake.add("slow", timeout_ms=1_000, max_attempts=1)
    handler = Polling(finish_at_once=False)
    async with running(fake, handler, clock, concurrency=1, prefetch=1) as worker:
        await started(handler)
        after = fake.add("next")
        await clock.sleeping(2)
        await clock.advance(1.0)
        await fake.wait_until(lambda: fake.nacks == [Nack(slow, "timed out after 1000 ms")])
        await wait_until(
            lambda: handler.saw_cancelled == [slow], what="the handler to see its limit"
        )
        # Its thread still runs: the handler's slot is not free until it returns.
        assert handler.seen == [slow]
        handler.release.set()
        handler.finish.set()
        await fake.wait_until(lambda: fake.acked == [after])
    assert handler.seen == [slow, after]
    assert (worker.succeeded, worker.failed, worker.timed_out) == (1, 1, 1)


async def test_the_lease_is_extended_up_to_the_time_limit_and_no_further(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("slow", timeout_ms=12_000, max_attempts=1)
    hold = Held()
    async with running(fake, hold, clock):
        await started(hold)
        await clock.sleeping(2)
        await clock.advance(HALF)  # 5 s
        await fake.wait_until(lambda: len(fake.extends) == 1)
        await clock.sleeping(2)
        await clock.advance(HALF)  # 10 s
        await fake.wait_until(lambda: len(fake.extends) == 2)
        await clock.advance(2.0)  # 12 s: the limit
        await fake.wait_until(lambda: bool(fake.nacks))
        await clock.advance(10 * HALF)
    assert fake.extends == [(task_id, LEASE_MS)] * 2
    assert hold.cancelled == [task_id]
    assert fake.nacks == [Nack(task_id, "timed out after 12000 ms")]


async def test_the_brokers_refusal_at_the_time_limit_is_taken_quietly(
    fake: FakeTransport, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    task_id = fake.add("slow", timeout_ms=7_000, max_attempts=1)
    fake.fail("extend", TimeLimitReached(f"task {task_id} has reached its time limit of 7000 ms"))
    hold = Held()
    async with running(fake, hold, clock) as worker:
        await started(hold)
        await clock.sleeping(2)
        await clock.advance(HALF)
        await fake.wait_until(lambda: len(fake.calls_to("extend")) == 1)
        assert warnings(caplog) == []  # neither a lost lease nor a failed extension
        await clock.advance(2.0)  # 7 s
        await fake.wait_until(lambda: bool(fake.nacks))
    assert fake.calls_to("extend") == [task_id]  # not tried again
    assert fake.nacks == [Nack(task_id, "timed out after 7000 ms")]
    assert worker.discarded == 0
    assert warnings(caplog) == [
        f"task {task_id} timed out after 7000 ms (attempt 1 of 1): its handler was stopped"
    ]


async def test_the_time_limit_counts_from_when_the_worker_got_the_task(clock: FakeClock) -> None:
    fake = FakeStreamingTransport()
    first = fake.add("first")
    late = fake.add("late", timeout_ms=2_000, max_attempts=1)
    hold = Held()
    async with running(fake, hold, clock, concurrency=1, prefetch=2):
        await started(hold)
        await fake.wait_until(lambda: late in fake.held)  # waiting for the only handler
        await clock.sleeping(2)  # one timer for the leases (see _LeaseWatch), the limit's
        await clock.advance(2.0)
        await fake.wait_until(lambda: fake.nacks == [Nack(late, "timed out after 2000 ms")])
        hold.release.set()
        await fake.wait_until(lambda: fake.acked == [first])
    assert hold.seen == [first]  # the late one never started


async def test_a_task_without_a_time_limit_runs_as_long_as_it_is_extended(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("long")
    hold = Held()
    async with running(fake, hold, clock):
        await started(hold)
        for n in range(1, 4):
            await clock.sleeping()
            await clock.advance(HALF)
            await fake.wait_until(lambda n=n: len(fake.extends) == n)  # type: ignore[misc]
        hold.release.set()
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert hold.cancelled == []


# -- progress -------------------------------------------------------------------------------------


async def test_an_asyncio_handler_reports_progress_which_extends_the_lease(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("work")
    hold = Held()
    seen: list[Any] = []

    async def handler(task: Task) -> None:
        await task.progress({"done": 1, "of": 3})
        seen.append((await fake.get_task(task.id)).progress_value)
        await task.progress(b'{"done":2,"of":3}')  # JSON text as it is
        await hold(task)

    async with running(fake, handler, clock):
        await started(hold)
        assert fake.progress_reports == [
            (task_id, b'{"done":1,"of":3}'),
            (task_id, b'{"done":2,"of":3}'),
        ]
        looked_up = await fake.get_task(task_id)
        assert looked_up.progress_json == b'{"done":2,"of":3}'
        hold.release.set()
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert seen == [{"done": 1, "of": 3}]
    assert fake.extends == [(task_id, LEASE_MS)] * 2
    if isinstance(fake, FakeStreamingTransport):
        assert fake.streams[0].stream_extends == [task_id] * 2  # on the stream


async def test_a_sync_handler_reports_progress_blocking(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("work")
    reported = threading.Event()

    def handler(task: Task) -> None:
        task.report_progress(0.5)
        task.report_progress(None)  # JSON null is a progress too
        reported.set()

    async with running(fake, handler, clock):
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert reported.is_set()
    assert fake.progress_reports == [(task_id, b"0.5"), (task_id, b"null")]


async def test_progress_on_a_cancelled_task_cancels_an_asyncio_handler(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    fake = FakeTransport()  # (no stream to tell it: the extension's refusal does)
    task_id = fake.add("work")
    outcome: list[str] = []
    cancelled = asyncio.Event()

    async def handler(task: Task) -> None:
        await cancelled.wait()
        try:
            await task.progress(1)
        except asyncio.CancelledError:
            outcome.append("CancelledError")
            raise
        outcome.append("went on")

    async with running(fake, handler, clock) as worker:
        await fake.wait_until(lambda: task_id in fake.held)
        await fake.cancel(task_id)
        cancelled.set()
        await fake.wait_until(lambda: bool(fake.nacks))
    assert outcome == ["CancelledError"]
    assert fake.nacks == [Nack(task_id, "cancelled")]
    assert fake.progress_reports == []  # refused, so not recorded
    assert worker.cancelled == 1
    assert warnings(caplog) == []


async def test_progress_on_a_cancelled_task_raises_cancelled_in_a_sync_handler(
    clock: FakeClock,
) -> None:
    fake = FakeTransport()
    task_id = fake.add("work")
    go = threading.Event()
    outcome: list[Any] = []

    def handler(task: Task) -> None:
        go.wait(10)
        try:
            task.report_progress(1)
        except Cancelled as e:
            outcome.append((type(e).__name__, task.cancelled))
        try:
            task.report_progress(2)  # still cancelled: no second extension
        except Cancelled:
            outcome.append("again")

    async with running(fake, handler, clock) as worker:
        await fake.wait_until(lambda: task_id in fake.held)
        await fake.cancel(task_id)
        go.set()
        await fake.wait_until(lambda: bool(fake.nacks))
        await wait_until(lambda: len(outcome) == 2, what="both progress reports to be refused")
    assert outcome == [("Cancelled", True), "again"]
    assert fake.calls_to("extend") == [task_id]
    assert fake.nacks == [Nack(task_id, "cancelled")]
    assert worker.cancelled == 1


async def test_progress_needs_a_task_a_worker_handed_out() -> None:
    now = datetime.now(UTC)
    task = Task("t1", b"1", 1, 3, now, now)
    assert task.cancelled is False
    with pytest.raises(WqError, match="not handed to a handler by a wqclient Worker"):
        await task.progress(1)
    with pytest.raises(WqError, match="not handed to a handler by a wqclient Worker"):
        task.report_progress(1)


async def test_report_progress_from_an_asyncio_handler_is_refused(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("work")
    errors: list[str] = []

    async def handler(task: Task) -> None:
        try:
            task.report_progress(1)  # would block the loop it needs
        except WqError as e:
            errors.append(e.message)

    async with running(fake, handler, clock):
        await fake.wait_until(lambda: fake.acked == [task_id])
    [message] = errors
    assert "task.progress(value)" in message
    assert fake.progress_reports == []


async def test_progress_after_the_handler_ended_is_refused(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("work")
    kept: list[Task] = []

    async def handler(task: Task) -> None:
        kept.append(task)

    async with running(fake, handler, clock):
        await fake.wait_until(lambda: fake.acked == [task_id])
    with pytest.raises(WqError, match="handler has ended"):
        await kept[0].progress(1)


async def test_a_progress_that_is_not_json_is_refused_before_it_is_sent(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("work")
    errors: list[str] = []

    async def handler(task: Task) -> None:
        try:
            await task.progress({1, 2})
        except WqError as e:
            errors.append(e.message)

    async with running(fake, handler, clock):
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert errors
    assert errors[0].startswith("progress cannot be encoded as JSON")
    assert fake.calls_to("extend") == []
