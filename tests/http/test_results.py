"""Results and workflows (docs/design/results.md) over HTTP, against a real broker on port 0 (the
memory store, the fake clock): an ack's result (``POST /jobs/{id}/ack`` with a body, and the acks
of ``POST /jobs/settle``), kept byte for byte; ``GET /jobs/{id}/result`` and its long poll;
``result_ttl_ms``; ``after`` (ids, and indices in a batch), waiting tasks, their release, the
parents' results on delivery, a failed parent's children buried, cancels that cascade; children
in a task's view; the gauges ``waiting`` and ``succeeded``; hostile input; and what a client that
sends none of it sees (nothing new). Each test runs with the fast lane and without it
(``-http-fast-lane=false``): the answers are the same both ways.

The rendering of the new members is checked without a broker at the end. The same over gRPC, and
across the protocols and the stores: ``tests/grpc/test_results.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import Http, http_broker, http_client, json_values, wait_until
from wqbroker import codec
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqbroker.http import core
from wqbroker.limits import MAX_PARENTS, MAX_RESULT_TTL_MS
from wqbroker.models import Delivery, Outcome, ParentResult, Task, TaskState

pytestmark = pytest.mark.timeout(60)

MAX_BODY = 64 * 1024

# The members of a task view a client that sends none of the new options sees.
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
OLD_GAUGES = {"ready", "handed_out", "delayed", "dead"}


@pytest.fixture(params=[True, False], ids=["fast-lane", "aiohttp-only"])
async def broker(clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    async with http_broker(clock=clock, max_body=MAX_BODY, http_fast_lane=request.param) as b:
        yield b


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


def ts(text: str) -> float:
    assert text.endswith("Z"), text
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC).timestamp()


async def raw(http: Http, method: str, path: str, data: bytes | None = None) -> tuple[int, bytes]:
    """The status and the body's bytes, as the broker wrote them."""
    async with http.session.request(method, http.base + path, data=data) as resp:
        return resp.status, await resp.read()


async def refused(http: Http, method: str, path: str, status: int, field: str, **kw: Any) -> Any:
    """The call is refused with ``status`` and a JSON error naming ``field``."""
    got, body = await http.request(method, path, **kw)
    assert got == status, body
    assert isinstance(body, dict), body
    assert field in body["error"], body
    return body


async def claim(http: Http, queue: str = "default") -> Any:
    status, delivery = await http.request("GET", f"/jobs/next?wait_ms=0&queue={queue}")
    assert status == 200, delivery
    return delivery


async def held(http: Http, **fields: Any) -> tuple[str, str]:
    """A task enqueued and claimed: (id, lease_id)."""
    task_id = await http.enqueue({"held": True}, **fields)
    delivery = await claim(http, fields.get("queue", "default"))
    assert delivery["task"]["id"] == task_id
    return task_id, str(delivery["lease_id"])


async def ack(http: Http, task_id: str, lease_id: str, body: bytes | None = None) -> int:
    status, _ = await raw(http, "POST", f"/jobs/{task_id}/ack?lease_id={lease_id}", body)
    return status


async def succeeded(http: Http, result: bytes, **fields: Any) -> str:
    """A task acked with ``result`` (JSON text): its id."""
    task_id, lease_id = await held(http, **fields)
    assert await ack(http, task_id, lease_id, b'{"result":' + result + b"}") == 204
    return task_id


async def lookup(http: Http, task_id: str) -> Any:
    status, body = await http.request("GET", f"/jobs/{task_id}")
    assert status == 200, body
    return body


async def result_of(http: Http, task_id: str, wait_ms: int | None = None) -> tuple[int, Any]:
    query = "" if wait_ms is None else f"?wait_ms={wait_ms}"
    return await http.request("GET", f"/jobs/{task_id}/result{query}")


async def stats(http: Http, queue: str | None = None) -> Any:
    status, body = await http.request("GET", "/stats" + (f"?queue={queue}" if queue else ""))
    assert status == 200, body
    return body


def holds(s: dict[str, Any]) -> bool:
    """The extended invariant (docs/design/results.md)."""
    t = s["totals"]
    gone = t["acked"] + t["purged"] + t["cancelled"] + t["expired"]
    held = s["ready"] + s["handed_out"] + s["delayed"] + s["dead"] + s["waiting"]
    return bool(
        held == t["enqueued"] - gone and t["nacked"] + t["reclaimed"] == t["retried"] + t["buried"]
    )


async def parked(broker: Broker, n: int = 1) -> None:
    """Wait until ``n`` result waits are waiting at the broker."""
    await wait_until(lambda: broker.service.result_waiters == n, what=f"{n} result waits to park")


def waiting(http: Http, task_id: str, wait_ms: int = 30_000) -> asyncio.Task[tuple[int, Any]]:
    return asyncio.ensure_future(result_of(http, task_id, wait_ms))


