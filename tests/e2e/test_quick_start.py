"""The spec's quick start and every one of its "Things to try", end to end.

Real processes only: ``python -m wqbroker``, ``python -m wqclient.cli.worker`` (wq-worker) and
``python -m wqclient.cli.producer`` (wq-producer), each run from a pytest tmp_path so jobs.log lands
there, over HTTP (``-broker http://...``) and over gRPC (``-broker grpc://...``). The broker is
always inspected the way the spec does it, with plain HTTP GETs of /stats and /dlq.

Sweeper and backoff timings are shortened by flag wherever the spec's numbers are not themselves
under test; everything waits on a condition with a deadline rather than sleeping.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import invariant_holds, wait_until_sync
from tests.procs import (
    BrokerProcess,
    broker_process,
    env,
    free_port,
    producer_command,
    worker_command,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

TRANSPORTS = ["http", "grpc"]
GAUGES = ("ready", "handed_out", "delayed", "dead")
CLOSING_LINE = re.compile(
    r"^enqueued (?P<enqueued>\d+), failed (?P<failed>\d+), in [\d.]+s "
    r"\((?P<rate>[\d.]+) tasks/s\)$"
)
PROGRESS_BAR = re.compile("━{3,}")  # rich.progress draws its bar with these
WORKER_LOG = re.compile(r"^(?P<ts>\S+ \S+) wq-worker (?P<level>[A-Z]+) (?P<message>.*)$")
FAILED = re.compile(r"task (?P<id>\S+) failed \(attempt (?P<attempt>\d+) of (?P<max>\d+)\)")


# -- helpers ------------------------------------------------------------------------------------


def http_get(url: str, timeout: float = 10) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        return e.code, None


def http_post(url: str, timeout: float = 10) -> int:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status: int = resp.status
            return status
    except urllib.error.HTTPError as e:
        return e.code


def stats(broker: BrokerProcess) -> dict[str, Any]:
    status, body = http_get(broker.url + "/stats")
    assert status == 200
    assert isinstance(body, dict)
    return body


def dlq(broker: BrokerProcess) -> list[dict[str, Any]]:
    status, body = http_get(broker.url + "/dlq")
    assert status == 200
    assert isinstance(body, list)
    return body


def line_count(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_lines(path: Path, n: int, timeout: float = 20) -> list[dict[str, Any]]:
    """Wait for ``n`` lines; returns the complete lines so far (a worker may be mid-write)."""
    wait_until_sync(
        lambda: line_count(path) >= n, what=f"{n} lines in {path.name}", timeout=timeout
    )
    return read_jobs(path, writers_active=True)


def read_jobs(path: Path, *, writers_active: bool = False) -> list[dict[str, Any]]:
    """Every line of jobs.log, each of which must be one complete JSON object. With
    ``writers_active`` a trailing partial line (a write in progress) is left for later."""
    text = path.read_text()
    if writers_active:
        text = text[: text.rfind("\n") + 1]
    assert text == "" or text.endswith("\n"), "jobs.log ends in a torn line"
    jobs = []
    for line in text.splitlines():
        job = json.loads(line)
        assert isinstance(job, dict), line
        assert {"id", "attempts", "payload", "done_at"} <= job.keys(), line
        jobs.append(job)
    return jobs


def rfc3339(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def done_at(job: dict[str, Any]) -> float:
    return rfc3339(job["done_at"])


def assert_gauges_zero(s: dict[str, Any], *, dead: int = 0) -> None:
    assert {g: s[g] for g in GAUGES} == {"ready": 0, "handed_out": 0, "delayed": 0, "dead": dead}


def assert_no_traceback(text: str) -> None:
    for sign in ("Traceback", "exception was never retrieved", "was destroyed but it is pending"):
        assert sign not in text, text


def client_url(broker: BrokerProcess, transport: str) -> str:
    return broker.url if transport == "http" else broker.grpc_url


class WorkerProcess:
    """A running wq-worker; its stderr (the log) goes to a file so it can never block."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_lines(self) -> list[str]:
        return self.log.splitlines()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        """Send ``sig`` and return the exit code; fails if the worker does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"worker did not exit within {timeout}s of {signal.Signals(sig).name}:\n" + self.log
            ) from None


_worker_ids = iter(range(1_000_000))


@contextmanager
def worker_process(cwd: Path, broker_url: str, *args: str) -> Iterator[WorkerProcess]:
    log_path = cwd / f"worker-{next(_worker_ids)}.err"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            worker_command("-broker", broker_url, *args),
            cwd=cwd,
            env=env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    worker = WorkerProcess(proc, log_path)
    try:
        # Wait for the startup line, so the worker is really up before the test goes on.
        wait_until_sync(
            lambda: "workers" in worker.log or not worker.alive(), what="the worker to start"
        )
        assert worker.alive(), f"the worker exited at start (rc {proc.returncode}):\n{worker.log}"
        yield worker
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def produce(
    cwd: Path, broker_url: str | None, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    cmd = producer_command(*(("-broker", broker_url) if broker_url else ()), *args)
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def produce_ok(cwd: Path, broker_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = produce(cwd, broker_url, *args)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done


# -- 1. quick start -----------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_quick_start_100_lines_and_the_queue_drains(transport: str, tmp_path: Path) -> None:
    with broker_process() as broker:
        url = client_url(broker, transport)
        with worker_process(tmp_path, url, "-concurrency", "3", "-wait-ms", "2000") as worker:
            produce_ok(tmp_path, url, "-n", "100")
            wait_lines(tmp_path / "jobs.log", 100)
            wait_until_sync(
                lambda: stats(broker), lambda s: s["totals"]["acked"] >= 100, what="100 acks"
            )
            # Once the worker has exited, nothing more can turn up: count what there is.
            assert worker.stop() == 0, worker.log
        jobs = read_jobs(tmp_path / "jobs.log")
        s = stats(broker)
    assert len(jobs) == 100
    assert len({j["id"] for j in jobs}) == 100
    assert sorted(j["payload"]["n"] for j in jobs) == list(range(1, 101))
    assert all(j["payload"]["line"] == f"task {j['payload']['n']} of 100" for j in jobs)
    assert all(j["attempts"] == 1 for j in jobs)
    assert_gauges_zero(s)
    assert s["totals"] == {
        "enqueued": 100,
        "delivered": 100,
        "acked": 100,
        "nacked": 0,
        "reclaimed": 0,
        "retried": 0,
        "buried": 0,
        "requeued": 0,
        "purged": 0,
        "cancelled": 0,
        "expired": 0,
    }


# -- 2. retries and the dead-letter queue -------------------------------------------------------


def failure_times(worker: WorkerProcess) -> dict[str, dict[int, datetime]]:
    """task id -> attempt -> when the worker logged that attempt's failure."""
    seen: dict[str, dict[int, datetime]] = {}
    for line in worker.log_lines():
        m = WORKER_LOG.match(line)
        f = FAILED.search(line)
        if m and f:
            when = datetime.strptime(m["ts"], "%Y-%m-%d %H:%M:%S,%f")
            seen.setdefault(f["id"], {})[int(f["attempt"])] = when
    return seen


