"""``wq cancel``, ``wq tasks`` and ``wq queue empty|delete`` against a real broker (a process, HTTP
and gRPC on port 0), in table and ``-json`` modes: the JSON compared with the HTTP API's own
answers, the tables read for what they show, the exit statuses (0 done, 1 refused, 2 usage, 3 not
found) and one-line errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.test_wq_command import bury, get, number, one_line_error, row, wq, wq_json
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


def test_cancel(url: str, broker: BrokerProcess, api: Client) -> None:
    queue = f"cancel-{url[:4]}"
    [dead] = bury(api, queue, 1)
    held = api.enqueue("running", queue=queue)
    delivery = api.claim(queues=queue, wait_ms=0)
    assert delivery is not None
    assert delivery.id == held
    ready = api.enqueue("waiting", queue=queue)
    assert wq_json(url, "cancel", ready) == {"id": ready, "state": "cancelled"}
    assert get(broker, f"/jobs/{ready}")[0] == 404
    code, out, err = wq("cancel", held, "-broker", url)
    assert (code, err) == (0, "")
    assert out.startswith(f"{held} is cancelling")
    status, view = get(broker, f"/jobs/{held}")
    assert (status, view["state"], view["cancelling"]) == (200, "handed_out", True)
    code, out, err = wq("cancel", dead, "-broker", url)
    assert (code, out, err) == (0, f"purged {dead} (it was in the dead-letter queue)\n", "")
    code, out, err = wq("cancel", ready, "-broker", url)
    assert (code, out) == (3, "")
    assert ready in one_line_error(err)
    api.nack(delivery)
    totals = get(broker, f"/stats?queue={queue}")[1]["totals"]
    assert (totals["cancelled"], totals["purged"]) == (2, 1)


def test_tasks_in_both_modes(url: str, broker: BrokerProcess, api: Client) -> None:
    queue = f"tasks-{url[:4]}"
    ids = [api.enqueue({"n": n}, queue=queue, priority=n % 2) for n in range(5)]
    first = wq_json(url, "tasks", queue, "-limit", "2")
    status, page = get(broker, f"/jobs?queue={queue}&limit=2")
    assert status == 200
    assert first == page
    assert first["next_cursor"] is not None
    every = wq_json(url, "tasks", queue, "-all", "-limit", "2")
    assert every["next_cursor"] is None
    claim_order = [ids[1], ids[3], ids[0], ids[2], ids[4]]  # priority 1 first, then oldest
    assert [t["id"] for t in every["tasks"]] == claim_order
    following = wq_json(url, "tasks", queue, "-limit", "2", "-cursor", first["next_cursor"])
    assert [t["id"] for t in following["tasks"]] == claim_order[2:4]

    code, table, err = wq("tasks", queue, "--limit", "2", "-broker", url)
    assert (code, err) == (0, "")
    title = table.splitlines()[0]
    assert title.startswith(f"ready tasks of queue {queue}: 2 (more: --cursor ")
    assert row(table, ids[1])[1:3] == ["1", "0/3"]
    code, out, _ = wq("tasks", queue, "-state", "dead", "-broker", url)
    assert (code, out) == (0, f"no dead tasks in queue {queue}\n")


def test_tasks_show_a_running_tasks_progress(url: str, broker: BrokerProcess, api: Client) -> None:
    queue = f"progress-{url[:4]}"
    task_id = api.enqueue({"big": "job"}, queue=queue, timeout_ms=600_000)
    delivery = api.claim(queues=queue, wait_ms=0)
    assert delivery is not None
    api.extend(delivery, progress={"pct": 40})
    listed = wq_json(url, "tasks", queue, "-state", "handed_out")
    assert listed == get(broker, f"/jobs?queue={queue}&state=handed_out")[1]
    [view] = listed["tasks"]
    assert (view["id"], view["progress"], view["timeout_ms"]) == (task_id, {"pct": 40}, 600000)
    code, table, _ = wq("tasks", queue, "-state", "handed_out", "-broker", url)
    assert code == 0
    assert 'progress {"pct": 40}' in table
    assert wq_json(url, "task", task_id) == get(broker, f"/jobs/{task_id}")[1]
    api.ack(delivery)


def test_tasks_usage_errors(url: str, broker: BrokerProcess) -> None:
    code, out, err = wq("tasks", "q", "-limit", "5000", "-broker", url)
    assert (code, out) == (2, "")
    assert "limit" in one_line_error(err)
    code, out, err = wq("tasks", "q", "-cursor", "garbage", "-broker", url)
    assert (code, out) == (2, "")
    assert "cursor" in one_line_error(err)


def test_queue_empty_and_delete(url: str, broker: BrokerProcess, api: Client) -> None:
    queue = f"drop-{url[:4]}"
    for n in range(3):
        api.enqueue(n, queue=queue)
    api.enqueue("later", queue=queue, delay_ms=60_000)
    code, out, err = wq("queue", "delete", queue, "-broker", url)
    assert (code, out) == (1, "")  # refused: it holds tasks
    assert queue in one_line_error(err)
    assert wq_json(url, "queue", "empty", queue) == {"queue": queue, "cancelled": 4}
    code, out, err = wq("queue", "delete", queue, "-broker", url)
    assert (code, out, err) == (0, f"deleted queue {queue}\n", "")
    assert queue not in [q["name"] for q in get(broker, "/queues")[1]]
    code, out, err = wq("queue", "delete", queue, "-broker", url, "-json")
    assert (code, out) == (3, "")
    one_line_error(err)
    code, out, err = wq("queue", "empty", queue, "-broker", url)
    assert (code, out) == (3, "")
    one_line_error(err)


def test_stats_show_the_new_totals(url: str, broker: BrokerProcess, api: Client) -> None:
    queue = f"totals-{url[:4]}"
    api.enqueue(1, queue=queue)
    wq_json(url, "queue", "empty", queue)
    assert wq_json(url, "stats", "-queue", queue) == get(broker, f"/stats?queue={queue}")[1]
    code, table, _ = wq("stats", "-queue", queue, "-broker", url)
    assert code == 0
    assert (number(table, "cancelled"), number(table, "expired")) == (1, 0)
