"""``python -m wqbroker`` / ``wqbroker``: run a broker until SIGINT or SIGTERM, configured by the
flags (and ``WQ_*`` variables) that ``config.py`` declares."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any, Final

from wqbroker.broker import Broker, StartupError
from wqbroker.config import FLAGS, Config, config_from_args
from wqbroker.store.postgres import redact
from wqwire.flags import FlagParser, setup_logging

log = logging.getLogger("wqbroker")


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
    config = config_from_args(parse_args(argv))
    setup_logging(
        getattr(logging, config.log_level.upper()),
        config.log_format,
        "%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        run(serve(config), config.loop)
    except StartupError as e:
        print(f"wqbroker: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
