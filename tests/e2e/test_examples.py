"""examples/shop, run as its README says: the broker with ``-schedule-file schedules.toml``,
``wq worker tasks:app`` and ``wq worker -queues archive -exec ./archive_order.sh`` from the
example's directory, then ``python producer.py``; ``$WQ_BROKER`` names the broker (on free ports,
over HTTP and over gRPC). The example is copied to a scratch directory first, so the files its
shell handler writes never land in the repository.

Checked end to end: what the producer prints (an async and a sync task's results, a chain's, a
chord's, a task retried then charged, one failed for good, the shell handler's result); the
schedule's fire, run by the Python worker; the dead-letter queue holding the failed tasks with
their errors; bad input at the example's calls (arguments that do not fit a task, an unknown SKU,
a payload the shell handler cannot use).
"""

from __future__ import annotations

import ast
import json
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_until_sync
from tests.procs import ROOT, BrokerProcess, broker_process, env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SHOP = ROOT / "examples" / "shop"
WQ = str(Path(sys.executable).with_name("wq"))  # the installed command, as the README runs it


# -- the broker's HTTP API, as a user's curl would see it ------------------------------------------


def call(broker: BrokerProcess, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(broker.url + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=40) as resp:
            text = resp.read()
            return resp.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        text = e.read()
        return e.code, json.loads(text) if text else None


def get(broker: BrokerProcess, path: str) -> Any:
    status, body = call(broker, "GET", path)
    assert status == 200, (path, status, body)
    return body


def outcome(broker: BrokerProcess, task_id: str) -> dict[str, Any]:
    """How the task ended (the result wait), once it has."""
    found: dict[str, Any] = wait_until_sync(
        lambda: call(broker, "GET", f"/jobs/{task_id}/result?wait_ms=2000"),
        lambda answer: answer[0] == 200,
        what=f"task {task_id} to end",
        timeout=30,
    )[1]
    return found


def enqueue(broker: BrokerProcess, payload: Any, queue: str) -> str:
    status, body = call(broker, "POST", "/jobs", {"payload": payload, "queue": queue})
    assert status == 201, body
    task_id: str = body["id"]
    return task_id


# -- the example's processes ----------------------------------------------------------------------


@pytest.fixture
def shop(tmp_path: Path) -> Path:
    where = tmp_path / "shop"
    shutil.copytree(SHOP, where, ignore=shutil.ignore_patterns("__pycache__", "archive"))
    return where


class Running:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc, self.log_path = proc, log

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def running(cmd: list[str], cwd: Path, child_env: dict[str, str]) -> Iterator[Running]:
    """A worker command started in the example's directory; stopped with SIGTERM at the end,
    which must end it cleanly."""
    log = cwd / f"{Path(cmd[0]).name}-{len(list(cwd.glob('*.log')))}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=child_env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    worker = Running(proc, log)
    try:
        yield worker
        assert proc.poll() is None, f"{cmd} exited early:\n{worker.log}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0, worker.log
        assert "Traceback" not in worker.log, worker.log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def python(cwd: Path, child_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=child_env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=90,
    )


def printed(stdout: str) -> dict[str, str]:
    """The producer's lines, ``what: value``, by what."""
    return dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)


# -- the example, end to end ---------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_the_shop_runs_with_its_documented_commands(shop: Path, transport: str) -> None:
    with broker_process("-schedule-file", str(shop / "schedules.toml")) as broker:
        child_env = dict(env(), WQ_BROKER=broker.url if transport == "http" else broker.grpc_url)
        with (
            running([WQ, "worker", "tasks:app"], shop, child_env) as py_worker,
            running(
                [WQ, "worker", "-queues", "archive", "-exec", "./archive_order.sh"],
                shop,
                child_env,
            ) as sh_worker,
        ):
            done = python(shop, child_env, "producer.py")
            assert done.returncode == 0, (done.stdout, done.stderr, py_worker.log, sh_worker.log)
            lines = printed(done.stdout)
            check_the_producers_results(lines, shop)
            check_the_schedule_fires(broker)
            check_bad_input(broker, shop, child_env)
            check_the_dead_letter_queue(broker)


