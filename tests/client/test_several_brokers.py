"""Several brokers in one HTTP URL (``http://a:8080,b:8080``), as the client spreads and fails
over: requests in turn, a broker that cannot be connected to skipped for a while (on a fake
clock) and tried again after, a request that reached a broker never sent to another, and a URL
with a host missing refused at once. Real brokers on port 0, and a fake one that reads a request
and never answers it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from tests.fake_clock import FakeClock
from tests.helpers import http_broker, wait_until
from tests.procs import free_port
from wqbroker.broker import Broker
from wqclient import AsyncClient, Unavailable, Worker, WqError
from wqclient._brokers import SKIP_FIRST
from wqclient._http import HttpTransport
from wqclient.client import make_transport
from wqclient.models import Task

pytestmark = pytest.mark.timeout(60)


async def enqueued(broker: Broker) -> int:
    return (await broker.service.stats()).totals.enqueued


def nothing_there() -> str:
    """host:port of a port nothing listens on (a connection to it is refused)."""
    return f"127.0.0.1:{free_port()}"


async def enqueue(wq: AsyncClient, count: int) -> None:
    for n in range(count):  # (one at a time: each a request of its own)
        await wq.enqueue({"n": n})


async def test_requests_are_spread_over_the_brokers_in_turn() -> None:
    async with http_broker() as a, http_broker() as b:
        url = f"http://{a.http_addresses[0]},{b.http_addresses[0]}"
        async with AsyncClient(url) as wq:
            await enqueue(wq, 10)
            assert (await enqueued(a), await enqueued(b)) == (5, 5)
            assert wq.url == url


async def test_a_broker_that_cannot_be_connected_to_is_skipped_for_a_while() -> None:
    """Its turn goes to the others (evenly), for SKIP_FIRST seconds after a first refusal and
    twice as long after a second in a row; then it is tried again, and has its turns back."""
    clock = FakeClock()
    down = nothing_there()
    async with http_broker() as a, http_broker() as b:
        url = f"http://{down},{a.http_addresses[0]},{b.http_addresses[0]}"
        transport = HttpTransport(url, clock=clock)
        async with AsyncClient(transport=transport) as wq:
            await enqueue(wq, 6)  # the first is refused by the one that is down, then goes on
            assert (await enqueued(a), await enqueued(b)) == (3, 3)
            clock.now += SKIP_FIRST
            await enqueue(wq, 1)  # tried again, refused again: skipped twice as long
            assert await enqueued(a) + await enqueued(b) == 7
            async with http_broker(addr=down) as back:
                clock.now += SKIP_FIRST * 1.5
                await enqueue(wq, 4)
                assert await enqueued(back) == 0  # still skipped
                clock.now += SKIP_FIRST
                await enqueue(wq, 6)
                assert await enqueued(back) == 2  # its turns again: one in three
                assert await enqueued(a) + await enqueued(b) == 7 + 4 + 4


@asynccontextmanager
async def answers_nothing(after: str) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A fake broker (its host:port, and the requests it read) that reads a request's head and
    then, ``after`` it: "close" closes the connection, "wait" keeps it open and never answers."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            seen.append(await reader.readuntil(b"\r\n\r\n"))
            if after == "wait":
                await reader.read()  # (until the client gives up)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        server.close()


@pytest.mark.parametrize("after", ["close", "wait"])
async def test_a_request_that_reached_a_broker_is_never_sent_to_another(after: str) -> None:
    """Its answer lost (the connection closed, or no answer in time), an enqueue may have been
    taken: sent again elsewhere, it could be enqueued twice. It fails instead, as with one
    broker, and the next request goes on to the next broker."""
    async with answers_nothing(after) as (silent, seen), http_broker() as live:
        async with AsyncClient(f"http://{silent},{live.http_addresses[0]}", timeout=0.5) as wq:
            with pytest.raises(Unavailable):
                await wq.enqueue({"n": 1})
            assert len(seen) == 1
            assert seen[0].startswith(b"POST /jobs")
            assert await enqueued(live) == 0
            await wq.enqueue({"n": 2})
            assert await enqueued(live) == 1


async def test_when_no_broker_can_be_connected_to_the_request_fails_naming_each() -> None:
    first, second = nothing_there(), nothing_there()
    async with AsyncClient(f"http://{first},{second}") as wq:
        with pytest.raises(Unavailable) as e:
            await wq.stats()
    assert e.value.message.startswith("cannot reach any of the brokers (")
    assert f"http://{first}: " in e.value.message
    assert f"http://{second}: " in e.value.message


async def test_a_worker_works_on_through_the_brokers_that_can_be_reached() -> None:
    """Its claims and its acks go round the brokers; the one that is down costs nothing."""
    async with http_broker() as live:
        async with AsyncClient(live.http_url) as direct:
            await enqueue(direct, 6)
            url = f"http://{nothing_there()},{live.http_addresses[0]}"
            done: list[Task] = []
            async with AsyncClient(url) as wq:
                worker = Worker(wq, done.append, concurrency=2, wait_ms=100)
                running = asyncio.create_task(worker.run())
                try:
                    await wait_until(
                        direct.stats, lambda stats: stats.totals.acked == 6, what="6 acks"
                    )
                finally:
                    worker.stop()
                    await asyncio.wait_for(running, 10)
            assert sorted(task.payload["n"] for task in done) == list(range(6))
            assert (await direct.stats()).totals.acked == 6


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://127.0.0.1:1,,127.0.0.1:2", "a host is missing between commas"),
        ("http://127.0.0.1:1,", "a host is missing between commas"),
        ("https://a:8080,b:80x", "'b:80x' has no valid port"),
        ("http://a:8080,:8081", "has no host"),
    ],
)
def test_a_url_with_a_host_missing_or_a_bad_port_is_refused_at_once(url: str, says: str) -> None:
    with pytest.raises(WqError, match=says):
        make_transport(url)
    with pytest.raises(WqError, match=says):
        AsyncClient(url)
