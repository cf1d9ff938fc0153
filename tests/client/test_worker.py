"""The Worker runner without a broker: driven through ``AsyncClient(transport=fake)``.

Each test runs over both of the worker's paths: claim loops on a unary transport (as over HTTP)
and one stream on a streaming transport (as over gRPC). Nothing sleeps to let things happen:
tests wait for conditions on the fake's state or for events their handlers set.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.fake_clock import FakeClock
from tests.fake_transport import FakeStreamingTransport, FakeTransport
from tests.helpers import settle
from wqclient import AsyncClient, Overloaded, StreamingTransport, Task, Unavailable, WqError
from wqclient.clock import Clock, SystemClock, call_later
from wqclient.worker import TaskFailed, Worker, _Lease, _LeaseWatch

pytestmark = pytest.mark.timeout(30)

WORKER_LOG = "wqclient.worker"
PATHS = ["unary", "stream"]


@pytest.fixture(params=PATHS)
def fake(request: pytest.FixtureRequest) -> FakeTransport:
    return FakeStreamingTransport() if request.param == "stream" else FakeTransport()


@asynccontextmanager
async def running(
    fake: FakeTransport, handler: Callable[[Task], Any], **options: Any
) -> AsyncIterator[Worker]:
    """A Worker on ``fake``, running in the background; on the way out it is stopped, and its
    run() must return cleanly."""
    async with AsyncClient(transport=fake) as client:
        worker = Worker(client, handler, **options)
        run = asyncio.ensure_future(worker.run())
        try:
            yield worker
        finally:
            worker.stop()
            await asyncio.wait_for(run, 10)


def logged(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == WORKER_LOG and text in r.getMessage()]


# -- which path ---------------------------------------------------------------------------------


async def test_a_client_streams_only_over_a_transport_that_can() -> None:
    assert not isinstance(FakeTransport(), StreamingTransport)
    async with AsyncClient(transport=FakeTransport()) as client:
        assert not client.can_stream
        with pytest.raises(WqError) as e:
            await client.stream(prefetch=2)
        assert "cannot stream over FakeTransport" in e.value.message
    async with AsyncClient(transport=FakeStreamingTransport()) as client:
        assert client.can_stream


async def test_over_a_unary_transport_the_worker_runs_one_claim_loop_per_unit_of_concurrency() -> (
    None
):
    fake = FakeTransport()
    async with running(fake, lambda task: None, concurrency=3, wait_ms=5_000, lease_ms=7_000):
        await fake.wait_until(lambda: len(fake.claims) == 3)  # all three parked
        assert fake.claims == [(5_000, 7_000)] * 3
        task_id = fake.add("work")
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert fake.calls_to("stream") == []


@pytest.mark.parametrize(("prefetch", "opened"), [(None, 8), (4, 4), (6, 6)])
async def test_over_a_streaming_transport_the_worker_opens_one_stream_of_its_prefetch(
    prefetch: int | None, opened: int
) -> None:
    fake = FakeStreamingTransport()
    async with running(
        fake, lambda task: None, concurrency=4, prefetch=prefetch, lease_ms=7_000
    ) as worker:
        task_id = fake.add("work")
        await fake.wait_until(lambda: fake.acked == [task_id])
        [stream] = fake.streams
        assert (stream.prefetch, stream.lease_ms) == (opened, 7_000)  # (twice, by default)
        assert worker.prefetch == opened
    assert fake.claims == []
    assert stream.closed
    assert stream.unsettled == {}


def test_a_prefetch_below_the_concurrency_is_refused() -> None:
    with pytest.raises(ValueError, match="prefetch must be at least the concurrency"):
        Worker("grpc://127.0.0.1:1", lambda task: None, concurrency=4, prefetch=3)


# -- outcomes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_returning_acks_and_raising_nacks_with_the_exception_text(
    fake: FakeTransport, kind: str
) -> None:
    def work(task: Task) -> None:
        if task.payload == "boom":
            raise ValueError("no good")
        if task.payload == "refuse":
            raise TaskFailed("cannot do this one")

    async def work_async(task: Task) -> None:
        work(task)

    ok = fake.add("fine", max_attempts=1)
    boom = fake.add("boom", max_attempts=1)
    refused = fake.add("refuse", max_attempts=1)
    handler = work if kind == "sync" else work_async
    async with running(fake, handler, concurrency=1) as worker:
        await fake.wait_until(lambda: len(fake.acked) + len(fake.nacked) == 3)
    assert fake.acked == [ok]
    assert fake.nacked == [(boom, "ValueError: no good"), (refused, "cannot do this one")]
    assert fake.dead == [boom, refused]
    assert (worker.succeeded, worker.failed) == (1, 2)


async def test_a_sync_handler_runs_off_the_event_loop(fake: FakeTransport) -> None:
    threads: list[threading.Thread] = []
    task_id = fake.add("work")
    async with running(fake, lambda task: threads.append(threading.current_thread())):
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert threads
    assert threads[0] is not threading.main_thread()


# -- concurrency and stop -----------------------------------------------------------------------


class Gate:
    """An async handler that holds every task until released, and counts how many it holds."""

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted
        self.holding = 0
        self.peak = 0
        self.seen: list[str] = []
        self.full = asyncio.Event()  # set when ``wanted`` tasks are held at once
        self.release = asyncio.Event()

    async def __call__(self, task: Task) -> None:
        self.seen.append(task.id)
        self.holding += 1
        self.peak = max(self.peak, self.holding)
        if self.holding == self.wanted:
            self.full.set()
        try:
            await self.release.wait()
        finally:
            self.holding -= 1


async def test_concurrency_is_used_and_never_exceeded(fake: FakeTransport) -> None:
    ids = [fake.add(n) for n in range(10)]
    gate = Gate(3)
    async with running(fake, gate, concurrency=3):
        await asyncio.wait_for(gate.full.wait(), 5)
        # Three in hand (over a stream three more waiting for a handler), the rest left on the
        # broker for somebody else.
        held = 6 if isinstance(fake, FakeStreamingTransport) else 3
        await fake.wait_until(lambda: len(fake.held) == held)
        await settle()
        assert (len(fake.held), len(fake.ready), gate.peak) == (held, 10 - held, 3)
        gate.release.set()
        await fake.wait_until(lambda: len(fake.acked) == 10)
    assert sorted(fake.acked) == sorted(ids)
    assert gate.peak == 3


async def test_stop_lets_the_tasks_in_hand_finish_and_settle_and_claims_no_more(
    fake: FakeTransport,
) -> None:
    ids = [fake.add(n) for n in range(5)]
    gate = Gate(2)
    async with AsyncClient(transport=fake) as client:
        worker = Worker(client, gate, concurrency=2)
        held = 4 if isinstance(fake, FakeStreamingTransport) else 2  # (its prefetch)
        run = asyncio.ensure_future(worker.run())
        await asyncio.wait_for(gate.full.wait(), 5)
        await fake.wait_until(lambda: len(fake.held) == held)
        worker.stop()
        if isinstance(fake, FakeStreamingTransport):
            await fake.wait_until(lambda: fake.streams[0].draining)
        assert not run.done()  # still holding its tasks
        gate.release.set()
        await asyncio.wait_for(run, 10)
        assert not fake.closed  # the client is the caller's: the worker leaves it open
    # The tasks in hand, those waiting for a handler too, are done; no other was claimed.
    assert sorted(fake.acked) == sorted(gate.seen) == ids[:held]
    assert list(fake.ready) == ids[held:]
    assert fake.held == {}


async def test_stop_returns_promptly_from_an_idle_worker(fake: FakeTransport) -> None:
    async with AsyncClient(transport=fake) as client:
        worker = Worker(client, lambda task: None, concurrency=2)
        run = asyncio.ensure_future(worker.run())
        if isinstance(fake, FakeStreamingTransport):
            await fake.wait_until(lambda: len(fake.streams) == 1)
        else:
            await fake.wait_until(lambda: len(fake.claims) == 2)  # both parked
        worker.stop()
        await asyncio.wait_for(run, 5)
    assert fake.acked == []
    assert fake.held == {}


# -- an unreachable broker, a lost lease ---------------------------------------------------------


async def test_a_broker_that_is_unavailable_for_a_while_is_retried_and_the_worker_recovers(
    fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    op = "stream" if isinstance(fake, FakeStreamingTransport) else "claim"
    fake.fail(op, Unavailable("connection refused"), times=3)
    task_id = fake.add("work")
    async with running(fake, lambda task: None, concurrency=1):
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert len(fake.calls_to(op)) >= 4  # three refused, then one that worked
    [down] = logged(caplog, "broker unavailable")  # said once, not once per attempt
    assert down.levelno == logging.WARNING
    assert "connection refused" in down.getMessage()
    assert len(logged(caplog, "reachable again")) == 1


async def test_an_ack_that_cannot_reach_the_broker_is_retried(fake: FakeTransport) -> None:
    fake.fail("ack", Unavailable("connection reset"), times=2)
    task_id = fake.add("work")
    async with running(fake, lambda task: None, concurrency=1):
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert fake.calls_to("ack") == [task_id] * 3


async def test_lease_lost_on_ack_is_logged_and_not_retried(
    fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    lost = fake.add("slow")

    async def handler(task: Task) -> None:
        if task.id == lost:
            fake.take_away(task.id)  # meanwhile the lease ran out and somebody else has it

    async with running(fake, handler, concurrency=1):
        await fake.wait_until(lambda: fake.calls_to("ack") == [lost])
        after = fake.add("next")  # the worker carries on
        await fake.wait_until(lambda: fake.acked == [after])
    assert fake.calls_to("ack") == [lost, after]  # the lost one was tried once
    assert lost in fake.held  # still the other holder's
    [warning] = logged(caplog, "lease no longer valid")
    assert warning.levelno == logging.WARNING
    assert lost in warning.getMessage()


async def test_a_broken_stream_is_reopened_and_its_task_comes_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    fake = FakeStreamingTransport()
    task_id = fake.add("work")
    attempts: list[int] = []
    first_in_hand = asyncio.Event()

    async def handler(task: Task) -> None:
        attempts.append(task.attempts)
        if task.attempts == 1:
            first_in_hand.set()
            await fake.wait_until(lambda: fake.streams[0].broken is not None)

    async with running(fake, handler, concurrency=1):
        await asyncio.wait_for(first_in_hand.wait(), 5)
        fake.break_streams()
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert attempts == [1, 2]
    assert len(fake.streams) == 2
    assert fake.counters.reclaimed == 1
    assert len(logged(caplog, "the stream ended before its outcome was sent")) == 1


async def test_a_busy_broker_is_waited_out_as_it_asks_and_said_once(
    fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    op = "stream" if isinstance(fake, FakeStreamingTransport) else "claim"
    fake.fail(op, Overloaded("50000 consumers are already waiting", retry_after=0.05), times=2)
    task_id = fake.add("work")
    async with running(fake, lambda task: None, concurrency=1):
        await fake.wait_until(lambda: fake.acked == [task_id])
    [busy] = logged(caplog, "broker busy")
    assert busy.levelno == logging.WARNING
    assert "consumers are already waiting" in busy.getMessage()
    assert not logged(caplog, "broker unavailable")


# -- timers: the clock's own, or a task that sleeps -------------------------------------------


class _SleepOnly:
    """A clock as the Clock protocol asks, no more (no call_later of its own)."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock

    def monotonic(self) -> float:
        return self._clock.monotonic()

    async def sleep(self, seconds: float) -> None:
        await self._clock.sleep(seconds)


