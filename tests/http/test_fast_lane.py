"""The fast lane (``wqbroker/http/fast.py``): the hot requests are served without aiohttp, and get
the very answers aiohttp's way gives them; every other request (and the rest of a connection the
lane gives up) is aiohttp's.

Each request is sent twice, to a real broker over a bare socket: as is (the fast lane takes it)
and with one letter of its path percent-encoded (``/jobs/%6Eext``: the same route once aiohttp
decodes it, but the fast lane passes it to aiohttp). The two answers must be the same, byte for
byte once ids, lease ids and times are put aside: status, headers in order and body. A spy on
``Application._handle`` (aiohttp's way in) shows which way each request went.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from tests.helpers import examples, http_broker, wait_until
from tests.rawhttp import RawResponse, exchange, raw_connection, request
from wqbroker.broker import Broker
from wqbroker.http import core
from wqbroker.http.fast import _Routes
from wqbroker.http.server import Runner
from wqbroker.service import Service

MAX_BODY = 4096

# The same route, passed to aiohttp by the fast lane: the first letter of the last segment encoded.
Variant = Callable[[str], str]


def fast(path: str) -> str:
    return path


def routed(path: str) -> str:
    head, _, last = path.rpartition("/")
    return f"{head}/%{ord(last[0]):02X}{last[1:]}"


VARIANTS = (fast, routed)


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
    async with http_broker(max_body=MAX_BODY) as b:
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
    aiohttp's way; return the fast lane's answer."""
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


async def enqueue_without_host(b: Broker, v: Variant) -> RawResponse:
    body = _json({"payload": 1})
    data = f"POST {v('/jobs')} HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    return await exchange(address(b), data)


def enqueue_with(*extra: str) -> Case:
    """POST /jobs with these header lines as well."""

    async def case(b: Broker, v: Variant) -> RawResponse:
        body = _json({"payload": 1})
        lines = "".join(f"{line}\r\n" for line in extra)
        data = (
            f"POST {v('/jobs')} HTTP/1.1\r\nHost: wq\r\n{lines}Content-Length: {len(body)}\r\n\r\n"
        )
        return await exchange(address(b), data.encode() + body)

    case.__name__ = f"enqueue_with_{len(extra)}_{extra[0].split(':')[0] if extra else ''}"
    return case


async def enqueue_controlled(b: Broker, v: Variant) -> RawResponse:
    body = {"payload": 1, "expires_in_ms": 60_000, "timeout_ms": 500, "unique": True}
    return await send(b, "POST", v("/jobs"), _json(body), **{"Idempotency-Key": f"u-{tag(v)}"})


async def enqueue_bad_control(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "POST", v("/jobs"), _json({"payload": 1, "timeout_ms": 0}))


async def enqueue_unique_without_key(b: Broker, v: Variant) -> RawResponse:
    return await send(b, "POST", v("/jobs"), _json({"payload": 1, "unique": True}))


async def batch_controlled(b: Broker, v: Variant) -> RawResponse:
    tasks = [
        {"payload": 1, "expires_in_ms": 1000, "unique": True, "idempotency_key": f"bu-{tag(v)}"},
        {"payload": 2, "unique": True, "idempotency_key": f"bu-{tag(v)}"},
    ]
    return await send(b, "POST", v("/jobs/batch"), _json({"tasks": tasks}))


async def batch_bad_control(b: Broker, v: Variant) -> RawResponse:
    tasks = [{"payload": 1}, {"payload": 3, "timeout_ms": 31_536_000_001}]
    return await send(b, "POST", v("/jobs/batch"), _json({"tasks": tasks}))


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


def claim_batch(query: str, tasks: int = 0) -> Case:
    async def case(b: Broker, v: Variant) -> RawResponse:
        queue = f"batch-{len(query)}-{tasks}"
        for n in range(tasks):
            await send(b, "POST", "/jobs", _json({"payload": n, "queue": queue}))
        answer = await send(b, "GET", v("/jobs/next/batch") + f"?queue={queue}&wait_ms=0{query}")
        # What is left goes too: the other variant finds the queue as this one did.
        await send(b, "GET", f"/jobs/next/batch?queue={queue}&wait_ms=0&max=100")
        return answer

    case.__name__ = f"claim_batch{query}-{tasks}"
    return case


