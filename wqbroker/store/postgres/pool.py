"""The PostgreSQL store's connections, and what it does while the database is away.

Calls go through a small asyncpg pool, each in its own transaction (one round trip: a pooled
connection goes back as it is, with no reset query). A call that cannot reach the database fails
with StoreError (503 / UNAVAILABLE) and marks the pool failed (:attr:`Pool.failed`, for the health
checks): until a probe (with backoff, doubling from :data:`RETRY_FIRST` to :data:`RETRY_CAP`) or
the listener (listener.py) reaches the database again, calls fail at once without trying the
network. Then the old connections are replaced and the store is told (``on_recovered``: every
queue is re-checked, since announcements may have been missed).
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Callable
from typing import Any, Final

import asyncpg

from wqbroker.errors import StoreError
from wqbroker.store.postgres.queries import Q

log = logging.getLogger("wqbroker.store.postgres")

POOL_SIZE: Final = 8
# A broker that lost its database (or its listening connection) tries again after this long,
# doubling up to the cap.
RETRY_FIRST: Final = 0.05
RETRY_CAP: Final = 2.0

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


class Pool:
    """The connections of one store (open with :meth:`connect`), failing fast while the database
    is away."""

    def __init__(self, on_recovered: Callable[[], None]) -> None:
        self.raw: asyncpg.Pool | None = None  # (None once closed)
        self.failed: str | None = None  # why the database is taken for away, while it is
        self.closed = False  # set when the store closes: calls are refused from then on
        self._on_recovered = on_recovered
        self._recovery: asyncio.Task[None] | None = None

    async def connect(self, dsn: str, size: int) -> None:
        """Open the pool. StoreError (one line, no password) if the database cannot be had."""
        try:
            self.raw = await asyncpg.create_pool(
                dsn,
                min_size=1,
                max_size=size,
                timeout=10,
                command_timeout=60,
                reset=_as_it_is,
            )
        except (*UNREACHABLE, asyncpg.PostgresError, ValueError) as e:
            raise StoreError(f"cannot connect to {redact(dsn)}: {one_line(e)}") from None

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
        pool = self.ready()
        try:
            return await pool.fetch(sql, *args)
        except UNREACHABLE as e:
            raise self._unreachable(e) from None
        except asyncpg.PostgresError as e:
            raise _failed(e) from None

    async def execute(self, sql: str, *args: Any) -> str:
        pool = self.ready()
        try:
            return await pool.execute(sql, *args)
        except UNREACHABLE as e:
            raise self._unreachable(e) from None
        except asyncpg.PostgresError as e:
            raise _failed(e) from None

    def _unreachable(self, error: BaseException) -> StoreError:
        if self.failed is None:
            self.failed = f"the database is unreachable: {one_line(error)}"
            log.warning("%s (retrying with backoff)", self.failed)
            if self._recovery is None and not self.closed:
                self._recovery = asyncio.get_running_loop().create_task(self._recover())
        return StoreError(self.failed)

    async def recovered(self) -> None:
        """The database answers again: forget the failure, drop connections made before it,
        and tell the store (announcements may have been missed)."""
        if self.failed is None:
            return
        log.warning("the database is reachable again")
        self.failed = None
        if self.raw is not None:
            await self.raw.expire_connections()
        self._on_recovered()

    async def _recover(self) -> None:
        """While the database is unreachable, try it with backoff until it answers."""
        delay = RETRY_FIRST
        try:
            while self.failed is not None and not self.closed and self.raw is not None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_CAP)
                try:
                    await self.raw.fetchval(Q.ping, timeout=5)
                except (*UNREACHABLE, asyncpg.PostgresError):
                    continue
                await self.recovered()
        finally:
            self._recovery = None

    async def close(self) -> None:
        self.closed = True
        await cancel(self._recovery)
        pool, self.raw = self.raw, None
        if pool is not None:
            await pool.close()


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task (if any) and wait until it has stopped."""
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


async def _as_it_is(_conn: asyncpg.Connection) -> None:
    """How a connection goes back to the pool: as it is. (asyncpg's default resets its session
    state with a query, a second round trip for every call; the store leaves no session state:
    no SET but SET LOCAL, no session locks, no LISTEN on these connections.)"""


def _failed(error: asyncpg.PostgresError) -> StoreError:
    """The database refused a call (it is shutting down, out of space, was terminated...)."""
    return StoreError(f"the database failed: {one_line(error)}")


def redact(dsn: str) -> str:
    """The DSN without its password, for messages."""
    parts = urllib.parse.urlsplit(dsn)
    if parts.password is None:
        return dsn
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def one_line(error: BaseException) -> str:
    """An error's message, its first line (for a one-line StoreError or log line)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