@pytest.mark.parametrize(
    ("transport", "backoff_base_ms"),
    [
        pytest.param("http", None, id="http-default-backoff-timed"),
        pytest.param("grpc", 50, id="grpc-fast-backoff"),
    ],
)
def test_failing_tasks_retry_with_backoff_and_are_buried(
    transport: str, backoff_base_ms: int | None, tmp_path: Path
) -> None:
    broker_args = ["-sweep-interval-ms", "50"]
    if backoff_base_ms is not None:
        broker_args += ["-backoff-base-ms", str(backoff_base_ms)]
    with broker_process(*broker_args) as broker:
        url = client_url(broker, transport)
        with worker_process(tmp_path, url, "-concurrency", "3", "-wait-ms", "2000") as worker:
            produce_ok(tmp_path, url, "-n", "5", "-fail", "-max-attempts", "3")
            wait_until_sync(
                lambda: stats(broker), lambda s: s["dead"] == 5, what="5 buried tasks", timeout=15
            )
            # Once the worker has exited, nothing more can happen: take stock.
            assert worker.stop() == 0, worker.log
            dead = dlq(broker)
            s = stats(broker)
            failures = failure_times(worker)

    assert_gauges_zero(s, dead=5)
    t = s["totals"]
    assert (t["enqueued"], t["delivered"], t["acked"]) == (5, 15, 0)
    assert (t["nacked"], t["retried"], t["buried"], t["reclaimed"]) == (15, 10, 5, 0)
    assert invariant_holds(s)
    assert read_jobs(tmp_path / "jobs.log") == []  # failing tasks never log a line

    assert len(dead) == 5
    assert len({d["id"] for d in dead}) == 5
    for task in dead:
        assert task["attempts"] == 3
        assert task["max_attempts"] == 3
        assert task["payload"]["fail"] is True
        assert isinstance(task["last_error"], str)
        assert task["last_error"]
        assert "fail" in task["last_error"]

    # Every task failed on attempts 1, 2 and 3, and the worker said so.
    assert set(failures) == {d["id"] for d in dead}
    assert all(sorted(a) == [1, 2, 3] for a in failures.values()), failures

    if backoff_base_ms is None:
        # The default policy: ~1 s then ~2 s; attempt n waits in [d/2, d], d = 1 s * 2**(n-1).
        # Real processes on real time, so this asserts causality, not elapsed bounds: the worker
        # logs a failure before it sends the nack that starts the backoff, so the next failure
        # can come no sooner than the backoff's fixed half (less the log's millisecond rounding).
        # How soon after d it comes is the sweeper's precision, pinned down on the fake clock
        # (unit/test_retry.py, service/test_service.py), not bounded by the wall clock here.
        first_gaps = []
        for task_id, when in failures.items():
            gap1 = (when[2] - when[1]).total_seconds()
            gap2 = (when[3] - when[2]).total_seconds()
            assert gap1 >= 0.5 - 0.01, (task_id, gap1)
            assert gap2 >= 1.0 - 0.01, (task_id, gap2)
            first_gaps.append(gap1)
        # Half of each delay is random: tasks that failed together do not retry in lockstep.
        assert max(first_gaps) - min(first_gaps) > 0.02, first_gaps