async def batch(http: Http, *tasks: dict[str, Any]) -> list[str]:
    status, body = await http.request("POST", "/jobs/batch", json={"tasks": list(tasks)})
    assert status == 201, body
    return list(body["ids"])


# -- an ack's result ------------------------------------------------------------------------------

RESULTS = [
    b"null",
    b"1.10",
    b"1e400",
    b"-0.0",
    b"12345678901234567890123456789012345678901234567890",
    b'"caf\\u00e9 \xc3\xa9 \\ud83d\\ude00"',
    b'{"z": [1, 2.50, {"a": {}}], "a": null}',
    b"[ ]",
    b"true",
]


@pytest.mark.parametrize("result", RESULTS)
async def test_an_ack_s_result_is_kept_byte_for_byte(
    http: Http, clock: FakeClock, result: bytes
) -> None:
    task_id, lease_id = await held(http)
    body = b'{ "result" : ' + result + b" }"
    assert await ack(http, task_id, lease_id, body) == 204
    status, answer = await raw(http, "GET", f"/jobs/{task_id}/result")
    assert status == 200
    finished = f'"finished_at":"{codec.rfc3339(clock.now())}"'.encode()
    assert answer == (
        f'{{"id":"{task_id}","state":"succeeded","result":'.encode()
        + result
        + b","
        + finished
        + b"}"
    )
    status, view = await raw(http, "GET", f"/jobs/{task_id}")
    assert status == 200
    assert b'"result":' + result + b"," + finished in view
    found = json.loads(view)
    assert found["state"] == "succeeded"
    assert set(found) == PLAIN_TASK | {"state", "result", "finished_at"}  # no lease, no progress
    assert found["attempts"] == 1


async def test_no_result_forgets_the_task_as_the_spec_says(http: Http) -> None:
    for body in (None, b"", b" \r\n\t", b"{}", b'{"other": [1]}'):
        task_id, lease_id = await held(http)
        assert await ack(http, task_id, lease_id, body) == 204, body
        assert (await http.request("GET", f"/jobs/{task_id}"))[0] == 404
        assert (await result_of(http, task_id))[0] == 404
    s = await stats(http)
    assert (s["succeeded"], s["totals"]["acked"]) == (0, 5)


async def test_null_is_a_result(http: Http) -> None:
    task_id = await succeeded(http, b"null")
    assert await result_of(http, task_id) == (
        200,
        {
            "id": task_id,
            "state": "succeeded",
            "result": None,
            "finished_at": (await lookup(http, task_id))["finished_at"],
        },
    )
    s = await stats(http)
    assert (s["succeeded"], s["totals"]["acked"]) == (1, 1)
    assert holds(s)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{not json", "request body"),
        (b'{"result": NaN}', "request body"),
        (b'{"result": }', "request body"),
        (b'{"result": 1} trailing', "request body"),
        (b'{"result": "\xff"}', "UTF-8"),
        (b"\xfe\xff", "UTF-8"),
        (b"[1]", "JSON object"),
        (b'"result"', "JSON object"),
        (b"null", "JSON object"),
    ],
)
async def test_a_bad_ack_body_is_a_400_and_the_task_stays_held(
    http: Http, body: bytes, field: str
) -> None:
    task_id, lease_id = await held(http)
    status, answer = await raw(http, "POST", f"/jobs/{task_id}/ack?lease_id={lease_id}", body)
    assert status == 400, answer
    assert field in json.loads(answer)["error"]
    assert (await lookup(http, task_id))["state"] == "handed_out"
    assert await ack(http, task_id, lease_id) == 204  # still held: acked now


async def test_a_result_over_the_body_limit_is_a_413_and_the_task_stays_held(http: Http) -> None:
    task_id, lease_id = await held(http)
    huge = b'{"result": "' + b"x" * MAX_BODY + b'"}'
    assert await ack(http, task_id, lease_id, huge) == 413
    assert (await lookup(http, task_id))["state"] == "handed_out"
    body = b'{"result": "' + b"x" * (MAX_BODY - 100) + b'"}'  # within the limit: taken
    assert await ack(http, task_id, lease_id, body) == 204
    assert (await lookup(http, task_id))["result"] == "x" * (MAX_BODY - 100)


async def test_an_ack_with_a_result_still_checks_the_lease(http: Http) -> None:
    task_id, lease_id = await held(http)
    assert await ack(http, task_id, "not-" + lease_id, b'{"result": 1}') == 409
    assert await ack(http, "ffffffffffffffff", lease_id, b'{"result": 1}') == 404
    await refused(http, "POST", f"/jobs/{task_id}/ack", 400, "lease_id", data=b'{"result": 1}')
    assert (await lookup(http, task_id))["state"] == "handed_out"


