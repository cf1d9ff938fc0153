"""The task framework without a broker (docs/design/tasks.md): what ``@app.task`` makes, the
payloads its calls produce (the same bytes with pydantic and without), the errors a bad call or
a bad option is at enqueue, and the App's handler driven with tasks made by hand: the payload
convention parsed, arguments decoded by hints, results passed, outcomes mapped."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

import pytest

from wqclient import (
    App,
    Context,
    ParentResult,
    Signature,
    Task,
    TaskArgumentError,
    TaskFunction,
    ThreadRunner,
    codec,
    current_context,
)
from wqclient.app import UnknownTaskError
from wqclient.worker import Fail, Retry

NOW = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)


@dataclass
class Item:
    sku: str
    price: Decimal


def charge(customer: str, amount: Decimal, when: datetime | None = None) -> dict[str, str]:
    return {"customer": customer, "amount": str(amount), "when": str(when)}


def add(x: int, y: int) -> int:
    return x + y


async def total(items: list[Item], *, discount: Decimal = Decimal(0)) -> Decimal:
    return sum((i.price for i in items), Decimal(0)) - discount


def whoami(ctx: Context, greeting: str = "hi") -> str:
    return f"{greeting} {ctx.name} #{ctx.attempt}/{ctx.max_attempts} on {ctx.queue}"


class Flaky(Exception):
    pass


class Broken(Exception):
    pass


def failing(kind: str) -> None:
    raise {"flaky": Flaky, "broken": Broken, "value": ValueError}[kind](kind)


def make_app() -> App:
    app = App("http://127.0.0.1:1", now=lambda: NOW)
    app.task(name="charge", queue="billing", priority=5, max_attempts=4, timeout=60)(charge)
    app.task(name="add")(add)
    app.task(name="total", queue="billing")(total)
    app.task(name="whoami")(whoami)
    app.task(name="retrying", retry_on=Flaky)(failing)
    app.task(name="giving_up", give_up_on=(Broken,))(failing)
    return app


@pytest.fixture(params=["pydantic", "standard"])
def app(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> App:
    monkeypatch.setattr(codec, "PYDANTIC", request.param == "pydantic")
    return make_app()


def task_of(
    call: Any, *, parents: tuple[ParentResult, ...] | None = None, attempts: int = 1
) -> Task:
    text = call if isinstance(call, bytes) else json.dumps(call).encode()
    return Task("t-1", text, attempts, 4, NOW, NOW, queue="billing", parents=parents)


# -- what @app.task makes --------------------------------------------------------------------------


def test_a_task_is_named_by_its_module_and_qualname_and_registered() -> None:
    app = App()

    @app.task
    def local(n: int) -> int:
        return n * 2

    assert isinstance(local, TaskFunction)
    where = "test_a_task_is_named_by_its_module_and_qualname_and_registered.<locals>"
    assert local.name == f"{__name__}.{where}.local"
    assert app.tasks == {local.name: local}
    assert (local.queue, local.is_async, local(21)) == ("default", False, 42)
    assert app.queues() == ["default"]


def test_queues_are_those_the_tasks_name(app: App) -> None:
    assert app.queues() == ["billing", "default"]
    assert App(default_queue="main").queues() == ["main"]


def test_a_plain_call_runs_the_function_here() -> None:
    app = make_app()
    assert app.tasks["add"](2, 3) == 5
    assert asyncio.run(app.tasks["total"]([Item("a", Decimal("1.5"))])) == Decimal("1.5")


def test_a_function_of_main_needs_a_name_and_names_are_unique() -> None:
    app = make_app()

    def f() -> None: ...

    f.__module__ = "__main__"
    with pytest.raises(ValueError, match="needs a name="):
        app.task(f)
    with pytest.raises(ValueError, match="task add: a task of that name is registered already"):
        app.task(name="add")(add)


def test_the_broker_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WQ_BROKER", "grpc://example:50051")
    assert App().broker == "grpc://example:50051"
    assert App("http://other:1").broker == "http://other:1"
    monkeypatch.delenv("WQ_BROKER")
    assert App().broker is None


# -- payloads --------------------------------------------------------------------------------------


def test_a_call_is_the_payload_convention(app: App) -> None:
    charge_task = app.tasks["charge"]
    payload = charge_task.payload(("ann", Decimal("12.50")), {"when": NOW})
    assert payload == (
        b'{"task":"charge","args":["ann","12.50"],"kwargs":{"when":"2026-12-06T10:00:00+00:00"}}'
    )


def test_the_payload_does_not_depend_on_pydantic(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("charge", ("ann", Decimal("1.10")), {"when": NOW}),
        ("total", ([Item("x", Decimal("2"))],), {"discount": Decimal("0.5")}),
        ("add", (1,), {"y": 2}),
    ]
    payloads = []
    for use in (True, False):
        monkeypatch.setattr(codec, "PYDANTIC", use)
        app = make_app()
        payloads.append([app.tasks[name].payload(args, kwargs) for name, args, kwargs in calls])
    assert payloads[0] == payloads[1]


def test_signatures_carry_the_options_and_pass_results_for_s_only(app: App) -> None:
    sig = app.tasks["charge"].with_options(delay=timedelta(minutes=1), key="k1").s(Decimal(5))
    assert isinstance(sig, Signature)
    assert json.loads(sig.payload) == {
        "task": "charge",
        "args": ["5"],
        "kwargs": {},
        "pass_results": True,
    }
    assert (sig.queue, sig.priority, sig.max_attempts, sig.timeout_ms) == ("billing", 5, 4, 60_000)
    assert (sig.delay_ms, sig.idempotency_key, sig.unique) == (60_000, "k1", False)
    unique = app.tasks["charge"].with_options(key="k2", unique=True).s(Decimal(5))
    assert (unique.idempotency_key, unique.unique, unique.item().unique) == ("k2", True, True)
    whole = app.tasks["add"].s(1, 2)  # (it fills the function: bound as given)
    assert json.loads(whole.payload)["args"] == [1, 2]
    immutable = app.tasks["add"].si(1, 2)
    assert "pass_results" not in json.loads(immutable.payload)


def test_options_in_seconds_become_milliseconds_and_eta_a_delay(app: App) -> None:
    task = app.tasks["add"].with_options(
        eta=NOW + timedelta(seconds=90), result_ttl=1.5, expires_in=timedelta(hours=1), unique=True
    )
    sig = task.si(1, 2)
    assert (sig.delay_ms, sig.result_ttl_ms, sig.expires_in_ms) == (90_000, 1500, 3_600_000)
    past = app.tasks["add"].with_options(eta=NOW - timedelta(days=1)).si(1, 2)
    assert past.delay_ms == 0


# -- errors at enqueue -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "kwargs", "message"),
    [
        ("add", ("one", 2), {}, r"task add: argument 'x' does not fit its hint int"),
        ("add", (1,), {}, r"task add: missing a required argument: 'y'"),
        ("add", (1, 2), {"z": 3}, r"task add: got an unexpected keyword argument 'z'"),
        ("add", (1, 2, 3), {}, r"task add: too many positional arguments"),
        ("charge", ("ann", Decimal(1)), {"when": "soon"}, r"argument 'when' does not fit"),
        ("charge", ("ann", float("nan")), {}, r"argument 'amount': nan is not allowed"),
        ("charge", (["ann"], Decimal(1)), {}, r"argument 'customer' does not fit its hint str"),
        ("total", ([Item("a", Decimal("NaN"))],), {}, r"argument 'items' at \[0\]\.price: Decimal"),
        ("total", ([{"sku": "a"}],), {}, r"argument 'items' at \[0\]"),
        ("add", ({1: 2}, 3), {}, r"argument 'x': a dict key must be a string, got int"),
        ("add", (object(), 3), {}, r"argument 'x': a value of type object cannot be encoded"),
    ],
)
def test_a_bad_call_is_a_task_argument_error_naming_the_task_and_the_parameter(
    app: App, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    task = app.tasks[name]
    with pytest.raises(TaskArgumentError, match=message) as caught:
        task.payload(args, kwargs)
    assert isinstance(caught.value, TypeError)
    with pytest.raises(TaskArgumentError, match=message):
        task.si(*args, **kwargs)


async def test_enqueue_refuses_a_bad_call_before_it_reaches_a_broker(app: App) -> None:
    # (the App's broker is not there: the error comes first)
    with pytest.raises(TaskArgumentError, match="task add: argument 'y'"):
        await app.tasks["add"].enqueue(1, y="two")
    with pytest.raises(TaskArgumentError, match="task add: argument 'y'"):
        app.tasks["add"].enqueue_sync(1, y="two")


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"priority": 12}, ValueError, "priority must be an integer from 0 to 9, got 12"),
        ({"priority": "high"}, TypeError, "priority must be an integer, got str"),
        ({"timeout": -1}, ValueError, "timeout must be a number of seconds above 0, got -1"),
        ({"timeout": 0}, ValueError, "timeout must be a number of seconds above 0"),
        ({"max_attempts": 0}, ValueError, "max_attempts must be an integer from 1"),
        ({"result_ttl": float("inf")}, ValueError, "result_ttl must be a number of seconds"),
        ({"expires_in": "1h"}, TypeError, "expires_in must be seconds"),
        ({"queue": ""}, TypeError, "queue must be a non-empty string"),
        ({"retry_on": "ValueError"}, TypeError, "retry_on must be exception classes"),
        ({"colour": "red"}, TypeError, "@app.task has no option 'colour'"),
    ],
)
def test_a_bad_option_of_a_task_is_refused_at_once(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        App().task(name="t", **options)(add)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"priority": 10}, ValueError, "task add: priority must be an integer from 0 to 9"),
        ({"delay": -5}, ValueError, "task add: delay must be a number of seconds from 0"),
        ({"eta": "tomorrow"}, TypeError, "task add: eta must be a datetime"),
        ({"unique": 1}, TypeError, "task add: unique must be true or false"),
        ({"retry_on": (Flaky,)}, TypeError, "retry_on is how the worker runs the task"),
        ({"prio": 1}, TypeError, "with_options\\(\\) has no option 'prio'"),
    ],
)
def test_a_bad_option_of_a_call_is_refused_at_once(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make_app().tasks["add"].with_options(**options)


# -- the handler -----------------------------------------------------------------------------------


async def test_the_handler_decodes_arguments_and_encodes_the_result(app: App) -> None:
    handler = app.handler()
    call = {
        "task": "total",
        "args": [[{"sku": "a", "price": "1.25"}, {"sku": "b", "price": "2"}]],
        "kwargs": {"discount": "0.25"},
        "v": 1,  # (other members are ignored)
    }
    assert await handler(task_of(call)) == b'"3.00"'
    assert await handler(task_of({"task": "add", "args": [1, 2]})) == b"3"  # (kwargs: optional)
    assert await handler(task_of({"task": "charge", "args": ["ann", "1"]})) == (
        b'{"customer":"ann","amount":"1","when":"None"}'
    )


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"[1, 2]", 'the payload is not a task call \\(an object with "task"\\), got an array'),
        (b'{"args": []}', "the payload's \"task\" must be a task's name \\(a string\\), got null"),
        (b'{"task": 7}', "got int"),
        (b'{"task": "add", "args": {"x": 1}}', 'task add: the payload\'s "args" must be an array'),
        (b'{"task": "add", "args": [1], "kwargs": [2]}', '"kwargs" must be an object'),
        (b'{"task": "add", "args": [1, 2], "pass_results": 1}', '"pass_results" must be true'),
        (b'{"task": "add", "args": [1, "b"]}', "task add: argument 'y' does not fit its hint int"),
        (b'{"task": "add", "args": [1]}', "task add: missing the argument 'y'"),
        (
            b'{"task": "add", "args": [1, 2, 3]}',
            "takes 2 positional arguments, the payload gives 3",
        ),
        (b'{"task": "add", "args": [1, 2], "kwargs": {"z": 1}}', "task add: has no parameter 'z'"),
        (b'{"task": "add", "args": [1, 2], "kwargs": {"x": 1}}', "the argument 'x' is given twice"),
        (b'{"task": "total", "args": [[{"sku": 1}]]}', "task total: argument 'items' at \\[0\\]"),
    ],
)
async def test_a_payload_that_does_not_fit_fails_for_good_saying_why(
    app: App, payload: bytes, message: str
) -> None:
    with pytest.raises(Fail, match=message):
        await app.handler()(task_of(payload))


async def test_an_unknown_task_is_a_plain_error_naming_the_tasks_registered(app: App) -> None:
    with pytest.raises(UnknownTaskError, match="no task 'nope' is registered here") as caught:
        await app.handler()(task_of({"task": "nope"}))
    assert not isinstance(caught.value, Fail | Retry)
    assert "add, charge, giving_up, retrying, total, whoami" in str(caught.value)


async def test_parents_results_come_first_when_asked(app: App) -> None:
    handler = app.handler()
    one = (ParentResult("p1", b"40"),)
    two = (
        ParentResult("p1", b'{"sku":"a","price":"1"}'),
        ParentResult("p2", b'{"sku":"b","price":"2"}'),
    )
    passing = {"task": "add", "args": [2], "pass_results": True}
    assert await handler(task_of(passing, parents=one)) == b"42"
    assert await handler(task_of({"task": "total", "pass_results": True}, parents=two)) == b'"3"'
    with pytest.raises(Fail, match="missing the argument 'y'"):  # (not asked: not passed)
        await handler(task_of({"task": "add", "args": [2]}, parents=one))
    assert await handler(task_of({"task": "add", "args": [2, 3], "pass_results": True})) == b"5"


async def test_the_context_is_given_and_current_in_the_thread(app: App) -> None:
    handler = app.handler()
    assert await handler(task_of({"task": "whoami", "args": ["hello"]}, attempts=2)) == (
        b'"hello whoami #2/4 on billing"'
    )
    seen: list[Any] = []

    def probe() -> str:
        ctx = current_context()
        seen.append((ctx.task_id, ctx.parent_results, threading.current_thread().name))
        return ctx.task_id

    app.task(name="probe")(probe)
    parents = (ParentResult("p1", b"[1]"), ParentResult("p2", None))
    assert await handler(task_of({"task": "probe"}, parents=parents)) == b'"t-1"'
    assert seen == [("t-1", [[1], None], seen[0][2])]
    assert seen[0][2].startswith("wq-task")
    with pytest.raises(RuntimeError, match="no wq task is running here"):
        current_context()


async def test_a_context_without_a_worker_says_so() -> None:
    ctx = Context(task_id="t", name="n", attempt=1, max_attempts=1, queue="q")
    assert (ctx.cancelled, ctx.parents, ctx.parent_results) == (False, (), [])
    with pytest.raises(RuntimeError, match="not running under a worker"):
        await ctx.progress(1)
    with pytest.raises(RuntimeError, match="not running under a worker"):
        ctx.report_progress(1)


async def test_invoke_takes_decoded_arguments_and_a_context_made_elsewhere(app: App) -> None:
    # (what a process pool does in its child)
    ctx = Context(task_id="t-9", name="whoami", attempt=3, max_attempts=5, queue="q")
    assert app.tasks["whoami"].invoke([], {"greeting": "yo"}, ctx) == "yo whoami #3/5 on q"
    assert app.tasks["whoami"].invoke(["yo"], {}, ctx) == "yo whoami #3/5 on q"
    coroutine = app.tasks["total"].invoke([[Item("a", Decimal(2))]], {}, ctx)
    assert await coroutine == Decimal(2)


async def test_exceptions_are_mapped_by_retry_on_and_give_up_on(app: App) -> None:
    handler = app.handler()
    with pytest.raises(Flaky):  # (retry_on: these retry)
        await handler(task_of({"task": "retrying", "args": ["flaky"]}))
    with pytest.raises(Fail, match="ValueError: value"):  # (any other fails for good)
        await handler(task_of({"task": "retrying", "args": ["value"]}))
    with pytest.raises(Fail, match="Broken: broken"):  # (give_up_on: these fail for good)
        await handler(task_of({"task": "giving_up", "args": ["broken"]}))
    with pytest.raises(ValueError, match="value"):  # (any other: the broker's backoff)
        await handler(task_of({"task": "giving_up", "args": ["value"]}))

    def asks(kind: str) -> None:
        raise Retry(delay=5) if kind == "retry" else Fail("no")

    app.task(name="asks", retry_on=Flaky, give_up_on=Exception)(asks)
    with pytest.raises(Retry) as retry:
        await handler(task_of({"task": "asks", "args": ["retry"]}))
    assert retry.value.delay_ms == 5000
    with pytest.raises(Fail, match=r"^no$"):
        await handler(task_of({"task": "asks", "args": ["fail"]}))


async def test_a_result_that_cannot_be_encoded_fails_for_good(app: App) -> None:
    def odd() -> object:
        return {"x": float("nan")}

    app.task(name="odd")(odd)
    with pytest.raises(Fail, match=r"result of odd cannot be encoded: \['x'\]: nan is not allowed"):
        await app.handler()(task_of({"task": "odd"}))


async def test_sync_functions_go_to_the_runner_given() -> None:
    app = make_app()
    calls: list[tuple[str, list[Any], dict[str, Any]]] = []

    class Recorder:
        async def run(
            self, fn: TaskFunction[Any, Any], args: list[Any], kwargs: dict[str, Any], ctx: Context
        ) -> Any:
            calls.append((fn.name, args, kwargs))
            return fn.invoke(args, kwargs, ctx)

        async def close(self) -> None: ...

    handler = app.handler(Recorder())
    assert await handler(
        task_of({"task": "charge", "args": ["a", "2.5"], "kwargs": {"when": None}})
    ) == (b'{"customer":"a","amount":"2.5","when":"None"}')
    assert calls == [("charge", ["a", Decimal("2.5")], {"when": None})]
    await handler(task_of({"task": "total", "args": [[]]}))  # (async: on the loop, not the runner)
    assert len(calls) == 1


async def test_a_thread_runner_runs_in_its_threads_and_closes() -> None:
    runner = ThreadRunner(2)
    app = make_app()
    ctx = Context(task_id="t", name="add", attempt=1, max_attempts=1, queue="q")
    assert await runner.run(app.tasks["add"], [1, 2], {}, ctx) == 3
    await runner.close()
    with pytest.raises(ValueError, match="at least one thread"):
        ThreadRunner(0)


def test_handles_decode_by_the_return_hint() -> None:
    app = make_app()
    sig = app.tasks["total"].s()
    assert sig.decode is not None
    assert sig.decode("1.50") == Decimal("1.50")
    assert app.tasks["charge"].s().decode is not None  # (dict[str, str]: checked)

    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    assert app.task(name="untyped")(untyped).s(1).decode is None


async def test_uuid_and_datetime_arguments_round_trip_through_the_handler() -> None:
    app = App()

    def stamp(ident: UUID, at: datetime) -> list[Any]:
        return [ident, at]

    task = app.task(name="stamp")(stamp)
    ident = UUID(int=7)
    payload = task.payload((ident, NOW), {})
    result = await app.handler()(task_of(payload))
    assert result == json.dumps([str(ident), NOW.isoformat()], separators=(",", ":")).encode()
