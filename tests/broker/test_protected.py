"""Protected mode (``wqbroker.protected``): a broker without ``-token-file`` serves only loopback
clients, and refuses the others with a message naming ``-token-file`` and ``-public`` (HTTP 403,
gRPC PERMISSION_DENIED), health probes excepted; ``-public`` serves anyone (logged loudly); a
token file serves every address (tokens protect it).

The refused client is this machine itself, through its non-loopback address (found at run time:
the machine must have one, as CI's has; the tests that need it are skipped otherwise)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.authkit import ROOT, bearer, metadata, write_token_file
from tests.helpers import running_broker
from tests.rawhttp import raw_connection
from wqbroker.__main__ import parse_args
from wqbroker.auth import NO_TOKEN
from wqbroker.broker import Broker
from wqbroker.config import FLAGS, config_from_args
from wqbroker.protected import (
    PROBES,
    REFUSAL,
    describe_peer,
    grpc_peer_is_local,
    is_loopback,
    local_peer,
)
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

Code = grpc.StatusCode


# -- the rule -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.0.0.53",
        "127.255.255.254",
        "::1",
        "[::1]",
        "0:0:0:0:0:0:0:1",
        "::ffff:127.0.0.1",
        "::ffff:7f00:2",
        "[::ffff:127.1.2.3]",
        " 127.0.0.1 ",
    ],
)
def test_loopback_addresses_are_loopback(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host",
    [
        "192.0.2.2",
        "10.0.0.1",
        "0.0.0.0",
        "128.0.0.1",
        "126.255.255.255",
        "::",
        "::2",
        "fe80::1%eth0",
        "fd00::2",
        "::ffff:192.0.2.2",
        "::127.0.0.1",  # (IPv4-compatible, not mapped: not loopback)
        "64:ff9b::7f00:1",  # (NAT64 of 127.0.0.1: it came from elsewhere)
        "localhost",  # (a name, not an address)
        "",
        "127.0.0.1.",
        "127.0.0.256",
        "127.1",
        "::1::",
        "[::1",
        "127.0.0.1:80",
        "not an address",
    ],
)
def test_other_addresses_and_text_that_is_none_are_not(host: str) -> None:
    assert not is_loopback(host)


def test_a_socket_peer_is_local_when_its_host_is_loopback_or_it_is_a_unix_socket() -> None:
    assert local_peer(("127.0.0.1", 5000))
    assert local_peer(("::1", 5000, 0, 0))
    assert local_peer(("::ffff:127.0.0.1", 5000, 0, 0))
    assert local_peer("/run/wq.sock")
    assert local_peer("")  # (an unnamed Unix socket)
    assert not local_peer(("192.0.2.2", 5000))
    assert not local_peer(("::ffff:192.0.2.2", 5000, 0, 0))
    assert not local_peer(None)  # (the peer is gone: refused, not served)
    assert not local_peer(())
    assert not local_peer((5000,))


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("ipv6:%5B::1%5D:5000", True),  # (percent-encoded, as newer gRPC versions write it)
        ("ipv6:%5B::ffff:127.0.0.1%5D:5000", True),
        ("unix:/run/wq.sock", True),
        ("unix-abstract:wq", True),
        ("ipv4:192.0.2.2:5000", False),
        ("ipv6:[fd00::2]:5000", False),
        ("ipv6:[::ffff:192.0.2.2]:5000", False),
        ("ipv6:%5Bfd00::2%5D:5000", False),
        ("ipv4:127.0.0.1", False),  # (no port: not a peer gRPC writes)
        ("ipv4:127.0.0.1:", False),
        ("127.0.0.1:5000", False),
        ("dns:localhost:5000", False),
        ("", False),
        (None, False),
        ("ipv4", False),
    ],
)
def test_a_grpc_peer_is_read_as_grpc_writes_it(peer: str | None, local: bool) -> None:
    assert grpc_peer_is_local(peer) is local


def test_the_probes_need_no_token_with_a_token_file_either() -> None:
    assert set(PROBES.http) <= set(NO_TOKEN.http)
    assert set(PROBES.grpc) <= set(NO_TOKEN.grpc)


def test_a_peer_is_described_as_host_and_port() -> None:
    assert describe_peer(("192.0.2.2", 5000)) == "192.0.2.2:5000"
    assert describe_peer(("fd00::2", 5000, 0, 0)) == "[fd00::2]:5000"
    assert describe_peer(None) == "None"


# -- the flag -------------------------------------------------------------------------------------


@pytest.fixture
def _no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for flag in FLAGS:
        monkeypatch.delenv("WQ_" + flag.dest.upper(), raising=False)


@pytest.mark.usefixtures("_no_settings_from_the_environment")
def test_public_is_a_switch_and_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_args(parse_args([])).public is False
    assert config_from_args(parse_args(["-public"])).public is True
    assert config_from_args(parse_args(["-public=false"])).public is False
    monkeypatch.setenv("WQ_PUBLIC", "true")
    assert config_from_args(parse_args([])).public is True
    assert config_from_args(parse_args(["-public=false"])).public is False  # (the flag wins)


# -- real servers ---------------------------------------------------------------------------------


def outside_address() -> str | None:
    """This machine's address as another machine reaches it (not loopback), or None."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # (no packet is sent: this only picks the route)
        host = str(s.getsockname()[0])
        if not is_loopback(host) and host != "0.0.0.0":
            return host
    with contextlib.suppress(OSError):
        for *_, sockaddr in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            host = str(sockaddr[0])
            if not is_loopback(host):
                return host
    return None


