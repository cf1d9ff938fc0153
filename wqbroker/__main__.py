"""``python -m wqbroker`` / ``wqbroker``: run a broker until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from wqbroker.broker import Broker, Config, StartupError, disabled, parse_addr
from wqbroker.http import DEFAULT_MAX_BODY

log = logging.getLogger("wqbroker")


def _number(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _address(text: str) -> str:
    if disabled(text):
        return "off"
    try:
        parse_addr(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wqbroker",
        description="wq job-queue broker: the HTTP/JSON API of the worker-queue spec, and gRPC.",
        allow_abbrev=False,
    )
    p.add_argument(
        "-addr",
        "--addr",
        default=":8080",
        metavar="ADDR",
        type=_address,
        help="HTTP address to listen on: host:port or :port (default :8080); off to disable",
    )
    p.add_argument(
        "-grpc-addr",
        "--grpc-addr",
        default=":50051",
        metavar="ADDR",
        type=_address,
        help="gRPC address to listen on (default :50051); off to disable",
    )
    p.add_argument(
        "-sweep-interval-ms",
        "--sweep-interval-ms",
        type=_number(1),
        default=250,
        metavar="MS",
        help="how often the sweeper ticks at the latest (default 250)",
    )
    p.add_argument(
        "-backoff-base-ms",
        "--backoff-base-ms",
        type=_number(0),
        default=1000,
        metavar="MS",
        help="first retry delay; doubles with each attempt (default 1000)",
    )
    p.add_argument(
        "-backoff-cap-ms",
        "--backoff-cap-ms",
        type=_number(0),
        default=30000,
        metavar="MS",
        help="longest retry delay (default 30000)",
    )
    p.add_argument(
        "-max-body-bytes",
        "--max-body-bytes",
        type=_number(1),
        default=DEFAULT_MAX_BODY,
        metavar="N",
        help=f"largest request body accepted (default {DEFAULT_MAX_BODY})",
    )
    p.add_argument(
        "-store",
        "--store",
        default="memory",
        metavar="STORE",
        help="memory (the default; lost on restart) or sqlite:PATH (durable)",
    )
    p.add_argument(
        "-sqlite-sync",
        "--sqlite-sync",
        default="full",
        choices=["full", "normal"],
        help="full (default): every answer is on disk; normal: survives kill -9, not power loss",
    )
    p.add_argument(
        "-log-level",
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default info)",
    )
    p.add_argument(
        "-loop",
        "--loop",
        default="uvloop",
        choices=["uvloop", "asyncio"],
        help="event loop implementation (default uvloop)",
    )
    p.add_argument(
        "-access-log", "--access-log", action="store_true", help="log every HTTP request"
    )
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    return Config(
        addr=args.addr,
        grpc_addr=args.grpc_addr,
        sweep_interval=args.sweep_interval_ms / 1000.0,
        backoff_base=args.backoff_base_ms / 1000.0,
        backoff_cap=args.backoff_cap_ms / 1000.0,
        max_body=args.max_body_bytes,
        access_log=args.access_log,
        store=args.store,
        sqlite_sync=args.sqlite_sync,
    )


async def serve(config: Config) -> None:
    broker = Broker(config)
    await broker.start()
    for address in broker.http_addresses:
        log.info("HTTP API listening on http://%s", address)
    for address in broker.grpc_addresses:
        log.info("gRPC API listening on %s", address)
    log.info("store: %s", config.store)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
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
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
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
