"""ProcessRunner (wqclient/_procpool.py): the App's sync task functions in child processes. Real
children (spawned), running tests/client/exec_programs/procpool_app.py; end to end, a real
broker on port 0 and a real Worker running ``app.handler(runner)`` over HTTP and gRPC.
Nothing sleeps to let things happen: tasks and tests meet through files."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest

from tests.client.exec_programs.procpool_app import app
from tests.helpers import running_broker, wait_until
from wqbroker.broker import Broker
from wqclient import AsyncClient, Context, LeaseLost, ParentResult, SyncRunner, TaskFunction
from wqclient._procpool import ProcessRunner
from wqclient.worker import Fail, Retry, Worker

pytestmark = pytest.mark.timeout(90)

APP = "tests.client.exec_programs.procpool_app:app"


class Sink:
    """The parent's progress sink (in a Worker: the Task): records what it is given, or
    raises ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.seen: list[Any] = []
        self.error = error

    @property
    def cancelled(self) -> bool:
        return False

    async def progress(self, value: Any) -> None:
        if self.error is not None:
            raise self.error
        self.seen.append(value)

    def report_progress(self, value: Any) -> None:
        raise AssertionError("the parent reports progress with await progress()")


def context(sink: Sink | None = None, **fields: Any) -> Context:
    fields.setdefault("task_id", "t-1")
    fields.setdefault("name", "some.task")
    fields.setdefault("attempt", 1)
    fields.setdefault("max_attempts", 3)
    fields.setdefault("queue", "default")
    return Context(sink=sink or Sink(), **fields)


def task(name: str) -> TaskFunction[Any, Any]:
    return app.tasks[name]


class Unknown:
    name = "not.registered"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is not running)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return text.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def text_of(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


async def read_pid(path: Path) -> int:
    return int(await wait_until(lambda: text_of(path).strip(), what=f"a pid in {path}"))


def touch(path: Path) -> None:
    path.write_text("")


@pytest.fixture
async def runner() -> AsyncIterator[ProcessRunner]:
    """A runner of one child (the tests that need more make their own: each child imports the
    app, which takes a moment)."""
    r = ProcessRunner(APP, 1)
    try:
        yield r
    finally:
        await r.close()


@pytest.fixture
async def pair() -> AsyncIterator[ProcessRunner]:
    r = ProcessRunner(APP, 2)
    try:
        yield r
    finally:
        await r.close()


def test_it_is_a_sync_runner() -> None:
    runner: SyncRunner = ProcessRunner(APP, 1)  # (mypy checks the protocol)
    assert runner is not None


def test_bad_arguments_are_refused_at_once() -> None:
    with pytest.raises(ValueError, match="'module:attribute'"):
        ProcessRunner("tests.client.exec_programs.procpool_app", 1)
    with pytest.raises(ValueError, match="at least 1"):
        ProcessRunner(APP, 0)


# -- results and exceptions ------------------------------------------------------------------------


async def test_results_come_back_and_the_child_sees_the_context(runner: ProcessRunner) -> None:
    assert await runner.run(task("add"), [2, 3], {}, context()) == 5
    assert await runner.run(task("add"), [2], {"b": 4}, context()) == 6
    assert await runner.run(task("noop"), [], {}, context()) is None
    when = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)
    parents = (ParentResult("p1", b'{"n": 1}'), ParentResult("p2", None))
    ctx = context(
        task_id="abc",
        name="ctx.task",
        attempt=2,
        max_attempts=7,
        queue="emails",
        parents=parents,
        schedule="nightly",
        scheduled_for=when,
    )
    seen = await runner.run(task("context"), [], {}, ctx)
    assert seen == {
        "task_id": "abc",
        "name": "ctx.task",
        "attempt": 2,
        "max_attempts": 7,
        "queue": "emails",
        "parents": [["p1", b'{"n": 1}'], ["p2", None]],
        "schedule": "nightly",
        "scheduled_for": when,
        "cwd": os.getcwd(),
        "sigint": True,  # (Ctrl-C is the parent's to handle)
    }
    pid = await runner.run(task("pid"), [], {}, context())
    assert pid in runner.pids
    assert pid != os.getpid()