OUTSIDE = outside_address()
needs_outside = pytest.mark.skipif(OUTSIDE is None, reason="this machine has no non-loopback IPv4")


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


@contextlib.asynccontextmanager
async def everywhere(**config: Any) -> AsyncIterator[Broker]:
    """A broker on every IPv4 interface (HTTP and gRPC, port 0)."""
    config.setdefault("addr", "0.0.0.0:0")
    config.setdefault("grpc_addr", "0.0.0.0:0")
    async with running_broker(**config) as broker:
        yield broker


def outside_url(broker: Broker) -> str:
    return f"http://{OUTSIDE}:{port_of(broker.http_addresses[0])}"


def outside_target(broker: Broker) -> str:
    return f"{OUTSIDE}:{port_of(broker.grpc_addresses[0])}"


# Every kind of route: the API, the dashboard, metrics, the description, and no route at all.
REFUSED_HTTP = [
    ("GET", "/stats"),
    ("POST", "/jobs"),
    ("GET", "/jobs/next?queue=q&wait_ms=0"),
    ("POST", "/dlq/requeue"),
    ("POST", "/queues/q/pause"),
    ("GET", "/ui/"),
    ("GET", "/ui"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/no/such/route"),
    ("DELETE", "/healthz"),
    ("HEAD", "/stats"),
]


@needs_outside
@pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "aiohttp-only"])
async def test_without_a_token_file_http_from_outside_is_refused_and_says_what_to_do(
    fast_lane: bool,
) -> None:
    async with (
        everywhere(http_fast_lane=fast_lane, grpc_addr="off") as broker,
        aiohttp.ClientSession() as session,
    ):
        base = outside_url(broker)
        for method, path in REFUSED_HTTP:  # (one kept-alive connection: each gets the answer)
            async with session.request(method, base + path, json={"payload": 1}) as r:
                assert r.status == 403, (method, path)
                assert r.content_type == "application/json"
                if method != "HEAD":
                    assert await r.json() == {"error": REFUSAL}, (method, path)
        # Nothing reached the service.
        async with session.get(broker.http_url + "/stats") as r:
            assert (await r.json())["totals"]["enqueued"] == 0
        # The probes are answered (a kubelet probes from the node's address).
        for path in ("/healthz", "/readyz"):
            async with session.get(base + path) as r:
                assert r.status == 200, path
            async with session.head(base + path) as r:
                assert r.status == 200, path


