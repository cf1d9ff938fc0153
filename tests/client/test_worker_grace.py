"""The Worker's shutdown with a grace period (``stop(grace)``, ``stop_now()``: the ``wq worker``
command's SIGTERM and second signal), and its line per task (``wqclient.worker.tasks``) and
``on_task``, without a broker.

Each test runs over claim loops on a unary transport (as over HTTP) and one stream (as over gRPC)
where both apply. Time is a :class:`FakeClock` moved on by hand: the grace runs on the worker's
clock, so nothing sleeps to let it pass.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.fake_clock import FakeClock
from tests.fake_transport import FakeStreamingTransport, FakeTransport, Nack
from tests.helpers import wait_until
from wqclient import AsyncClient, Task
from wqclient.worker import HANDED_BACK_ERROR, Fail, Retry, Worker, task_name
from wqwire.flags import JsonFormatter

pytestmark = pytest.mark.timeout(30)

TASKS_LOG = "wqclient.worker.tasks"
LEASE_MS = 10_000  # its half (5 s) is never reached: every grace below is shorter
GRACE = 2.0


@pytest.fixture(params=["unary", "stream"])
def fake(request: pytest.FixtureRequest) -> FakeTransport:
    return FakeStreamingTransport() if request.param == "stream" else FakeTransport()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class Held:
    """An asyncio handler that holds each task until released (``ignore``: the tasks whose
    handler finishes at once)."""

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.started: list[str] = []
        self.release = asyncio.Event()
        self.cancelled: list[str] = []
        self.ignore = ignore

    async def __call__(self, task: Task) -> None:
        self.started.append(task.id)
        if task.payload in self.ignore:
            return
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(task.id)
            raise


class Blocking:
    """A synchronous handler that blocks until released (it never looks at task.cancelled)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.returned: list[str] = []

    def __call__(self, task: Task) -> str:
        self.started.set()
        self.release.wait(20)
        self.returned.append(task.id)
        return "done"


def start(
    fake: FakeTransport, handler: Callable[[Task], Any], clock: FakeClock, **options: Any
) -> tuple[Worker, asyncio.Future[None], AsyncClient]:
    client = AsyncClient(transport=fake)
    options.setdefault("lease_ms", LEASE_MS)
    options.setdefault("concurrency", 1)
    worker = Worker(client, handler, clock=clock, **options)
    return worker, asyncio.ensure_future(worker.run()), client


