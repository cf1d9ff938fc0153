"""The express lane (``wqbroker/http/express.py``): the hot requests skip aiohttp's router, and get
the very answers the router would give them.

Each request is sent twice, to a real broker over a bare socket: as is (the express lane takes
it) and with one letter of its path percent-encoded (``/jobs/%6Eext``: the same route once
aiohttp decodes it, but the express lane leaves it to the router). The two answers must be the
same, once ids, lease ids and times are put aside: status, headers and body. A spy on
``Application._handle`` (the router's way in) shows which way each request went.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.authkit import ONLY, ROOT, bearer, write_token_file
from tests.helpers import running_broker
from tests.rawhttp import RawResponse, exchange, raw_connection, request
from wqbroker.broker import Broker

MAX_BODY = 4096

# The same route, not taken by the express lane: the first letter of the last segment encoded.
Variant = Callable[[str], str]


def express(path: str) -> str:
    return path


def routed(path: str) -> str:
    head, _, last = path.rpartition("/")
    return f"{head}/%{ord(last[0]):02X}{last[1:]}"


VARIANTS = (express, routed)


def tag(variant: Variant) -> str:
    """A name for what each variant makes (keys, queues), the same length both ways."""
    return variant.__name__[:1]


@pytest.fixture
def router_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The requests that went through aiohttp's router, as "METHOD target"."""
    calls: list[str] = []
    handle = web.Application._handle

    async def spy(self: web.Application, req: web.Request) -> web.StreamResponse:
        calls.append(f"{req.method} {req.raw_path}")
        return await handle(self, req)

    monkeypatch.setattr(web.Application, "_handle", spy)
    return calls


@pytest.fixture
async def broker(router_calls: list[str]) -> AsyncIterator[Broker]:
    async with running_broker(grpc_addr="off", max_body=MAX_BODY) as b:
        yield b


def address(broker: Broker) -> str:
    return broker.http_addresses[0]


_ID = re.compile(rb"\b[0-9a-f]{16}\b")
_TIME = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")


def normal(response: RawResponse) -> tuple[int, str, list[tuple[str, str]], bytes]:
    """An answer with what differs from one request to the next put aside: the Date header,
    ids and lease ids (numbered in order of appearance), times."""
    seen: dict[bytes, bytes] = {}
    body = _ID.sub(lambda m: seen.setdefault(m[0], b"<id%d>" % len(seen)), response.body)
    body = _TIME.sub(b"<time>", body)
    headers = [(k, v) for k, v in response.headers if k.lower() != "date"]
    return response.status, response.reason, headers, body


async def send(
    broker: Broker, method: str, target: str, body: bytes | None = None, **headers: str
) -> RawResponse:
    data = request(method, target, body, headers)
    return await exchange(address(broker), data, head=method == "HEAD")


async def enqueue(broker: Broker, payload: Any = None) -> str:
    body = json.dumps({"payload": payload or {"n": 1}}).encode()
    answer = await send(broker, "POST", "/jobs", body)
    assert answer.status == 201, answer
    return str(answer.json()["id"])


async def claim(broker: Broker, queue: str = "default") -> tuple[str, str]:
    answer = await send(broker, "GET", f"/jobs/next?wait_ms=0&queue={queue}")
    assert answer.status == 200, answer
    delivery = answer.json()
    return delivery["task"]["id"], delivery["lease_id"]


Case = Callable[[Broker, Variant], Awaitable[RawResponse]]


async def same_both_ways(broker: Broker, case: Case, router_calls: list[str]) -> RawResponse:
    """Run ``case`` both ways; assert the answers match and that only the routed one went
    through the router; return the express lane's answer."""
    answers = []
    for variant in VARIANTS:
        before = len(router_calls)
        answers.append(await case(broker, variant))
        took_router = [c for c in router_calls[before:] if "%" in c]
        assert bool(took_router) == (variant is routed), (variant.__name__, router_calls[before:])
    assert normal(answers[0]) == normal(answers[1])
    return answers[0]


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


# -- the cases ------------------------------------------------------------------------------------


async def enqueue_ok(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "POST", v("/jobs"), _json({"payload": {"a": [1, 2]}, "priority": 3}))


async def enqueue_bad_json(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "POST", v("/jobs"), b'{"payload": ')


async def enqueue_bad_field(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "POST", v("/jobs"), _json({"payload": 1, "max_attempts": -1}))


async def enqueue_invalid_utf8(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "POST", v("/jobs"), b'{"payload": "\xff\xfe"}')


async def enqueue_duplicate(b: Broker, v: Variant) -> RawResponse:
    key = f"key-{tag(v)}"
    await send(b, "POST", v("/jobs"), _json({"payload": 1}), **{"Idempotency-Key": key})
    return await send(b, "POST", v("/jobs"), _json({"payload": 1}), **{"Idempotency-Key": key})


async def enqueue_two_keys(b: Broker, v: Variant) -> RawResponse:
    data = (
        f"POST {v('/jobs')} HTTP/1.1\r\nHost: wq\r\nIdempotency-Key: a\r\nIdempotency-Key: b\r\n"
        'Content-Length: 14\r\n\r\n{"payload": 1}'
    ).encode()
    return await exchange(address(b), data)