async def test_a_settle_s_acks_take_results_byte_for_byte(http: Http) -> None:
    ids = [await http.enqueue(i) for i in range(4)]
    status, claimed = await http.request("GET", "/jobs/next/batch?wait_ms=0&max=4")
    assert status == 200
    lease = {d["task"]["id"]: d["lease_id"] for d in claimed["deliveries"]}
    body = (
        b'{"acks": ['
        + f'{{"id": "{ids[0]}", "lease_id": "{lease[ids[0]]}", "result": '.encode()
        + b'{"b": 1.10, "a": [1e400]}},'
        # The member's name spelled with an escape is the same member.
        + f'{{"id": "{ids[1]}", "lease_id": "{lease[ids[1]]}", "res\\u0075lt": null}},'.encode()
        + f'{{"id": "{ids[2]}", "lease_id": "{lease[ids[2]]}"}},'.encode()
        + f'{{"id": "{ids[3]}", "lease_id": "wrong", "result": 3}}'.encode()
        + b"]}"
    )
    status, answer = await raw(http, "POST", "/jobs/settle", body)
    assert status == 200, answer
    outcomes = json.loads(answer)
    assert outcomes["acks"][:3] == [None, None, None]
    assert outcomes["acks"][3]["status"] == 409
    status, first = await raw(http, "GET", f"/jobs/{ids[0]}/result")
    assert b'"result":{"b": 1.10, "a": [1e400]},' in first
    assert (await result_of(http, ids[1]))[1]["result"] is None
    assert (await result_of(http, ids[2]))[0] == 404  # acked without one: gone
    assert (await lookup(http, ids[3]))["state"] == "handed_out"


async def test_a_settle_without_results_is_as_before(http: Http) -> None:
    task_id, lease_id = await held(http)
    body = {"acks": [{"id": task_id, "lease_id": lease_id}], "nacks": []}
    assert await http.request("POST", "/jobs/settle", json=body) == (
        200,
        {"acks": [None], "nacks": []},
    )
    assert (await http.request("GET", f"/jobs/{task_id}"))[0] == 404


async def test_a_settle_s_nack_may_say_result_without_it_being_one(http: Http) -> None:
    task_id, lease_id = await held(http)
    body = {"nacks": [{"id": task_id, "lease_id": lease_id, "error": '"result"'}]}
    assert await http.request("POST", "/jobs/settle", json=body) == (
        200,
        {"acks": [], "nacks": [None]},
    )
    assert (await lookup(http, task_id))["last_error"] == '"result"'


# -- waiting for a result -------------------------------------------------------------------------


async def test_a_pending_task_answers_204(http: Http, broker: Broker, clock: FakeClock) -> None:
    task_id = await http.enqueue(1)
    assert await result_of(http, task_id) == (204, None)  # the default wait: none
    assert await result_of(http, task_id, 0) == (204, None)
    wait = waiting(http, task_id, 5_000)
    await parked(broker)
    clock.advance(4.9)
    await asyncio.sleep(0.05)
    assert not wait.done()
    clock.advance(0.2)
    assert await asyncio.wait_for(wait, 10) == (204, None)
    assert broker.service.result_waiters == 0


async def test_a_wait_above_the_cap_is_clamped_to_30_s(
    http: Http, broker: Broker, clock: FakeClock
) -> None:
    task_id = await http.enqueue(1)
    wait = asyncio.ensure_future(http.request("GET", f"/jobs/{task_id}/result?wait_ms={10**30}"))
    await parked(broker)
    clock.advance(29.9)
    await asyncio.sleep(0.05)
    assert not wait.done()
    clock.advance(0.2)
    assert await asyncio.wait_for(wait, 10) == (204, None)


@pytest.mark.parametrize("wait_ms", ["-1", "x", "1.5", "1e3", "", "%2B", "1_000"])
async def test_a_bad_wait_is_a_400_naming_it(http: Http, wait_ms: str) -> None:
    task_id = await http.enqueue(1)
    await refused(http, "GET", f"/jobs/{task_id}/result?wait_ms={wait_ms}", 400, "wait_ms")


async def test_wait_ms_given_twice_is_refused(http: Http) -> None:
    task_id = await http.enqueue(1)
    await refused(http, "GET", f"/jobs/{task_id}/result?wait_ms=1&wait_ms=2", 400, "wait_ms")


async def test_an_unknown_task_is_404_at_once(http: Http) -> None:
    status, body = await result_of(http, "ffffffffffffffff", 30_000)
    assert status == 404
    assert "ffffffffffffffff" in body["error"]
    status, _ = await http.request("HEAD", "/jobs/ffffffffffffffff/result")
    assert status == 404


async def test_head_answers_as_get(http: Http) -> None:
    task_id = await succeeded(http, b"1")
    async with http.session.head(f"{http.base}/jobs/{task_id}/result") as resp:
        assert resp.status == 200
        assert await resp.read() == b""


async def test_many_waiters_are_woken_by_one_ack(http: Http, broker: Broker) -> None:
    task_id, lease_id = await held(http)
    waits = [waiting(http, task_id) for _ in range(20)]
    await parked(broker, 20)
    assert await ack(http, task_id, lease_id, b'{"result": {"n": 1.50}}') == 204
    answers = await asyncio.wait_for(asyncio.gather(*waits), 10)
    assert {status for status, _ in answers} == {200}
    assert {json.dumps(body, sort_keys=True) for _, body in answers} == {
        json.dumps(
            {
                "id": task_id,
                "state": "succeeded",
                "result": {"n": 1.5},
                "finished_at": answers[0][1]["finished_at"],
            },
            sort_keys=True,
        )
    }
    assert broker.service.result_waiters == 0