async def test_an_exception_comes_back_as_itself_with_the_childs_traceback(
    runner: ProcessRunner,
) -> None:
    with pytest.raises(ValueError, match="no good") as e:
        await runner.run(task("raise_value_error"), ["no good"], {}, context())
    assert str(e.value) == "no good"
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "in the worker process:" in notes
    assert "procpool_app.py" in notes


async def test_an_exception_that_does_not_unpickle_comes_back_as_its_text(
    runner: ProcessRunner,
) -> None:
    with pytest.raises(RuntimeError, match=r"^Unpicklable: this and that$"):
        await runner.run(task("raise_unpicklable"), [], {}, context())


@pytest.mark.parametrize(("delay_ms", "error"), [(250, "rate limited"), (None, None), (0, "now")])
async def test_retry_comes_back_with_its_fields(
    runner: ProcessRunner, delay_ms: int | None, error: str | None
) -> None:
    with pytest.raises(Retry) as e:
        await runner.run(task("raise_retry"), [delay_ms, error], {}, context())
    assert type(e.value) is Retry
    assert (e.value.delay_ms, e.value.error) == (delay_ms, error)


@pytest.mark.parametrize("error", ["the account is closed", None])
async def test_fail_comes_back_with_its_fields(runner: ProcessRunner, error: str | None) -> None:
    with pytest.raises(Fail) as e:
        await runner.run(task("raise_fail"), [error], {}, context())
    assert type(e.value) is Fail
    assert e.value.error == error


async def test_sys_exit_in_a_task_fails_the_task_not_the_child(runner: ProcessRunner) -> None:
    await runner.run(task("noop"), [], {}, context())
    before = sorted(runner.pids)
    for _ in range(3):
        with pytest.raises(RuntimeError, match=r"^SystemExit: 3$"):
            await runner.run(task("exit"), [3], {}, context())
    assert sorted(runner.pids) == before


async def test_a_result_that_does_not_pickle_fails_its_task(runner: ProcessRunner) -> None:
    with pytest.raises(RuntimeError, match="result cannot be sent back from the worker process"):
        await runner.run(task("unpicklable_result"), [], {}, context())
    assert await runner.run(task("add"), [1, 1], {}, context()) == 2


async def test_a_task_the_childs_app_does_not_have_fails_naming_it(runner: ProcessRunner) -> None:
    unknown = cast(TaskFunction[Any, Any], Unknown())
    with pytest.raises(RuntimeError, match=r"task 'not\.registered' is not registered"):
        await runner.run(unknown, [], {}, context())


async def test_start_waits_until_every_child_has_loaded_the_app() -> None:
    runner = ProcessRunner(APP, 2)
    try:
        await runner.start()
        assert len(runner.pids) == 2
        assert all(child is not None and child.ready for child in runner._slots)
        assert await runner.run(task("add"), [1, 2], {}, context()) == 3
    finally:
        await runner.close()
    broken = ProcessRunner("tests.client.exec_programs.no_such_module:app", 1)
    try:
        with pytest.raises(RuntimeError, match="could not load the app"):
            await broken.start()
    finally:
        await broken.close()


async def test_an_app_that_does_not_load_fails_each_task_saying_why() -> None:
    runner = ProcessRunner("tests.client.exec_programs.no_such_module:app", 1)
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="could not load the app") as e:
                await runner.run(task("noop"), [], {}, context())
            assert "No module named 'tests.client.exec_programs.no_such_module'" in str(e.value)
    finally:
        await runner.close()


# -- progress --------------------------------------------------------------------------------------


async def test_progress_is_forwarded_to_the_parents_context(runner: ProcessRunner) -> None:
    sink = Sink()
    assert await runner.run(task("progress"), [3], {}, context(sink)) == "done"
    assert sink.seen == [{"step": 0}, {"step": 1}, {"step": 2}]


