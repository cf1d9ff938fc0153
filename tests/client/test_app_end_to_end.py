"""The task framework end to end (docs/design/tasks.md): an App's tasks enqueued through its own
clients to a real broker on port 0, over HTTP and over gRPC, run by a ``wqclient.Worker`` with
``app.handler()``, their results decoded by the functions' return hints; retries, failures,
context, progress, cancel, workflows of ``.s()`` calls, sync functions in threads, and payloads
made by hand as another language would."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pydantic
import pytest

from tests.helpers import running_broker, wait_until
from wqbroker.broker import Broker
from wqclient import (
    App,
    AsyncClient,
    Context,
    Retry,
    TaskNotSucceeded,
    chain,
    chord,
    current_context,
    group,
)
from wqclient.worker import Fail, Worker

pytestmark = pytest.mark.timeout(60)


@dataclass
class Receipt:
    customer: str
    total: Decimal
    at: datetime


class Summary(pydantic.BaseModel):
    count: int
    mean: Decimal


class Flaky(Exception):
    pass


class State:
    """What the tasks of one test share with it."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.seen: list[Any] = []


def make_app(url: str, state: State) -> App:  # noqa: C901 (a function per task)
    app = App(url)

    @app.task(name="receipt")
    async def receipt(customer: str, amount: Decimal, at: datetime) -> Receipt:
        return Receipt(customer, amount * 2, at + timedelta(days=1))

    @app.task(name="summary")
    def summary(values: list[Decimal]) -> Summary:
        return Summary(count=len(values), mean=sum(values, Decimal(0)) / len(values))

    @app.task(name="add")
    async def add(x: int, y: int = 0) -> int:
        return x + y

    @app.task(name="total")
    async def total(values: list[int]) -> int:
        return sum(values)

    @app.task(name="later", max_attempts=5)
    async def later() -> None:
        raise Retry(delay=3600, error="come back in an hour")

    @app.task(name="doomed", max_attempts=5)
    async def doomed() -> None:
        raise Fail("the account is gone")

    @app.task(name="picky", max_attempts=5, retry_on=(Flaky,))
    async def picky(kind: str) -> None:
        raise Flaky("try again") if kind == "flaky" else KeyError(kind)

    @app.task(name="stubborn", max_attempts=5, give_up_on=(ValueError,))
    async def stubborn() -> None:
        raise ValueError("never")

    @app.task(name="context", queue="ctx", max_attempts=3)
    async def context(label: str, ctx: Context) -> dict[str, Any]:
        await ctx.progress({"label": label, "step": 1})
        await state.release.wait()
        return {
            "id": ctx.task_id,
            "name": ctx.name,
            "attempt": ctx.attempt,
            "max_attempts": ctx.max_attempts,
            "queue": ctx.queue,
            "same": current_context() is ctx,
            "cancelled": ctx.cancelled,
        }

    @app.task(name="forever")
    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            state.cancelled.set()
            raise

    @app.task(name="threaded")
    def threaded(n: int) -> dict[str, Any]:
        ctx = current_context()
        ctx.report_progress({"n": n})
        return {"id": ctx.task_id, "thread": threading.current_thread().name, "n": n}

    @app.task(name="unencodable")
    async def unencodable() -> object:
        return {"when": object()}

    return app


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async with running_broker() as b:
        yield b


@pytest.fixture(params=["http", "grpc"])
def url(request: pytest.FixtureRequest, broker: Broker) -> str:
    return broker.http_url if request.param == "http" else "grpc://" + broker.grpc_target


@pytest.fixture
def state() -> State:
    return State()


@pytest.fixture
async def app(url: str, state: State) -> AsyncIterator[App]:
    async with make_app(url, state) as a:
        yield a


@asynccontextmanager
async def working(app: App, url: str, lease_ms: int = 30_000) -> AsyncIterator[Worker]:
    """A Worker of the App's tasks (on all its queues), on a client of its own."""
    handler = app.handler(threads=2)
    async with AsyncClient(url) as client:
        worker = Worker(client, handler, concurrency=4, queues=app.queues(), lease_ms=lease_ms)
        run = asyncio.ensure_future(worker.run())
        try:
            yield worker
        finally:
            worker.stop()
            await asyncio.wait_for(run, 10)
            await handler.close()  # type: ignore[attr-defined]


