"""Control over every task (docs/design/control.md) over HTTP, against a real broker on port 0:
cancel (``DELETE /jobs/{id}``), listing (``GET /jobs``), emptying and deleting queues, expiry, time
limits, unique keys, progress (``POST /jobs/{id}/extend`` with a body), the new totals, and what a
client that sends none of it sees (nothing new). Each test runs with the fast lane and without it
(``-http-fast-lane=false``): the answers are the same both ways.

The rendering of the new task members, and the error body of a cancelled task, are checked without
a broker at the end.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.helpers import Http, http_broker, http_client
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqbroker.errors import Cancelled, LeaseLost, TimeLimitReached
from wqbroker.http import core
from wqbroker.models import Task, TaskState

pytestmark = pytest.mark.timeout(60)

# The members of a task view a client that sends none of the new options sees: the spec's, and
# the extensions it always had.
PLAIN_TASK = {
    "id",
    "payload",
    "attempts",
    "max_attempts",
    "created_at",
    "available_at",
    "last_error",
    "queue",
    "priority",
}
OLD_TOTALS = {
    "enqueued",
    "delivered",
    "acked",
    "nacked",
    "reclaimed",
    "retried",
    "buried",
    "requeued",
    "purged",
}


@pytest.fixture(params=[True, False], ids=["fast-lane", "aiohttp-only"])
async def broker(clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    async with http_broker(clock=clock, max_body=64 * 1024, http_fast_lane=request.param) as b:
        yield b


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


def ts(text: str) -> float:
    assert text.endswith("Z"), text
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC).timestamp()


async def refused(http: Http, method: str, path: str, status: int, field: str, **kw: Any) -> Any:
    """The call is refused with ``status`` and a JSON error naming ``field``."""
    got, body = await http.request(method, path, **kw)
    assert got == status, body
    assert isinstance(body, dict), body
    assert field in body["error"], body
    return body


async def held(http: Http, queue: str = "default", **fields: Any) -> tuple[str, str]:
    """A task enqueued and claimed: (id, lease_id)."""
    task_id = await http.enqueue({"held": True}, queue=queue, **fields)
    status, delivery = await http.request("GET", f"/jobs/next?wait_ms=0&queue={queue}")
    assert status == 200, delivery
    assert delivery["task"]["id"] == task_id
    return task_id, str(delivery["lease_id"])


async def dead(http: Http, queue: str = "default") -> str:
    task_id, lease_id = await held(http, queue, max_attempts=1)
    assert await http.nack(task_id, lease_id, "no") == 204
    return task_id


async def lookup(http: Http, task_id: str) -> Any:
    status, body = await http.request("GET", f"/jobs/{task_id}")
    assert status == 200, body
    return body


async def totals(http: Http, queue: str | None = None) -> Any:
    status, body = await http.request("GET", "/stats" + (f"?queue={queue}" if queue else ""))
    assert status == 200
    return body["totals"]


def holds(stats: dict[str, Any]) -> bool:
    """The extended invariant: the four gauges add up to what was taken in and not let go."""
    t = stats["totals"]
    gone = t["acked"] + t["purged"] + t["cancelled"] + t["expired"]
    held = stats["ready"] + stats["handed_out"] + stats["delayed"] + stats["dead"]
    return bool(
        held == t["enqueued"] - gone and t["nacked"] + t["reclaimed"] == t["retried"] + t["buried"]
    )


# -- cancel -------------------------------------------------------------------------------------


async def test_a_ready_task_is_cancelled_at_once(http: Http) -> None:
    task_id = await http.enqueue({"n": 1})
    status, body = await http.request("DELETE", f"/jobs/{task_id}")
    assert (status, body) == (204, None)
    assert (await http.request("GET", f"/jobs/{task_id}"))[0] == 404
    assert (await http.request("DELETE", f"/jobs/{task_id}"))[0] == 404  # gone
    stats = await http.stats()
    assert stats["ready"] == 0
    assert stats["totals"]["cancelled"] == 1
    assert holds(stats)
    assert await http.claim() is None


async def test_a_delayed_task_is_cancelled_at_once(http: Http, clock: FakeClock) -> None:
    task_id = await http.enqueue({"n": 1}, delay_ms=60_000)
    assert (await lookup(http, task_id))["state"] == "delayed"
    assert (await http.request("DELETE", f"/jobs/{task_id}"))[0] == 204
    clock.advance(61)
    assert await http.claim() is None
    stats = await http.stats()
    assert (stats["delayed"], stats["totals"]["cancelled"]) == (0, 1)


async def test_a_held_task_becomes_cancelling_and_its_extend_is_refused(http: Http) -> None:
    task_id, lease_id = await held(http)
    status, body = await http.request("DELETE", f"/jobs/{task_id}")
    assert (status, body) == (202, {"state": "cancelling"})
    assert (await http.request("DELETE", f"/jobs/{task_id}")) == (202, {"state": "cancelling"})
    view = await lookup(http, task_id)
    assert view["state"] == "handed_out"
    assert view["cancelling"] is True
    assert "lease_id" not in view
    status, body = await http.request("POST", f"/jobs/{task_id}/extend?lease_id={lease_id}")
    assert status == 409
    assert body["cancelled"] is True
    assert "cancelled" in body["error"]
    assert set(body) == {"error", "cancelled"}
    # Its nack drops it: counted cancelled, neither nacked nor retried.
    assert await http.nack(task_id, lease_id, "stopped") == 204
    assert (await http.request("GET", f"/jobs/{task_id}"))[0] == 404
    stats = await http.stats()
    assert stats["totals"]["cancelled"] == 1
    assert (stats["totals"]["nacked"], stats["totals"]["retried"]) == (0, 0)
    assert holds(stats)


async def test_a_cancelling_task_s_ack_counts_as_usual(http: Http) -> None:
    task_id, lease_id = await held(http)
    assert (await http.request("DELETE", f"/jobs/{task_id}"))[0] == 202
    assert await http.ack(task_id, lease_id) == 204
    t = await totals(http)
    assert (t["acked"], t["cancelled"]) == (1, 0)


async def test_a_cancelling_task_whose_lease_runs_out_is_gone(
    http: Http, broker: Broker, clock: FakeClock
) -> None:
    task_id, _ = await held(http)
    assert (await http.request("DELETE", f"/jobs/{task_id}"))[0] == 202
    clock.advance(31)
    await broker.service.sweep()
    assert (await http.request("GET", f"/jobs/{task_id}"))[0] == 404
    stats = await http.stats()
    assert stats["totals"]["cancelled"] == 1
    assert stats["totals"]["reclaimed"] == 0
    assert holds(stats)


async def test_a_dead_task_is_purged(http: Http) -> None:
    task_id = await dead(http)
    assert (await http.request("DELETE", f"/jobs/{task_id}"))[0] == 204
    stats = await http.stats()
    assert (stats["dead"], stats["totals"]["purged"], stats["totals"]["cancelled"]) == (0, 1, 0)


async def test_cancelling_an_unknown_task_is_404(http: Http) -> None:
    status, body = await http.request("DELETE", "/jobs/0123456789abcdef")
    assert status == 404
    assert "0123456789abcdef" in body["error"]


async def test_cancel_is_no_claim_and_no_batch(http: Http) -> None:
    # (``next``, ``batch`` and ``settle`` are no task ids: those paths take no DELETE.)
    for path in ("/jobs/next", "/jobs/batch", "/jobs/settle"):
        status, body = await http.request("DELETE", path)
        assert status == 405, path
        assert "DELETE" in body["error"]


# -- listing ------------------------------------------------------------------------------------


async def page(http: Http, query: str) -> Any:
    status, body = await http.request("GET", "/jobs?" + query)
    assert status == 200, body
    assert set(body) == {"tasks", "next_cursor"}
    return body


async def test_ready_tasks_are_listed_in_claim_order(http: Http) -> None:
    low = [await http.enqueue(i, queue="l", priority=1) for i in range(3)]
    high = [await http.enqueue(10 + i, queue="l", priority=7) for i in range(2)]
    body = await page(http, "queue=l")
    assert [t["id"] for t in body["tasks"]] == high + low
    assert body["next_cursor"] is None
    first = body["tasks"][0]
    assert set(first) == PLAIN_TASK | {"state"}
    assert (first["state"], first["payload"], first["queue"]) == ("ready", 10, "l")
    # The default: ready tasks of the default queue.
    assert (await page(http, ""))["tasks"] == []
    mine = await http.enqueue("default's")
    assert [t["id"] for t in (await page(http, ""))["tasks"]] == [mine]


async def test_pages_follow_one_another_with_the_cursor(http: Http) -> None:
    ids = [await http.enqueue(i, queue="paged") for i in range(7)]
    seen: list[str] = []
    cursor = ""
    pages = 0
    while True:
        body = await page(http, f"queue=paged&limit=3&cursor={cursor}")
        seen += [t["id"] for t in body["tasks"]]
        pages += 1
        if body["next_cursor"] is None:
            break
        cursor = body["next_cursor"]
        assert isinstance(cursor, str)
        assert cursor
    assert seen == ids
    assert pages == 3
    # A task that stayed is neither repeated nor skipped when others go meanwhile.
    first = await page(http, "queue=paged&limit=2")
    assert [t["id"] for t in first["tasks"]] == ids[:2]
    assert (await http.request("DELETE", f"/jobs/{ids[1]}"))[0] == 204
    assert (await http.request("DELETE", f"/jobs/{ids[2]}"))[0] == 204
    rest = await page(http, f"queue=paged&cursor={first['next_cursor']}")
    assert [t["id"] for t in rest["tasks"]] == ids[3:]


async def test_each_state_is_listed_with_its_state(http: Http, clock: FakeClock) -> None:
    ready = await http.enqueue(1, queue="s")
    later = await http.enqueue(2, queue="s", delay_ms=60_000)
    sooner = await http.enqueue(3, queue="s", delay_ms=30_000)
    out, _ = await held(http, "s2")
    buried = await dead(http, "s3")
    assert [t["id"] for t in (await page(http, "queue=s&state=ready"))["tasks"]] == [ready]
    delayed = (await page(http, "queue=s&state=delayed"))["tasks"]
    assert [t["id"] for t in delayed] == [sooner, later]  # by due time
    assert {t["state"] for t in delayed} == {"delayed"}
    handed = (await page(http, "queue=s2&state=handed_out"))["tasks"]
    assert [(t["id"], t["state"]) for t in handed] == [(out, "handed_out")]
    assert all("lease_id" not in t for t in handed)
    graves = (await page(http, "queue=s3&state=dead"))["tasks"]
    assert [(t["id"], t["state"]) for t in graves] == [(buried, "dead")]
    assert graves[0]["last_error"] == "no"


async def test_an_unknown_queue_lists_nothing(http: Http) -> None:
    assert await page(http, "queue=never-seen") == {"tasks": [], "next_cursor": None}


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("state=gone", "state"),
        ("state=READY", "state"),
        ("state=ready&state=dead", "state"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=-1", "limit"),
        ("limit=ten", "limit"),
        ("limit=1.5", "limit"),
        ("limit=" + "9" * 40, "limit"),
        ("queue=no%20spaces", "queue"),
        ("queue=" + "q" * 65, "queue"),
        ("queue=a&queue=b", "queue"),
        ("cursor=not-a-cursor", "cursor"),
        ("cursor=%FF%FE", "cursor"),
        ("cursor=" + "A" * 300, "cursor"),
        ("cursor=W10", "cursor"),  # [] as base64: no state, no key
        ("cursor=WyJyZWFkeSIsInEiXQ", "cursor"),  # ["ready","q"]: not numbers
    ],
)
async def test_a_bad_listing_parameter_is_a_400_naming_it(
    http: Http, query: str, field: str
) -> None:
    await refused(http, "GET", "/jobs?" + query, 400, field)


async def test_a_cursor_goes_with_its_state(http: Http) -> None:
    for i in range(3):
        await http.enqueue(i, queue="c")
    cursor = (await page(http, "queue=c&limit=1"))["next_cursor"]
    body = await refused(http, "GET", f"/jobs?queue=c&state=delayed&cursor={cursor}", 400, "cursor")
    assert "ready" in body["error"]


async def test_head_on_the_listing_answers_as_get(http: Http) -> None:
    await http.enqueue(1)
    async with http.session.head(http.base + "/jobs") as resp:
        assert resp.status == 200
        assert await resp.read() == b""


# -- emptying and deleting a queue ----------------------------------------------------------------


async def test_emptying_a_queue_cancels_its_ready_and_delayed_tasks(http: Http) -> None:
    out, lease = await held(http, "e")
    for i in range(3):
        await http.enqueue(i, queue="e")
    await http.enqueue("later", queue="e", delay_ms=60_000)
    other = await http.enqueue("elsewhere", queue="f")
    status, body = await http.request("POST", "/queues/e/empty")
    assert (status, body) == (200, {"cancelled": 4})
    listed = (await page(http, "queue=e&state=handed_out"))["tasks"]
    assert [t["id"] for t in listed] == [out]
    assert "cancelling" not in listed[0]  # handed-out tasks run their course
    assert await http.ack(out, lease) == 204
    assert (await lookup(http, other))["state"] == "ready"
    assert (await totals(http, "e"))["cancelled"] == 4
    assert (await http.request("POST", "/queues/e/empty")) == (200, {"cancelled": 0})
    assert holds(await http.stats())


async def test_emptying_an_unknown_queue_is_404(http: Http) -> None:
    await refused(http, "POST", "/queues/never-seen/empty", 404, "never-seen")
    await refused(http, "POST", "/queues/bad%20name/empty", 400, "queue")


async def test_a_queue_is_deleted_once_it_holds_nothing(http: Http) -> None:
    task_id = await http.enqueue(1, queue="d")
    assert (await http.request("POST", "/queues/d/pause"))[0] == 204
    body = await refused(http, "DELETE", "/queues/d", 409, "1")
    assert "ready" in body["error"]
    assert (await http.request("DELETE", f"/jobs/{task_id}"))[0] == 204
    assert (await http.request("DELETE", "/queues/d")) == (204, None)
    queues = (await http.request("GET", "/queues"))[1]
    assert "d" not in [q["name"] for q in queues]
    assert await refused(http, "DELETE", "/queues/d", 404, "d")
    # Made again, new: not paused.
    again = await http.enqueue(2, queue="d")
    row = next(q for q in (await http.request("GET", "/queues"))[1] if q["name"] == "d")
    assert row["paused"] is False
    assert (await http.request("GET", "/jobs/next?wait_ms=0&queue=d"))[1]["task"]["id"] == again


async def test_deleting_a_queue_with_held_or_dead_tasks_is_refused(http: Http) -> None:
    await held(http, "h")
    await refused(http, "DELETE", "/queues/h", 409, "handed")
    await dead(http, "x")
    await refused(http, "DELETE", "/queues/x", 409, "dead")
    await refused(http, "DELETE", "/queues/never-seen", 404, "never-seen")
    await refused(http, "DELETE", "/queues/bad%20name", 400, "queue")


# -- enqueue options ----------------------------------------------------------------------------


async def test_expiry_and_time_limit_are_shown_when_set(http: Http, clock: FakeClock) -> None:
    now = clock.now()
    task_id = await http.enqueue({"n": 1}, expires_in_ms=60_000, timeout_ms=5_000)
    view = await lookup(http, task_id)
    assert set(view) == PLAIN_TASK | {"state", "expires_at", "timeout_ms"}
    assert ts(view["expires_at"]) == pytest.approx(now + 60, abs=1e-6)
    assert view["timeout_ms"] == 5000
    status, delivery = await http.request("GET", "/jobs/next?wait_ms=0&lease_ms=60000")
    assert status == 200
    assert delivery["task"]["timeout_ms"] == 5000
    # The lease is cut to the time limit.
    assert ts(delivery["deadline"]) == pytest.approx(now + 5, abs=1e-3)


async def test_a_task_not_handed_out_in_time_expires(
    http: Http, broker: Broker, clock: FakeClock
) -> None:
    gone = await http.enqueue(1, expires_in_ms=1000)
    kept = await http.enqueue(2)
    clock.advance(1.5)
    status, delivery = await http.request("GET", "/jobs/next?wait_ms=0")
    assert (status, delivery["task"]["id"]) == (200, kept)
    assert (await http.request("GET", f"/jobs/{gone}"))[0] == 404
    stats = await http.stats()
    assert stats["totals"]["expired"] == 1
    assert holds(stats)


async def test_a_lease_is_not_extended_past_the_time_limit(http: Http, clock: FakeClock) -> None:
    task_id = await http.enqueue(1, timeout_ms=2000)
    status, delivery = await http.request("GET", "/jobs/next?wait_ms=0&lease_ms=1000")
    lease = delivery["lease_id"]
    path = f"/jobs/{task_id}/extend?lease_id={lease}&lease_ms=60000"
    status, body = await http.request("POST", path)
    assert status == 200, body
    assert ts(body["deadline"]) == pytest.approx(ts(delivery["deadline"]) + 1, abs=1e-3)
    status, body = await http.request("POST", path)
    assert status == 409
    assert "time limit" in body["error"]
    assert "cancelled" not in body


@pytest.mark.parametrize("field", ["expires_in_ms", "timeout_ms"])
@pytest.mark.parametrize("value", [0, -1, 31_536_000_001, "1000", 1.5, True, [1], 10**30])
async def test_bad_durations_are_a_400_naming_them(http: Http, field: str, value: Any) -> None:
    await refused(http, "POST", "/jobs", 400, field, json={"payload": 1, field: value})
    body = {"tasks": [{"payload": 1}, {"payload": 2, field: value}]}
    error = await refused(http, "POST", "/jobs/batch", 400, f"tasks[1].{field}", json=body)
    assert error
    assert (await http.stats())["ready"] == 0


@pytest.mark.parametrize("field", ["expires_in_ms", "timeout_ms"])
async def test_durations_at_their_bounds_are_taken(http: Http, field: str) -> None:
    for value in (1, 31_536_000_000, None):
        status, _ = await http.request("POST", "/jobs", json={"payload": 1, field: value})
        assert status == 201, value


async def test_a_unique_key_holds_while_its_task_lives(http: Http) -> None:
    key = {"Idempotency-Key": "order-1"}
    body = {"payload": 1, "unique": True}
    status, first = await http.request("POST", "/jobs", json=body, headers=key)
    assert status == 201
    status, again = await http.request("POST", "/jobs", json=body, headers=key)
    assert (status, again) == (200, {"id": first["id"], "duplicate": True})
    delivery = await http.claim()
    assert (await http.request("POST", "/jobs", json=body, headers=key))[0] == 200
    assert await http.ack(delivery["task"]["id"], delivery["lease_id"]) == 204
    status, new = await http.request("POST", "/jobs", json=body, headers=key)
    assert status == 201
    assert new["id"] != first["id"]
    # Cancelled: the key is free again.
    assert (await http.request("DELETE", f"/jobs/{new['id']}"))[0] == 204
    assert (await http.request("POST", "/jobs", json=body, headers=key))[0] == 201


async def test_unique_in_a_batch_takes_the_member_key(http: Http) -> None:
    tasks = [
        {"payload": 1, "unique": True, "idempotency_key": "u"},
        {"payload": 2, "unique": True, "idempotency_key": "u"},
        {"payload": 3, "unique": False, "idempotency_key": "v"},
    ]
    status, body = await http.request("POST", "/jobs/batch", json={"tasks": tasks})
    assert status == 201, body
    assert body["duplicates"] == [False, True, False]
    assert body["ids"][0] == body["ids"][1]


@pytest.mark.parametrize("value", ["yes", 1, 0, "", [], {}])
async def test_unique_must_be_a_boolean(http: Http, value: Any) -> None:
    await refused(
        http,
        "POST",
        "/jobs",
        400,
        "unique",
        json={"payload": 1, "unique": value},
        headers={"Idempotency-Key": "k"},
    )


async def test_unique_without_a_key_is_refused(http: Http) -> None:
    await refused(http, "POST", "/jobs", 400, "unique", json={"payload": 1, "unique": True})
    tasks = [{"payload": 1, "unique": True}]
    await refused(http, "POST", "/jobs/batch", 400, "tasks[0].unique", json={"tasks": tasks})
    # false or null without a key: as if absent.
    for value in (False, None):
        status, _ = await http.request("POST", "/jobs", json={"payload": 1, "unique": value})
        assert status == 201


# -- progress -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "progress",
    [
        b'{"done": 40, "of": 100}',
        b'  "step 2 of 3"',
        b"1.10",
        b"[1, 2.0, 3e5]",
        '{"é": "日本"}'.encode(),
        b"12345678901234567890123456789012345678901234567890",
    ],
)
async def test_progress_is_recorded_byte_for_byte(http: Http, progress: bytes) -> None:
    task_id, lease_id = await held(http)
    body = b'{"progress": ' + progress + b', "ignored": true}'
    status, answer = await http.request(
        "POST", f"/jobs/{task_id}/extend?lease_id={lease_id}", data=body
    )
    assert status == 200, answer
    assert set(answer) == {"deadline"}
    async with http.session.get(f"{http.base}/jobs/{task_id}") as resp:
        raw = await resp.read()
    assert b'"progress":' + progress.strip() + b',"state":' in raw
    view = json.loads(raw)
    assert view["progress"] == json.loads(progress)
    listed = (await page(http, "state=handed_out"))["tasks"]
    assert listed[0]["progress"] == json.loads(progress)


async def test_progress_is_replaced_and_gone_once_the_task_leaves_handed_out(http: Http) -> None:
    task_id, lease_id = await held(http, max_attempts=2)
    path = f"/jobs/{task_id}/extend?lease_id={lease_id}"
    for n in (1, 2):
        assert (await http.request("POST", path, json={"progress": n}))[0] == 200
    assert (await lookup(http, task_id))["progress"] == 2
    # An extend without a body, or with null, leaves it as it is.
    assert (await http.request("POST", path))[0] == 200
    assert (await http.request("POST", path, json={"progress": None}))[0] == 200
    assert (await http.request("POST", path, data=b"  "))[0] == 200
    assert (await lookup(http, task_id))["progress"] == 2
    assert await http.nack(task_id, lease_id, "again") == 204
    assert "progress" not in await lookup(http, task_id)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"progress": ', "request body"),
        (b"[1]", "request body"),
        (b'"progress"', "request body"),
        (b'{"progress": NaN}', "request body"),
        (b'{"progress": "\xff"}', "request body"),
        (b'{"progress": "' + b"x" * 4095 + b'"}', "progress"),
    ],
)
async def test_bad_progress_is_a_400(http: Http, body: bytes, field: str) -> None:
    task_id, lease_id = await held(http)
    path = f"/jobs/{task_id}/extend?lease_id={lease_id}"
    await refused(http, "POST", path, 400, field, data=body)
    assert "progress" not in await lookup(http, task_id)


async def test_progress_of_4096_bytes_is_taken(http: Http) -> None:
    task_id, lease_id = await held(http)
    value = b'"' + b"x" * 4094 + b'"'
    body = b'{"progress":' + value + b"}"
    status, _ = await http.request("POST", f"/jobs/{task_id}/extend?lease_id={lease_id}", data=body)
    assert status == 200
    assert (await lookup(http, task_id))["progress"] == "x" * 4094


async def test_progress_of_a_task_held_by_someone_else_is_refused(http: Http) -> None:
    task_id, _ = await held(http)
    path = f"/jobs/{task_id}/extend?lease_id=not-the-lease"
    status, body = await http.request("POST", path, json={"progress": 1})
    assert status == 409
    assert "cancelled" not in body
    assert "progress" not in await lookup(http, task_id)


# -- a client that sends none of it --------------------------------------------------------------


async def test_a_client_that_sends_none_of_it_sees_nothing_new(http: Http) -> None:
    task_id = await http.enqueue({"n": 1})
    assert set(await lookup(http, task_id)) == PLAIN_TASK | {"state"}
    status, delivery = await http.request("GET", "/jobs/next?wait_ms=0")
    assert set(delivery["task"]) == PLAIN_TASK
    lease = delivery["lease_id"]
    assert set(await lookup(http, task_id)) == PLAIN_TASK | {"state"}
    status, body = await http.request("POST", f"/jobs/{task_id}/extend?lease_id={lease}")
    assert (status, set(body)) == (200, {"deadline"})
    assert set(await lookup(http, task_id)) == PLAIN_TASK | {"state"}
    # The totals gain two members (the one change docs/design/control.md allows), zero here.
    t = await totals(http)
    assert set(t) == OLD_TOTALS | {"cancelled", "expired"}
    assert (t["cancelled"], t["expired"]) == (0, 0)
    assert set(await totals(http, "default")) == OLD_TOTALS | {"cancelled", "expired"}


# -- rendering, without a broker ---------------------------------------------------------------


def _task(**extra: Any) -> Task:
    return Task("0123456789abcdef", b'{"a":1}', 1, 3, 1_700_000_000.0, 1_700_000_000.0, **extra)


def test_a_plain_task_renders_as_it_always_did() -> None:
    assert core.render_task(_task()) == (
        b'{"id":"0123456789abcdef","payload":{"a":1},"attempts":1,"max_attempts":3,'
        b'"created_at":"2023-11-14T22:13:20.000000Z","available_at":"2023-11-14T22:13:20.000000Z",'
        b'"last_error":null,"queue":"default","priority":0}'
    )


def test_the_new_members_render_only_when_set_and_in_order() -> None:
    task = _task(expires_at=1_700_000_060.5, timeout=2.5, progress=b' {"p": 1.10}', cancelling=True)
    raw = core.render_task(task)
    assert raw.endswith(
        b'"priority":0,"expires_at":"2023-11-14T22:14:20.500000Z","timeout_ms":2500,'
        b'"progress": {"p": 1.10},"cancelling":true}'
    )
    state = core.render_task_state(TaskState(task, "handed_out"))
    assert json.loads(state)["state"] == "handed_out"
    assert json.loads(state)["cancelling"] is True
    for only in ({"timeout": 0.001}, {"progress": b"null"}, {"cancelling": True}):
        view = json.loads(core.render_task(_task(**only)))
        assert len(set(view) - PLAIN_TASK) == 1, only


def test_a_page_renders_its_cursor_or_null() -> None:
    found = [TaskState(_task(), "ready")]
    assert json.loads(core.render_page(found, "abc"))["next_cursor"] == "abc"
    assert json.loads(core.render_page([], None)) == {"tasks": [], "next_cursor": None}


def test_only_a_cancelled_task_s_refusal_says_cancelled() -> None:
    assert json.loads(core.render_error(Cancelled("task x was cancelled"))) == {
        "error": "task x was cancelled",
        "cancelled": True,
    }
    for error in (LeaseLost("held elsewhere"), TimeLimitReached("at its limit")):
        assert json.loads(core.render_error(error)) == {"error": error.message}
        assert core.error_parts(error)[0] == 409
    assert core.error_parts(Cancelled("x"))[0] == 409