@pytest.mark.parametrize("own", [True, False], ids=["own timer", "sleeping task"])
async def test_call_later_calls_back_once_the_time_has_passed_unless_cancelled(own: bool) -> None:
    fake = FakeClock()
    clock: Clock = fake if own else _SleepOnly(fake)
    called: list[str] = []
    kept = call_later(clock, 10, lambda: called.append("kept"))
    dropped = call_later(clock, 10, lambda: called.append("dropped"))
    await fake.sleeping(2)
    dropped.cancel()
    await fake.advance(9.9)
    assert called == []
    await fake.advance(0.2)
    assert called == ["kept"]
    assert kept is not None


async def test_the_system_clock_calls_back_on_the_event_loop() -> None:
    called = asyncio.Event()
    dropped: list[int] = []
    SystemClock().call_later(60, lambda: dropped.append(1)).cancel()
    call_later(SystemClock(), 0, called.set)
    await asyncio.wait_for(called.wait(), 5)
    assert dropped == []


async def test_a_handler_that_ends_before_half_the_lease_sets_no_keeper_going() -> None:
    # The lease keeper starts only when the watch's timer finds the handler still running: quick
    # handlers leave the watch as they end, and nothing is left parked on the clock (no sleeping
    # task per task, as there used to be, nor a timer per task: one for all of them).
    clock = FakeClock()
    transport = FakeStreamingTransport()
    async with AsyncClient(transport=transport) as client:
        for i in range(20):
            await client.enqueue({"n": i})
        done: list[int] = []

        async def handler(task: Task) -> None:
            done.append(task.payload["n"])
            if len(done) == 20:
                worker.stop()

        worker = Worker(client, handler, clock=clock, concurrency=4)
        await asyncio.wait_for(worker.run(), 10)
    assert sorted(done) == list(range(20))
    assert clock.parked == 0
    assert clock.sleeps == [15.0]  # one timer, for the first; cancelled when the worker ended