def settle_many(body: Callable[[str, str], Any]) -> Case:
    """POST /jobs/settle with the body ``body(task_id, lease_id)`` makes of a task just claimed."""

    async def case(b: Broker, v: Variant) -> RawResponse:
        queue = f"settle-{tag(v)}"
        await send(b, "POST", "/jobs", _json({"payload": 1, "queue": queue}))
        task_id, lease_id = await claim(b, queue)
        made = body(task_id, lease_id)
        data = made if isinstance(made, bytes) else _json(made)
        return await send(b, "POST", v("/jobs/settle"), data)

    return case


async def enqueue_after(b: Broker, v: Variant) -> RawResponse:
    parent = (await send(b, "POST", "/jobs", _json({"payload": 0, "queue": "after"}))).json()
    body = {"payload": 1, "queue": "after", "after": [parent["id"]], "result_ttl_ms": 5000}
    return await send(b, "POST", v("/jobs"), _json(body))


async def enqueue_after_unknown(b: Broker, v: Variant) -> RawResponse:
    body = {"payload": 1, "after": ["0123456789abcdef"]}
    return await send(b, "POST", v("/jobs"), _json(body))


async def batch_with_a_graph(b: Broker, v: Variant) -> RawResponse:
    tasks = [{"payload": 0}, {"payload": 1, "after": [0]}, {"payload": 2, "after": [0, 1]}]
    return await send(b, "POST", v("/jobs/batch"), _json({"tasks": tasks}))


async def batch_with_a_later_index(b: Broker, v: Variant) -> RawResponse:
    tasks = [{"payload": 0, "after": [1]}, {"payload": 1}]
    return await send(b, "POST", v("/jobs/batch"), _json({"tasks": tasks}))


async def result_of_a_task(b: Broker, v: Variant) -> RawResponse:
    queue = f"result-{tag(v)}"
    await send(b, "POST", "/jobs", _json({"payload": 1, "queue": queue}))
    task_id, lease_id = await claim(b, queue)
    ack = await send(b, "POST", f"/jobs/{task_id}/ack?lease_id={lease_id}", b'{"result": [1]}')
    assert ack.status == 204, ack
    return await send(b, "GET", v(f"/jobs/{task_id}/result") + "?wait_ms=0")


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
    enqueue_with(*(f"X-H{i}: {i}" for i in range(126))),  # 128 in all, with Host and the length
    enqueue_with("Content-Encoding: identity"),
    enqueue_with("Connection: keep-alive, Close"),
    enqueue_with("X-Spaced:   padded value   \t"),
    enqueue_with("X-Empty:"),
    enqueue_controlled,
    enqueue_bad_control,
    enqueue_unique_without_key,
    batch_controlled,
    batch_bad_control,
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
    settle("ack", body=b"an ack's body is read: this is no JSON"),
    # An ack's result (docs/design/results.md).
    settle("ack", body=_json({"result": {"n": [1.10, None]}})),
    settle("ack", body=b'{"result": null}'),
    settle("ack", body=b"{}"),
    settle("ack", body=b'{"result": NaN}'),
    settle("ack", body=b'{"result": "\xff"}'),
    settle("ack", body=b"[1]"),
    settle("ack", body=_json({"result": 1}), lease="nope"),
    settle("ack", lease="not-the-lease"),
    settle("ack", query="&lease_id=again"),
    settle("nack", body=_json({"error": "boom", "delay_ms": 0})),
    settle("nack", body=_json({"error": 12})),
    settle("nack", body=b"{not json"),
    settle("nack", body=_json({"terminal": True})),
    settle("extend", query="&lease_ms=60000"),
    settle("extend", query="&lease_ms=-5"),
    settle("extend", lease="nope"),
    settle("extend", body=_json({"progress": {"done": 1.10, "of": [3]}})),
    settle("extend", body=_json({"progress": None, "other": 1})),
    settle("extend", body=b"  \r\n"),
    settle("extend", body=b"{not json"),
    settle("extend", body=b"[1]"),
    settle("extend", body=_json({"progress": "x" * 4000})),
    settle("extend", body=_json({"progress": 1}), lease="nope"),
    ack_unknown_task,
    ack_without_lease,
    claim_batch("&max=3", tasks=5),
    claim_batch("&max=3", tasks=1),
    claim_batch("&max=3"),
    claim_batch("&max=0"),
    claim_batch("&max=many"),
    claim_batch("&max=2&max=3"),
    claim_batch("&max=" + "9" * 30, tasks=2),
    claim_batch("&lease_ms=5000", tasks=2),
    settle_many(lambda t, lease: {"acks": [{"id": t, "lease_id": lease}]}),
    settle_many(lambda t, lease: {"acks": [{"id": t, "lease_id": "x"}], "nacks": []}),
    settle_many(lambda t, lease: {"nacks": [{"id": t, "lease_id": lease, "error": "e"}]}),
    settle_many(lambda t, lease: {"nacks": [{"id": t, "lease_id": lease, "terminal": True}]}),
    settle_many(lambda t, lease: {"acks": [{"id": t, "lease_id": lease}, {"id": t}]}),
    settle_many(lambda t, lease: {"acks": {"id": t}}),
    settle_many(lambda t, lease: {"acks": [], "nacks": [7]}),
    settle_many(lambda t, lease: b"{not json"),
    settle_many(lambda t, lease: b""),
    settle_many(lambda t, lease: {"acks": [{"id": t, "lease_id": lease, "result": [1.5]}]}),
    settle_many(
        lambda t, lease: (
            f'{{"acks": [{{"id": "{t}", "lease_id": "{lease}", "res\\u0075lt": 1}}]}}'.encode()
        )
    ),
    enqueue_after,
    enqueue_after_unknown,
    batch_with_a_graph,
    batch_with_a_later_index,
    result_of_a_task,
]


