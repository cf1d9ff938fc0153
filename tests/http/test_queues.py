"""Queues, priorities, keys and the rest of a task's life over HTTP, against a real server on port 0
and a real aiohttp client: named queues, priorities, pause and resume, lease extension, nack
options, idempotency keys, task lookup and the DLQ's bulk operations. Every route's shapes, status
codes and refusals; the defaults that reproduce the spec (a client that knows only the spec sees the
spec).

A FakeClock drives every deadline, so nothing sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import pytest

from tests.helpers import Http, http_broker, http_client, invariant_holds, settle, wait_until
from tests.rawhttp import exchange, request
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqbroker.limits import MAX_BATCH

pytestmark = pytest.mark.timeout(60)

SPEC_TASK = {"id", "payload", "attempts", "max_attempts", "created_at", "available_at"}
SPEC_TOTALS = [
    "enqueued",
    "delivered",
    "acked",
    "nacked",
    "reclaimed",
    "retried",
    "buried",
    "requeued",
]
QUEUE_ROW = [
    "name",
    "ready",
    "handed_out",
    "delayed",
    "dead",
    "waiting",  # docs/design/results.md
    "succeeded",
    "paused",
    "oldest_ready_at",
    "limits",  # docs/design/schedules.md
    "tokens",
]
# /stats: the spec's gauges in its order, the two of docs/design/results.md, the totals last.
STATS_KEYS = ["ready", "handed_out", "delayed", "dead", "waiting", "succeeded", "totals"]


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[Broker]:
    async with http_broker(clock=clock) as b:
        yield b


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


def ts(text: str) -> float:
    assert text.endswith("Z"), text
    return datetime.fromisoformat(text).timestamp()


async def put(http: Http, payload: Any = 1, key: str | None = None, **fields: Any) -> str:
    """Enqueue a new task (201); its id."""
    headers = {"Idempotency-Key": key} if key is not None else {}
    status, body = await http.request(
        "POST", "/jobs", json={"payload": payload, **fields}, headers=headers
    )
    assert (status, set(body)) == (201, {"id"}), body
    return str(body["id"])


async def take(http: Http, query: str = "", lease_ms: int | None = None) -> Any:
    """Claim at once (``query``: e.g. ``queue=a,b``); the answer's body, or None for 204."""
    params = ["wait_ms=0"] + ([query] if query else [])
    if lease_ms is not None:
        params.append(f"lease_ms={lease_ms}")
    status, body = await http.request("GET", "/jobs/next?" + "&".join(params))
    assert status in (200, 204), body
    return body


async def refused(http: Http, method: str, path: str, field: str, **kw: Any) -> str:
    """The call gets 400 naming ``field``; the error message."""
    status, body = await http.request(method, path, **kw)
    assert status == 400, (status, body)
    assert set(body) == {"error"}
    assert field in body["error"], body
    return str(body["error"])


async def bury(http: Http, queue: str | None = None, payload: Any = 1) -> str:
    """A task of ``queue`` in the DLQ: its id."""
    fields = {"queue": queue} if queue is not None else {}
    task_id = await put(http, payload, max_attempts=1, **fields)
    body = await take(http, f"queue={queue}" if queue else "")
    assert body["task"]["id"] == task_id
    assert await http.nack(task_id, body["lease_id"], "bad") == 204
    return task_id


def gauges(stats: dict[str, Any]) -> tuple[int, int, int, int]:
    return stats["ready"], stats["handed_out"], stats["delayed"], stats["dead"]


# -- the spec's answers are unchanged ----------------------------------------------------------


async def test_a_spec_enqueue_is_201_with_only_an_id_and_lands_in_default(http: Http) -> None:
    status, body = await http.request("POST", "/jobs", json={"payload": {"n": 1}})
    assert status == 201
    assert list(body) == ["id"]
    claimed = await take(http)
    assert list(claimed) == ["task", "lease_id", "deadline"]
    task = claimed["task"]
    assert SPEC_TASK <= set(task)
    assert (task["queue"], task["priority"]) == ("default", 0)


async def test_stats_keeps_the_spec_order_and_adds_its_own_totals_last(http: Http) -> None:
    stats = await http.stats()
    assert list(stats) == STATS_KEYS
    assert list(stats["totals"]) == [*SPEC_TOTALS, "purged", "cancelled", "expired"]


async def test_task_views_gain_queue_and_priority_after_the_spec_members(http: Http) -> None:
    await bury(http, "mail")
    async with http.session.get(http.base + "/dlq") as resp:
        raw = await resp.read()
    # (then, as every later member, only when set: a dead task's burial time)
    assert b',"last_error":"bad","queue":"mail","priority":0,"buried_at":"' in raw, raw
    assert raw.endswith(b'Z"}]'), raw


# -- named queues --------------------------------------------------------------------------------


async def test_a_claim_takes_only_from_the_queues_it_names(http: Http) -> None:
    mail = await put(http, "m", queue="mail")
    default = await put(http, "d")
    assert (await take(http))["task"]["id"] == default  # no queue: default only
    assert await take(http) is None
    got = await take(http, "queue=mail")
    assert got["task"]["id"] == mail
    assert got["task"]["queue"] == "mail"