async def test_the_lease_watch_keeps_each_handler_due_in_order_and_none_that_ended() -> None:
    clock = FakeClock()
    watch = _LeaseWatch(clock, clock.call_later)
    kept: list[str] = []
    leases = {name: _Lease(datetime.now(UTC)) for name in "abcd"}
    watch.watch(leases["a"], 10, lambda: kept.append("a"))  # due at 10
    await clock.advance(3)
    watch.watch(leases["b"], 10, lambda: kept.append("b"))  # due at 13
    watch.watch(leases["c"], 10, lambda: kept.append("c"))  # due at 13, then dropped
    await clock.advance(3)
    watch.watch(leases["d"], 10, lambda: kept.append("d"))  # due at 16
    watch.drop(leases["c"])
    assert clock.sleeps == [10]  # one timer so far, for the oldest
    await clock.advance(4)  # t = 10
    assert kept == ["a"]
    assert clock.sleeps == [10, 3]  # set again, for b
    await clock.advance(3)  # t = 13
    assert kept == ["a", "b"]
    watch.drop(leases["d"])  # ended before it was due
    await clock.advance(10)
    assert kept == ["a", "b"]
    assert clock.parked == 0
    watch.watch(leases["a"], 10, lambda: kept.append("a again"))  # a new timer: none was left
    watch.close()
    assert clock.parked == 0
    await clock.advance(20)
    assert kept == ["a", "b"]