# -- 3. delayed tasks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("transport", "delay_ms"),
    [pytest.param("http", 5000, id="http-5s"), pytest.param("grpc", 1500, id="grpc-1.5s")],
)
def test_delayed_tasks_wait_then_drain(transport: str, delay_ms: int, tmp_path: Path) -> None:
    jobs_log = tmp_path / "jobs.log"
    delay = delay_ms / 1000
    with broker_process() as broker:
        url = client_url(broker, transport)
        with worker_process(tmp_path, url, "-concurrency", "3", "-wait-ms", "2000"):
            started = time.time()
            produce_ok(tmp_path, url, "-n", "10", "-delay-ms", str(delay_ms))
            first = stats(broker)
            assert first["delayed"] == 10, first
            assert (first["ready"], first["handed_out"]) == (0, 0), first

            # Watch /stats until the first delivery. Real time, so causality rather than elapsed
            # bounds: every look that was over before the delay could have run out (it started
            # before the first enqueue) shows all ten held back and nothing logged.
            looks: list[tuple[float, dict[str, Any], int]] = [(time.time(), first, 0)]

            def look() -> dict[str, Any]:
                s, lines = stats(broker), line_count(jobs_log)
                looks.append((time.time(), s, lines))
                return s

            wait_until_sync(
                look,
                lambda s: s["totals"]["delivered"] > 0,
                what="the first delivery",
                timeout=delay + 10,
            )
            during = [(s, lines) for at, s, lines in looks if at < started + delay]
            assert during, "the delay ran out before /stats could be read"
            for s, lines in during:
                assert (s["delayed"], s["totals"]["delivered"], lines) == (10, 0, 0), s

            jobs = wait_lines(jobs_log, 10, timeout=delay + 10)
            s = wait_until_sync(
                lambda: stats(broker),
                lambda s: s["totals"]["acked"] == 10,
                what="10 acks",
                timeout=10,
            )
    assert len({j["id"] for j in jobs}) == 10
    assert sorted(j["payload"]["n"] for j in jobs) == list(range(1, 11))
    # None of them ran before its delay was over (the producer started before any enqueue).
    assert min(done_at(j) for j in jobs) >= started + delay - 0.05
    assert_gauges_zero(s)
    assert s["totals"]["delivered"] == 10


