"""The PostgreSQL store's connections, and what it does while the database is away.

Calls go through a small asyncpg pool, each in its own transaction (one round trip: a pooled
connection goes back as it is, with no reset query).

Every call has a deadline (:attr:`Pool.deadline`, ``-db-timeout-ms``, 5 s by default), kept twice:
the server ends a statement that runs longer (``statement_timeout``), and the broker stops waiting
for one whose answer does not come (:func:`bounded`: a silent partition, where no packet comes
back and nothing is refused, would otherwise hold the caller for as long as TCP takes to give up).
A call past its deadline fails with StoreError (503 / UNAVAILABLE, with a Retry-After) and has the
probe look at once. The connections also have TCP keepalives and a user time-out (:func:`tune`),
so the kernel drops one whose peer is gone even while the pool does not use it.

The probe is the listener's connection (listener.py): it pings the database every
:data:`PROBE_EVERY` seconds and gives it :data:`PROBE_TIMEOUT` to answer, so a broker notices a
silent partition within a few seconds whether or not it has traffic, and every broker of a cluster
says the same in ``/readyz``. When the database cannot be reached, the pool is marked failed
(:attr:`Pool.failed`, for the health checks) and calls fail at once without trying the network
(the calls waiting to go in a group commit too): until a probe (with backoff, doubling from
:data:`RETRY_FIRST` to :data:`RETRY_CAP`) or the listener reaches the database again. Then the
old connections are replaced and the store is told (``on_recovered``: every queue is re-checked,
since announcements may have been missed).

A call the database ends in a deadlock or a serialization failure (two brokers locking the same
waiting tasks in opposite orders, which the functions avoid where they can) was rolled back whole,
since every call is one transaction: it is made again, a few times, after a short random pause.

A failover is the same: the connections are made through dsn.py (the DSN's servers, the one that
takes writes), and a server that stops being the primary (:data:`SWITCHING`: a write refused as
read-only, a server shutting down or starting; or the probe finding it read-only) makes the store
unavailable, with the reason, and its connections are made again until a primary answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

import asyncpg

from wqbroker.errors import StoreError
from wqbroker.store.postgres import dsn as dsns
from wqbroker.store.postgres.dsn import redact
from wqbroker.store.postgres.queries import Q

log = logging.getLogger("wqbroker.store.postgres")

R = TypeVar("R")

#: Connections for calls (opened as calls need them): enough for ENQUEUE_WIDTH enqueues side by
#: side on a slow link (group.py), and a few calls of other kinds beside them.
POOL_SIZE: Final = 16
#: The longest a database call may take (-db-timeout-ms), by default: shorter than any client's
#: own time-out (wqclient waits 30 s), long enough for the largest bulk call on a busy database.
DEADLINE: Final = 5.0
#: How often the probe pings the database, and how long it waits for the answer: a silent
#: partition is noticed within PROBE_EVERY + PROBE_TIMEOUT seconds.
PROBE_EVERY: Final = 1.0
PROBE_TIMEOUT: Final = 2.0
#: TCP keepalives on every connection: probes after this many idle seconds, then every
#: KEEPALIVE_EVERY, dropped after KEEPALIVE_COUNT unanswered (a dead peer: about 10 s idle).
KEEPALIVE_IDLE: Final = 5
KEEPALIVE_EVERY: Final = 2
KEEPALIVE_COUNT: Final = 3
# A broker that lost its database (or its listening connection) tries again after this long,
# doubling up to the cap.
RETRY_FIRST: Final = 0.05
RETRY_CAP: Final = 2.0
#: How long a closing store waits for its connections to say goodbye before it drops them.
CLOSE_TIMEOUT: Final = 2.0

UNREACHABLE: Final = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    # A pooled connection whose server side was killed can be left in a state where asyncpg
    # refuses to use it ("cannot switch to state ..."): it is replaced like a lost one.
    asyncpg.InternalClientError,
)
#: A call that ended in a deadlock or a serialization failure (rolled back whole: each call is
#: one transaction) is made again, up to this many times in all, after a short random pause.
AGAIN: Final = 5
_GAVE_UP: Final = (
    f"the database ended the call {AGAIN} times in a deadlock or a serialization failure"
)
#: The class of SQLSTATEs the store's functions raise to refuse a call (``WQ404``: an unknown
#: parent, sql/functions.sql's wq.link): passed to the store as asyncpg raised them.
REFUSED: Final = "WQ"


class _Again(Exception):
    """A call to make again."""


def _again_after(attempt: int) -> float:
    """The pause before the next try of a call ended in a deadlock: long enough for the
    transaction that went on to take what it waited for (made again at once, the call could take
    it back first, and meet the same cycle), random so that two calls do not meet again in step
    (5 to 20 ms, doubling each time)."""
    return float(random.uniform(0.005, 0.02) * 2**attempt)


#: What a server says when it is not, or no longer, the primary a store needs: read-only (a
#: standby, an old primary back as one, ``default_transaction_read_only``: 25006), shutting down
#: (57P01, 57P02) or starting or in recovery (57P03). A failover under way: the connection is
#: dropped and the store is unavailable until the probe finds a primary through the DSN.
SWITCHING = (
    asyncpg.ReadOnlySQLTransactionError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.CannotConnectNowError,
)


class Pool:
    """The connections of one store (open with :meth:`connect`), each call bounded by
    ``deadline`` seconds, failing fast while the database is away."""

    def __init__(
        self,
        on_recovered: Callable[[], None],
        on_failed: Callable[[StoreError], None] | None = None,
        deadline: float = DEADLINE,
    ) -> None:
        self.raw: asyncpg.Pool | None = None  # (None once closed)
        self.failed: str | None = None  # why the database is taken for away, while it is
        # Times the database came back after being away (what was cached from it before, such
        # as reserved ids, may come from a server that is no longer the primary).
        self.generation = 0
        self.dsn = ""
        self.closed = False  # set when the store closes: calls are refused from then on
        self.deadline = deadline
        self._on_recovered = on_recovered
        self._on_failed = on_failed
        self._recovery: asyncio.Task[None] | None = None
        self._open: Callable[[int], Coroutine[Any, Any, asyncpg.Pool]] | None = None
        # Set when a call ran past its deadline: the probe (listener.py) looks at once.
        self.look = asyncio.Event()
        self._expiring: set[asyncio.Task[None]] = set()
        self.retries = 0  # calls made again after a deadlock or a serialization failure

    async def connect(self, dsn: str, size: int) -> None:
        """Open the pool (its connections to a server of ``dsn`` that takes writes: dsn.py).
        StoreError (one line, no password) if the database cannot be had."""
        self.dsn = dsn

        async def open_pool(min_size: int) -> asyncpg.Pool:
            return await dsns.create_pool(
                dsn,
                min_size=min_size,
                max_size=size,
                # (each server of the DSN: with several, one that answers nothing must not
                # hold the next back for long)
                timeout=self.deadline if len(dsns.servers(dsn)) > 1 else max(self.deadline, 10),
                command_timeout=self.deadline,
                server_settings={"statement_timeout": str(round(self.deadline * 1000))},
                init=tune,
                reset=_as_it_is,
            )

        try:
            self.raw = await open_pool(1)
        except (*UNREACHABLE, asyncpg.PostgresError, ValueError) as e:
            why = dsns.explain(e, dsn) or one_line(e)
            raise StoreError(f"cannot connect to {redact(dsn)}: {why}") from None
        self._open = open_pool

    def problem(self) -> str | None:
        if self.failed is not None:
            return f"the store is unavailable: {self.failed}"
        return None

    def ready(self) -> asyncpg.Pool:
        """The pool, if calls may use it; else StoreError."""
        if self.closed or self.raw is None:
            raise StoreError("the store is closed")
        if self.failed is not None:
            # Fail fast while the database is away (the recovery task tries it with backoff):
            # clients get their 503 at once instead of waiting for a connection to time out.
            raise StoreError(self.failed)
        return self.raw

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        for attempt in range(AGAIN):
            raw = self.ready()
            try:
                return await self._call(raw, raw.fetch(sql, *args))
            except _Again:
                self.retries += 1
                await asyncio.sleep(_again_after(attempt))
        raise StoreError(_GAVE_UP)

    async def execute(self, sql: str, *args: Any) -> str:
        for attempt in range(AGAIN):
            raw = self.ready()
            try:
                return await self._call(raw, raw.execute(sql, *args))
            except _Again:
                self.retries += 1
                await asyncio.sleep(_again_after(attempt))
        raise StoreError(_GAVE_UP)

    async def _call(self, raw: asyncpg.Pool, call: Coroutine[Any, Any, R]) -> R:
        try:
            return await bounded(call, self.deadline)
        except TimeoutError:
            self.look.set()  # (the probe tells whether the database is away, or only slow)
            raise StoreError(f"the database did not answer within {self.deadline:g} s") from None
        except (*UNREACHABLE, *SWITCHING) as e:
            if raw is not self.raw:  # its connection was dropped as the pool was replaced
                raise StoreError(f"the database connection was lost: {one_line(e)}") from None
            raise self.unreachable(e) from None
        except (asyncpg.DeadlockDetectedError, asyncpg.SerializationError):
            # Rolled back whole (every call is one transaction): run again (fetch, execute).
            raise _Again from None
        except asyncpg.PostgresError as e:
            if e.sqlstate.startswith(REFUSED):
                raise  # (a refusal of the store's own: the store reads it)
            raise _failed(e) from None
        except Exception as e:
            if raw is self.raw:
                raise
            # The pool was replaced and the old one terminated under this call: asyncpg, its
            # connection gone mid-statement, may fail with anything (seen: an AttributeError
            # from a statement's type introspection). Lost, as above; never a 500.
            log.debug("a call on a dropped connection failed: %r", e)
            raise StoreError(
                "the database connection was lost (the connections were replaced)"
            ) from None

    def unreachable(self, error: BaseException | str) -> StoreError:
        """The database cannot be reached, or the server reached is not the primary (a
        failover: :data:`SWITCHING`): fail fast from now on, until a primary answers again. A
        server that refuses writes has its connections dropped (the pool makes new ones through
        the DSN's servers). Said again, with another reason, the reason is updated (what /readyz
        tells)."""
        if self.closed:
            return StoreError("the store is closed")
        reason = self.describe(error)
        if isinstance(error, asyncpg.ReadOnlySQLTransactionError):
            self.expire()
        if self.failed is None:
            self.failed = reason
            log.warning("%s (retrying with backoff)", self.failed)
            if self._on_failed is not None:
                self._on_failed(StoreError(self.failed))
            if self._recovery is None:
                self._recovery = asyncio.get_running_loop().create_task(self._recover())
        elif reason != self.failed:
            self.failed = reason
            log.info("still unavailable: %s", reason)
        return StoreError(self.failed)

    def describe(self, error: BaseException | str) -> str:
        """Why the store is unavailable, in a line, from what went wrong."""
        if isinstance(error, str):
            return (
                error
                if error.startswith("the database is")
                else f"the database is unreachable: {error}"
            )
        text = one_line(error)
        if isinstance(error, asyncpg.ReadOnlySQLTransactionError):
            return (
                "the database is read-only (a standby, or a primary being demoted: a failover?): "
                + text
            )
        if isinstance(error, SWITCHING):
            return f"the database is shutting down or starting (a failover?): {text}"
        explained = dsns.explain(error, self.dsn)
        if explained is not None:
            return explained
        return f"the database is unreachable: {text}"

    def expire(self) -> None:
        """Have every connection of the pool made again (idle ones at their next use, busy ones
        when they come back): they may be to a server that is not the primary any more."""
        if self.raw is not None:
            task = asyncio.get_running_loop().create_task(self.raw.expire_connections())
            self._expiring.add(task)
            task.add_done_callback(self._expiring.discard)

    async def recovered(self) -> None:
        """The database answers again: forget the failure, drop connections made before it,
        and tell the store (announcements may have been missed).

        The connections are dropped, not closed: a connection from before may sit on a link
        that died, where a goodbye would wait for nothing (asyncpg's ``expire_connections``
        closes each with a timeout in a task of its own whose failure nobody reads). So a new
        pool (no connection opened yet) takes the old one's place, and the old one is
        terminated: a call still on one of its connections fails (with a StoreError that does
        not mark the store failed again)."""
        if self.failed is None:
            return
        log.warning("the database is reachable again")
        self.failed = None
        self.generation += 1
        old = self.raw
        if old is not None and self._open is not None and not self.closed:
            try:
                self.raw = await self._open(0)
            except (*UNREACHABLE, asyncpg.PostgresError) as e:  # (none expected: no connection)
                log.warning("could not replace the connections: %s", one_line(e))
            else:
                old.terminate()
        self._on_recovered()

    async def _recover(self) -> None:
        """While the database is unreachable, try it with backoff until it answers."""
        delay = RETRY_FIRST
        try:
            while self.failed is not None and not self.closed and self.raw is not None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_CAP)
                try:
                    read_only = await bounded(self.raw.fetchval(Q.ping), PROBE_TIMEOUT)
                except TimeoutError:
                    continue
                except (*UNREACHABLE, asyncpg.PostgresError) as e:
                    self.unreachable(e)  # (the reason, up to date)
                    continue
                if read_only:
                    # A connection made before to a server that is a standby now: made again,
                    # through the DSN, until one reaches the primary.
                    self.unreachable(READ_ONLY)
                    await self.raw.expire_connections()
                    continue
                await self.recovered()
        finally:
            self._recovery = None

    async def close(self) -> None:
        self.closed = True
        await cancel(self._recovery)
        pool, self.raw = self.raw, None
        if pool is not None:
            # A goodbye on each connection, for CLOSE_TIMEOUT at most: one on a dead link (or
            # a call that never came back) would hold the broker's stop; those are dropped.
            try:
                await asyncio.wait_for(pool.close(), CLOSE_TIMEOUT)
            except (*UNREACHABLE, asyncpg.PostgresError):
                pool.terminate()


#: Why the store is unavailable when the probe finds its server read-only.
READ_ONLY: Final = (
    "the database is read-only (a standby, or a primary being demoted: a failover?): "
    "pg_is_in_recovery() or transaction_read_only"
)


async def bounded(call: Coroutine[Any, Any, R], seconds: float) -> R:
    """What ``call`` returns, if it does within ``seconds``; else TimeoutError at once. The call
    runs as a task of its own, so giving up on it never waits for it (asyncpg, cancelled, would
    first try to cancel the query on the server: on a dead link, as long again); it is cancelled
    and left to end in the background (its connection is dropped). A caller cancelled meanwhile
    cancels it too."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(call)
    waiter = loop.create_future()
    task.add_done_callback(lambda _: _wake(waiter))
    timer = loop.call_later(seconds, _wake, waiter)
    try:
        await waiter
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        timer.cancel()
    if not task.done():
        task.cancel()
        task.add_done_callback(_forget)
        raise TimeoutError
    return task.result()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _forget(task: asyncio.Task[Any]) -> None:
    """A call given up on has ended: its outcome is nobody's (retrieved, so never logged)."""
    if not task.cancelled():
        task.exception()


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task (if any) and wait until it has stopped."""
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


async def tune(conn: asyncpg.Connection) -> None:
    """A new connection's socket: TCP keepalives (a peer gone silent is found while the
    connection is idle) and a user time-out (data left unacknowledged as long as the keepalives
    would take drops it too), where the platform has them."""
    transport = getattr(conn, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # (a Unix socket: no network between)
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_EVERY)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
        user_timeout = (KEEPALIVE_IDLE + KEEPALIVE_EVERY * KEEPALIVE_COUNT) * 1000
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout)


async def _as_it_is(_conn: asyncpg.Connection) -> None:
    """How a connection goes back to the pool: as it is. (asyncpg's default resets its session
    state with a query, a second round trip for every call; the store leaves no session state:
    no SET but SET LOCAL, no session locks, no LISTEN on these connections.)"""


def _failed(error: asyncpg.PostgresError) -> StoreError:
    """The database refused a call (it is shutting down, out of space, was terminated...)."""
    return StoreError(f"the database failed: {one_line(error)}")


def one_line(error: BaseException | str) -> str:
    """An error's message (or a text), its first line (for a one-line StoreError or log line)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