# Requests aiohttp's parser refuses (400) before any route: the lane leaves them to it.
REFUSED: list[Case] = [
    enqueue_without_host,
    enqueue_with("Host: again"),
    enqueue_with("Content-Type: a", "Content-Type: b"),
    enqueue_with("User-Agent: a", "User-Agent: b"),
    enqueue_with(*(f"X-H{i}: {i}" for i in range(127))),  # 129 in all
    enqueue_with("Sec-WebSocket-Key1: x"),
]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.__name__)
async def test_what_aiohttps_parser_refuses_is_refused_the_same_way(
    broker: Broker, router_calls: list[str], case: Case
) -> None:
    answers = [await case(broker, variant) for variant in VARIANTS]
    assert normal(answers[0]) == normal(answers[1])
    assert answers[0].status == 400
    assert router_calls == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
async def test_the_fast_lane_answers_as_aiohttp_does(
    broker: Broker, router_calls: list[str], case: Case
) -> None:
    await same_both_ways(broker, case, router_calls)


async def test_the_hot_requests_never_reach_aiohttp(
    broker: Broker, router_calls: list[str]
) -> None:
    await enqueue(broker)
    await send(broker, "POST", "/jobs/batch", _json({"tasks": [{"payload": 2}]}))
    task_id, lease_id = await claim(broker)
    await send(broker, "POST", f"/jobs/{task_id}/extend?lease_id={lease_id}")
    progress = _json({"progress": {"step": 2}})
    extended = await send(broker, "POST", f"/jobs/{task_id}/extend?lease_id={lease_id}", progress)
    assert extended.status == 200, extended
    await send(broker, "POST", f"/jobs/{task_id}/nack?lease_id={lease_id}", b"{}")
    task_id, lease_id = await claim(broker)
    assert (await send(broker, "POST", f"/jobs/{task_id}/ack?lease_id={lease_id}")).status == 204
    await enqueue(broker)
    batch = (await send(broker, "GET", "/jobs/next/batch?wait_ms=0&max=5")).json()["deliveries"]
    acks = [{"id": d["task"]["id"], "lease_id": d["lease_id"]} for d in batch]
    settled = await send(broker, "POST", "/jobs/settle", _json({"acks": acks}))
    assert settled.json() == {"acks": [None], "nacks": []}
    assert router_calls == []
    # Anything else goes aiohttp's way, unchanged.
    others = [
        ("GET", "/stats"),
        ("GET", f"/jobs/{task_id}"),
        ("DELETE", f"/jobs/{task_id}"),
        ("GET", "/jobs?queue=default&state=ready"),
        ("POST", "/queues/default/empty"),
        ("DELETE", "/queues/default"),
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


async def test_an_expect_header_goes_aiohttps_way(broker: Broker, router_calls: list[str]) -> None:
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
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(task_id=st.text(alphabet="aZ09_~-.%2Fe", min_size=1, max_size=12))
async def test_any_task_id_gets_the_same_answer_both_ways(
    broker: Broker, router_calls: list[str], task_id: str
) -> None:
    async def ack(b: Broker, v: Variant) -> RawResponse:
        return await send(b, "POST", v(f"/jobs/{task_id}/ack") + "?lease_id=l")

    answers = [normal(await ack(broker, v)) for v in VARIANTS]
    assert answers[0] == answers[1]


async def test_tokens_are_checked_on_the_fast_lane(tmp_path: Path, router_calls: list[str]) -> None:
    tokens = write_token_file(tmp_path)
    async with http_broker(token_file=str(tokens)) as b:

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


async def test_fast_lane_requests_are_counted_by_route(broker: Broker) -> None:
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


@pytest.mark.parametrize(
    "config", [{"http_fast_lane": False}, {"access_log": True}], ids=["lane-off", "access-log"]
)
async def test_without_the_lane_aiohttp_serves_every_connection_with_the_same_answers(
    router_calls: list[str], config: dict[str, Any]
) -> None:
    """``-http-fast-lane=false`` (or the access log, which sees only aiohttp's requests): no
    connection is the lane's, every request goes aiohttp's way, and each case of the
    differential test gets the answer the lane gives it."""
    async with (
        http_broker(max_body=MAX_BODY) as lane,
        http_broker(max_body=MAX_BODY, **config) as plain,
    ):
        async with raw_connection(address(lane)) as held, raw_connection(address(plain)) as kept:
            await held.send(request("POST", "/jobs", _json({"payload": 1})))
            await kept.send(request("POST", "/jobs", _json({"payload": 1})))
            assert (await held.response()).status == (await kept.response()).status == 201
            assert (lane_connections(lane), lane_connections(plain)) == (1, 0)
        for case in CASES:
            expected = normal(await case(lane, fast))
            before = len(router_calls)
            got = normal(await case(plain, fast))
            assert got == expected, case.__name__
            assert router_calls[before:], case.__name__  # (aiohttp's way, all of them)
        assert lane_connections(plain) == 0
        metrics = (await send(plain, "GET", "/metrics")).body.decode()
        assert (
            'wq_http_requests_total{method="POST",route="/jobs/{id}/ack",status="204"}' in metrics
        )


async def _no_content(service: Service, request: core.Request) -> core.Answer:
    return core.NO_CONTENT


def test_the_lane_finds_a_hot_row_and_its_path_parameters_by_method_and_path() -> None:
    """A row with several parameters, rows that share a prefix, a plain one: each found by its
    own method and path only, its parameters read from the path (the table has none of these
    yet: a route added to it is served by the lane as it is by aiohttp)."""
    two = core.Route("POST", "/things/{kind}/items/{item}/touch", _no_content, hot=True)
    one = core.Route("POST", "/things/{kind}/touch", _no_content, hot=True)
    get = core.Route("GET", "/things/{kind}", _no_content, hot=True)
    plain = core.Route("POST", "/things", _no_content, hot=True)
    table = _Routes([two, one, get, plain])

    def found(method: str, path: str, *names: str) -> tuple[core.Route, list[str]] | None:
        hit = table.find(method, path)
        if hit is None:
            return None
        hot, match = hit
        assert (match is None) == (not names)
        return hot.route, [match[hot.groups[n]] for n in names] if match else []

    assert found("POST", "/things/a-1/items/b~2/touch", "kind", "item") == (two, ["a-1", "b~2"])
    assert found("POST", "/things/a/touch", "kind") == (one, ["a"])
    assert found("GET", "/things/a", "kind") == (get, ["a"])
    assert found("POST", "/things") == (plain, [])
    for method, path in [
        ("GET", "/things/a/touch"),
        ("POST", "/things/a"),
        ("POST", "/things/a.b/touch"),  # (a parameter of the plain characters only)
        ("POST", "/things/a/items//touch"),
        ("PUT", "/things"),
    ]:
        assert table.find(method, path) is None, (method, path)
    with pytest.raises(ValueError, match="no patterns"):
        _Routes([core.Route("GET", "/x/{id}", _no_content, hot=True, patterns=(("id", "a"),))])


# -- the lane's own handling of a connection ------------------------------------------------------


async def test_a_connection_goes_on_in_the_lane_after_a_request_passed_to_aiohttp(
    broker: Broker, router_calls: list[str]
) -> None:
    """Pipelined: fast, passed (another route), fast, passed (HTTP/1.0 with keep-alive), fast:
    the answers come in order, and only the two passed requests go aiohttp's way."""
    one = request("POST", "/jobs", _json({"payload": 1}))
    stats = request("GET", "/stats")
    old = (
        b'POST /jobs HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 14\r\n\r\n{"payload": 2}'
    )
    async with raw_connection(address(broker)) as conn:
        await conn.send(one + stats + one + old + one)
        answers = [await conn.response() for _ in range(5)]
        assert [a.status for a in answers] == [201, 200, 201, 201, 201]
        assert answers[1].json()["ready"] == 1  # (answered after the first, before the rest)
        assert not any(a.closes for a in answers)
        await conn.send(one)  # and the connection is still the lane's
        assert (await conn.response()).status == 201
    assert router_calls == ["GET /stats", "POST /jobs"]


async def test_a_request_whose_end_needs_a_parser_hands_the_connection_over_for_good(
    broker: Broker, router_calls: list[str]
) -> None:
    chunked = (
        b"POST /jobs HTTP/1.1\r\nHost: wq\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"e\r\n" + b'{"payload": 3}' + b"\r\n0\r\n\r\n"
    )
    one = request("POST", "/jobs", _json({"payload": 1}))
    async with raw_connection(address(broker)) as conn:
        await conn.send(one + chunked + one)
        assert [(await conn.response()).status for _ in range(3)] == [201, 201, 201]
    # The fast lane answered the first; aiohttp the chunked one and all that followed.
    assert router_calls == ["POST /jobs", "POST /jobs"]
    assert (await send(broker, "GET", "/stats")).json()["ready"] == 3


async def test_bytes_that_are_no_head_are_aiohttps_to_refuse_at_once(broker: Broker) -> None:
    for data in (b"\x16\x03\x01\x02\x00", b"GET /jobs/next HTTP/1.1\nHost: wq\n\n"):
        async with raw_connection(address(broker)) as conn:
            await conn.send(data)
            answer = await conn.response(timeout=2)  # (not the head time-out's 408)
            assert answer.status == 400, answer
            assert await conn.closed()


LANE_ON_OFF = pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "aiohttp-only"])


