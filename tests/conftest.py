"""Shared fixtures: fake clock, every store backend, and real brokers on port 0."""

from __future__ import annotations

import asyncio
import inspect
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from wqbroker.broker import Broker, Config
from wqbroker.clock import Clock, FakeClock
from wqbroker.retry import Backoff
from wqbroker.service import Service
from wqbroker.store import Store
from wqbroker.store.memory import MemoryStore
from wqbroker.store.sqlite import SqliteStore

# Every store backend; the contract tests and the state machine run against each one.
BACKENDS = ["memory", "sqlite"]


def make_store(
    kind: str, backoff: Backoff, rng: random.Random, tmp_path: Any = None
) -> Store | Awaitable[Store]:
    """A store of the given kind (SQLite opens asynchronously: await the result)."""
    if kind == "memory":
        return MemoryStore(backoff, rng)
    if kind == "sqlite":
        # synchronous=NORMAL: the same semantics as FULL for the contract, without an fsync per
        # commit (the crash tests use the default, FULL).
        path = os.path.join(str(tmp_path), f"wq-{rng.getrandbits(32):08x}.db")
        return SqliteStore.open(path, backoff, rng, sync="normal")
    raise ValueError(kind)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def store(backend: str, rng: random.Random, tmp_path: Any) -> AsyncIterator[Store]:
    made = make_store(backend, Backoff(1.0, 30.0, rng), rng, tmp_path)
    s = await made if inspect.isawaitable(made) else made
    yield s
    await s.close()


@pytest.fixture
async def service(store: Store, clock: FakeClock) -> AsyncIterator[Service]:
    svc = Service(store, clock)
    await svc.start()
    yield svc
    await svc.close()


async def settle(rounds: int = 5) -> None:
    """Let the event loop run whatever became runnable (after a FakeClock.advance, say)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


@asynccontextmanager
async def running_broker(
    clock: Clock | None = None,
    rng: random.Random | None = None,
    store: Store | None = None,
    **config: Any,
) -> AsyncIterator[Broker]:
    """A real broker (HTTP and gRPC on 127.0.0.1, port 0) in this event loop; ``config`` are
    Config fields, ``store`` an already opened store to use."""
    config.setdefault("addr", "127.0.0.1:0")
    config.setdefault("grpc_addr", "127.0.0.1:0")
    broker = Broker(Config(**config), clock=clock, rng=rng, store=store)
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop()


@pytest.fixture
def broker_factory() -> Callable[..., Any]:
    return running_broker


class Http:
    """A small JSON client over a real aiohttp session, for the HTTP tests."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session = session
        self.base = base

    async def request(
        self, method: str, path: str, *, json: Any = None, data: Any = None, **kw: Any
    ) -> tuple[int, Any]:
        async with self.session.request(
            method, self.base + path, json=json, data=data, **kw
        ) as resp:
            body = await resp.read()
            if not body:
                return resp.status, None
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, body.decode("utf-8", "replace")

    async def enqueue(self, payload: Any = None, **fields: Any) -> str:
        status, body = await self.request("POST", "/jobs", json={"payload": payload, **fields})
        assert status == 201, body
        return str(body["id"])

    async def claim(self, wait_ms: int = 0, lease_ms: int | None = None) -> Any:
        query = f"?wait_ms={wait_ms}" + (f"&lease_ms={lease_ms}" if lease_ms is not None else "")
        status, body = await self.request("GET", "/jobs/next" + query)
        assert status in (200, 204), body
        return body

    async def ack(self, task_id: str, lease_id: str) -> int:
        status, _ = await self.request("POST", f"/jobs/{task_id}/ack?lease_id={lease_id}")
        return status

    async def nack(self, task_id: str, lease_id: str, error: str | None = None) -> int:
        body = {"error": error} if error is not None else None
        status, _ = await self.request(
            "POST", f"/jobs/{task_id}/nack?lease_id={lease_id}", json=body
        )
        return status

    async def stats(self) -> Any:
        status, body = await self.request("GET", "/stats")
        assert status == 200
        return body


@asynccontextmanager
async def http_client(base: str) -> AsyncIterator[Http]:
    async with aiohttp.ClientSession() as session:
        yield Http(session, base)


def invariant_holds(stats: dict[str, Any]) -> bool:
    t = stats["totals"]
    return bool(t["nacked"] + t["reclaimed"] == t["retried"] + t["buried"])


Tick = Callable[[], Awaitable[Any]]
