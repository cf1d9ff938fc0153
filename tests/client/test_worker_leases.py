"""The Worker's lease extension, Retry and Fail, and its queues, without a broker.

The worker runs on ``AsyncClient(transport=fake)`` (both of its paths: claim loops on a unary
transport, one stream on a streaming one) and measures time on a :class:`FakeClock`: tests move
the clock on by hand once the worker is waiting on it, so nothing here sleeps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest

import wqclient
from tests.fake_clock import FakeClock
from tests.fake_transport import FakeStreamingTransport, FakeTransport, Nack
from wqclient import AsyncClient, InvalidArgument, NotFound, Task, Unavailable
from wqclient.worker import Fail, Retry, Worker

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
        worker = Worker(client, handler, clock=clock, concurrency=1, **options)
        run = asyncio.ensure_future(worker.run())
        try:
            yield worker
        finally:
            worker.stop()
            await asyncio.wait_for(run, 10)


def logged(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == WORKER_LOG and text in r.getMessage()]


class Hold:
    """An async handler that holds each task until released."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.seen: list[str] = []

    async def __call__(self, task: Task) -> None:
        self.seen.append(task.id)
        self.started.set()
        await self.release.wait()


async def half_lease_passes(fake: FakeTransport, clock: FakeClock, calls: int) -> None:
    """Once the worker waits on the clock, move it on by half a lease; wait until ``calls``
    extensions have been asked for in all."""
    await clock.sleeping()
    await clock.advance(HALF)
    await fake.wait_until(lambda: len(fake.calls_to("extend")) >= calls)


# -- extension ----------------------------------------------------------------------------------


