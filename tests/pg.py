"""A PostgreSQL database for this test run: created on first use, dropped at the end.

The server is the one at ``$WQ_TEST_POSTGRES`` (a DSN of its maintenance database; by default
``postgres://postgres@127.0.0.1:5432/postgres``). When it cannot be reached, the tests that need it
skip with a one-line reason -- or fail, when ``$CI`` is set (CI must not pass without them).

Also :class:`Proxy`, a TCP proxy to that server which a test can cut and restore.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import urllib.parse
from typing import NoReturn

import asyncpg
import pytest

MAINTENANCE = os.environ.get("WQ_TEST_POSTGRES", "postgres://postgres@127.0.0.1:5432/postgres")

_created: list[str] = []  # the name of the database made for this run, once made
_failed: list[str] = []  # why the server could not be used, once known


def dsn_of(name: str) -> str:
    """The DSN of database ``name`` on the test server."""
    parts = urllib.parse.urlsplit(MAINTENANCE)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


def unavailable(reason: str) -> NoReturn:
    message = f"PostgreSQL unavailable at {MAINTENANCE}: {reason}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set: PostgreSQL tests must run)", pytrace=False)
    pytest.skip(message)


async def maintenance() -> asyncpg.Connection:
    try:
        return await asyncpg.connect(MAINTENANCE, timeout=5)
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
        text = str(e).strip().splitlines()
        _failed.append(text[0] if text else type(e).__name__)
        unavailable(_failed[0])


async def _create(conn: asyncpg.Connection, name: str) -> None:
    """A database whose commits do not wait for the disk (``synchronous_commit = off``): what a
    broker sees is the same (a commit is visible to all once it returns); only a crash of the
    server itself could lose the last commits, and no test crashes it. Under load (the tests in
    parallel, other databases on the server) a wait for each commit's fsync made the tests that
    commit thousands of times take seconds."""
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')


async def database() -> str:
    """The DSN of this run's database (created by the first call)."""
    if _failed:
        unavailable(_failed[0])
    if not _created:
        conn = await maintenance()
        try:
            name = f"wq_test_{secrets.token_hex(4)}"
            await _create(conn, name)
            _created.append(name)
        finally:
            await conn.close()
    return dsn_of(_created[0])


async def create_database(prefix: str) -> str:
    """A further database of this run (dropped at the end with the rest); its DSN."""
    await database()
    conn = await maintenance()
    try:
        name = f"{_created[0]}_{prefix}_{secrets.token_hex(3)}"
        await _create(conn, name)
        _created.append(name)
    finally:
        await conn.close()
    return dsn_of(name)


async def _drop_all() -> None:
    conn = await asyncpg.connect(MAINTENANCE, timeout=5)
    try:
        for name in _created:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


def drop_all() -> None:
    """Drop every database this run created (at the end of the session)."""
    if _created:
        asyncio.run(_drop_all())
        _created.clear()


class Proxy:
    """A TCP proxy to the PostgreSQL server that can be cut (its listening socket and every
    connection closed) and restored on the same port, as a network or a restarting server would;
    or stalled: nothing passes either way, nothing is closed or refused (a silent partition: a
    dead switch, a security group changed), until it flows again."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    def stall(self) -> None:
        """Let nothing through, either way, on any connection (new ones are accepted and left
        hanging), without closing or refusing anything."""
        self._flowing.clear()

    def flow(self) -> None:
        """Let everything held back through, and what follows."""
        self._flowing.set()

    @classmethod
    async def start(cls, dsn: str) -> Proxy:
        proxy = cls(urllib.parse.urlsplit(dsn).port or 5432)
        await proxy.restore()
        return proxy

    def dsn(self, dsn: str) -> str:
        """``dsn``, through the proxy."""
        parts = urllib.parse.urlsplit(dsn)
        user = parts.netloc.rpartition("@")[0]
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{self.port}"))

    async def restore(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.close()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        await self._flowing.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers.add(up_writer)
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