@LANE_ON_OFF
async def test_a_body_that_does_not_come_gets_408_and_the_connection_is_closed(
    fast_lane: bool,
) -> None:
    async with http_broker(read_body_timeout=0.3, http_fast_lane=fast_lane) as b:
        async with raw_connection(b.http_addresses[0]) as conn:
            await conn.send(b"POST /jobs HTTP/1.1\r\nHost: wq\r\nContent-Length: 50\r\n\r\n{")
            answer = await conn.response()
            assert answer.status == 408
            assert answer.json() == {"error": "request body not received within 300 ms"}
            assert answer.closes
            assert await conn.closed()
        stats = (await send(b, "GET", "/stats")).json()
        assert stats["totals"]["enqueued"] == 0
        metrics = (await send(b, "GET", "/metrics")).body.decode()
        assert 'wq_http_requests_total{method="POST",route="/jobs",status="408"} 1.0' in metrics


async def test_a_body_sent_in_pieces_is_read_whole(broker: Broker, router_calls: list[str]) -> None:
    body = _json({"payload": {"pieces": "x" * 3000}})
    async with raw_connection(address(broker)) as conn:
        await conn.send(request("POST", "/jobs", body)[: -len(body) + 5])
        for start in range(5, len(body), 700):
            await asyncio.sleep(0.01)
            await conn.send(body[start : start + 700])
        assert (await conn.response()).status == 201
    assert router_calls == []