async def test_a_long_handler_has_its_lease_extended_at_every_half_lease_then_acks(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("long")
    hold = Hold()
    async with running(fake, hold, clock):
        await asyncio.wait_for(hold.started.wait(), 5)
        for n in range(1, 5):  # "hours" of fake time: four half-leases
            await half_lease_passes(fake, clock, n)
            assert fake.extends == [(task_id, LEASE_MS)] * n
        hold.release.set()
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert clock.sleeps[:4] == [HALF] * 4
    assert fake.nacked == []
    if isinstance(fake, FakeStreamingTransport):  # extended on the stream, not beside it
        assert fake.streams[0].stream_extends == [task_id] * 4


async def test_a_sync_handler_is_extended_too(fake: FakeTransport, clock: FakeClock) -> None:
    task_id = fake.add("long")
    started, release = threading.Event(), threading.Event()

    def handler(task: Task) -> None:
        started.set()
        release.wait(10)

    async with running(fake, handler, clock):
        await asyncio.to_thread(started.wait, 5)
        await half_lease_passes(fake, clock, 1)
        await half_lease_passes(fake, clock, 2)
        release.set()
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert fake.extends == [(task_id, LEASE_MS)] * 2


async def test_a_quick_handler_is_never_extended(fake: FakeTransport, clock: FakeClock) -> None:
    ids = [fake.add(n) for n in range(3)]
    async with running(fake, lambda task: None, clock):
        await fake.wait_until(lambda: fake.acked == ids)
    assert fake.calls_to("extend") == []
    assert clock.parked == 0  # no extension timer left behind


async def test_a_lost_lease_is_logged_and_the_result_discarded(
    fake: FakeTransport, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    lost = fake.add("slow")
    hold = Hold()
    async with running(fake, hold, clock) as worker:
        await asyncio.wait_for(hold.started.wait(), 5)
        fake.take_away(lost)  # the lease ran out meanwhile and somebody else has the task
        await clock.sleeping()
        await clock.advance(HALF)
        await fake.wait_until(lambda: bool(logged(caplog, "it is lost")))
        await clock.advance(10 * HALF)
        assert fake.calls_to("extend") == [lost]  # not tried again
        hold.release.set()
        after = fake.add("next")  # the worker carries on
        await fake.wait_until(lambda: fake.acked == [after])
    assert fake.calls_to("ack") == [after]  # no ack (nor nack) for the lost one
    assert fake.calls_to("nack") == []
    assert lost in fake.held  # still the other holder's
    assert (worker.succeeded, worker.failed, worker.discarded) == (1, 0, 1)
    [warning] = logged(caplog, "it is lost")
    assert warning.levelno == logging.WARNING
    assert lost in warning.getMessage()
    assert len(logged(caplog, "result is discarded")) == 1


async def test_a_failing_handler_whose_lease_was_lost_is_not_nacked_either(
    fake: FakeTransport, clock: FakeClock
) -> None:
    lost = fake.add("slow")
    hold = Hold()

    async def handler(task: Task) -> None:
        await hold(task)
        raise ValueError("too late anyway")

    async with running(fake, handler, clock) as worker:
        await asyncio.wait_for(hold.started.wait(), 5)
        fake.take_away(lost)
        await half_lease_passes(fake, clock, 1)
        hold.release.set()
        after = fake.add("next")  # it fails too, and is nacked: the lost one was not
        await fake.wait_until(lambda: fake.calls_to("nack") == [after])
    assert worker.discarded == 1


async def test_not_found_on_extend_is_a_lost_lease_too(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("slow")
    hold = Hold()
    fake.fail("extend", NotFound(f"task {task_id} is not handed out"))
    async with running(fake, hold, clock) as worker:
        await asyncio.wait_for(hold.started.wait(), 5)
        await half_lease_passes(fake, clock, 1)
        fake.take_away(task_id)  # (the broker no longer counts it as this worker's)
        hold.release.set()
        after = fake.add("next")
        await fake.wait_until(lambda: fake.acked == [after])
    assert fake.calls_to("ack") == [after]
    assert worker.discarded == 1


async def test_an_extension_that_cannot_reach_the_broker_is_logged_and_tried_again(
    fake: FakeTransport, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    task_id = fake.add("slow")
    hold = Hold()
    fake.fail("extend", Unavailable("connection reset"))
    async with running(fake, hold, clock):
        await asyncio.wait_for(hold.started.wait(), 5)
        await clock.sleeping()
        await clock.advance(HALF)  # the first extension fails
        await fake.wait_until(lambda: len(fake.calls_to("extend")) == 1)
        await clock.sleeping()
        # Tried again after half of what is left of the lease (not a whole half-lease later,
        # when the lease would already have run out).
        await clock.advance(HALF / 2)
        await fake.wait_until(lambda: fake.extends == [(task_id, LEASE_MS)])
        await half_lease_passes(fake, clock, 3)  # and then at every half-lease again
        hold.release.set()
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert clock.sleeps[:3] == [HALF, HALF / 2, HALF]
    [warning] = logged(caplog, "could not extend the lease")
    assert warning.levelno == logging.WARNING
    assert "connection reset" in warning.getMessage()
    assert not logged(caplog, "discarded")


async def test_an_extension_that_fails_unexpectedly_is_logged_and_the_task_still_acked(
    fake: FakeTransport, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    task_id = fake.add("slow")
    hold = Hold()
    fake.fail("extend", cast(Any, RuntimeError("a bug in a transport")))
    async with running(fake, hold, clock):
        await asyncio.wait_for(hold.started.wait(), 5)
        await clock.sleeping()
        await clock.advance(HALF)  # the extension raises what no transport should
        await fake.wait_until(lambda: len(fake.calls_to("extend")) == 1)
        hold.release.set()
        await fake.wait_until(lambda: fake.acked == [task_id])
        await fake.wait_until(lambda: bool(logged(caplog, "extending its lease failed")))
    [error] = logged(caplog, "extending its lease failed")
    assert error.levelno == logging.ERROR
    assert "a bug in a transport" in error.getMessage()


async def test_an_extension_failing_near_the_deadline_is_retried_no_sooner_than_a_second(
    clock: FakeClock,
) -> None:
    fake = FakeTransport()
    task_id = fake.add("slow")
    hold = Hold()
    fake.fail("extend", Unavailable("down"), times=5)
    async with running(fake, hold, clock):
        await asyncio.wait_for(hold.started.wait(), 5)
        for n in range(1, 7):
            await clock.sleeping()
            await clock.advance(clock.sleeps[-1])
            await fake.wait_until(lambda n=n: len(fake.calls_to("extend")) == n)  # type: ignore[misc]
        hold.release.set()
        await fake.wait_until(lambda: fake.acked == [task_id])
    # Half a lease, then half of what is left each time, but at least a second apart.
    assert clock.sleeps[:6] == [5.0, 2.5, 1.25, 1.0, 1.0, 1.0]


async def test_a_lease_longer_than_the_broker_grants_is_extended_before_the_cap_runs_out(
    clock: FakeClock,
) -> None:
    fake = FakeTransport()
    fake.add("slow")
    hold = Hold()
    async with running(fake, hold, clock, lease_ms=3_600_000):  # an hour; the broker caps 300 s
        await asyncio.wait_for(hold.started.wait(), 5)
        await clock.sleeping()
        hold.release.set()
        await fake.wait_until(lambda: len(fake.acked) == 1)
    assert clock.sleeps[0] == 150.0


async def test_stop_waits_for_a_long_handler_and_keeps_extending_meanwhile(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("slow")
    hold = Hold()
    async with AsyncClient(transport=fake) as client:
        worker = Worker(client, hold, clock=clock, lease_ms=LEASE_MS, concurrency=1)
        run = asyncio.ensure_future(worker.run())
        await asyncio.wait_for(hold.started.wait(), 5)
        worker.stop()
        await half_lease_passes(fake, clock, 1)
        assert not run.done()
        hold.release.set()
        await asyncio.wait_for(run, 10)
    assert fake.acked == [task_id]
    assert fake.extends == [(task_id, LEASE_MS)]


# -- Retry and Fail -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (Retry(delay_ms=5_000, error="rate limited"), ("rate limited", 5_000, False)),
        (Retry(delay_ms=0), ("Retry", 0, False)),
        (Retry(error="try later"), ("try later", None, False)),  # the broker's backoff
        (Fail("account closed"), ("account closed", None, True)),
        (Fail(), ("Fail", None, True)),
        (KeyError("x"), ("KeyError: 'x'", None, False)),
    ],
    ids=["retry-delay", "retry-0", "retry-backoff", "fail", "fail-bare", "other"],
)
async def test_what_a_handler_raises_decides_the_nack(
    fake: FakeTransport, clock: FakeClock, raised: Exception, expected: tuple[Any, ...]
) -> None:
    task_id = fake.add("work", max_attempts=5)

    def handler(task: Task) -> None:
        if task.attempts == 1:
            raise raised

    terminal = expected[2]
    async with running(fake, handler, clock) as worker:
        await fake.wait_until(lambda: task_id in fake.dead or task_id in fake.acked)
    assert fake.nacks == [Nack(task_id, *expected)]
    assert worker.failed == 1
    # Fail buries at once, with four attempts left; the others come back, and succeed.
    assert fake.dead == ([task_id] if terminal else [])


async def test_retry_and_fail_are_exported_and_checked() -> None:
    assert wqclient.Retry is Retry
    assert wqclient.Fail is Fail
    assert "Retry" in wqclient.__all__
    assert "Fail" in wqclient.__all__
    with pytest.raises(ValueError, match="delay_ms"):
        Retry(delay_ms=-1)
    with pytest.raises(ValueError, match="delay_ms"):
        Retry(delay_ms="soon")  # type: ignore[arg-type]
    retry = Retry(delay_ms=10, error="x")
    assert (retry.delay_ms, retry.error, str(retry)) == (10, "x", "x")


async def test_a_retry_with_a_bad_delay_is_a_plain_failure(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("work")

    def handler(task: Task) -> None:
        if task.attempts == 1:
            raise Retry(delay_ms=-5)

    async with running(fake, handler, clock):
        await fake.wait_until(lambda: fake.acked == [task_id])
    [nack] = fake.nacks
    assert (nack.task_id, nack.delay_ms, nack.terminal) == (task_id, None, False)
    assert nack.error is not None
    assert nack.error.startswith("ValueError: Retry: delay_ms")


async def test_options_the_broker_refuses_fall_back_to_a_plain_nack(
    fake: FakeTransport, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WORKER_LOG)
    task_id = fake.add("work")
    fake.fail("nack", InvalidArgument("delay_ms must be at most 86400000"))

    def handler(task: Task) -> None:
        if task.attempts == 1:
            raise Retry(delay_ms=10**12, error="much later")

    async with running(fake, handler, clock):
        await fake.wait_until(lambda: fake.acked == [task_id])
    assert fake.nacks == [Nack(task_id, "much later")]
    assert len(logged(caplog, "refused the nack's options")) == 1


# -- queues -------------------------------------------------------------------------------------


@pytest.mark.parametrize("queues", ["high,low", ["high", "low"]])
async def test_the_worker_takes_from_its_queues_in_order(
    fake: FakeTransport, clock: FakeClock, queues: str | list[str]
) -> None:
    other = fake.add("not mine", queue="other")
    low = fake.add("low", queue="low")
    high = fake.add("high", queue="high")
    hold = Hold()
    async with running(fake, hold, clock, queues=queues):
        await asyncio.wait_for(hold.started.wait(), 5)
        hold.release.set()
        await fake.wait_until(lambda: len(fake.acked) == 2)
    assert fake.acked == [high, low]
    assert other in fake.ready
    assert fake.claim_queues[0] == ["high", "low"]


async def test_without_queues_the_worker_takes_from_the_default_queue(
    fake: FakeTransport, clock: FakeClock
) -> None:
    mine = fake.add("default")
    fake.add("elsewhere", queue="other")
    async with running(fake, lambda task: None, clock):
        await fake.wait_until(lambda: fake.acked == [mine])
    assert fake.claim_queues[0] == ["default"]