async def test_queues_listed_are_tried_in_order(http: Http) -> None:
    a = [await put(http, i, queue="a") for i in range(2)]
    b = [await put(http, i, queue="b") for i in range(2)]
    got = [(await take(http, "queue=b,a"))["task"]["id"] for _ in range(4)]
    assert got == b + a  # b first while it has a ready task, however old a's are
    await put(http, "late-a", queue="a")
    late_b = await put(http, "late-b", queue="b")
    assert (await take(http, "queue=b,a"))["task"]["id"] == late_b


async def test_a_parked_poll_is_woken_only_by_a_queue_it_names(http: Http, broker: Broker) -> None:
    poll = asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=20000&queue=x,y"))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    await put(http, "not for it")
    await settle()
    assert not poll.done()
    task_id = await put(http, "for it", queue="y")
    status, body = await asyncio.wait_for(poll, 5)
    assert status == 200
    assert (body["task"]["id"], body["task"]["queue"]) == (task_id, "y")


@pytest.mark.parametrize(
    "queue", ["", "has space", "x" * 65, "slash/ed", "é", "tab\t", 5, True, ["a"], {"a": 1}]
)
async def test_a_bad_queue_name_in_an_enqueue_gets_400(http: Http, queue: object) -> None:
    await refused(http, "POST", "/jobs", "queue", json={"payload": 1, "queue": queue})
    assert (await http.stats())["totals"]["enqueued"] == 0


async def test_the_longest_queue_name_and_every_allowed_character_are_accepted(
    http: Http,
) -> None:
    name = "Az09_.-" + "q" * 57
    assert len(name) == 64
    task_id = await put(http, 1, queue=name)
    got = await take(http, f"queue={name}")
    assert (got["task"]["id"], got["task"]["queue"]) == (task_id, name)


async def test_null_queue_and_priority_take_their_defaults(http: Http) -> None:
    await put(http, 1, queue=None, priority=None)
    task = (await take(http))["task"]
    assert (task["queue"], task["priority"]) == ("default", 0)


@pytest.mark.parametrize(
    "query", ["queue=", "queue=a,,b", "queue=has%20space", "queue=a&queue=b", "queue=" + "x" * 65]
)
async def test_a_bad_queue_list_in_a_claim_gets_400_and_claims_nothing(
    http: Http, query: str
) -> None:
    await put(http, 1)
    await refused(http, "GET", "/jobs/next?wait_ms=0&" + query, "queue")
    assert (await http.stats())["handed_out"] == 0


async def test_more_than_64_queues_in_a_claim_get_400(http: Http) -> None:
    names = ",".join(f"q{i}" for i in range(65))
    await refused(http, "GET", f"/jobs/next?wait_ms=0&queue={names}", "queue")
    sixty_four = ",".join(f"q{i}" for i in range(64))
    assert await take(http, f"queue={sixty_four}") is None


async def test_get_queues_lists_every_queue_by_name_with_its_gauges(http: Http) -> None:
    status, body = await http.request("GET", "/queues")
    assert status == 200
    assert isinstance(body, list)
    await bury(http, "zeta")
    ready_id = await put(http, 1, queue="zeta")
    await put(http, 2, queue="alpha")
    await put(http, 3, queue="alpha", delay_ms=5000)
    await take(http, "queue=alpha")
    status, body = await http.request("GET", "/queues")
    assert status == 200
    rows = {row["name"]: row for row in body}
    assert [row["name"] for row in body] == sorted(rows)
    assert all(list(row) == QUEUE_ROW for row in body)
    assert rows["alpha"] == {
        "name": "alpha",
        "ready": 0,
        "handed_out": 1,
        "delayed": 1,
        "dead": 0,
        "waiting": 0,
        "succeeded": 0,
        "paused": False,
        "oldest_ready_at": None,  # nothing ready
        "limits": None,
        "tokens": None,
    }
    _, ready = await http.request("GET", f"/jobs/{ready_id}")
    assert rows["zeta"] == {
        "name": "zeta",
        "ready": 1,
        "handed_out": 0,
        "delayed": 0,
        "dead": 1,
        "waiting": 0,
        "succeeded": 0,
        "paused": False,
        "oldest_ready_at": ready["available_at"],
        "limits": None,
        "tokens": None,
    }


async def test_stats_of_one_queue_has_the_spec_shape_and_only_its_tasks(http: Http) -> None:
    await put(http, 1, queue="a")
    await put(http, 2, queue="a")
    await put(http, 3, queue="b")
    await take(http, "queue=a")
    status, a = await http.request("GET", "/stats?queue=a")
    assert status == 200
    assert list(a) == STATS_KEYS
    assert list(a["totals"]) == [*SPEC_TOTALS, "purged", "cancelled", "expired"]
    assert gauges(a) == (1, 1, 0, 0)
    assert (a["totals"]["enqueued"], a["totals"]["delivered"]) == (2, 1)
    whole = await http.stats()
    assert gauges(whole) == (2, 1, 0, 0)
    assert whole["totals"]["enqueued"] == 3


async def test_stats_of_a_queue_never_seen_is_all_zeros(http: Http) -> None:
    await put(http, 1)
    status, body = await http.request("GET", "/stats?queue=nobody")
    assert status == 200
    assert gauges(body) == (0, 0, 0, 0)
    assert set(body["totals"].values()) == {0}