async def test_a_task_still_running_when_the_grace_is_over_is_handed_back_and_run_returns(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("long", max_attempts=5)
    hold = Held()
    worker, run, client = start(fake, hold, clock)
    await wait_until(lambda: hold.started == [task_id], what="the handler to start")
    worker.stop(grace=GRACE)
    await clock.sleeping()
    await clock.advance(GRACE - 0.1)
    assert not run.done()
    assert fake.released == []
    await clock.advance(0.1)
    await asyncio.wait_for(run, 5)
    assert hold.cancelled == [task_id]
    assert fake.released == [task_id]  # released, not nacked: its attempt is not counted
    assert fake.nacks == []
    assert fake.ready[0] == task_id  # ready again at once at the head, not waiting for its lease
    assert fake.tasks[task_id].attempts == 0
    assert fake.tasks[task_id].last_error is None  # (a release records nothing)
    assert (worker.succeeded, worker.failed, worker.handed_back) == (0, 0, 1)
    await client.close()


async def test_a_broker_without_release_gets_a_nack_with_delay_0_once_and_no_more_releases(
    fake: FakeTransport, clock: FakeClock
) -> None:
    fake.releases = False
    first, second = fake.add("one", max_attempts=5), fake.add("two", max_attempts=5)
    hold = Held()
    worker, run, client = start(fake, hold, clock, concurrency=2)
    await wait_until(lambda: len(hold.started) == 2, what="both handlers to start")
    worker.stop(grace=GRACE)
    await clock.sleeping()
    await clock.advance(GRACE)
    await asyncio.wait_for(run, 5)
    assert sorted(fake.nacks) == sorted(
        [Nack(first, HANDED_BACK_ERROR, 0), Nack(second, HANDED_BACK_ERROR, 0)]
    )
    assert fake.tasks[first].attempts == 1  # (the nack counts the attempt)
    assert fake.tasks[first].last_error == HANDED_BACK_ERROR
    assert len(fake.calls_to("release")) == 1  # asked once, then remembered
    assert worker.handed_back == 2
    await client.close()


async def test_a_task_that_ends_within_the_grace_is_acked_and_nothing_is_handed_back(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("long")
    hold = Held()
    worker, run, client = start(fake, hold, clock)
    await wait_until(lambda: hold.started == [task_id], what="the handler to start")
    worker.stop(grace=GRACE)
    hold.release.set()
    await asyncio.wait_for(run, 5)
    assert fake.acked == [task_id]
    assert fake.nacks == []
    assert worker.handed_back == 0
    assert clock.parked == 0  # the grace's timer went with the worker
    await client.close()


async def test_stop_now_hands_back_the_running_task_and_the_ones_waiting_for_a_handler(
    clock: FakeClock,
) -> None:
    fake = FakeStreamingTransport()
    first, second = fake.add("one"), fake.add("two")
    hold = Held()
    worker, run, client = start(fake, hold, clock, prefetch=2)
    await wait_until(lambda: hold.started == [first], what="the handler to start")
    await fake.wait_until(lambda: second in fake.held)  # waiting in the worker for a handler
    worker.stop()
    worker.stop_now()
    await asyncio.wait_for(run, 5)
    assert hold.started == [first]  # the waiting one was never handled
    assert sorted(fake.released) == sorted([first, second])
    assert fake.nacks == []
    assert fake.tasks[first].attempts == fake.tasks[second].attempts == 0
    assert worker.handed_back == 2
    await client.close()


async def test_a_grace_of_zero_hands_back_at_once(fake: FakeTransport, clock: FakeClock) -> None:
    task_id = fake.add("long")
    hold = Held()
    worker, run, client = start(fake, hold, clock)
    await wait_until(lambda: hold.started == [task_id], what="the handler to start")
    worker.stop(grace=0)
    await asyncio.wait_for(run, 5)
    assert fake.released == [task_id]
    await client.close()


async def test_a_sync_handler_is_abandoned_past_the_grace_run_returns_without_its_thread(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("long")
    handler = Blocking()
    worker, run, client = start(fake, handler, clock)
    await asyncio.to_thread(handler.started.wait, 5)
    worker.stop(grace=GRACE)
    await clock.sleeping()
    await clock.advance(GRACE)
    await asyncio.wait_for(run, 5)  # while the thread still runs
    assert handler.returned == []
    assert fake.released == [task_id]
    assert fake.calls_to("ack") == []
    handler.release.set()
    await wait_until(lambda: handler.returned == [task_id], what="the thread to return")
    assert fake.calls_to("ack") == []  # its result is discarded
    await client.close()


async def test_a_timed_out_sync_handler_still_running_is_not_waited_for_by_stop_now(
    fake: FakeTransport, clock: FakeClock
) -> None:
    task_id = fake.add("slow", timeout_ms=1000, max_attempts=1)  # (not delivered again)
    handler = Blocking()
    worker, run, client = start(fake, handler, clock)
    await asyncio.to_thread(handler.started.wait, 5)
    await clock.advance(1.0)  # its time limit: nacked, its thread let run on
    await fake.wait_until(lambda: bool(fake.nacks))
    worker.stop()
    await asyncio.sleep(0.05)
    assert not run.done()  # stop() alone waits for the thread
    worker.stop_now()
    await asyncio.wait_for(run, 5)
    assert fake.nacks == [Nack(task_id, "timed out after 1000 ms")]  # nacked once
    assert worker.handed_back == 0
    handler.release.set()
    await client.close()


async def test_stop_now_with_nothing_in_hand_ends_the_run(
    fake: FakeTransport, clock: FakeClock
) -> None:
    hold = Held()
    worker, run, client = start(fake, hold, clock)
    worker.stop_now()
    await asyncio.wait_for(run, 5)
    assert hold.started == []
    assert worker.handed_back == 0
    await client.close()


# -- the line per task, and on_task ----------------------------------------------------------


def named(name: str, *args: Any) -> dict[str, Any]:
    return {"task": name, "args": list(args)}


async def test_each_task_is_logged_once_at_info_with_its_name_outcome_and_duration(
    fake: FakeTransport, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=TASKS_LOG)
    ok = fake.add(named("billing.charge", "ann"))
    retried = fake.add(named("billing.retry"), max_attempts=3)
    failed = fake.add(named("billing.fail"))
    plain = fake.add({"other": 1})
    told: list[tuple[str, str | None, str, float]] = []

    async def handler(task: Task) -> Any:
        name = task_name(task)
        if name == "billing.retry":
            raise Retry(delay=1)
        if name == "billing.fail":
            raise Fail("no")
        return {"ok": True}

    def on_task(task: Task, name: str | None, outcome: str, seconds: float) -> None:
        told.append((task.id, name, outcome, seconds))

    worker, run, client = start(fake, handler, clock, on_task=on_task)
    await fake.wait_until(lambda: len(told) == 4)
    worker.stop()
    await asyncio.wait_for(run, 5)
    await client.close()
    outcomes: dict[str, tuple[str | None, str]] = {}
    for task_id, name, outcome, _ in told:  # (the first attempt's: the fake retries at once)
        outcomes.setdefault(task_id, (name, outcome))
    assert outcomes == {
        ok: ("billing.charge", "succeeded"),
        retried: ("billing.retry", "retried"),
        failed: ("billing.fail", "failed"),
        plain: (None, "succeeded"),
    }
    finished = [r for r in caplog.records if r.name == TASKS_LOG and r.levelno == logging.INFO]
    assert {r.__dict__["task_id"] for r in finished} == {ok, retried, failed, plain}
    assert len(finished) == len(told)  # one line per task settled
    [line] = [r for r in finished if r.__dict__["task_id"] == ok]
    assert "billing.charge" in line.getMessage()
    assert "succeeded" in line.getMessage()
    document = json.loads(JsonFormatter().format(line))
    assert document["task_name"] == "billing.charge"
    assert document["outcome"] == "succeeded"
    assert document["attempts"] == 1
    assert isinstance(document["duration_ms"], float)
    starts = [r for r in caplog.records if r.name == TASKS_LOG and r.levelno == logging.DEBUG]
    assert len(starts) == len(told)


async def test_the_handed_back_outcome_is_told(fake: FakeTransport, clock: FakeClock) -> None:
    task_id = fake.add(named("slow"))
    hold = Held()
    told: list[tuple[str, str | None, str]] = []
    worker, run, client = start(
        fake, hold, clock, on_task=lambda t, name, outcome, s: told.append((t.id, name, outcome))
    )
    await wait_until(lambda: hold.started == [task_id], what="the handler to start")
    worker.stop_now()
    await asyncio.wait_for(run, 5)
    assert told == [(task_id, "slow", "handed_back")]
    await client.close()


def test_task_name_follows_the_payload_convention() -> None:
    def task(payload: bytes) -> Task:
        from datetime import UTC, datetime

        now = datetime.now(UTC)
        return Task("t1", payload, 1, 3, now, now)

    assert task_name(task(b'{"task":"a.b","args":[]}')) == "a.b"
    assert task_name(task(b'{ "task" : "a.b" }')) == "a.b"
    assert task_name(task(b'{"args":[],"task":"later"}')) == "later"
    assert task_name(task(b'{"args":[{"task":"nested"}]}')) is None
    assert task_name(task(b'{"task":5}')) is None
    assert task_name(task(b'"task"')) is None
    assert task_name(task(b"[1, 2]")) is None
    assert task_name(task(b'{"task":"caf\\u00e9"}')) == "caf\u00e9"