async def test_a_waiter_hears_of_an_ack_without_a_result(http: Http, broker: Broker) -> None:
    task_id, lease_id = await held(http)
    wait = waiting(http, task_id)
    await parked(broker)
    assert await ack(http, task_id, lease_id) == 204
    status, body = await asyncio.wait_for(wait, 10)
    assert status == 200
    assert set(body) == {"id", "state", "finished_at"}  # no result member
    assert (body["id"], body["state"]) == (task_id, "succeeded")
    assert (await result_of(http, task_id))[0] == 404  # gone for whoever comes later


async def test_a_waiter_hears_of_a_burial(http: Http, broker: Broker) -> None:
    task_id, lease_id = await held(http, max_attempts=1)
    wait = waiting(http, task_id)
    await parked(broker)
    assert await http.nack(task_id, lease_id, "boom") == 204
    dead = {"id": task_id, "state": "dead", "last_error": "boom", "attempts": 1}
    assert await asyncio.wait_for(wait, 10) == (200, dead)
    assert await result_of(http, task_id, 30_000) == (200, dead)  # it stays: at once


async def test_a_waiter_hears_of_a_cancel_and_of_an_expiry(
    http: Http, broker: Broker, clock: FakeClock
) -> None:
    first = await http.enqueue(1)
    second = await http.enqueue(2, delay_ms=60_000, expires_in_ms=10_000)
    cancelled, expired = waiting(http, first), waiting(http, second)
    await parked(broker, 2)
    assert (await http.request("DELETE", f"/jobs/{first}"))[0] == 204
    assert await asyncio.wait_for(cancelled, 10) == (200, {"id": first, "state": "cancelled"})
    clock.advance(11)
    assert await asyncio.wait_for(expired, 10) == (200, {"id": second, "state": "expired"})
    assert (await result_of(http, first))[0] == 404
    assert (await result_of(http, second))[0] == 404


async def test_a_waiter_at_a_broker_that_closes_is_answered_204(clock: FakeClock) -> None:
    async with http_broker(clock=clock) as b, http_client(b.http_url) as h:
        task_id = await h.enqueue(1)
        waits = [waiting(h, task_id) for _ in range(3)]
        await parked(b, 3)
        await b.stop()
        assert await asyncio.wait_for(asyncio.gather(*waits), 10) == [(204, None)] * 3


async def test_a_waiter_that_goes_away_waits_no_more(http: Http, broker: Broker) -> None:
    task_id = await http.enqueue(1)
    async with http_client(http.base) as other:
        wait = waiting(other, task_id)
        await parked(broker)
        wait.cancel()
    await wait_until(lambda: broker.service.result_waiters == 0, what="the wait to end")
    assert (await result_of(http, task_id))[0] == 204


async def test_result_waits_count_toward_max_waiters(clock: FakeClock) -> None:
    async with http_broker(clock=clock, max_waiters=1) as b, http_client(b.http_url) as h:
        task_id, other = await h.enqueue(1), await h.enqueue(2)
        wait = waiting(h, task_id)
        await parked(b)
        async with h.session.get(f"{h.base}/jobs/{other}/result?wait_ms=1000") as resp:
            assert resp.status == 429
            assert resp.headers["Retry-After"] == "1"
        assert await result_of(h, other) == (204, None)  # no wait: answered
        claim_status, _ = await h.request("GET", "/jobs/next?wait_ms=1000&queue=other")
        assert claim_status == 429  # claims and result waits share the limit
        clock.advance(31)
        assert await asyncio.wait_for(wait, 10) == (204, None)


# -- the result's time to live --------------------------------------------------------------------


async def test_result_ttl_ms_is_shown_only_when_given(http: Http) -> None:
    plain = await http.enqueue(1)
    assert "result_ttl_ms" not in await lookup(http, plain)
    for ttl in (0, 5_000, MAX_RESULT_TTL_MS):
        task_id = await http.enqueue(1, result_ttl_ms=ttl)
        assert (await lookup(http, task_id))["result_ttl_ms"] == ttl
    task_id = await http.enqueue(1, result_ttl_ms=None)  # null: the default
    assert "result_ttl_ms" not in await lookup(http, task_id)