@pytest.mark.parametrize("query", ["queue=", "queue=a%20b", "queue=a&queue=b", "queue=a,b"])
async def test_a_bad_queue_in_stats_or_dlq_gets_400(http: Http, query: str) -> None:
    await refused(http, "GET", "/stats?" + query, "queue")
    await refused(http, "GET", "/dlq?" + query, "queue")
    await refused(http, "POST", "/dlq/requeue?" + query, "queue")


# -- priorities ----------------------------------------------------------------------------------


async def test_higher_priority_first_then_oldest_first(http: Http) -> None:
    low = await put(http, "low")  # priority 0
    mid = [await put(http, i, priority=5) for i in range(2)]
    top = await put(http, "top", priority=9)
    got = [(await take(http))["task"] for _ in range(4)]
    assert [t["id"] for t in got] == [top, *mid, low]
    assert [t["priority"] for t in got] == [9, 5, 5, 0]


async def test_queue_order_comes_before_priority(http: Http) -> None:
    b = await put(http, "b", queue="b", priority=9)
    a = await put(http, "a", queue="a", priority=0)
    assert (await take(http, "queue=a,b"))["task"]["id"] == a
    assert (await take(http, "queue=a,b"))["task"]["id"] == b


@pytest.mark.parametrize(
    "priority", [b"10", b"-1", b'"1"', b"true", b"1.5", b"9.0", b"1e400", b"9" * 30, b"[1]"]
)
async def test_a_bad_priority_gets_400(http: Http, priority: bytes) -> None:
    body = b'{"payload": 1, "priority": ' + priority + b"}"
    await refused(http, "POST", "/jobs", "priority", data=body)
    assert (await http.stats())["totals"]["enqueued"] == 0


# -- pause and resume ------------------------------------------------------------------------


async def test_a_paused_queue_takes_tasks_and_hands_none_out_until_resumed(http: Http) -> None:
    status, body = await http.request("POST", "/queues/mail/pause")
    assert (status, body) == (204, None)
    task_id = await put(http, 1, queue="mail")
    other = await put(http, 2, queue="other")
    assert await take(http, "queue=mail") is None
    assert (await take(http, "queue=mail,other"))["task"]["id"] == other  # the next one serves
    status, rows = await http.request("GET", "/queues")
    assert {r["name"]: r["paused"] for r in rows}["mail"] is True
    status, body = await http.request("POST", "/queues/mail/resume")
    assert (status, body) == (204, None)
    assert (await take(http, "queue=mail"))["task"]["id"] == task_id
    status, rows = await http.request("GET", "/queues")
    assert {r["name"]: r["paused"] for r in rows}["mail"] is False


async def test_a_paused_queue_still_promotes_delayed_tasks_and_takes_settlements(
    http: Http, clock: FakeClock
) -> None:
    held_id = await put(http, "held", queue="p")
    held = await take(http, "queue=p")
    await put(http, "later", queue="p", delay_ms=1000)
    assert (await http.request("POST", "/queues/p/pause"))[0] == 204
    clock.advance(1.01)
    await settle()
    _, stats = await wait_until(
        lambda: http.request("GET", "/stats?queue=p"),
        lambda answer: answer[1]["ready"] == 1,
        what="the delayed task to become ready",
    )
    assert gauges(stats) == (1, 1, 0, 0)
    assert await take(http, "queue=p") is None
    path = f"/jobs/{held_id}/extend?lease_id={held['lease_id']}"
    assert (await http.request("POST", path))[0] == 200
    assert await http.ack(held_id, held["lease_id"]) == 204


async def test_pause_and_resume_are_idempotent_and_create_an_unknown_queue(http: Http) -> None:
    for _ in range(2):
        assert (await http.request("POST", "/queues/fresh/pause"))[0] == 204
    _, rows = await http.request("GET", "/queues")
    assert {
        "name": "fresh",
        "ready": 0,
        "handed_out": 0,
        "delayed": 0,
        "dead": 0,
        "waiting": 0,
        "succeeded": 0,
        "paused": True,
        "oldest_ready_at": None,
        "limits": None,
        "tokens": None,
    } in rows
    for _ in range(2):
        assert (await http.request("POST", "/queues/fresh/resume"))[0] == 204
    assert (await http.request("POST", "/queues/never-paused/resume"))[0] == 204


async def test_resume_wakes_a_poll_parked_on_a_paused_queue(http: Http, broker: Broker) -> None:
    assert (await http.request("POST", "/queues/default/pause"))[0] == 204
    task_id = await put(http, 1)
    poll = asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=20000"))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    await settle()
    assert not poll.done()
    assert (await http.request("POST", "/queues/default/resume"))[0] == 204
    status, body = await asyncio.wait_for(poll, 5)
    assert status == 200
    assert body["task"]["id"] == task_id


@pytest.mark.parametrize("name", ["a%20b", "x" * 65, "%C3%A9", "a%09b"])
@pytest.mark.parametrize("verb", ["pause", "resume"])
async def test_pausing_a_bad_queue_name_gets_400(http: Http, name: str, verb: str) -> None:
    await refused(http, "POST", f"/queues/{name}/{verb}", "queue")


# -- lease extension --------------------------------------------------------------------------