async def test_an_ack_with_its_result_still_to_come_waits_for_it_in_the_lane(
    broker: Broker, router_calls: list[str]
) -> None:
    """An ack reads its body (an optional result, docs/design/results.md): the lane waits for
    it, as for an extend's progress."""
    await enqueue(broker)
    task_id, lease_id = await claim(broker)
    body = _json({"result": {"pieces": "z" * 50}})
    data = request("POST", f"/jobs/{task_id}/ack?lease_id={lease_id}", body)
    async with raw_connection(address(broker)) as conn:
        await conn.send(data[:-20])
        await asyncio.sleep(0.05)
        await conn.send(data[-20:] + request("POST", "/jobs", _json({"payload": 1})))
        assert (await conn.response()).status == 204
        assert (await conn.response()).status == 201
    assert router_calls == []
    found = await send(broker, "GET", f"/jobs/{task_id}/result")
    assert found.json()["result"] == {"pieces": "z" * 50}


async def test_an_extend_with_its_progress_still_to_come_waits_for_it_in_the_lane(
    broker: Broker, router_calls: list[str]
) -> None:
    """An extend reads its body (the progress): the lane waits for it, as for an enqueue's."""
    await enqueue(broker)
    task_id, lease_id = await claim(broker)
    body = _json({"progress": {"pieces": "y" * 50}})
    data = request("POST", f"/jobs/{task_id}/extend?lease_id={lease_id}", body)
    async with raw_connection(address(broker)) as conn:
        await conn.send(data[:-20])
        await asyncio.sleep(0.05)
        await conn.send(data[-20:])
        assert (await conn.response()).status == 200
    assert router_calls == []
    found = await send(broker, "GET", f"/jobs/{task_id}")
    assert found.json()["progress"] == {"pieces": "y" * 50}