async def test_a_result_is_kept_for_its_ttl_then_pruned(
    http: Http, broker: Broker, clock: FakeClock
) -> None:
    short = await succeeded(http, b'"short"', result_ttl_ms=5_000)
    default = await succeeded(http, b'"default"')
    assert (await stats(http))["succeeded"] == 2
    clock.advance(4.9)
    assert (await result_of(http, short))[1]["result"] == "short"
    clock.advance(0.2)
    await wait_until(
        lambda: http.request("GET", f"/jobs/{short}/result"),
        lambda answer: answer[0] == 404,
        what="the short result to be pruned",
    )
    assert (await result_of(http, default))[1]["result"] == "default"
    clock.advance(3600)
    await wait_until(
        lambda: http.request("GET", f"/jobs/{default}/result"),
        lambda answer: answer[0] == 404,
        what="the default result (an hour) to be pruned",
    )
    s = await stats(http)
    assert (s["succeeded"], s["totals"]["acked"]) == (0, 2)


async def test_a_result_ttl_of_zero_keeps_nothing(http: Http) -> None:
    task_id = await succeeded(http, b"1", result_ttl_ms=0)
    assert (await http.request("GET", f"/jobs/{task_id}"))[0] == 404
    assert (await stats(http))["succeeded"] == 0


@pytest.mark.parametrize("value", [-1, MAX_RESULT_TTL_MS + 1, "1000", 1.5, True, [1], 10**30])
async def test_a_bad_result_ttl_is_a_400_naming_it(http: Http, value: Any) -> None:
    body = {"payload": 1, "result_ttl_ms": value}
    await refused(http, "POST", "/jobs", 400, "result_ttl_ms", json=body)
    tasks = {"tasks": [{"payload": 1}, body]}
    await refused(http, "POST", "/jobs/batch", 400, "tasks[1].result_ttl_ms", json=tasks)
    assert (await stats(http))["totals"]["enqueued"] == 0


# -- workflows ------------------------------------------------------------------------------------


async def test_a_chain_in_one_batch_runs_in_order_with_its_parents_results(
    http: Http, broker: Broker
) -> None:
    a, b, c = await batch(
        http, {"payload": "a"}, {"payload": "b", "after": [0]}, {"payload": "c", "after": [1]}
    )
    view = await lookup(http, b)
    assert (view["state"], view["after"], view["waiting_for"]) == ("waiting", [a], 1)
    s = await stats(http)
    assert (s["ready"], s["waiting"]) == (1, 2)
    assert holds(s)
    first = await claim(http)
    assert first["task"]["id"] == a
    assert "parents" not in first  # a task without parents: no member
    assert (await http.request("GET", "/jobs/next?wait_ms=0"))[0] == 204  # b waits
    body = b'{"result": {"from": "a", "n": 1.10}}'
    assert await ack(http, a, first["lease_id"], body) == 204
    view = await lookup(http, b)
    assert (view["state"], view["after"]) == ("ready", [a])
    assert "waiting_for" not in view  # only while waiting
    status, delivered = await raw(http, "GET", "/jobs/next?wait_ms=0")
    assert status == 200
    assert delivered.endswith(
        f',"parents":[{{"id":"{a}","result":{{"from": "a", "n": 1.10}}}}]}}'.encode()
    )
    second = json.loads(delivered)
    assert second["task"]["id"] == b
    assert second["task"]["after"] == [a]
    assert await ack(http, b, second["lease_id"]) == 204  # without a result
    third = await claim(http)
    assert third["task"]["id"] == c
    assert third["parents"] == [{"id": b}]  # b's result is not held: its id alone
    s = await stats(http)
    assert (s["waiting"], s["succeeded"], s["handed_out"]) == (0, 1, 1)
    assert holds(s)


async def test_a_fan_in_waits_for_every_parent(http: Http, broker: Broker) -> None:
    parents = [await http.enqueue(i) for i in range(3)]
    child = await http.enqueue("child", after=list(reversed(parents)))
    assert (await lookup(http, child))["waiting_for"] == 3
    leases = {}
    for _ in parents:
        d = await claim(http)
        leases[d["task"]["id"]] = d["lease_id"]
    consumer = asyncio.ensure_future(http.request("GET", "/jobs/next?wait_ms=30000"))
    await wait_until(lambda: broker.service.parked_polls == 1, what="the claim to park")
    for n, parent in enumerate(parents):
        assert await ack(http, parent, leases[parent], f'{{"result": {n}}}'.encode()) == 204
        if n < 2:
            assert (await lookup(http, child))["waiting_for"] == 2 - n
    status, delivery = await asyncio.wait_for(consumer, 10)  # the waiting consumer gets it
    assert status == 200
    assert delivery["task"]["id"] == child
    assert delivery["parents"] == [
        {"id": p, "result": n} for n, p in reversed(list(enumerate(parents)))
    ]


async def test_a_child_with_a_delay_is_delayed_from_its_release(
    http: Http, clock: FakeClock
) -> None:
    parent, lease = await held(http)
    child = await http.enqueue(1, after=[parent], delay_ms=10_000)
    clock.advance(20)  # (within the parent's lease)
    assert (await lookup(http, child))["state"] == "waiting"
    assert await ack(http, parent, lease) == 204
    view = await lookup(http, child)
    assert view["state"] == "delayed"
    assert ts(view["available_at"]) == pytest.approx(clock.now() + 10, abs=1e-3)
    clock.advance(10.5)
    assert (await claim(http))["task"]["id"] == child


