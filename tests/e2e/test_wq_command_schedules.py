"""``wq schedules``, ``wq schedule set|get|delete|pause|resume`` and ``wq limits`` against a real
broker (a process, HTTP and gRPC on port 0, the system clock), in table and ``-json`` modes: the
JSON compared with the HTTP API's own answers, the tables read for what they show, a schedule that
fires every second, the exit statuses (0 done, 2 usage, 3 not found) and one-line errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.test_wq_command import get, one_line_error, row, wq, wq_json
from tests.helpers import wait_until_sync
from tests.procs import BrokerProcess, broker_process
from wqclient import Client

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _plain_output(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    for name in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "LINES"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with broker_process() as b:
        yield b


@pytest.fixture(params=["http", "grpc"])
def url(request: pytest.FixtureRequest, broker: BrokerProcess) -> str:
    return broker.url if request.param == "http" else broker.grpc_url


@pytest.fixture
def api(broker: BrokerProcess) -> Iterator[Client]:
    with Client(broker.url) as client:
        yield client


def field(table: str, label: str) -> str:
    """The value a field table shows for ``label``."""
    for line in table.splitlines():
        if line.startswith(f" {label}  "):
            return " ".join(line[len(label) + 1 :].split())
    raise AssertionError(f"no field {label!r} in:\n{table}")


def test_schedule_set_get_and_list(url: str, broker: BrokerProcess) -> None:
    name = f"nightly-{url[:4]}"
    view = wq_json(
        url,
        "schedule",
        "set",
        name,
        "-cron",
        "0 2 * * *",
        "-timezone",
        "Europe/Paris",
        "-payload",
        '{"report": "daily"}',
        "-queue",
        "reports",
        "-priority",
        "5",
        "-max-attempts",
        "2",
        "-expires-in-ms",
        "3600000",
    )
    status, stored = get(broker, f"/schedules/{name}")
    assert (status, view) == (200, stored)
    assert (view["cron"], view["timezone"], view["every_ms"]) == ("0 2 * * *", "Europe/Paris", None)
    assert (view["payload"], view["queue"], view["priority"]) == ({"report": "daily"}, "reports", 5)
    assert (view["max_attempts"], view["expires_in_ms"], view["fires"]) == (2, 3600000, 0)
    assert view["next_fire_at"] is not None
    assert wq_json(url, "schedule", "get", name) == stored
    listed = wq_json(url, "schedules")
    assert listed == get(broker, "/schedules")[1]
    assert name in [s["name"] for s in listed["schedules"]]

    code, table, err = wq("schedules", "-broker", url)
    assert (code, err) == (0, "")
    assert table.splitlines()[0].startswith("schedules: ")
    cells = row(table, name)
    assert cells[1:7] == ["0", "2", "*", "*", "*", "Europe/Paris"]
    assert cells[7] == "reports"
    assert cells[-2:] == ["0", "active"]
    code, table, _ = wq("schedule", "get", name, "-broker", url)
    assert code == 0
    assert field(table, "rule") == "0 2 * * *"
    assert field(table, "timezone") == "Europe/Paris"
    assert field(table, "next fire") == stored["next_fire_at"]
    assert field(table, "queue") == "reports"
    assert field(table, "expires in") == "3,600,000 ms"

    code, out, err = wq("schedule", "set", name, "-every", "90s", "-payload", "1", "-broker", url)
    assert (code, err) == (0, "")
    replaced = get(broker, f"/schedules/{name}")[1]
    assert out == f"schedule {name} set (every 90s): next fire {replaced['next_fire_at']}\n"
    assert (replaced["every_ms"], replaced["cron"], replaced["timezone"]) == (90000, None, None)
    assert replaced["created_at"] == stored["created_at"]
    wq("schedule", "delete", name, "-broker", url)


def test_a_schedule_fires_every_second(url: str, broker: BrokerProcess, api: Client) -> None:
    name = f"tick-{url[:4]}"
    queue = f"ticks-{url[:4]}"
    code, _, err = wq(
        "schedule", "set", name, "-every", "1s", "-payload", '{"tick": 1}', "-queue", queue,
        "-broker", url,
    )  # fmt: skip
    assert (code, err) == (0, "")
    schedule = wait_until_sync(
        lambda: wq_json(url, "schedule", "get", name),
        lambda s: s["fires"] >= 1,
        what="the first fire",
    )
    task_id = schedule["last_task_id"]
    view = wq_json(url, "task", task_id)
    assert view == get(broker, f"/jobs/{task_id}")[1]
    assert (view["schedule"], view["scheduled_for"]) == (name, schedule["last_fire_at"])
    assert view["queue"] == queue
    code, table, _ = wq("task", task_id, "-broker", url)
    assert field(table, "schedule") == name
    assert field(table, "scheduled for") == schedule["last_fire_at"]

    code, out, err = wq("schedule", "pause", name, "-broker", url)
    assert (code, out, err) == (0, f"paused schedule {name}: no fires until it is resumed\n", "")
    paused = wq_json(url, "schedule", "get", name)
    assert (paused["paused"], paused["next_fire_at"]) == (True, None)
    resumed = wq_json(url, "schedule", "resume", name)
    assert resumed == get(broker, f"/schedules/{name}")[1]
    assert (resumed["paused"], resumed["fires"] >= schedule["fires"]) == (False, True)
    assert resumed["next_fire_at"] is not None
    assert wq_json(url, "schedule", "delete", name) == {"schedule": name, "deleted": True}
    assert get(broker, f"/schedules/{name}")[0] == 404
    assert api.get_task(task_id).schedule == name  # (the tasks it fired stay)


def test_schedule_errors(url: str, broker: BrokerProcess) -> None:
    for action in ("get", "delete", "pause", "resume"):
        code, out, err = wq("schedule", action, "never-was", "-broker", url)
        assert (code, out) == (3, ""), action
        assert "never-was" in one_line_error(err)
    code, out, err = wq(
        "schedule", "set", "bad", "-cron", "61 * * * *", "-payload", "1", "-broker", url
    )
    assert (code, out) == (2, "")
    assert "cron" in one_line_error(err)
    code, out, err = wq(
        "schedule", "set", "bad", "-cron", "@daily", "-timezone", "Nowhere/Special",
        "-payload", "1", "-broker", url,
    )  # fmt: skip
    assert (code, out) == (2, "")
    assert "timezone" in one_line_error(err)
    code, out, err = wq(
        "schedule", "set", "bad", "-every", "500ms", "-payload", "1", "-broker", url
    )
    assert (code, out) == (2, "")
    assert "every_ms" in one_line_error(err)
    assert get(broker, "/schedules/bad")[0] == 404


def test_limits_set_shown_and_cleared(url: str, broker: BrokerProcess, api: Client) -> None:
    queue = f"limited-{url[:4]}"
    api.enqueue(1, queue=queue)
    code, out, err = wq("limits", queue, "-broker", url)
    assert (code, out, err) == (0, f"queue {queue}: no limits\n", "")
    answer = wq_json(url, "limits", queue, "-rate", "20/s", "-concurrency", "4")
    assert answer == {
        "queue": queue,
        "limits": {"rate": {"tasks": 20, "per_ms": 1000, "burst": 20}, "concurrency": 4},
    }
    entry = {q["name"]: q for q in get(broker, "/queues")[1]}[queue]
    assert entry["limits"] == answer["limits"]
    shown = wq_json(url, "limits", queue)
    assert (shown["limits"], shown["handed_out"]) == (answer["limits"], 0)
    assert shown["tokens"] == pytest.approx(20, abs=0.01)
    assert {q["name"]: q for q in wq_json(url, "queues")}[queue]["limits"] == answer["limits"]

    code, table, err = wq("queues", "-broker", url)
    assert (code, err) == (0, "")
    header = table.splitlines()[1].split()
    assert header[-4:] == ["rate", "tokens", "concurrency", "state"]
    cells = row(table, queue)
    assert cells[-4:] == ["20/s", "20", "0/4", "active"]
    code, out, err = wq("limits", queue, "-rate", "100/1m", "-burst", "5", "-broker", url)
    assert (code, out, err) == (0, f"queue {queue}: rate 100/m burst 5\n", "")
    code, out, err = wq("limits", queue, "-clear", "-broker", url)
    assert (code, out, err) == (0, f"queue {queue}: limits cleared\n", "")
    entry = {q["name"]: q for q in get(broker, "/queues")[1]}[queue]
    assert (entry["limits"], entry["tokens"]) == (None, None)

    code, out, err = wq("limits", "no-such-queue-here", "-broker", url)
    assert (code, out) == (3, "")
    one_line_error(err)
    code, out, err = wq("limits", queue, "-rate", "0/s", "-broker", url)
    assert (code, out) == (2, "")
    assert "tasks" in one_line_error(err)