@LANE_ON_OFF
async def test_a_request_head_that_does_not_come_gets_408(fast_lane: bool) -> None:
    async with http_broker(read_header_timeout=0.3, http_fast_lane=fast_lane) as b:
        async with raw_connection(b.http_addresses[0]) as conn:
            await conn.send(request("POST", "/jobs", _json({"payload": 1})))
            assert (await conn.response()).status == 201
            await conn.send(b"POST /jobs HTTP/1.1\r\nHost")
            answer = await conn.response()
            assert answer.status == 408
            assert "request line and headers not received within 300 ms" in answer.json()["error"]
            assert await conn.closed()


@LANE_ON_OFF
async def test_an_idle_connection_is_closed_and_a_busy_one_is_not(fast_lane: bool) -> None:
    async with http_broker(idle_timeout=0.3, http_fast_lane=fast_lane) as b:
        async with (
            raw_connection(b.http_addresses[0]) as idle,
            raw_connection(b.http_addresses[0]) as polling,
        ):
            await idle.send(request("POST", "/jobs", _json({"payload": 1})))
            assert (await idle.response()).status == 201
            await polling.send(request("GET", "/jobs/next?wait_ms=1000&queue=none-yet"))
            assert await idle.closed(timeout=3)
            # The long-poll outlived the idle time-out: nothing times out while it is answered.
            assert (await polling.response()).status == 204


def lane_connections(broker: Broker) -> int:
    runner = broker._runner
    assert isinstance(runner, Runner)
    return runner.fast_connections


async def test_a_client_that_goes_away_mid_body_enqueues_nothing(broker: Broker) -> None:
    async with raw_connection(address(broker)) as conn:
        await conn.send(
            b'POST /jobs HTTP/1.1\r\nHost: wq\r\nContent-Length: 100\r\n\r\n{"payload":'
        )
        await wait_until(lambda: lane_connections(broker) == 1, what="the lane to hold it")
    await wait_until(lambda: lane_connections(broker) == 0, what="the lane to let it go")
    stats = (await send(broker, "GET", "/stats")).json()
    assert (stats["ready"], stats["totals"]["enqueued"]) == (0, 0)


async def test_a_long_poll_whose_client_went_away_is_handed_nothing(broker: Broker) -> None:
    async with raw_connection(address(broker)) as conn:
        await conn.send(request("GET", "/jobs/next?wait_ms=10000&queue=gone"))
        await wait_until(lambda: broker.service.parked_polls == 1, what="the poll to park")
    await wait_until(lambda: broker.service.parked_polls == 0, what="the poll to leave")
    await send(broker, "POST", "/jobs", _json({"payload": 1, "queue": "gone"}))
    answer = await send(broker, "GET", "/jobs/next?wait_ms=0&queue=gone")
    assert answer.status == 200
    assert answer.json()["task"]["attempts"] == 1  # the first to be handed it