async def test_results_come_back_decoded_by_the_return_hint(app: App, url: str) -> None:
    at = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)
    async with working(app, url):
        made = await app.tasks["receipt"].enqueue("ann", Decimal("6.25"), at=at)
        summed = await app.tasks["summary"].enqueue([Decimal("1"), Decimal("2")])
        plain = await app.tasks["add"].enqueue(40, y=2)
        assert await made.result(20) == Receipt("ann", Decimal("12.50"), at + timedelta(days=1))
        assert await summed.result(20) == Summary(count=2, mean=Decimal("1.5"))
        assert await plain.result(20) == 42
        view = await made.status()
    assert view.state == "succeeded"
    assert view.result == {"customer": "ann", "total": "12.50", "at": "2026-12-07T10:00:00+00:00"}


async def test_retry_fail_retry_on_and_give_up_on_as_the_broker_sees_them(
    app: App, url: str
) -> None:
    async with working(app, url):
        before = datetime.now(UTC)
        later = await app.tasks["later"].enqueue()
        doomed = await app.tasks["doomed"].enqueue()
        flaky = await app.tasks["picky"].enqueue("flaky")
        other = await app.tasks["picky"].enqueue("other")
        stubborn = await app.tasks["stubborn"].enqueue()
        views = {}
        for name, handle in [("later", later), ("flaky", flaky)]:
            views[name] = await wait_until(
                handle.status, lambda t: t.attempts == 1 and t.state != "handed_out", what=name
            )
        for name, handle in [("doomed", doomed), ("other", other), ("stubborn", stubborn)]:
            views[name] = await wait_until(handle.status, lambda t: t.state == "dead", what=name)
        after = datetime.now(UTC)
    retried = views["later"]
    assert (retried.state, retried.last_error) == ("delayed", "come back in an hour")
    assert before + timedelta(hours=1) <= retried.available_at <= after + timedelta(hours=1)
    assert (views["flaky"].attempts, views["flaky"].last_error) == (1, "Flaky: try again")
    assert views["flaky"].state in ("ready", "delayed")
    for name, error in [
        ("doomed", "the account is gone"),
        ("other", "KeyError: 'other'"),
        ("stubborn", "ValueError: never"),
    ]:
        assert (views[name].attempts, views[name].last_error) == (1, error), name
    with pytest.raises(TaskNotSucceeded, match="the account is gone"):
        await doomed.result(5)


async def test_the_context_and_progress(app: App, url: str, state: State) -> None:
    async with working(app, url):
        handle = await app.tasks["context"].enqueue("hello")
        view = await wait_until(
            handle.status, lambda t: t.progress_value is not None, what="the progress"
        )
        assert view.progress_value == {"label": "hello", "step": 1}
        state.release.set()
        result = await handle.result(20)
    assert result == {
        "id": handle.id,
        "name": "context",
        "attempt": 1,
        "max_attempts": 3,
        "queue": "ctx",
        "same": True,
        "cancelled": False,
    }


async def test_a_handle_cancels_its_task(app: App, url: str, state: State) -> None:
    # (over HTTP a worker hears of a cancel when it next extends the lease: a short one)
    async with working(app, url, lease_ms=1000) as worker:
        handle = await app.tasks["forever"].enqueue()
        await wait_until(handle.status, lambda t: t.state == "handed_out", what="the hand-out")
        waiting = asyncio.ensure_future(handle.result(20))  # (a cancelled task is then gone)
        await wait_until(lambda: app.client.stats(), lambda s: s.handed_out == 1, what="hand-out")
        assert await handle.cancel() == "cancelling"
        await asyncio.wait_for(state.cancelled.wait(), 20)
        with pytest.raises(TaskNotSucceeded) as caught:
            await waiting
    assert caught.value.state == "cancelled"
    assert worker.cancelled == 1


