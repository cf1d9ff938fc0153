"""``wq worker`` as a user runs it: a broker process, a tasks module in a directory of its own,
``wq worker tasks:app`` (or ``-exec``, or ``-- PROGRAM``) in that directory, tasks enqueued with
wqclient and looked at in the broker. Also ``wq-worker -- PROGRAM`` (the spec's worker running a
program per task)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_until_sync
from tests.procs import BrokerProcess, broker_process, env, free_port, worker_command
from wqclient import Client

pytestmark = pytest.mark.timeout(120)

TASKS = textwrap.dedent(
    """
    import asyncio
    import os
    import time

    import wqclient

    app = wqclient.App()


    @app.task
    async def add(a: int, b: int) -> int:
        return a + b


    @app.task
    def mul(a: int, b: int) -> int:
        return a * b


    @app.task
    async def sleepy(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "woke"


    @app.task(timeout=1, max_attempts=1)
    def stuck(seconds: float) -> int:
        time.sleep(seconds)
        return os.getpid()


    @app.task
    def pid() -> int:
        return os.getpid()


    not_an_app = 42
    empty = wqclient.App()
    """
)

SCRIPT = textwrap.dedent(
    """\
    #!/bin/sh
    payload=$(cat)
    case "$payload" in
      *dead*) echo "giving up" >&2; exit 100;;
      *flaky*) echo "first line" >&2; echo "something broke" >&2; exit 3;;
    esac
    echo "{\\"echo\\": $payload, \\"attempt\\": $WQ_ATTEMPT}"
    """
)


# What the App's enqueue would send for tasks.stuck (a raw enqueue names its options itself).
STUCK: dict[str, Any] = {"timeout_ms": 1000, "max_attempts": 1}


def call(name: str, *args: Any) -> dict[str, Any]:
    return {"task": name, "args": list(args)}


class WorkerProcess:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        assert proc.stderr is not None
        stderr = proc.stderr

        def read() -> None:
            for line in stderr:
                self.lines.append(line.rstrip("\n"))

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def saw(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def wait_for(self, text: str, timeout: float = 30) -> None:
        wait_until_sync(
            lambda: self.saw(text) or self.proc.poll() is not None,
            what=f"the worker to log {text!r}",
            timeout=timeout,
        )
        assert self.saw(text), "\n".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("the worker did not stop:\n" + "\n".join(self.lines)) from None
        self._reader.join(10)
        return rc


def wq(*args: str) -> list[str]:
    return [sys.executable, "-m", "wqclient.cli.admin", *args]


@contextmanager
def worker_in(
    cwd: Path, *args: str, command: list[str] | None = None, ready: str = "running"
) -> Iterator[WorkerProcess]:
    proc = subprocess.Popen(
        command or wq("worker", *args),
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = WorkerProcess(proc)
    try:
        worker.wait_for(ready)
        yield worker
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with broker_process() as b:
        yield b


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "tasks.py").write_text(TASKS)
    script = tmp_path / "handle.sh"
    script.write_text(SCRIPT)
    script.chmod(0o755)
    return tmp_path


@pytest.fixture
def queue(request: pytest.FixtureRequest) -> str:
    """A queue of the test's own (the broker is shared by the module's tests)."""
    return f"q{abs(hash(request.node.name)) % 10**8}"


def result_of(client: Client, task_id: str, timeout: float = 30) -> Any:
    outcome = client.wait_result(task_id, timeout=timeout)
    assert outcome is not None, f"task {task_id} still pending"
    return outcome


# -- running an App's tasks ------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_async_and_sync_tasks_run_and_their_results_are_kept(
    broker: BrokerProcess, project: Path, queue: str, protocol: str
) -> None:
    url = broker.grpc_url if protocol == "grpc" else broker.url
    with (
        Client(broker.url) as client,
        worker_in(project, "tasks:app", "-broker", url, "-queues", queue) as worker,
    ):
        added = client.enqueue(call("tasks.add", 2, 3), queue=queue).id
        multiplied = client.enqueue(call("tasks.mul", 4, 5), queue=queue).id
        assert result_of(client, added).result == 5
        assert result_of(client, multiplied).result == 20
        assert worker.stop() == 0
    assert worker.saw("gRPC" if protocol == "grpc" else "HTTP")
    assert worker.saw("tasks.add")  # the start-up line names the tasks ...
    assert worker.saw(f"queues {queue}")  # ... the queues, concurrency, pool
    assert worker.saw("concurrency 8, pool threads")


def test_the_broker_comes_from_the_environment_and_the_queues_from_the_app(
    broker: BrokerProcess, project: Path
) -> None:
    with Client(broker.url) as client:
        proc = subprocess.Popen(
            wq("worker", "tasks:app"),
            cwd=project,
            env={**env(), "WQ_BROKER": broker.grpc_url},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        worker = WorkerProcess(proc)
        try:
            worker.wait_for("running")
            task_id = client.enqueue(call("tasks.add", 1, 1)).id  # the default queue
            assert result_of(client, task_id).result == 2
            assert worker.stop() == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    assert worker.saw(broker.grpc_url)


def test_a_process_pool_kills_a_task_past_its_timeout_and_keeps_working(
    broker: BrokerProcess, project: Path, queue: str
) -> None:
    args = ("tasks:app", "-broker", broker.grpc_url, "-queues", queue)
    with (
        Client(broker.url) as client,
        worker_in(project, *args, "-pool", "processes", "-concurrency", "1") as worker,
    ):
        first = result_of(client, client.enqueue(call("tasks.pid"), queue=queue).id).result
        stuck = client.enqueue(call("tasks.stuck", 60), queue=queue, **STUCK).id
        ended = result_of(client, stuck)
        assert ended.state == "dead"  # (max_attempts=1)
        # The worker's own nack, or the broker's reclaim at the limit: the same words.
        assert ended.last_error == "timed out after 1000 ms"
        worker.wait_for("timed out after 1000 ms")
        after = result_of(client, client.enqueue(call("tasks.pid"), queue=queue).id).result
        assert after != first  # the child that ran it was killed, and another started
        assert isinstance(after, int)
        assert worker.stop() == 0
    assert worker.saw("pool processes")


# -- stopping ------------------------------------------------------------------------------------


def test_sigterm_hands_back_a_task_still_running_after_the_grace(
    broker: BrokerProcess, project: Path, queue: str
) -> None:
    args = ("tasks:app", "-broker", broker.grpc_url, "-queues", queue, "-grace", "1")
    with Client(broker.url) as client, worker_in(project, *args) as worker:
        quick = client.enqueue(call("tasks.add", 1, 2), queue=queue).id
        assert result_of(client, quick).result == 3
        long = client.enqueue(call("tasks.sleepy", 300), queue=queue, max_attempts=5).id
        wait_until_sync(
            lambda: client.get_task(long).state == "handed_out", what="the task to be taken"
        )
        started = time.monotonic()
        assert worker.stop(signal.SIGTERM) == 0
        assert time.monotonic() - started < 10  # the grace (1 s), not the task (300 s)
        task = client.get_task(long)
        assert task.state == "ready"  # at once: not waiting for its lease to run out
        assert task.attempts == 0  # released: the attempt it was on is not counted
        assert task.last_error is None
        assert client.stats(queue).totals.nacked == 0
    assert worker.saw("handed back")
    assert worker.saw("stopped:")


def test_a_second_signal_hands_back_at_once(
    broker: BrokerProcess, project: Path, queue: str
) -> None:
    args = ("tasks:app", "-broker", broker.grpc_url, "-queues", queue, "-grace", "300")
    with Client(broker.url) as client, worker_in(project, *args) as worker:
        long = client.enqueue(call("tasks.sleepy", 300), queue=queue, max_attempts=5).id
        wait_until_sync(
            lambda: client.get_task(long).state == "handed_out", what="the task to be taken"
        )
        worker.proc.send_signal(signal.SIGINT)
        worker.wait_for("stopping")
        assert worker.proc.poll() is None  # still within its grace
        started = time.monotonic()
        assert worker.stop(signal.SIGINT) == 0
        assert time.monotonic() - started < 10
        task = client.get_task(long)
        assert task.state == "ready"
        assert (task.attempts, task.last_error) == (0, None)


# -- a program per task --------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["exec", "dashdash", "wq-worker"])
def test_a_program_per_task_acks_buries_and_retries_by_its_exit_status(
    broker: BrokerProcess, project: Path, queue: str, form: str
) -> None:
    flags = ["-broker", broker.grpc_url]
    if form == "exec":
        command = wq("worker", *flags, "-queues", queue, "-exec", "./handle.sh --unused")
    elif form == "dashdash":
        command = wq("worker", *flags, "-queues", queue, "--", "./handle.sh", "--unused")
    else:
        command = worker_command(*flags, "-queue", queue, "--", "./handle.sh")
    ready = "workers streaming" if form == "wq-worker" else "running"
    with (
        Client(broker.url) as client,
        worker_in(project, command=command, ready=ready) as worker,
    ):
        ok = client.enqueue({"n": 1}, queue=queue).id
        dead = client.enqueue({"dead": True}, queue=queue, max_attempts=5).id
        flaky = client.enqueue({"flaky": True}, queue=queue, max_attempts=5).id
        assert result_of(client, ok).result == {"echo": {"n": 1}, "attempt": 1}
        buried = result_of(client, dead)
        assert buried.state == "dead"
        assert buried.attempts == 1  # straight to the dead-letter queue
        assert "giving up" in (buried.last_error or "")
        wait_until_sync(
            lambda: client.get_task(flaky).last_error,
            what="the flaky task to fail once",
        )
        task = client.get_task(flaky)
        assert task.state != "dead"  # retried
        assert "something broke" in (task.last_error or "")
        assert worker.stop() == 0
    assert not (project / "jobs.log").exists()  # wq-worker ran the program, wrote no log


# -- metrics and logs ----------------------------------------------------------------------------


def test_metrics_are_served_in_the_prometheus_text_format(
    broker: BrokerProcess, project: Path, queue: str
) -> None:
    port = free_port()
    args = ("tasks:app", "-broker", broker.grpc_url, "-queues", queue)
    with (
        Client(broker.url) as client,
        worker_in(project, *args, "-metrics-addr", f"127.0.0.1:{port}") as worker,
    ):
        for i in range(3):
            result_of(client, client.enqueue(call("tasks.add", i, i), queue=queue).id)
        result_of(client, client.enqueue(call("tasks.stuck", 60), queue=queue, **STUCK).id)
        worker.wait_for("timed_out in")  # (the broker's limit may have told the client first)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert worker.stop() == 0
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    succeeded = (("outcome", "succeeded"), ("task", "tasks.add"))
    assert samples[("wq_worker_tasks_total", succeeded)] == 3
    timed_out = samples.get(
        ("wq_worker_tasks_total", (("outcome", "timed_out"), ("task", "tasks.stuck")))
    )
    assert timed_out == 1
    assert samples[("wq_worker_task_duration_seconds_count", (("task", "tasks.add"),))] == 3
    assert samples[("wq_worker_tasks_in_flight", ())] == 0


def test_json_logs_have_a_line_per_task_with_its_fields(
    broker: BrokerProcess, project: Path, queue: str
) -> None:
    args = ("tasks:app", "-broker", broker.grpc_url, "-queues", queue, "-log-format", "json")
    with Client(broker.url) as client, worker_in(project, *args) as worker:
        task_id = client.enqueue(call("tasks.add", 1, 2), queue=queue).id
        result_of(client, task_id)
        worker.wait_for(task_id)
        assert worker.stop() == 0
    records = [json.loads(line) for line in worker.lines if line.startswith("{")]
    assert len(records) == len(worker.lines)  # every line is a JSON object
    [line] = [r for r in records if r.get("task_id") == task_id]
    assert line["task_name"] == "tasks.add"
    assert line["outcome"] == "succeeded"
    assert line["attempts"] == 1
    assert line["level"] == "info"
    assert isinstance(line["duration_ms"], float)


def test_quiet_logs_no_line_per_task(broker: BrokerProcess, project: Path, queue: str) -> None:
    args = ("tasks:app", "-broker", broker.grpc_url, "-queues", queue, "-quiet")
    proc = subprocess.Popen(
        wq("worker", *args), cwd=project, env=env(), stderr=subprocess.PIPE, text=True
    )
    worker = WorkerProcess(proc)
    with Client(broker.url) as client:
        try:
            time.sleep(1.5)  # (nothing to wait for: it says nothing)
            task_id = client.enqueue(call("tasks.add", 1, 2), queue=queue).id
            result_of(client, task_id)
            assert worker.stop() == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    assert not worker.saw(task_id)


# -- the command line --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["nosuchmodule:app"], "no module named 'nosuchmodule'"),
        (["tasks:nope"], "has no attribute 'nope'"),
        (["tasks:not_an_app"], "is not a wqclient.App"),
        (["tasks:empty"], "has no tasks"),
        (["tasks"], "is not MODULE:APP"),
        ([], "nothing to run"),
        (["tasks:app", "-exec", "./handle.sh"], "not both"),
        (["-exec", "./handle.sh", "--", "./handle.sh"], "not both"),
        (["--"], "no program after --"),
        (["-exec", "'unclosed"], "-exec"),
        (["-exec", "./missing.sh"], "program not found"),
        (["tasks:app", "-concurrency", "0"], "-concurrency"),
        (["tasks:app", "-pool", "fibers"], "-pool"),
        (["tasks:app", "-grace", "-1"], "-grace"),
        (["tasks:app", "-metrics-addr", "nowhere"], "host:port"),
        (["tasks:app", "-nope"], "flag provided but not defined: -nope"),
        (["tasks:app", "-concurrency", "4", "-prefetch", "2"], "-prefetch"),
        (["-exec", "./handle.sh", "-pool", "processes"], "-pool"),
    ],
)
def test_a_bad_invocation_is_one_line_and_exit_2(project: Path, args: list[str], says: str) -> None:
    done = subprocess.run(
        wq("worker", *args), cwd=project, env=env(), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("wq worker: "), lines[0]
    assert says in lines[0]


def test_wq_help_lists_the_worker_command(project: Path) -> None:
    done = subprocess.run(wq("--help"), env=env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    assert any(line.split()[:1] == ["worker"] for line in done.stdout.splitlines())
    done = subprocess.run(wq("worker", "-h"), env=env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    for flag in ("-queues", "-concurrency", "-pool", "-grace", "-reload", "-metrics-addr"):
        assert flag in done.stdout


# -- -reload ---------------------------------------------------------------------------------------


def test_reload_restarts_the_worker_when_a_py_file_changes(
    broker: BrokerProcess, project: Path, queue: str
) -> None:
    args = ("tasks:app", "-broker", broker.grpc_url, "-queues", queue, "-reload", "-grace", "1")
    with Client(broker.url) as client, worker_in(project, *args) as worker:
        assert (
            result_of(client, client.enqueue(call("tasks.add", 1, 2), queue=queue).id).result == 3
        )
        time.sleep(1.1)  # (a modification time that differs, on any file system)
        tasks = project / "tasks.py"
        tasks.write_text(tasks.read_text().replace("return a + b", "return a + b + 100"))
        worker.wait_for("tasks.py changed")
        wait_until_sync(
            lambda: sum("running" in line for line in list(worker.lines)) >= 2,
            what="the worker to start again",
        )
        assert (
            result_of(client, client.enqueue(call("tasks.add", 1, 2), queue=queue).id).result == 103
        )
        assert worker.stop() == 0
    assert os.path.exists(project / "tasks.py")