async def test_a_flood_of_pipelined_requests_is_answered_in_order(broker: Broker) -> None:
    n = 400
    data = b"".join(request("POST", "/jobs", _json({"payload": i})) for i in range(n))
    async with raw_connection(address(broker)) as conn:
        await conn.send(data)
        ids = [(await conn.response()).json()["id"] for _ in range(n)]
    assert len(set(ids)) == n
    got = []
    for _ in range(n):
        answer = await send(broker, "GET", "/jobs/next?wait_ms=0")
        got.append(answer.json()["task"]["payload"])
    assert got == list(range(n))


async def test_a_client_that_reads_no_answers_is_not_buffered_without_end(
    broker: Broker,
) -> None:
    """Pipelined requests from a client that reads nothing: once its answers wait to be
    written, the lane stops reading (rather than parsing, and answering, without end), so the
    client's own writes stop going out; and the broker serves others meanwhile."""
    one = request("GET", "/jobs/next?wait_ms=0&queue=nothing-here")
    host, _, port = address(broker).rpartition(":")
    _, writer = await asyncio.open_connection(host, int(port))
    sent = 0

    async def flood() -> None:
        nonlocal sent
        while sent < 50_000_000:
            writer.write(one * 1000)
            await writer.drain()
            sent += 1000 * len(one)

    try:
        done, _ = await asyncio.wait([asyncio.ensure_future(flood())], timeout=3)
        assert not done  # held back: the broker stopped reading
        assert sent < 20_000_000, sent  # what the sockets' buffers hold, give or take
        assert (await send(broker, "GET", "/healthz")).status == 200
    finally:
        writer.transport.abort()


async def test_an_application_with_another_middleware_is_served_all_aiohttps_way() -> None:
    from aiohttp import web as aioweb

    from wqbroker.clock import FakeClock
    from wqbroker.http import create_app, make_runner
    from wqbroker.service import Service
    from wqbroker.store.memory import MemoryStore

    seen: list[str] = []

    @aioweb.middleware
    async def note(
        request: aioweb.Request,
        handler: Callable[[aioweb.Request], Awaitable[aioweb.StreamResponse]],
    ) -> aioweb.StreamResponse:
        seen.append(request.path)
        return await handler(request)

    app = create_app(Service(MemoryStore(), FakeClock()))
    app.middlewares.append(note)
    runner = make_runner(app)
    await runner.setup()
    try:
        site = aioweb.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        answer = await exchange(f"{host}:{port}", request("POST", "/jobs", _json({"payload": 1})))
        assert answer.status == 201
        assert seen == ["/jobs"]  # the added middleware saw it: the lane did not take it
    finally:
        await runner.cleanup()


async def test_the_broker_stops_with_connections_in_the_lane() -> None:
    async with http_broker() as b:
        idle = raw_connection(b.http_addresses[0])
        conn = await idle.__aenter__()
        await conn.send(request("POST", "/jobs", _json({"payload": 1})))
        assert (await conn.response()).status == 201
        polling = raw_connection(b.http_addresses[0])
        poll = await polling.__aenter__()
        await poll.send(request("GET", "/jobs/next?wait_ms=30000&queue=later"))
        await wait_until(lambda: b.service.parked_polls == 1, what="the poll to park")
    # Stopped: the parked poll was answered (nothing came), both connections closed.
    assert (await poll.response()).status == 204
    assert await conn.closed(timeout=5)
    assert await poll.closed(timeout=5)
    await idle.__aexit__(None, None, None)
    await polling.__aexit__(None, None, None)


@pytest.mark.parametrize("digits", [16, 5000])
async def test_a_content_length_of_very_many_digits_is_aiohttps_to_refuse(
    broker: Broker, digits: int
) -> None:
    data = b"POST /jobs HTTP/1.1\r\nHost: wq\r\nContent-Length: " + b"9" * digits + b"\r\n\r\n{}"
    answer = await exchange(address(broker), data)
    assert answer.status in (400, 413), answer
    assert "error" in answer.json()
    assert (await send(broker, "GET", "/healthz")).status == 200


# -- the same bytes, the same answers -------------------------------------------------------------