async def test_extend_moves_the_deadline_and_keeps_the_task(
    http: Http, broker: Broker, clock: FakeClock
) -> None:
    task_id = await put(http, 1)
    held = await take(http, lease_ms=1000)
    clock.advance(0.8)
    status, body = await http.request(
        "POST", f"/jobs/{task_id}/extend?lease_id={held['lease_id']}&lease_ms=2000"
    )
    assert status == 200
    assert list(body) == ["deadline"]
    assert ts(body["deadline"]) == pytest.approx(clock.now() + 2.0, abs=1e-6)
    clock.advance(1.5)  # past the first deadline, before the new one
    await settle()
    assert (await http.stats())["totals"]["reclaimed"] == 0
    assert await http.ack(task_id, held["lease_id"]) == 204


async def test_an_extended_lease_still_expires_at_its_new_deadline(
    http: Http, clock: FakeClock
) -> None:
    task_id = await put(http, 1)
    held = await take(http, lease_ms=1000)
    path = f"/jobs/{task_id}/extend?lease_id={held['lease_id']}&lease_ms=1500"
    assert (await http.request("POST", path))[0] == 200
    clock.advance(1.51)
    await settle()
    stats = await wait_until(
        http.stats, lambda s: s["totals"]["reclaimed"] == 1, what="the lease to expire"
    )
    assert stats["handed_out"] == 0
    assert await http.ack(task_id, held["lease_id"]) == 404


async def test_extend_defaults_to_30s_and_is_capped_at_5_minutes(
    http: Http, clock: FakeClock
) -> None:
    task_id = await put(http, 1)
    lease = (await take(http, lease_ms=1000))["lease_id"]
    base = f"/jobs/{task_id}/extend?lease_id={lease}"
    status, body = await http.request("POST", base)
    assert status == 200
    assert ts(body["deadline"]) == pytest.approx(clock.now() + 30, abs=1e-6)
    status, body = await http.request("POST", base + "&lease_ms=" + "9" * 30)
    assert status == 200
    assert ts(body["deadline"]) == pytest.approx(clock.now() + 300, abs=1e-6)


async def test_extend_answers_404_and_409_as_ack_does(http: Http, clock: FakeClock) -> None:
    task_id = await put(http, 1)
    held = await take(http)
    status, body = await http.request("POST", f"/jobs/{task_id}/extend?lease_id=not-the-lease")
    assert status == 409
    assert "lease" in body["error"]
    status, body = await http.request("POST", "/jobs/nosuchtask/extend?lease_id=x")
    assert status == 404
    assert "nosuchtask" in body["error"]
    assert await http.ack(task_id, held["lease_id"]) == 204
    status, _ = await http.request("POST", f"/jobs/{task_id}/extend?lease_id={held['lease_id']}")
    assert status == 404  # acked: nobody holds it


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("", "lease_id"),
        ("lease_id=", "lease_id"),
        ("lease_id=L&lease_ms=0", "lease_ms"),
        ("lease_id=L&lease_ms=-5", "lease_ms"),
        ("lease_id=L&lease_ms=1.5", "lease_ms"),
        ("lease_id=L&lease_ms=abc", "lease_ms"),
        ("lease_id=L&lease_ms=1&lease_ms=2", "lease_ms"),
    ],
)
async def test_bad_extend_parameters_get_400(
    http: Http, clock: FakeClock, query: str, field: str
) -> None:
    task_id = await put(http, 1)
    held = await take(http, lease_ms=1000)
    query = query.replace("lease_id=L", f"lease_id={held['lease_id']}")
    await refused(http, "POST", f"/jobs/{task_id}/extend?{query}", field)
    clock.advance(1.01)  # the lease was not extended
    await settle()
    assert (await http.stats())["totals"]["reclaimed"] == 1


# -- nack options -----------------------------------------------------------------------------


async def nack(http: Http, body: Any, *, raw: bytes | None = None) -> tuple[Any, int, Any]:
    """A held task nacked with ``body`` (JSON, or ``raw`` bytes): (the delivery, status, answer)."""
    await put(http, {"n": 1}, max_attempts=3)
    held = await take(http)
    path = f"/jobs/{held['task']['id']}/nack?lease_id={held['lease_id']}"
    if raw is not None:
        status, answer = await http.request("POST", path, data=raw)
    else:
        status, answer = await http.request("POST", path, json=body)
    return held, status, answer


async def test_nack_with_delay_ms_retries_after_exactly_that(http: Http, clock: FakeClock) -> None:
    held, status, _ = await nack(http, {"error": "later", "delay_ms": 5000})
    assert status == 204
    stats = await http.stats()
    assert gauges(stats) == (0, 0, 1, 0)
    assert (stats["totals"]["nacked"], stats["totals"]["retried"]) == (1, 1)
    clock.advance(4.99)
    await settle()
    assert await take(http) is None
    clock.advance(0.02)
    await settle()
    again = await wait_until(lambda: take(http), lambda b: b is not None, what="the retry")
    assert again["task"]["id"] == held["task"]["id"]
    assert again["task"]["attempts"] == 2
    assert again["task"]["last_error"] == "later"
    assert ts(again["task"]["available_at"]) == pytest.approx(clock.now() - 0.01, abs=0.02)
    assert invariant_holds(await http.stats())


async def test_nack_with_delay_ms_zero_is_ready_at_once(http: Http) -> None:
    held, status, _ = await nack(http, {"delay_ms": 0})
    assert status == 204
    again = await take(http)
    assert again["task"]["id"] == held["task"]["id"]