async def test_a_child_of_a_succeeded_parent_is_ready_at_once(http: Http) -> None:
    parent = await succeeded(http, b'"done"')
    child = await http.enqueue(1, after=[parent])
    assert (await lookup(http, child))["state"] == "ready"
    delivery = await claim(http)
    assert delivery["parents"] == [{"id": parent, "result": "done"}]


async def test_a_task_shows_its_live_children(http: Http) -> None:
    parent = await http.enqueue(1)
    plain = await lookup(http, parent)
    assert "children" not in plain
    assert "children_count" not in plain
    kids = [await http.enqueue(i, after=[parent]) for i in range(3)]
    view = await lookup(http, parent)
    assert (view["children"], view["children_count"]) == (kids, 3)
    assert "children" not in await lookup(http, kids[0])
    assert (await http.request("DELETE", f"/jobs/{kids[1]}"))[0] == 204
    view = await lookup(http, parent)
    assert (view["children"], view["children_count"]) == ([kids[0], kids[2]], 2)


async def test_a_task_shows_at_most_100_children(http: Http) -> None:
    parent = await http.enqueue(1)
    kids = await batch(http, *({"payload": i, "after": [parent]} for i in range(120)))
    view = await lookup(http, parent)
    assert (view["children"], view["children_count"]) == (kids[:100], 120)


async def test_a_failed_parent_buries_its_children_and_theirs(http: Http) -> None:
    parent, lease = await held(http, max_attempts=1)
    child, grandchild = await batch(
        http, {"payload": 1, "after": [parent]}, {"payload": 2, "after": [0]}
    )
    assert await http.nack(parent, lease, "boom") == 204
    view = await lookup(http, child)
    assert view["state"] == "dead"
    assert view["last_error"] == f"parent {parent} is dead: boom"
    assert (await lookup(http, grandchild))["last_error"] == (
        f"parent {child} is dead: parent {parent} is dead: boom"
    )
    status, dead = await http.request("GET", "/dlq")
    assert status == 200
    assert {t["id"] for t in dead} == {parent, child, grandchild}
    s = await stats(http)
    assert (s["dead"], s["waiting"], s["totals"]["buried"]) == (3, 0, 1)  # children never ran
    assert holds(s)
    # Requeued, a child runs at once, without waiting again.
    assert (await http.request("POST", f"/dlq/{child}/requeue"))[0] == 204
    delivery = await claim(http)
    assert delivery["task"]["id"] == child
    assert delivery["parents"] == [{"id": parent}]


async def test_a_child_of_a_dead_parent_is_buried_at_once(http: Http) -> None:
    parent, lease = await held(http, max_attempts=1)
    assert await http.nack(parent, lease, "no") == 204
    child = await http.enqueue(1, after=[parent])
    view = await lookup(http, child)
    assert (view["state"], view["last_error"]) == ("dead", f"parent {parent} is dead: no")


async def test_cancelling_a_waiting_task_cancels_its_waiting_children(http: Http) -> None:
    parent = await http.enqueue(1)
    child, grandchild = await batch(
        http, {"payload": 1, "after": [parent]}, {"payload": 2, "after": [0]}
    )
    assert (await http.request("DELETE", f"/jobs/{child}"))[0] == 204
    assert (await http.request("GET", f"/jobs/{grandchild}"))[0] == 404
    s = await stats(http)
    assert (s["waiting"], s["ready"], s["totals"]["cancelled"]) == (0, 1, 2)
    assert holds(s)


async def test_emptying_a_queue_cancels_its_waiting_tasks(http: Http) -> None:
    parent = await http.enqueue(1, queue="flow")
    await http.enqueue(2, queue="flow", after=[parent])
    assert await http.request("POST", "/queues/flow/empty") == (200, {"cancelled": 2})
    s = await stats(http, "flow")
    assert (s["ready"], s["waiting"]) == (0, 0)


async def test_a_queue_holding_waiting_tasks_is_not_deleted(http: Http) -> None:
    parent = await http.enqueue(1)
    await http.enqueue(2, queue="later", after=[parent])
    body = await refused(http, "DELETE", "/queues/later", 409, "waiting")
    assert body


async def test_waiting_and_succeeded_tasks_are_listed(http: Http) -> None:
    parent = await http.enqueue(1)
    kids = [await http.enqueue(i, after=[parent]) for i in range(3)]
    status, page = await http.request("GET", "/jobs?state=waiting&limit=2")
    assert status == 200
    assert [(t["id"], t["state"]) for t in page["tasks"]] == [(k, "waiting") for k in kids[:2]]
    status, rest = await http.request("GET", f"/jobs?state=waiting&cursor={page['next_cursor']}")
    assert [t["id"] for t in rest["tasks"]] == kids[2:]
    done = [await succeeded(http, f"{i}".encode(), queue="done") for i in range(2)]
    status, page = await http.request("GET", "/jobs?state=succeeded&queue=done")
    assert [(t["id"], t["state"], t["result"]) for t in page["tasks"]] == [
        (done[0], "succeeded", 0),
        (done[1], "succeeded", 1),
    ]


