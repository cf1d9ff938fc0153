"""Hostile input, generated: random bytes as bodies on every POST route, random JSON (deep, huge
numbers, odd escapes), random headers, random paths and query strings, each test against ONE live
broker (memory store; the body and JSON ones against SQLite too).

The rule for every answer: no 5xx (nothing here shuts the broker down, so not even 503), no hang
(every exchange is bounded by a client time-out), a body that is JSON (an error's names the
problem), and a normal request still served right after. After each test: ``/healthz`` is 200,
a normal enqueue, claim and ack still work, ``nacked + reclaimed == retried + buried``, and the
gauges account for every task (``ready + handed_out + delayed + dead + acked + purged ==
enqueued``).

Hypothesis runs a synchronous test; the broker lives on an event loop of its own, run for each
example (as the store state machine does), so one broker serves every example of a test.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Coroutine, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import Http, examples, http_broker, invariant_holds, make_store
from tests.rawhttp import RawResponse, exchange, raw_connection
from wqbroker.broker import Broker
from wqbroker.retry import Backoff

T = TypeVar("T")

pytestmark = pytest.mark.timeout(300)

EXAMPLES = settings(
    max_examples=examples(100),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CLIENT_TIMEOUT = 10.0  # a hang fails the example


# -- one live broker per test ---------------------------------------------------------------------


class Live:
    """A broker (HTTP on port 0) on an event loop of its own, and a client session on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, broker: Broker, http: Http) -> None:
        self.loop = loop
        self.broker = broker
        self.http = http

    @property
    def address(self) -> str:
        return self.broker.http_addresses[0]

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, CLIENT_TIMEOUT))

    async def still_serves(self) -> None:
        """A normal request right after a hostile one is answered normally."""
        status, body = await self.http.request("GET", "/healthz")
        assert (status, body) == (200, {"status": "ok"})

    async def held_task(self) -> tuple[str, str]:
        """A task held under a lease (id, lease id), for acks and nacks to aim at."""
        await self.http.enqueue({"held": True}, max_attempts=2)
        task_id, lease_id, _ = await claim_now(self.http)
        return task_id, lease_id

    async def healthy(self) -> None:
        """The end of every test: health, a normal round trip, the invariant, the gauges."""
        await self.still_serves()
        task_id = await self.http.enqueue({"after": "hostile input"})
        while True:  # past whatever the test left ready
            got, lease_id, raw = await claim_now(self.http)
            assert await self.http.ack(got, lease_id) == 204
            if got == task_id:
                assert b'"payload":' + json.dumps({"after": "hostile input"}).encode() in raw
                break
        stats = await self.http.stats()
        assert invariant_holds(stats), stats
        gauges = stats["ready"] + stats["handed_out"] + stats["delayed"] + stats["dead"]
        gone = stats["totals"]["acked"] + stats["totals"]["purged"]
        assert gauges + gone == stats["totals"]["enqueued"], stats


@contextmanager
def live_broker(backend: str, tmp_path: Path) -> Iterator[Live]:
    loop = asyncio.new_event_loop()
    stack = AsyncExitStack()

    async def start() -> Live:
        rng = random.Random(7)
        store = await make_store(backend, Backoff(1.0, 30.0, rng), rng, tmp_path)
        broker = await stack.enter_async_context(
            http_broker(
                store=store,
                read_header_timeout=2.0,
                read_body_timeout=0.5,
                idle_timeout=5.0,
            )
        )
        session = await stack.enter_async_context(aiohttp.ClientSession())
        return Live(loop, broker, Http(session, broker.http_url))

    try:
        live = loop.run_until_complete(start())
        yield live
        live.run(live.healthy())
    finally:
        loop.run_until_complete(stack.aclose())
        loop.close()


_CLAIMED = re.compile(
    rb'\{"task":\{"id":"([^"]+)",.*,"lease_id":"([^"]+)","deadline":"[^"]+"\}', re.S
)


async def claim_now(http: Http) -> tuple[str, str, bytes]:
    """Claim a ready task: its id, the lease id and the whole answer. The answer is not decoded:
    a payload may hold what the broker accepts but Python's json module does not (an integer of
    5000 digits, nesting deeper than this test's stack allows)."""
    async with http.session.get(http.base + "/jobs/next?wait_ms=0") as resp:
        raw = await resp.read()
    assert resp.status == 200, (resp.status, raw[:300])
    claimed = _CLAIMED.fullmatch(raw)
    assert claimed is not None, raw[:300]
    task_id, lease_id = (group.decode() for group in claimed.groups())
    return task_id, lease_id, raw


