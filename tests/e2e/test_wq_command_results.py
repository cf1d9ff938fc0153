"""``wq result``, ``wq task`` (parents, children, result), ``wq enqueue -after -result-ttl-ms``,
``wq tasks -state waiting|succeeded`` and the gauges of ``wq stats`` and ``wq queues`` against a
real broker (a process, HTTP and gRPC on port 0), in table and ``-json`` modes: the JSON compared
with the HTTP API's own answers, the tables read for what they show, and ``wq result``'s exit
statuses (0 succeeded, 1 dead, cancelled or expired, 3 not found, 6 still pending)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

from tests.e2e.test_wq_command import get, number, one_line_error, row, wq, wq_json
from tests.procs import BrokerProcess, broker_process
from wqclient import Client, EnqueueItem

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


def finish(api: Client, queue: str, result: bytes | None = None) -> str:
    """Claim the next task of ``queue`` and ack it (with ``result``, JSON text, if given)."""
    delivery = api.claim(queues=queue, wait_ms=0)
    assert delivery is not None
    if result is None:
        api.ack(delivery)
    else:
        api.ack(delivery, result=result)
    return delivery.id


def test_result_of_each_ending(url: str, broker: BrokerProcess, api: Client) -> None:
    queue = f"result-{url[:4]}"
    done = api.enqueue("done", queue=queue)
    finish(api, queue, b'{"total": 1.10, "rows": [1, 2]}')
    code, out, err = wq("result", done, "-broker", url)
    assert (code, out, err) == (0, '{"total": 1.10, "rows": [1, 2]}\n', "")  # as kept
    assert wq_json(url, "result", done) == get(broker, f"/jobs/{done}/result")[1]

    dead = api.enqueue("dead", queue=queue, max_attempts=1)
    delivery = api.claim(queues=queue, wait_ms=0)
    assert delivery is not None
    api.nack(delivery, error="the printer is on fire")
    code, out, err = wq("result", dead, "-broker", url)
    assert (code, err) == (1, "")
    assert out == f"task {dead} is dead (attempts 1): the printer is on fire\n"
    code, out, _ = wq("result", dead, "-broker", url, "-json")
    assert code == 1
    assert json.loads(out) == get(broker, f"/jobs/{dead}/result")[1]

    pending = api.enqueue("pending", queue=queue)
    code, out, err = wq("result", pending, "-broker", url)
    assert (code, out, err) == (6, f"task {pending} is still pending\n", "")
    code, out, _ = wq("result", pending, "-broker", url, "-json", "-wait", "50")
    assert (code, json.loads(out)) == (6, {"id": pending, "state": "pending"})

    code, out, err = wq("result", "0123456789abcdef", "-broker", url)
    assert (code, out) == (3, "")
    assert "0123456789abcdef" in one_line_error(err)
    assert wq("result", done, "-wait", "soon", "-broker", url)[0] == 2  # (argparse says why)


def test_result_waits_for_the_end(url: str, api: Client) -> None:
    queue = f"wait-{url[:4]}"
    task_id = api.enqueue("slow", queue=queue)
    cancelled = api.enqueue("doomed", queue=queue)
    answers: dict[str, tuple[int, str, str]] = {}

    def wait(which: str) -> None:
        answers[which] = wq("result", which, "-wait", "20000", "-broker", url)

    waiters = [threading.Thread(target=wait, args=(i,)) for i in (task_id, cancelled)]
    for waiter in waiters:
        waiter.start()
    threading.Event().wait(0.2)  # (the waits are parked at the broker; nothing has ended yet)
    assert answers == {}
    api.cancel(cancelled)
    finish(api, queue, b"[42]")
    for waiter in waiters:
        waiter.join(20)
    assert answers[task_id] == (0, "[42]\n", "")
    assert answers[cancelled] == (1, f"task {cancelled} was cancelled\n", "")


def test_enqueue_after_and_a_task_with_parents_and_children(
    url: str, broker: BrokerProcess, api: Client
) -> None:
    queue = f"graph-{url[:4]}"
    first, second = api.enqueue("first", queue=queue), api.enqueue("second", queue=queue)
    code, out, err = wq(
        "enqueue",
        '"child"',
        "-queue",
        queue,
        "-after",
        f"{first},{second}",
        "-result-ttl-ms",
        "60000",
        "-broker",
        url,
    )
    assert (code, err) == (0, "")
    child = out.strip()
    view = get(broker, f"/jobs/{child}")[1]
    assert (view["state"], view["after"], view["waiting_for"], view["result_ttl_ms"]) == (
        "waiting",
        [first, second],
        2,
        60000,
    )
    assert wq_json(url, "task", child) == view
    code, table, _ = wq("task", child, "-broker", url)
    assert code == 0
    assert row(table, "state")[1] == "waiting"
    assert row(table, "parents")[1] == first
    assert f"{second} (waiting for 2)" in table

    finish(api, queue, b'{"first": true}')
    parent = get(broker, f"/jobs/{first}")[1]
    assert (parent["children"], parent["children_count"]) == ([child], 1)
    assert wq_json(url, "task", first) == parent
    code, table, _ = wq("task", first, "-broker", url)
    assert row(table, "state")[1] == "succeeded"
    assert row(table, "children")[1:] == ["(1)", child]
    assert row(table, "finished")[1:3] == ["at", parent["finished_at"]]
    assert '"first": true' in table

    assert wq("enqueue", "1", "-after", ",", "-broker", url)[0] == 2  # (argparse says why)
    code, _, err = wq("enqueue", "1", "-after", "0123456789abcdef", "-broker", url)
    assert code == 2  # (the broker refuses an unknown parent: a usage error)
    assert "after[0]" in one_line_error(err)


def test_listings_and_gauges_of_waiting_and_succeeded(
    url: str, broker: BrokerProcess, api: Client
) -> None:
    queue = f"gauges-{url[:4]}"
    root, child = api.enqueue_many(
        [EnqueueItem(b'"root"'), EnqueueItem(b'"child"', after=[0])], queue=queue
    )
    page = wq_json(url, "tasks", queue, "-state", "waiting")
    assert page == get(broker, f"/jobs?queue={queue}&state=waiting")[1]
    assert [t["id"] for t in page["tasks"]] == [child]
    finish(api, queue, b"1")
    page = wq_json(url, "tasks", queue, "-state", "succeeded")
    assert [(t["id"], t["result"]) for t in page["tasks"]] == [(root, 1)]
    code, table, _ = wq("tasks", queue, "-state", "succeeded", "-broker", url)
    assert (code, row(table, root)[0]) == (0, root)

    assert wq_json(url, "stats", "-queue", queue) == get(broker, f"/stats?queue={queue}")[1]
    code, table, _ = wq("stats", "-queue", queue, "-broker", url)
    assert (number(table, "waiting"), number(table, "succeeded"), number(table, "ready")) == (
        0,
        1,
        1,
    )
    assert wq_json(url, "queues") == get(broker, "/queues")[1]
    code, table, _ = wq("queues", "-broker", url)
    header = next(line.split() for line in table.splitlines() if line.split()[:1] == ["queue"])
    assert header[-3:] == ["waiting", "succeeded", "state"]
    assert row(table, queue) == [queue, "1", "0", "0", "0", "0", "1", "active"]