def check_the_producers_results(lines: dict[str, str], shop: Path) -> None:
    assert lines["receipt"] == "receipt for o-1001 sent to ann@example.com"
    assert Decimal(lines["2 mugs"]) == Decimal("25.00")
    order = ast.literal_eval(lines["order o-1002"])
    assert order["order"] == "o-1002"
    assert order["status"] == "shipped"
    assert order["charge"].startswith("ch_")
    assert order["charge"].endswith("_20.00")  # the price, handed on by the chain's first step
    assert Decimal(lines["basket"]) == Decimal("50.00")  # the chord: 25.00 + 20.00 + 4 x 1.25
    assert lines["flaky card"].startswith("ch_")
    assert lines["flaky card"].endswith("_9.99 (attempt 2)")
    assert "card 4000-0000-0000-0002 declined" in lines["declined card"]
    archived = ast.literal_eval(lines["archived"])
    assert archived["attempt"] == 1
    kept = json.loads((shop / archived["archived"]).read_text())
    assert kept == {"task": "archive_order", "kwargs": {"order_id": "o-1002"}}
    assert archived["bytes"] == (shop / archived["archived"]).stat().st_size


def check_the_schedule_fires(broker: BrokerProcess) -> None:
    """Every five seconds the broker fires stock-report; the Python worker runs it and its
    result is kept."""
    schedule = wait_until_sync(
        lambda: get(broker, "/schedules/stock-report"),
        lambda s: s["last_task_id"] is not None,
        what="stock-report to fire",
        timeout=30,
    )
    fired = outcome(broker, schedule["last_task_id"])
    assert fired["state"] == "succeeded", fired
    assert fired["result"] == {"tee": 3}
    task = get(broker, f"/jobs/{schedule['last_task_id']}")
    assert task["schedule"] == "stock-report"
    assert task["payload"] == {"task": "tasks.stock_report"}
    names = [s["name"] for s in get(broker, "/schedules")["schedules"]]
    assert names == ["morning-report", "stock-report"]


def check_bad_input(broker: BrokerProcess, shop: Path, child_env: dict[str, str]) -> None:
    # A task is a plain function too: called, it runs here and now.
    here = python(shop, child_env, "-c", "from tasks import price; print(price('mug', 2))")
    assert here.returncode == 0, here.stderr
    assert here.stdout.strip() == "25.00"

    # Arguments that do not fit the hints are refused at enqueue, and nothing is sent. (The
    # schedules paused first: stock-report would enqueue meanwhile, every five seconds.)
    for name in ("stock-report", "morning-report"):
        status, body = call(broker, "POST", f"/schedules/{name}/pause")
        assert status == 200, (name, status, body)
    before = get(broker, "/stats")["totals"]["enqueued"]
    bad = python(
        shop,
        child_env,
        "-c",
        "from tasks import price\n"
        "try:\n"
        "    price.enqueue_sync('mug', qty='two')\n"
        "except TypeError as e:\n"
        "    print(e)\n",
    )
    assert bad.returncode == 0, bad.stderr
    assert bad.stdout.startswith("task tasks.price: argument 'qty' does not fit"), bad.stdout
    assert get(broker, "/stats")["totals"]["enqueued"] == before

    # An unknown SKU fails for good (give_up_on=(KeyError,)): dead after one attempt.
    unknown = enqueue(broker, {"task": "tasks.price", "args": ["hat", 1]}, "default")
    ended = outcome(broker, unknown)
    assert ended["state"] == "dead", ended
    task = get(broker, f"/jobs/{unknown}")
    assert task["attempts"] == 1
    assert "KeyError" in task["last_error"]
    assert "hat" in task["last_error"]

    # A payload the shell handler cannot use: it exits 100, dead with the handler's stderr.
    useless = enqueue(broker, {"task": "archive_order", "kwargs": {}}, "archive")
    ended = outcome(broker, useless)
    assert ended["state"] == "dead", ended
    task = get(broker, f"/jobs/{useless}")
    assert task["attempts"] == 1
    assert "cannot archive: no order_id" in task["last_error"]
    assert not (shop / "archive" / f"{useless}.json").exists()


def check_the_dead_letter_queue(broker: BrokerProcess) -> None:
    dead = {d["payload"]["task"]: d for d in get(broker, "/dlq")}
    assert set(dead) == {"tasks.charge", "tasks.price", "archive_order"}
    declined = dead["tasks.charge"]
    assert declined["attempts"] == 1  # Fail: no retry
    assert "card 4000-0000-0000-0002 declined" in declined["last_error"]
    assert declined["payload"]["kwargs"] == {"card": "4000-0000-0000-0002"}
