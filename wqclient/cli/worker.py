"""``wq-worker`` (``python -m wqclient.cli.worker``): the spec's cmd/worker. It claims tasks with a
:class:`~wqclient.worker.Worker` and appends each to a log file as one JSON line; a payload with
``"fail": true`` fails on purpose. Given a program after ``--`` (``wq-worker [flags] -- ./prog
args``), it runs that program per task instead (:class:`~wqclient._exec.ExecHandler`: the
payload on stdin; exit 0 acks, 100 fails for good, any other retries). SIGINT or SIGTERM stops
it as ``Worker.stop()`` does: the tasks in hand finish and settle, then it exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime

from wqclient._exec import ExecHandler
from wqclient.cli import SettingError, add_auth_flags, add_broker_flag, connection, quiet_grpc
from wqclient.client import AsyncClient
from wqclient.errors import CertificateError, PermissionDenied, Unauthenticated, WqError
from wqclient.limits import DEFAULT_LEASE_MS, DEFAULT_WAIT_MS
from wqclient.models import DEFAULT_QUEUE, Task
from wqclient.worker import AUTO_PREFETCH_MAX, TaskFailed, Worker
from wqwire.flags import (
    LOG_FORMATS,
    FlagParser,
    add_switch,
    positive_int,
    queue_list,
    setup_logging,
)

log = logging.getLogger("wqclient.worker")


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
        'A payload containing "fail": true fails on purpose (a nack with an error). '
        "After --, a program run per task instead (as wq worker runs one: the payload on its "
        "stdin; exit 0 acks, 100 fails for good, anything else retries).",
    )
    p.usage = "wq-worker [flags] [-- PROGRAM ARGS]"
    add_broker_flag(p)
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
        "-prefetch",
        "--prefetch",
        type=positive_int,
        default=None,
        help="how many tasks to hold at once: those worked on and those waiting for a free "
        "slot, their leases kept (default: it follows the handlers, from twice -concurrency "
        f"over gRPC, or -concurrency over HTTP, up to {AUTO_PREFETCH_MAX} while tasks are short "
        "against the broker's round trip; -prefetch equal to -concurrency takes a task only "
        "when a slot is free)",
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
        help="how long to claim each task for at first; while its handler runs, the lease is "
        f"extended by as much each time half of it has gone by (default {DEFAULT_LEASE_MS})",
    )
    p.add_argument(
        "-queue",
        "--queue",
        type=queue_list,
        default=[DEFAULT_QUEUE],
        metavar="NAMES",
        help="the queues to take tasks from, comma-separated, in order of preference: the first "
        f'with a ready task wins (default "{DEFAULT_QUEUE}")',
    )
    add_auth_flags(p)
    p.add_argument(
        "-log-format",
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: a line per record; json: one JSON object per line (level, time, message, "
        "logger and the record's fields: task_id, queue, outcome ...) (default text)",
    )
    add_switch(p, "quiet", "log only warnings and errors")
    return p


async def _main(args: argparse.Namespace, program: list[str] | None = None) -> int:  # noqa: C901
    handler: LogFileHandler | ExecHandler
    if program is not None:  # `wq-worker [flags] -- ./prog args`: the program per task
        try:
            handler = ExecHandler(program)
        except (OSError, ValueError) as e:
            print(f"wq-worker: {e}", file=sys.stderr)
            return 2
        target = f"running {shlex.join(program)}"
    else:
        try:
            handler = LogFileHandler(args.log_file)
        except OSError as e:
            print(f"wq-worker: cannot open {args.log_file}: {e.strerror}", file=sys.stderr)
            return 1
        target = f"logging to {args.log_file}"
    try:
        client = AsyncClient(args.broker, token=args.token, ca_file=args.ca_file)
    except WqError as e:
        if isinstance(handler, LogFileHandler):
            handler.close()
        print(f"wq-worker: {e.message}", file=sys.stderr)
        return 2
    if args.prefetch is not None and args.prefetch < args.concurrency:
        if isinstance(handler, LogFileHandler):
            handler.close()
        print("wq-worker: -prefetch must be at least -concurrency", file=sys.stderr)
        return 2
    worker = Worker(
        client,
        handler,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        wait_ms=args.wait_ms,
        lease_ms=args.lease_ms,
        queues=None if args.queue == [DEFAULT_QUEUE] else args.queue,  # as the spec's worker
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.stop)
    mode = "streaming" if client.can_stream else "long-polling"
    log.info(
        "%d workers %s %s (queues %s), %s",
        args.concurrency,
        mode,
        args.broker,
        ",".join(args.queue),
        target,
    )
    try:
        await worker.run()
    except (Unauthenticated, PermissionDenied, CertificateError):
        return 1  # the worker has said why
    finally:
        await client.close()
        if isinstance(handler, LogFileHandler):
            handler.close()
    log.info(
        "stopped: %d succeeded, %d failed, %d cancelled",
        worker.succeeded,
        worker.failed,
        worker.cancelled,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    program: list[str] | None = None
    if "--" in given:  # a program to run per task, instead of the log file
        i = given.index("--")
        given, program = given[:i], given[i + 1 :]
    parser = build_parser()
    args = parser.parse_args(given)
    if program is not None and not program:
        parser.error("no program after --")
    try:
        conn = connection(args)
    except SettingError as e:
        parser.error(str(e))
    args.broker, args.token, args.ca_file = conn.broker, conn.token, conn.ca_file
    setup_logging(
        logging.WARNING if args.quiet else logging.INFO,
        args.log_format,
        "%(asctime)s wq-worker %(levelname)s %(message)s",
    )
    # The spec's worker logs no line per task (the Worker's, on a logger of its own).
    logging.getLogger("wqclient.worker.tasks").setLevel(logging.WARNING)
    try:
        return asyncio.run(_main(args, program))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    quiet_grpc()
    sys.exit(main())