async def test_the_queues_carry_the_new_gauges(http: Http) -> None:
    await succeeded(http, b"1", queue="flow")
    parent = await http.enqueue(1, queue="flow")
    await http.enqueue(2, queue="flow", after=[parent])
    status, rows = await http.request("GET", "/queues")
    assert status == 200
    (row,) = [r for r in rows if r["name"] == "flow"]
    assert (row["ready"], row["waiting"], row["succeeded"]) == (1, 1, 1)
    s = await stats(http, "flow")
    assert (s["ready"], s["waiting"], s["succeeded"]) == (1, 1, 1)
    assert holds(s)


# -- bad after ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("after", "field"),
    [
        ("0123456789abcdef", "after must be a list"),
        ({"id": "x"}, "after must be a list"),
        ([], "after must name at least one"),
        ([None], "after[0]"),
        ([""], "after[0]"),
        ([1.5], "after[0]"),
        ([True], "after[0]"),
        ([["x"]], "after[0]"),
        (["\ud800"], "after[0]"),
        (["ffffffffffffffff"], "after[0]"),  # unknown
        (["a", "b", "a"], "after[2]"),  # twice
        (["a"] * (MAX_PARENTS + 1), f"after names at most {MAX_PARENTS}"),
    ],
)
async def test_a_bad_after_is_a_400_naming_it(http: Http, after: Any, field: str) -> None:
    await refused(http, "POST", "/jobs", 400, field, json={"payload": 1, "after": after})
    body = {"tasks": [{"payload": 0}, {"payload": 1, "after": after}]}
    await refused(http, "POST", "/jobs/batch", 400, f"tasks[1].{field}", json=body)
    assert (await stats(http))["totals"]["enqueued"] == 0


async def test_an_index_names_an_item_of_a_batch_only(http: Http) -> None:
    body = await refused(http, "POST", "/jobs", 400, "after[0]", json={"payload": 1, "after": [0]})
    assert "earlier item of a batch" in body["error"]


@pytest.mark.parametrize(
    ("index", "after", "field"),
    [
        (0, [0], "tasks[0].after[0]"),  # itself
        (1, [1], "tasks[1].after[0]"),  # itself
        (1, [2], "tasks[1].after[0]"),  # a later one
        (1, [-1], "tasks[1].after[0]"),
        (2, [0, 5], "tasks[2].after[1]"),
        (2, [1, 1], "tasks[2].after[1]"),  # twice
        (2, [2**40], "tasks[2].after[0]"),
    ],
)
async def test_a_batch_item_names_only_earlier_items(
    http: Http, index: int, after: list[int], field: str
) -> None:
    tasks: list[dict[str, Any]] = [{"payload": i} for i in range(3)]
    tasks[index]["after"] = after
    await refused(http, "POST", "/jobs/batch", 400, field, json={"tasks": tasks})
    assert (await stats(http))["totals"]["enqueued"] == 0


async def test_an_unknown_parent_refuses_the_whole_batch(http: Http) -> None:
    known = await http.enqueue(0)
    tasks = [
        {"payload": 1},
        {"payload": 2, "after": [0, known]},
        {"payload": 3, "after": [known, "ffffffffffffffff"]},
    ]
    body = await refused(
        http, "POST", "/jobs/batch", 400, "tasks[2].after[1]", json={"tasks": tasks}
    )
    assert "ffffffffffffffff" in body["error"]
    assert (await stats(http))["totals"]["enqueued"] == 1


async def test_a_parent_gone_is_unknown(http: Http) -> None:
    forgotten, lease = await held(http)
    assert await ack(http, forgotten, lease) == 204  # acked without a result: gone
    cancelled = await http.enqueue(1)
    assert (await http.request("DELETE", f"/jobs/{cancelled}"))[0] == 204
    for gone in (forgotten, cancelled):
        await refused(http, "POST", "/jobs", 400, "after[0]", json={"payload": 1, "after": [gone]})


async def test_a_fan_in_of_a_whole_batch(clock: FakeClock) -> None:
    """A batch of 10,000 tasks (the most a batch holds), the last waiting for the 9,999 others
    (by index): the body is within the default limit (1 MiB)."""
    count = MAX_PARENTS - 1
    async with http_broker(clock=clock) as b, http_client(b.http_url) as h:
        tasks: list[dict[str, Any]] = [{"payload": 0} for _ in range(count)]
        tasks.append({"payload": 1, "after": list(range(count))})
        status, body = await h.request("POST", "/jobs/batch", json={"tasks": tasks})
        assert status == 201, body
        view = await lookup(h, body["ids"][-1])
        assert (view["state"], view["waiting_for"]) == ("waiting", count)
        assert view["after"] == body["ids"][:-1]