@needs_outside
async def test_loopback_clients_are_served_as_ever() -> None:
    async with everywhere() as broker, aiohttp.ClientSession() as session:
        port = port_of(broker.http_addresses[0])
        for host in ("127.0.0.1", "localhost", "127.0.0.2"):
            async with session.post(
                f"http://{host}:{port}/jobs", json={"queue": "q", "payload": host}
            ) as r:
                assert r.status == 201, host
        async with session.get(f"http://127.0.0.1:{port}/ui/") as r:
            assert r.status == 200
        async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
            stats = await pb_grpc.BrokerStub(channel).Stats(pb.StatsRequest())
            assert stats.totals.enqueued == 3


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
async def test_ipv6_loopback_is_served_on_an_ipv6_socket() -> None:
    try:
        context = running_broker(addr="[::1]:0", grpc_addr="[::1]:0")
        broker = await context.__aenter__()
    except Exception as e:  # (a machine without ::1)
        pytest.skip(f"cannot listen on ::1: {e}")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{broker.http_addresses[0]}/stats") as r:
                assert r.status == 200
        async with grpc.aio.insecure_channel(broker.grpc_addresses[0]) as channel:
            await pb_grpc.BrokerStub(channel).Stats(pb.StatsRequest())
    finally:
        await context.__aexit__(None, None, None)


@needs_outside
async def test_a_refused_connection_answers_every_pipelined_request() -> None:
    async with everywhere(grpc_addr="off") as broker:
        address = f"{OUTSIDE}:{port_of(broker.http_addresses[0])}"
        async with raw_connection(address) as conn:
            body = b'{"queue":"q","payload":1}'
            one = (
                b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await conn.send(one * 20 + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            for _ in range(20):
                response = await conn.response()
                assert (response.status, response.json()) == (403, {"error": REFUSAL})
                assert not response.closes
            assert (await conn.response()).status == 200
        assert (await broker.service.stats()).totals.enqueued == 0


@needs_outside
async def test_a_refused_connection_with_a_big_body_gets_the_answer_not_a_reset() -> None:
    async with everywhere(grpc_addr="off", max_body=1024) as broker:
        address = f"{OUTSIDE}:{port_of(broker.http_addresses[0])}"
        async with raw_connection(address) as conn:
            body = b"x" * 200_000
            await conn.send(
                b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            response = await conn.response()
            assert (response.status, response.json()) == (403, {"error": REFUSAL})


@needs_outside
async def test_without_a_token_file_grpc_from_outside_is_refused_and_says_what_to_do() -> None:
    async with everywhere(addr="off") as broker:
        async with grpc.aio.insecure_channel(outside_target(broker)) as channel:
            stub = pb_grpc.BrokerStub(channel)
            calls: list[Any] = [
                stub.Stats(pb.StatsRequest()),
                stub.Enqueue(pb.EnqueueRequest(queue="q", payload=b"1")),
                stub.NextJob(pb.NextJobRequest(queues=["q"])),
                stub.PurgeDead(pb.PurgeDeadRequest()),
            ]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == Code.PERMISSION_DENIED
                assert caught.value.details() == REFUSAL
            # A stream of requests and answers (StreamJobs), and one of requests (Produce).
            stream = stub.StreamJobs(None)
            await stream.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=1)))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stream.read()
            assert (caught.value.code(), caught.value.details()) == (
                Code.PERMISSION_DENIED,
                REFUSAL,
            )
            produce = stub.Produce(None)
            await produce.write(
                pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(queue="q", payload=b"1")])
            )
            assert await produce.code() == Code.PERMISSION_DENIED
            # Reflection too (it describes the API: not a probe).
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            info = reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in info:
                    pass
            assert caught.value.code() == Code.PERMISSION_DENIED
            # Health checking is answered (Check, and the first answer of Watch).
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(service="wq.v1.Broker"))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            watch = health.Watch(health_pb2.HealthCheckRequest())
            first = await asyncio.wait_for(watch.read(), 5)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        # Loopback, on the same server (gRPC's default address, "[::]", sees mapped peers).
        async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
            stub = pb_grpc.BrokerStub(channel)
            await stub.Enqueue(pb.EnqueueRequest(queue="q", payload=b"1"))
        assert (await broker.service.stats()).totals.enqueued == 1


