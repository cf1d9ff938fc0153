"""``python -m wqbroker`` / ``wqbroker``: run a broker until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any, Final

from wqbroker.broker import Broker, Config, StartupError, disabled, parse_addr
from wqbroker.http import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_BODY,
    DEFAULT_READ_BODY_TIMEOUT,
    DEFAULT_READ_HEADER_TIMEOUT,
)
from wqbroker.limits import (
    DEFAULT_DEDUP_WINDOW_MS,
    DEFAULT_MAX_QUEUES,
    DEFAULT_MAX_TASKS,
    DEFAULT_MAX_WAITERS,
    dedup_window_seconds,
)
from wqbroker.store.postgres import redact
from wqclient.flags import (
    LOG_FORMATS,
    Flag,
    FlagParser,
    non_negative_int,
    positive_int,
    setup_logging,
)

log = logging.getLogger("wqbroker")


def _address(text: str) -> str:
    if disabled(text):
        return "off"
    try:
        parse_addr(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# The broker's flags, one row each; every flag is -name or --name, its value after a space or "=".
# The help text gets " (default X)" from the row's default.
FLAGS: tuple[Flag, ...] = (
    Flag(
        "addr",
        default=":8080",
        parse=_address,
        metavar="ADDR",
        help="HTTP address to listen on: host:port or :port (every interface); off to disable",
    ),
    Flag(
        "grpc-addr",
        default=":50051",
        parse=_address,
        metavar="ADDR",
        help="gRPC address to listen on; off to disable",
    ),
    Flag(
        "sweep-interval-ms",
        default=250,
        parse=positive_int,
        metavar="MS",
        help="how often the sweeper ticks at the latest",
    ),
    Flag(
        "poll-ms",
        default=1000,
        parse=positive_int,
        metavar="MS",
        help="with a store shared by several brokers (PostgreSQL), how often a broker with "
        "waiting consumers looks for ready tasks it was not told about (a lost wake-up costs "
        "at most this)",
    ),
    Flag(
        "backoff-base-ms",
        default=1000,
        parse=non_negative_int,
        metavar="MS",
        help="first retry delay; doubles with each attempt",
    ),
    Flag(
        "backoff-cap-ms",
        default=30000,
        parse=non_negative_int,
        metavar="MS",
        help="longest retry delay",
    ),
    Flag(
        "max-body-bytes",
        default=DEFAULT_MAX_BODY,
        parse=positive_int,
        metavar="N",
        help="largest request body accepted",
    ),
    Flag(
        "read-header-timeout-ms",
        default=round(DEFAULT_READ_HEADER_TIMEOUT * 1000),
        parse=positive_int,
        metavar="MS",
        help="HTTP: time to send a request's line and headers, from its first byte",
    ),
    Flag(
        "read-body-timeout-ms",
        default=round(DEFAULT_READ_BODY_TIMEOUT * 1000),
        parse=positive_int,
        metavar="MS",
        help="HTTP: time to send a request's body",
    ),
    Flag(
        "idle-timeout-ms",
        default=round(DEFAULT_IDLE_TIMEOUT * 1000),
        parse=positive_int,
        metavar="MS",
        help="HTTP: how long an idle keep-alive connection is kept open",
    ),
    Flag(
        "store",
        default="",
        metavar="STORE",
        help="memory (lost on restart), sqlite:PATH (durable) or postgres://USER@HOST:PORT/DB "
        "(durable, shared by brokers); unset: $WQ_STORE, else memory",
    ),
    Flag(
        "sqlite-sync",
        default="full",
        choices=("full", "normal"),
        help="full: every answer is on disk; normal: survives kill -9, not power loss",
    ),
    Flag(
        "log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log verbosity",
    ),
    Flag(
        "loop",
        default="uvloop",
        choices=("uvloop", "asyncio"),
        help="event loop implementation",
    ),
    Flag(
        "log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text: a line per record; json: one JSON object per line (level, time, message, "
        "logger and the record's fields: task_id, queue ...)",
    ),
    Flag("access-log", default=False, help="log every HTTP request (JSON with -log-format json)"),
    Flag(
        "http-fast-lane",
        default=True,
        help="serve the hot HTTP requests (enqueue, claim, ack ...) without aiohttp's "
        "per-request machinery, with the same answers; false: every request through aiohttp",
    ),
    Flag(
        "max-tasks",
        default=DEFAULT_MAX_TASKS,
        parse=non_negative_int,
        metavar="N",
        help="tasks held (ready, delayed, handed out) before enqueues get 429; 0: no limit",
    ),
    Flag(
        "max-waiters",
        default=DEFAULT_MAX_WAITERS,
        parse=non_negative_int,
        metavar="N",
        help="parked long-polls and open streams before more get 429; 0: no limit",
    ),
    Flag(
        "max-queues",
        default=DEFAULT_MAX_QUEUES,
        parse=non_negative_int,
        metavar="N",
        help="named queues kept before an enqueue (or pause) to a new one gets 429; 0: no limit",
    ),
    Flag(
        "dedup-window-ms",
        default=DEFAULT_DEDUP_WINDOW_MS,
        parse=non_negative_int,
        metavar="MS",
        help="how long an idempotency key is remembered: an enqueue with the same key and "
        "queue within it is answered with the first task's id and creates nothing",
    ),
    Flag(
        "token-file",
        default="",
        metavar="PATH",
        help="require bearer tokens: a file of lines TOKEN SCOPE[,SCOPE...] (scopes produce, "
        "consume, admin, metrics), read again on SIGHUP; unset, no token is needed",
    ),
    Flag(
        "metrics-public",
        default=False,
        help="GET /metrics needs no token even with -token-file (else: the metrics scope)",
    ),
    Flag(
        "tls-cert",
        default="",
        metavar="PATH",
        help="serve HTTPS and gRPC over TLS with this PEM certificate chain (with -tls-key)",
    ),
    Flag("tls-key", default="", metavar="PATH", help="the PEM private key of -tls-cert"),
)


def build_parser() -> FlagParser:
    return FlagParser(
        "wqbroker",
        "wq job-queue broker: the HTTP/JSON API of the worker-queue spec, and gRPC.",
        FLAGS,
        env_prefix="WQ_",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags as given (``sys.argv`` by default); a bad one exits 2 with a one-line error."""
    return build_parser().parse_args(argv)


