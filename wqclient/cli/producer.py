"""``wq-producer`` (``python -m wqclient.cli.producer``): the spec's cmd/producer, a test harness
that enqueues numbered tasks, ``{"line": "task 1 of 100", "n": 1}`` (with ``"fail": true`` under
``-fail``), to ``-queue`` at ``-priority``.

``-idempotency-key K`` gives each task a key: ``K`` itself when ``-n`` is 1, else ``K-1`` ...
``K-n`` (task i gets ``K-i``, as it is numbered in its payload). Running the same command again
within the broker's window therefore enqueues nothing new: every task comes back a duplicate,
and the summary counts them (``enqueued 0, duplicates 5, ...``)."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TaskProgressColumn,
    TextColumn,
)
from rich.progress import Progress as RichProgress
from rich.progress import Task as RichTask
from rich.text import Text

from wqclient.cli import SettingError, add_auth_flags, add_broker_flag, connection, quiet_grpc
from wqclient.client import AsyncClient
from wqclient.errors import (
    CertificateError,
    Overloaded,
    PermissionDenied,
    Unauthenticated,
    WqError,
)
from wqclient.models import DEFAULT_QUEUE
from wqwire.flags import FlagParser, add_switch, non_negative_int, positive_int, priority


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(
        prog="wq-producer",
        description="Enqueue test tasks on a wq broker.",
    )
    add_broker_flag(p)
    p.add_argument("-n", "--n", type=positive_int, default=1, help="how many tasks (default 1)")
    add_switch(p, "fail", "enqueue tasks that always fail")
    p.add_argument(
        "-max-attempts",
        "--max-attempts",
        type=positive_int,
        default=3,
        help="attempts before a task is buried (default 3)",
    )
    p.add_argument(
        "-delay-ms",
        "--delay-ms",
        type=non_negative_int,
        default=0,
        help="hold each task back this long before it can be picked up (default 0)",
    )
    p.add_argument(
        "-concurrency",
        "--concurrency",
        type=positive_int,
        default=1,
        help="how many tasks to post at once (default 1)",
    )
    p.add_argument(
        "-queue",
        "--queue",
        default=DEFAULT_QUEUE,
        metavar="NAME",
        help=f'the queue to enqueue to (default "{DEFAULT_QUEUE}")',
    )
    p.add_argument(
        "-priority",
        "--priority",
        type=priority,
        default=0,
        help="the tasks' priority, 0 to 9, higher served first (default 0)",
    )
    p.add_argument(
        "-expires-in-ms",
        "--expires-in-ms",
        type=positive_int,
        default=None,
        metavar="MS",
        help="drop each task (counted expired) if it is not handed out within this long of its "
        "enqueue (default: never)",
    )
    p.add_argument(
        "-timeout-ms",
        "--timeout-ms",
        type=positive_int,
        default=None,
        metavar="MS",
        help="the most one attempt of a task may run: no lease is extended past it, and a "
        "Worker stops its handler there (default: no limit)",
    )
    p.add_argument(
        "-idempotency-key",
        "--idempotency-key",
        default="",
        metavar="KEY",
        help="an idempotency key: KEY for a single task, KEY-1 ... KEY-n for -n tasks; an "
        "enqueue whose key the broker has seen (within its window) creates nothing and counts "
        "as a duplicate",
    )
    add_auth_flags(p)
    return p


def key_for(key: str, i: int, n: int) -> str | None:
    """Task ``i`` of ``n``'s idempotency key: none without ``key``, ``key`` for a single task,
    else ``key-i``."""
    if not key:
        return None
    return key if n == 1 else f"{key}-{i}"


class _Rate(ProgressColumn):
    """Tasks a second: while it runs (rich's estimate), then over the whole run."""

    def render(self, task: RichTask) -> Text:
        speed = task.finished_speed or task.speed
        if speed is None:
            return Text("- tasks/s", style="progress.data.speed")
        return Text(f"{speed:,.0f} tasks/s", style="progress.data.speed")


class _Eta(ProgressColumn):
    """The time left while it runs (``ETA 0:00:04``), the time taken once done."""

    def render(self, task: RichTask) -> Text:
        if task.finished:
            took = task.finished_time or 0.0
            text = f"{took:.1f}s" if took < 60 else str(timedelta(seconds=round(took)))
            return Text(f"in {text}", style="progress.elapsed")
        left = task.time_remaining
        text = "-:--:--" if left is None else str(timedelta(seconds=math.ceil(left)))
        return Text(f"ETA {text}", style="progress.remaining")


class Progress:
    """A progress bar (rich.progress) with the count, the rate and the time left, drawn only
    when ``out`` is a terminal; elsewhere it does nothing."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total = total
        self.out = out
        self.enabled = out.isatty()
        self._bar: RichProgress | None = None
        if self.enabled:
            self._bar = RichProgress(
                TextColumn("enqueueing"),
                BarColumn(),
                MofNCompleteColumn(),
                TaskProgressColumn(),
                _Rate(),
                _Eta(),
                TextColumn("{task.fields[failed]}", style="red"),
                console=Console(file=out, highlight=False),
                refresh_per_second=10,
            )
            self._task = self._bar.add_task("enqueue", total=total, failed="")
            self._bar.start()

    def update(self, done: int, failed: int, force: bool = False) -> None:
        if self._bar is None:
            return
        self._bar.update(
            self._task,
            completed=done,
            failed=f"{failed} failed" if failed else "",
            refresh=force,
        )

    def say(self, line: str) -> None:
        """A line for the user: above the bar while it is drawn, else on ``out``."""
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.out)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def payload_for(i: int, n: int, fail: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {"line": f"task {i} of {n}", "n": i}
    if fail:
        payload["fail"] = True
    return payload


class _Run:
    """One wq-producer run: ``args.n`` tasks posted by ``args.concurrency`` loops."""

    def __init__(self, args: argparse.Namespace, client: AsyncClient, err: TextIO) -> None:
        self.args = args
        self.client = client
        self.err = err
        self.progress = Progress(args.n, err)
        self.counter = iter(range(1, args.n + 1))
        self.enqueued = 0
        self.duplicates = 0
        self.failures: list[str] = []
        # The broker refused the token, or its certificate failed verification: no use posting
        # more.
        self.refused: list[WqError] = []
        self.told_busy = False

    async def enqueue(self, i: int) -> bool:
        """One task; while the broker is at its task limit, wait as it says and try again.
        True if it was a duplicate (its key seen before: nothing was created)."""
        args = self.args
        while True:
            try:
                enqueued = await self.client.enqueue(
                    payload_for(i, args.n, args.fail),
                    max_attempts=args.max_attempts,
                    delay_ms=args.delay_ms or None,
                    queue=None if args.queue == DEFAULT_QUEUE else args.queue,
                    priority=args.priority or None,
                    idempotency_key=key_for(args.idempotency_key, i, args.n),
                    expires_in_ms=args.expires_in_ms,
                    timeout_ms=args.timeout_ms,
                )
                return getattr(enqueued, "duplicate", False) is True
            except Overloaded as e:
                if not self.told_busy:
                    self.told_busy = True
                    self.progress.say(f"wq-producer: {e.message} (waiting, then retrying)")
                await asyncio.sleep(e.retry_after)

    async def post(self) -> None:
        for i in self.counter:
            if self.refused:
                return
            try:
                if await self.enqueue(i):
                    self.duplicates += 1
                else:
                    self.enqueued += 1
            except (Unauthenticated, PermissionDenied, CertificateError) as e:
                self.refused.append(e)
                self.failures.append(e.message)
            except WqError as e:
                self.failures.append(e.message)
            done = self.enqueued + self.duplicates + len(self.failures)
            self.progress.update(done, len(self.failures))

    def report(self, elapsed: float, out: TextIO) -> int:
        failures = self.failures
        done = self.enqueued + self.duplicates + len(failures)
        self.progress.update(done, len(failures), force=True)
        self.progress.finish()
        if self.refused:
            first = self.refused[0]
            if isinstance(first, CertificateError):
                print(f"wq-producer: {first.message}", file=self.err)
            else:
                print(f"wq-producer: the broker refused the token: {first.message}", file=self.err)
        elif failures:
            print(
                f"wq-producer: {len(failures)} enqueues failed; first error: {failures[0]}",
                file=self.err,
            )
        rate = self.enqueued / elapsed if elapsed > 0 else 0.0
        duplicates = f", duplicates {self.duplicates}" if self.duplicates else ""
        print(
            f"enqueued {self.enqueued}{duplicates}, failed {len(failures)}, in {elapsed:.2f}s "
            f"({rate:.0f} tasks/s)",
            file=out,
        )
        return 1 if failures else 0


async def produce(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        client = AsyncClient(args.broker, token=args.token, ca_file=args.ca_file)
    except WqError as e:
        print(f"wq-producer: {e.message}", file=err)
        return 2
    run = _Run(args, client, err)
    started = time.monotonic()
    try:
        await asyncio.gather(*(run.post() for _ in range(min(args.concurrency, args.n))))
    except BaseException:
        run.progress.finish()  # give the terminal its cursor back
        raise
    finally:
        await client.close()
    return run.report(time.monotonic() - started, out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        conn = connection(args)
    except SettingError as e:
        parser.error(str(e))
    args.broker, args.token, args.ca_file = conn.broker, conn.token, conn.ca_file
    try:
        return asyncio.run(produce(args, sys.stdout, sys.stderr))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    quiet_grpc()
    sys.exit(main())
