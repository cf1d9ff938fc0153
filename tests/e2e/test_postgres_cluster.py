"""Several wq brokers on one PostgreSQL database are one broker.

Real brokers (in this process, or as processes), real clients (aiohttp, wqclient over gRPC), a real
PostgreSQL (tests/pg.py: a database per test, dropped at the end of the run). What is shown:

- any operation on a task works through any broker, and /stats reads the same from each;
- a task made ready through one broker wakes a consumer parked on another at once (by
  LISTEN/NOTIFY: the brokers here poll every 30 s, so nothing else could explain a prompt answer);
- broker processes killed with SIGKILL under load lose nothing: the survivors keep serving,
  reclaim what the dead one handed out and promote what it delayed;
- a broker cut off from the database answers 503 and recovers by itself, LISTENing again;
  connections killed by the server are replaced;
- brokers whose clocks are an hour apart agree on what is due (the database's clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import random
import signal
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests import pg
from tests.helpers import Http, invariant_holds, wait_until
from tests.procs import BrokerProcess, broker_process, free_port
from wqbroker.broker import Broker
from wqbroker.clock import Clock, SystemClock, TimerHandle
from wqbroker.config import Config
from wqclient import AsyncClient, LeaseLost, NotFound, Task, Worker

# What "at once" means for a wake-up, a reclaim after its deadline, a promotion after its delay:
# these take milliseconds; the bound is generous for a loaded two-core machine.
PROMPT = 2.0
# The brokers' fallback poll (Config.poll_interval), and the sweep of brokers that only consume in
# the wake-up tests: long enough that only a LISTEN/NOTIFY wake-up explains a prompt answer.
QUIET = 30.0
# A long-poll's wait when it is expected to be woken (well beyond PROMPT, well below QUIET).
LONG_WAIT_MS = 20_000


# -- brokers in this process ----------------------------------------------------------------------


class Node:
    """A broker started in this event loop, with an HTTP client for it."""

    def __init__(self, broker: Broker, session: aiohttp.ClientSession) -> None:
        self.broker = broker
        self.http = Http(session, broker.http_url)
        self.grpc_url = "grpc://" + broker.grpc_target
        self._stopped = False

    @property
    def waiting(self) -> int:
        """Consumers parked on this broker (long-polls and streams with room)."""
        return self.broker.service.waiting

    async def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            await self.broker.stop()

    async def get(self, path: str) -> tuple[int, Any]:
        return await self.http.request("GET", path)

    async def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return await self.http.request("POST", path, json=body, **kw)

    async def enqueue(self, payload: Any = None, **fields: Any) -> str:
        return await self.http.enqueue(payload, **fields)

    async def claim(self, query: str = "", wait_ms: int = 0, lease_ms: int = 30_000) -> Any:
        """A delivery (the JSON body), or None (204)."""
        status, body = await self.get(f"/jobs/next?wait_ms={wait_ms}&lease_ms={lease_ms}{query}")
        assert status in (200, 204), (status, body)
        return body

    async def task(self, task_id: str) -> Any:
        status, body = await self.get(f"/jobs/{task_id}")
        assert status == 200, (status, body)
        return body

    async def park(
        self, query: str = "", wait_ms: int = LONG_WAIT_MS, lease_ms: int = 30_000
    ) -> asyncio.Task[tuple[int, Any]]:
        """Start a long-poll and return once it is parked on this broker."""
        before = self.waiting
        poll = asyncio.ensure_future(
            self.get(f"/jobs/next?wait_ms={wait_ms}&lease_ms={lease_ms}{query}")
        )
        await wait_until(lambda: self.waiting > before or poll.done(), what="a long-poll to park")
        assert not poll.done(), poll.result()
        return poll


class Cluster:
    """Brokers on one database, sharing one HTTP session; all stopped at the end."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.nodes: list[Node] = []
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=45)
        )

    async def add(
        self, *, clock: Clock | None = None, dsn: str | None = None, **config: Any
    ) -> Node:
        """Start a broker (HTTP and gRPC on port 0) on the database (or ``dsn``). It polls only
        every QUIET seconds unless ``poll_interval`` says otherwise."""
        config.setdefault("poll_interval", QUIET)
        broker = Broker(
            Config(addr="127.0.0.1:0", grpc_addr="127.0.0.1:0", store=dsn or self.dsn, **config),
            clock=clock,
        )
        await broker.start()
        node = Node(broker, self.session)
        self.nodes.append(node)
        return node

    async def close(self) -> None:
        for node in self.nodes:
            await node.stop()
        await self.session.close()


@pytest.fixture
async def dsn() -> str:
    return await pg.create_database("cluster")


@pytest.fixture
async def cluster(dsn: str) -> AsyncIterator[Cluster]:
    c = Cluster(dsn)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def pair(cluster: Cluster) -> tuple[Node, Node]:
    return await cluster.add(), await cluster.add()


def stamp(text: str) -> float:
    """An RFC 3339 timestamp of the API, as epoch seconds."""
    return datetime.fromisoformat(text).timestamp()


_TIMES = ("created_at", "available_at")


def assert_same_task(x: Any, y: Any) -> None:
    """Two views of one task through two brokers: equal, the times to within what the brokers'
    estimates of their skew from the database's clock may differ by."""
    assert {k: v for k, v in x.items() if k not in _TIMES} == {
        k: v for k, v in y.items() if k not in _TIMES
    }
    for k in _TIMES:
        assert abs(stamp(x[k]) - stamp(y[k])) < 0.05, (k, x[k], y[k])


def assert_invariants(stats: Any) -> None:
    t = stats["totals"]
    gauges = stats["ready"] + stats["handed_out"] + stats["delayed"] + stats["dead"]
    assert gauges == t["enqueued"] - t["acked"] - t["purged"], stats
    assert invariant_holds(stats), stats


async def same_stats(nodes: Sequence[Node], query: str = "") -> Any:
    """/stats (with ``query``) from every broker: one answer, which obeys the invariants."""
    answers = [await n.get("/stats" + query) for n in nodes]
    assert all(status == 200 for status, _ in answers), answers
    first = answers[0][1]
    assert all(body == first for _, body in answers), answers
    assert_invariants(first)
    return first


async def claim_soon(node: Node, query: str = "", timeout: float = 5.0) -> Any:
    """A task claimed through ``node``, asking every 20 ms: when it became claimable, whether
    or not a long-poll would have been woken (the wake-up tests tell that)."""
    return await wait_until(
        lambda: node.claim(query),
        lambda d: d is not None,
        what="a task to claim",
        timeout=timeout,
        interval=0.02,
    )


async def answered(poll: Awaitable[tuple[int, Any]], within: float = PROMPT) -> tuple[int, Any]:
    return await asyncio.wait_for(poll, within)


# -- 1. one broker, whichever you ask -------------------------------------------------------------