# -- acks on a real gRPC stream: queued, not waited for, their answers judged -------------------


async def test_a_worker_on_a_grpc_stream_does_not_wait_for_its_acks_and_judges_their_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.helpers import running_broker
    from wqbroker.clock import FakeClock as BrokerClock

    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    broker_clock = BrokerClock()
    async with (
        running_broker(clock=broker_clock) as broker,
        AsyncClient("grpc://" + broker.grpc_target) as other,
    ):
        url = "grpc://" + broker.grpc_target
        lost = await other.enqueue({"n": "lost"}, max_attempts=1)
        ids = [await other.enqueue({"n": i}) for i in range(20)]
        done: list[str] = []

        async def handler(task: Task) -> None:
            if task.id == lost:
                # Meanwhile its lease runs out at the broker (the worker's own clock stands
                # still, so it does not extend it): reclaimed, buried (one attempt).
                broker_clock.advance(120)
                await broker.service.sweep()
            done.append(task.id)
            if len(done) == 21:
                worker.stop()

        worker = Worker(url, handler, concurrency=1, prefetch=1, clock=FakeClock())  # (one)
        await asyncio.wait_for(worker.run(), 15)
        stats = await other.stats()
        assert stats.totals.acked == 20
        assert stats.dead == 1  # the lost one: reclaimed, out of attempts; its ack refused
        assert stats.handed_out == stats.ready == 0
        assert sorted(done) == sorted([lost, *ids])
        [warning] = logged(caplog, "lease no longer valid")  # judged when its answer came
        assert lost in warning.getMessage()
        assert worker.succeeded == 21
