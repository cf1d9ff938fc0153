"""The HTTP API against a real server on port 0, driven by a real aiohttp client.

Most tests inject a FakeClock so timing (lease deadlines, long-poll time-outs, backoff, delays) is
exact and nothing sleeps; the sweeper runs on that clock too.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import Http, http_broker, http_client, invariant_holds, settle, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqbroker.http import create_app, make_runner
from wqbroker.retry import Backoff
from wqbroker.service import Service
from wqbroker.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(60)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture(params=[True, False], ids=["fast-lane", "aiohttp-only"])
async def broker(clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    """A broker with the fast lane (the default), and one serving everything aiohttp's way
    (``-http-fast-lane=false``): the API is the same both ways."""
    async with http_broker(clock=clock, max_body=64 * 1024, http_fast_lane=request.param) as b:
        yield b


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


def ts(text: str) -> float:
    assert text.endswith("Z"), text
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    offset = parsed.utcoffset()
    assert offset is not None
    assert offset.total_seconds() == 0
    return parsed.timestamp()


# -- POST /jobs ---------------------------------------------------------------------------------


async def test_enqueue_returns_201_with_an_id(http: Http) -> None:
    status, body = await http.request("POST", "/jobs", json={"payload": {"line": "hello"}})
    assert status == 201
    assert set(body) == {"id"}
    assert isinstance(body["id"], str)
    assert body["id"]


async def test_ids_are_unique(http: Http) -> None:
    ids = {await http.enqueue(i) for i in range(200)}
    assert len(ids) == 200


async def test_claimed_task_has_the_documented_shape_and_defaults(
    http: Http, clock: FakeClock
) -> None:
    now = clock.now()
    task_id = await http.enqueue({"line": "hello"})
    body = await http.claim()
    assert set(body) == {"task", "lease_id", "deadline"}
    task = body["task"]
    assert {"id", "payload", "attempts", "max_attempts", "created_at", "available_at"} <= set(task)
    assert task["id"] == task_id
    assert task["payload"] == {"line": "hello"}
    assert task["attempts"] == 1
    assert task["max_attempts"] == 3
    assert ts(task["created_at"]) == pytest.approx(now, abs=1e-6)
    assert ts(task["available_at"]) == pytest.approx(now, abs=1e-6)
    assert ts(body["deadline"]) == pytest.approx(now + 30, abs=1e-6)  # lease_ms default 30 s
    assert isinstance(body["lease_id"], str)
    assert body["lease_id"]


@pytest.mark.parametrize(
    "payload",
    [
        b'{"line": "hello"}',
        b'  {"a" : [1, 2.0, 3e5, -0.0, true, false, null], "b": {"c": "\\u00e9\\n"}}  ',
        b'"just a string"',
        b"12345678901234567890123456789012345678901234567890",
        b"1.10",
        b"null",
        b"[]",
        '{"emoji": "🐍", "jp": "日本"}'.encode(),
    ],
)
async def test_payload_round_trips_byte_for_byte(http: Http, payload: bytes) -> None:
    body = b'{"payload": ' + payload + b', "max_attempts": 2}'
    status, _ = await http.request("POST", "/jobs", data=body)
    assert status == 201
    async with http.session.get(http.base + "/jobs/next?wait_ms=0") as resp:
        raw = await resp.read()
    assert resp.status == 200
    # The payload is spliced back exactly as sent (surrounding whitespace aside).
    assert b'"payload":' + payload.strip() + b"," in raw
    assert json.loads(raw)["task"]["payload"] == json.loads(payload)


async def test_form_content_type_from_curl_is_accepted(http: Http) -> None:
    # curl -d sends application/x-www-form-urlencoded; the body is still JSON.
    status, body = await http.request(
        "POST",
        "/jobs",
        data=b'{"payload": {"n": 1}}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert status == 201, body


async def test_max_attempts_and_delay_are_honoured(http: Http, clock: FakeClock) -> None:
    await http.enqueue({"n": 1}, max_attempts=7, delay_ms=5000)
    stats = await http.stats()
    assert (stats["ready"], stats["delayed"]) == (0, 1)
    assert await http.claim() is None
    clock.advance(4.9)
    await settle()
    assert await http.claim() is None
    clock.advance(0.2)
    await settle()
    body = await http.claim()
    assert body["task"]["max_attempts"] == 7
    assert ts(body["task"]["available_at"]) == pytest.approx(
        ts(body["task"]["created_at"]) + 5, abs=1e-6
    )


async def test_null_optional_fields_take_their_defaults(http: Http) -> None:
    await http.enqueue(1, max_attempts=None, delay_ms=None)
    body = await http.claim()
    assert body["task"]["max_attempts"] == 3


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"", "empty"),
        (b"not json", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b'{"payload": 1,}', "not valid JSON"),
        (b'{"payload": 1} trailing', "not valid JSON"),
        (b'{"payload": NaN}', "NaN"),
        (b'{"payload": Infinity}', "Infinity"),
        (b"[1, 2]", "JSON object"),
        (b'"payload"', "JSON object"),
        (b"null", "JSON object"),
        (b"{}", "payload is required"),
        (b'{"max_attempts": 3}', "payload is required"),
        (b'{"payload": 1, "max_attempts": "3"}', "max_attempts"),
        (b'{"payload": 1, "max_attempts": true}', "max_attempts"),
        (b'{"payload": 1, "max_attempts": 1.5}', "max_attempts"),
        (b'{"payload": 1, "max_attempts": 3.0}', "max_attempts"),
        (b'{"payload": 1, "max_attempts": 0}', "max_attempts"),
        (b'{"payload": 1, "max_attempts": -1}', "max_attempts"),
        (b'{"payload": 1, "max_attempts": 1e400}', "max_attempts"),
        (b'{"payload": 1, "max_attempts": 99999999999999999999999999}', "max_attempts"),
        (b'{"payload": 1, "max_attempts": [3]}', "max_attempts"),
        (b'{"payload": 1, "delay_ms": -5}', "delay_ms"),
        (b'{"payload": 1, "delay_ms": "100"}', "delay_ms"),
        (b'{"payload": 1, "delay_ms": false}', "delay_ms"),
        (b'{"payload": 1, "delay_ms": 10.5}', "delay_ms"),
        (b'{"payload": 1, "delay_ms": 99999999999999999999999}', "delay_ms"),
        (b"\xff\xfe{}", "UTF-8"),
        (b'{"payload": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "nested too deeply"),
    ],
)
async def test_bad_enqueue_bodies_get_400_naming_the_problem(
    http: Http, body: bytes, needle: str
) -> None:
    status, answer = await http.request("POST", "/jobs", data=body)
    assert status == 400, answer
    assert needle in answer["error"]
    stats = await http.stats()
    assert stats["totals"]["enqueued"] == 0


async def test_body_over_the_limit_gets_413(http: Http) -> None:
    big = b'{"payload": "' + b"x" * (64 * 1024) + b'"}'
    status, answer = await http.request("POST", "/jobs", data=big)
    assert status == 413
    assert "64" in answer["error"] or "65536" in answer["error"]
    # Just under the limit is fine.
    ok = b'{"payload": "' + b"x" * (64 * 1024 - 20) + b'"}'
    status, _ = await http.request("POST", "/jobs", data=ok)
    assert status == 201


async def test_default_body_limit_is_one_mebibyte(clock: FakeClock) -> None:
    async with http_broker(clock=clock) as b, http_client(b.http_url) as h:
        status, _ = await h.request(
            "POST", "/jobs", data=b'{"payload":"' + b"x" * (1024 * 1024) + b'"}'
        )
        assert status == 413
        status, _ = await h.request(
            "POST", "/jobs", data=b'{"payload":"' + b"x" * (1024 * 1024 - 100) + b'"}'
        )
        assert status == 201


# -- GET /jobs/next -----------------------------------------------------------------------------


async def test_next_answers_204_at_once_with_wait_zero(http: Http) -> None:
    status, body = await http.request("GET", "/jobs/next?wait_ms=0")
    assert (status, body) == (204, None)


async def test_next_is_oldest_first(http: Http) -> None:
    ids = [await http.enqueue(i) for i in range(5)]
    got = [(await http.claim())["task"]["id"] for _ in range(5)]
    assert got == ids


async def test_long_poll_is_woken_by_an_enqueue(http: Http, broker: Broker) -> None:
    poll = asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=20000"))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    assert not poll.done()
    task_id = await http.enqueue({"wake": True})
    status, body = await asyncio.wait_for(poll, 5)
    assert status == 200
    assert body["task"]["id"] == task_id


async def test_long_poll_times_out_with_204(http: Http, broker: Broker, clock: FakeClock) -> None:
    poll = asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=1500"))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    clock.advance(1.4)
    await settle()
    assert broker.service.waiting == 1  # the broker still holds it (a time-out would free it)
    clock.advance(0.2)
    await settle()
    assert broker.service.waiting == 0  # ...and now it has let it go: settle() was enough
    assert await asyncio.wait_for(poll, 5) == (204, None)


async def test_wait_ms_defaults_to_20s_and_is_capped_at_30s(
    http: Http, broker: Broker, clock: FakeClock
) -> None:
    default = asyncio.create_task(http.request("GET", "/jobs/next"))
    capped = asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=999999999999999"))
    await wait_until(lambda: broker.service.waiting == 2, what="2 parked claims")
    # A poll the broker lets go of leaves ``waiting`` within a settle(); one it still holds stays.
    clock.advance(19.9)
    await settle()
    assert broker.service.waiting == 2
    clock.advance(0.2)
    assert await asyncio.wait_for(default, 5) == (204, None)
    assert broker.service.waiting == 1
    assert not capped.done()
    clock.advance(9.8)
    await settle()
    assert broker.service.waiting == 1
    clock.advance(0.2)
    assert await asyncio.wait_for(capped, 5) == (204, None)
    assert broker.service.waiting == 0


async def test_lease_ms_is_honoured_and_capped_at_5_minutes(http: Http, clock: FakeClock) -> None:
    await http.enqueue(1)
    await http.enqueue(2)
    short = await http.claim(lease_ms=1500)
    assert ts(short["deadline"]) == pytest.approx(clock.now() + 1.5, abs=1e-6)
    long = await http.claim(lease_ms=10**12)
    assert ts(long["deadline"]) == pytest.approx(clock.now() + 300, abs=1e-6)


@pytest.mark.parametrize(
    "query",
    [
        "wait_ms=abc",
        "wait_ms=-1",
        "wait_ms=1.5",
        "wait_ms=",
        "wait_ms=true",
        "wait_ms=1_000",
        "lease_ms=abc",
        "lease_ms=0",
        "lease_ms=-100",
        "lease_ms=2.5",
        "wait_ms=1&wait_ms=2",
    ],
)
async def test_bad_next_parameters_get_400(http: Http, query: str) -> None:
    await http.enqueue(1)
    status, body = await http.request("GET", "/jobs/next?" + query)
    assert status == 400
    name = query.split("=")[0]
    assert name in body["error"]
    stats = await http.stats()
    assert stats["handed_out"] == 0
    assert stats["ready"] == 1


async def test_disconnected_long_poller_is_never_handed_a_task(http: Http, broker: Broker) -> None:
    poll = asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=20000"))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    poll.cancel()  # closes the connection
    await wait_until(lambda: broker.service.waiting == 0, what="no parked claim")
    task_id = await http.enqueue({"after": "disconnect"})
    stats = await http.stats()
    assert (stats["ready"], stats["handed_out"]) == (1, 0)
    assert stats["totals"]["delivered"] == 0
    body = await http.claim()
    assert body["task"]["id"] == task_id
    assert body["task"]["attempts"] == 1


async def test_many_disconnected_pollers_then_one_live_one(http: Http, broker: Broker) -> None:
    polls = [
        asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=20000")) for _ in range(20)
    ]
    await wait_until(lambda: broker.service.waiting == 20, what="20 parked claims")
    for p in polls:
        p.cancel()
    await wait_until(lambda: broker.service.waiting == 0, what="no parked claim")
    live = asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=20000"))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    task_id = await http.enqueue(1)
    status, body = await asyncio.wait_for(live, 5)
    assert status == 200
    assert body["task"]["id"] == task_id
    stats = await http.stats()
    assert stats["totals"]["delivered"] == 1
    assert stats["handed_out"] == 1


async def test_parked_pollers_are_served_first_come_first_served(
    http: Http, broker: Broker
) -> None:
    polls = []
    for _ in range(3):
        polls.append(asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=20000")))
        await wait_until(lambda: broker.service.waiting == len(polls), what="the claim to park")
    ids = [await http.enqueue(i) for i in range(3)]
    results = [await asyncio.wait_for(p, 5) for p in polls]
    assert [body["task"]["id"] for _, body in results] == ids


# -- ack / nack ---------------------------------------------------------------------------------


async def test_ack_then_404_on_repeat(http: Http) -> None:
    await http.enqueue(1)
    body = await http.claim()
    task_id, lease_id = body["task"]["id"], body["lease_id"]
    assert await http.ack(task_id, lease_id) == 204
    assert await http.ack(task_id, lease_id) == 404
    stats = await http.stats()
    assert stats["totals"]["acked"] == 1
    assert (stats["ready"], stats["handed_out"], stats["delayed"], stats["dead"]) == (0, 0, 0, 0)


async def test_ack_with_the_wrong_lease_gets_409(http: Http) -> None:
    await http.enqueue(1)
    body = await http.claim()
    status, answer = await http.request(
        "POST", f"/jobs/{body['task']['id']}/ack?lease_id=not-the-lease"
    )
    assert status == 409
    assert "lease" in answer["error"]
    assert (await http.stats())["handed_out"] == 1


async def test_ack_of_unknown_task_gets_404(http: Http) -> None:
    status, answer = await http.request("POST", "/jobs/doesnotexist/ack?lease_id=abc")
    assert status == 404
    assert "doesnotexist" in answer["error"]


@pytest.mark.parametrize("verb", ["ack", "nack"])
async def test_missing_lease_id_gets_400(http: Http, verb: str) -> None:
    await http.enqueue(1)
    body = await http.claim()
    for query in ("", "?lease_id="):
        status, answer = await http.request("POST", f"/jobs/{body['task']['id']}/{verb}{query}")
        assert status == 400
        assert "lease_id" in answer["error"]


async def test_stale_lease_after_reclaim_and_redelivery_gets_409(
    http: Http, clock: FakeClock, broker: Broker
) -> None:
    await http.enqueue(1)
    first = await http.claim(lease_ms=1000)
    clock.advance(1.01)
    await settle()
    assert (await http.stats())["totals"]["reclaimed"] == 1
    # While delayed, nobody holds it: 404.
    assert await http.ack(first["task"]["id"], first["lease_id"]) == 404
    clock.advance(1.0)  # past the first backoff (at most 1 s)
    await settle()
    second = await http.claim()
    assert second["task"]["attempts"] == 2
    assert second["task"]["last_error"] == "lease expired"
    # Now somebody else holds it: the old lease gets 409, the new one succeeds.
    assert await http.ack(first["task"]["id"], first["lease_id"]) == 409
    assert await http.nack(first["task"]["id"], first["lease_id"]) == 409
    assert await http.ack(second["task"]["id"], second["lease_id"]) == 204


async def test_nack_retries_with_backoff_then_buries(http: Http, clock: FakeClock) -> None:
    task_id = await http.enqueue({"fail": True}, max_attempts=3)
    gaps = []
    for attempt in (1, 2, 3):
        body = await http.claim()
        assert body["task"]["attempts"] == attempt
        nacked_at = clock.now()
        assert await http.nack(task_id, body["lease_id"], f"boom {attempt}") == 204
        stats = await http.stats()
        if attempt < 3:
            assert stats["delayed"] == 1
            # Not claimable before the shortest possible backoff...
            clock.advance(0.5 * 2 ** (attempt - 1) - 0.01)
            await settle()
            assert await http.claim() is None
            # ...and claimable by the longest.
            clock.advance(0.5 * 2 ** (attempt - 1) + 0.02)
            await settle()
            status, peek = await http.request("GET", "/stats")
            assert peek["ready"] == 1
            gaps.append(clock.now() - nacked_at)
    assert gaps[1] > gaps[0]
    stats = await http.stats()
    assert (stats["ready"], stats["handed_out"], stats["delayed"], stats["dead"]) == (0, 0, 0, 1)
    t = stats["totals"]
    assert (t["nacked"], t["retried"], t["buried"], t["delivered"]) == (3, 2, 1, 3)
    assert invariant_holds(stats)
    status, dlq = await http.request("GET", "/dlq")
    assert status == 200
    assert [d["id"] for d in dlq] == [task_id]
    assert dlq[0]["last_error"] == "boom 3"
    assert dlq[0]["attempts"] == 3
    assert dlq[0]["payload"] == {"fail": True}


async def test_nack_body_is_optional(http: Http) -> None:
    await http.enqueue(1, max_attempts=1)
    body = await http.claim()
    status, _ = await http.request(
        "POST", f"/jobs/{body['task']['id']}/nack?lease_id={body['lease_id']}"
    )
    assert status == 204
    status, dlq = await http.request("GET", "/dlq")
    assert dlq[0]["id"] == body["task"]["id"]


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"error": 42}', "error must be a string"),
        (b'{"error": ["x"]}', "error must be a string"),
        (b'"just a string"', "JSON object"),
    ],
)
async def test_bad_nack_bodies_get_400_and_change_nothing(
    http: Http, data: bytes, needle: str
) -> None:
    await http.enqueue(1)
    body = await http.claim()
    status, answer = await http.request(
        "POST", f"/jobs/{body['task']['id']}/nack?lease_id={body['lease_id']}", data=data
    )
    assert status == 400
    assert needle in answer["error"]
    stats = await http.stats()
    assert stats["handed_out"] == 1
    assert stats["totals"]["nacked"] == 0
    assert await http.ack(body["task"]["id"], body["lease_id"]) == 204


# -- the DLQ ------------------------------------------------------------------------------------


async def bury(http: Http, payload: Any, error: str = "bad") -> str:
    task_id = await http.enqueue(payload, max_attempts=1)
    body = await http.claim()
    assert body["task"]["id"] == task_id
    assert await http.nack(task_id, body["lease_id"], error) == 204
    return task_id


async def test_dlq_lists_dead_tasks_in_burial_order(http: Http) -> None:
    status, empty = await http.request("GET", "/dlq")
    assert (status, empty) == (200, [])
    ids = [await bury(http, {"n": i}, f"err {i}") for i in range(3)]
    status, dlq = await http.request("GET", "/dlq")
    assert [d["id"] for d in dlq] == ids
    assert [d["last_error"] for d in dlq] == ["err 0", "err 1", "err 2"]
    assert [d["payload"] for d in dlq] == [{"n": 0}, {"n": 1}, {"n": 2}]


async def test_a_dead_task_shows_when_it_was_buried_until_requeued(
    http: Http, clock: FakeClock
) -> None:
    task_id = await http.enqueue({"x": 1}, max_attempts=1)
    body = await http.claim()
    assert "buried_at" not in body["task"]  # (not dead: left out)
    clock.advance(5.0)
    buried = clock.now()
    assert await http.nack(task_id, body["lease_id"], "no") == 204
    clock.advance(60.0)  # (shown as it was, not as now)
    [dead] = (await http.request("GET", "/dlq"))[1]
    assert ts(dead["buried_at"]) == pytest.approx(buried, abs=1e-3)
    status, found = await http.request("GET", f"/jobs/{task_id}")
    assert (status, found["state"]) == (200, "dead")
    assert ts(found["buried_at"]) == pytest.approx(buried, abs=1e-3)
    assert found["available_at"] != found["buried_at"]
    assert (await http.request("POST", f"/dlq/{task_id}/requeue"))[0] == 204
    status, found = await http.request("GET", f"/jobs/{task_id}")
    assert (status, found["state"]) == (200, "ready")
    assert "buried_at" not in found


async def test_requeue_gives_a_clean_start(http: Http) -> None:
    task_id = await bury(http, {"x": 1})
    status, _ = await http.request("POST", f"/dlq/{task_id}/requeue")
    assert status == 204
    stats = await http.stats()
    assert (stats["ready"], stats["dead"], stats["totals"]["requeued"]) == (1, 0, 1)
    body = await http.claim()
    assert body["task"]["id"] == task_id
    assert body["task"]["attempts"] == 1
    assert body["task"]["last_error"] is None
    assert (await http.request("GET", "/dlq"))[1] == []
    assert invariant_holds(await http.stats())


async def test_requeue_of_a_task_not_in_the_dlq_gets_404(http: Http) -> None:
    status, answer = await http.request("POST", "/dlq/nope/requeue")
    assert status == 404
    assert "nope" in answer["error"]
    dead = await bury(http, 2)
    task_id = await http.enqueue(1)  # ready, not dead
    status, _ = await http.request("POST", f"/dlq/{task_id}/requeue")
    assert status == 404
    assert (await http.request("POST", f"/dlq/{dead}/requeue"))[0] == 204
    assert (await http.request("POST", f"/dlq/{dead}/requeue"))[0] == 404


# -- crash recovery -----------------------------------------------------------------------------


async def test_unconfirmed_lease_is_reclaimed_and_the_task_returns(
    http: Http, clock: FakeClock
) -> None:
    task_id = await http.enqueue({"line": "crash"})
    body = await http.claim(lease_ms=1000)
    clock.advance(0.99)
    await settle()
    assert (await http.stats())["totals"]["reclaimed"] == 0
    clock.advance(0.02)
    await settle()
    stats = await http.stats()
    assert stats["totals"]["reclaimed"] == 1
    assert stats["handed_out"] == 0
    assert stats["delayed"] + stats["ready"] == 1
    clock.advance(1.0)
    await settle()
    stats = await http.stats()
    assert stats["ready"] == 1
    again = await http.claim()
    assert again["task"]["id"] == task_id
    assert again["lease_id"] != body["lease_id"]
    assert invariant_holds(await http.stats())


async def test_reclaimed_task_wakes_a_parked_poller(
    http: Http, clock: FakeClock, broker: Broker
) -> None:
    task_id = await http.enqueue(1)
    await http.claim(lease_ms=500)
    poll = asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=30000"))
    await wait_until(lambda: broker.service.waiting == 1, what="1 parked claim")
    clock.advance(0.6)  # lease expires -> delayed for 0.5..1 s
    await settle()
    clock.advance(1.0)  # promoted -> handed to the parked poller
    status, body = await asyncio.wait_for(poll, 5)
    assert status == 200
    assert body["task"]["id"] == task_id
    assert body["task"]["attempts"] == 2


# -- stats, health, routing ---------------------------------------------------------------------


async def test_stats_has_exactly_the_spec_fields(http: Http) -> None:
    stats = await http.stats()
    # The spec's four gauges, and two more (docs/design/results.md): tasks waiting for their
    # parents, results held.
    assert set(stats) == {
        "ready",
        "handed_out",
        "delayed",
        "dead",
        "waiting",
        "succeeded",
        "totals",
    }
    # The spec's eight totals, and three more (extensions): dead tasks purged for good, tasks
    # cancelled and tasks expired (docs/design/control.md).
    assert set(stats["totals"]) == {
        "enqueued",
        "delivered",
        "acked",
        "nacked",
        "reclaimed",
        "retried",
        "buried",
        "requeued",
        "purged",
        "cancelled",
        "expired",
    }
    assert all(v == 0 for k, v in stats.items() if k != "totals")
    assert all(v == 0 for v in stats["totals"].values())


async def test_healthz(http: Http) -> None:
    status, body = await http.request("GET", "/healthz")
    assert status == 200
    assert body == {"status": "ok"}


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/", 404),
        ("GET", "/nope", 404),
        ("GET", "/jobs/x/y/z", 404),
        ("PUT", "/jobs", 405),
        ("DELETE", "/jobs", 405),
        ("POST", "/jobs/next", 405),
        ("GET", "/jobs/abc/ack", 405),
        ("PUT", "/jobs/abc/nack", 405),
        ("POST", "/stats", 405),
        ("DELETE", "/dlq", 405),
        ("GET", "/dlq/abc/requeue", 405),
        ("POST", "/healthz", 405),
    ],
)
async def test_unknown_paths_and_wrong_methods_get_json_errors(
    http: Http, method: str, path: str, status: int
) -> None:
    got, body = await http.request(method, path)
    assert got == status
    assert isinstance(body, dict)
    assert body["error"]


async def test_malformed_http_does_not_crash_the_server(broker: Broker, http: Http) -> None:
    host, port = broker.http_addresses[0].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GARBAGE / HTTP/9.9\r\n\r\n")
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 5)
    assert line.startswith(b"HTTP/1.")
    assert b" 400 " in line
    writer.close()
    assert (await http.request("GET", "/healthz"))[0] == 200


async def test_client_disconnecting_mid_body_loses_nothing(clock: FakeClock) -> None:
    """A client that goes away half-way through a request body enqueues nothing, and the server
    carries on. The real app runs with one extra, innermost middleware that notes when a handler
    starts and ends, so the test waits for the server to be done with the torn request."""
    started: list[str] = []
    ended: list[str] = []

    @web.middleware
    async def note(request: web.Request, handler: Handler) -> web.StreamResponse:
        started.append(request.path)
        try:
            return await handler(request)
        finally:
            ended.append(request.path)

    rng = random.Random(1)
    service = Service(MemoryStore(Backoff(1.0, 30.0, rng), rng), clock)
    app = create_app(service)
    app.middlewares.append(note)
    runner = make_runner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        _reader, writer = await asyncio.open_connection(host, port)
        writer.write(b'POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"payload":')
        await writer.drain()
        await wait_until(lambda: started == ["/jobs"], what="the handler to start on the body")
        writer.close()
        await wait_until(lambda: ended == ["/jobs"], what="the handler to end")
        stats = await service.stats()
        assert stats.totals.enqueued == 0
        async with http_client(f"http://{host}:{port}") as http:
            assert (await http.request("GET", "/healthz"))[0] == 200
    finally:
        await runner.cleanup()
        await service.close()


# -- shutdown -----------------------------------------------------------------------------------


async def test_shutdown_answers_open_long_polls() -> None:
    async with http_broker() as broker, aiohttp.ClientSession() as session:
        url = broker.http_url + "/jobs/next?wait_ms=30000"

        async def poll() -> int:
            async with session.get(url) as resp:
                return resp.status

        polls = [asyncio.create_task(poll()) for _ in range(3)]
        await wait_until(lambda: broker.service.waiting == 3, what="3 parked claims")
        await broker.stop()
        assert await asyncio.wait_for(asyncio.gather(*polls), 5) == [204, 204, 204]


# -- contention ---------------------------------------------------------------------------------


async def test_contention_2000_tasks_50_producers_3_workers() -> None:
    """The spec's contention exercise over real HTTP: every task acked exactly once."""
    n_tasks, n_producers, n_workers = 2000, 50, 3
    async with http_broker() as broker:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            http = Http(session, broker.http_url)
            acked: list[str] = []
            sent: list[str] = []
            done = asyncio.Event()

            async def producer(k: int) -> None:
                for i in range(k, n_tasks, n_producers):
                    sent.append(await http.enqueue({"i": i}))

            async def worker() -> None:
                while not done.is_set():
                    status, body = await http.request("GET", "/jobs/next?wait_ms=200")
                    if status == 204:
                        continue
                    assert status == 200
                    assert await http.ack(body["task"]["id"], body["lease_id"]) == 204
                    acked.append(body["task"]["id"])
                    if len(acked) == n_tasks:
                        done.set()

            workers = [asyncio.create_task(worker()) for _ in range(n_workers)]
            await asyncio.gather(*(producer(k) for k in range(n_producers)))
            await asyncio.wait_for(done.wait(), 60)
            await asyncio.gather(*workers)
            assert len(sent) == len(set(sent)) == n_tasks
            assert sorted(acked) == sorted(sent)  # each exactly once
            stats = await http.stats()
            assert (stats["ready"], stats["handed_out"], stats["delayed"], stats["dead"]) == (
                0,
                0,
                0,
                0,
            )
            t = stats["totals"]
            assert (t["enqueued"], t["delivered"], t["acked"]) == (n_tasks, n_tasks, n_tasks)
            assert invariant_holds(stats)


def test_timestamps_are_rfc3339_utc() -> None:
    from wqbroker.codec import rfc3339

    assert rfc3339(0) == "1970-01-01T00:00:00.000000Z"
    assert rfc3339(1_800_000_000.25) == "2027-01-15T08:00:00.250000Z"
    assert rfc3339(1_800_000_000.9999999) == "2027-01-15T08:00:01.000000Z"
    when = datetime(2026, 11, 29, 23, 7, 38, 123456, tzinfo=UTC).timestamp()
    assert rfc3339(when) == "2026-11-29T23:07:38.123456Z"