async def test_nack_with_delay_ms_on_the_last_attempt_buries(http: Http) -> None:
    task_id = await put(http, 1, max_attempts=1)
    held = await take(http)
    path = f"/jobs/{task_id}/nack?lease_id={held['lease_id']}"
    assert (await http.request("POST", path, json={"delay_ms": 1000}))[0] == 204
    stats = await http.stats()
    assert gauges(stats) == (0, 0, 0, 1)
    assert stats["totals"]["buried"] == 1
    assert invariant_holds(stats)


async def test_a_terminal_nack_buries_whatever_attempts_remain(http: Http) -> None:
    held, status, _ = await nack(http, {"error": "poison", "terminal": True})
    assert status == 204
    stats = await http.stats()
    assert gauges(stats) == (0, 0, 0, 1)
    t = stats["totals"]
    assert (t["nacked"], t["retried"], t["buried"]) == (1, 0, 1)
    assert invariant_holds(stats)
    status, dead = await http.request("GET", "/dlq")
    assert [(d["id"], d["attempts"], d["last_error"]) for d in dead] == [
        (held["task"]["id"], 1, "poison")
    ]


async def test_terminal_false_is_the_spec_nack(http: Http) -> None:
    _, status, _ = await nack(http, {"terminal": False, "delay_ms": None})
    assert status == 204
    stats = await http.stats()
    assert gauges(stats) == (0, 0, 1, 0)
    assert stats["totals"]["retried"] == 1


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"terminal": "yes"}', "terminal"),
        (b'{"terminal": 1}', "terminal"),
        (b'{"terminal": "true"}', "terminal"),
        (b'{"terminal": [true]}', "terminal"),
        (b'{"delay_ms": -1}', "delay_ms"),
        (b'{"delay_ms": "5"}', "delay_ms"),
        (b'{"delay_ms": true}', "delay_ms"),
        (b'{"delay_ms": 1.5}', "delay_ms"),
        (b'{"delay_ms": ' + b"9" * 5000 + b"}", "delay_ms"),
        (b'{"terminal": true, "delay_ms": 5}', "delay_ms"),
    ],
)
async def test_bad_nack_options_get_400_and_change_nothing(
    http: Http, raw: bytes, field: str
) -> None:
    held, status, answer = await nack(http, None, raw=raw)
    assert status == 400, answer
    assert field in answer["error"]
    assert len(answer["error"]) < 300
    stats = await http.stats()
    assert stats["handed_out"] == 1
    assert stats["totals"]["nacked"] == 0
    assert await http.ack(held["task"]["id"], held["lease_id"]) == 204


# -- idempotency keys --------------------------------------------------------------------------


async def test_a_repeated_key_answers_200_with_the_first_id_and_creates_nothing(
    http: Http,
) -> None:
    first = await put(http, {"n": 1}, key="order-17")
    status, body = await http.request(
        "POST", "/jobs", json={"payload": {"n": 2}}, headers={"Idempotency-Key": "order-17"}
    )
    assert status == 200
    assert body == {"id": first, "duplicate": True}
    assert list(body) == ["id", "duplicate"]
    stats = await http.stats()
    assert (stats["ready"], stats["totals"]["enqueued"]) == (1, 1)


async def test_a_key_is_remembered_after_its_task_was_acked(http: Http) -> None:
    first = await put(http, 1, key="k")
    held = await take(http)
    assert await http.ack(first, held["lease_id"]) == 204
    status, body = await http.request(
        "POST", "/jobs", json={"payload": 1}, headers={"Idempotency-Key": "k"}
    )
    assert (status, body) == (200, {"id": first, "duplicate": True})
    assert await take(http) is None


async def test_a_key_is_per_queue(http: Http) -> None:
    a = await put(http, 1, key="same", queue="a")
    b = await put(http, 1, key="same", queue="b")
    assert a != b
    status, body = await http.request(
        "POST", "/jobs", json={"payload": 1, "queue": "b"}, headers={"Idempotency-Key": "same"}
    )
    assert (status, body) == (200, {"id": b, "duplicate": True})


async def test_a_key_is_forgotten_after_the_window(
    clock: FakeClock,
) -> None:
    async with (
        http_broker(clock=clock, dedup_window=10.0) as broker,
        http_client(broker.http_url) as http,
    ):
        first = await put(http, 1, key="k")
        clock.advance(9.9)
        status, body = await http.request(
            "POST", "/jobs", json={"payload": 1}, headers={"Idempotency-Key": "k"}
        )
        assert (status, body) == (200, {"id": first, "duplicate": True})
        clock.advance(0.2)
        second = await put(http, 1, key="k")
        assert second != first


def test_the_dedup_window_flag_reaches_the_service(capsys: pytest.CaptureFixture[str]) -> None:
    from wqbroker import __main__ as cli
    from wqbroker.config import config_from_args

    assert config_from_args(cli.parse_args([])).dedup_window == 300.0
    for argv in (["-dedup-window-ms", "1500"], ["--dedup-window-ms=1500"]):
        assert config_from_args(cli.parse_args(argv)).dedup_window == 1.5
    assert config_from_args(cli.parse_args(["-dedup-window-ms=0"])).dedup_window == 0.0
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["-dedup-window-ms=-1"])
    assert e.value.code == 2
    assert "-dedup-window-ms" in capsys.readouterr().err


async def test_the_window_reaches_the_service(clock: FakeClock) -> None:
    async with http_broker(clock=clock, dedup_window=1.5) as broker:
        assert broker.service.dedup_window == 1.5


