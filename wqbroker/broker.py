"""Assembling a broker: config (``config.py``) -> store -> service -> servers, and taking it down
again."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from typing import Any

import grpc
from aiohttp import web

from wqbroker.auth import TokenFileError, Tokens
from wqbroker.clock import Clock, SystemClock
from wqbroker.config import Config, disabled, parse_addr
from wqbroker.errors import StoreError
from wqbroker.grpc.auth import AuthInterceptor
from wqbroker.grpc.metrics import MetricsInterceptor
from wqbroker.grpc.protected import LocalOnlyInterceptor
from wqbroker.grpc.server import create_server, set_serving, watch_readiness
from wqbroker.http import (
    create_app,
    make_runner,
)
from wqbroker.metrics import Metrics
from wqbroker.retry import Backoff
from wqbroker.schedulefile import ScheduleFileError, put_all, read_schedules
from wqbroker.service import ScheduleSubmission, Service
from wqbroker.store import Store
from wqbroker.store.memory import MemoryStore
from wqbroker.store.postgres import PostgresStore
from wqbroker.store.sqlite import SqliteStore
from wqbroker.tls import ServerTLS, TLSError, load_server_tls

log = logging.getLogger("wqbroker")

# How often gRPC health's readiness (``wq.v1.Broker``) is brought up to date for its watchers
# (from what the store's probe last found: no I/O).
READINESS_EVERY = 0.25


class StartupError(Exception):
    """The broker cannot start (address taken, bad store...). The message is one line for users."""


def format_addr(sockname: tuple[object, ...] | str) -> str:
    if isinstance(sockname, str):
        return sockname
    host, port = str(sockname[0]), sockname[1]
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


async def open_store(
    config: Config, backoff: Backoff, rng: random.Random, clock: Clock | None = None
) -> Store:
    """The store ``config.store`` names: ``memory``, ``sqlite:PATH`` or a PostgreSQL URL
    (``postgres://USER@HOST:PORT/DB``, or ``postgresql://``). On PostgreSQL, times are the
    database's (``clock`` is the broker's, to compare)."""
    spec = config.store.strip()
    if spec == "memory":
        return MemoryStore(backoff, rng)
    if spec.startswith("sqlite:") and spec[len("sqlite:") :]:
        try:
            return await SqliteStore.open(
                spec[len("sqlite:") :], backoff, rng, sync=config.sqlite_sync
            )
        except (StoreError, ValueError) as e:
            raise StartupError(str(e)) from None
    if spec.startswith(("postgres://", "postgresql://")):
        try:
            return await PostgresStore.open(
                spec, backoff, rng, db_clock=True, clock=clock, deadline=config.db_timeout
            )
        except (StoreError, ValueError) as e:
            raise StartupError(str(e)) from None
    raise StartupError(
        f"unknown store {config.store!r}: use memory, sqlite:PATH or postgres://USER@HOST:PORT/DB"
    )


class Broker:
    """One broker: a store, the service over it and the HTTP server, on the running event loop."""

    def __init__(
        self,
        config: Config,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        store: Store | None = None,
    ) -> None:
        self.config = config
        self.clock = clock if clock is not None else SystemClock()
        self._rng = rng if rng is not None else random.Random()
        self._store = store
        self._service: Service | None = None
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health: Any = None
        self._readiness: asyncio.Task[None] | None = None  # keeps gRPC health's readiness
        self.tokens: Tokens | None = None  # the token file's tokens (reload() on SIGHUP)
        self.metrics = Metrics(self.clock)  # this broker's registry (GET /metrics)
        self._tls: ServerTLS | None = None
        self.http_addresses: list[str] = []
        self.grpc_addresses: list[str] = []

    @property
    def store(self) -> Store:
        if self._store is None:
            raise RuntimeError("the broker is not started")
        return self._store

    @property
    def service(self) -> Service:
        if self._service is None:
            raise RuntimeError("the broker is not started")
        return self._service

    @property
    def local_only(self) -> bool:
        """Protected mode (``wqbroker.protected``): no token file and no -public, so only
        loopback clients are served."""
        return self.tokens is None and not self.config.public

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP API (for clients on this machine)."""
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://" + _local(self.http_addresses[0])

    @property
    def grpc_target(self) -> str:
        """host:port of the gRPC API (for clients on this machine)."""
        return _local(self.grpc_addresses[0])

    async def start(self) -> None:
        config = self.config
        if disabled(config.addr) and disabled(config.grpc_addr):
            raise StartupError("both the HTTP and the gRPC server are switched off")
        try:
            http_at = None if disabled(config.addr) else parse_addr(config.addr or "")
            grpc_at = None if disabled(config.grpc_addr) else parse_addr(config.grpc_addr or "")
        except ValueError as e:
            raise StartupError(str(e)) from None
        try:
            self._tls = load_server_tls(config.tls_cert, config.tls_key)
            if config.token_file:
                self.tokens = Tokens.load(config.token_file)
        except (TLSError, TokenFileError) as e:
            raise StartupError(str(e)) from None
        schedules = _schedule_file(config)
        if self._store is None:
            backoff = Backoff(config.backoff_base, config.backoff_cap, self._rng)
            self._store = await open_store(config, backoff, self._rng, self.clock)
        self._service = Service(
            self._store,
            self.clock,
            sweep_interval=config.sweep_interval,
            poll_interval=config.poll_interval,
            max_payload=config.max_body,
            max_tasks=config.max_tasks,
            max_queues=config.max_queues,
            max_schedules=config.max_schedules,
            max_waiters=config.max_waiters,
            dedup_window=config.dedup_window,
            result_ttl=config.result_ttl,
            events=self.metrics,
        )
        self.metrics.watch(self._service)
        if schedules:
            await self._put_schedules(schedules)
        await self._service.start()
        try:
            if http_at is not None:
                await self._start_http(*http_at)
            if grpc_at is not None:
                await self._start_grpc(*grpc_at)
        except BaseException:
            await self.stop()
            raise
        self._log_access()

    def _log_access(self) -> None:
        """Who may call: said at start-up, loudly when it is anyone at all."""
        if self.tokens is not None:
            return  # (__main__ says how many tokens)
        if self.config.public:
            log.warning(
                "-public and no -token-file: serving clients from every address without "
                "authentication; anyone who can reach the ports can enqueue, claim, purge, "
                "requeue and pause. Give the broker -token-file to require tokens"
            )
        else:
            log.info(
                "no -token-file: serving only loopback clients (127.0.0.0/8, ::1); others are "
                "refused (give -token-file, or -public to serve anyone without authentication)"
            )

    async def _put_schedules(self, schedules: list[tuple[str, ScheduleSubmission]]) -> None:
        """The schedules of -schedule-file put (docs/design/schedules.md); a bad one stops the
        broker, naming it and its member."""
        try:
            await put_all(self.service, self.config.schedule_file or "", schedules)
        except ScheduleFileError as e:
            await self.stop()
            raise StartupError(str(e)) from None

    async def _start_http(self, host: str | None, port: int) -> None:
        config = self.config
        app = create_app(
            self.service,
            max_body=config.max_body,
            read_body_timeout=config.read_body_timeout,
            tokens=self.tokens,
            metrics=self.metrics,
            metrics_public=config.metrics_public,
        )
        runner = make_runner(
            app,
            access_log=config.access_log,
            read_header_timeout=config.read_header_timeout,
            idle_timeout=config.idle_timeout,
            fast_lane=config.http_fast_lane,
            local_only=self.local_only,
        )
        await runner.setup()
        self._runner = runner
        try:
            ssl_context = self._tls.ssl_context if self._tls is not None else None
            await web.TCPSite(
                runner, host, port, reuse_address=True, ssl_context=ssl_context
            ).start()
        except OSError as e:
            reason = os.strerror(e.errno).lower() if e.errno else str(e)
            raise StartupError(f"cannot listen on {self.config.addr}: {reason}") from None
        self.http_addresses = [format_addr(a) for a in runner.addresses]

    async def _start_grpc(self, host: str | None, port: int) -> None:
        interceptors: list[grpc.aio.ServerInterceptor[Any, Any]] = [
            MetricsInterceptor(self.metrics)
        ]
        if self.tokens is not None:
            interceptors.append(AuthInterceptor(self.tokens))  # (inside: refusals are counted)
        elif self.local_only:
            interceptors.append(LocalOnlyInterceptor())  # (as is this one's)
        server, self._health = create_server(self.service, interceptors)
        self._grpc = server
        bind_host = "[::]" if host is None else (f"[{host}]" if ":" in host else host)
        try:
            if self._tls is not None:
                bound = server.add_secure_port(f"{bind_host}:{port}", self._tls.grpc_credentials)
            else:
                bound = server.add_insecure_port(f"{bind_host}:{port}")
        except RuntimeError:
            bound = 0
        if not bound:
            raise StartupError(
                f"cannot listen on {self.config.grpc_addr} (gRPC): address already in use "
                "or not available"
            )
        await server.start()
        await set_serving(self._health, True)
        self._readiness = asyncio.get_running_loop().create_task(
            watch_readiness(self._health, self.service, READINESS_EVERY)
        )
        self.grpc_addresses = [f"{bind_host}:{bound}"]

    async def stop(self) -> None:
        """Answer open long-polls, end streams, stop serving, close the store."""
        if self._readiness is not None:
            self._readiness.cancel()
        if self._health is not None:
            await set_serving(self._health, False)
        if self._service is not None:
            await self._service.close()
        server, self._grpc = self._grpc, None
        if server is not None:
            await server.stop(grace=2.0)
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        if self._store is not None:
            await self._store.close()


def _schedule_file(config: Config) -> list[tuple[str, ScheduleSubmission]]:
    """The schedules of -schedule-file (none without one), read before anything is opened."""
    if not config.schedule_file:
        return []
    try:
        return read_schedules(config.schedule_file)
    except ScheduleFileError as e:
        raise StartupError(str(e)) from None


def _local(hostport: str) -> str:
    """A listening address as clients on this machine reach it."""
    host, _, port = hostport.rpartition(":")
    if host in ("0.0.0.0", "[::]", ""):
        host = "127.0.0.1"
    return f"{host}:{port}"