async def test_a_task_enqueued_on_one_is_claimed_on_the_other_and_acked_on_the_first(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    task_id = await a.enqueue({"n": 1})
    d = await b.claim()
    assert d is not None
    assert d["task"]["id"] == task_id
    assert d["task"]["payload"] == {"n": 1}
    assert await a.http.ack(task_id, "0" * 16) == 409  # another lease: refused, whoever asks
    assert await a.http.ack(task_id, d["lease_id"]) == 204
    assert await b.http.ack(task_id, d["lease_id"]) == 404  # gone, for both
    assert (await a.get(f"/jobs/{task_id}"))[0] == 404
    assert (await b.get(f"/jobs/{task_id}"))[0] == 404
    assert await b.claim() is None
    stats = await same_stats(pair)
    assert (stats["totals"]["enqueued"], stats["totals"]["delivered"]) == (1, 1)
    assert stats["totals"]["acked"] == 1


async def test_a_nack_on_the_other_broker_retries_the_task(pair: tuple[Node, Node]) -> None:
    a, b = pair
    task_id = await b.enqueue({"n": 1}, max_attempts=3)
    d = await a.claim()
    assert d["task"]["id"] == task_id
    assert await b.http.nack(task_id, "0" * 16) == 409
    # a plain nack through the other broker: the backoff (about a second), so delayed for now
    assert await b.http.nack(task_id, d["lease_id"], "first") == 204
    for node in pair:
        view = await node.task(task_id)
        assert (view["state"], view["attempts"], view["last_error"]) == ("delayed", 1, "first")
    d = await b.claim(wait_ms=5000)  # promoted by whichever broker sweeps first
    assert d is not None
    task = d["task"]
    assert (task["id"], task["attempts"], task["last_error"]) == (task_id, 2, "first")
    # nack with delay_ms=0 through the other: ready again at once
    status, _ = await a.post(
        f"/jobs/{task_id}/nack?lease_id={d['lease_id']}", {"error": "second", "delay_ms": 0}
    )
    assert status == 204
    d = await b.claim(wait_ms=2000)
    assert d is not None
    assert (d["task"]["attempts"], d["task"]["last_error"]) == (3, "second")
    # the last attempt fails: buried, seen as dead from both
    assert await a.http.nack(task_id, d["lease_id"], "third") == 204
    for node in pair:
        assert (await node.task(task_id))["state"] == "dead"
    totals = (await same_stats(pair))["totals"]
    assert (totals["nacked"], totals["retried"], totals["buried"]) == (3, 2, 1)


async def test_a_lease_extended_through_the_other_broker_outlives_its_first_deadline(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    task_id = await a.enqueue({"n": 1})
    d = await a.claim(lease_ms=1000)
    first_deadline = stamp(d["deadline"])
    lease = d["lease_id"]
    path = f"/jobs/{task_id}/extend?lease_id={lease}&lease_ms=4000"
    status, body = await b.post(f"/jobs/{task_id}/extend?lease_id={'0' * 16}&lease_ms=4000")
    assert status == 409, body
    status, body = await b.post(path)
    assert status == 200, body
    assert stamp(body["deadline"]) > first_deadline + 2.5
    assert abs(stamp(body["deadline"]) - (time.time() + 4.0)) < 0.5
    # past the first deadline, nobody (neither broker's sweeper) reclaimed it
    await asyncio.sleep(max(0.0, first_deadline - time.time()) + 0.6)
    for node in pair:
        assert (await node.task(task_id))["state"] == "handed_out"
    assert (await same_stats(pair))["totals"]["reclaimed"] == 0
    assert await a.http.ack(task_id, lease) == 204
    status, _ = await b.post(path)
    assert status == 404


async def test_a_task_looks_the_same_from_both_brokers_in_every_state(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    task_id = await a.enqueue({"n": 1}, max_attempts=2, queue="mail", priority=4)

    async def both(state: str) -> None:
        x, y = await a.task(task_id), await b.task(task_id)
        assert_same_task(x, y)
        assert (x["state"], x["queue"], x["priority"]) == (state, "mail", 4)

    await both("ready")
    d = await b.claim("&queue=mail")
    await both("handed_out")
    status, _ = await a.post(
        f"/jobs/{task_id}/nack?lease_id={d['lease_id']}", {"error": "later", "delay_ms": 60_000}
    )
    assert status == 204
    await both("delayed")
    assert (await a.task(task_id))["last_error"] == "later"


async def test_a_task_buried_through_one_is_requeued_and_purged_through_the_other(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    first = await a.enqueue({"n": 1}, max_attempts=1)
    second = await a.enqueue({"n": 2}, max_attempts=5)
    third = await a.enqueue({"n": 3}, max_attempts=5, queue="other")
    d1, d2 = await b.claim(), await b.claim()
    d3 = await a.claim("&queue=other")
    assert [d1["task"]["id"], d2["task"]["id"], d3["task"]["id"]] == [first, second, third]
    assert await a.http.nack(first, d1["lease_id"], "out of attempts") == 204
    status, _ = await a.post(
        f"/jobs/{second}/nack?lease_id={d2['lease_id']}", {"error": "bad", "terminal": True}
    )
    assert status == 204
    status, _ = await b.post(
        f"/jobs/{third}/nack?lease_id={d3['lease_id']}", {"error": "bad", "terminal": True}
    )
    assert status == 204
    # the DLQ, from either broker: the same tasks, in burial order
    status, dead_a = await a.get("/dlq")
    assert status == 200
    status, dead_b = await b.get("/dlq")
    assert [t["id"] for t in dead_a] == [t["id"] for t in dead_b] == [first, second, third]
    assert [t["last_error"] for t in dead_b] == ["out of attempts", "bad", "bad"]
    # requeued through the other broker: ready again with a clean start, claimable anywhere
    assert (await b.post(f"/dlq/{first}/requeue"))[0] == 204
    assert (await a.post(f"/dlq/{first}/requeue"))[0] == 404
    d = await a.claim()
    assert (d["task"]["id"], d["task"]["attempts"], d["task"]["last_error"]) == (first, 1, None)
    assert await b.http.ack(first, d["lease_id"]) == 204
    # bulk requeue of one queue through one, a purge through the other
    assert await b.post("/dlq/requeue?queue=other") == (200, {"requeued": 1})
    assert (await a.task(third))["state"] == "ready"
    assert (await a.http.request("DELETE", f"/dlq/{second}"))[0] == 204
    assert (await b.http.request("DELETE", f"/dlq/{second}"))[0] == 404
    assert (await b.get("/dlq"))[1] == []
    totals = (await same_stats(pair))["totals"]
    assert (totals["buried"], totals["requeued"], totals["purged"]) == (3, 2, 1)


async def test_stats_are_the_same_from_both_brokers_after_a_known_workload(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    t = [await a.enqueue({"t": i}) for i in range(1, 5)]
    t.append(await b.enqueue({"t": 5}, max_attempts=1))
    await b.enqueue({"m": 1}, queue="mail")
    await b.enqueue({"m": 2}, queue="mail")
    d = [await (b if i % 2 == 0 else a).claim() for i in range(5)]
    assert [x["task"]["id"] for x in d] == t  # oldest first, whichever broker enqueued
    assert await a.http.ack(t[0], d[0]["lease_id"]) == 204
    retry = {"error": "later", "delay_ms": 60_000}
    assert (await b.post(f"/jobs/{t[1]}/nack?lease_id={d[1]['lease_id']}", retry))[0] == 204
    bury = {"error": "no", "terminal": True}
    assert (await a.post(f"/jobs/{t[2]}/nack?lease_id={d[2]['lease_id']}", bury))[0] == 204
    assert (await b.post(f"/dlq/{t[2]}/requeue"))[0] == 204
    # t[3] stays handed out; t[4] (one attempt) is buried by a nack, then purged
    assert await b.http.nack(t[4], d[4]["lease_id"], "no") == 204
    assert (await a.http.request("DELETE", f"/dlq/{t[4]}"))[0] == 204
    m = await a.claim("&queue=mail")
    assert await b.http.ack(m["task"]["id"], m["lease_id"]) == 204

    stats = await same_stats(pair)
    assert stats == {
        "ready": 2,
        "handed_out": 1,
        "delayed": 1,
        "dead": 0,
        "waiting": 0,  # (the gauges of docs/design/results.md: nothing waits, no result held)
        "succeeded": 0,
        "totals": {
            "enqueued": 7,
            "delivered": 6,
            "acked": 2,
            "nacked": 3,
            "reclaimed": 0,
            "retried": 1,
            "buried": 2,
            "requeued": 1,
            "purged": 1,
            "cancelled": 0,
            "expired": 0,
        },
    }
    mail = await same_stats(pair, "?queue=mail")
    assert (mail["ready"], mail["totals"]["enqueued"], mail["totals"]["acked"]) == (1, 2, 1)
    status, queues_a = await a.get("/queues")
    assert status == 200
    queues_b = (await b.get("/queues"))[1]
    # The same, but for the times each broker translates into its own clock (to within the
    # error of its estimate of the database's clock: well under a round trip).
    times_a = [q.pop("oldest_ready_at") for q in queues_a]
    times_b = [q.pop("oldest_ready_at") for q in queues_b]
    assert queues_a == queues_b
    for at_a, at_b in zip(times_a, times_b, strict=True):
        assert (at_a is None) == (at_b is None)
        if at_a is not None:
            gap = datetime.fromisoformat(at_a) - datetime.fromisoformat(at_b)
            assert abs(gap.total_seconds()) < 0.05
    assert [(q["name"], q["ready"], q["handed_out"], q["delayed"]) for q in queues_a] == [
        ("default", 1, 1, 1),
        ("mail", 1, 0, 0),
    ]


async def test_idempotency_keys_are_shared_by_the_brokers(pair: tuple[Node, Node]) -> None:
    a, b = pair

    async def post(node: Node, key: str, queue: str = "default") -> tuple[int, Any]:
        body = {"payload": {"key": key}, "queue": queue}
        return await node.post("/jobs", body, headers={"Idempotency-Key": key})

    status, first = await post(a, "order-1")
    assert status == 201, first
    assert await post(b, "order-1") == (200, {"id": first["id"], "duplicate": True})
    status, other = await post(b, "order-1", "other")  # another queue: another task
    assert status == 201
    assert other["id"] != first["id"]
    # acked meanwhile (through the other broker): still a duplicate
    d = await b.claim()
    assert await b.http.ack(first["id"], d["lease_id"]) == 204
    assert await post(a, "order-1") == (200, {"id": first["id"], "duplicate": True})
    # the same keys sent to both brokers at once: one task each
    keys = [f"k{i}" for i in range(20)]
    answers = await asyncio.gather(*(post(n, k) for k in keys for n in (a, b)))
    for i in range(len(keys)):
        (s1, x), (s2, y) = answers[2 * i], answers[2 * i + 1]
        assert sorted((s1, s2)) == [200, 201], (x, y)
        assert x["id"] == y["id"]
    stats = await same_stats(pair)
    assert stats["totals"]["enqueued"] == 2 + len(keys)


async def test_a_queue_paused_through_one_broker_is_paused_on_the_other(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    assert (await a.post("/queues/mail/pause"))[0] == 204
    status, queues = await b.get("/queues")
    assert (status, queues[0]["name"], queues[0]["paused"]) == (200, "mail", True)
    task_id = await b.enqueue({"n": 1}, queue="mail")
    other = await b.enqueue({"n": 2})
    assert await b.claim("&queue=mail") is None
    d = await b.claim("&queue=mail,default")  # skips the paused queue
    assert d["task"]["id"] == other
    poll = await b.park("&queue=mail")
    await asyncio.sleep(0.5)  # nothing hands it the paused queue's task meanwhile
    assert not poll.done()
    assert (await b.task(task_id))["state"] == "ready"
    assert (await a.post("/queues/mail/resume"))[0] == 204
    status, body = await answered(poll)
    assert (status, body["task"]["id"]) == (200, task_id)


async def test_grpc_clients_on_two_brokers_work_on_one_task(pair: tuple[Node, Node]) -> None:
    a, b = pair
    async with AsyncClient(a.grpc_url) as ga, AsyncClient(b.grpc_url) as gb:
        task_id = await ga.enqueue({"n": 1}, idempotency_key="g-1")
        again = await gb.enqueue({"n": 1}, idempotency_key="g-1")
        assert again.duplicate
        assert again == task_id
        d = await gb.claim(wait_ms=0, lease_ms=30_000)
        assert d is not None
        assert d.task.id == task_id
        with pytest.raises(LeaseLost):
            await ga.ack(task_id, "0" * 16)
        deadline = await ga.extend(d, 60_000)
        assert abs(deadline.timestamp() - (time.time() + 60)) < 1
        assert (await ga.get_task(task_id)).state == "handed_out"
        await ga.ack(d)
        with pytest.raises(NotFound):
            await gb.ack(d)
        with pytest.raises(NotFound):
            await ga.get_task(task_id)
        # across protocols: enqueued over HTTP on one, claimed over gRPC on the other
        http_id = await a.enqueue({"via": "http"})
        d = await gb.claim(wait_ms=0)
        assert d is not None
        assert (d.task.id, d.payload) == (http_id, {"via": "http"})
        assert await a.http.ack(http_id, d.lease_id) == 204
        assert (await ga.stats()) == (await gb.stats())


# -- 2. wake-ups across brokers -------------------------------------------------------------------


@pytest.fixture
async def waker_and_sleeper(cluster: Cluster) -> tuple[Node, Node]:
    """A broker that makes tasks ready, and one whose consumers wait for them. The second
    neither polls nor sweeps for 30 s: only an announcement from the first wakes it."""
    return await cluster.add(), await cluster.add(sweep_interval=QUIET)


async def test_an_enqueue_on_one_broker_wakes_a_long_poll_on_the_other(
    waker_and_sleeper: tuple[Node, Node],
) -> None:
    a, b = waker_and_sleeper
    for n in range(3):
        poll = await b.park()
        task_id = await a.enqueue({"n": n})
        status, body = await answered(poll)
        assert (status, body["task"]["id"]) == (200, task_id)
        assert await a.http.ack(task_id, body["lease_id"]) == 204


async def test_an_enqueue_on_one_broker_is_pushed_to_a_stream_on_the_other(
    waker_and_sleeper: tuple[Node, Node],
) -> None:
    a, b = waker_and_sleeper
    async with AsyncClient(b.grpc_url) as client:
        stream = await client.stream(prefetch=1, lease_ms=30_000)
        try:
            for n in range(3):
                await wait_until(lambda: b.waiting == 1, what="the stream to wait on b")
                task_id = await a.enqueue({"n": n})
                d = await asyncio.wait_for(stream.__anext__(), PROMPT)
                assert (d.task.id, d.payload) == (task_id, {"n": n})
                await stream.ack(d, confirm=True)
        finally:
            await stream.close()
    stats = await same_stats([a, b])
    assert (stats["totals"]["acked"], stats["ready"], stats["handed_out"]) == (3, 0, 0)


async def test_a_retry_at_once_on_one_broker_wakes_a_long_poll_on_the_other(
    waker_and_sleeper: tuple[Node, Node],
) -> None:
    a, b = waker_and_sleeper
    task_id = await a.enqueue({"n": 1})
    d = await a.claim()
    poll = await b.park()
    nack = {"error": "again", "delay_ms": 0}
    assert (await a.post(f"/jobs/{task_id}/nack?lease_id={d['lease_id']}", nack))[0] == 204
    status, body = await answered(poll)
    assert status == 200
    assert (body["task"]["id"], body["task"]["attempts"]) == (task_id, 2)


async def test_a_requeue_on_one_broker_wakes_a_long_poll_on_the_other(
    waker_and_sleeper: tuple[Node, Node],
) -> None:
    a, b = waker_and_sleeper
    task_id = await a.enqueue({"n": 1}, max_attempts=1)
    d = await a.claim()
    assert await a.http.nack(task_id, d["lease_id"], "dead") == 204
    poll = await b.park()
    assert (await a.post(f"/dlq/{task_id}/requeue"))[0] == 204
    status, body = await answered(poll)
    assert status == 200
    assert (body["task"]["id"], body["task"]["attempts"]) == (task_id, 1)


async def test_a_batch_enqueue_on_one_broker_wakes_a_batch_claim_on_the_other_and_settles_there(
    waker_and_sleeper: tuple[Node, Node],
) -> None:
    a, b = waker_and_sleeper
    before = b.waiting
    poll = asyncio.ensure_future(b.get("/jobs/next/batch?max=3&wait_ms=20000"))
    await wait_until(lambda: b.waiting > before, what="the batch claim to park on b")
    tasks = [{"payload": {"n": n}} for n in range(5)]
    status, body = await a.post("/jobs/batch", {"tasks": tasks})
    assert status == 201
    ids = body["ids"]
    status, body = await answered(poll)
    assert status == 200
    got = body["deliveries"]
    assert [d["task"]["id"] for d in got] == ids[:3]  # all five came at once: three of them
    # settled through a, held through b: one refused (another lease), the others each applied
    settle = {
        "acks": [{"id": d["task"]["id"], "lease_id": d["lease_id"]} for d in got]
        + [{"id": got[0]["task"]["id"], "lease_id": "0" * 16}],
        "nacks": [],
    }
    status, body = await a.post("/jobs/settle", settle)
    assert status == 200
    outcomes = body["acks"]
    assert outcomes[: len(got)] == [None] * len(got)
    assert outcomes[-1]["status"] == 404  # acked already, just before, in the same request
    stats = await same_stats([a, b])
    assert (stats["totals"]["acked"], stats["ready"], stats["handed_out"]) == (
        len(got),
        5 - len(got),
        0,
    )


async def test_workers_over_http_on_two_brokers_do_every_task_once(cluster: Cluster) -> None:
    a, b = await cluster.add(), await cluster.add()
    done: list[int] = []

    async def handle(task: Task) -> None:
        done.append(task.payload["n"])

    async with AsyncClient(a.broker.http_url) as producer:
        await producer.enqueue_many([{"n": n} for n in range(300)])
    workers = []
    for node in (a, b):
        client = AsyncClient(node.broker.http_url)
        workers.append((client, Worker(client, handle, concurrency=8, wait_ms=200)))
    runs = [asyncio.ensure_future(w.run()) for _, w in workers]
    try:
        await wait_until(lambda: len(done) >= 300, what="every task done", timeout=30)
        await wait_until(
            lambda: a.get("/stats"),
            lambda answer: answer[1]["totals"]["acked"] == 300,
            what="every ack to land",
        )
        stats = await same_stats([a, b])
    finally:
        for _, worker in workers:
            worker.stop()
        await asyncio.gather(*runs)
        for client, _ in workers:
            await client.close()
    assert sorted(done) == list(range(300))  # each once: none lost, none twice
    assert (stats["ready"], stats["handed_out"], stats["totals"]["delivered"]) == (0, 0, 300)


async def test_one_task_for_many_long_polls_on_two_brokers_goes_to_exactly_one(
    cluster: Cluster,
) -> None:
    a, b = await cluster.add(), await cluster.add()
    per_broker, wait_ms = 12, 4000
    polls: list[asyncio.Task[tuple[int, Any]]] = []
    for node in (a, b):
        polls += [await node.park(wait_ms=wait_ms) for _ in range(per_broker)]
    parked_at = time.monotonic()
    assert (a.waiting, b.waiting) == (per_broker, per_broker)
    task_id = await a.enqueue({"n": 1})
    done, _ = await asyncio.wait(polls, timeout=PROMPT, return_when=asyncio.FIRST_COMPLETED)
    assert [t.result()[0] for t in done] == [200]
    assert next(iter(done)).result()[1]["task"]["id"] == task_id
    assert a.waiting + b.waiting == 2 * per_broker - 1  # the others are still parked
    rest = await asyncio.wait_for(asyncio.gather(*(p for p in polls if p not in done)), 10)
    assert [status for status, _ in rest] == [204] * (2 * per_broker - 1)
    assert time.monotonic() - parked_at >= wait_ms / 1000 - 0.5  # answered at their wait's end
    stats = await same_stats([a, b])
    assert (stats["totals"]["delivered"], stats["handed_out"], stats["ready"]) == (1, 1, 0)


async def test_a_broker_that_just_started_is_woken_by_one_that_was_alone(cluster: Cluster) -> None:
    # The first broker sweeps while it is the only one listening; a second one starts after that
    # sweep and parks a long-poll. An enqueue on the first must still reach it: "nobody else
    # listens" is out of date as soon as another broker has started.
    a = await cluster.add(sweep_interval=QUIET)
    tick = await a.enqueue({"tick": 1}, delay_ms=1, queue="tick")  # due at once: a sweep now
    await wait_until(
        lambda: a.task(tick), lambda v: v["state"] == "ready", what="a's sweeper to promote it"
    )
    b = await cluster.add(sweep_interval=QUIET)
    poll = await b.park()
    task_id = await a.enqueue({"n": 1})
    status, body = await answered(poll)
    assert (status, body["task"]["id"]) == (200, task_id)


# -- 3. broker processes killed under load --------------------------------------------------------

LEASE_MS = 1000  # the workers' lease, and the lease of the tasks a broker holds when it is killed
# Traffic between two events (kills, restarts): this many more tasks answered 201, and a quarter
# as many more acked.
ACCEPTED_BETWEEN = 60
_UNREACHABLE = (aiohttp.ClientError, OSError, TimeoutError)


@dataclass
class Books:
    """What the clients were told, to check the brokers against."""

    accepted: set[str] = field(default_factory=set)  # ids answered 201
    acked: dict[str, int] = field(default_factory=dict)  # id -> number of 204s to its acks
    ack_unknown: set[str] = field(default_factory=set)  # an ack whose answer was lost
    delivered_after_ack: list[str] = field(default_factory=list)
    deliveries: int = 0


@dataclass
class Traffic:
    """Producers and workers over HTTP, each request to a broker picked at random."""

    session: aiohttp.ClientSession
    urls: list[str]
    books: Books = field(default_factory=Books)
    rng: random.Random = field(default_factory=lambda: random.Random(12))

    def pick(self) -> str:
        return self.rng.choice(self.urls)

    async def produce(self, stop: asyncio.Event, k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            body = {"payload": {"producer": k, "n": n}, "max_attempts": 100}
            try:
                async with self.session.post(self.pick() + "/jobs", json=body) as resp:
                    if resp.status == 201:
                        self.books.accepted.add((await resp.json())["id"])
                        continue
                    assert resp.status == 503, await resp.text()
            except _UNREACHABLE:
                pass  # that broker is down: another one serves
            await asyncio.sleep(0.02)

    async def work(self, stop: asyncio.Event, queues: str = "default") -> None:
        query = f"/jobs/next?wait_ms=200&lease_ms={LEASE_MS}&queue={queues}"
        while not stop.is_set():
            try:
                async with self.session.get(self.pick() + query) as resp:
                    delivery = await resp.json() if resp.status == 200 else None
            except _UNREACHABLE:
                delivery = None
            if delivery is None:
                await asyncio.sleep(0.02)
                continue
            self.delivered(delivery["task"]["id"])
            await self.ack(delivery["task"]["id"], delivery["lease_id"])

    def delivered(self, task_id: str) -> None:
        self.books.deliveries += 1
        if self.books.acked.get(task_id):
            self.books.delivered_after_ack.append(task_id)

    async def ack(self, task_id: str, lease_id: str) -> None:
        """Ack through a broker picked at random (through another if that one is down)."""
        books = self.books
        for url in self.rng.sample(self.urls, len(self.urls)):
            try:
                async with self.session.post(f"{url}/jobs/{task_id}/ack?lease_id={lease_id}") as r:
                    status = r.status
            except _UNREACHABLE:
                status = 503
            if status == 503:  # committed or not (its answer was lost): the end tells
                books.ack_unknown.add(task_id)
                continue
            if status == 204:
                books.acked[task_id] = books.acked.get(task_id, 0) + 1
                books.ack_unknown.discard(task_id)
            return  # 404/409: the lease ran out and the task went round again

    async def enqueue(self, url: str, queue: str, delay_ms: int = 0) -> str:
        body = {"payload": {"queue": queue}, "queue": queue, "delay_ms": delay_ms}
        async with self.session.post(url + "/jobs", json=body) as resp:
            assert resp.status == 201, await resp.text()
            task_id = str((await resp.json())["id"])
        self.books.accepted.add(task_id)
        return task_id

    async def some(self) -> None:
        """Wait until the brokers have taken and settled some more work."""
        books = self.books
        accepted, acked = len(books.accepted), len(books.acked)
        await wait_until(
            lambda: (
                len(books.accepted) >= accepted + ACCEPTED_BETWEEN
                and len(books.acked) >= acked + ACCEPTED_BETWEEN // 4
            ),
            what=f"{ACCEPTED_BETWEEN} more tasks accepted and some acked",
            timeout=30,
        )

    async def stats_of_one(self) -> Any:
        async with self.session.get(self.pick() + "/stats") as resp:
            assert resp.status == 200
            return await resp.json()

    async def stats(self) -> Any:
        """/stats from every broker (when nothing changes): one answer, which obeys the
        invariants."""
        answers = []
        for url in self.urls:
            async with self.session.get(url + "/stats") as resp:
                assert resp.status == 200
                answers.append(await resp.json())
        assert all(s == answers[0] for s in answers), answers
        assert_invariants(answers[0])
        return answers[0]

    @contextlib.asynccontextmanager
    async def running(self, producers: int, workers: int, queues: str) -> AsyncIterator[None]:
        """Producers and workers at work until the block ends (and always stopped then)."""
        stop = asyncio.Event()
        clients = [asyncio.create_task(self.produce(stop, k)) for k in range(producers)]
        clients += [asyncio.create_task(self.work(stop, queues)) for _ in range(workers)]
        try:
            yield
        except BaseException:
            for c in clients:
                c.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            raise
        stop.set()
        await asyncio.gather(*clients)  # (an assertion in one of them fails the test)

    async def drain(self, queues: str) -> tuple[set[str], Any]:
        """Work (taking from ``queues``) until nothing is ready, held or delayed; the DLQ's ids
        and the final stats."""
        async with self.running(0, 4, queues):
            await wait_until(
                self.stats_of_one,
                lambda s: not (s["ready"] or s["handed_out"] or s["delayed"]),
                what="the queues to drain",
                timeout=30,
                interval=0.1,
            )
        async with self.session.get(self.urls[0] + "/dlq") as resp:
            dead = {t["id"] for t in await resp.json()}
        return dead, await self.stats()


def check_books(books: Books, dead: set[str], stats: Any) -> None:
    """Nothing answered 201 was lost, nothing acked came back, the counters account for it all."""
    assert len(books.accepted) > 100, "too little traffic to mean anything"
    assert books.deliveries >= len(books.acked)
    assert books.delivered_after_ack == []
    twice = {k: v for k, v in books.acked.items() if v != 1}
    assert twice == {}, twice
    # Every accepted task was acked (the answer to its ack may have been lost, but then it is gone
    # from the database, which holds only dead tasks now) or is in the DLQ.
    lost = books.accepted - set(books.acked) - dead - books.ack_unknown
    assert lost == set(), f"{len(lost)} accepted tasks were lost: {sorted(lost)[:5]}"
    assert (stats["ready"], stats["handed_out"], stats["delayed"]) == (0, 0, 0)
    totals = stats["totals"]
    assert totals["enqueued"] >= len(books.accepted)
    assert totals["enqueued"] == totals["acked"] + len(dead)
    assert len(books.acked) <= totals["acked"] <= len(books.acked) + len(books.ack_unknown)


class Fleet:
    """Broker processes on one database, each restarted on its own port after a kill."""

    def __init__(self, dsn: str, size: int, stack: contextlib.ExitStack) -> None:
        self.dsn = dsn
        self.stack = stack
        self.ports = [free_port() for _ in range(size)]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.procs: list[BrokerProcess | None] = [None] * size

    async def start(self, i: int) -> None:
        args = (
            "-addr", f"127.0.0.1:{self.ports[i]}", "-grpc-addr", "off", "-store", self.dsn,
            "-sweep-interval-ms", "50", "-backoff-base-ms", "50", "-backoff-cap-ms", "200",
        )  # fmt: skip
        # (in a thread: the clients keep running while it starts)
        self.procs[i] = await asyncio.to_thread(self.stack.enter_context, broker_process(*args))

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait()
        self.procs[i] = None


@dataclass
class Held:
    """A task handed out (under a LEASE_MS lease) by a broker about to be killed."""

    task_id: str
    attempts: int
    asked: float  # the event loop's time when the claim was sent
    told: float  # ... and when it was answered


async def hold(t: Traffic, url: str, queue: str, n: int) -> list[Held]:
    """Enqueue ``n`` tasks to ``queue`` through ``url`` and claim them there, unacked."""
    loop = asyncio.get_running_loop()
    for _ in range(n):
        await t.enqueue(url, queue)
    held = []
    for _ in range(n):
        asked = loop.time()
        query = f"/jobs/next?wait_ms=0&lease_ms={LEASE_MS}&queue={queue}"
        async with t.session.get(url + query) as resp:
            assert resp.status == 200, await resp.text()
            d = await resp.json()
        held.append(Held(d["task"]["id"], d["task"]["attempts"], asked, loop.time()))
        t.delivered(d["task"]["id"])
    return held


async def reclaimed(t: Traffic, survivors: list[str], held: Held) -> float:
    """When the survivors show the task no longer held under that lease (the event loop's time)."""
    loop = asyncio.get_running_loop()
    while True:
        async with t.session.get(f"{t.rng.choice(survivors)}/jobs/{held.task_id}") as resp:
            view = await resp.json() if resp.status == 200 else None
        if view is None or view["state"] != "handed_out" or view["attempts"] != held.attempts:
            return loop.time()
        await asyncio.sleep(0.02)


async def promoted(t: Traffic, survivors: list[str], queue: str, n: int) -> list[float]:
    """Claim ``n`` delayed tasks of ``queue`` through the survivors as they become ready; when
    each came (the event loop's time). Each is acked."""
    loop = asyncio.get_running_loop()
    came = []
    for _ in range(n):
        url = t.rng.choice(survivors)
        async with t.session.get(f"{url}/jobs/next?wait_ms=5000&queue={queue}") as resp:
            assert resp.status == 200, f"a delayed task of {queue} was not promoted"
            d = await resp.json()
        came.append(loop.time())
        t.delivered(d["task"]["id"])
        await t.ack(d["task"]["id"], d["lease_id"])
    return came


async def kill_one(fleet: Fleet, t: Traffic, victim: int, r: int) -> None:
    """Kill a broker holding leased and delayed tasks; the survivors keep serving, reclaim its
    leases at their deadline and promote its delayed tasks on time. Then restart it."""
    loop = asyncio.get_running_loop()
    url = fleet.urls[victim]
    survivors = [u for u in fleet.urls if u != url]
    held = await hold(t, url, f"held{r}", 3)
    delayed_at = loop.time()
    for _ in range(3):
        await t.enqueue(url, f"later{r}", delay_ms=500)
    fleet.kill(victim)
    reclaims = asyncio.gather(*(reclaimed(t, survivors, h) for h in held))
    times, came, _ = await asyncio.gather(
        asyncio.wait_for(reclaims, 15), promoted(t, survivors, f"later{r}", 3), t.some()
    )
    for h, at in zip(held, times, strict=True):
        assert h.asked + LEASE_MS / 1000 - 0.1 <= at <= h.told + LEASE_MS / 1000 + PROMPT, (
            f"held {at - h.asked:.2f} s for a lease of {LEASE_MS} ms"
        )
    for at in came:
        assert delayed_at + 0.45 <= at <= delayed_at + 0.5 + PROMPT, at - delayed_at
    await fleet.start(victim)


KILLS = 3


@pytest.mark.timeout(120)
async def test_broker_processes_killed_under_load_lose_nothing(dsn: str) -> None:
    rng = random.Random(7)
    with contextlib.ExitStack() as stack:
        fleet = Fleet(dsn, 3, stack)
        await asyncio.gather(*(fleet.start(i) for i in range(3)))
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=5)
        ) as session:
            t = Traffic(session, fleet.urls)
            async with t.running(6, 6, "default"):
                for r in range(KILLS):
                    await t.some()
                    await kill_one(fleet, t, rng.randrange(3), r)
                await t.some()
            dead, stats = await t.drain(",".join(["default"] + [f"held{r}" for r in range(KILLS)]))
    check_books(t.books, dead, stats)
    assert stats["totals"]["reclaimed"] >= 3 * KILLS  # at least the tasks the dead brokers held
    print(json.dumps({"accepted": len(t.books.accepted), **stats["totals"]}))


# -- 4. the database goes away --------------------------------------------------------------------


async def health(node: Node, service: str = "wq.v1.Broker") -> tuple[int, str]:
    """Readiness (/readyz's status, and the gRPC health service's answer for the broker's
    service), or with ``service=""`` liveness (/healthz's, and the server's)."""
    status, _ = await node.get("/readyz" if service else "/healthz")
    async with grpc.aio.insecure_channel(node.broker.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return status, str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


async def listeners(dsn: str) -> int:
    """How many brokers LISTEN on the database."""
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 "
                "AND (application_name = 'wq listener' OR query LIKE 'LISTEN%')",
                urllib.parse.urlsplit(dsn).path.lstrip("/"),
            )
        )
    finally:
        await conn.close()


async def wakes(sleeper: Node, waker: Node, queue: str) -> None:
    """A long-poll parked on ``sleeper`` is answered at once with a task enqueued on ``waker``."""
    poll = await sleeper.park(f"&queue={queue}")
    task_id = await waker.enqueue({"wake": queue}, queue=queue)
    status, body = await answered(poll)
    assert (status, body["task"]["id"]) == (200, task_id)
    assert await waker.http.ack(task_id, body["lease_id"]) == 204


async def claim_all(node: Node, n: int) -> set[str]:
    """Claim and ack ``n`` tasks through ``node``; their ids."""
    got: set[str] = set()
    for _ in range(n):
        d = await node.claim(wait_ms=2000)
        assert d is not None, f"only {len(got)} of {n} tasks came"
        assert await node.http.ack(d["task"]["id"], d["lease_id"]) == 204
        got.add(d["task"]["id"])
    return got


async def cut_off(a: Node, b: Node, proxy: pg.Proxy) -> str:
    """Cut ``a`` off: its calls fail at once with 503, its health says so; ``b`` serves on. The
    id of a task enqueued through ``b`` meanwhile."""
    await proxy.cut()
    asked = time.monotonic()
    status, body = await a.post("/jobs", {"payload": {"n": "cut"}})
    assert status == 503, body
    assert "unreachable" in body["error"], body
    assert time.monotonic() - asked < 5
    assert (await a.get("/jobs/next?wait_ms=0"))[0] == 503
    await wait_until(lambda: health(a), lambda h: h == (503, "NOT_SERVING"), what="a unready")
    assert await health(a, "") == (200, "SERVING")  # (alive all the same)
    return await b.enqueue({"n": "during"})


async def unready(node: Node) -> None:
    """Wait until ``node`` says it cannot serve: within five seconds of its database going."""
    await wait_until(
        lambda: health(node), lambda h: h == (503, "NOT_SERVING"), what="unready", timeout=5
    )


async def recovered(node: Node, timeout: float = 6) -> None:
    await wait_until(
        lambda: health(node), lambda h: h == (200, "SERVING"), what="healthy", timeout=timeout
    )


@pytest.mark.timeout(60)
async def test_a_broker_cut_off_from_the_database_says_503_and_recovers_by_itself(
    cluster: Cluster, dsn: str
) -> None:
    proxy = await pg.Proxy.start(dsn)
    a = await cluster.add(dsn=proxy.dsn(dsn))
    try:
        b = await cluster.add()
        kept = {await a.enqueue({"n": i}) for i in range(5)}
        assert await health(a) == (200, "SERVING")
        during = await cut_off(a, b, proxy)
        assert await health(b) == (200, "SERVING")
        await proxy.restore()
        await recovered(a)
        after = await a.enqueue({"n": "after"})  # no restart needed
        # It LISTENs again: a long-poll parked on it is woken by a task enqueued on b.
        await wait_until(lambda: listeners(dsn), lambda n: n == 2, what="a to listen again")
        await wakes(a, b, "wake")
        await wakes(b, a, "wake")
        # nothing accepted before (or during) the outage was lost
        assert await claim_all(a, 7) == kept | {during, after}
    finally:
        await a.stop()
        await proxy.cut()


async def readiness_heard(node: Node, seen: list[str], stop: asyncio.Event) -> None:
    """What a gRPC health Watch of the broker's service hears, into ``seen``, until ``stop``."""
    async with grpc.aio.insecure_channel(node.broker.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        call = stub.Watch(health_pb2.HealthCheckRequest(service="wq.v1.Broker"))
        reading = asyncio.ensure_future(_statuses(call, seen))
        await stop.wait()
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reading


async def _statuses(call: Any, seen: list[str]) -> None:
    async for answer in call:
        seen.append(str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)))


@pytest.mark.timeout(60)
async def test_a_silent_partition_is_noticed_within_seconds_with_no_traffic(
    cluster: Cluster, dsn: str
) -> None:
    proxy = await pg.Proxy.start(dsn)
    a = await cluster.add(dsn=proxy.dsn(dsn))
    stop, heard = asyncio.Event(), list[str]()
    watching = asyncio.ensure_future(readiness_heard(a, heard, stop))
    try:
        b = await cluster.add()
        kept = {await a.enqueue({"n": i}) for i in range(3)}
        assert await health(a) == (200, "SERVING")
        # Packets dropped, nothing refused nor closed: an idle broker notices all the same, by
        # its probe, within five seconds; the other broker does not (its database answers).
        proxy.stall()
        await unready(a)
        assert await health(a, "") == (200, "SERVING")  # alive: no reason to restart it
        assert await health(b) == (200, "SERVING")
        await wait_until(lambda: heard[-1:] == ["NOT_SERVING"], what="a watch to hear it")
        # Known away, it fails fast: 503 at once, with when to try again.
        asked = time.monotonic()
        async with cluster.session.post(a.http.base + "/jobs", json={"payload": 1}) as answer:
            assert answer.status == 503
            assert answer.headers["Retry-After"] == "1"
            assert "unreachable" in (await answer.json())["error"]
        assert time.monotonic() - asked < 1
        during = await b.enqueue({"n": "during"})
        # Healed: ready again by itself, and nothing accepted is lost.
        proxy.flow()
        await recovered(a)
        after = await a.enqueue({"n": "after"})
        assert await claim_all(a, 5) == kept | {during, after}
        await wait_until(lambda: heard[-1:] == ["SERVING"], what="the watch to hear it back")
        assert heard == ["SERVING", "NOT_SERVING", "SERVING"]
    finally:
        stop.set()
        await watching
        await a.stop()
        proxy.flow()
        await proxy.cut()


@pytest.mark.timeout(60)
async def test_every_broker_says_the_same_when_the_database_refuses_connections(
    cluster: Cluster, dsn: str
) -> None:
    proxy = await pg.Proxy.start(dsn)
    a = await cluster.add(dsn=proxy.dsn(dsn))
    b = await cluster.add(dsn=proxy.dsn(dsn))
    try:
        await a.enqueue({"n": 1})  # (traffic on one of them only)
        await proxy.cut()
        for node in (a, b):  # each finds out by itself, with or without traffic
            await unready(node)
        await proxy.restore()
        for node in (a, b):
            await recovered(node)
    finally:
        await a.stop()
        await b.stop()
        await proxy.cut()


@pytest.mark.timeout(60)
async def test_calls_caught_in_a_silent_partition_are_answered_within_their_deadline(
    cluster: Cluster, dsn: str
) -> None:
    proxy = await pg.Proxy.start(dsn)
    a = await cluster.add(dsn=proxy.dsn(dsn), db_timeout=1.0)
    try:
        kept = await a.enqueue({"n": "before"})
        proxy.stall()
        # Sent into the partition before the broker knows of it: enqueues waiting behind one
        # another's group commit, a claim, a read. None waits on the dead link past its deadline
        # (and what waits behind a stuck call is let go once the probe finds the link dead).
        asked = time.monotonic()
        answers = await asyncio.gather(
            *(a.post("/jobs", {"payload": {"n": i}}) for i in range(20)),
            a.get("/jobs/next?wait_ms=0"),
            a.get("/stats"),
        )
        took = time.monotonic() - asked
        assert {status for status, _ in answers} == {503}, answers
        assert took < 5, took  # (the deadline is 1 s; the probe gives up after 2 s more)
        proxy.flow()
        await recovered(a)
        # Whatever of the refused enqueues the database got before the link went dead stays;
        # what was kept is there, and the broker serves.
        after = await a.enqueue({"n": "after"})
        claimed = await claim_all(a, 2)
        assert {kept, after} <= claimed | {d["task"]["id"] for d in await drain(a)}
    finally:
        await a.stop()
        proxy.flow()
        await proxy.cut()


@pytest.mark.timeout(60)
async def test_connections_caught_in_a_partition_are_dropped_once_it_heals(
    cluster: Cluster, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await pg.Proxy.start(dsn)
    a = await cluster.add(dsn=proxy.dsn(dsn))
    try:
        await asyncio.gather(*(a.enqueue({"n": i}) for i in range(16)))  # (several connections)
        for busy in (False, True):  # idle when it begins, then with calls caught in it
            proxy.stall()
            if busy:
                answers = await asyncio.gather(*(a.post("/jobs", {"payload": i}) for i in range(8)))
                assert {status for status, _ in answers} == {503}, answers
            await unready(a)
            proxy.flow()
            await recovered(a)
        # It serves on connections of its own again, and it stops at once: no goodbye is
        # waited for on a connection from before the partition, nor left to fail unread.
        await asyncio.gather(*(a.enqueue({"n": i}) for i in range(16)))
    finally:
        asked = time.monotonic()
        await a.stop()
        took = time.monotonic() - asked
        proxy.flow()
        await proxy.cut()
    gc.collect()  # (a task whose failure nobody read is logged as it is collected)
    assert took < 5, took
    unread = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert unread == []


async def drain(node: Node) -> list[Any]:
    """Claim and ack every task ready on ``node``; the deliveries."""
    got: list[Any] = []
    while (d := await node.claim(wait_ms=0)) is not None:
        assert await node.http.ack(d["task"]["id"], d["lease_id"]) == 204
        got.append(d)
    return got


@pytest.mark.timeout(60)
async def test_brokers_whose_connections_are_all_killed_recover_by_themselves(
    cluster: Cluster, dsn: str
) -> None:
    a, b = await cluster.add(), await cluster.add()
    t = Traffic(cluster.session, [a.http.base, b.http.base])
    name = urllib.parse.urlsplit(dsn).path.lstrip("/")
    conn = await asyncpg.connect(dsn)
    try:
        async with t.running(4, 4, "default"):
            for _ in range(3):
                await t.some()
                killed = await conn.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = $1 AND pid <> pg_backend_pid()",
                    name,
                )
                assert killed >= 4  # each broker: its pool (one at least) and its listener
                await recovered(a)
                await recovered(b)
                await t.some()  # and they serve again
        dead, stats = await t.drain("default")
    finally:
        await conn.close()
    check_books(t.books, dead, stats)
    # both LISTEN again: each wakes the other's long-polls
    await wait_until(lambda: listeners(dsn), lambda n: n == 2, what="both to listen again")
    await wakes(a, b, "wake")
    await wakes(b, a, "wake")


# -- 5. clocks an hour apart ----------------------------------------------------------------------


class SkewedClock(SystemClock):
    """The real clock, off by ``skew`` seconds (its timers too)."""

    def __init__(self, skew: float) -> None:
        self.skew = skew

    def now(self) -> float:
        return time.time() + self.skew

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        loop = asyncio.get_running_loop()
        return loop.call_later(max(0.0, when - self.now()), callback)


async def due_on_time(source: Node, source_clock: Clock, target: Node) -> None:
    """A task enqueued with delay_ms=300 through ``source`` is claimable through ``target`` 300 ms
    later, and each broker shows its time in its own clock."""
    sent, sent_there = time.time(), source_clock.now()
    task_id = await source.enqueue({"n": 1}, delay_ms=300)
    early = await target.claim()
    assert early is None or time.time() - sent >= 0.3, "claimable before its time"
    shown = stamp((await source.task(task_id))["available_at"])
    assert abs(shown - (sent_there + 0.3)) < 0.5
    shown = stamp((await target.task(task_id))["available_at"])
    assert abs(shown - (target.broker.clock.now() - (time.time() - sent) + 0.3)) < 0.5
    d = early or await claim_soon(target)
    came = time.time() - sent
    assert d["task"]["id"] == task_id
    assert 0.25 <= came <= 0.3 + PROMPT, came
    assert await source.http.ack(task_id, d["lease_id"]) == 204


async def reclaimed_on_time(holder: Node, other: Node) -> None:
    """A 1 s lease taken through ``holder``, which then stops, is reclaimed through ``other`` 1 s
    after it was taken (neither early nor late)."""
    task_id = await other.enqueue({"n": 2})
    taken = time.monotonic()
    d = await holder.claim(lease_ms=1000)
    assert d["task"]["id"] == task_id
    assert abs(stamp(d["deadline"]) - (holder.broker.clock.now() + 1.0)) < 0.5  # its own clock
    await holder.stop()
    await wait_until(
        lambda: other.task(task_id),
        lambda v: v["state"] != "handed_out",
        what="the lease to be reclaimed",
        timeout=10,
        interval=0.02,
    )
    assert 0.9 <= time.monotonic() - taken <= 1.0 + PROMPT, time.monotonic() - taken
    assert (await other.task(task_id))["last_error"] is not None


@pytest.mark.parametrize("skew", [3600.0, -3600.0])
async def test_brokers_an_hour_apart_agree_on_what_is_due(cluster: Cluster, skew: float) -> None:
    clock = SkewedClock(skew)
    skewed, right = await cluster.add(clock=clock), await cluster.add()
    await due_on_time(skewed, clock, right)
    await due_on_time(right, right.broker.clock, skewed)
    # a lease taken on the right clock, reclaimed by the skewed broker alone...
    await reclaimed_on_time(right, skewed)
    # ... and one taken on the skewed clock, reclaimed by a broker on the right clock
    await reclaimed_on_time(skewed, await cluster.add())


async def test_delayed_tasks_wake_long_polls_on_time_while_several_brokers_sweep(
    cluster: Cluster,
) -> None:
    # Every broker sweeps, and each wakes exactly when the next delayed task is due, so they all
    # try to promote it at the same moment. Each task has a queue of its own, a long-poll parked
    # on one broker and an enqueue through another; no later promotion can hand it out instead.
    brokers = [await cluster.add() for _ in range(4)]
    n, step_ms = 8, 250
    loop = asyncio.get_running_loop()
    polls = {f"d{i}": await brokers[i % 4].park(f"&queue=d{i}", wait_ms=4_500) for i in range(n)}
    sent = loop.time()
    due = {}
    for i in range(n):
        queue, delay_ms = f"d{i}", 300 + step_ms * i
        task_id = await brokers[(i + 1) % 4].enqueue({"i": i}, queue=queue, delay_ms=delay_ms)
        due[queue] = (task_id, sent + delay_ms / 1000)

    async def came(queue: str) -> str:
        status, body = await polls[queue]
        if status != 200:  # (what came instead, and when, to tell a timeout from a refusal)
            return f"never: {status} {body!r} after {loop.time() - sent:.2f} s"
        assert body["task"]["id"] == due[queue][0]
        return f"{loop.time() - due[queue][1]:.2f} s"

    late = dict(zip(polls, await asyncio.gather(*(came(q) for q in polls)), strict=True))
    on_time = {
        q: x
        for q, x in late.items()
        if not x.startswith("never") and -0.05 <= float(x[:-2]) <= PROMPT
    }
    assert on_time == late, f"how late each task came: {late}"


async def test_a_long_poll_gets_a_ready_task_once_another_transaction_lets_go_of_it(
    cluster: Cluster, dsn: str
) -> None:
    # A ready task whose row another transaction holds locked for a while (as another broker's
    # sweep or claim holds a row it re-checked without taking it, until it commits): claims skip
    # it, and nobody will announce it again. The parked long-poll must still get it as soon as
    # the lock goes, not when its wait runs out (polling is off here: QUIET).
    node = await cluster.add()
    task_id = await node.enqueue({"held": True}, queue="locked")
    conn = await asyncpg.connect(dsn)
    try:
        locking = conn.transaction()
        await locking.start()
        await conn.execute("SELECT 1 FROM wq.tasks WHERE queue = 'locked' FOR UPDATE")
        poll = await node.park("&queue=locked", wait_ms=20_000)
        await asyncio.sleep(0.3)  # (real time: the lock is a real transaction's)
        assert not poll.done()  # skipped while locked
        let_go = time.monotonic()
        await locking.rollback()
        status, body = await answered(poll)
        assert status == 200, body
        assert body["task"]["id"] == task_id
        assert time.monotonic() - let_go < 1.0
    finally:
        await conn.close()