async def test_without_a_key_every_enqueue_is_new(http: Http) -> None:
    ids = {await put(http, 1) for _ in range(3)}
    assert len(ids) == 3


async def test_a_duplicate_is_checked_for_validity_first(http: Http) -> None:
    # A repeated key with a bad body is refused for the body, not answered as a duplicate.
    await put(http, 1, key="k")
    await refused(
        http,
        "POST",
        "/jobs",
        "priority",
        json={"payload": 1, "priority": 10},
        headers={"Idempotency-Key": "k"},
    )


@pytest.mark.parametrize("key", ["", "x" * 257, "tab\tinside"])
async def test_a_bad_key_gets_400(broker: Broker, http: Http, key: str) -> None:
    # (raw HTTP: aiohttp's client would strip the tab and refuse the empty value)
    data = b'{"payload": 1}'
    response = await exchange(
        broker.http_addresses[0],
        request("POST", "/jobs", data, {"Idempotency-Key": key}),
    )
    assert response.status == 400, response.body
    assert "key" in response.json()["error"].lower()
    assert (await http.stats())["totals"]["enqueued"] == 0


async def test_the_longest_key_is_accepted(http: Http) -> None:
    first = await put(http, 1, key="k" * 256)
    status, body = await http.request(
        "POST", "/jobs", json={"payload": 1}, headers={"Idempotency-Key": "k" * 256}
    )
    assert (status, body) == (200, {"id": first, "duplicate": True})


async def test_two_key_headers_get_400(http: Http) -> None:
    headers = [("Idempotency-Key", "a"), ("Idempotency-Key", "b")]
    await refused(http, "POST", "/jobs", "Idempotency-Key", json={"payload": 1}, headers=headers)
    assert (await http.stats())["totals"]["enqueued"] == 0


# -- task lookup --------------------------------------------------------------------------------


async def state_of(http: Http, task_id: str) -> Any:
    status, body = await http.request("GET", f"/jobs/{task_id}")
    assert status == 200, body
    assert "lease_id" not in body
    assert body["id"] == task_id
    return body


async def test_lookup_follows_a_task_through_every_state(http: Http, clock: FakeClock) -> None:
    task_id = await put(http, {"n": 1}, max_attempts=2, queue="q", priority=4)
    view = await state_of(http, task_id)
    assert SPEC_TASK <= set(view)
    assert list(view)[-3:] == ["queue", "priority", "state"]
    assert (view["payload"], view["queue"], view["priority"], view["state"]) == (
        {"n": 1},
        "q",
        4,
        "ready",
    )
    assert view["attempts"] == 0
    held = await take(http, "queue=q")
    view = await state_of(http, task_id)
    assert (view["state"], view["attempts"]) == ("handed_out", 1)
    assert await http.nack(task_id, held["lease_id"], "once") == 204
    view = await state_of(http, task_id)
    assert (view["state"], view["last_error"]) == ("delayed", "once")
    clock.advance(5)
    await settle()
    await wait_until(lambda: state_of(http, task_id), lambda v: v["state"] == "ready", what="ready")
    held = await take(http, "queue=q")
    assert await http.nack(task_id, held["lease_id"], "twice") == 204
    view = await state_of(http, task_id)
    assert (view["state"], view["attempts"], view["last_error"]) == ("dead", 2, "twice")
    assert (await http.request("POST", f"/dlq/{task_id}/requeue"))[0] == 204
    assert (await state_of(http, task_id))["state"] == "ready"
    held = await take(http, "queue=q")
    assert await http.ack(task_id, held["lease_id"]) == 204
    status, body = await http.request("GET", f"/jobs/{task_id}")
    assert status == 404
    assert task_id in body["error"]


async def test_a_delayed_task_is_delayed(http: Http) -> None:
    task_id = await put(http, 1, delay_ms=60000)
    assert (await state_of(http, task_id))["state"] == "delayed"


async def test_lookup_of_an_unknown_task_is_404(http: Http) -> None:
    status, body = await http.request("GET", "/jobs/nosuchtask")
    assert status == 404
    assert "nosuchtask" in body["error"]


async def test_head_on_a_task_answers_as_get_without_a_body(http: Http, broker: Broker) -> None:
    task_id = await put(http, 1)
    response = await exchange(
        broker.http_addresses[0], request("HEAD", f"/jobs/{task_id}"), head=True
    )
    assert response.status == 200
    assert response.body == b""
    assert (await http.stats())["handed_out"] == 0


async def test_jobs_next_is_never_a_lookup(http: Http, broker: Broker) -> None:
    await put(http, 1)
    response = await exchange(broker.http_addresses[0], request("HEAD", "/jobs/next"), head=True)
    assert response.status == 405
    assert response.header("Allow") == "GET"
    assert (await http.stats())["handed_out"] == 0


# -- the DLQ: filter, purge, requeue all --------------------------------------------------------


async def test_the_dlq_filters_by_queue(http: Http) -> None:
    a = await bury(http, "a")
    b = await bury(http, "b")
    d = await bury(http)
    status, everything = await http.request("GET", "/dlq")
    assert [t["id"] for t in everything] == [a, b, d]
    assert [t["queue"] for t in everything] == ["a", "b", "default"]
    status, only_b = await http.request("GET", "/dlq?queue=b")
    assert status == 200
    assert [t["id"] for t in only_b] == [b]
    status, none = await http.request("GET", "/dlq?queue=nobody&limit=5")
    assert (status, none) == (200, [])


