"""A PostgreSQL primary and a streaming standby of its own, for the failover tests.

Two clusters made for the test (``initdb``; the standby by ``pg_basebackup -R``), each on a free
port on 127.0.0.1 and its own Unix socket directory, under one temporary directory: never the
machine's own server. The binaries are ``$WQ_PG_BIN`` (by default PostgreSQL 15's, else whatever
``pg_config --bindir`` says); without them the tests skip (fail when ``$CI`` is set). PostgreSQL
refuses to run as root: as root, every binary runs as the ``postgres`` OS user (``runuser``), who
owns the directory.

Replication is synchronous (``synchronous_standby_names = '*'``, ``synchronous_commit = on``: a
commit returns once the standby has it) or asynchronous. The clusters run with ``fsync = off``:
fast, and it changes nothing the tests rely on -- no test crashes the machine, only the server
processes (``pg_ctl stop -m immediate``), and what a server wrote is in the operating system's
cache for the next one to read; what synchronous replication promises (the standby acknowledged
the commit's WAL before the commit returned) is untouched, the standby's own fsync aside.

Everything is stopped (``-m immediate``) and removed when the pair closes, however the test ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import asyncpg
import pytest

from tests.pg import Proxy
from tests.procs import free_port


def _bin_dir() -> Path | None:
    given = os.environ.get("WQ_PG_BIN")
    candidates = [Path(given)] if given else [Path("/usr/lib/postgresql/15/bin")]
    if not given:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            out = subprocess.run(
                ["pg_config", "--bindir"], capture_output=True, text=True, check=True
            )
            candidates.append(Path(out.stdout.strip()))
    for d in candidates:
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            return d
    return None


def unavailable(reason: str) -> None:
    message = f"cannot make PostgreSQL clusters for the failover tests: {reason}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set: these tests must run)", pytrace=False)
    pytest.skip(message)


class Server:
    """One cluster of the pair: its data directory, port and socket directory."""

    def __init__(self, pair: Replicas, name: str) -> None:
        self.pair = pair
        self.name = name
        self.data = pair.root / name
        self.sockets = pair.root / f"{name}.sock"
        self.port = free_port()
        self.log = pair.root / f"{name}.log"

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    async def start(self) -> None:
        await self.pair.run("pg_ctl", "start", "-w", "-t", "30", "-D", self.data, "-l", self.log)

    async def stop(self, mode: str = "immediate") -> None:
        """Stop the server (``immediate``: as if its processes were killed, no shutdown
        checkpoint, nothing more sent to the standby)."""
        await self.pair.run(
            "pg_ctl", "stop", "-w", "-t", "30", "-m", mode, "-D", self.data, check=False
        )

    async def promote(self) -> None:
        await self.pair.run("pg_ctl", "promote", "-w", "-t", "30", "-D", self.data)

    def configure(self, settings: dict[str, str], *, auto: bool = False) -> None:
        """Append ``settings`` to the cluster's postgresql.conf (read at its next start), or to
        its postgresql.auto.conf (which wins over it: where pg_basebackup -R writes)."""
        lines = "".join(f"{k} = '{v}'\n" for k, v in settings.items())
        name = "postgresql.auto.conf" if auto else "postgresql.conf"
        with (self.data / name).open("a") as f:
            f.write(lines)

    async def follow(self, primary: Server) -> None:
        """Make this (stopped) cluster a standby of ``primary`` at its next start."""
        (self.data / "standby.signal").touch()
        self.configure({"primary_conninfo": f"host=127.0.0.1 port={primary.port} user=postgres"})
        await self.pair.own(self.data)


class Replicas:
    """A primary and its streaming standby (see the module's docstring). Use as a context
    manager, or call :meth:`close`."""

    def __init__(self, *, synchronous: bool, relay: bool = False) -> None:
        bindir = _bin_dir()
        if bindir is None:
            unavailable("no initdb/pg_ctl (set $WQ_PG_BIN)")
        assert bindir is not None
        self.bin = bindir
        self.synchronous = synchronous
        self.as_root = os.geteuid() == 0
        if self.as_root and shutil.which("runuser") is None:
            unavailable("running as root without runuser")
        self.root = Path(tempfile.mkdtemp(prefix="wq-replicas-"))
        self.root.chmod(0o755)
        self.primary = Server(self, "primary")
        self.standby = Server(self, "standby")
        self._started: list[Server] = []
        # With ``relay``, the standby streams through a TCP proxy in the test's event loop, which
        # the test can stall (the standby falls behind) and cut.
        self.relay: Proxy | None = Proxy(self.primary.port) if relay else None

    # -- running the binaries --------------------------------------------------------------------

    async def own(self, path: Path) -> None:
        if self.as_root:
            await _run(["chown", "-R", "postgres:postgres", str(path)])

    async def run(self, program: str, *args: object, check: bool = True) -> None:
        """Run one of the binaries (as the postgres user, when root), without blocking the event
        loop (brokers of the test may run in it)."""
        command = [str(self.bin / program), *map(str, args)]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        await _run(command, check=check)

    # -- the pair --------------------------------------------------------------------------------

    async def start(self) -> Replicas:
        """Make and start the primary, then the standby from its base backup; return once the
        standby streams (and, when synchronous, is the synchronous one)."""
        p, s = self.primary, self.standby
        await self.own(self.root)
        await self.run(
            "initdb", "-D", p.data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"
        )
        for server in (p, s):
            server.sockets.mkdir()
            await self.own(server.sockets)
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(p.port),
            "unix_socket_directories": str(p.sockets),
            "fsync": "off",
            "full_page_writes": "off",
            "wal_level": "replica",
            "max_wal_senders": "5",
            "wal_keep_size": "256MB",
            "hot_standby": "on",
            "max_connections": "60",
            "shared_buffers": "32MB",
            "synchronous_commit": "on",
            "synchronous_standby_names": "*" if self.synchronous else "",
            "wal_sender_timeout": "5s",
            "wal_receiver_status_interval": "1s",
            "logging_collector": "off",
        }
        p.configure(settings)
        await p.start()
        self._started.append(p)
        await self.run(
            "pg_basebackup",
            "-h", "127.0.0.1", "-p", p.port, "-U", "postgres",
            "-D", s.data, "-R", "-X", "stream", "--no-sync",
        )  # fmt: skip
        # Promoted, the standby is a primary alone: were it to wait for a synchronous standby of
        # its own, every commit would hang (a cluster manager -- Patroni's synchronous_mode --
        # does the same: a lone primary commits without one).
        s.configure(
            {
                "port": str(s.port),
                "unix_socket_directories": str(s.sockets),
                "synchronous_standby_names": "",
            }
        )
        if self.relay is not None:
            await self.relay.restore()
            conninfo = f"host=127.0.0.1 port={self.relay.port} user=postgres"
            s.configure({"primary_conninfo": conninfo}, auto=True)
        await s.start()
        self._started.append(s)
        await self.wait_streaming()
        return self

    async def wait_streaming(self, timeout: float = 30) -> None:
        """Until the primary has a standby streaming (its synchronous one, when synchronous)."""
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        while True:
            state = await query(
                self.primary.dsn, "SELECT state, sync_state FROM pg_stat_replication"
            )
            if state and state[0] == ("streaming", want):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby does not stream: {state}")
            await asyncio.sleep(0.05)

    def dsn(self, *servers: Server, database: str = "postgres", query: str = "") -> str:
        """A DSN listing ``servers`` in that order (both, primary first, by default)."""
        servers = servers or (self.primary, self.standby)
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in servers)
        return f"postgresql://postgres@{hosts}/{database}" + (f"?{query}" if query else "")

    async def fail_over(self) -> None:
        """What a failover does: the primary stops dead, the standby is promoted (with what it
        received: the relay, if any, is cut, and what it held back is lost)."""
        if self.relay is not None:
            await self.relay.cut()  # (first: a walsender stuck on a stalled relay slows the stop)
        await self.primary.stop("immediate")
        await self.standby.promote()

    async def close(self) -> None:
        if self.relay is not None:
            await self.relay.cut()
        for server in reversed(self._started):
            with contextlib.suppress(Exception):
                await server.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    async def __aenter__(self) -> Replicas:
        try:
            return await self.start()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, *_: object) -> None:
        await self.close()


async def _run(command: list[str], *, check: bool = True) -> None:
    proc = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {out.decode(errors='replace')}")


async def query(dsn: str, sql: str, *args: object) -> list[tuple[object, ...]]:
    """The rows of ``sql`` on ``dsn`` (a connection of its own, that may write whatever the
    server's default_transaction_read_only)."""
    conn = await asyncpg.connect(
        dsn, timeout=5, server_settings={"default_transaction_read_only": "off"}
    )
    try:
        return [tuple(r) for r in await conn.fetch(sql, *args)]
    finally:
        await conn.close()
