"""The worker runner, and ``wq-worker`` (``python -m wqclient.worker``), the spec's cmd/worker.

Write a handler, ``def handle(task)`` or ``async def handle(task)``, and a :class:`Worker` runs
it with the concurrency you ask for: a handler that returns acks the task, one that raises nacks it
with the exception's text. Over a transport that can stream (gRPC) it consumes one stream whose
prefetch is the concurrency; otherwise (HTTP) it long-polls, one claim loop per unit of
concurrency. Synchronous handlers run in a thread pool of that size, so they may block.

``stop()`` (or SIGINT/SIGTERM in the CLI) stops claiming, lets the tasks in hand finish and settle,
and returns. A broker that is down or restarting is reported once and retried with backoff. A
broker that refuses the worker's token (401/403, UNAUTHENTICATED/PERMISSION_DENIED) will not change
its mind by being asked again: that is logged once, the worker stops as on ``stop()``, and
``run()`` raises the error.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from wqclient.client import ENV_CA_FILE, ENV_TOKEN, AsyncClient
from wqclient.errors import (
    LeaseLost,
    NotFound,
    Overloaded,
    PermissionDenied,
    StreamEnded,
    Unauthenticated,
    Unavailable,
    WqError,
)
from wqclient.flags import FlagParser, bool_flag, positive_int
from wqclient.limits import DEFAULT_LEASE_MS, DEFAULT_URL, DEFAULT_WAIT_MS
from wqclient.models import Delivery, Task
from wqclient.transport import AsyncStream

log = logging.getLogger("wqclient.worker")

Handler = Callable[[Task], Any]

_BACKOFF_START = 0.1
_BACKOFF_MAX = 5.0
# How long stop() lets open claims come back before cancelling the ones still parked.
_STOP_GRACE = 0.25
# The broker refused the token: retrying cannot help.
_REFUSED = (Unauthenticated, PermissionDenied)


class TaskFailed(Exception):
    """Raise from a handler to fail a task with a message (any exception does the same)."""


def describe(error: BaseException) -> str:
    text = str(error)
    if isinstance(error, TaskFailed) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Worker:
    """Runs ``handler`` on tasks from a broker until ``stop()``.

    ``broker``: a URL (the worker then makes and closes its own client, which takes its token
    and CA file from ``$WQ_TOKEN`` and ``$WQ_CA_FILE``) or an :class:`AsyncClient` (yours to
    close; ``AsyncClient(url, token=...)`` to give it a token, ``AsyncClient(transport=...)`` to
    run on a transport of your own). At most ``concurrency`` tasks are in hand at once; each claim
    long-polls up to ``wait_ms`` and holds its task for ``lease_ms``.

    ``run()`` raises :class:`~wqclient.Unauthenticated` or :class:`~wqclient.PermissionDenied`
    if the broker refuses the token (after letting the tasks in hand finish).
    """

    def __init__(
        self,
        broker: str | AsyncClient,
        handler: Handler,
        *,
        concurrency: int = 3,
        wait_ms: int = DEFAULT_WAIT_MS,
        lease_ms: int = DEFAULT_LEASE_MS,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._client = broker if isinstance(broker, AsyncClient) else AsyncClient(broker)
        self._own_client = not isinstance(broker, AsyncClient)
        self._handler = handler
        self._is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004
        )
        self.concurrency = concurrency
        self.wait_ms = wait_ms
        self.lease_ms = lease_ms
        self._executor: ThreadPoolExecutor | None = None
        self._stopping = asyncio.Event()
        self._claims: set[asyncio.Task[Delivery | None]] = set()
        self._down_since: float | None = None
        self._refusal: WqError | None = None
        self.succeeded = 0
        self.failed = 0

    @property
    def client(self) -> AsyncClient:
        return self._client

    def stop(self) -> None:
        """Stop claiming; tasks in hand finish and are settled. Safe to call more than once.

        A claim already on its way back is let finish (its task is then worked on, as one in
        hand): only claims still parked after a short grace are cancelled. Cancelling a claim at
        the very moment the broker hands it a task would leave that task to its lease."""
        if not self._stopping.is_set():
            log.info("stopping: finishing the tasks in hand")
            self._halt()

    def _halt(self) -> None:
        if not self._stopping.is_set():
            self._stopping.set()
            if self._claims:
                asyncio.get_running_loop().call_later(_STOP_GRACE, self._cancel_claims)

    def _refused(self, error: WqError) -> None:
        """The broker refused the token: say so once and stop (run() then raises ``error``)."""
        if self._refusal is None:
            self._refusal = error
            log.error(
                "the broker refused this worker's token (%s: %s); stopping",
                type(error).__name__,
                error.message,
            )
            self._halt()

    def _cancel_claims(self) -> None:
        for claim in list(self._claims):
            claim.cancel()

    async def run(self) -> None:
        if not self._is_async:
            self._executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix="wq-handler")
        try:
            if self._client.can_stream:
                await self._run_stream()
            else:
                await asyncio.gather(*(self._poll_loop() for _ in range(self.concurrency)))
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self._own_client:
                await self._client.close()
        if self._refusal is not None:
            raise self._refusal

    # -- broker up / down ------------------------------------------------------------------------

    async def _broker_down(self, error: WqError, attempt: int) -> None:
        """The broker is down, or busy (at a limit): say so once, wait, try again."""
        if self._down_since is None:
            self._down_since = time.monotonic()
            what = "broker busy" if isinstance(error, Overloaded) else "broker unavailable"
            log.warning("%s (%s); retrying with backoff", what, error.message)
        delay = min(_BACKOFF_MAX, _BACKOFF_START * 2**attempt)
        if isinstance(error, Overloaded):
            delay = max(delay, error.retry_after)
        try:
            await asyncio.wait_for(self._stopping.wait(), delay)
        except TimeoutError:
            pass

    def _broker_up(self) -> None:
        if self._down_since is not None:
            log.info("broker reachable again after %.1fs", time.monotonic() - self._down_since)
            self._down_since = None

    # -- HTTP / unary: claim loops ----------------------------------------------------------------

    async def _poll_loop(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            claim = asyncio.ensure_future(
                self._client.claim(wait_ms=self.wait_ms, lease_ms=self.lease_ms)
            )
            self._claims.add(claim)
            try:
                delivery = await claim
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # we are being cancelled ourselves
                return  # stop() cancelled the idle claim
            except Unavailable as e:
                await self._broker_down(e, failures)
                failures += 1
                continue
            except _REFUSED as e:
                self._refused(e)
                return
            finally:
                self._claims.discard(claim)
            failures = 0
            self._broker_up()
            if delivery is not None:
                await self._process(delivery, self._ack, self._nack)

    async def _ack(self, delivery: Delivery) -> None:
        await self._client.ack(delivery)

    async def _nack(self, delivery: Delivery, error: str | None) -> None:
        await self._client.nack(delivery, error=error)

    # -- gRPC: one stream --------------------------------------------------------------------------

    async def _run_stream(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                stream = await self._client.stream(
                    prefetch=self.concurrency, lease_ms=self.lease_ms
                )
            except Unavailable as e:
                await self._broker_down(e, failures)
                failures += 1
                continue
            except _REFUSED as e:
                self._refused(e)
                return
            self._broker_up()
            failures = 0
            error = await self._consume(stream)
            if isinstance(error, _REFUSED):
                self._refused(error)
            if self._stopping.is_set():
                return
            # The stream broke, or the broker ended it (it is shutting down): reconnect.
            await self._broker_down(error or StreamEnded("the broker ended the stream"), failures)
            failures += 1

    async def _consume(self, stream: AsyncStream) -> WqError | None:
        """Run one stream until stop() (returns None) or until it breaks (returns the error)."""
        in_flight: set[asyncio.Task[None]] = set()

        async def nack(delivery: Delivery, error: str | None = None) -> None:
            await stream.nack(delivery, error)

        async def receive() -> WqError | None:
            async for delivery in stream:
                task = asyncio.ensure_future(self._process(delivery, stream.ack, nack))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            return None

        receiver = asyncio.ensure_future(receive())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({receiver, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if receiver.done():
                error = receiver.exception()
                if in_flight:
                    await asyncio.gather(*in_flight, return_exceptions=True)
                if isinstance(error, WqError):
                    return error
                if error is not None:
                    raise error
                return None  # the broker ended the stream (it is shutting down)
            # stop(): no new tasks; finish and settle the ones in hand, then end the stream.
            await stream.drain()
            while in_flight:
                await asyncio.gather(*list(in_flight), return_exceptions=True)
            return None
        finally:
            stopping.cancel()
            receiver.cancel()
            await stream.close()

    # -- one task --------------------------------------------------------------------------------

    async def _process(
        self,
        delivery: Delivery,
        ack: Callable[[Delivery], Awaitable[None]],
        nack: Callable[[Delivery, str | None], Awaitable[None]],
    ) -> None:
        task = delivery.task
        try:
            if self._is_async:
                await self._handler(task)
            else:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._executor, self._handler, task)
        except Exception as e:
            self.failed += 1
            message = describe(e)
            log.warning(
                "task %s failed (attempt %d of %d): %s",
                task.id,
                task.attempts,
                task.max_attempts,
                message,
            )
            await self._settle(delivery, lambda: nack(delivery, message))
        else:
            self.succeeded += 1
            await self._settle(delivery, lambda: ack(delivery))

    async def _settle(self, delivery: Delivery, call: Callable[[], Awaitable[None]]) -> None:
        """Ack or nack, retrying while the broker is unreachable and the lease still holds."""
        attempt = 0
        while True:
            try:
                await call()
                return
            except StreamEnded:
                log.warning(
                    "task %s: the stream ended before its outcome was sent; the broker has "
                    "taken it back and will retry it",
                    delivery.task.id,
                )
                return
            except (LeaseLost, NotFound) as e:
                log.warning(
                    "task %s: lease no longer valid (%s); it may run again elsewhere",
                    delivery.task.id,
                    e.message,
                )
                return
            except _REFUSED as e:
                self._refused(e)
                return
            except Unavailable as e:
                if datetime.now(UTC) >= delivery.deadline:
                    log.warning(
                        "task %s: could not report to the broker before the lease ran out (%s)",
                        delivery.task.id,
                        e.message,
                    )
                    return
                await asyncio.sleep(min(_BACKOFF_MAX, _BACKOFF_START * 2**attempt))
                attempt += 1


# -- wq-worker ------------------------------------------------------------------------------------


def add_auth_flags(p: argparse.ArgumentParser) -> None:
    """``-token`` and ``-ca-file``, for wq-worker and wq-producer."""
    p.add_argument(
        "-token",
        "--token",
        metavar="TOKEN",
        help=f"bearer token for a broker that wants one (default ${ENV_TOKEN}; prefer it: "
        "a command line is visible to other users)",
    )
    p.add_argument(
        "-ca-file",
        "--ca-file",
        metavar="PATH",
        help="PEM CA certificate(s) to verify an https:// or grpcs:// broker with "
        f"(default ${ENV_CA_FILE}, else the system's store)",
    )


class LogFileHandler:
    """The spec's worker: append each task to a file as one JSON line; fail on ``"fail": true``.

    Each line goes out in one ``write()`` on a file opened with O_APPEND, from the event loop's
    thread, so lines never interleave or tear, whatever the concurrency, and several worker
    processes may share one file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    async def __call__(self, task: Task) -> None:
        payload = task.payload
        if isinstance(payload, dict) and payload.get("fail") is True:
            raise TaskFailed("the payload asked to fail")
        line = json.dumps(
            {
                "id": task.id,
                "attempts": task.attempts,
                "payload": payload,
                "done_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            },
            separators=(",", ":"),
            ensure_ascii=False,
        )
        data = (line + "\n").encode()
        while data:
            written = os.write(self._fd, data)
            data = data[written:]

    def close(self) -> None:
        os.close(self._fd)


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(
        prog="wq-worker",
        description="Claim tasks from a wq broker and append each to a log file as a JSON line. "
        'A payload containing "fail": true fails on purpose (a nack with an error).',
    )
    p.add_argument(
        "-broker",
        "--broker",
        default=DEFAULT_URL,
        help="broker URL: http://host:port, or grpc://host:port to stream; https://, grpcs:// "
        f"for TLS (default {DEFAULT_URL})",
    )
    p.add_argument(
        "-log-file", "--log-file", default="./jobs.log", help="file to append to (./jobs.log)"
    )
    p.add_argument(
        "-concurrency",
        "--concurrency",
        type=positive_int,
        default=3,
        help="how many tasks to work on at once (default 3)",
    )
    p.add_argument(
        "-wait-ms",
        "--wait-ms",
        type=positive_int,
        default=DEFAULT_WAIT_MS,
        help=f"how long each long-poll waits for a task (default {DEFAULT_WAIT_MS})",
    )
    p.add_argument(
        "-lease-ms",
        "--lease-ms",
        type=positive_int,
        default=DEFAULT_LEASE_MS,
        help=f"how long to claim each task for (default {DEFAULT_LEASE_MS})",
    )
    add_auth_flags(p)
    p.add_argument(
        "-quiet",
        "--quiet",
        type=bool_flag,
        nargs="?",
        const=True,
        default=False,
        help="log only warnings and errors",
    )
    return p


async def _main(args: argparse.Namespace) -> int:
    try:
        handler = LogFileHandler(args.log_file)
    except OSError as e:
        print(f"wq-worker: cannot open {args.log_file}: {e.strerror}", file=sys.stderr)
        return 1
    try:
        client = AsyncClient(args.broker, token=args.token, ca_file=args.ca_file)
    except WqError as e:
        handler.close()
        print(f"wq-worker: {e.message}", file=sys.stderr)
        return 2
    worker = Worker(
        client,
        handler,
        concurrency=args.concurrency,
        wait_ms=args.wait_ms,
        lease_ms=args.lease_ms,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.stop)
    mode = "streaming" if client.can_stream else "long-polling"
    log.info("%d workers %s %s, logging to %s", args.concurrency, mode, args.broker, args.log_file)
    try:
        await worker.run()
    except _REFUSED:
        return 1  # the worker has said why
    finally:
        await client.close()
        handler.close()
    log.info("stopped: %d succeeded, %d failed", worker.succeeded, worker.failed)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s wq-worker %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
