"""The HTTP edge against hostile input: compressed bodies, bodies over the limit, methods that must
not change state, integers too long to convert, malformed HTTP, and clients that are slow on
purpose. Each test sends what a hostile or broken client would, over a real socket, to a real
broker on port 0, and checks the answer is a clear JSON 4xx, that nothing else was harmed, and
that the broker still serves everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from http.client import HTTPConnection
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import Http, http_broker, http_client, settle, wait_until
from tests.rawhttp import exchange, raw_connection, request, stubborn_upload
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqbroker.config import Config
from wqbroker.http import transport
from wqbroker.http.transport import LINGER_BYTES, json_response, no_content
from wqbroker.limits import DEFAULT_MAX_PAYLOAD

pytestmark = pytest.mark.timeout(60)

LIMIT = 64 * 1024


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[Broker]:
    async with http_broker(clock=clock, max_body=LIMIT) as b:
        yield b


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


def address(broker: Broker) -> str:
    return broker.http_addresses[0]


def json_error(response: Any) -> str:
    assert (response.header("Content-Type") or "").startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    assert isinstance(body["error"], str)
    assert body["error"]
    return str(body["error"])


def deflate_bomb(inflated: int, wbits: int) -> bytes:
    """``inflated`` zero bytes, compressed (about 1000:1): small on the wire, huge inflated."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, wbits)
    block = bytes(1 << 20)
    parts = [compressor.compress(block) for _ in range(inflated >> 20)]
    parts.append(compressor.flush())
    return b"".join(parts)


# -- 1. compressed bodies, bodies over the limit, Expect: 100-continue ----------------------------


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "x-gzip", "gzip, identity", "zstd"])
async def test_a_compressed_body_is_refused_with_415(
    http: Http, broker: Broker, encoding: str
) -> None:
    body = b'{"payload": 1}'
    response = await exchange(
        address(broker), request("POST", "/jobs", body, {"Content-Encoding": encoding})
    )
    assert response.status == 415
    assert "Content-Encoding" in json_error(response)
    assert response.header("Accept-Encoding") == "identity"
    assert (await http.stats())["totals"]["enqueued"] == 0


@pytest.mark.parametrize("coding", ["gzip, chunked", "deflate,chunked", "br , chunked"])
async def test_a_compressing_transfer_coding_is_refused_with_415(
    http: Http, broker: Broker, coding: str
) -> None:
    body = zlib.compress(b'{"payload": 1}')
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    head = request("POST", "/jobs", headers={"Transfer-Encoding": coding})
    response = await exchange(address(broker), head + chunked)
    assert response.status == 415
    assert "Transfer-Encoding" in json_error(response)
    assert (await http.stats())["totals"]["enqueued"] == 0


@pytest.mark.parametrize("encoding", ["identity", "IDENTITY", ""])
async def test_identity_encoding_is_accepted(http: Http, broker: Broker, encoding: str) -> None:
    body = b'{"payload": 1}'
    response = await exchange(
        address(broker), request("POST", "/jobs", body, {"Content-Encoding": encoding})
    )
    assert response.status == 201, response.body


async def test_a_compression_bomb_is_answered_from_its_headers(broker: Broker) -> None:
    """The 415 comes before a byte of the body is sent: nothing is ever inflated."""
    bomb = deflate_bomb(64 << 20, 31)
    head = request("POST", "/jobs", headers={"Content-Encoding": "gzip"})[:-2]
    head += f"Content-Length: {len(bomb)}\r\n\r\n".encode()
    async with raw_connection(address(broker)) as conn:
        await conn.send(head)
        response = await conn.response()
        assert response.status == 415
        assert response.closes
        assert await conn.closed()


async def test_a_gzip_bomb_costs_no_cpu_and_stalls_nobody(http: Http, broker: Broker) -> None:
    """1 MB on the wire that would inflate to 1 GiB, sent in full before reading: refused, the
    connection closed, at little CPU, and the next client is served as ever."""
    bomb = deflate_bomb(1 << 30, 31)
    head = request("POST", "/jobs", headers={"Content-Encoding": "gzip"})[:-2]
    head += f"Content-Length: {len(bomb)}\r\n\r\n".encode()
    cpu = time.process_time()  # this process: the broker, and the client sending the bomb
    chunks = (bomb[i : i + 65536] for i in range(0, len(bomb), 65536))
    upload = await stubborn_upload(address(broker), head, chunks)
    spent = time.process_time() - cpu
    assert upload.response.status == 415
    assert upload.closed
    # Inflating the bomb costs seconds of CPU (about 3 s here before the fix); sending and
    # refusing it, a few hundredths. CPU time, not elapsed time: a busy machine does not move it.
    assert spent < 1.0, f"{spent:.2f}s of CPU for one refused request"
    task_id = await http.enqueue({"n": 1})
    assert (await http.stats())["totals"]["enqueued"] == 1
    assert task_id