# -- a client that sends none of it ---------------------------------------------------------------


async def test_a_client_that_sends_none_of_it_sees_nothing_new(http: Http) -> None:
    task_id = await http.enqueue({"n": 1})
    assert set(await lookup(http, task_id)) == PLAIN_TASK | {"state"}
    delivery = await claim(http)
    assert set(delivery) == {"task", "lease_id", "deadline"}
    assert set(delivery["task"]) == PLAIN_TASK
    assert await ack(http, task_id, delivery["lease_id"]) == 204
    assert (await http.request("GET", f"/jobs/{task_id}"))[0] == 404
    # /stats and /queues gain two gauges (the one change docs/design/results.md allows).
    s = await stats(http)
    assert set(s) == OLD_GAUGES | {"waiting", "succeeded", "totals"}
    assert (s["waiting"], s["succeeded"]) == (0, 0)
    _, rows = await http.request("GET", "/queues")
    assert set(rows[0]) == {"name", "paused", "oldest_ready_at"} | OLD_GAUGES | {
        "waiting",
        "succeeded",
        "limits",  # (docs/design/schedules.md: null without limits)
        "tokens",
    }


# -- rendering, without a broker ------------------------------------------------------------------


def _task(**extra: Any) -> Task:
    return Task("0123456789abcdef", b'{"a":1}', 1, 3, 1_700_000_000.0, 1_700_000_000.0, **extra)


def test_the_new_members_render_only_when_set_and_in_order() -> None:
    task = _task(
        result=b' {"r": 1.10}',
        finished_at=1_700_000_001.5,
        result_ttl=2.5,
        after=("aa", "bb"),
        waiting_for=0,
    )
    assert core.render_task(task).endswith(
        b'"priority":0,"result": {"r": 1.10},"finished_at":"2023-11-14T22:13:21.500000Z",'
        b'"result_ttl_ms":2500,"after":["aa","bb"]}'
    )
    waiting_task = _task(after=("aa",), waiting_for=1)
    assert core.render_task(waiting_task).endswith(b'"after":["aa"],"waiting_for":1}')
    for only in ({"result_ttl": 0.0}, {"after": ("x",)}, {"finished_at": 1.0}):
        view = json.loads(core.render_task(_task(**only)))
        assert len(set(view) - PLAIN_TASK) == 1, only
    assert set(json.loads(core.render_task(_task()))) == PLAIN_TASK


def test_children_are_added_only_when_there_are_some() -> None:
    view = core.render_task_state(TaskState(_task(), "ready"))
    assert core.render_children(view, [], 0) == view
    with_children = json.loads(core.render_children(view, ["x", "y"], 7))
    assert (with_children["children"], with_children["children_count"]) == (["x", "y"], 7)


def test_a_delivery_renders_its_parents_only_when_it_has_some() -> None:
    plain = Delivery(_task(), "lease", 1_700_000_030.0)
    assert set(json.loads(core.render_delivery(plain))) == {"task", "lease_id", "deadline"}
    parents = [ParentResult("p1", b" [1.10] "), ParentResult("p2")]
    rendered = core.render_delivery(Delivery(_task(), "lease", 1_700_000_030.0, parents))
    assert rendered.endswith(b',"parents":[{"id":"p1","result": [1.10] },{"id":"p2"}]}')


def test_each_outcome_renders_as_the_design_says() -> None:
    finished = 1_700_000_001.0
    assert json.loads(core.render_outcome(Outcome("t", "succeeded", b"[1]", finished))) == {
        "id": "t",
        "state": "succeeded",
        "result": [1],
        "finished_at": "2023-11-14T22:13:21.000000Z",
    }
    assert set(json.loads(core.render_outcome(Outcome("t", "succeeded", None, finished)))) == {
        "id",
        "state",
        "finished_at",
    }
    assert json.loads(core.render_outcome(Outcome("t", "dead", last_error="x", attempts=2))) == {
        "id": "t",
        "state": "dead",
        "last_error": "x",
        "attempts": 2,
    }
    assert json.loads(core.render_outcome(Outcome("t", "dead", attempts=1)))["last_error"] is None
    for state in ("cancelled", "expired"):
        assert json.loads(core.render_outcome(Outcome("t", state, finished_at=finished))) == {
            "id": "t",
            "state": state,
        }


@given(value=json_values, indent=st.sampled_from([None, 0, 2]))
def test_any_json_result_is_spliced_as_sent(value: Any, indent: int | None) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=indent is None).encode()
    outcome = core.render_outcome(Outcome("t", "succeeded", text, 1.0))
    assert b'"result":' + text + b"," in outcome
    assert json.loads(outcome)["result"] == value
    task = core.render_task(_task(result=text, finished_at=1.0))
    assert json.loads(task)["result"] == value
    delivery = core.render_delivery(Delivery(_task(), "l", 1.0, [ParentResult("p", text)]))
    assert json.loads(delivery)["parents"] == [{"id": "p", "result": value}]