def store_spec(flag: str) -> str:
    """The store to use: the -store flag, else ``$WQ_STORE``, else memory."""
    return flag or os.environ.get("WQ_STORE", "").strip() or "memory"


def config_from_args(args: argparse.Namespace) -> Config:
    return Config(
        addr=args.addr,
        grpc_addr=args.grpc_addr,
        sweep_interval=args.sweep_interval_ms / 1000.0,
        poll_interval=args.poll_ms / 1000.0,
        backoff_base=args.backoff_base_ms / 1000.0,
        backoff_cap=args.backoff_cap_ms / 1000.0,
        max_body=args.max_body_bytes,
        read_header_timeout=args.read_header_timeout_ms / 1000.0,
        read_body_timeout=args.read_body_timeout_ms / 1000.0,
        idle_timeout=args.idle_timeout_ms / 1000.0,
        access_log=args.access_log,
        http_fast_lane=args.http_fast_lane,
        store=store_spec(args.store),
        sqlite_sync=args.sqlite_sync,
        max_tasks=args.max_tasks,
        max_queues=args.max_queues,
        max_waiters=args.max_waiters,
        dedup_window=dedup_window_seconds(args.dedup_window_ms),
        token_file=args.token_file or None,
        metrics_public=args.metrics_public,
        tls_cert=args.tls_cert or None,
        tls_key=args.tls_key or None,
    )


# The collector's first generation runs after this many new container objects (700 by default).
# Almost all of a broker's garbage (requests, messages, answers) is freed as its last reference
# goes; at 700 the collector ran every few requests and took 3-6% of the CPU per task (py-spy,
# `make bench ARGS=users`).
GC_YOUNG_THRESHOLD: Final = 20_000


def _tune_collector() -> None:
    """Run the cyclic collector less often, and never over what start-up made (the modules, the
    store's recovered tasks): ``gc.freeze`` moves those out of its sight."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


async def serve(config: Config) -> None:
    broker = Broker(config)
    await broker.start()
    _tune_collector()
    scheme, tls = ("https", " (TLS)") if config.tls_cert else ("http", "")
    for address in broker.http_addresses:
        log.info("HTTP API listening on %s://%s", scheme, address)
    for address in broker.grpc_addresses:
        log.info("gRPC API listening on %s%s", address, tls)
    log.info("store: %s", redact(config.store))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if broker.tokens is not None:
        log.info("bearer tokens required: %d from %s", len(broker.tokens), config.token_file)
        loop.add_signal_handler(signal.SIGHUP, broker.tokens.reload)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("shutting down")
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal ends it at once
            loop.remove_signal_handler(sig)
    finally:
        await broker.stop()
    log.info("stopped")


def run(main: Coroutine[Any, Any, None], loop: str) -> None:
    """Run on uvloop (a libuv event loop: faster I/O for the HTTP side) unless told otherwise."""
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError:  # pragma: no cover - a dependency; absent only on odd platforms
            log.warning("uvloop is not installed; using the asyncio event loop")
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(
        getattr(logging, args.log_level.upper()),
        args.log_format,
        "%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        run(serve(config_from_args(args)), args.loop)
    except StartupError as e:
        print(f"wqbroker: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