async def test_expect_100_continue_over_the_limit_gets_413_before_the_body(
    http: Http, broker: Broker
) -> None:
    head = request(
        "POST",
        "/jobs",
        headers={"Content-Length": str(10**9), "Expect": "100-continue"},
    )
    async with raw_connection(address(broker)) as conn:
        await conn.send(head)
        response = await conn.response()
        assert response.status == 413  # not "100 Continue"
        assert str(LIMIT) in json_error(response)
        assert response.closes
        assert await conn.closed()
    assert (await http.stats())["totals"]["enqueued"] == 0


async def test_expect_100_continue_within_the_limit_still_works(broker: Broker) -> None:
    async with raw_connection(address(broker)) as conn:
        body = b'{"payload": {"n": 1}}'
        await conn.send(request("POST", "/jobs", headers={"Expect": "100-continue"})[:-2])
        await conn.send(f"Content-Length: {len(body)}\r\n\r\n".encode())
        interim = await conn.response()
        assert interim.status == 100
        await conn.send(body)
        response = await conn.response()
        assert response.status == 201
    async with aiohttp.ClientSession() as session:
        async with session.post(
            broker.http_url + "/jobs", data=b'{"payload": 2}', expect100=True
        ) as resp:
            assert resp.status == 201


async def test_an_unknown_expectation_gets_417_json(broker: Broker) -> None:
    for path in ("/jobs", "/nowhere"):
        response = await exchange(
            address(broker), request("POST", path, b"{}", {"Expect": "something-else"})
        )
        assert response.status == 417
        assert "Expect" in json_error(response)


async def test_a_body_over_the_limit_closes_the_connection_instead_of_draining(
    http: Http, broker: Broker
) -> None:
    """Content-Length says 100 MB: 413 at once, and the connection is closed after reading at
    most about another limit's worth, however long the client keeps sending."""
    head = request("POST", "/jobs", headers={"Content-Length": str(100 << 20)})
    upload = await stubborn_upload(address(broker), head, (bytes(65536) for _ in range(1600)))
    assert upload.response.status == 413
    assert str(LIMIT) in json_error(upload.response)
    assert upload.response.closes
    assert upload.closed
    assert upload.sent < 100 << 20
    assert (await http.stats())["totals"]["enqueued"] == 0


async def test_a_chunked_body_over_the_limit_gets_413_and_a_closed_connection(
    http: Http, broker: Broker
) -> None:
    chunk = b"%x\r\n%s\r\n" % (16384, b"x" * 16384)
    head = request("POST", "/jobs", headers={"Transfer-Encoding": "chunked"})
    upload = await stubborn_upload(address(broker), head, (chunk for _ in range(10_000)))
    assert upload.response.status == 413
    assert str(LIMIT) in json_error(upload.response)
    assert upload.response.closes
    assert upload.closed
    assert upload.sent < 10_000 * len(chunk)
    assert (await http.stats())["totals"]["enqueued"] == 0


async def test_a_client_that_reads_while_it_sends_gets_the_413(broker: Broker) -> None:
    """aiohttp's client reads the answer while it still sends the body."""

    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield bytes(65536)

    async with aiohttp.ClientSession() as session:
        async with session.post(broker.http_url + "/jobs", data=endless()) as resp:
            assert resp.status == 413
            assert str(LIMIT) in (await resp.json())["error"]


def _post_whole_body_then_read(address: str, size: int, chunked: bool) -> tuple[int, bytes, str]:
    """POST ``size`` bytes to /jobs with Python's ``http.client``, which writes the whole body
    before it reads a byte of the answer (with Content-Length, or chunked); the answer."""
    host, _, port = address.rpartition(":")
    connection = HTTPConnection(host, int(port), timeout=30)
    try:
        body = bytes(size)
        if chunked:

            def pieces() -> Iterator[bytes]:
                for start in range(0, size, 65536):
                    yield body[start : start + 65536]

            connection.request("POST", "/jobs", body=pieces(), encode_chunked=True)
        else:
            connection.request("POST", "/jobs", body=body)
        response = connection.getresponse()
        return response.status, response.read(), response.getheader("Content-Type") or ""
    finally:
        connection.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "aiohttp-only"])
async def test_a_client_that_sends_its_whole_body_before_reading_gets_the_413(
    fast_lane: bool, chunked: bool
) -> None:
    """20 MB to a broker with the default limit, from a client that reads nothing until it has
    sent everything: it reads the 413 and its JSON error (the broker reads and drops the rest
    before it closes, rather than resetting the connection under the client's write)."""
    async with http_broker(http_fast_lane=fast_lane) as b:
        for _ in range(3):  # (a reset, when it happens, happens every time)
            status, body, content_type = await asyncio.to_thread(
                _post_whole_body_then_read, address(b), 20 << 20, chunked
            )
            assert status == 413, body
            assert content_type.startswith("application/json")
            assert json.loads(body) == {
                "error": f"request body is larger than the limit of {DEFAULT_MAX_PAYLOAD} bytes"
            }
        async with http_client(b.http_url) as http:
            assert (await http.stats())["totals"]["enqueued"] == 0
            assert (await http.request("GET", "/healthz"))[0] == 200


@pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "aiohttp-only"])
async def test_a_client_that_never_stops_sending_is_cut_off_after_the_lingering_bytes(
    fast_lane: bool,
) -> None:
    """Reading and dropping a body after its 413 has a cap: a client that goes on sending is
    cut off once that much more has come (plus what the sockets' buffers hold)."""
    async with http_broker(http_fast_lane=fast_lane, max_body=LIMIT) as b:
        head = request("POST", "/jobs", headers={"Content-Length": str(1 << 40)})
        upload = await stubborn_upload(address(b), head, itertools.repeat(bytes(1 << 20)))
        assert upload.response.status == 413
        assert str(LIMIT) in json_error(upload.response)
        assert upload.closed
        assert LINGER_BYTES <= upload.sent < LINGER_BYTES + (32 << 20)
        async with http_client(b.http_url) as http:
            assert (await http.request("GET", "/healthz"))[0] == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "aiohttp-only"])
async def test_a_client_that_trickles_on_is_cut_off_after_the_lingering_time(
    fast_lane: bool, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends its body too slowly ever to reach the cap is cut off once the
    lingering time has passed (shortened here, so the test need not wait the real one)."""
    monkeypatch.setattr(transport, "LINGER_SECONDS", 0.3)
    piece = b"x" * 4096
    if chunked:
        head = request("POST", "/jobs", headers={"Transfer-Encoding": "chunked"})
        piece = b"%x\r\n%s\r\n" % (len(piece), piece)
    else:
        head = request("POST", "/jobs", headers={"Content-Length": str(1 << 30)})

    def trickle() -> Iterator[bytes]:
        yield piece * 20  # over the limit at once
        for _ in range(2000):  # 40 s of it, if nothing stopped it
            time.sleep(0.02)
            yield piece

    async with http_broker(http_fast_lane=fast_lane, max_body=LIMIT) as b:
        upload = await stubborn_upload(address(b), head, trickle())
        assert upload.response.status == 413
        assert str(LIMIT) in json_error(upload.response)
        assert upload.closed
        assert upload.sent < len(piece) * 500  # cut off long before the end
        async with http_client(b.http_url) as http:
            assert (await http.request("GET", "/healthz"))[0] == 200


@pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "aiohttp-only"])
async def test_a_client_that_stops_sending_after_its_413_is_not_waited_for(
    fast_lane: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing more comes of the body (the client reads its answer and waits): the connection is
    closed once nothing has come for the idle bound, not at the end of the lingering time (made
    long here, and the idle bound short, so that either would show)."""
    monkeypatch.setattr(transport, "LINGER_SECONDS", 60.0)
    monkeypatch.setattr(transport, "LINGER_IDLE", 0.2)
    async with http_broker(http_fast_lane=fast_lane, max_body=LIMIT) as b:
        async with raw_connection(address(b)) as conn:
            head = request("POST", "/jobs", headers={"Content-Length": str(4 << 20)})
            await conn.send(head + bytes(1 << 20))
            response = await conn.response()
            assert response.status == 413
            assert str(LIMIT) in json_error(response)
            assert await conn.closed(timeout=10)


async def _refused(address: str) -> bool:
    """Whether a new connection to ``address`` is refused (the broker stopped listening)."""
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        return True
    writer.close()
    return False


@pytest.mark.parametrize("then", ["goes away", "stays silent"])
@pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "aiohttp-only"])
async def test_the_broker_stops_while_a_body_is_dropped_after_its_413(
    fast_lane: bool, then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker stops while it reads and drops what comes of a body after its 413, and the
    client goes away (its connection ends under the request the broker waits for), or stays
    without sending (the lingering time ends it: shortened here): it stops cleanly."""
    monkeypatch.setattr(transport, "LINGER_SECONDS", 0.5)
    broker = Broker(
        Config(addr="127.0.0.1:0", grpc_addr="off", http_fast_lane=fast_lane, max_body=LIMIT)
    )
    await broker.start()
    stopping: asyncio.Task[None] | None = None
    try:
        size = 4 << 20
        async with raw_connection(address(broker)) as conn:
            head = request("POST", "/jobs", headers={"Content-Length": str(size)})
            await conn.send(head + bytes(size // 4))
            response = await conn.response()
            assert response.status == 413
            stopping = asyncio.create_task(broker.stop())
            await wait_until(lambda: _refused(address(broker)), what="the broker to stop listening")
            await settle()
            if then == "stays silent":
                assert await conn.closed()
        await asyncio.wait_for(stopping, 10)  # (and it did not fail)
    finally:
        if stopping is None:
            await broker.stop()


async def test_a_small_unread_body_keeps_the_connection(broker: Broker) -> None:
    """A body nobody reads (an ack's, a 404's) within the limit is skipped, not a reason to
    close: the next request on the connection is served."""
    async with raw_connection(address(broker)) as conn:
        await conn.send(request("POST", "/jobs/nope/ack?lease_id=x", b'{"ignored": true}'))
        assert (await conn.response()).status == 404
        await conn.send(request("GET", "/nowhere", b"x" * 1000))
        assert (await conn.response()).status == 404
        await conn.send(request("GET", "/healthz"))
        response = await conn.response()
        assert response.status == 200
        assert response.json() == {"status": "ok"}


# -- 2. only documented methods reach handlers -----------------------------------------------------

# Every route and the methods that reach its handler. HEAD is allowed where it changes nothing
# (the read-only GETs answer it as GET, without the body); never on /jobs/next, which claims.
ROUTES = {
    "/jobs": {"POST", "GET", "HEAD"},
    "/jobs/next?wait_ms=0": {"GET"},
    "/jobs/abc/ack?lease_id=x": {"POST"},
    "/jobs/abc/nack?lease_id=x": {"POST"},
    "/stats": {"GET", "HEAD"},
    "/dlq": {"GET", "HEAD"},
    "/dlq/abc/requeue": {"POST"},
    "/healthz": {"GET", "HEAD"},
    # the extensions
    "/jobs/abc": {"GET", "HEAD", "DELETE"},
    "/jobs/abc/extend?lease_id=x": {"POST"},
    "/jobs/abc/release?lease_id=x": {"POST"},
    "/queues": {"GET", "HEAD"},
    "/queues/q/pause": {"POST"},
    "/queues/q/resume": {"POST"},
    "/dlq/requeue": {"POST"},
    "/dlq/abc": {"DELETE"},
    # control over tasks (docs/design/control.md)
    "/queues/q": {"DELETE"},
    "/queues/q/empty": {"POST"},
    "/jobs/next/batch?wait_ms=0": {"GET"},
}
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "PROPFIND"]


async def test_head_on_jobs_next_is_405_and_claims_nothing(http: Http, broker: Broker) -> None:
    task_id = await http.enqueue({"n": 1})
    response = await exchange(address(broker), request("HEAD", "/jobs/next?wait_ms=0"), head=True)
    assert response.status == 405
    assert response.header("Allow") == "GET"
    stats = await http.stats()
    assert (stats["ready"], stats["handed_out"]) == (1, 0)
    assert stats["totals"]["delivered"] == 0
    body = await http.claim()
    assert body["task"]["id"] == task_id
    assert body["task"]["attempts"] == 1


@pytest.mark.parametrize("path", list(ROUTES))
async def test_only_documented_methods_reach_handlers(
    http: Http, broker: Broker, path: str
) -> None:
    await http.enqueue({"n": 1})
    before = await http.stats()
    allowed = ROUTES[path]
    for method in METHODS:
        if method in allowed:
            continue
        head = method == "HEAD"
        response = await exchange(address(broker), request(method, path, b""), head=head)
        assert response.status == 405, (method, path, response.status)
        assert set((response.header("Allow") or "").split(",")) == allowed, (method, path)
        if not head:
            assert method in json_error(response)
    assert await http.stats() == before  # none of them changed anything (abc is no task)


async def test_head_on_a_read_only_route_answers_as_get_without_a_body(
    http: Http, broker: Broker
) -> None:
    await http.enqueue({"n": 1})
    before = await http.stats()
    async with raw_connection(address(broker)) as conn:
        for path in ("/stats", "/dlq", "/healthz", "/queues", "/stats?queue=q"):
            await conn.send(request("HEAD", path))
            response = await conn.response(head=True)
            assert response.status == 200, path
            assert (response.header("Content-Type") or "").startswith("application/json")
        # The connection is still in step: no body followed any of the HEAD answers.
        await conn.send(request("GET", "/healthz"))
        assert (await conn.response()).json() == {"status": "ok"}
    assert await http.stats() == before


# -- 3. integers too long to convert ---------------------------------------------------------------

HUGE = "9" * 5000  # past Python's 4300-digit limit on int(str)


@pytest.mark.parametrize("name", ["wait_ms", "lease_ms"])
async def test_a_huge_duration_is_clamped_as_the_spec_says(
    http: Http, clock: FakeClock, name: str
) -> None:
    await http.enqueue({"n": 1})
    status, body = await http.request("GET", f"/jobs/next?{name}={HUGE}")
    assert status == 200, body
    if name == "lease_ms":  # clamped to 5 minutes
        deadline = datetime.fromisoformat(body["deadline"].replace("Z", "+00:00")).timestamp()
        assert deadline == pytest.approx(clock.now() + 300, abs=1e-3)


async def test_a_huge_wait_is_clamped_to_30s(http: Http, broker: Broker, clock: FakeClock) -> None:
    poll = asyncio.create_task(http.request("GET", f"/jobs/next?wait_ms={HUGE}"))
    await wait_until(lambda: broker.service.waiting == 1, what="the claim to park")
    clock.advance(29.9)
    await settle()
    assert broker.service.waiting == 1
    clock.advance(0.2)
    assert await asyncio.wait_for(poll, 5) == (204, None)


@pytest.mark.parametrize("limit", [HUGE, "99999999999999999999", "9223372036854775808"])
async def test_a_huge_dlq_limit_lists_everything(http: Http, limit: str) -> None:
    await http.enqueue({"n": 1}, max_attempts=1)
    body = await http.claim()
    assert await http.nack(body["task"]["id"], body["lease_id"], "x") == 204
    status, dead = await http.request("GET", f"/dlq?limit={limit}")
    assert status == 200, dead
    assert [d["id"] for d in dead] == [body["task"]["id"]]


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        (f"/jobs/next?wait_ms=-{HUGE}", "wait_ms must not be negative"),
        (f"/jobs/next?lease_ms=-{HUGE}", "lease_ms must be at least 1"),
        (f"/dlq?limit=-{HUGE}", "limit must not be negative"),
        (f"/jobs/next?wait_ms=%2B-{HUGE}", "wait_ms must be an integer"),
    ],
)
async def test_a_huge_negative_query_integer_gets_400(http: Http, query: str, needle: str) -> None:
    await http.enqueue({"n": 1})
    status, body = await http.request("GET", query)
    assert status == 400, body
    assert needle in body["error"]
    assert len(body["error"]) < 200  # names the number, does not repeat all of it
    assert (await http.stats())["handed_out"] == 0


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("max_attempts", HUGE, "max_attempts must be at most 2147483647"),
        ("max_attempts", "-" + HUGE, "max_attempts must be at least 1"),
        ("delay_ms", HUGE, "delay_ms must be at most 31536000000"),
        ("delay_ms", "-" + HUGE, "delay_ms must not be negative"),
        ("max_attempts", "1e999999", "max_attempts must be an integer"),
        ("max_attempts", "-1e999999", "max_attempts must be an integer"),
        ("delay_ms", "1" + "0" * 5000 + ".5", "delay_ms must be an integer"),
    ],
)
async def test_a_huge_number_in_an_integer_field_gets_a_clear_400(
    http: Http, field: str, value: str, needle: str
) -> None:
    body = f'{{"payload": 1, "{field}": {value}}}'.encode()
    status, answer = await http.request("POST", "/jobs", data=body)
    assert status == 400, answer
    assert needle in answer["error"]
    assert "sys.set_int_max_str_digits" not in answer["error"]
    assert len(answer["error"]) < 200
    assert (await http.stats())["totals"]["enqueued"] == 0


@pytest.mark.parametrize(
    "payload",
    [
        HUGE.encode(),
        b"-" + HUGE.encode(),
        b"1" * 60_000,
        b"[" + HUGE.encode() + b', {"n": -' + HUGE.encode() + b"}]",
        b"1e999999",
        b"-1e999999",
        b"1e-999999",
        b"0." + b"1" * 10_000,
        b"1" * 5000 + b".5e-3",
    ],
    ids=lambda p: f"{len(p)}B:{p[:12].decode()}",
)
async def test_a_payload_holding_huge_numbers_is_accepted_and_returned_byte_for_byte(
    http: Http, payload: bytes
) -> None:
    status, answer = await http.request(
        "POST", "/jobs", data=b'{"payload": ' + payload + b', "ignored": ' + HUGE.encode() + b"}"
    )
    assert status == 201, answer
    async with http.session.get(http.base + "/jobs/next?wait_ms=0") as resp:
        raw = await resp.read()
    assert resp.status == 200
    assert b'"payload":' + payload + b',"attempts":1' in raw


async def test_a_nack_body_with_a_huge_number_in_an_unknown_field_is_accepted(
    http: Http,
) -> None:
    await http.enqueue({"n": 1})
    body = await http.claim()
    status, answer = await http.request(
        "POST",
        f"/jobs/{body['task']['id']}/nack?lease_id={body['lease_id']}",
        data=b'{"error": "boom", "code": ' + HUGE.encode() + b"}",
    )
    assert status == 204, answer
    assert (await http.stats())["totals"]["nacked"] == 1


def test_the_codec_validates_numbers_without_converting_them() -> None:
    from wqbroker import codec

    for text in (HUGE, "1" * 100_000, "1e999999", "[-" + HUGE + "]"):
        assert codec.validate_json(text.encode()) == text.encode()
    fields = codec.parse_object(
        b'{"payload": ' + HUGE.encode() + b', "n": ' + HUGE.encode() + b"}", frozenset({"payload"})
    )
    assert fields["payload"] == HUGE.encode()
    # A number the broker reads saturates at int64 and names itself without converting.
    assert fields["n"] == 2**63 - 1
    assert f"{fields['n']}" == "9" * 16 + "... (5000 digits)"
    assert codec.parse_int("-" + HUGE) == -(2**63)
    assert codec.parse_int("9223372036854775807") == 2**63 - 1
    assert type(codec.parse_int("9223372036854775807")) is int
    assert type(codec.parse_int("9223372036854775808")) is codec.BigInt
    assert codec.parse_int("0" * 10_000 + "42") == 42


# -- 4. malformed HTTP ----------------------------------------------------------------------------

MALFORMED = {
    "a 64 KB path": b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "a 70 KB header": b"GET /stats HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
    "300 headers": b"GET /stats HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-H%d: y\r\n" % i for i in range(300))
    + b"\r\n",
    "Content-Length with Transfer-Encoding": b"POST /jobs HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "a NUL in a header": b"GET /stats HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "an unknown method": b"FOO /stats HTTP/1.1\r\nHost: x\r\n\r\n",
    "a method that is not a token": b"G@T /stats HTTP/1.1\r\nHost: x\r\n\r\n",
    "a bad Content-Length": b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "a negative Content-Length": b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "an overflowing Content-Length": b"POST /jobs HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 99999999999999999999999\r\n\r\n",
    "two Content-Lengths": b"POST /jobs HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "an unknown Transfer-Encoding": b"POST /jobs HTTP/1.1\r\nHost: x\r\n"
    b"Transfer-Encoding: foo\r\n\r\n",
    "a bad chunk size": b"POST /jobs HTTP/1.1\r\nHost: x\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n",
    "HTTP/9.9": b"GET /stats HTTP/9.9\r\nHost: x\r\n\r\n",
    "garbage": b"GARBAGE / HTTP/9.9\r\n\r\n",
    "a space in the path": b"GET /st ats HTTP/1.1\r\nHost: x\r\n\r\n",
    "bytes that are not ASCII in the path": b"GET /jobs/\xff\xfe/ack HTTP/1.1\r\nHost: x\r\n\r\n",
    "a bad header name": b"GET /stats HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
    "an absolute URL that is not one": b"GET http://[::1/aaaaaaaa HTTP/1.1\r\nHost: x\r\n\r\n",
    "no Host": b"GET /stats HTTP/1.1\r\n\r\n",
    "bare line feeds": b"GET /stats HTTP/1.1\nHost: x\n\n",
    "TLS": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(40),
    "HTTP/2": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
}

_REPRS = ("b'", 'b"', "\\x", "bytearray", "aaaaaaaa", "Traceback")


@pytest.mark.parametrize("data", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_malformed_http_gets_a_json_400_and_no_traceback(
    http: Http, broker: Broker, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with raw_connection(address(broker)) as conn:
        await conn.send(data)
        response = await conn.response()
        assert 400 <= response.status < 500
        error = json_error(response)
        assert not any(mark in error for mark in _REPRS), error
        assert response.closes
        assert await conn.closed()
    assert (await http.request("GET", "/healthz"))[0] == 200
    for record in caplog.records:
        assert record.exc_info is None, record.getMessage()
        assert record.levelno < logging.WARNING, record.getMessage()
        assert not any(mark in record.getMessage() for mark in _REPRS), record.getMessage()
    assert (await http.stats())["totals"]["enqueued"] == 0


async def test_malformed_requests_are_logged_in_one_line_at_most_every_ten_seconds(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    for _ in range(30):
        response = await exchange(address(broker), MALFORMED["a NUL in a header"])
        assert response.status == 400
    lines = [r for r in caplog.records if r.levelno >= logging.INFO and "bad" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "127.0.0.1" in lines[0].getMessage()
    assert "header" in lines[0].getMessage()


async def test_a_malformed_request_after_good_ones_on_one_connection(broker: Broker) -> None:
    async with raw_connection(address(broker)) as conn:
        for _ in range(3):
            await conn.send(request("GET", "/healthz"))
            assert (await conn.response()).status == 200
        await conn.send(MALFORMED["a NUL in a header"])
        response = await conn.response()
        assert response.status == 400
        json_error(response)
        assert await conn.closed()


# -- 5. time-outs ---------------------------------------------------------------------------------

# Short time-outs, so a test takes a second or two; real time (they are the transport's, on the
# event loop), while the service runs on the fake clock: a parked long-poll stays parked for as
# long as the test likes.
HEADER_TIMEOUT, BODY_TIMEOUT, IDLE_TIMEOUT = 0.4, 0.4, 0.8


@pytest.fixture(params=[True, False], ids=["fast-lane", "aiohttp-only"])
async def strict(clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    """Short time-outs, kept by the fast lane (the default) or by aiohttp's handler of the
    connection (``-http-fast-lane=false``): the same both ways."""
    async with http_broker(
        clock=clock,
        read_header_timeout=HEADER_TIMEOUT,
        read_body_timeout=BODY_TIMEOUT,
        idle_timeout=IDLE_TIMEOUT,
        http_fast_lane=request.param,
    ) as b:
        yield b


def test_the_timeout_flags_reach_the_config() -> None:
    from wqbroker import __main__ as cli
    from wqbroker.config import config_from_args

    config = config_from_args(cli.parse_args([]))
    assert (config.read_header_timeout, config.read_body_timeout, config.idle_timeout) == (
        10.0,
        30.0,
        75.0,
    )
    args = cli.parse_args(
        ["-read-header-timeout-ms", "500", "--read-body-timeout-ms=700", "-idle-timeout-ms=900"]
    )
    config = config_from_args(args)
    assert (config.read_header_timeout, config.read_body_timeout, config.idle_timeout) == (
        0.5,
        0.7,
        0.9,
    )


async def test_slowloris_is_cut_off_while_a_long_poll_and_others_carry_on(
    strict: Broker,
) -> None:
    loop = asyncio.get_running_loop()
    began = loop.time()
    async with http_client(strict.http_url) as http:
        poll = asyncio.create_task(http.request("GET", "/jobs/next?wait_ms=30000"))
        await wait_until(lambda: strict.service.waiting == 1, what="the long-poll to park")
        async with raw_connection(address(strict)) as slow:
            dribbled = 0

            async def dribble() -> None:
                nonlocal dribbled
                head = request("GET", "/stats", headers={"X-Slow": "y" * 1000})
                for byte in head:
                    await slow.send(bytes([byte]))
                    dribbled += 1
                    await asyncio.sleep(0.02)

            dribbler = asyncio.create_task(dribble())
            response = await slow.response()
            assert response.status == 408
            assert "within 400 ms" in json_error(response)
            assert await slow.closed()
            dribbler.cancel()
            assert dribbled < 200  # cut off long before the head was done
            # Everyone else is served meanwhile.
            assert (await http.request("GET", "/healthz"))[0] == 200
        # The long-poll outlives every time-out, twice over, and still gets its task.
        await wait_until(
            loop.time, lambda now: now > began + 2 * IDLE_TIMEOUT, what="the time-outs to pass"
        )
        assert not poll.done()
        task_id = await http.enqueue({"n": 1})
        status, body = await asyncio.wait_for(poll, 5)
        assert status == 200
        assert body["task"]["id"] == task_id


async def test_a_connection_that_sends_nothing_is_closed_without_an_answer(
    strict: Broker,
) -> None:
    async with raw_connection(address(strict)) as conn:
        assert await conn.closed(timeout=5)


async def test_a_slow_body_gets_408_and_a_closed_connection(strict: Broker) -> None:
    async with raw_connection(address(strict)) as conn:
        await conn.send(request("POST", "/jobs", headers={"Content-Length": "100"}))
        await conn.send(b'{"payload": ')  # and nothing more
        response = await conn.response()
        assert response.status == 408
        assert "body" in json_error(response)
        assert response.closes
        assert await conn.closed()
    async with http_client(strict.http_url) as http:
        assert (await http.stats())["totals"]["enqueued"] == 0


async def test_an_idle_connection_is_kept_for_the_idle_timeout_then_closed(
    strict: Broker,
) -> None:
    loop = asyncio.get_running_loop()
    async with raw_connection(address(strict)) as conn:
        await conn.send(request("GET", "/healthz"))
        assert (await conn.response()).status == 200
        # Idle for longer than the head time-out (which only starts with a request's first
        # byte), well within the idle one: still open.
        resumed = loop.time() + HEADER_TIMEOUT * 1.5
        await wait_until(loop.time, lambda now: now > resumed, what="a pause")
        await conn.send(request("GET", "/healthz"))
        assert (await conn.response()).status == 200
        quiet_since = loop.time()
        assert await conn.closed(timeout=5)
        assert loop.time() - quiet_since >= IDLE_TIMEOUT * 0.9


async def test_the_head_time_out_of_a_later_request_runs_from_its_own_first_byte(
    strict: Broker,
) -> None:
    """On a kept connection, after an answer and a pause longer than the head time-out, a
    request dribbled in is given the whole time-out from its first byte, and no more."""
    loop = asyncio.get_running_loop()
    async with raw_connection(address(strict)) as conn:
        await conn.send(request("GET", "/healthz"))
        assert (await conn.response()).status == 200
        resumed = loop.time() + HEADER_TIMEOUT * 1.5
        await wait_until(loop.time, lambda now: now > resumed, what="a pause")
        started = loop.time()
        dribbler = asyncio.create_task(_dribble(conn, request("GET", "/stats") + bytes(10_000)))
        response = await conn.response()
        cut_after = loop.time() - started
        dribbler.cancel()
        assert response.status == 408
        assert HEADER_TIMEOUT * 0.9 <= cut_after < HEADER_TIMEOUT * 5
        assert await conn.closed()


@pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "aiohttp-only"])
async def test_a_head_after_a_pause_is_not_given_the_idle_time_out(fast_lane: bool) -> None:
    """After an answer and a pause longer than the head time-out, a kept connection waits for
    the idle time-out (a long one here); once a request's first byte comes, its head is due
    within the head time-out of it, not whenever the idle time-out would have ended."""
    loop = asyncio.get_running_loop()
    async with http_broker(
        read_header_timeout=HEADER_TIMEOUT, idle_timeout=60.0, http_fast_lane=fast_lane
    ) as b:
        async with raw_connection(address(b)) as conn:
            await conn.send(request("GET", "/healthz"))
            assert (await conn.response()).status == 200
            resumed = loop.time() + HEADER_TIMEOUT * 1.5
            await wait_until(loop.time, lambda now: now > resumed, what="a pause")
            started = loop.time()
            await conn.send(b"GET /stats HTTP/1.1\r\nHost")  # and nothing more
            response = await conn.response(timeout=10)
            assert response.status == 408
            assert HEADER_TIMEOUT * 0.9 <= loop.time() - started < HEADER_TIMEOUT * 5
            assert await conn.closed()


async def _dribble(conn: Any, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        for byte in data:
            await conn.send(bytes([byte]))
            await asyncio.sleep(0.02)


# -- answers written in one piece are the bytes aiohttp would write ------------------------------


def _answer_app(hook: bool = False) -> web.Application:
    """``/{kind}/{status}``: the same answer made as the broker makes it (``answer``) or as a
    plain aiohttp Response (``plain``); ``?close`` forces the connection shut, ``?header`` adds a
    header (as a middleware might), ``?empty`` sends an empty body, ``?bytearray`` a body that
    is not bytes; with ``hook``, a response hook adds a header to every answer."""

    async def handle(request: web.Request) -> web.StreamResponse:
        status = int(request.match_info["status"])
        body = b"" if "empty" in request.query else b'{"id":"abc"}'
        response: web.Response
        if request.match_info["kind"] == "answer":
            response = no_content() if status == 204 else json_response(body, status)
        elif status == 204:
            response = web.Response(status=204)
        else:
            response = web.Response(body=body, status=status, content_type="application/json")
        if "close" in request.query:
            response.force_close()
        if "header" in request.query:
            response.headers["Retry-After"] = "1"
        if "bytearray" in request.query and status != 204:
            response.body = bytearray(body)
        return response

    async def stamp(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Hooked"] = "yes"

    app = web.Application()
    app.router.add_route("*", "/{kind}/{status}", handle)
    if hook:
        app.on_response_prepare.append(stamp)
    return app


async def _bytes_of(port: int, head: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += await asyncio.wait_for(reader.read(65536), 5)
        headers, _, body = answer.partition(b"\r\n\r\n")
        for line in headers.split(b"\r\n"):
            if line.lower().startswith(b"content-length:") and b"HEAD" not in head[:5]:
                while len(body) < int(line.split(b":")[1]):
                    body += await asyncio.wait_for(reader.read(65536), 5)
        # The Date header alone may differ (a second may pass between the two answers).
        lines = [line for line in headers.split(b"\r\n") if not line.startswith(b"Date: ")]
        return b"\r\n".join(lines) + b"\r\n\r\n" + body
    finally:
        writer.close()


@pytest.mark.parametrize("status", [200, 201, 204, 404])
@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /{kind}/{status} HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /{kind}/{status} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /{kind}/{status} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /{kind}/{status}?close HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /{kind}/{status}?header HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /{kind}/{status}?empty HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /{kind}/{status}?bytearray HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /{kind}/{status} HTTP/1.0\r\n\r\n",
        b"GET /{kind}/{status} HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        b"HEAD /{kind}/{status} HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
async def test_an_answer_in_one_piece_is_what_aiohttp_would_send(
    status: int, request_head: bytes
) -> None:
    await _same_answers(_answer_app(), status, request_head)


async def test_a_response_hook_is_honoured() -> None:
    head = b"GET /{kind}/{status} HTTP/1.1\r\nHost: x\r\n\r\n"
    answer = await _same_answers(_answer_app(hook=True), 201, head)
    assert b"X-Hooked: yes\r\n" in answer


async def _same_answers(app: web.Application, status: int, request_head: bytes) -> bytes:
    """The answer made as the broker makes it; asserted to be the plain Response's, byte for
    byte (but the Date)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        answers = [
            await _bytes_of(
                port, request_head.replace(b"{kind}", kind).replace(b"{status}", b"%d" % status)
            )
            for kind in (b"answer", b"plain")
        ]
        assert answers[0] == answers[1]
        assert answers[0].startswith(b"HTTP/1.")
        return answers[0]
    finally:
        await runner.cleanup()