@needs_outside
async def test_grpc_on_every_interface_sees_ipv4_callers_as_mapped_and_refuses_them() -> None:
    async with everywhere(addr="off", grpc_addr=":0") as broker:  # (binds [::]: dual-stack)
        async with grpc.aio.insecure_channel(outside_target(broker)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pb_grpc.BrokerStub(channel).Stats(pb.StatsRequest())
            assert caught.value.code() == Code.PERMISSION_DENIED
        async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
            await pb_grpc.BrokerStub(channel).Stats(pb.StatsRequest())


@needs_outside
async def test_public_serves_anyone_and_says_so_loudly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="wqbroker"):
        async with everywhere(public=True) as broker, aiohttp.ClientSession() as session:
            async with session.post(outside_url(broker) + "/jobs", json={"payload": 1}) as r:
                assert r.status == 201
            async with session.get(outside_url(broker) + "/ui/") as r:
                assert r.status == 200
            async with grpc.aio.insecure_channel(outside_target(broker)) as channel:
                stats = await pb_grpc.BrokerStub(channel).Stats(pb.StatsRequest())
                assert stats.totals.enqueued == 1
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.name == "wqbroker"
    text = warning.getMessage()
    assert "-public" in text
    assert "without authentication" in text
    assert "anyone who can reach the ports can enqueue" in text
    assert "purge, requeue and pause" in text


async def test_without_public_start_up_says_only_loopback_is_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="wqbroker"):
        async with running_broker():
            pass
    said = [r.getMessage() for r in caplog.records if r.name == "wqbroker"]
    assert any("serving only loopback clients" in line for line in said)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@needs_outside
async def test_a_token_file_serves_every_address_to_token_holders(tmp_path: Path) -> None:
    tokens = write_token_file(tmp_path)
    async with everywhere(token_file=str(tokens)) as broker:
        async with aiohttp.ClientSession() as session:
            async with session.get(outside_url(broker) + "/stats", headers=bearer(ROOT)) as r:
                assert r.status == 200
            async with session.get(outside_url(broker) + "/stats") as r:
                assert r.status == 401  # (the token's refusal, not protected mode's)
                assert "token" in (await r.json())["error"]
        async with grpc.aio.insecure_channel(outside_target(broker)) as channel:
            stub = pb_grpc.BrokerStub(channel)
            await stub.Stats(pb.StatsRequest(), metadata=metadata(ROOT))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Stats(pb.StatsRequest())
            assert caught.value.code() == Code.UNAUTHENTICATED


@needs_outside
async def test_a_refused_peer_flooding_requests_does_not_stop_loopback_clients() -> None:
    async with everywhere() as broker:
        outside = outside_url(broker)
        refused = 0

        async def flood(session: aiohttp.ClientSession) -> None:
            nonlocal refused
            for _ in range(100):
                async with session.post(outside + "/jobs", json={"payload": 1}) as r:
                    assert r.status == 403
                    refused += 1

        async def flood_grpc() -> None:
            async with grpc.aio.insecure_channel(outside_target(broker)) as channel:
                stub = pb_grpc.BrokerStub(channel)
                for _ in range(100):
                    with pytest.raises(grpc.aio.AioRpcError):
                        await stub.Enqueue(pb.EnqueueRequest(queue="q", payload=b"1"))

        async def work(session: aiohttp.ClientSession) -> int:
            done = 0
            for i in range(50):
                async with session.post(
                    broker.http_url + "/jobs", json={"queue": "q", "payload": i}
                ) as r:
                    assert r.status == 201
                async with session.get(broker.http_url + "/jobs/next?queue=q&wait_ms=1000") as r:
                    assert r.status == 200
                    claimed = await r.json()
                task_id, lease_id = claimed["task"]["id"], claimed["lease_id"]
                async with session.post(
                    f"{broker.http_url}/jobs/{task_id}/ack?lease_id={lease_id}"
                ) as r:
                    assert r.status == 204
                    done += 1
            return done

        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with (
            aiohttp.ClientSession(connector=connector) as outsiders,
            aiohttp.ClientSession() as insider,
        ):
            results = await asyncio.gather(
                *(flood(outsiders) for _ in range(8)), flood_grpc(), work(insider)
            )
        assert results[-1] == 50
        assert refused == 800
        stats = await broker.service.stats()
        assert (stats.totals.enqueued, stats.totals.acked) == (50, 50)