async def test_purge_drops_a_dead_task_for_good_and_counts_it(http: Http) -> None:
    dead = await bury(http)
    kept = await bury(http)
    status, body = await http.request("DELETE", f"/dlq/{dead}")
    assert (status, body) == (204, None)
    assert (await http.request("DELETE", f"/dlq/{dead}"))[0] == 404
    assert (await http.request("GET", f"/jobs/{dead}"))[0] == 404
    assert [t["id"] for t in (await http.request("GET", "/dlq"))[1]] == [kept]
    stats = await http.stats()
    t = stats["totals"]
    assert (stats["dead"], t["purged"], t["buried"]) == (1, 1, 2)
    # gauges = enqueued - acked - purged; the failures' invariant is untouched
    assert sum(gauges(stats)) == t["enqueued"] - t["acked"] - t["purged"]
    assert invariant_holds(stats)


async def test_purge_of_a_task_that_is_not_dead_is_404(http: Http) -> None:
    ready = await put(http, 1)
    status, body = await http.request("DELETE", f"/dlq/{ready}")
    assert status == 404
    assert ready in body["error"]
    assert (await http.request("DELETE", "/dlq/nosuchtask"))[0] == 404
    assert (await http.stats())["ready"] == 1


async def test_requeue_all_requeues_every_dead_task(http: Http) -> None:
    ids = [await bury(http, q) for q in ("a", "b", "b")]
    status, body = await http.request("POST", "/dlq/requeue")
    assert (status, body) == (200, {"requeued": 3})
    stats = await http.stats()
    assert (stats["ready"], stats["dead"], stats["totals"]["requeued"]) == (3, 0, 3)
    got = {(await take(http, "queue=a,b"))["task"]["id"] for _ in range(3)}
    assert got == set(ids)
    assert (await http.request("POST", "/dlq/requeue"))[1] == {"requeued": 0}


async def test_requeue_all_of_one_queue(http: Http) -> None:
    a = await bury(http, "a")
    b = [await bury(http, "b") for _ in range(2)]
    status, body = await http.request("POST", "/dlq/requeue?queue=b")
    assert (status, body) == (200, {"requeued": 2})
    assert [t["id"] for t in (await http.request("GET", "/dlq"))[1]] == [a]
    got = [(await take(http, "queue=b"))["task"] for _ in range(2)]
    assert [t["id"] for t in got] == b
    assert all(t["attempts"] == 1 and t["last_error"] is None for t in got)
    assert (await http.request("POST", "/dlq/requeue?queue=nobody"))[1] == {"requeued": 0}


async def test_the_gauges_and_totals_agree_through_requeues_and_purges(http: Http) -> None:
    again = await bury(http, "a")
    await bury(http, "a")
    await bury(http, "b")
    assert (await http.request("POST", "/dlq/requeue?queue=a"))[1] == {"requeued": 2}
    held = await take(http, "queue=a")
    assert held["task"]["id"] == again
    assert await http.nack(again, held["lease_id"], "again") == 204  # dies a second time
    assert (await http.request("DELETE", f"/dlq/{again}"))[0] == 204
    for query in ("", "?queue=a", "?queue=b"):
        _, stats = await http.request("GET", "/stats" + query)
        t = stats["totals"]
        assert sum(gauges(stats)) == t["enqueued"] - t["acked"] - t["purged"], (query, stats)
        assert stats["dead"] == t["buried"] - t["requeued"] - t["purged"], (query, stats)
        assert invariant_holds(stats)
    _, a = await http.request("GET", "/stats?queue=a")
    assert (gauges(a), a["totals"]["purged"], a["totals"]["requeued"]) == ((1, 0, 0, 0), 1, 2)


async def test_requeue_all_wakes_a_parked_poll(http: Http, broker: Broker) -> None:
    dead = await bury(http)
    poll = asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=20000"))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    assert (await http.request("POST", "/dlq/requeue"))[1] == {"requeued": 1}
    status, body = await asyncio.wait_for(poll, 5)
    assert (status, body["task"]["id"]) == (200, dead)


# -- methods ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/jobs/abc", "DELETE,GET,HEAD"),
        ("POST", "/jobs/abc", "DELETE,GET,HEAD"),
        ("GET", "/jobs/abc/extend", "POST"),
        ("PUT", "/jobs/abc/extend", "POST"),
        ("POST", "/queues", "GET,HEAD"),
        ("DELETE", "/queues", "GET,HEAD"),
        ("GET", "/queues/q", "DELETE"),
        ("GET", "/queues/q/empty", "POST"),
        ("DELETE", "/jobs", "GET,HEAD,POST"),
        ("DELETE", "/jobs/next", "GET"),
        ("GET", "/queues/q/pause", "POST"),
        ("DELETE", "/queues/q/resume", "POST"),
        ("GET", "/dlq/requeue", "POST"),
        ("DELETE", "/dlq/requeue", "POST"),
        ("GET", "/dlq/abc", "DELETE"),
        ("POST", "/dlq/abc", "DELETE"),
        ("HEAD", "/jobs/next", "GET"),
        ("POST", "/jobs/next", "GET"),
    ],
)
async def test_wrong_methods_on_the_new_routes_get_405(
    http: Http, method: str, path: str, allow: str
) -> None:
    async with http.session.request(method, http.base + path) as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == allow
        if method != "HEAD":
            assert method in (await resp.json())["error"]


