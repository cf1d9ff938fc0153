"""The SQLite store under kill -9: a real broker process on `-store sqlite:PATH` (default
synchronous=FULL), with concurrent producers and workers over HTTP, killed with SIGKILL several
times and restarted on the same file. Afterwards every task that was answered 201 has been acked
exactly once or sits in the DLQ; none is lost, and no acked task is ever delivered again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import invariant_holds, wait_until
from tests.procs import BrokerProcess, broker_process, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KILLS = 4
# Traffic before each kill: this many more tasks answered 201, and a quarter as many more acked.
ACCEPTED_BETWEEN_KILLS = 100


class Books:
    """What the clients were told, to check the broker against."""

    def __init__(self) -> None:
        self.accepted: set[str] = set()  # ids answered 201
        self.acked: dict[str, int] = {}  # id -> number of 204s to its acks
        self.ack_unknown: set[str] = set()  # an ack was sent but the answer was lost
        self.delivered_after_ack: list[str] = []
        self.deliveries = 0


async def produce(
    session: aiohttp.ClientSession, base: list[str], books: Books, stop: asyncio.Event, k: int
) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        body = {"payload": {"producer": k, "n": n}, "max_attempts": 100}
        try:
            async with session.post(base[0] + "/jobs", json=body) as resp:
                if resp.status == 201:
                    books.accepted.add((await resp.json())["id"])
                else:
                    assert resp.status == 503, await resp.text()
        except (aiohttp.ClientError, ConnectionError):
            await asyncio.sleep(0.05)  # the broker is down: it will be back


async def work(
    session: aiohttp.ClientSession, base: list[str], books: Books, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        try:
            async with session.get(base[0] + "/jobs/next?wait_ms=200&lease_ms=1500") as resp:
                if resp.status != 200:
                    continue
                delivery = await resp.json()
        except (aiohttp.ClientError, ConnectionError):
            await asyncio.sleep(0.05)
            continue
        task_id = delivery["task"]["id"]
        books.deliveries += 1
        if books.acked.get(task_id):
            books.delivered_after_ack.append(task_id)
        url = f"{base[0]}/jobs/{task_id}/ack?lease_id={delivery['lease_id']}"
        try:
            async with session.post(url) as resp:
                if resp.status == 204:
                    books.acked[task_id] = books.acked.get(task_id, 0) + 1
                    books.ack_unknown.discard(task_id)
                # 404/409: the lease ran out (the broker was down) and the task went round again
        except (aiohttp.ClientError, ConnectionError):
            books.ack_unknown.add(task_id)  # committed or not: the checks below tell


async def some_traffic(books: Books) -> None:
    """Wait until the broker has taken and settled some more work (it is under load now)."""
    accepted, acked = len(books.accepted), len(books.acked)
    await wait_until(
        lambda: (
            len(books.accepted) >= accepted + ACCEPTED_BETWEEN_KILLS
            and len(books.acked) >= acked + ACCEPTED_BETWEEN_KILLS // 4
        ),
        what=f"{ACCEPTED_BETWEEN_KILLS} more tasks accepted and some acked",
        timeout=30,
    )


async def test_sigkill_loses_no_accepted_task(tmp_path: Path) -> None:
    db = tmp_path / "wq.db"
    port = free_port()
    args = (
        "-addr", f"127.0.0.1:{port}", "-grpc-addr", "off", "-store", f"sqlite:{db}",
        "-sweep-interval-ms", "50", "-backoff-base-ms", "50", "-backoff-cap-ms", "200",
    )  # fmt: skip
    books = Books()
    stop = asyncio.Event()
    base = [f"http://127.0.0.1:{port}"]
    with contextlib.ExitStack() as stack:
        broker: BrokerProcess = stack.enter_context(broker_process(*args))
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=5)
        ) as session:
            clients = [
                asyncio.create_task(produce(session, base, books, stop, k)) for k in range(8)
            ]
            clients += [asyncio.create_task(work(session, base, books, stop)) for _ in range(4)]
            for _ in range(KILLS):
                await some_traffic(books)
                broker.proc.send_signal(signal.SIGKILL)
                broker.proc.wait()
                broker = stack.enter_context(broker_process(*args))
            await some_traffic(books)
            stop.set()
            await asyncio.gather(*clients)

            # No more producing: let workers drain what is left, then read the books.
            drain = asyncio.Event()
            drainers = [asyncio.create_task(work(session, base, books, drain)) for _ in range(4)]

            async def current_stats() -> Any:
                async with session.get(base[0] + "/stats") as resp:
                    return await resp.json()

            await wait_until(
                current_stats,
                lambda s: not (s["ready"] or s["handed_out"] or s["delayed"]),
                what="the queue to drain",
                timeout=60,
            )
            drain.set()
            await asyncio.gather(*drainers)
            async with session.get(base[0] + "/dlq") as resp:
                dead = {t["id"] for t in await resp.json()}
            async with session.get(base[0] + "/stats") as resp:
                stats = await resp.json()

    assert len(books.accepted) > 100, "too little traffic to mean anything"
    assert books.deliveries >= len(books.acked)
    # Nothing acked was ever delivered again, and no task was acked twice.
    assert books.delivered_after_ack == []
    assert all(count == 1 for count in books.acked.values()), {
        k: v for k, v in books.acked.items() if v != 1
    }
    # Every accepted task was acked (the answer to its ack may have been lost in a crash, but
    # then it is gone from the store, which is empty now) or is in the DLQ.
    lost = books.accepted - set(books.acked) - dead - books.ack_unknown
    assert lost == set(), f"{len(lost)} accepted tasks were lost: {sorted(lost)[:5]}"
    assert (stats["ready"], stats["handed_out"], stats["delayed"]) == (0, 0, 0)
    # The lifetime counters survived every restart, and account for every task ever enqueued
    # (some were enqueued without their 201 reaching the producer): acked, or dead.
    totals = stats["totals"]
    assert totals["enqueued"] >= len(books.accepted)
    assert totals["enqueued"] == totals["acked"] + len(dead)
    assert len(books.acked) <= totals["acked"] <= len(books.acked) + len(books.ack_unknown)
    assert invariant_holds(stats)
    print(json.dumps({"accepted": len(books.accepted), "acked": len(books.acked), **totals}))