# -- 4. contention --------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_contention_2000_tasks_50_producers_3_workers(transport: str, tmp_path: Path) -> None:
    with broker_process() as broker:
        url = client_url(broker, transport)
        with (
            worker_process(tmp_path, url, "-wait-ms", "2000") as w1,
            worker_process(tmp_path, url, "-wait-ms", "2000") as w2,
            worker_process(tmp_path, url, "-wait-ms", "2000") as w3,
        ):
            done = produce_ok(tmp_path, url, "-n", "2000", "-concurrency", "50")
            jobs = wait_lines(tmp_path / "jobs.log", 2000, timeout=40)
            wait_until_sync(
                lambda: stats(broker), lambda s: s["totals"]["acked"] >= 2000, what="2000 acks"
            )
            for w in (w1, w2, w3):
                assert w.alive(), w.log
            # Once the workers have exited, nothing more can turn up: count what there is.
            for w in (w1, w2, w3):
                assert w.stop() == 0, w.log
                assert_no_traceback(w.log)
            jobs = read_jobs(tmp_path / "jobs.log")
            s = stats(broker)
    m = CLOSING_LINE.match(done.stdout.strip())
    assert m, done.stdout
    assert (m["enqueued"], m["failed"]) == ("2000", "0"), done.stdout
    assert len(jobs) == 2000
    assert len({j["id"] for j in jobs}) == 2000
    assert sorted(j["payload"]["n"] for j in jobs) == list(range(1, 2001))
    assert_gauges_zero(s)
    t = s["totals"]
    assert (t["enqueued"], t["delivered"], t["acked"], t["nacked"], t["reclaimed"]) == (
        2000,
        2000,
        2000,
        0,
        0,
    )


# -- 5. crash recovery --------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_hand_claimed_task_with_one_second_lease_is_reclaimed(
    transport: str, tmp_path: Path
) -> None:
    with broker_process("-sweep-interval-ms", "50", "-backoff-base-ms", "200") as broker:
        produce_ok(tmp_path, client_url(broker, transport), "-n", "1")
        status, delivery = http_get(broker.url + "/jobs/next?wait_ms=2000&lease_ms=1000")
        assert status == 200, delivery
        assert delivery["task"]["attempts"] == 1
        task_id, lease_id = delivery["task"]["id"], delivery["lease_id"]
        assert stats(broker)["handed_out"] == 1

        # Never confirmed: the sweeper takes it back to ready once the lease has run out. Real
        # time, so causality rather than elapsed bounds: every look that was over before the
        # deadline shows the task still out, and the look that shows it reclaimed ended after
        # the deadline. (That the reclaim comes promptly is pinned down on the fake clock.)
        deadline = rfc3339(delivery["deadline"])
        looks: list[tuple[float, dict[str, Any]]] = []

        def look() -> dict[str, Any]:
            s = stats(broker)
            looks.append((time.time(), s))
            return s

        s = wait_until_sync(
            look,
            lambda s: s["totals"]["reclaimed"] == 1 and s["ready"] == 1,
            what="the task reclaimed and back in ready",
        )
        for at, seen in looks:
            if at < deadline:
                assert (seen["handed_out"], seen["totals"]["reclaimed"]) == (1, 0), seen
        assert looks[-1][0] >= deadline
        assert (s["handed_out"], s["delayed"], s["dead"]) == (0, 0, 0)
        assert s["totals"]["retried"] == 1
        assert invariant_holds(s)
        # The lapsed lease confirms nothing: nobody holds the task now.
        assert http_post(f"{broker.url}/jobs/{task_id}/ack?lease_id={lease_id}") == 404

        with worker_process(
            tmp_path, client_url(broker, transport), "-concurrency", "1", "-wait-ms", "2000"
        ):
            jobs = wait_lines(tmp_path / "jobs.log", 1, timeout=10)
            s = wait_until_sync(
                lambda: stats(broker),
                lambda s: s["totals"]["acked"] == 1,
                what="the ack",
                timeout=10,
            )
    assert [(j["id"], j["attempts"]) for j in jobs] == [(task_id, 2)]
    assert_gauges_zero(s)
    assert s["totals"]["delivered"] == 2
    assert invariant_holds(s)