# -- what every answer must be ------------------------------------------------------------------


def check_answer(status: int, body: bytes, *, head: bool = False) -> Any:
    """No 5xx; a body, if any, is JSON; an error's is ``{"error": "..."}``."""
    assert status < 500, (status, body[:300])
    if head or not body:
        return None
    try:
        value = json.loads(body, parse_int=str, parse_float=str)  # numbers of any size
    except ValueError:
        raise AssertionError(f"a {status} answer whose body is not JSON: {body[:300]!r}") from None
    if status >= 400:
        assert isinstance(value, dict), value
        assert isinstance(value.get("error"), str), value
        assert value["error"], value
    return value


async def post(live: Live, path: str, data: bytes) -> tuple[int, Any]:
    async with live.http.session.post(live.http.base + path, data=data) as resp:
        raw = await resp.read()
        return resp.status, check_answer(resp.status, raw)


def check_raw(response: RawResponse, *, head: bool = False) -> Any:
    return check_answer(response.status, response.body, head=head)


# -- strategies ---------------------------------------------------------------------------------

DIGITS = "0123456789"
# Integers as text: any, around the int64 bounds, and past Python's 4300-digit int(str) limit.
_digits = st.one_of(
    st.text(DIGITS, min_size=1, max_size=30),
    st.integers(4290, 6000).map(lambda n: "9" * n),
    st.tuples(st.integers(1, 9), st.integers(4300, 6000)).map(lambda p: str(p[0]) * p[1]),
).map(lambda d: d.lstrip("0") or "0")
INT_TEXT = st.one_of(
    st.integers().map(str),
    st.integers(2**63 - 3, 2**63 + 3).map(str),
    st.integers(-(2**63) - 3, -(2**63) + 3).map(str),
    _digits,
    _digits.map(lambda d: "-" + d),
    st.sampled_from(["0", "-0", "1", "3", "2147483647", "2147483648", "31536000000", "-1"]),
)
FLOAT_TEXT = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(["1e999999", "-1e999999", "1e-999999", "0.0", "-0.0", "1E5", "2e+10", "1.5"]),
    st.tuples(_digits, _digits).map(lambda p: f"{p[0]}.{p[1]}e-{len(p[1])}"),
)
# Strings: any text (as json.dumps escapes it, or not), and escapes Python would decode to lone
# surrogates (valid JSON text; not valid Unicode).
PLAIN_STRING_TEXT = st.one_of(
    st.text(max_size=50).map(lambda t: json.dumps(t, ensure_ascii=False)),
    st.text(max_size=50).map(json.dumps),
    st.sampled_from(['"\\u0000"', '"\\/"', '"\\b\\f\\n\\r\\t"', '"\\ud800\\udc00"', '""']),
)
ODD_STRING_TEXT = st.sampled_from(['"\\ud800"', '"\\udfff"', '"\\udfff\\ud800"', '"a\\ud800b"'])
STRING_TEXT = st.one_of(PLAIN_STRING_TEXT, ODD_STRING_TEXT)
SCALAR_TEXT = st.one_of(
    st.sampled_from(["null", "true", "false"]), INT_TEXT, FLOAT_TEXT, STRING_TEXT
)


def _array(items: list[str]) -> str:
    return "[" + ",".join(items) + "]"


def _object(members: list[tuple[str, str]]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in members) + "}"


JSON_TEXT = st.recursive(
    SCALAR_TEXT,
    lambda kids: st.one_of(
        st.lists(kids, max_size=5).map(_array),
        st.lists(st.tuples(STRING_TEXT, kids), max_size=5).map(_object),
    ),
    max_leaves=25,
)
# Nesting around the decoder's recursion limit (about 1000), and far past it.
DEEP_TEXT = st.one_of(
    st.integers(1, 100_000), st.sampled_from([500, 900, 990, 1000, 1100, 20_000, 100_000])
).map(lambda n: "[" * n + "]" * n)
PAYLOAD_TEXT = st.one_of(JSON_TEXT, DEEP_TEXT)
FIELD_TEXT = st.one_of(
    st.none(), st.just("null"), INT_TEXT, FLOAT_TEXT, STRING_TEXT, JSON_TEXT
)  # None: the member is left out


def _valid_int(text: str | None, low: int, high: int) -> bool:
    if text is None or text == "null":
        return True
    if not text.lstrip("-").isdigit() or len(text) > 20:
        return False
    return low <= int(text) <= high


