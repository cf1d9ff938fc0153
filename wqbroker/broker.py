"""Assembling a broker: config -> store -> service -> servers, and taking it down again."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass

from aiohttp import web

from wqbroker.clock import Clock, SystemClock
from wqbroker.http import DEFAULT_MAX_BODY, create_app, make_runner
from wqbroker.retry import DEFAULT_BASE, DEFAULT_CAP, Backoff
from wqbroker.service import DEFAULT_SWEEP_INTERVAL, Service
from wqbroker.store import Store
from wqbroker.store.memory import MemoryStore

log = logging.getLogger("wqbroker")


class StartupError(Exception):
    """The broker cannot start (address taken, bad store...). The message is one line for users."""


def parse_addr(addr: str) -> tuple[str | None, int]:
    """``host:port``, ``:port`` (every interface), ``[v6]:port`` or a bare port."""
    text = addr.strip()
    host: str | None
    if text.isdigit():
        host, port_text = None, text
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"address {addr!r} has no port; use host:port or :port")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        host = host or None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"address {addr!r} has an invalid port")
    return host, int(port_text)


def format_addr(sockname: tuple[object, ...] | str) -> str:
    if isinstance(sockname, str):
        return sockname
    host, port = str(sockname[0]), sockname[1]
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


@dataclass
class Config:
    addr: str = ":8080"
    sweep_interval: float = DEFAULT_SWEEP_INTERVAL
    backoff_base: float = DEFAULT_BASE
    backoff_cap: float = DEFAULT_CAP
    max_body: int = DEFAULT_MAX_BODY
    access_log: bool = False


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
        rng = rng if rng is not None else random.Random()
        backoff = Backoff(config.backoff_base, config.backoff_cap, rng)
        self.store: Store = store if store is not None else MemoryStore(backoff, rng)
        self.service = Service(self.store, self.clock, sweep_interval=config.sweep_interval)
        self._runner: web.AppRunner | None = None
        self.http_addresses: list[str] = []

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP API (for clients on this machine)."""
        hostport = self.http_addresses[0]
        host, _, port = hostport.rpartition(":")
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{port}"

    async def start(self) -> None:
        try:
            host, port = parse_addr(self.config.addr)
        except ValueError as e:
            raise StartupError(str(e)) from None
        await self.service.start()
        app = create_app(self.service, max_body=self.config.max_body)
        runner = make_runner(app, access_log=self.config.access_log)
        await runner.setup()
        self._runner = runner
        try:
            await web.TCPSite(runner, host, port, reuse_address=True).start()
        except OSError as e:
            await self.stop()
            reason = os.strerror(e.errno).lower() if e.errno else str(e)
            raise StartupError(f"cannot listen on {self.config.addr}: {reason}") from None
        self.http_addresses = [format_addr(a) for a in runner.addresses]

    async def stop(self) -> None:
        """Answer open long-polls, stop serving, close the store."""
        await self.service.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        await self.store.close()