# -- 6. worker shutdown and an absent broker ----------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_worker_signal_exits_0_and_leaves_nothing_handed_out(
    transport: str, sig: int, tmp_path: Path
) -> None:
    with broker_process() as broker:
        url = client_url(broker, transport)
        # Its long-polls last 30 s: stop() gives it 10 s, so exiting at all shows that it cut
        # them short rather than waiting them out.
        with worker_process(tmp_path, url, "-concurrency", "3", "-wait-ms", "30000") as worker:
            produce_ok(tmp_path, url, "-n", "20")
            wait_lines(tmp_path / "jobs.log", 20)
            assert worker.stop(sig, timeout=10) == 0, worker.log
            assert_no_traceback(worker.log)
            assert "stopped" in worker.log
        s = wait_until_sync(
            lambda: stats(broker), lambda s: s["totals"]["acked"] == 20, what="20 acks", timeout=5
        )
    assert_gauges_zero(s)
    assert len(read_jobs(tmp_path / "jobs.log")) == 20


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_worker_sigterm_mid_flow_settles_what_it_holds(transport: str, tmp_path: Path) -> None:
    """SIGTERM while tasks are streaming through: the worker stops claiming, what it holds is
    finished (or handed back), and nothing is left out on a lease."""
    total = 12000  # (enough that three quick workers, each stopped after 700 more, leave some)
    with broker_process() as broker:
        url = client_url(broker, transport)
        produce_ok(tmp_path, url, "-n", str(total), "-concurrency", "50")
        # Three workers in turn, each signalled while busy: a shutdown race gets three chances.
        # (A fixed prefetch: left to follow its quick handler, a worker would hold thousands of
        # the tasks at once, and finish them all before it stops.)
        for cycle in range(1, 4):
            with worker_process(
                tmp_path,
                url,
                "-concurrency",
                "16",
                "-prefetch",
                "32",
                "-wait-ms",
                "5000",
                "-lease-ms",
                "300000",
            ) as worker:
                try:
                    wait_lines(tmp_path / "jobs.log", 700 * cycle)
                except AssertionError as e:
                    raise AssertionError(f"{e}\n/stats: {stats(broker)}\n{worker.log}") from None
                assert worker.stop(signal.SIGTERM) == 0, worker.log
                assert_no_traceback(worker.log)
        # No lease can have run out while this test runs (they are 5 minutes): once nothing is
        # handed out, the workers gave back everything they held themselves.
        wait_until_sync(lambda: stats(broker), lambda s: s["handed_out"] == 0, what="nothing out")
        jobs = read_jobs(tmp_path / "jobs.log")
        s = stats(broker)
    assert len(jobs) < total, "the worker did not stop claiming"
    assert len({j["id"] for j in jobs}) == len(jobs)
    assert s["totals"]["acked"] == len(jobs)
    assert s["ready"] + s["delayed"] + s["totals"]["acked"] == total
    assert invariant_holds(s)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_worker_waits_for_a_broker_that_is_not_there_yet(transport: str, tmp_path: Path) -> None:
    port = free_port()
    url = f"{transport}://127.0.0.1:{port}"
    with worker_process(tmp_path, url, "-concurrency", "3", "-wait-ms", "1000") as worker:
        # It reports the outage and keeps trying until the broker comes (that it retries, with
        # backoff, is counted in client/test_client.py; here: it is still there, having said it
        # once).
        wait_until_sync(
            lambda: "broker unavailable" in worker.log or not worker.alive(),
            what="the outage to be reported",
        )
        assert worker.alive(), worker.log
        assert worker.log.count("broker unavailable") == 1, worker.log
        assert_no_traceback(worker.log)

        addr_flag = "-addr" if transport == "http" else "-grpc-addr"
        with broker_process(addr_flag, f"127.0.0.1:{port}") as broker:
            produce_ok(tmp_path, url, "-n", "10")
            jobs = wait_lines(tmp_path / "jobs.log", 10, timeout=20)
            s = wait_until_sync(
                lambda: stats(broker),
                lambda s: s["totals"]["acked"] == 10,
                what="10 acks",
                timeout=5,
            )
            assert worker.stop(signal.SIGTERM) == 0, worker.log
    assert len({j["id"] for j in jobs}) == 10
    assert_gauges_zero(s)
    assert worker.log.count("broker unavailable") == 1, worker.log
    assert_no_traceback(worker.log)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_worker_rides_out_a_broker_restart(transport: str, tmp_path: Path) -> None:
    http_port, grpc_port = free_port(), free_port()
    ports = ("-addr", f"127.0.0.1:{http_port}", "-grpc-addr", f"127.0.0.1:{grpc_port}")
    url = (
        f"http://127.0.0.1:{http_port}" if transport == "http" else f"grpc://127.0.0.1:{grpc_port}"
    )
    jobs_log = tmp_path / "jobs.log"
    with (
        broker_process(*ports) as first,
        worker_process(tmp_path, url, "-concurrency", "3", "-wait-ms", "1000") as worker,
    ):
        produce_ok(tmp_path, url, "-n", "5")
        wait_lines(jobs_log, 5)
        wait_until_sync(
            lambda: stats(first), lambda s: s["totals"]["acked"] == 5, what="5 acks", timeout=5
        )
        assert "broker unavailable" not in worker.log

        assert first.stop(signal.SIGTERM) == 0
        # The broker is gone: the worker reports it once and keeps trying; it does not exit.
        wait_until_sync(
            lambda: "broker unavailable" in worker.log or not worker.alive(),
            what="the outage to be reported",
        )
        assert worker.alive(), (
            f"the worker exited (rc {worker.proc.returncode}) when the broker went away:\n"
            + worker.log
        )
        assert "broker unavailable" in worker.log, worker.log

        with broker_process(*ports) as second:
            produce_ok(tmp_path, url, "-n", "5")
            jobs = wait_lines(jobs_log, 10, timeout=20)
            s = wait_until_sync(
                lambda: stats(second), lambda s: s["totals"]["acked"] == 5, what="5 acks", timeout=5
            )
            assert worker.stop(signal.SIGTERM) == 0, worker.log
    assert len({j["id"] for j in jobs}) == 10
    assert_gauges_zero(s)
    assert worker.log.count("broker unavailable") == 1, worker.log
    assert_no_traceback(worker.log)