async def enqueue_compressed(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "POST", v("/jobs"), b"\x1f\x8b\x08\x00", **{"Content-Encoding": "gzip"})


async def enqueue_too_large(b: Broker, v: Variant) -> RawResponse:
    body = _json({"payload": "x" * (MAX_BODY + 10)})
    return await send(b, "POST", v("/jobs"), body)


async def enqueue_chunked(b: Broker, v: Variant) -> RawResponse:
    body = b'{"payload": {"chunked": true}}'
    data = (
        f"POST {v('/jobs')} HTTP/1.1\r\nHost: wq\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    )
    return await exchange(address(b), data)


async def enqueue_no_body(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "POST", v("/jobs"))


async def enqueue_http10(b: Broker, v: Variant) -> RawResponse:
    body = _json({"payload": "old"})
    data = f"POST {v('/jobs')} HTTP/1.0\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    return await exchange(address(b), data)


async def enqueue_closing(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "POST", v("/jobs"), _json({"payload": 1}), Connection="close")


async def enqueue_pipelined(b: Broker, v: Variant) -> RawResponse:
    """Three requests in one write: the answers come in order, the last one compared."""
    one = request("POST", v("/jobs"), _json({"payload": 1}))
    bad = request("POST", v("/jobs"), b"[]")
    async with raw_connection(address(b)) as conn:
        await conn.send(one + bad + one)
        statuses = [(await conn.response()).status for _ in range(2)]
        assert statuses == [201, 400]
        return await conn.response()


async def batch_ok(b: Broker, v: Variant) -> RawResponse:
    tasks = [{"payload": i, "idempotency_key": f"{tag(v)}-{i % 2}"} for i in range(3)]
    return await send(b, "POST", v("/jobs/batch"), _json({"tasks": tasks}))


async def batch_bad_task(b: Broker, v: Variant) -> RawResponse:
    tasks = [{"payload": 1}, {"payload": 2, "priority": 12}]
    return await send(b, "POST", v("/jobs/batch"), _json({"tasks": tasks}))


async def batch_with_key_header(b: Broker, v: Variant) -> RawResponse:
    body = _json({"tasks": [{"payload": 1}]})
    return await send(b, "POST", v("/jobs/batch"), body, **{"Idempotency-Key": "k"})


async def claim_empty(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "GET", v("/jobs/next") + "?wait_ms=0&queue=nothing-here")


async def claim_task(b: Broker, v: Variant) -> RawResponse:
    queue = "claim-task"  # (each variant claims what it just enqueued)
    await send(b, "POST", "/jobs", _json({"payload": {"q": 1}, "queue": queue}))
    return await send(b, "GET", v("/jobs/next") + f"?wait_ms=0&lease_ms=5000&queue={queue}")


async def claim_bad_wait(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "GET", v("/jobs/next") + "?wait_ms=soon")


async def claim_wait_twice(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "GET", v("/jobs/next") + "?wait_ms=0&wait_ms=1")


async def claim_huge_wait(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "GET", v("/jobs/next") + "?wait_ms=0&lease_ms=" + "9" * 40)


async def claim_with_body(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "GET", v("/jobs/next") + "?wait_ms=0&queue=nothing-here", b"ignored")


def settle(
    action: str, query: str = "", body: bytes | None = None, lease: str | None = None
) -> Case:
    async def case(b: Broker, v: Variant) -> RawResponse:
        queue = f"{action}-{len(query)}-{len(body or b'')}"  # (claimed at once, as above)
        await send(b, "POST", "/jobs", _json({"payload": 1, "queue": queue}))
        task_id, lease_id = await claim(b, queue)
        given = lease_id if lease is None else lease
        target = v(f"/jobs/{task_id}/{action}") + f"?lease_id={given}{query}"
        return await send(b, "POST", target, body)

    case.__name__ = f"{action}{query}{'-body' if body else ''}"
    return case


async def ack_unknown_task(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "POST", v("/jobs/0123456789abcdef/ack") + "?lease_id=x")


async def ack_without_lease(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "POST", v("/jobs/0123456789abcdef/ack"))


CASES: list[Case] = [
    enqueue_ok,
    enqueue_bad_json,
    enqueue_bad_field,
    enqueue_invalid_utf8,
    enqueue_duplicate,
    enqueue_two_keys,
    enqueue_compressed,
    enqueue_too_large,
    enqueue_chunked,
    enqueue_no_body,
    enqueue_http10,
    enqueue_closing,
    enqueue_pipelined,
    batch_ok,
    batch_bad_task,
    batch_with_key_header,
    claim_empty,
    claim_task,
    claim_bad_wait,
    claim_wait_twice,
    claim_huge_wait,
    claim_with_body,
    settle("ack"),
    settle("ack", body=b"an ack's body is not read"),
    settle("ack", lease="not-the-lease"),
    settle("ack", query="&lease_id=again"),
    settle("nack", body=_json({"error": "boom", "delay_ms": 0})),
    settle("nack", body=_json({"error": 12})),
    settle("nack", body=b"{not json"),
    settle("nack", body=_json({"terminal": True})),
    settle("extend", query="&lease_ms=60000"),
    settle("extend", query="&lease_ms=-5"),
    settle("extend", lease="nope"),
    ack_unknown_task,
    ack_without_lease,
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
async def test_the_express_lane_answers_as_the_router_does(
    broker: Broker, router_calls: list[str], case: Case
) -> None:
    await same_both_ways(broker, case, router_calls)


async def test_the_hot_requests_never_reach_the_router(
    broker: Broker, router_calls: list[str]
) -> None:
    await enqueue(broker)
    await send(broker, "POST", "/jobs/batch", _json({"tasks": [{"payload": 2}]}))
    task_id, lease_id = await claim(broker)
    await send(broker, "POST", f"/jobs/{task_id}/extend?lease_id={lease_id}")
    await send(broker, "POST", f"/jobs/{task_id}/nack?lease_id={lease_id}", b"{}")
    task_id, lease_id = await claim(broker)
    assert (await send(broker, "POST", f"/jobs/{task_id}/ack?lease_id={lease_id}")).status == 204
    assert router_calls == []
    # Anything else goes the router's way, unchanged.
    others = [
        ("GET", "/stats"),
        ("GET", f"/jobs/{task_id}"),
        ("HEAD", "/jobs/next"),
        ("PUT", "/jobs"),
        ("GET", "/jobs"),
        ("POST", "/jobs/"),
        ("POST", "//jobs"),
        ("POST", "/jobs/./ack"),
        ("POST", "/jobs/a.b/ack"),
        ("POST", "/jobs/a%2Fb/ack"),
        ("POST", "/jobs/x/ack/"),
        ("POST", "/jobs/x/bury"),
        ("POST", f"http://wq/jobs/{task_id}/ack"),
    ]
    for method, target in others:
        await send(broker, method, target)
    assert router_calls == [f"{m} {t}" for m, t in others]


async def test_an_expect_header_goes_the_routers_way(
    broker: Broker, router_calls: list[str]
) -> None:
    body = _json({"payload": 1})
    async with raw_connection(address(broker)) as conn:
        await conn.send(
            request(
                "POST", "/jobs", None, {"Expect": "100-continue", "Content-Length": str(len(body))}
            )
        )
        assert (await conn.response()).status == 100
        await conn.send(body)
        assert (await conn.response()).status == 201
    assert router_calls == ["POST /jobs"]


async def test_a_keep_alive_connection_mixes_both_ways(
    broker: Broker, router_calls: list[str]
) -> None:
    async with raw_connection(address(broker)) as conn:
        for target in ("/jobs", "/j%6Fbs", "/jobs"):
            await conn.send(request("POST", target, _json({"payload": target})))
            answer = await conn.response()
            assert answer.status == 201
            assert not answer.closes
    assert router_calls == ["POST /j%6Fbs"]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(task_id=st.text(alphabet="aZ09_~-.%2Fe", min_size=1, max_size=12))
async def test_any_task_id_gets_the_same_answer_both_ways(
    broker: Broker, router_calls: list[str], task_id: str
) -> None:
    async def ack(b: Broker, v: Variant) -> RawResponse:
        return await send(b, "POST", v(f"/jobs/{task_id}/ack") + "?lease_id=l")

    answers = [normal(await ack(broker, v)) for v in VARIANTS]
    assert answers[0] == answers[1]


async def test_tokens_are_checked_on_the_express_lane(
    tmp_path: Path, router_calls: list[str]
) -> None:
    tokens = write_token_file(tmp_path)
    async with running_broker(grpc_addr="off", token_file=str(tokens)) as b:

        def enqueue_as(token: str | None) -> Case:
            async def case(b: Broker, v: Variant) -> RawResponse:
                headers = bearer(token) if token else {}
                return await send(b, "POST", v("/jobs"), _json({"payload": 1}), **headers)

            return case

        for token in (None, "Bearer-less", ONLY["consume"], ONLY["produce"], ROOT):
            await same_both_ways(b, enqueue_as(token), router_calls)
        refused = await send(b, "POST", "/jobs", _json({"payload": 1}))
        assert refused.status == 401
        assert refused.header("WWW-Authenticate") == 'Bearer realm="wq"'
        forbidden = await send(b, "POST", "/jobs", _json({"payload": 1}), **bearer(ONLY["consume"]))
        assert forbidden.status == 403


async def test_express_requests_are_counted_by_route(broker: Broker) -> None:
    await enqueue(broker)
    await send(broker, "POST", "/j%6Fbs", _json({"payload": 1}))
    task_id, lease_id = await claim(broker)
    await send(broker, "POST", f"/jobs/{task_id}/ack?lease_id={lease_id}")
    metrics = (await send(broker, "GET", "/metrics")).body.decode()
    counted = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("wq_http_requests_total{")
    }
    assert counted['wq_http_requests_total{method="POST",route="/jobs",status="201"}'] == 2
    assert counted['wq_http_requests_total{method="GET",route="/jobs/next",status="200"}'] == 1
    assert counted['wq_http_requests_total{method="POST",route="/jobs/{id}/ack",status="204"}'] == 1
