"""The PostgreSQL store's schema: made, upgraded or checked when a store opens.

The tables are the migrations in ``migrations/`` (``001_tables.sql``, ``002_key_expiries.sql``,
``003_control.sql``, ``004_results.sql``, ...), run by the one runner the SQL stores share
(wqbroker/store/migrate.py) inside a transaction holding ``pg_advisory_xact_lock``: brokers
starting together on one database wait for each other, and one of them makes or upgrades the
schema. In the same transaction, whenever a migration ran, every function is made again from
``sql/functions.sql``; and a new database gets the key that scatters its task ids. A database
holding other tables and no wq schema, or a wq schema of a newer version, is refused (ValueError;
the store makes it a one-line StoreError)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final

import asyncpg

from wqbroker.store.migrate import Migrations
from wqbroker.store.postgres.queries import FUNCTIONS, Q

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    Conn = asyncpg.Connection | PoolConnectionProxy[Any]

MIGRATIONS: Final = Migrations("wqbroker.store.postgres", "migrations")
# 2: set-based enqueue and acks, promotions reported by claims, fold, an index of key expiries
# 3: control over every task (cancel, listing, expiry, time limits, unique keys, progress)
# 4: results and workflows (results kept, tasks waiting for others, watched tasks)
# 5: schedules (wq.schedules, wq.fire; the schedule of a fired task)
# 6: limits per queue (their columns on wq.queues: wq.claim takes from a limited queue what they
#    allow, under its row's lock)
# 7: no table changes: wq.sweep names a lease that ran out at its time limit ("timed out after N
#    ms"); the version makes an older database take the functions again
# 8: wq.tasks.buried_at, when a dead task was buried (set by every function that buries, cleared
#    by wq.requeue; NULL for a task buried before: not known)
SCHEMA_VERSION: Final = MIGRATIONS.latest
# Any constant: the key of the advisory lock taken while the schema is checked or made.
_LOCK_KEY: Final = 0x7771_0000_0001


async def prepare(conn: Conn, rng: random.Random, where: str) -> int:
    """Make, upgrade or check the schema (``where`` names the database in the log); the key
    that scatters this database's task ids (drawn from ``rng`` for a new database)."""
    async with MIGRATIONS.migrate(_Database(conn), where) as found:
        if found != MIGRATIONS.latest:  # made or upgraded: every function made again, whole
            await conn.execute(FUNCTIONS)
        if found is None:
            await conn.execute(Q.new_id_key, str(rng.getrandbits(64)))
        return int(await conn.fetchval(Q.id_key))


class _Database:
    """A connection as the migration runner uses it."""

    def __init__(self, conn: Conn) -> None:
        self._conn = conn

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        async with self._conn.transaction():
            await self._conn.execute(Q.no_deadline)
            await self._conn.execute(Q.lock, _LOCK_KEY)
            yield

    async def version(self) -> int | None:
        """None for a database without tables. ValueError if it holds other tables and no wq
        schema."""
        if await self._conn.fetchval(Q.has_meta):
            found = await self._conn.fetchval(Q.version)
            if found is None or not str(found).isdigit():
                raise ValueError("not a wq database: its wq.meta table has no schema version")
            return int(found)
        if await self._conn.fetchval(Q.other_tables):
            raise ValueError("not a wq database: it holds other tables and no wq schema version")
        return None

    async def run(self, sql: str) -> None:
        await self._conn.execute(sql)

    async def record(self, version: int) -> None:
        await self._conn.execute(Q.record_version, str(version))
