"""Limits per queue (docs/design/schedules.md) over two broker processes on one PostgreSQL
database, as a user runs them: limits set through one broker's HTTP API hold over both, for
clients of the public library on each. A rate-limited queue's hand-outs in any second stay
within ``tasks + burst`` and go on at about the rate (its tokens wake the claims parked on either
broker): timed by the brokers themselves (each delivery's deadline less its lease), since a
worker's own clock sees deliveries that a loaded machine held back arrive in a clump. A
concurrency-limited queue never has more tasks handed out than its limit (what its handlers hold,
and what the brokers count), for wqclient.Worker on each broker, and a slot freed on one broker is
taken on the other."""

from __future__ import annotations

import asyncio
import bisect
import json
import time
import urllib.request
from datetime import timedelta
from typing import Any

import pytest

from tests import pg
from tests.procs import BrokerProcess, broker_process
from wqclient import AsyncClient, RateLimit, Worker

pytestmark = pytest.mark.timeout(90)

RUN = 3.0  # seconds the workers run
TASKS, BURST, LIMIT = 20, 5, 3
LEASE_MS = 30_000


def queue_row(broker: BrokerProcess, name: str) -> Any:
    with urllib.request.urlopen(broker.url + "/queues", timeout=10) as resp:
        rows = json.loads(resp.read())
    return next(r for r in rows if r["name"] == name)


async def test_limits_hold_over_two_broker_processes() -> None:
    dsn = await pg.create_database("limits")
    with broker_process("-store", dsn) as a, broker_process("-store", dsn) as b:
        async with AsyncClient(a.url) as admin:
            await admin.set_limits("rated", rate=RateLimit(TASKS, 1000, BURST))
            await admin.set_limits("bounded", concurrency=LIMIT)
            await admin.enqueue_many([{"n": i} for i in range(300)], queue="rated")
            await admin.enqueue_many([{"n": i} for i in range(2000)], queue="bounded")
        row = queue_row(b, "bounded")  # (set through a, seen through b)
        assert row["limits"] == {"rate": None, "concurrency": LIMIT}
        handed: list[float] = []  # the brokers' times of the rated queue's hand-outs
        running = 0
        most = 0

        async def rated(client: AsyncClient) -> None:
            while time.monotonic() < started + RUN:
                delivery = await client.claim(queues="rated", wait_ms=200, lease_ms=LEASE_MS)
                if delivery is not None:
                    out = delivery.deadline - timedelta(milliseconds=LEASE_MS)
                    handed.append(out.timestamp())
                    await client.ack(delivery)

        async def bounded(task: Any) -> None:
            nonlocal running, most
            running += 1
            most = max(most, running)
            await asyncio.sleep(0.005)
            running -= 1

        clients = [AsyncClient(a.grpc_url), AsyncClient(b.grpc_url)]
        workers = [Worker(c, bounded, concurrency=8, queues="bounded") for c in clients]
        started = time.monotonic()
        runs = [asyncio.ensure_future(w.run()) for w in workers]
        runs += [asyncio.ensure_future(rated(c)) for c in clients for _ in range(4)]
        counted = 0
        while time.monotonic() < started + RUN:
            for broker in (a, b):
                held = (await asyncio.to_thread(queue_row, broker, "bounded"))["handed_out"]
                assert held <= LIMIT
                counted = max(counted, held)
            await asyncio.sleep(0.01)
        for w in workers:
            w.stop()
        await asyncio.gather(*runs)
        for c in clients:
            await c.close()
    assert most <= LIMIT
    assert counted == LIMIT  # reached, never passed
    done = [w.succeeded for w in workers]
    assert all(n > 0 for n in done), done  # taken through both brokers
    assert sum(done) >= 100, done
    handed.sort()
    for i, t in enumerate(handed):
        assert bisect.bisect_right(handed, t + 1.0) - i <= TASKS + BURST, handed[i:]
    assert BURST + TASKS * (RUN - 1) <= len(handed) <= BURST + TASKS * (RUN + 0.5), len(handed)