async def test_a_progress_report_that_fails_raises_in_the_child(runner: ProcessRunner) -> None:
    sink = Sink(LeaseLost("the lease is gone"))
    got = await runner.run(task("progress_caught"), [], {}, context(sink))
    assert got == "LeaseLost: the lease is gone"
    with pytest.raises(LeaseLost, match="the lease is gone"):  # (uncaught: comes back)
        await runner.run(task("progress"), [1], {}, context(sink))


# -- hard limits -----------------------------------------------------------------------------------


async def test_cancelling_a_run_kills_its_child_and_the_pool_keeps_its_size(
    pair: ProcessRunner, tmp_path: Path
) -> None:
    run = asyncio.ensure_future(pair.run(task("stuck"), [str(tmp_path / "pid")], {}, context()))
    pid = await read_pid(tmp_path / "pid")
    assert pid in pair.pids
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert not alive(pid)
    assert len(pair.pids) == 2
    assert pid not in pair.pids
    # both children work: two tasks at once meet
    (tmp_path / "meet").mkdir()
    pids = await asyncio.gather(
        *(pair.run(task("meet"), [str(tmp_path / "meet"), 2], {}, context()) for _ in range(2))
    )
    assert sorted(pids) == sorted(pair.pids)


async def test_a_child_that_dies_fails_only_its_task_and_is_replaced(
    pair: ProcessRunner, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    waiting = asyncio.ensure_future(pair.run(task("gate"), [str(gate)], {}, context()))
    other = await read_pid(tmp_path / "gate.pid")
    with pytest.raises(RuntimeError, match=r"the worker process died \(exit code 7\)"):
        await pair.run(task("die"), [7], {}, context())
    with pytest.raises(RuntimeError, match=r"died \(killed by signal SIGSEGV\)"):
        await pair.run(task("segfault"), [], {}, context())
    assert len(pair.pids) == 2
    assert other in pair.pids
    touch(gate)
    assert await waiting == "passed"  # (the other child's task went on)
    assert await pair.run(task("add"), [1, 2], {}, context()) == 3


async def test_an_idle_child_killed_from_outside_is_replaced(pair: ProcessRunner) -> None:
    await pair.run(task("noop"), [], {}, context())
    victim = pair.pids[0]
    os.kill(victim, signal.SIGKILL)
    await wait_until(
        lambda: len(pair.pids) == 2 and victim not in pair.pids,
        what="a new child in the killed one's place",
    )
    got = await asyncio.gather(*(pair.run(task("pid"), [], {}, context()) for _ in range(4)))
    assert set(got) <= set(pair.pids)


async def test_ctrl_c_does_not_stop_a_child_mid_task(runner: ProcessRunner, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    waiting = asyncio.ensure_future(runner.run(task("gate"), [str(gate)], {}, context()))
    pid = await read_pid(tmp_path / "gate.pid")
    os.kill(pid, signal.SIGINT)
    touch(gate)
    assert await waiting == "passed"
    assert pid in runner.pids


# -- concurrency and closing -----------------------------------------------------------------------


async def test_size_n_runs_n_tasks_at_once_one_per_child(tmp_path: Path) -> None:
    runner = ProcessRunner(APP, 3)
    try:
        pids = await asyncio.gather(
            *(runner.run(task("meet"), [str(tmp_path), 3], {}, context()) for _ in range(3))
        )
        assert len(set(pids)) == 3  # all three met: at once, each in a child of its own
        assert sorted(pids) == sorted(runner.pids)
        # more tasks than children: each waits for a free one
        got = await asyncio.gather(
            *(runner.run(task("add"), [i, 1], {}, context()) for i in range(20))
        )
        assert got == [i + 1 for i in range(20)]
    finally:
        await runner.close()


async def test_close_ends_the_children(tmp_path: Path) -> None:
    runner = ProcessRunner(APP, 2)
    await runner.run(task("noop"), [], {}, context())
    pids = runner.pids
    assert len(pids) == 2
    await runner.close()
    assert runner.pids == []
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="the process runner is closed"):
        await runner.run(task("noop"), [], {}, context())
    await runner.close()  # (again: nothing to do)


async def test_close_kills_a_child_still_running_after_the_grace(tmp_path: Path) -> None:
    runner = ProcessRunner(APP, 1)
    run = asyncio.ensure_future(runner.run(task("stuck"), [str(tmp_path / "pid")], {}, context()))
    queued = asyncio.ensure_future(runner.run(task("noop"), [], {}, context()))
    pid = await read_pid(tmp_path / "pid")
    await runner.close(grace=0.1)
    assert not alive(pid)
    for waited in (run, queued):
        with pytest.raises(RuntimeError, match="the process runner was closed"):
            await waited
    assert runner.pids == []


async def test_an_unclosed_runners_children_end_with_their_parent(tmp_path: Path) -> None:
    # (a child's pipe ends when the parent goes: an idle child then exits)
    runner = ProcessRunner(APP, 1)
    await runner.run(task("noop"), [], {}, context())
    [pid] = runner.pids
    for child in runner._slots:
        assert child is not None
        child.detach()  # (as the parent's exit closes its end)
    await wait_until(lambda: not alive(pid), what="the child to exit")
    await runner.close()


# -- end to end: a real broker, a real Worker ------------------------------------------------------

TRANSPORTS = ["http", "grpc"]


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async with running_broker() as b:
        yield b


def url_for(broker: Broker, transport: str) -> str:
    return broker.http_url if transport == "http" else "grpc://" + broker.grpc_target


def call(name: str, *args: Any) -> dict[str, Any]:
    return {"task": name, "args": list(args)}


async def test_end_to_end_through_a_worker(broker: Broker, transport: str, tmp_path: Path) -> None:
    runner = ProcessRunner(APP, 2)
    async with AsyncClient(url_for(broker, transport)) as client:
        worker = Worker(client, app.handler(runner), concurrency=2, wait_ms=200, lease_ms=1000)
        running = asyncio.ensure_future(worker.run())
        try:
            added = (await client.enqueue(call("add", 2, 40), result_ttl_ms=60_000)).id
            failed = (await client.enqueue(call("raise_fail", "closed account"))).id
            retried = (await client.enqueue(call("raise_retry", 60_000, "busy"))).id
            died = (await client.enqueue(call("die", 9), max_attempts=1)).id
            stuck = (await client.enqueue(call("stuck", str(tmp_path / "pid")))).id

            done = await client.wait_result(added, timeout=30)
            assert done is not None
            assert (done.state, done.result) == ("succeeded", 42)
            dead = await client.wait_result(failed, timeout=30)
            assert dead is not None
            assert (dead.state, dead.last_error) == ("dead", "closed account")
            later = await wait_until(
                lambda: client.get_task(retried),
                lambda t: t.last_error is not None,
                what="the retried task to be nacked",
            )
            assert (later.state, later.last_error) == ("delayed", "busy")
            gone = await client.wait_result(died, timeout=30)
            assert gone is not None
            assert gone.state == "dead"
            assert gone.last_error is not None
            assert "the worker process died (exit code 9)" in gone.last_error

            pid = await read_pid(tmp_path / "pid")
            assert await client.cancel(stuck) == "cancelling"
            # (the nack that ends it may come before a result wait could start: counted)
            await wait_until(
                client.stats, lambda s: s.totals.cancelled == 1, what="the task's cancel"
            )
            await wait_until(lambda: not alive(pid), what="the cancelled task's child to die")
            assert len(runner.pids) == 2
        finally:
            worker.stop()
            await asyncio.wait_for(running, 30)
            await runner.close()


def test_it_runs_on_uvloop_as_wq_worker_does() -> None:
    # (`wq worker` runs on uvloop: the pipes' readers and the children's pidfds on its loop)
    import uvloop

    async def run() -> tuple[Any, Any]:
        pool = ProcessRunner(APP, 1)
        try:
            added = await pool.run(task("add"), [2, 3], {}, context())
            with pytest.raises(Fail):
                await pool.run(task("raise_fail"), ["no"], {}, context())
            return added, await pool.run(task("noop"), [], {}, context())
        finally:
            await pool.close()

    assert uvloop.run(run()) == (5, None)
