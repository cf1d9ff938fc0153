"""What the tests share that is not a fixture: the store backends, an in-process broker on port 0,
a small HTTP client, the totals invariant, and the one way to wait for something to happen.

Fixtures live in ``conftest.py`` (which imports from here); tests import from here, never from
``conftest``.

Waiting: a test that needs something to happen (a claim to park, a counter to move, a line to be
written) waits for that observable condition with :func:`wait_until` (or :func:`wait_until_sync`
outside an event loop), which fails with an AssertionError naming what it waited for. The time-out
there is a safety bound that turns a hang into a failure, never something a test asserts. Timing
logic runs on a :class:`~wqbroker.clock.FakeClock`; :func:`settle` lets the event loop run what
became runnable after the clock moved.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Final, Protocol, TypeVar, overload

import aiohttp
from hypothesis import strategies as st

from tests import pg
from wqbroker.broker import Broker
from wqbroker.clock import Clock
from wqbroker.config import Config
from wqbroker.retry import Backoff
from wqbroker.store import Store
from wqbroker.store.memory import MemoryStore
from wqbroker.store.postgres import PostgresStore
from wqbroker.store.sqlite import SqliteStore

T = TypeVar("T")

# -- waiting ------------------------------------------------------------------------------------

# How many times wait_until just yields to the event loop before it starts sleeping between polls:
# most conditions come true after a step or two of the loop, and a fake-clock test should not pay
# a real interval for each.
_YIELDS_FIRST = 10


def _timed_out(what: str, timeout: float, last: object) -> AssertionError:
    seen = "" if isinstance(last, bool) or last is None else f"; last seen: {last!r}"
    return AssertionError(f"timed out after {timeout:g}s waiting for {what}{seen}")


@overload
async def wait_until(
    probe: Callable[[], Awaitable[T]],
    holds: Callable[[T], object] = ...,
    *,
    what: str,
    timeout: float = ...,
    interval: float = ...,
) -> T: ...


@overload
async def wait_until(
    probe: Callable[[], T],
    holds: Callable[[T], object] = ...,
    *,
    what: str,
    timeout: float = ...,
    interval: float = ...,
) -> T: ...


async def wait_until(
    probe: Callable[[], Any],
    holds: Callable[[Any], object] = bool,
    *,
    what: str,
    timeout: float = 10.0,
    interval: float = 0.005,
) -> Any:
    """Call ``probe()`` (sync or async) until ``holds(value)`` is true, and return that value.

    ``wait_until(lambda: service.waiting == 1, what="the claim to park")`` or, with a predicate
    over what the probe returns, ``stats = await wait_until(client.stats, lambda s: s.ready == 0,
    what="the queue to drain")``. Fails with an AssertionError naming ``what`` (and the last value
    seen) if it does not happen within ``timeout`` seconds of real time.
    """
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    polls = 0
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if holds(value):
            return value
        if loop.time() >= give_up:
            raise _timed_out(what, timeout, value)
        await asyncio.sleep(0 if polls < _YIELDS_FIRST else interval)
        polls += 1


def wait_until_sync(
    probe: Callable[[], T],
    holds: Callable[[T], object] = bool,
    *,
    what: str,
    timeout: float = 15.0,
    interval: float = 0.02,
) -> T:
    """:func:`wait_until` for code outside an event loop (real processes, threads)."""
    give_up = time.monotonic() + timeout
    while True:
        value = probe()
        if holds(value):
            return value
        if time.monotonic() >= give_up:
            raise _timed_out(what, timeout, value)
        time.sleep(interval)


async def settle(rounds: int = 5) -> None:
    """Let the event loop run whatever became runnable (after a FakeClock.advance, say)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


# -- stores and brokers -------------------------------------------------------------------------

# Every store backend; the contract tests and the state machine run against each one.
BACKENDS = ["memory", "sqlite", "postgres"]

#: The Hypothesis profile of this run (tests/conftest.py): ``ci`` runs every property as written,
#: ``dev`` fewer examples. ``$HYPOTHESIS_PROFILE`` chooses; else ``ci`` when ``$CI`` is set.
PROFILE: Final = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")


def examples(count: int) -> int:
    """A property's number of examples in this run: ``count`` in the ``ci`` profile, a fifth of
    it (at least 5) in ``dev``."""
    return count if PROFILE == "ci" else max(5, count // 5)


SQLITE_HOT = 3
#: Seconds a test store's database call may take before it fails (see make_store).
TEST_DB_DEADLINE: Final = 60.0  # (a 10,000-task statement on a loaded 2-core machine took 30)


async def make_store(
    kind: str,
    backoff: Backoff,
    rng: random.Random,
    tmp_path: str | os.PathLike[str] | None = None,
) -> Store:
    """A fresh store of the given kind (a durable one is created in ``tmp_path``)."""
    if kind == "memory":
        return MemoryStore(backoff, rng)
    if kind == "sqlite":
        if tmp_path is None:
            raise ValueError("an SQLite store needs a directory (tmp_path)")
        # synchronous=NORMAL: the same semantics as FULL for the contract, without an fsync per
        # commit (the crash tests use the default, FULL).
        path = os.path.join(tmp_path, f"wq-{rng.getrandbits(32):08x}.db")
        # hot_ready=3: past three ready tasks, the rest go cold (ids only, read back when their
        # turn comes), so every test also runs that path.
        return await SqliteStore.open(path, backoff, rng, sync="normal", hot_ready=SQLITE_HOT)
    if kind == "postgres":
        # One database for the run (tests/pg.py), emptied for each store. A longer deadline on
        # database calls than a broker's (5 s): a test that is not about deadlines must not fail
        # because the machine running the whole suite was busy for a moment (the deadline tests
        # open stores of their own).
        store = await PostgresStore.open(
            await pg.database(), backoff, rng, pool_size=4, deadline=TEST_DB_DEADLINE
        )
        await store.wipe()
        return store
    raise ValueError(kind)


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


def http_broker(
    clock: Clock | None = None, rng: random.Random | None = None, **config: Any
) -> AbstractAsyncContextManager[Broker]:
    """A real broker serving HTTP only (127.0.0.1, port 0): no gRPC server is started, the HTTP
    tests need none."""
    return running_broker(clock, rng, grpc_addr="off", **config)


# -- HTTP ---------------------------------------------------------------------------------------


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


# -- the invariant --------------------------------------------------------------------------------


class _Totals(Protocol):
    @property
    def nacked(self) -> int: ...
    @property
    def reclaimed(self) -> int: ...
    @property
    def retried(self) -> int: ...
    @property
    def buried(self) -> int: ...


class _WithTotals(Protocol):
    @property
    def totals(self) -> _Totals: ...


def invariant_holds(stats: Mapping[str, Any] | _WithTotals) -> bool:
    """``nacked + reclaimed == retried + buried``: every failure was either retried or buried.

    ``stats`` is the body of GET /stats, or a Stats of the broker or the client library."""
    if isinstance(stats, Mapping):
        t = stats["totals"]
        return bool(t["nacked"] + t["reclaimed"] == t["retried"] + t["buried"])
    totals = stats.totals
    return totals.nacked + totals.reclaimed == totals.retried + totals.buried


# -- Hypothesis ---------------------------------------------------------------------------------

#: Any JSON value (no NaN, no infinities: JSON has none), nested a little.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