def test_worker_bad_flag_is_a_one_line_error(tmp_path: Path) -> None:
    done = subprocess.run(
        worker_command("-concurrency", "0"),
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("wq-worker: "), line
    assert "-concurrency" in line, line
    assert_no_traceback(done.stderr)


# -- 7. the producer ----------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_producer_closing_line_and_no_progress_bar_on_pipes(transport: str, tmp_path: Path) -> None:
    with broker_process() as broker:
        done = produce_ok(tmp_path, client_url(broker, transport), "-n", "25", "-concurrency", "5")
        s = stats(broker)
    assert s["ready"] == 25
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    m = CLOSING_LINE.match(lines[0])
    assert m, lines[0]
    assert (m["enqueued"], m["failed"]) == ("25", "0")
    assert float(m["rate"]) > 0
    # Output is not a terminal: no progress bar, no carriage returns, nothing on stderr.
    for text in (done.stdout, done.stderr):
        assert "\r" not in text
        assert not PROGRESS_BAR.search(text)
    assert done.stderr == ""


def test_producer_draws_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    with broker_process() as broker:
        master, slave = pty.openpty()
        try:
            proc = subprocess.Popen(
                producer_command("-broker", broker.url, "-n", "40"),
                cwd=tmp_path,
                env=env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=slave,
                text=True,
            )
            os.close(slave)
            slave = -1
            terminal = b""
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ready, _, _ = select.select([master], [], [], 0.1)
                if ready:
                    try:
                        chunk = os.read(master, 4096)
                    except OSError:  # EIO: the child closed its end
                        break
                    if not chunk:
                        break
                    terminal += chunk
                elif proc.poll() is not None:
                    break
            stdout, _ = proc.communicate(timeout=10)
        finally:
            os.close(master)
            if slave >= 0:
                os.close(slave)
        assert stats(broker)["ready"] == 40
    assert proc.returncode == 0
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.decode(errors="replace"))
    assert PROGRESS_BAR.search(drawn), drawn
    assert "40/40" in drawn
    m = CLOSING_LINE.match(stdout.strip())
    assert m, stdout
    assert m["enqueued"] == "40", stdout


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["-n", "abc"], "-n"),
        (["-n", "0"], "-n"),
        (["-nope"], "-nope"),
        (["-concurrency", "many"], "-concurrency"),
        (["-delay-ms", "-5"], "-delay-ms"),
        (["-fail=maybe"], "-fail"),
    ],
    ids=["n-abc", "n-0", "nope", "concurrency-many", "delay-negative", "fail-maybe"],
)
def test_producer_bad_flag_is_a_one_line_error_naming_it(
    args: list[str], flag: str, tmp_path: Path
) -> None:
    # Aimed at a port nobody listens on: a bad flag must stop it before it tries anything.
    done = produce(tmp_path, f"http://127.0.0.1:{free_port()}", *args, timeout=30)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert_no_traceback(done.stderr)
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("wq-producer: "), line
    assert re.search(rf"(^|[\s:/'\"]){re.escape(flag)}($|[\s:/'\"=,])", line), line


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_producer_without_a_broker_is_a_one_line_error(transport: str, tmp_path: Path) -> None:
    # It gives up rather than retrying for ever (produce() fails if it is still going at 30 s).
    done = produce(tmp_path, f"{transport}://127.0.0.1:{free_port()}", "-n", "3", timeout=30)
    assert done.returncode != 0, (done.stdout, done.stderr)
    assert_no_traceback(done.stdout + done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("wq-producer:"), errors[0]
    assert "127.0.0.1" in errors[0]
    m = CLOSING_LINE.match(done.stdout.strip())
    assert m, done.stdout
    assert (m["enqueued"], m["failed"]) == ("0", "3"), done.stdout
