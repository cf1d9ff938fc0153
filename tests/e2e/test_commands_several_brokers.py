"""The three commands given several brokers in one HTTP URL (``-broker http://a:port,b:port``), as
a user runs them against broker processes: ``wq-producer`` spreads its tasks over them, and goes
on past one that is down, as do ``wq-worker`` and ``wq``; a URL with a host missing is a one-line
error and exit status 2 from each.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_until_sync
from tests.procs import (
    BrokerProcess,
    broker_process,
    env,
    free_port,
    producer_command,
    worker_command,
)

pytestmark = pytest.mark.timeout(60)

ADMIN = [sys.executable, "-m", "wqclient.cli.admin"]


def host(broker: BrokerProcess) -> str:
    return broker.url.removeprefix("http://")


def stats(broker: BrokerProcess) -> Any:
    with urllib.request.urlopen(broker.url + "/stats", timeout=10) as resp:
        return json.loads(resp.read())


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def brokers() -> Iterator[tuple[BrokerProcess, BrokerProcess]]:
    with broker_process("-grpc-addr", "off") as a, broker_process("-grpc-addr", "off") as b:
        yield a, b


def test_wq_producer_spreads_its_tasks_over_the_brokers(
    brokers: tuple[BrokerProcess, BrokerProcess], tmp_path: Path
) -> None:
    a, b = brokers
    before = [stats(x)["totals"]["enqueued"] for x in brokers]
    done = run(producer_command("-broker", f"http://{host(a)},{host(b)}", "-n", "10"), tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("enqueued 10, failed 0"), done.stdout
    assert done.stderr == ""
    after = [stats(x)["totals"]["enqueued"] for x in brokers]
    assert [n - m for n, m in zip(after, before, strict=True)] == [5, 5]


def test_the_commands_go_on_past_a_broker_that_is_down(tmp_path: Path) -> None:
    down = f"127.0.0.1:{free_port()}"
    with broker_process("-grpc-addr", "off") as live:
        url = f"http://{down},{host(live)}"
        produced = run(producer_command("-broker", url, "-n", "6"), tmp_path)
        assert produced.returncode == 0, produced.stderr
        assert produced.stdout.startswith("enqueued 6, failed 0"), produced.stdout

        shown = run([*ADMIN, "-broker", url, "-json", "stats"], tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["ready"] == 6

        with open(tmp_path / "worker.err", "wb") as err:
            worker = subprocess.Popen(
                worker_command("-broker", url, "-wait-ms", "200", "-concurrency", "2"),
                cwd=tmp_path,
                env=env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        try:
            wait_until_sync(lambda: stats(live)["totals"]["acked"] == 6, what="6 acks", timeout=30)
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(10) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        assert (tmp_path / "jobs.log").read_text().count("\n") == 6
        said = (tmp_path / "worker.err").read_text()
        assert "broker unavailable" not in said, said
        assert "Traceback" not in said


@pytest.mark.parametrize("command", ["wq-producer", "wq-worker", "wq"])
def test_a_url_with_a_host_missing_is_one_line_and_exit_2(command: str, tmp_path: Path) -> None:
    url = "http://127.0.0.1:1,,127.0.0.1:2"
    cmd = {
        "wq-producer": producer_command("-broker", url),
        "wq-worker": worker_command("-broker", url),
        "wq": [*ADMIN, "-broker", url, "stats"],
    }[command]
    done = run(cmd, tmp_path)
    assert done.returncode == 2, done.stderr
    says = f"{command}: broker URL {url!r}: a host is missing between commas (a:port,b:port)\n"
    assert done.stderr == says
