"""Workflows under kill -9, on both durable stores (docs/design/results.md): producers submit
small graphs (three parents and a child waiting for all of them, one batch each), workers claim
and ack the parents with results, and a broker process is killed with SIGKILL several times
mid-traffic and restarted on the same store (on PostgreSQL a second broker on the same database
keeps serving, and the workers fall over to it). Afterwards every child is released exactly once
(handed out on its first attempt, never twice), with its three parents on its delivery and the
results of those whose ack with a result was answered 204; no task is left waiting; and the gauges
add up to enqueued - acked - purged - cancelled - expired."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests import pg
from tests.procs import BrokerProcess, broker_process, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

KILLS = 3
LEASE_MS = 1000  # a parent whose ack was lost in a kill comes back quickly


class Books:
    """What the clients were told."""

    def __init__(self) -> None:
        self.graphs: list[tuple[list[str], str]] = []  # (parents, child), answered 201
        self.results: dict[str, Any] = {}  # parent id -> the result of its ack answered 204
        self.children: dict[str, list[dict[str, Any]]] = {}  # child id -> its deliveries
        self.unknown: set[str] = set()  # acks sent whose answers were lost


async def produce(
    session: aiohttp.ClientSession, bases: list[str], books: Books, stop: asyncio.Event, k: int
) -> None:
    rng = random.Random(k)
    n = 0
    while not stop.is_set():
        base = rng.choice(bases)
        tasks: list[dict[str, Any]] = [{"payload": {"k": k, "n": n, "i": i}} for i in range(3)]
        tasks.append({"payload": {"child": [k, n]}, "queue": "children", "after": [0, 1, 2]})
        n += 1
        try:
            async with session.post(base + "/jobs/batch", json={"tasks": tasks}) as resp:
                if resp.status == 201:
                    ids = (await resp.json())["ids"]
                    books.graphs.append((ids[:3], ids[3]))
                else:
                    assert resp.status == 503, await resp.text()
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            await asyncio.sleep(0.05)


async def work(
    session: aiohttp.ClientSession,
    bases: list[str],
    books: Books,
    stop: asyncio.Event,
    k: int,
) -> None:
    rng = random.Random(100 + k)
    while not stop.is_set():
        base = rng.choice(bases)
        url = f"{base}/jobs/next?wait_ms=200&lease_ms={LEASE_MS}&queue=default,children"
        try:
            async with session.get(url) as resp:
                if resp.status != 200:
                    assert resp.status in (204, 503), await resp.text()
                    continue
                d = await resp.json()
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            await asyncio.sleep(0.05)
            continue
        task = d["task"]
        if task["queue"] == "children":
            books.children.setdefault(task["id"], []).append(d)
            body = None
        else:
            body = {"result": {"from": task["id"], "x": rng.random()}}
        ack = f"{base}/jobs/{task['id']}/ack?lease_id={d['lease_id']}"
        try:
            async with session.post(ack, json=body) as resp:
                if resp.status == 204 and body is not None:
                    books.results[task["id"]] = body["result"]
                elif resp.status != 204:
                    assert resp.status in (404, 409, 503), await resp.text()
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            books.unknown.add(task["id"])


@contextlib.asynccontextmanager
async def store_args(kind: str, tmp_path: Path) -> AsyncIterator[tuple[str, ...]]:
    if kind == "sqlite":
        yield ("-store", f"sqlite:{tmp_path / 'wq.db'}")
    else:
        yield ("-store", await pg.create_database("kill9_results"))


async def traffic(books: Books, more: int) -> None:
    target = len(books.graphs) + more
    while len(books.graphs) < target:  # noqa: ASYNC110 - the clients' own progress
        await asyncio.sleep(0.01)
    await asyncio.sleep(random.random() * 0.05)  # (kill at some moment, not at a boundary)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_sigkill_never_loses_nor_doubles_a_release(kind: str, tmp_path: Path) -> None:
    books = Books()
    stop = asyncio.Event()
    async with store_args(kind, tmp_path) as store:
        ports = [free_port(), free_port()] if kind == "postgres" else [free_port()]
        args = [("-addr", f"127.0.0.1:{port}", "-grpc-addr", "off", *store) for port in ports]
        bases = [f"http://127.0.0.1:{port}" for port in ports]
        with contextlib.ExitStack() as stack:
            brokers: list[BrokerProcess] = [stack.enter_context(broker_process(*a)) for a in args]
            timeout = aiohttp.ClientTimeout(total=5)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                clients = [
                    asyncio.create_task(produce(session, bases, books, stop, k)) for k in range(3)
                ]
                clients += [
                    asyncio.create_task(work(session, bases, books, stop, k)) for k in range(4)
                ]
                for life in range(KILLS):
                    await traffic(books, 60)
                    victim = life % len(brokers)
                    brokers[victim].proc.send_signal(signal.SIGKILL)
                    brokers[victim].proc.wait()
                    brokers[victim] = stack.enter_context(broker_process(*args[victim]))
                await traffic(books, 60)
                stop.set()
                await asyncio.gather(*clients)
                # Everything still pending runs now, on a broker that stays up.
                stop = asyncio.Event()
                drain = [
                    asyncio.create_task(work(session, bases, books, stop, k)) for k in range(4)
                ]

                async def stats() -> dict[str, Any]:
                    async with session.get(bases[0] + "/stats") as resp:
                        body: dict[str, Any] = await resp.json()
                        return body

                for _ in range(600):
                    s = await stats()
                    if s["ready"] + s["handed_out"] + s["delayed"] + s["waiting"] == 0:
                        break
                    await asyncio.sleep(0.1)
                stop.set()
                await asyncio.gather(*drain)
                final = await stats()
    assert len(books.graphs) > 150, "too little traffic to mean anything"
    assert final["waiting"] == 0, final
    for parents, child in books.graphs:
        deliveries = books.children.get(child, [])
        assert deliveries, f"child {child} was never released"
        first = deliveries[0]
        assert first["task"]["attempts"] == 1, f"child {child}: {first}"
        assert [p["id"] for p in first["parents"]] == parents
        for p in first["parents"]:
            if p["id"] in books.results and p["id"] not in books.unknown:
                assert p.get("result") == books.results[p["id"]], (child, p)
        # Released once: a second hand-out only after its lease ran out (an ack lost in a kill).
        assert all(d["task"]["attempts"] == i + 1 for i, d in enumerate(deliveries)), deliveries
        assert len(deliveries) == 1 or child in books.unknown, deliveries
    t = final["totals"]
    gauges = final["ready"] + final["handed_out"] + final["delayed"] + final["dead"]
    assert gauges + final["waiting"] == (
        t["enqueued"] - t["acked"] - t["purged"] - t["cancelled"] - t["expired"]
    ), final
    assert t["nacked"] + t["reclaimed"] == t["retried"] + t["buried"], final