def _enqueue_body(payload: str, attempts: str | None, delay: str | None) -> str:
    members = [f'"payload": {payload}']
    if attempts is not None:
        members.append(f'"max_attempts": {attempts}')
    if delay is not None:
        members.append(f'"delay_ms": {delay}')
    return "{" + ", ".join(members) + "}"


# -- bodies ---------------------------------------------------------------------------------------

BACKENDS = ["memory", "sqlite"]
POST_ROUTES = [
    "enqueue",
    "ack",
    "nack",
    "requeue",
    "ack of no task",
    "nack of no task",
    "extend",
    "requeue all",
    "pause",
    "empty",
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_bytes_as_bodies_on_every_post_route(backend: str, tmp_path: Path) -> None:
    with live_broker(backend, tmp_path) as live:

        @EXAMPLES
        @given(route=st.sampled_from(POST_ROUTES), body=st.binary(max_size=4096))
        def check(route: str, body: bytes) -> None:
            async def example() -> None:
                task_id, lease_id = await live.held_task()
                path = {
                    "enqueue": "/jobs",
                    "ack": f"/jobs/{task_id}/ack?lease_id={lease_id}",
                    "nack": f"/jobs/{task_id}/nack?lease_id={lease_id}",
                    "requeue": f"/dlq/{task_id}/requeue",
                    "ack of no task": "/jobs/nope/ack?lease_id=x",
                    "nack of no task": "/jobs/nope/nack?lease_id=x",
                    "extend": f"/jobs/{task_id}/extend?lease_id={lease_id}",
                    "requeue all": "/dlq/requeue?queue=nobody",
                    "pause": "/queues/elsewhere/pause",
                    "empty": "/queues/elsewhere/empty",
                }[route]
                status, _ = await post(live, path, body)
                if route == "pause":  # the body is ignored
                    assert status == 204
                elif route == "ack":  # (an optional {"result"}: anything else is a 400)
                    assert status == 204 if not body.strip(b" \t\r\n") else status in (204, 400)
                elif route == "requeue all":
                    assert status == 200
                elif route == "empty":  # (the body is ignored; the queue may be unknown yet)
                    assert status in (200, 404)
                elif route == "extend":  # (an optional {"progress"}: anything else is a 400)
                    assert status == 200 if not body.strip(b" \t\r\n") else status in (200, 400)
                await live.http.ack(task_id, lease_id)  # whatever happened, let it go
                await live.still_serves()

            live.run(example())

        check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_json_enqueued_is_accepted_or_refused_and_round_trips(
    backend: str, tmp_path: Path
) -> None:
    with live_broker(backend, tmp_path) as live:

        @EXAMPLES
        @given(payload=PAYLOAD_TEXT, attempts=FIELD_TEXT, delay=FIELD_TEXT)
        def check(payload: str, attempts: str | None, delay: str | None) -> None:
            body = _enqueue_body(payload, attempts, delay).encode()

            async def example() -> None:
                status, answer = await post(live, "/jobs", body)
                fields_ok = _valid_int(attempts, 1, 2**31 - 1) and _valid_int(
                    delay, 0, 365 * 24 * 3600 * 1000
                )
                if status == 400 and "nested too deeply" in answer["error"]:
                    assert payload.startswith("[[")
                    return
                assert status == (201 if fields_ok else 400), (status, answer)
                if status == 400:
                    assert "max_attempts" in answer["error"] or "delay_ms" in answer["error"]
                    return
                if delay not in (None, "null", "0", "-0"):
                    return  # held back: not claimable now
                await _claim_exactly(live, answer["id"], payload.encode())

            live.run(example())

        check()


_CLAIMED = re.compile(
    rb'\{"task":\{"id":"([^"]+)",.*,"lease_id":"([^"]+)","deadline":"[^"]+"\}', re.S
)


async def _claim_exactly(live: Live, task_id: str, payload: bytes) -> None:
    """Claim until the task comes (acking what is ahead of it); its payload is byte for byte.
    (The answer is not decoded: a payload nested as deep as the broker accepts may be deeper
    than this test's stack allows.)"""
    while True:
        async with live.http.session.get(live.http.base + "/jobs/next?wait_ms=0") as resp:
            raw = await resp.read()
        assert resp.status == 200, raw[:300]
        claimed = _CLAIMED.fullmatch(raw)
        assert claimed is not None, raw[:300]
        got, lease = (group.decode() for group in claimed.groups())
        assert await live.http.ack(got, lease) == 204
        if got == task_id:
            assert b'"payload":' + payload + b',"attempts":' in raw
            return


NACK_ERROR = st.one_of(st.none(), STRING_TEXT, SCALAR_TEXT.filter(lambda t: t[0] != '"'))


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_json_nack_bodies(backend: str, tmp_path: Path) -> None:
    with live_broker(backend, tmp_path) as live:

        @EXAMPLES
        @given(error=NACK_ERROR, extra=st.lists(st.tuples(STRING_TEXT, JSON_TEXT), max_size=3))
        def check(error: str | None, extra: list[tuple[str, str]]) -> None:
            members = ([('"error"', error)] if error is not None else []) + extra
            body = _object(members).encode()

            async def example() -> None:
                task_id, lease_id = await live.held_task()
                path = f"/jobs/{task_id}/nack?lease_id={lease_id}"
                status, answer = await post(live, path, body)
                if status == 400:
                    assert "error" in answer["error"] or "JSON" in answer["error"], answer
                    assert await live.http.ack(task_id, lease_id) == 204
                else:
                    assert status == 204, (status, answer)
                await live.still_serves()

            live.run(example())

        check()


def _nack_options_refused(answer: Any, delay: str | None, terminal: str | None) -> bool:
    """A 400 for a nack with these options names one of the fields sent."""
    message = answer["error"]
    named = [("delay_ms", delay), ("terminal", terminal)]
    return any(name in message for name, text in named if text is not None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_nack_options(backend: str, tmp_path: Path) -> None:
    """Random ``delay_ms`` and ``terminal`` (nack options): 204, or 400 naming one of them and the
    task still held; the counters' invariant holds either way."""
    with live_broker(backend, tmp_path) as live:

        @EXAMPLES
        @given(delay=FIELD_TEXT, terminal=FIELD_TEXT)
        def check(delay: str | None, terminal: str | None) -> None:
            members = [('"error"', '"x"')]
            if delay is not None:
                members.append(('"delay_ms"', delay))
            if terminal is not None:
                members.append(('"terminal"', terminal))
            body = _object(members).encode()

            async def example() -> None:
                task_id, lease_id = await live.held_task()
                path = f"/jobs/{task_id}/nack?lease_id={lease_id}"
                status, answer = await post(live, path, body)
                if status == 400:
                    assert _nack_options_refused(answer, delay, terminal), answer
                    assert await live.http.ack(task_id, lease_id) == 204
                else:
                    assert status == 204, (status, answer)
                    assert await live.http.ack(task_id, lease_id) in (404, 409)
                assert invariant_holds(await live.http.stats())
                await live.still_serves()

            live.run(example())

        check()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("error", ['"\\ud800"', '"\\udfff x"', '"a\\udbff"'])
def test_a_nack_error_with_a_lone_surrogate_does_not_poison_the_queue(
    backend: str, tmp_path: Path, error: str
) -> None:
    """Refused (400, naming the field), and the task is untouched: its holder can still settle
    it, and the broker stays healthy."""
    with live_broker(backend, tmp_path) as live:

        async def example() -> None:
            await live.http.enqueue({"n": 1}, max_attempts=1)
            task_id, lease_id, _ = await claim_now(live.http)
            path = f"/jobs/{task_id}/nack?lease_id={lease_id}"
            status, answer = await post(live, path, f'{{"error": {error}}}'.encode())
            assert status == 400, answer
            assert "error is not valid Unicode" in answer["error"]
            assert await live.http.ack(task_id, lease_id) == 204
            await live.still_serves()

        live.run(example())


# -- headers, paths, query strings --------------------------------------------------------------

TOKEN = st.text(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_!#$%&'*+.^`|~",
    min_size=1,
    max_size=30,
)
HEADER_NAME = st.one_of(
    TOKEN,
    st.sampled_from(
        [
            "Content-Length",
            "Transfer-Encoding",
            "Content-Encoding",
            "Expect",
            "Connection",
            "Host",
            "Upgrade",
            "Content-Type",
            "Accept-Encoding",
            "Te",
            "Trailer",
        ]
    ),
    st.binary(min_size=1, max_size=20).map(lambda b: b.decode("latin-1")),
)
HEADER_VALUE = st.one_of(
    st.text(max_size=60).map(lambda t: t.encode("utf-8").decode("latin-1")),
    st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
    st.sampled_from(["0", "5", "-1", "chunked", "gzip", "identity", "100-continue", "close"]),
)
HEADERS = st.lists(st.tuples(HEADER_NAME, HEADER_VALUE), max_size=6)
TARGETS = st.sampled_from(
    [("GET", "/healthz", b""), ("GET", "/stats", b""), ("POST", "/jobs", b'{"payload": 1}')]
)


def _raw(method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nHost: wq\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers)
    if body:
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode("latin-1") + b"\r\n" + body


def test_random_headers(tmp_path: Path) -> None:
    with live_broker("memory", tmp_path) as live:

        @EXAMPLES
        @given(target=TARGETS, headers=HEADERS)
        def check(target: tuple[str, str, bytes], headers: list[tuple[str, str]]) -> None:
            method, path, body = target

            async def example() -> None:
                async with raw_connection(live.address) as conn:
                    await conn.send(_raw(method, path, headers, body))
                    response = await conn.response()
                    if response.status == 100:  # Expect: 100-continue (the body was sent)
                        response = await conn.response()
                    check_raw(response)
                await live.still_serves()

            live.run(example())

        check()


SEGMENT = st.one_of(
    st.sampled_from(
        [
            "jobs",
            "next",
            "ack",
            "nack",
            "dlq",
            "requeue",
            "stats",
            "healthz",
            "extend",
            "queues",
            "empty",
            "",
        ]
    ),
    st.text(max_size=12),
    st.sampled_from(["%00", "%ED%A0%80", "%FF", "%2F", "..", ".", "%2e%2e", "a%20b", "%"]),
)
ROUTE = st.sampled_from(
    [
        "/jobs",
        "/jobs/next",
        "/jobs/x/ack",
        "/jobs/x/nack",
        "/stats",
        "/dlq",
        "/dlq/x/requeue",
        "/jobs/x",
        "/jobs/x/extend",
        "/queues",
        "/queues/x/pause",
        "/queues/x/resume",
        "/dlq/requeue",
        "/dlq/x",
        "/queues/x",
        "/queues/x/empty",
    ]
)
PATH = st.one_of(
    ROUTE,
    st.lists(SEGMENT, min_size=1, max_size=5).map(lambda parts: "/" + "/".join(parts)),
)
QUERY_KEY = st.one_of(
    st.sampled_from(["wait_ms", "lease_ms", "limit", "lease_id", "queue", "state", "cursor", "x"]),
    st.text(max_size=8),
)
QUERY_VALUE = st.one_of(
    INT_TEXT,
    FLOAT_TEXT,
    st.text(max_size=20),
    st.sampled_from(["", "%00", "%ED%A0%80", "%FF", "+1", "%2B1", "1_000", "١٢", "0x10"]),
)
QUERY = st.lists(st.tuples(QUERY_KEY, QUERY_VALUE), max_size=4).map(
    lambda pairs: "&".join(f"{k}={v}" for k, v in pairs)
)
METHOD = st.one_of(
    st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE"]),
    TOKEN,
)


def _target_bytes(text: str) -> str:
    """A request target as latin-1 text: what is not printable ASCII percent-encoded (mostly),
    or sent raw (sometimes: the parser must refuse it)."""
    return "".join(
        c if 0x21 <= ord(c) < 0x7F else "".join(f"%{b:02X}" for b in c.encode("utf-8"))
        for c in text
    )


def test_random_paths_and_query_strings(tmp_path: Path) -> None:
    with live_broker("memory", tmp_path) as live:

        @EXAMPLES
        @given(method=METHOD, path=PATH, query=QUERY, raw=st.booleans())
        def check(method: str, path: str, query: str, raw: bool) -> None:
            target = path + ("?" + query if query else "")
            if not raw:
                target = _target_bytes(target)
            data = f"{method} ".encode() + target.encode("utf-8", "surrogateescape")
            data += b" HTTP/1.1\r\nHost: wq\r\nContent-Length: 0\r\n\r\n"

            async def example() -> None:
                # A ready task, so a claim answers at once whatever wait_ms says.
                stats = await live.http.stats()
                if stats["ready"] == 0:
                    await live.http.enqueue({"ready": True})
                head = method == "HEAD"
                response = await exchange(live.address, data, head=head)
                answer = check_raw(response, head=head)
                if response.status == 200 and isinstance(answer, dict) and "lease_id" in answer:
                    await live.http.ack(answer["task"]["id"], answer["lease_id"])
                await live.still_serves()

            live.run(example())

        check()
