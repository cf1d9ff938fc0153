"""Schedules and per-queue limits over HTTP (docs/design/schedules.md), against a real broker on
port 0 driven by a real aiohttp client: ``PUT|GET|DELETE /schedules/{name}``, ``GET /schedules``,
``POST /schedules/{name}/pause|resume``, ``PUT|DELETE /queues/{name}/limits``; the views and
their times; a fired task's ``schedule`` and ``scheduled_for`` (and nothing new for a task no
schedule enqueued); ``limits`` and ``tokens`` in ``GET /queues``; every refusal naming what was
wrong (never a 5xx); the token rules.

A FakeClock drives the schedules: a fire is the clock moved past its time and a sweep.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.authkit import ALL_BUT, ONLY, ROOT, bearer, write_token_file
from tests.helpers import Http, http_broker, http_client, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock

pytestmark = pytest.mark.timeout(60)

SCHEDULE_KEYS = [
    "name",
    "cron",
    "timezone",
    "every_ms",
    "queue",
    "payload",
    "priority",
    "max_attempts",
    "expires_in_ms",
    "timeout_ms",
    "result_ttl_ms",
    "paused",
    "created_at",
    "updated_at",
    "next_fire_at",
    "last_fire_at",
    "last_task_id",
    "fires",
]
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
TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$")


@pytest.fixture(params=[True, False], ids=["fast-lane", "aiohttp-only"])
async def broker(clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    async with http_broker(clock=clock, max_body=64 * 1024, http_fast_lane=request.param) as b:
        yield b


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


def ts(text: str) -> float:
    assert TIMESTAMP.match(text), text
    return datetime.fromisoformat(text).timestamp()


async def put(http: Http, name: str, body: Any = None, *, data: bytes | None = None) -> Any:
    """PUT /schedules/{name}: 200, the view."""
    status, view = await http.request("PUT", f"/schedules/{name}", json=body, data=data)
    assert status == 200, view
    assert list(view) == SCHEDULE_KEYS, view
    return view


async def get(http: Http, name: str) -> Any:
    status, view = await http.request("GET", f"/schedules/{name}")
    assert status == 200, view
    return view


async def refused(http: Http, method: str, path: str, status: int, *words: str, **kw: Any) -> str:
    """The call is refused with ``status`` and a JSON error naming each of ``words``."""
    got, body = await http.request(method, path, **kw)
    assert got == status, body
    assert isinstance(body, dict), body
    assert list(body) == ["error"], body
    for word in words:
        assert word in body["error"], (word, body)
    return str(body["error"])


async def fire(broker: Broker, http: Http, clock: FakeClock, name: str, seconds: float) -> Any:
    """Move the clock on by ``seconds`` and sweep: the schedule fires (once); its view after."""
    before = (await get(http, name))["fires"]
    clock.advance(seconds)
    await broker.service.sweep()
    return await wait_until(
        lambda: get(http, name), lambda v: v["fires"] > before, what=f"{name} to fire"
    )


# -- putting and reading -----------------------------------------------------------------------


async def test_a_cron_schedule_is_put_and_read_back(http: Http, clock: FakeClock) -> None:
    now = clock.now()  # (1_800_000_000: on a five-minute boundary)
    body = {"cron": "*/5 * * * *", "timezone": "Europe/Paris", "payload": {"n": 1}}
    view = await put(http, "reports", body)
    assert view == {
        "name": "reports",
        "cron": "*/5 * * * *",
        "timezone": "Europe/Paris",
        "every_ms": None,
        "queue": "default",
        "payload": {"n": 1},
        "priority": 0,
        "max_attempts": 3,
        "expires_in_ms": None,
        "timeout_ms": None,
        "result_ttl_ms": None,
        "paused": False,
        "created_at": view["created_at"],
        "updated_at": view["updated_at"],
        "next_fire_at": view["next_fire_at"],
        "last_fire_at": None,
        "last_task_id": None,
        "fires": 0,
    }
    assert ts(view["created_at"]) == ts(view["updated_at"]) == now
    assert ts(view["next_fire_at"]) == now + 300  # strictly after now
    assert await get(http, "reports") == view


async def test_an_interval_schedule_has_no_cron_nor_timezone(http: Http, clock: FakeClock) -> None:
    body = {
        "every_ms": 90_000,
        "payload": None,
        "queue": "ticks",
        "priority": 7,
        "max_attempts": 1,
        "expires_in_ms": 60_000,
        "timeout_ms": 5_000,
        "result_ttl_ms": 0,
    }
    view = await put(http, "tick", body)
    assert (view["cron"], view["timezone"], view["every_ms"]) == (None, None, 90_000)
    assert view["payload"] is None
    assert (view["queue"], view["priority"], view["max_attempts"]) == ("ticks", 7, 1)
    assert (view["expires_in_ms"], view["timeout_ms"], view["result_ttl_ms"]) == (60_000, 5_000, 0)
    assert ts(view["next_fire_at"]) == clock.now() + 90


async def test_a_macro_is_kept_as_given_and_the_timezone_defaults_to_utc(http: Http) -> None:
    view = await put(http, "hourly", {"cron": "@hourly", "payload": 1})
    assert (view["cron"], view["timezone"]) == ("@hourly", "UTC")


async def test_the_payload_is_kept_byte_for_byte(http: Http) -> None:
    payload = b'{ "a" : [1, 2.50, 1e3, "\\u00e9", "\xc3\xa9"],\n "b": null }'
    await put(http, "bytes", data=b'{"every_ms": 1000, "payload": ' + payload + b"}")
    async with http.session.get(http.base + "/schedules/bytes") as resp:
        raw = await resp.read()
    assert b'"payload":' + payload + b"," in raw
    async with http.session.get(http.base + "/schedules") as resp:
        assert b'"payload":' + payload + b"," in await resp.read()


async def test_null_is_a_payload(http: Http) -> None:
    async with http.session.put(
        http.base + "/schedules/nothing", data=b'{"every_ms": 1000, "payload": null}'
    ) as resp:
        assert resp.status == 200
        assert b'"payload":null,' in await resp.read()


async def test_the_list_is_by_name_and_head_answers_without_a_body(http: Http) -> None:
    assert await http.request("GET", "/schedules") == (200, {"schedules": []})
    for name in ("zeta", "alpha", "mid"):
        await put(http, name, {"every_ms": 1000, "payload": name})
    status, body = await http.request("GET", "/schedules")
    assert status == 200
    assert list(body) == ["schedules"]
    assert [s["name"] for s in body["schedules"]] == ["alpha", "mid", "zeta"]
    assert all(list(s) == SCHEDULE_KEYS for s in body["schedules"])
    for path in ("/schedules", "/schedules/alpha"):
        async with http.session.head(http.base + path) as resp:
            assert resp.status == 200
            assert await resp.read() == b""


async def test_a_replace_keeps_its_history_and_takes_the_new_rule(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    first = await put(http, "job", {"every_ms": 1000, "payload": 1})
    fired = await fire(broker, http, clock, "job", 1.0)
    clock.advance(0.5)
    again = await put(http, "job", {"cron": "@daily", "payload": 2, "queue": "other"})
    assert again["created_at"] == first["created_at"]
    assert ts(again["updated_at"]) == clock.now()
    assert (again["fires"], again["last_task_id"]) == (1, fired["last_task_id"])
    assert again["last_fire_at"] == fired["last_fire_at"]
    assert (again["cron"], again["every_ms"], again["payload"], again["queue"]) == (
        "@daily",
        None,
        2,
        "other",
    )
    assert ts(again["next_fire_at"]) > clock.now()


async def test_delete_forgets_it_and_leaves_its_tasks(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    await put(http, "gone", {"every_ms": 1000, "payload": 1})
    fired = await fire(broker, http, clock, "gone", 1.0)
    assert await http.request("DELETE", "/schedules/gone") == (204, None)
    await refused(http, "GET", "/schedules/gone", 404, "gone")
    await refused(http, "DELETE", "/schedules/gone", 404, "gone")
    assert (await http.request("GET", "/schedules"))[1] == {"schedules": []}
    status, task = await http.request("GET", f"/jobs/{fired['last_task_id']}")
    assert (status, task["schedule"]) == (200, "gone")


@pytest.mark.parametrize("verb", ["pause", "resume"])
async def test_an_unknown_schedule_is_404(http: Http, verb: str) -> None:
    await refused(http, "GET", "/schedules/nosuch", 404, "nosuch")
    await refused(http, "POST", f"/schedules/nosuch/{verb}", 404, "nosuch")


async def test_pause_stops_its_fires_and_resume_counts_from_now(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    await put(http, "p", {"every_ms": 1000, "payload": 1})
    status, paused = await http.request("POST", "/schedules/p/pause")
    assert status == 200
    assert list(paused) == SCHEDULE_KEYS
    assert (paused["paused"], paused["next_fire_at"]) == (True, None)
    assert (await http.request("POST", "/schedules/p/pause"))[1]["paused"] is True  # idempotent
    clock.advance(5.0)
    await broker.service.sweep()
    assert (await get(http, "p"))["fires"] == 0
    status, resumed = await http.request("POST", "/schedules/p/resume")
    assert (status, resumed["paused"]) == (200, False)
    assert ts(resumed["next_fire_at"]) == clock.now() + 1.0
    fired = await fire(broker, http, clock, "p", 1.0)
    assert fired["fires"] == 1


async def test_a_schedule_put_paused_does_not_fire(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    view = await put(http, "held", {"every_ms": 1000, "payload": 1, "paused": True})
    assert (view["paused"], view["next_fire_at"]) == (True, None)
    clock.advance(3.0)
    await broker.service.sweep()
    assert (await get(http, "held"))["fires"] == 0


# -- a fired task ---------------------------------------------------------------------------------


async def test_a_fired_task_carries_its_schedule_and_time_in_every_view(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    plain_id = await http.enqueue({"plain": True}, queue="fired")
    await put(http, "beat", {"every_ms": 1000, "payload": {"beat": 1}, "queue": "fired"})
    fired = await fire(broker, http, clock, "beat", 1.0)
    task_id = fired["last_task_id"]
    assert ts(fired["last_fire_at"]) == clock.now()
    assert ts(fired["next_fire_at"]) == clock.now() + 1.0
    status, found = await http.request("GET", f"/jobs/{task_id}")
    assert status == 200
    assert set(found) == PLAIN_TASK | {"state", "schedule", "scheduled_for"}
    assert (found["schedule"], found["scheduled_for"]) == ("beat", fired["last_fire_at"])
    assert (found["payload"], found["queue"]) == ({"beat": 1}, "fired")
    status, listed = await http.request("GET", "/jobs?queue=fired")
    assert status == 200
    views = {t["id"]: t for t in listed["tasks"]}
    assert views[task_id]["schedule"] == "beat"
    assert "schedule" not in views[plain_id]
    assert "scheduled_for" not in views[plain_id]
    # A claim (the fast lane's, with it on) gives the same members; a plain task has none.
    status, first = await http.request("GET", "/jobs/next?wait_ms=0&queue=fired")
    assert (status, set(first["task"])) == (200, PLAIN_TASK)
    status, second = await http.request("GET", "/jobs/next?wait_ms=0&queue=fired")
    assert status == 200
    assert second["task"]["id"] == task_id
    assert second["task"]["scheduled_for"] == fired["last_fire_at"]
    status, batch = await http.request("GET", "/jobs/next/batch?wait_ms=0&queue=fired&max=5")
    assert status == 204, batch
    lease = second["lease_id"]
    status, _ = await http.request(
        "POST", f"/jobs/{task_id}/nack?lease_id={lease}", json={"terminal": True}
    )
    assert status == 204
    status, dead = await http.request("GET", "/dlq?queue=fired")
    assert [(t["id"], t["schedule"]) for t in dead] == [(task_id, "beat")]


async def test_an_expiring_schedule_counts_its_tasks_expiry_from_the_fire(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    await put(http, "exp", {"every_ms": 2000, "payload": 1, "expires_in_ms": 30_000})
    fired = await fire(broker, http, clock, "exp", 2.0)
    _, task = await http.request("GET", f"/jobs/{fired['last_task_id']}")
    assert ts(task["expires_at"]) == ts(task["scheduled_for"]) + 30


# -- refusals -------------------------------------------------------------------------------------

BAD_SCHEDULES = [
    ({"cron": "61 * * * *", "payload": 1}, "cron"),
    ({"cron": "* * *", "payload": 1}, "cron"),
    ({"cron": "", "payload": 1}, "cron"),
    ({"cron": 5, "payload": 1}, "cron"),
    ({"cron": "@fortnightly", "payload": 1}, "cron"),
    ({"cron": "* * * * *", "timezone": "Mars/Olympus_Mons", "payload": 1}, "timezone"),
    ({"cron": "* * * * *", "timezone": "", "payload": 1}, "timezone"),
    ({"cron": "* * * * *", "timezone": 1, "payload": 1}, "timezone"),
    ({"cron": "* * * * *", "every_ms": 1000, "payload": 1}, "every_ms"),
    ({"payload": 1}, "every_ms"),
    ({"payload": 1, "queue": "q"}, "cron"),
    ({"every_ms": 0, "payload": 1}, "every_ms"),
    ({"every_ms": -1000, "payload": 1}, "every_ms"),
    ({"every_ms": 999, "payload": 1}, "every_ms"),
    ({"every_ms": 31_536_000_001, "payload": 1}, "every_ms"),
    ({"every_ms": 1500.5, "payload": 1}, "every_ms"),
    ({"every_ms": "1000", "payload": 1}, "every_ms"),
    ({"every_ms": True, "payload": 1}, "every_ms"),
    ({"every_ms": 1000, "timezone": "Europe/Paris", "payload": 1}, "timezone"),
    ({"every_ms": 1000}, "payload"),
    ({"every_ms": 1000, "payload": 1, "queue": "no spaces"}, "queue"),
    ({"every_ms": 1000, "payload": 1, "priority": 10}, "priority"),
    ({"every_ms": 1000, "payload": 1, "max_attempts": 0}, "max_attempts"),
    ({"every_ms": 1000, "payload": 1, "expires_in_ms": 0}, "expires_in_ms"),
    ({"every_ms": 1000, "payload": 1, "timeout_ms": -1}, "timeout_ms"),
    ({"every_ms": 1000, "payload": 1, "result_ttl_ms": -1}, "result_ttl_ms"),
    ({"every_ms": 1000, "payload": 1, "paused": "yes"}, "paused"),
]


@pytest.mark.parametrize(("body", "field"), BAD_SCHEDULES, ids=lambda v: str(v)[:60])
async def test_a_bad_schedule_is_400_naming_the_member_and_puts_nothing(
    http: Http, body: dict[str, Any], field: str
) -> None:
    await refused(http, "PUT", "/schedules/bad", 400, field, json=body)
    await refused(http, "GET", "/schedules/bad", 404)


BAD_BODIES = [
    (b"", "empty"),
    (b"{", "not valid JSON"),
    (b'{"every_ms": 1000, "payload": NaN}', "not valid JSON"),
    (b'{"every_ms": 1000, "payload": 1,}', "not valid JSON"),
    (b"[1]", "object"),
    (b'{"every_ms": 1000, "payload": "\xff"}', "UTF-8"),
    (b'{"every_ms": 1' + b"0" * 400 + b', "payload": 1}', "every_ms"),
    (b'{"every_ms": 1e400, "payload": 1}', "every_ms"),
    (b'{"every_ms": 1000, "payload": 1, "max_attempts": 9' + b"9" * 30 + b"}", "max_attempts"),
    (b'{"cron": "\\ud800 * * * *", "payload": 1}', "cron"),
    (b'{"cron": "* * * * *", "timezone": "\\udfff", "payload": 1}', "timezone"),
    (b'{"every_ms": 1000, "payload": ' + b"[" * 20_000 + b"}", "nested too deeply"),
]


@pytest.mark.parametrize(("data", "words"), BAD_BODIES, ids=lambda v: repr(v)[:40])
async def test_a_bad_body_is_400_naming_the_problem_never_5xx(
    http: Http, data: bytes, words: str
) -> None:
    await refused(http, "PUT", "/schedules/bad", 400, words, data=data)


@pytest.mark.parametrize("name", ["a%20b", "x" * 65, "%C3%A9t%C3%A9", "a%00b"])
async def test_a_bad_name_is_400(http: Http, name: str) -> None:
    await refused(http, "PUT", f"/schedules/{name}", 400, json={"every_ms": 1000, "payload": 1})
    for method, path in (
        ("GET", f"/schedules/{name}"),
        ("DELETE", f"/schedules/{name}"),
        ("POST", f"/schedules/{name}/pause"),
    ):
        status, body = await http.request(method, path)
        assert status in (400, 404), (method, path, body)
        assert isinstance(body, dict)
        assert body["error"]


async def test_the_longest_name_and_every_allowed_character_are_accepted(http: Http) -> None:
    for name in ("x" * 64, "Az09_.-"):
        assert (await put(http, name, {"every_ms": 1000, "payload": 1}))["name"] == name


async def test_unknown_members_are_ignored_as_everywhere(http: Http) -> None:
    view = await put(http, "extra", {"every_ms": 1000, "payload": 1, "colour": "blue"})
    assert "colour" not in view


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/schedules"),
        ("DELETE", "/schedules"),
        ("POST", "/schedules/x"),
        ("GET", "/schedules/x/pause"),
        ("GET", "/queues/q/limits"),
        ("POST", "/queues/q/limits"),
    ],
)
async def test_wrong_methods_get_405(http: Http, method: str, path: str) -> None:
    async with http.session.request(method, http.base + path) as resp:
        assert resp.status == 405
        assert resp.headers["Allow"]
        assert "not allowed" in (await resp.json())["error"]


# -- limits ---------------------------------------------------------------------------------------


async def queue_row(http: Http, name: str) -> Any:
    status, rows = await http.request("GET", "/queues")
    assert status == 200
    (row,) = [r for r in rows if r["name"] == name]
    return row


async def test_limits_are_set_shown_and_cleared(http: Http) -> None:
    await http.enqueue(1, queue="slow")
    plain = await queue_row(http, "slow")
    assert (plain["limits"], plain["tokens"]) == (None, None)
    body = {"rate": {"tasks": 20, "per_ms": 1000, "burst": 5}, "concurrency": 4}
    status, answer = await http.request("PUT", "/queues/slow/limits", json=body)
    assert (status, answer) == (200, {"queue": "slow", "limits": body})
    row = await queue_row(http, "slow")
    assert row["limits"] == body
    assert row["tokens"] == 5  # the bucket starts full
    assert list(row)[-2:] == ["limits", "tokens"]
    # burst defaults to tasks; concurrency alone has no tokens.
    status, answer = await http.request(
        "PUT", "/queues/slow/limits", json={"rate": {"tasks": 3, "per_ms": 60_000}}
    )
    assert answer["limits"] == {
        "rate": {"tasks": 3, "per_ms": 60_000, "burst": 3},
        "concurrency": None,
    }
    status, answer = await http.request("PUT", "/queues/slow/limits", json={"concurrency": 2})
    assert answer["limits"] == {"rate": None, "concurrency": 2}
    row = await queue_row(http, "slow")
    assert (row["limits"], row["tokens"]) == ({"rate": None, "concurrency": 2}, None)
    assert await http.request("DELETE", "/queues/slow/limits") == (204, None)
    row = await queue_row(http, "slow")
    assert (row["limits"], row["tokens"]) == (None, None)


async def test_limits_of_nothing_are_none(http: Http) -> None:
    for body in ({}, {"rate": None, "concurrency": None}):
        status, answer = await http.request("PUT", "/queues/none/limits", json=body)
        assert (status, answer) == (200, {"queue": "none", "limits": None})


async def test_limits_on_an_unknown_queue_create_it(http: Http) -> None:
    status, _ = await http.request("PUT", "/queues/fresh/limits", json={"concurrency": 1})
    assert status == 200
    row = await queue_row(http, "fresh")
    assert (row["ready"], row["limits"]) == (0, {"rate": None, "concurrency": 1})


async def test_a_concurrency_limit_holds_back_a_claim(http: Http) -> None:
    for n in range(3):
        await http.enqueue(n, queue="one")
    await http.request("PUT", "/queues/one/limits", json={"concurrency": 1})
    status, _first = await http.request("GET", "/jobs/next?wait_ms=0&queue=one")
    assert status == 200
    assert (await http.request("GET", "/jobs/next?wait_ms=0&queue=one"))[0] == 204
    row = await queue_row(http, "one")
    assert (row["handed_out"], row["ready"]) == (1, 2)


BAD_LIMITS = [
    ({"rate": 5}, "rate"),
    ({"rate": "fast"}, "rate"),
    ({"rate": [1, 2]}, "rate"),
    ({"rate": {"per_ms": 1000}}, "tasks"),
    ({"rate": {"tasks": 1}}, "per_ms"),
    ({"rate": {"tasks": 0, "per_ms": 1000}}, "tasks"),
    ({"rate": {"tasks": 1_000_001, "per_ms": 1000}}, "tasks"),
    ({"rate": {"tasks": 1, "per_ms": 0}}, "per_ms"),
    ({"rate": {"tasks": 1, "per_ms": 86_400_001}}, "per_ms"),
    ({"rate": {"tasks": 1, "per_ms": 1000, "burst": 0}}, "burst"),
    ({"rate": {"tasks": 1, "per_ms": 1000, "burst": 1.5}}, "burst"),
    ({"rate": {"tasks": 1, "per_ms": 1000, "bursts": 2}}, "bursts"),
    ({"rate": {"tasks": "1", "per_ms": 1000}}, "tasks"),
    ({"concurrency": 0}, "concurrency"),
    ({"concurrency": -1}, "concurrency"),
    ({"concurrency": 1_000_001}, "concurrency"),
    ({"concurrency": "2"}, "concurrency"),
    ({"concurrency": True}, "concurrency"),
]


@pytest.mark.parametrize(("body", "field"), BAD_LIMITS, ids=lambda v: str(v)[:60])
async def test_bad_limits_are_400_naming_the_member_and_change_nothing(
    http: Http, body: dict[str, Any], field: str
) -> None:
    await http.request("PUT", "/queues/lim/limits", json={"concurrency": 3})
    await refused(http, "PUT", "/queues/lim/limits", 400, field, json=body)
    assert (await queue_row(http, "lim"))["limits"] == {"rate": None, "concurrency": 3}


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "empty"),
        (b"{", "not valid JSON"),
        (b"null", "object"),
        (b'{"concurrency": 2', "not valid JSON"),
        (b'{"concurrency": "\xff"}', "UTF-8"),
        (b'{"concurrency": 1' + b"0" * 500 + b"}", "concurrency"),
        (b'{"concurrency": 1e999}', "concurrency"),
        (b'{"rate": {"tasks": 1e999, "per_ms": 1}}', "tasks"),
    ],
    ids=lambda v: repr(v)[:40],
)
async def test_a_bad_limits_body_is_400_naming_the_problem(
    http: Http, data: bytes, words: str
) -> None:
    await refused(http, "PUT", "/queues/lim/limits", 400, words, data=data)


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
async def test_limits_of_a_bad_queue_name_are_400(http: Http, method: str) -> None:
    await refused(http, method, "/queues/a%20b/limits", 400, json={"concurrency": 1})


# -- tokens ---------------------------------------------------------------------------------------

ADMIN_CALLS = [
    ("PUT", "/schedules/s", {"every_ms": 1000, "payload": 1}, 200),
    ("POST", "/schedules/s/pause", None, 200),
    ("POST", "/schedules/s/resume", None, 200),
    ("DELETE", "/schedules/s", None, 204),
    ("PUT", "/queues/q/limits", {"concurrency": 2}, 200),
    ("DELETE", "/queues/q/limits", None, 204),
]


async def test_changes_need_admin_and_reads_any_token(tmp_path: Path) -> None:
    token_file = write_token_file(tmp_path)
    async with (
        http_broker(token_file=str(token_file)) as broker,
        aiohttp.ClientSession() as session,
    ):
        http = Http(session, broker.http_url)
        for method, path, body, ok in ADMIN_CALLS:
            for token in (ALL_BUT["admin"], ONLY["produce"], ONLY["consume"]):
                got, answer = await http.request(method, path, json=body, headers=bearer(token))
                assert got == 403, (method, path, token, answer)
                assert "admin" in answer["error"]
            got, answer = await http.request(method, path, json=body)
            assert got == 401, (method, path, answer)
            got, answer = await http.request(method, path, json=body, headers=bearer(ONLY["admin"]))
            assert got == ok, (method, path, answer)
        await http.request(
            "PUT", "/schedules/r", json={"every_ms": 1000, "payload": 1}, headers=bearer(ROOT)
        )
        for path in ("/schedules", "/schedules/r"):
            assert (await http.request("GET", path))[0] == 401
            for token in (ONLY["produce"], ONLY["consume"], ONLY["metrics"]):
                got, answer = await http.request("GET", path, headers=bearer(token))
                assert got == 200, (path, answer)