@pytest.mark.parametrize(
    "path", ["/queues/q/empty/now", "/queues/q/stop", "/queues//pause", "/dlq/a/b"]
)
async def test_unknown_paths_near_the_new_routes_get_404(http: Http, path: str) -> None:
    status, body = await http.request("POST", path)
    assert status == 404
    assert body["error"]


# -- POST /jobs/batch (an extension) ---------------------------------------------------------


async def test_a_batch_enqueues_in_order_each_task_with_its_own_options(http: Http) -> None:
    raw = (
        b'{"tasks": [{"payload": {"n": 1.10}}, {"payload": [1e400], "queue": "mail", '
        b'"priority": 7, "max_attempts": 5}, {"payload": null, "delay_ms": 60000}], "x": 1}'
    )
    status, body = await http.request("POST", "/jobs/batch", data=raw)
    assert status == 201, body
    assert set(body) == {"ids", "duplicates"}
    assert body["duplicates"] == [False, False, False]
    first, mail, delayed = body["ids"]
    assert len({first, mail, delayed}) == 3
    one = await take(http)
    assert (one["task"]["id"], one["task"]["payload"]) == (first, {"n": 1.1})
    two = await take(http, "queue=mail")
    assert (two["task"]["id"], two["task"]["priority"], two["task"]["max_attempts"]) == (
        mail,
        7,
        5,
    )
    assert await take(http) is None  # the third waits out its delay
    stats = await http.stats()
    assert (stats["totals"]["enqueued"], gauges(stats)) == (3, (0, 2, 1, 0))


async def test_a_batch_keeps_each_payload_byte_for_byte(http: Http) -> None:
    status, body = await http.request(
        "POST", "/jobs/batch", data=b'{"tasks":[{"payload":{"b": 2,  "a": [1.10, 1e400]}}]}'
    )
    assert status == 201, body
    async with http.session.get(http.base + "/jobs/next?wait_ms=0") as resp:
        text = await resp.read()
    assert b'"payload":{"b": 2,  "a": [1.10, 1e400]},' in text


async def test_a_batch_answers_each_idempotency_key(http: Http) -> None:
    first = await put(http, 1, key="k1")
    status, body = await http.request(
        "POST",
        "/jobs/batch",
        json={"tasks": [{"payload": 2, "idempotency_key": "k1"}, {"payload": 3}]},
    )
    assert status == 201, body
    assert body["ids"][0] == first
    assert body["duplicates"] == [True, False]
    assert (await http.stats())["totals"]["enqueued"] == 2


async def test_a_batch_refuses_the_idempotency_key_header(http: Http) -> None:
    # One header cannot key many tasks: refused, not ignored (nothing is enqueued unkeyed).
    message = await refused(
        http,
        "POST",
        "/jobs/batch",
        "idempotency_key member",
        json={"tasks": [{"payload": 1}]},
        headers={"Idempotency-Key": "k1"},
    )
    assert "Idempotency-Key" in message
    assert (await http.stats())["totals"]["enqueued"] == 0


async def test_an_empty_batch_enqueues_nothing(http: Http) -> None:
    status, body = await http.request("POST", "/jobs/batch", json={"tasks": []})
    assert (status, body) == (201, {"ids": [], "duplicates": []})


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b"", "empty"),
        (b"[]", "must be a JSON object"),
        (b"{}", "tasks is required"),
        (b'{"tasks": {"payload": 1}}', "tasks must be an array"),
        (b'{"tasks": [{"payload": 1}, 2]}', "tasks[1] must be a JSON object"),
        (b'{"tasks": [{"payload": 1}, {}]}', "tasks[1].payload"),
        (b'{"tasks": [{"payload": 1}, {"payload": NaN}]}', "not valid JSON"),
        (b'{"tasks": [{"payload": 1}, {"payload": 2, "priority": 10}]}', "tasks[1].priority"),
        (b'{"tasks": [{"payload": 1, "idempotency_key": 5}]}', "tasks[0].idempotency key"),
        (b'{"tasks": [{"payload": 1, "max_attempts": 3.0}]}', "tasks[0].max_attempts"),
        (b'{"tasks": [{"payload": 1, "queue": "no such/queue"}]}', "tasks[0].queue"),
        (b'{"tasks": [{"payload": 1}]', "not valid JSON"),
        (b'{"tasks": [{"payload": "\xff"}]}', "UTF-8"),
    ],
)
async def test_a_bad_batch_is_refused_whole_naming_the_task(
    http: Http, body: bytes, named: str
) -> None:
    await refused(http, "POST", "/jobs/batch", named, data=body)
    assert (await http.stats())["totals"]["enqueued"] == 0


async def test_a_batch_of_more_than_the_limit_is_refused(http: Http) -> None:
    tasks = b",".join([b'{"payload":1}'] * (MAX_BATCH + 1))
    await refused(
        http, "POST", "/jobs/batch", f"at most {MAX_BATCH}", data=b'{"tasks":[' + tasks + b"]}"
    )
    assert (await http.stats())["totals"]["enqueued"] == 0


async def test_batch_is_no_task_id(http: Http) -> None:
    # /jobs/batch is a route of its own: GET is not the lookup of a task called "batch".
    status, body = await http.request("GET", "/jobs/batch")
    assert status == 405, body
    assert "POST" in body["error"]