_POOL: list[bytes] = [
    request("POST", "/jobs", _json({"payload": {"n": 1}})),
    request("POST", "/jobs", b'{"payload": '),
    request("POST", "/jobs", _json({"payload": 1, "priority": 42})),
    request("POST", "/jobs/batch", _json({"tasks": [{"payload": 1}, {"payload": 2}]})),
    request("GET", "/jobs/next?wait_ms=0"),
    request("GET", "/jobs/next?wait_ms=zero"),
    request("POST", "/jobs/0123456789abcdef/ack?lease_id=x"),
    request("POST", "/jobs/0123456789abcdef/nack?lease_id=x", b"{not json"),
    request("POST", "/jobs/0123456789abcdef/extend?lease_id=x&lease_ms=-1"),
    request("GET", "/stats"),
    request("GET", "/j%6Fbs/next?wait_ms=0"),
    request("POST", "/jobs", _json({"payload": 1}), {"Connection": "close"}),
    request("POST", "/jobs", _json({"payload": 1}), {"Content-Encoding": "gzip"}),
    b"POST /jobs HTTP/1.0\r\nContent-Length: 14\r\n\r\n" + b'{"payload": 3}',
    b"POST /jobs HTTP/1.1\r\nHost: wq\r\nTransfer-Encoding: chunked\r\n\r\n"
    b'e\r\n{"payload": 4}\r\n0\r\n\r\n',
    request("GET", "/jobs/next/batch?wait_ms=0&max=3"),
    request("POST", "/jobs/settle", _json({"acks": [{"id": "0123456789abcdef", "lease_id": "x"}]})),
    request("POST", "/jobs/settle", _json({"nacks": [{"id": 1}]})),
]
# What aiohttp's parser refuses: when that comes in the same read as requests before it, aiohttp
# answers the 400 alone (the requests before are lost with it); the lane answers them first.
# So it is sent last, on its own, after the others are read.
_MALFORMED: list[bytes] = [
    b"GET /stats HTTP/1.1\nHost: wq\n\n",
    b"\x00\x01garbage\r\n\r\n",
    b"POST /jobs HTTP/1.1\r\nHost: wq\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
]
_CLOSING_PICKS = frozenset({11, 12, 13})  # Connection: close, a 415, HTTP/1.0 (in _POOL)


async def _all_answers(addr: str, data: bytes, cuts: list[int], tail: bytes) -> list[Any]:
    """Send ``data`` in pieces (cut at ``cuts``), then ``tail`` on its own; read every answer
    until the connection ends or half a second passes without one; their normal forms."""
    answers: list[Any] = []
    async with raw_connection(addr) as conn:
        start = 0
        for cut in [*sorted(set(cuts)), len(data)]:
            if cut > start:
                with contextlib.suppress(ConnectionError):
                    await conn.send(data[start:cut])
                await asyncio.sleep(0.001)
                start = cut
        if tail:
            await asyncio.sleep(0.05)
            with contextlib.suppress(ConnectionError):
                await conn.send(tail)
        while True:
            try:
                answer = await conn.response(timeout=0.5)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                break
            answers.append(normal(answer))
    return answers


@settings(
    max_examples=examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    picks=st.lists(st.integers(0, len(_POOL) - 1), min_size=1, max_size=6),
    cuts=st.lists(st.integers(0, 4000), max_size=6),
    tail=st.sampled_from([b"", *_MALFORMED]),
)
async def test_any_bytes_get_the_answers_aiohttp_alone_gives(
    picks: list[int], cuts: list[int], tail: bytes
) -> None:
    """The same bytes, in the same pieces, to a broker with the fast lane and to one without it
    (``-http-fast-lane=false``: every request is aiohttp's): the same answers, in the same order.

    Nothing follows a request that ends the connection (``Connection: close``, HTTP/1.0): the
    lane answers it and reads no further (RFC 9112, section 9.6), where aiohttp's parser
    answers 400 when more bytes came in the same read as the request, and not otherwise."""
    closing = [i for i, pick in enumerate(picks) if pick in _CLOSING_PICKS]
    if closing:
        picks, tail = picks[: closing[0] + 1], b""
    data = b"".join(_POOL[i] for i in picks)
    async with (
        http_broker() as lane,
        http_broker(http_fast_lane=False) as plain,
    ):
        got = await _all_answers(lane.http_addresses[0], data, cuts, tail)
        expected = await _all_answers(plain.http_addresses[0], data, cuts, tail)
    assert got == expected
