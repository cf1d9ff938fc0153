"""Cancels and emptied queues under kill -9, on both durable stores: a real broker process
(`-store sqlite:PATH`, or a PostgreSQL database), producers enqueueing (some delayed, some into a
queue that is emptied now and then), cancellers cancelling tasks they were told exist, killed with
SIGKILL several times mid-traffic and restarted on the same store. Afterwards nothing is half-done:
a task whose cancel was answered 204 never comes back; every task answered 201 that nobody
cancelled, and no empty reached, is still there; an empty answered 200 left none of the tasks
enqueued before it; and the gauges add up to enqueued - acked - purged - cancelled - expired."""

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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

KILLS = 3


class Books:
    """What the clients were told."""

    def __init__(self) -> None:
        self.accepted: dict[str, str] = {}  # id -> queue, answered 201
        self.cancelled: set[str] = set()  # a cancel answered 204
        self.cancel_unknown: set[str] = set()  # a cancel sent, its answer lost
        self.emptied: set[str] = set()  # accepted before an empty of its queue answered 200
        self.empty_unknown: set[str] = set()  # accepted before an empty whose answer was lost
        self.cancels = 0
        self.refused: dict[str, tuple[int, str]] = {}  # cancels answered 404 or 503
        self.lives = 0  # the broker processes killed so far


async def produce(
    session: aiohttp.ClientSession, base: list[str], books: Books, stop: asyncio.Event, k: int
) -> None:
    rng = random.Random(k)
    while not stop.is_set():
        queue = rng.choice(["keep", "keep", "e"])
        body: dict[str, Any] = {"payload": {"k": k}, "queue": queue}
        if rng.random() < 0.3:
            body["delay_ms"] = 600_000
        try:
            async with session.post(base[0] + "/jobs", json=body) as resp:
                if resp.status == 201:
                    books.accepted[(await resp.json())["id"]] = queue
                else:
                    assert resp.status == 503, await resp.text()
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            await asyncio.sleep(0.05)


async def cancel(
    session: aiohttp.ClientSession, base: list[str], books: Books, stop: asyncio.Event
) -> None:
    rng = random.Random(99)
    while not stop.is_set():
        candidates = [i for i, q in books.accepted.items() if q == "keep"]
        if not candidates:
            await asyncio.sleep(0.01)
            continue
        task_id = rng.choice(candidates)
        if task_id in books.cancelled:
            await asyncio.sleep(0)
            continue
        life = books.lives
        try:
            async with session.delete(f"{base[0]}/jobs/{task_id}") as resp:
                if resp.status == 204:
                    books.cancelled.add(task_id)
                    books.cancels += 1
                elif books.lives != life:
                    # aiohttp sends an idempotent request (DELETE) once more when the
                    # connection drops before the answer: the broker it reached first may have
                    # cancelled the task before it was killed, and the next says 404.
                    books.cancel_unknown.add(task_id)
                else:
                    assert resp.status in (404, 503), (resp.status, await resp.text())
                    books.refused[task_id] = (resp.status, await resp.text())
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            books.cancel_unknown.add(task_id)
            await asyncio.sleep(0.05)


async def empty(
    session: aiohttp.ClientSession, base: list[str], books: Books, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.05)
        before = {i for i, q in books.accepted.items() if q == "e"}
        try:
            async with session.post(f"{base[0]}/queues/e/empty") as resp:
                if resp.status == 200:
                    books.emptied |= before
                else:
                    assert resp.status in (404, 503), (resp.status, await resp.text())
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            books.empty_unknown |= before


async def traffic(books: Books, more: int) -> None:
    target = len(books.accepted) + more
    while len(books.accepted) < target:  # noqa: ASYNC110 - the clients' own progress
        await asyncio.sleep(0.01)
    await asyncio.sleep(random.random() * 0.05)  # (kill at some moment, not at a boundary)


@contextlib.asynccontextmanager
async def store_args(kind: str, tmp_path: Path) -> AsyncIterator[tuple[str, ...]]:
    if kind == "sqlite":
        yield ("-store", f"sqlite:{tmp_path / 'wq.db'}")
    else:
        yield ("-store", await pg.create_database("kill9"))


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_sigkill_leaves_no_cancel_or_empty_half_done(kind: str, tmp_path: Path) -> None:
    port = free_port()
    books = Books()
    stop = asyncio.Event()
    base = [f"http://127.0.0.1:{port}"]
    async with store_args(kind, tmp_path) as store:
        args = ("-addr", f"127.0.0.1:{port}", "-grpc-addr", "off", *store)
        with contextlib.ExitStack() as stack:
            broker: BrokerProcess = stack.enter_context(broker_process(*args))
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                clients = [
                    asyncio.create_task(produce(session, base, books, stop, k)) for k in range(6)
                ]
                clients += [asyncio.create_task(cancel(session, base, books, stop))]
                clients += [asyncio.create_task(empty(session, base, books, stop))]
                for _ in range(KILLS):
                    await traffic(books, 150)
                    broker.proc.send_signal(signal.SIGKILL)
                    broker.proc.wait()
                    books.lives += 1
                    broker = stack.enter_context(broker_process(*args))
                await traffic(books, 150)
                stop.set()
                await asyncio.gather(*clients)

                async def state(task_id: str) -> int:
                    async with session.get(f"{base[0]}/jobs/{task_id}") as resp:
                        return resp.status

                present = {i for i in books.accepted if await state(i) == 200}
                async with session.get(base[0] + "/stats") as resp:
                    stats = await resp.json()
    assert len(books.accepted) > 300, "too little traffic to mean anything"
    assert books.cancels > 20, "too few cancels to mean anything"
    assert len(books.emptied) > 20, "too few emptied tasks to mean anything"
    # A cancel answered 204, an empty answered 200: those tasks are gone for good.
    assert not present & books.cancelled, "a cancelled task came back"
    assert not present & books.emptied, "an emptied task came back"
    # Everything else accepted is still there (nothing consumed them).
    maybe_gone = books.cancel_unknown | books.empty_unknown | books.cancelled | books.emptied
    later_emptied = {i for i, q in books.accepted.items() if q == "e"}  # (an empty may run
    # after the last one we heard of; every task of "e" can be gone)
    lost = set(books.accepted) - present - maybe_gone - later_emptied
    assert lost == set(), (
        f"{len(lost)} accepted tasks were lost: {sorted(lost)[:5]}",
        {i: books.refused.get(i) for i in lost},  # (what their cancels were told)
    )
    totals = stats["totals"]
    gauges = stats["ready"] + stats["handed_out"] + stats["delayed"] + stats["dead"]
    assert (
        gauges
        == totals["enqueued"]
        - totals["acked"]
        - totals["purged"]
        - totals["cancelled"]
        - totals["expired"]
    ), stats
    assert totals["cancelled"] >= len(books.cancelled) + len(books.emptied)
    assert gauges >= len(present)