async def test_a_chain_and_a_chord_pass_results(app: App, url: str) -> None:
    add, total = app.tasks["add"], app.tasks["total"]
    async with working(app, url):
        steps = await app.submit(chain(add.s(1, 2), add.s(10), add.s(y=100)))
        tally = await app.submit(chord([add.s(n, n) for n in range(5)], total.s()))
        fan = await app.submit(group(add.si(1), add.si(2)))
        assert await steps.result(20) == 113
        assert await tally.result(20) == sum(2 * n for n in range(5))
        assert await fan.result(20) == [1, 2]


async def test_sync_functions_run_in_threads_with_their_context(app: App, url: str) -> None:
    async with working(app, url):
        handles = [await app.tasks["threaded"].enqueue(n) for n in range(3)]
        results = [await h.result(20) for h in handles]
        view = await handles[0].status()
    for n, (handle, result) in enumerate(zip(handles, results, strict=True)):
        assert (result["id"], result["n"]) == (handle.id, n)
        assert result["thread"].startswith("wq-task")
    assert view.state == "succeeded"


async def test_a_payload_made_by_hand_runs_a_task(app: App, url: str) -> None:
    async with working(app, url), AsyncClient(url) as client:
        task_id = await client.enqueue(
            b'{"task": "receipt", "args": ["bo"], '
            b'"kwargs": {"amount": "0.10", "at": "2026-01-31T23:00:00+01:00"}}'
        )
        answer = await client.wait_result(task_id, timeout=20)
    assert answer is not None
    assert answer.result == {"customer": "bo", "total": "0.20", "at": "2026-02-01T23:00:00+01:00"}


async def test_what_cannot_run_is_reported(app: App, url: str) -> None:
    async with working(app, url), AsyncClient(url) as client:
        unknown = await client.enqueue({"task": "nobody.knows"}, max_attempts=3)
        mismatch = await client.enqueue({"task": "add", "args": ["x"]}, max_attempts=3)
        not_a_call = await client.enqueue([1, 2], max_attempts=3)
        unencodable = await app.tasks["unencodable"].enqueue()
        retried = await wait_until(
            lambda: client.get_task(unknown),
            lambda t: t.attempts >= 1 and t.last_error,
            what="nack",
        )
        dead = {}
        for name, task_id in [
            ("mismatch", str(mismatch)),
            ("not_a_call", str(not_a_call)),
            ("unencodable", unencodable.id),
        ]:
            dead[name] = await wait_until(
                functools.partial(client.get_task, task_id), lambda t: t.state == "dead", what=name
            )
    assert retried.state != "dead"
    assert "no task 'nobody.knows' is registered here" in (retried.last_error or "")
    assert "add, context, doomed, forever" in (retried.last_error or "")
    assert (dead["mismatch"].last_error or "").startswith(
        "task add: argument 'x' does not fit its hint int: "
    )
    assert dead["mismatch"].attempts == 1
    assert "not a task call" in (dead["not_a_call"].last_error or "")
    assert "result of unencodable cannot be encoded" in (dead["unencodable"].last_error or "")


async def test_the_blocking_calls(app: App, url: str) -> None:
    add = app.tasks["add"]
    async with working(app, url):

        def produce() -> tuple[Any, Any, str | None]:
            handle = add.enqueue_sync(2, y=3)
            flow = app.submit_sync(chain(add.s(1, 1), add.s(5)))
            return handle.result(20), flow.result(20), handle.status().state

        assert await asyncio.to_thread(produce) == (5, 7, "succeeded")


async def test_eta_and_options_reach_the_broker(url: str, state: State) -> None:
    start = datetime.now(UTC)
    async with make_app(url, state) as app:
        app.now = lambda: start
        handle = await (
            app.tasks["add"]
            .with_options(eta=start + timedelta(hours=2), priority=7, key="once", result_ttl=60)
            .enqueue(1)
        )
        again = await app.tasks["add"].with_options(key="once", delay=7200).enqueue(1)
        view = await handle.status()
    assert again.id == handle.id  # (the idempotency key)
    assert (view.state, view.priority, view.result_ttl_ms) == ("delayed", 7, 60_000)
    assert view.available_at - view.created_at >= timedelta(hours=2) - timedelta(seconds=5)
