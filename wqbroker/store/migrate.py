"""Schema migrations as numbered SQL files, and the one runner every SQL store uses.

A store's migrations are the files ``NNN_what.sql`` of one folder of the package (shipped with it:
see ``[tool.setuptools.package-data]``): ``001`` makes the first schema, and each next file takes a
database from the version before it to its own number. A database records the version it is at;
a new database runs every file, from ``001`` (as River's migrations do), so there is one way to get
any schema, whatever version it started from. A file, once released, never changes: a change of
schema is a new file.

The runner (:meth:`Migrations.migrate`), when a store opens: inside one transaction that holds the
store's lock (PostgreSQL: an advisory lock, so of several brokers starting at once on one database
one migrates and the others wait, then find the work done; SQLite: the file's write lock), it reads
the version the database records, refuses a database of a version newer than the last file (it was
written by a newer wq), runs every later file in order, and records the new version -- once, after
the last file (so, while a database is being made from nothing, it records no version yet: a file
may test that to tell a new database from an old one). The store then does what else belongs in
the same transaction (PostgreSQL: its functions; both: the key that scatters task ids), and the
transaction commits: a database is never seen half-migrated.

The runner talks to a database through :class:`Database`, which each store implements for its
driver (asyncpg, sqlite3 in its writer thread): the transaction with the lock, reading and
recording the version, running a file.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Protocol

log = logging.getLogger("wqbroker.store.migrate")

_NAME = re.compile(r"(\d{3})_[a-z0-9_]+\.sql")


@dataclass(frozen=True, slots=True)
class Migration:
    """One file: the version it takes a database to, its name, its statements."""

    version: int
    name: str
    sql: str


class Database(Protocol):
    """A connection to a store's database, as the runner uses it."""

    def transaction(self) -> AbstractAsyncContextManager[None]:
        """A transaction holding the lock that keeps two brokers from migrating at once: it
        commits when the block ends, and rolls back if the block raises."""
        ...

    async def version(self) -> int | None:
        """The version the database records; None for an empty database. ValueError if it holds
        what is not a wq schema."""
        ...

    async def run(self, sql: str) -> None:
        """Run a file's statements (inside the transaction)."""
        ...

    async def record(self, version: int) -> None:
        """Record the version the database is now at."""
        ...


class Migrations:
    """The migrations of one store: the files of ``folder`` in ``package``, read at start-up."""

    def __init__(self, package: str, folder: str) -> None:
        self.files = _read(package, folder)
        self.latest = self.files[-1].version

    def pending(self, found: int | None) -> tuple[Migration, ...]:
        """The files to run, in order, on a database at version ``found`` (None: empty).
        ValueError for a version no file makes (a database newer than the last file)."""
        if found is not None and not 1 <= found <= self.latest:
            raise ValueError(
                f"schema version {found} is not one this broker knows (it knows up to "
                f"{self.latest}): was it written by a newer wq?"
            )
        return tuple(m for m in self.files if found is None or m.version > found)

    @asynccontextmanager
    async def migrate(self, db: Database, where: str) -> AsyncIterator[int | None]:
        """Bring ``db`` to the latest version, in one locked transaction; the block runs inside
        it, after the version is recorded, and is told the version found (None: it was empty).
        ``where`` names the database in the log."""
        async with db.transaction():
            found = await db.version()
            todo = self.pending(found)
            for migration in todo:
                await db.run(migration.sql)
            if todo:
                await db.record(self.latest)
                if found is None:
                    log.info("%s: created the wq schema (version %d)", where, self.latest)
                else:
                    log.info(
                        "%s: upgraded the wq schema from version %d to %d",
                        where,
                        found,
                        self.latest,
                    )
            yield found


def _read(package: str, folder: str) -> tuple[Migration, ...]:
    """The numbered files of a folder, checked: 001, 002, ... with none missing or twice."""
    found: list[Migration] = []
    for entry in resources.files(package).joinpath(folder).iterdir():
        match = _NAME.fullmatch(entry.name)
        if match is not None:
            found.append(Migration(int(match[1]), entry.name, entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    numbers = [m.version for m in found]
    if numbers != list(range(1, len(found) + 1)):
        raise RuntimeError(f"the migrations in {package}/{folder} are not numbered 1..n: {numbers}")
    return tuple(found)
