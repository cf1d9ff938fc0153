"""The worker runner (the ``wq-worker`` command is :mod:`wqclient.cli.worker`).

Write a handler, ``def handle(task)`` or ``async def handle(task)``, and a :class:`Worker` runs
it with the concurrency you ask for: a handler that returns acks the task, one that raises nacks it
with the exception's text (raise :class:`Retry` to retry after a delay of your choosing,
:class:`Fail` to bury the task at once). What a handler returns, unless it is None, is the task's
result (docs/design/results.md): the ack carries it, JSON-encoded (``bytes`` are taken as JSON
text), and the broker keeps it for the task's result TTL, for whoever waits for it
(``wait_result``) and for the tasks that wait for this one (they find it in ``task.parents``); a
value that JSON cannot encode, or that the broker refuses, buries the task (a terminal nack:
``"result is not JSON: ..."``; running it again would redo its work only to fail the same way),
logged. A handler that returns None acks as always.

Over a transport that can stream (gRPC) it consumes one stream whose prefetch is ``prefetch``:
the tasks beyond the concurrency wait in the worker for a handler to be free, their leases kept,
so that a handler that ends finds its next task at hand instead of waiting a round trip for it.
Over HTTP it claims for its free slots at once (``claim_many``, one claim at a time), its acks
and nacks going together; from a broker without batch claims it long-polls, one claim loop per
unit of concurrency. Given no ``prefetch``, how
many tasks it holds follows its handlers (:class:`_Window`): twice the concurrency over gRPC (the
concurrency over HTTP) while handlers are long against the broker's round trip, more while they
are short, so a worker of short tasks is not bound by its round trips (up to AUTO_PREFETCH_MAX
tasks and AUTO_PREFETCH_BYTES of payloads). Synchronous handlers run in a
thread pool of that size, so they may block. On a gRPC stream a handler's ack is queued on the
stream and its slot is free at once: the broker's answer is judged when it comes (a refusal is
logged, as one waited for would be), and ``run()`` returns only once the broker has answered every
ack sent.

A handler may run for as long as it needs: while it runs, the worker extends the task's lease
(by ``lease_ms``) each time half of the current lease has gone by. If the broker answers that
the lease is lost (another worker may have the task now), that is logged and the handler's
result is discarded: neither ack nor nack is sent for it. An extension that fails otherwise (the
broker unreachable) is logged and tried again after half of what is left of the lease.

A task can be stopped while its handler runs. When the broker says it was cancelled (a
``Cancel`` on the gRPC stream, at once; over HTTP, when its next extension is refused with
:class:`~wqclient.Cancelled`), an asyncio handler is cancelled (``CancelledError`` inside it) and a
synchronous one sees ``task.cancelled`` become true; the task is nacked (the broker drops it,
counted cancelled, without a retry) and logged once, as cancelled, not as a failure. A task whose
view has ``timeout_ms`` has its handler stopped the same way at that limit, counted from when the
worker got the task on its clock, and is nacked with ``"timed out after N ms"`` (retried, or
buried); its lease is never extended past the limit. A synchronous handler cannot be
interrupted: its task is nacked at once and its thread let run on (its result then discarded),
holding its slot until it returns; a task stopped while it waits for a handler is nacked at once
and never handled. A handler reports progress with ``await task.progress(value)`` (a synchronous
one with ``task.report_progress(value)``, which blocks): any JSON value, recorded on the task by
an extension of its lease.

``stop()`` (or SIGINT/SIGTERM in the CLI) stops claiming, lets the tasks in hand finish and settle
(those waiting for a handler too: at most ``prefetch - concurrency`` of them), and returns;
``stop(grace)`` hands back those still in hand past the grace, and ``stop_now()`` at once: each
is released, ready again at the head of its queue with its attempt not counted. A
broker that is down or restarting is reported once and retried with backoff. A broker that
refuses the worker's token (401/403, UNAUTHENTICATED/PERMISSION_DENIED) will not change
its mind by being asked again, nor will a certificate that failed verification
(:class:`~wqclient.CertificateError`: the CA file is missing or wrong): that is logged once, the
worker stops as on ``stop()``, and ``run()`` raises the error.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Protocol

from wqclient.client import AsyncClient, encode_progress
from wqclient.clock import Clock, SystemClock, Timer, call_later
from wqclient.errors import (
    Cancelled,
    CertificateError,
    InvalidArgument,
    LeaseLost,
    NotFound,
    Overloaded,
    PermissionDenied,
    StreamEnded,
    TimeLimitReached,
    Unauthenticated,
    Unavailable,
    Unsupported,
    WqError,
)
from wqclient.limits import DEFAULT_LEASE_MS, DEFAULT_WAIT_MS, MAX_CLAIM_BATCH, MAX_LEASE_MS
from wqclient.models import Delivery, Task
from wqclient.transport import AsyncStream

log = logging.getLogger("wqclient.worker")
#: The line per task (at INFO; its start at DEBUG): a logger of its own, so that a program can
#: keep it quiet (``wq-worker`` does) and the rest of the worker's log as it is.
task_log = logging.getLogger("wqclient.worker.tasks")

Handler = Callable[[Task], Any]

#: A gRPC worker's prefetch, when none is given, starts at this many times its concurrency and
#: never goes below it (see :class:`_Window`)...
PREFETCH_FACTOR = 2
#: ... and grows, while its handlers end fast against the broker's round trip, up to this many
#: tasks (or the start, if more), and no more than this many bytes of payloads held.
AUTO_PREFETCH_MAX = 4096
AUTO_PREFETCH_BYTES = 32 * 1024 * 1024
_BACKOFF_START = 0.1
_BACKOFF_MAX = 5.0
# How long stop() lets open claims come back before cancelling the ones still parked.
_STOP_GRACE = 0.25
# How long a hand-back on a stream waits for the broker's answer to the stream's drain (so that
# the task released is not pushed back on it), at most.
_DRAIN_WAIT = 5.0
# Retrying cannot help: the broker refused the token, or its certificate failed verification.
_FATAL = (Unauthenticated, PermissionDenied, CertificateError)
# The shortest wait before trying a failed lease extension again (or half the lease, if shorter).
_EXTEND_RETRY_MIN = 1.0
# What an extension can answer that means the task is no longer this worker's.
_GONE = (LeaseLost, NotFound, StreamEnded)


class TaskFailed(Exception):
    """Raise from a handler to fail a task with a message (any exception does the same)."""


class Retry(Exception):
    """Raise from a handler to nack the task with a retry after exactly ``delay`` seconds (an
    int, a float or a ``timedelta``; or ``delay_ms`` milliseconds) instead of the broker's
    backoff (neither: the backoff). It still counts an attempt: a task with none left is
    buried. ``error`` is recorded as the task's last_error.

    >>> raise Retry(delay=60, error="rate limited")
    """

    def __init__(
        self,
        delay_ms: int | None = None,
        error: str | None = None,
        *,
        delay: float | timedelta | None = None,
    ) -> None:
        if delay is not None:
            if delay_ms is not None:
                raise ValueError("Retry: give delay or delay_ms, not both")
            delay_ms = seconds_ms(delay, "Retry: delay")
        if delay_ms is not None and (
            isinstance(delay_ms, bool) or not isinstance(delay_ms, int) or delay_ms < 0
        ):
            raise ValueError(f"Retry: delay_ms must be an integer from 0, got {delay_ms!r}")
        super().__init__(error or "")
        self.delay_ms = delay_ms
        self.error = error


def seconds_ms(value: object, what: str, *, positive: bool = False) -> int:
    """Seconds (an int, a float or a ``timedelta``) in whole milliseconds (with ``positive``,
    above 0 and at least 1 ms). ``what`` names the value in the error: TypeError for another
    type, ValueError for a value out of range. (Retry's ``delay``, and the task framework's
    options.)"""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"{what} must be seconds (a number or a timedelta), got {type(value).__name__}"
        )
    low = "above 0" if positive else "from 0"
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        raise ValueError(f"{what} must be a number of seconds {low}, got {value!r}")
    ms = round(seconds * 1000)
    return max(ms, 1) if positive else ms


class Fail(Exception):
    """Raise from a handler to fail the task for good: a terminal nack buries it in the
    dead-letter queue now, whatever attempts it has left. ``error`` is its last_error.

    >>> raise Fail("the account no longer exists")
    """

    def __init__(self, error: str | None = None) -> None:
        super().__init__(error or "")
        self.error = error


def describe(error: BaseException) -> str:
    text = str(error)
    if isinstance(error, (TaskFailed, Retry, Fail)) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _fields(task: Task, outcome: str) -> dict[str, object]:
    """The fields of a log record about a task (``-log-format json`` shows them)."""
    return {
        "task_id": task.id,
        "queue": task.queue,
        "attempts": task.attempts,
        "max_attempts": task.max_attempts,
        "outcome": outcome,
    }


class _Settler(Protocol):
    """Where a delivery is settled and its lease extended: the client (claim loops) or the
    stream it came on. ``window``: the stream's prefetch if it follows the handlers (each
    handler's time is then told to :meth:`handled`), else None."""

    window: _Window | None

    def ack(self, delivery: Delivery, result: bytes | None = None) -> Awaitable[None]: ...

    def nack(
        self,
        delivery: Delivery,
        error: str | None = None,
        delay_ms: int | None = None,
        terminal: bool = False,
    ) -> Awaitable[None]: ...

    def extend(
        self, delivery: Delivery, lease_ms: int | None, progress: bytes | None = None
    ) -> Awaitable[datetime]: ...

    def handled(self, delivery: Delivery, seconds: float) -> None: ...


class _Unary:
    """Settling and extending through the client's unary calls (``window``: how many tasks
    batch claims hold, if it follows the handlers)."""

    def __init__(self, client: AsyncClient, window: _Window | None = None) -> None:
        self._client = client
        self.window = window

    def handled(self, delivery: Delivery, seconds: float) -> None:
        if self.window is not None:
            self.window.handled(seconds, len(delivery.task.payload_json))

    def ack(self, delivery: Delivery, result: bytes | None = None) -> Awaitable[None]:
        if result is None:
            return self._client.ack(delivery)
        return self._client.ack(delivery, result=result)

    def nack(
        self,
        delivery: Delivery,
        error: str | None = None,
        delay_ms: int | None = None,
        terminal: bool = False,
    ) -> Awaitable[None]:
        return self._client.nack(delivery, error=error, delay_ms=delay_ms, terminal=terminal)

    def extend(
        self, delivery: Delivery, lease_ms: int | None, progress: bytes | None = None
    ) -> Awaitable[datetime]:
        if progress is None:
            return self._client.extend(delivery, lease_ms)
        return self._client.extend(delivery, lease_ms, progress=progress)


def _kept(delivery: Delivery, keeper: asyncio.Future[None]) -> None:
    """Say so if the keeper of a delivery's lease failed (other than by being cancelled)."""
    error = None if keeper.cancelled() else keeper.exception()
    if error is not None:
        log.error(
            "task %s: extending its lease failed: %r",
            delivery.task.id,
            error,
            extra=_fields(delivery.task, "extend_failed"),
        )


class _OnStream:
    """Settling on a stream. Nacks are confirmed (a refusal is logged per task); so are acks,
    but on a stream that can queue one and hand back the future of its answer (``ack_soon``:
    wqclient's gRPC stream), where an ack is not waited for: ``judge`` gets its answer when it
    comes, and the handler's slot is free at once. (Waiting gains nothing there: a stream's ack
    cannot be sent again elsewhere, and the stream is closed, at the end, only once the broker
    has answered every ack sent on it.)"""

    def __init__(
        self,
        stream: AsyncStream,
        judge: Callable[[Delivery, asyncio.Future[Any]], None],
        window: _Window | None = None,
        clock: Clock | None = None,
        refused: Callable[[], None] | None = None,
    ) -> None:
        self._stream = stream
        self._refused = refused  # told of each result the broker refused (nacked here)
        self._ack_soon: Callable[..., asyncio.Future[Any]] | None = getattr(
            stream, "ack_soon", None
        )
        self._judge = judge
        # The window is followed where acks are not waited for (their answers are timed).
        self.window = window if self._ack_soon is not None else None
        self._clock: Clock = clock or SystemClock()

    # (Each hands over the stream's own awaitable, or one already done: no coroutine per task.)
    def ack(self, delivery: Delivery, result: bytes | None = None) -> Awaitable[None]:
        if self._ack_soon is None:
            if result is None:
                return self._stream.ack(delivery, confirm=True)
            return self._stream.ack(delivery, confirm=True, result=result)
        if result is None:
            answer = self._ack_soon(delivery)  # (raises StreamEnded at once if it is over)
            answer.add_done_callback(functools.partial(self._judge, delivery))
        else:
            answer = self._ack_soon(delivery, result)
            answer.add_done_callback(functools.partial(self._result_judged, delivery))
        window = self.window
        if window is not None and not window.timing:
            window.timing = True
            answer.add_done_callback(functools.partial(self._answered, self._clock.monotonic()))
        return _DONE

    def _result_judged(self, delivery: Delivery, answer: asyncio.Future[Any]) -> None:
        """The answer to an ack with a result: one the broker refused for its result (too
        large, not JSON to it) is nacked, its lease being still held; anything else is judged
        as any ack."""
        error = None if answer.cancelled() else answer.exception()
        if not isinstance(error, InvalidArgument):
            self._judge(delivery, answer)
            return
        message = _refused_result(delivery, error)
        if self._refused is not None:
            self._refused()
        try:
            nack = asyncio.ensure_future(
                self._stream.nack(delivery, message, terminal=True, confirm=True)
            )
        except WqError as e:  # (the stream is over: the broker takes the task back)
            log.warning("task %s: not nacked: %s", delivery.task.id, e.message)
            return
        nack.add_done_callback(functools.partial(_nacked, delivery))

    def _answered(self, asked: float, answer: asyncio.Future[Any]) -> None:
        window = self.window
        assert window is not None
        if answer.cancelled() or answer.exception() is not None:
            window.timing = False  # (a refusal's time says nothing of the round trip)
            return
        self._resize(window.answered(self._clock.monotonic() - asked))

    def handled(self, delivery: Delivery, seconds: float) -> None:
        if self.window is not None:
            self._resize(self.window.handled(seconds, len(delivery.task.payload_json)))

    def _resize(self, size: int | None) -> None:
        if size is not None:
            log.debug("prefetch %d from now on", size)
            try:
                self._stream.set_prefetch(size)
            except WqError:
                pass  # the stream is over: a new one opens with this size

    def nack(
        self,
        delivery: Delivery,
        error: str | None = None,
        delay_ms: int | None = None,
        terminal: bool = False,
    ) -> Awaitable[None]:
        return self._stream.nack(delivery, error, delay_ms, terminal, confirm=True)

    def extend(
        self, delivery: Delivery, lease_ms: int | None, progress: bytes | None = None
    ) -> Awaitable[datetime]:
        if progress is None:
            return self._stream.extend(delivery, lease_ms)
        return self._stream.extend(delivery, lease_ms, progress=progress)


def _refused_result(delivery: Delivery, error: WqError) -> str:
    """Say that the broker refused a handler's result; the nack's error."""
    log.warning(
        "task %s: the broker refused its handler's result (%s); burying it",
        delivery.task.id,
        error.message,
        extra=_fields(delivery.task, "result_refused"),
    )
    return f"result refused by the broker: {error.message}"


def _nacked(delivery: Delivery, nack: asyncio.Future[Any]) -> None:
    """Say so if a nack sent from a callback was refused."""
    error = None if nack.cancelled() else nack.exception()
    if error is not None:
        log.warning("task %s: its nack was refused: %s", delivery.task.id, error)


def _result_text(value: Any) -> bytes:
    """A handler's result as JSON text (``bytes`` are taken as JSON text, and checked); raises
    ValueError (or TypeError, RecursionError) naming what JSON cannot encode."""
    if isinstance(value, (bytes, bytearray)):
        json.loads(value)
        return bytes(value)
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


class _Done:
    """An awaitable that is already done (an ack queued, its answer judged when it comes)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # (a generator that ends at once)


_DONE = _Done()


_ENDED: Final = "the task's handler has ended: progress is reported while it runs"

# Why a handler was stopped before it ended (_Lease.stop).
_CANCELLED: Final = "cancelled"  # the broker said the task was cancelled
_TIMED_OUT: Final = "timed out"  # it reached its time limit (the task's timeout_ms)
_HANDED_BACK: Final = "handed back"  # the worker stopped past its grace (stop_now)

#: The error of a task handed back because the worker stopped before its handler ended
#: (:meth:`Worker.stop_now`, or :meth:`Worker.stop` past its grace) to a broker without release:
#: nacked with delay 0 there. (A release records no error.)
HANDED_BACK_ERROR: Final = "the worker stopped: handed back"

# What became of a task, as the per-task log line and ``on_task`` tell it.
SUCCEEDED: Final = "succeeded"
FAILED: Final = "failed"  # for good: buried (a Fail, no attempts left, a result refused)
RETRIED: Final = "retried"  # nacked, to be tried again (the broker's backoff, or a Retry)
CANCELLED: Final = "cancelled"
TIMED_OUT: Final = "timed_out"
HANDED_BACK: Final = "handed_back"
DISCARDED: Final = "discarded"  # its lease was lost while the handler ran
_OUTCOMES: Final = {_CANCELLED: CANCELLED, _TIMED_OUT: TIMED_OUT, _HANDED_BACK: HANDED_BACK}

#: ``on_task(task, name, outcome, seconds)``: told of each task once it is settled: its name
#: (the payload convention's ``task``, None if it has none), what became of it (SUCCEEDED ...)
#: and the seconds from its handler's start to its settling.
TaskObserver = Callable[[Task, str | None, str, float], None]

# A payload of the convention, as wqclient.App writes it: {"task": "name", ...}.
_NAME_FIRST: Final = re.compile(rb'\s*\{\s*"task"\s*:\s*"([^"\\]*)"')


def task_name(task: Task) -> str | None:
    """The task's name by the payload convention (docs/design/tasks.md): its payload's
    ``task`` member, if it is a string; None otherwise. Cheap when the name comes first."""
    data = task.payload_json
    m = _NAME_FIRST.match(data)
    if m is not None:
        return m.group(1).decode("utf-8", "replace")
    if b'"task"' not in data:
        return None
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    name = payload.get("task") if isinstance(payload, dict) else None
    return name if isinstance(name, str) else None


class _Lease:
    """One delivery's lease while its handler runs; and, attached to the task handed to the
    handler, its :class:`~wqclient.models.TaskControl`: whether it was cancelled, and its
    progress reports (through ``worker`` on the delivery's ``settler``).

    (A plain object, its state past the first four members taken from the class until set:
    made for every task, and most of that state is never set.)"""

    lost: bool = False  # the broker said it is no longer ours: discard the result
    done: bool = False  # the handler has finished (or was stopped): extend no more
    extending: bool = False  # an extension is on its way
    stop: str | None = None  # _CANCELLED or _TIMED_OUT once the handler is to stop
    limit: float | None = None  # when its time limit is reached (the clock's monotonic time)
    task: asyncio.Task[Any] | None = None  # the task its _process runs in
    runner: asyncio.Task[Any] | None = None  # that task, while an asyncio handler runs in it
    cancel_sent: bool = False  # runner.cancel() was called, and not yet taken back
    in_thread: bool = False  # a synchronous handler is running
    early: asyncio.Future[None] | None = None  # its nack, sent without waiting for the thread
    thread: asyncio.Future[Any] | None = None  # a synchronous handler's run in the pool
    abandoned: bool = False  # that run is waited for no more (stop_now): its thread runs on
    holders: dict[str, _Lease] | None = None  # where it is registered by lease id (a stream's)
    keeper: asyncio.Task[None] | None = None  # extending it, once half of it has gone by
    timer: Timer | None = None  # stops the handler at the time limit

    def __init__(
        self,
        deadline: datetime,
        worker: Worker | None = None,
        delivery: Delivery | None = None,
        settler: _Settler | None = None,
    ) -> None:
        self.deadline = deadline  # the broker's latest deadline for it
        self.worker = worker
        self.delivery = delivery
        self.settler = settler

    @property
    def cancelled(self) -> bool:
        return self.stop is not None

    async def progress(self, value: Any) -> None:
        worker, delivery = self.worker, self.delivery
        if worker is None or delivery is None:
            raise WqError(_ENDED)
        await worker._progress(self, delivery, encode_progress(value), in_thread=False)

    def report_progress(self, value: Any) -> None:
        worker, delivery = self.worker, self.delivery
        if worker is None or delivery is None:
            raise WqError(_ENDED)
        loop = worker._loop
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise WqError(
                "report_progress() blocks: call it from a synchronous handler (an asyncio "
                "handler awaits task.progress(value))"
            )
        if loop is None or loop.is_closed():
            raise WqError("the worker is not running")
        data = encode_progress(value)
        asyncio.run_coroutine_threadsafe(
            worker._progress(self, delivery, data, in_thread=True), loop
        ).result()


class _Ended:
    """The TaskControl of a task whose handler has ended: no more progress reports."""

    __slots__ = ("cancelled",)

    def __init__(self, cancelled: bool) -> None:
        self.cancelled = cancelled

    async def progress(self, value: Any) -> None:
        raise WqError(_ENDED)

    def report_progress(self, value: Any) -> None:
        raise WqError(_ENDED)


_OVER: Final = _Ended(False)
# Sets a frozen Task's control slot (the slot's own descriptor: no dataclass check on the way).
_set_control: Final = Task._control.__set__  # type: ignore[attr-defined]
_STOPPED: Final = _Ended(True)  # (it was cancelled, or timed out: it still says so)


class _LeaseWatch:
    """When each running handler's lease is half gone, with one timer for them all (a timer
    per task costs more than the rest of a short task's bookkeeping). Every handler is watched
    for the same span, so they come due in the order they started: the timer is set for the
    oldest, and when it fires, each one due is kept (its ``keep`` called) and the timer set
    for the next. A handler that ends is dropped from the watch at once."""

    def __init__(
        self, clock: Clock, call_later: Callable[[float, Callable[[], None]], Timer]
    ) -> None:
        self._clock = clock
        self._call_later = call_later
        # By lease, in the order watched: (when due, what to call then).
        self._due: dict[_Lease, tuple[float, Callable[[], None]]] = {}
        self._timer: Timer | None = None

    def watch(self, lease: _Lease, after: float, keep: Callable[[], None]) -> None:
        self._due[lease] = (self._clock.monotonic() + after, keep)
        if self._timer is None:
            self._timer = self._call_later(after, self._fire)

    def drop(self, lease: _Lease) -> None:
        self._due.pop(lease, None)

    def _fire(self) -> None:
        self._timer = None
        due = self._due
        now = self._clock.monotonic()
        while due:
            lease = next(iter(due))
            when, keep = due[lease]
            if when > now:
                self._timer = self._call_later(when - now, self._fire)
                return
            del due[lease]
            keep()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._due.clear()


class _Window:
    """How many tasks a worker given no prefetch holds (its stream's prefetch over gRPC, its
    batch claims over HTTP): as many as keep its handlers busy over the broker's round trip,
    and no more.

    A handler that ends takes its next task at once if the worker holds more tasks than the
    handlers run; the broker sends the task that takes the ended one's place a round trip
    later (its ack, the commit, the delivery; over HTTP, the next claim). So the tasks beyond
    the concurrency are worth holding while handlers are short against that round trip, and
    not otherwise (a task held waits while another worker may be idle). The window is
    ``concurrency * (1 + 2 * trip / handler)``: two round trips of work at hand, so one slow
    answer starves no handler; at least ``floor`` (over gRPC PREFETCH_FACTOR times the
    concurrency, the fixed default before; over HTTP the concurrency), at most ``cap`` tasks
    and ``budget`` bytes of payloads. ``handler`` follows a handler's time up at once and down
    slowly (a burst of slow tasks shrinks the window before many more are taken; fast ones grow
    it back over many tasks); ``trip`` is a moving average of the round trip (over gRPC an
    ack's answer time, one ack timed at a time; over HTTP a claim answered in full); ``payload``,
    of the payloads' sizes. The window changes only by a quarter or more, so a steady workload
    sends no change at all."""

    __slots__ = (
        "concurrency",
        "floor",
        "cap",
        "budget",
        "size",
        "handler",
        "trip",
        "payload",
        "timing",
    )

    # How much of each new figure goes into the averages.
    UP: Final = 0.5
    DOWN: Final = 0.05
    TRIP: Final = 0.2
    # A change smaller than this share of the window is not made.
    STEP: Final = 0.25

    def __init__(self, concurrency: int, floor: int, cap: int, budget: int) -> None:
        self.concurrency = concurrency
        self.floor = floor
        self.cap = max(cap, floor)
        self.budget = budget
        self.size = floor
        self.handler: float | None = None  # seconds a handler runs
        self.trip: float | None = None  # seconds from an ack sent to its answer
        self.payload = 0.0  # bytes in a task's payload
        self.timing = False  # an ack's answer is being timed

    def handled(self, seconds: float, size: int) -> int | None:
        """A handler ran ``seconds`` on a payload of ``size`` bytes: the new window, if it is
        to change."""
        self.payload += self.TRIP * (size - self.payload)
        h = self.handler
        if h is None:
            self.handler = seconds
        else:
            self.handler = h + (self.UP if seconds > h else self.DOWN) * (seconds - h)
            if seconds <= 4 * h:
                return None  # (looked at once per round trip, unless handlers got much slower)
        return self._resized()

    def answered(self, seconds: float) -> int | None:
        """An ack's answer came ``seconds`` after it was sent: the new window, if it is to
        change."""
        self.timing = False
        t = self.trip
        self.trip = seconds if t is None else t + self.TRIP * (seconds - t)
        return self._resized()

    def target(self) -> int:
        h, t = self.handler, self.trip
        if h is None or t is None:
            return self.size
        c = self.concurrency
        if t <= 0:
            want = c  # (no time measured: a clock that does not move)
        elif t >= h * self.cap:
            want = self.cap  # (handlers that take no time, or next to none)
        else:
            want = c + math.ceil(2 * c * t / h)
        cap = min(self.cap, int(self.budget // max(1.0, self.payload)))
        return max(self.floor, min(cap, want))

    def _resized(self) -> int | None:
        want = self.target()
        if abs(want - self.size) < max(1, self.STEP * self.size):
            return None
        self.size = want
        return want


class Worker:
    """Runs ``handler`` on tasks from a broker until ``stop()``.

    ``broker``: a URL (the worker then makes and closes its own client, which takes its token
    and CA file from ``$WQ_TOKEN`` and ``$WQ_CA_FILE``) or an :class:`AsyncClient` (yours to
    close; ``AsyncClient(url, token=...)`` to give it a token, ``AsyncClient(transport=...)`` to
    run on a transport of your own). At most ``concurrency`` handlers run at once; the worker
    holds ``prefetch`` tasks, those waiting for a handler included (over HTTP, in batch claims).
    None (the default) lets it follow the handlers: twice the concurrency over gRPC (the
    concurrency over HTTP) while they are long against the broker's round trip, up to
    AUTO_PREFETCH_MAX while they are short (see the module's docstring).
    ``prefetch=concurrency`` takes a task only when a handler is free, as a worker whose tasks
    are long and few may prefer, so that another worker takes them meanwhile. Each claim
    long-polls up to ``wait_ms`` and holds its task for ``lease_ms`` at first: while the task
    waits for a handler and while the handler runs, the lease is extended by ``lease_ms`` each
    time half of it has gone by. ``queues``: the queues to take tasks from, in order of
    preference (a list, or ``"a,b"``; default the broker's, ``["default"]``). ``clock``: what
    lease extension and the prefetch's window measure time with (tests pass a fake; default
    the system's). ``on_task(task, name, outcome, seconds)``: told of each task once it is
    settled (see :data:`TaskObserver`; it runs on the event loop, so it must be quick).

    Each task settled is logged at INFO on the ``wqclient.worker.tasks`` logger (its name, id,
    attempt, outcome and duration; its start at DEBUG), if that logger is enabled for it.

    ``run()`` raises :class:`~wqclient.Unauthenticated` or :class:`~wqclient.PermissionDenied`
    if the broker refuses the token, :class:`~wqclient.CertificateError` if its TLS certificate
    fails verification (after letting the tasks in hand finish).
    """

    def __init__(
        self,
        broker: str | AsyncClient,
        handler: Handler,
        *,
        concurrency: int = 3,
        prefetch: int | None = None,
        wait_ms: int = DEFAULT_WAIT_MS,
        lease_ms: int = DEFAULT_LEASE_MS,
        queues: str | Sequence[str] | None = None,
        clock: Clock | None = None,
        on_task: TaskObserver | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if prefetch is not None and prefetch < concurrency:
            raise ValueError("prefetch must be at least the concurrency")
        floor = PREFETCH_FACTOR * concurrency
        # None: the prefetch follows the handlers (over a stream that can change it; batch
        # claims from the concurrency up, as they held before).
        self._window: _Window | None = None
        self._batch_window: _Window | None = None
        if prefetch is None:
            self._window = _Window(concurrency, floor, AUTO_PREFETCH_MAX, AUTO_PREFETCH_BYTES)
            self._batch_window = _Window(
                concurrency, concurrency, AUTO_PREFETCH_MAX, AUTO_PREFETCH_BYTES
            )
        self._client = broker if isinstance(broker, AsyncClient) else AsyncClient(broker)
        self._own_client = not isinstance(broker, AsyncClient)
        self._handler = handler
        self._is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004
        )
        self.concurrency = concurrency
        self._prefetch = floor if prefetch is None else prefetch
        self.wait_ms = wait_ms
        self.lease_ms = lease_ms
        self.queues = queues
        self._clock: Clock = clock or SystemClock()
        # The clock's own timers if it has them.
        timer = getattr(self._clock, "call_later", None)
        self._call_later: Callable[[float, Callable[[], None]], Timer] = (
            timer if timer is not None else functools.partial(call_later, self._clock)
        )
        self._leases = _LeaseWatch(self._clock, self._call_later)
        self._loop: asyncio.AbstractEventLoop | None = None  # run()'s (progress from threads)
        self._executor: ThreadPoolExecutor | None = None
        self._running = asyncio.Semaphore(concurrency)
        self._stopping = asyncio.Event()
        self._claims: set[asyncio.Future[Any]] = set()
        self._room: asyncio.Event | None = None  # a batch loop waits on it for a free slot
        self._down_since: float | None = None
        self._refusal: WqError | None = None
        self.succeeded = 0
        self.failed = 0  # (results JSON could not encode, or the broker refused, counted too)
        self.discarded = 0  # results thrown away because the lease was lost
        self.cancelled = 0  # tasks cancelled while held: handlers stopped, tasks nacked
        self.timed_out = 0  # handlers stopped at their task's time limit (counted failed too)
        self.handed_back = 0  # tasks handed back unfinished when the worker stopped
        self._on_task = on_task
        # The leases of the tasks in hand whose handlers have not ended (running, or waiting
        # for a slot), for stop_now() to hand back.
        self._in_hand: dict[_Lease, None] = {}
        self._handing_back = False  # stop_now(): every task in hand, or coming, is handed back
        # Whether the broker releases tasks (None: not known yet; the first hand-back asks,
        # the others meanwhile wait for its answer under the lock).
        self._releases: bool | None = None
        self._asking = asyncio.Lock()
        self._grace_timer: Timer | None = None
        self._abandoned = False  # a synchronous handler's thread was let run on (stop_now)
        # The stream's drain, asked for now (so that stop_now() hands its tasks back only
        # once the broker is to send no more: else they could come back on it at once).
        self._drain_now: Callable[[], Awaitable[int]] | None = None

    @property
    def client(self) -> AsyncClient:
        return self._client

    @property
    def in_hand(self) -> int:
        """How many tasks the worker holds whose handlers have not ended (running, or waiting
        for a free slot)."""
        return len(self._in_hand)

    @property
    def prefetch(self) -> int:
        """The stream's prefetch now: the one given, or where the window stands (a new stream
        opens with it)."""
        return self._prefetch if self._window is None else self._window.size

    def stop(self, grace: float | None = None) -> None:
        """Stop claiming; tasks in hand finish and are settled. Safe to call more than once.

        A claim already on its way back is let finish (its task is then worked on, as one in
        hand): only claims still parked after a short grace are cancelled. Cancelling a claim at
        the very moment the broker hands it a task would leave that task to its lease.

        ``grace`` (seconds, on the worker's clock; None: no limit): the tasks still in hand
        that long after are handed back, as :meth:`stop_now` does (0: at once). A later call
        does not move a grace already set."""
        if not self._stopping.is_set():
            if grace is None:
                log.info("stopping: finishing the tasks in hand")
            else:
                log.info("stopping: finishing the tasks in hand (for up to %gs)", grace)
            self._halt()
        if grace is None or self._handing_back or self._grace_timer is not None:
            return
        if grace <= 0:
            self.stop_now()
        else:
            self._grace_timer = self._call_later(grace, self._grace_over)

    def _grace_over(self) -> None:
        self._grace_timer = None
        if not self._handing_back and self._in_hand:
            log.warning("the grace is over: handing back the tasks still in hand")
        self.stop_now()

    def stop_now(self) -> None:
        """Stop claiming, and hand back every task in hand whose handler has not ended: an
        asyncio handler is cancelled, a synchronous one abandoned (its thread runs on, its
        result discarded; ``run()`` does not wait for it), and the task is released
        (:meth:`AsyncClient.release <wqclient.AsyncClient.release>`): ready again at once at
        the head of its queue, its attempt not counted and no error recorded; so is a task
        still waiting for a handler, or one that comes from a claim on its way back. (A broker
        without release gets a nack with delay 0 and the error :data:`HANDED_BACK_ERROR`
        instead, which counts the attempt, as a lease that ran out would.) ``run()`` returns
        once they are handed back. Safe to call more than once, and after :meth:`stop`."""
        self._halt()
        if self._handing_back:
            return
        self._handing_back = True
        if self._drain_now is not None:
            self._drain_now()  # (asked for first: the hand-backs go on the stream after it)
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        if self._in_hand:
            log.info("handing back the %d task(s) in hand", len(self._in_hand))
        for lease in list(self._in_hand):
            self._hand_back(lease)

    def _hand_back(self, lease: _Lease) -> None:
        """Stop a task's handler for good, as stop_now() does (see :meth:`_interrupt`); a
        synchronous handler's thread (this task's, or one stopped before and still running) is
        waited for no more."""
        self._interrupt(lease, _HANDED_BACK)
        thread = lease.thread
        if lease.in_thread and thread is not None and not thread.done():
            lease.abandoned = True
            self._abandoned = True
            thread.cancel()  # (the future only: _process goes on; the thread runs on)

    def _halt(self) -> None:
        if not self._stopping.is_set():
            self._stopping.set()
            if self._room is not None:
                self._room.set()  # (a batch loop waiting for room goes on, to stop)
            if self._claims:
                asyncio.get_running_loop().call_later(_STOP_GRACE, self._cancel_claims)

    def _give_up(self, error: WqError) -> None:
        """The broker refused the token, or its certificate failed verification (``_FATAL``):
        say so once and stop (run() then raises ``error``)."""
        if self._refusal is None:
            self._refusal = error
            if isinstance(error, CertificateError):
                log.error("%s; stopping", error.message)
            else:
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
        self._loop = asyncio.get_running_loop()
        if not self._is_async:
            self._executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix="wq-handler")
        try:
            if self._client.can_stream:
                await self._run_stream()
            elif not self._client.claims_many or await self._run_batches():
                await asyncio.gather(*(self._poll_loop() for _ in range(self.concurrency)))
        finally:
            if self._grace_timer is not None:
                self._grace_timer.cancel()
                self._grace_timer = None
            self._leases.close()  # (every handler has ended by now, or was abandoned)
            if self._executor is not None:
                # (a thread abandoned by stop_now() is not waited for)
                self._executor.shutdown(wait=not self._abandoned, cancel_futures=True)
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

    def _broker_up(self, asked_at: float | None = None) -> None:
        """The broker answered a call made at ``asked_at`` (monotonic; None: just now). An
        answer to a call made before the outage was reported proves nothing (a broker shutting
        down answers its parked long-polls on its way out): only a later call ends the outage."""
        down_since = self._down_since
        if down_since is None or (asked_at is not None and asked_at <= down_since):
            return
        log.info("broker reachable again after %.1fs", time.monotonic() - down_since)
        self._down_since = None

    # -- HTTP / unary: claim loops ----------------------------------------------------------------

    async def _poll_loop(self) -> None:
        failures = [0]
        me = asyncio.current_task()
        while not self._stopping.is_set():
            deliveries = await self._claimed(self._claim_one(), failures)
            if deliveries is None:
                return
            for delivery in deliveries:
                settler = _Unary(self._client)
                lease = self._lease(delivery, settler)
                lease.task = me
                await self._process(delivery, settler, lease)

    async def _claim_one(self) -> list[Delivery]:
        delivery = await self._client.claim(
            wait_ms=self.wait_ms, lease_ms=self.lease_ms, queues=self.queues
        )
        return [] if delivery is None else [delivery]

    # -- HTTP with batch claims: one claim at a time, for as many tasks as there is room --------

    async def _run_batches(self) -> bool:
        """Claim for every free slot at once (GET /jobs/next/batch), one claim at a time, and
        work on what comes; acks and nacks go together (the client's doing). True if the
        broker turned out to have no batch claims: the claim loops take over."""
        in_flight: set[asyncio.Task[None]] = set()
        room = self._room = asyncio.Event()
        window = self._batch_window
        settler = _Unary(self._client, window)
        create_task = asyncio.get_running_loop().create_task
        failures = [0]

        def finished(task: asyncio.Task[None]) -> None:
            in_flight.discard(task)
            room.set()

        try:
            while not self._stopping.is_set():
                held = self._prefetch if window is None else window.size
                free = min(held - len(in_flight), MAX_CLAIM_BATCH)
                if free <= 0:
                    room.clear()
                    await room.wait()
                    continue
                many = self._client.claim_many(
                    free, wait_ms=self.wait_ms, lease_ms=self.lease_ms, queues=self.queues
                )
                asked = self._clock.monotonic()
                deliveries = await self._claimed(many, failures)
                if deliveries is None:
                    return False  # stopped, or the token was refused
                if window is not None and len(deliveries) == free:
                    # A claim answered in full did not wait for tasks: its time is the round
                    # trip a free handler would wait for its next task.
                    window.answered(self._clock.monotonic() - asked)
                for delivery in deliveries:
                    lease = self._lease(delivery, settler)
                    task = lease.task = create_task(self._process(delivery, settler, lease))
                    in_flight.add(task)
                    task.add_done_callback(finished)
                if not self._client.claims_many:
                    return not self._stopping.is_set()  # an older broker: claim loops then
            return False
        finally:
            self._room = None
            if in_flight:  # the tasks in hand finish and are settled
                await asyncio.gather(*in_flight, return_exceptions=True)

    async def _claimed(
        self, call: Coroutine[Any, Any, list[Delivery]], failures: list[int]
    ) -> list[Delivery] | None:
        """The answer to one claim (one task or none, or a batch): what came (nothing, if the
        broker is down: after the backoff, ``failures[0]`` counting the failures in a row), or
        None to stop (stop() cancelled it, or the token was refused)."""
        asked_at = time.monotonic()
        claim = asyncio.ensure_future(call)
        self._claims.add(claim)
        try:
            deliveries = await claim
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # we are being cancelled ourselves
            return None  # stop() cancelled the idle claim
        except _FATAL as e:  # (a CertificateError is an Unavailable that retrying cannot help)
            self._give_up(e)
            return None
        except Unavailable as e:
            await self._broker_down(e, failures[0])
            failures[0] += 1
            return []
        finally:
            self._claims.discard(claim)
        failures[0] = 0
        self._broker_up(asked_at)
        return deliveries

    # -- gRPC: one stream --------------------------------------------------------------------------

    async def _run_stream(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                stream = await self._client.stream(
                    prefetch=self.prefetch, lease_ms=self.lease_ms, queues=self.queues
                )
            except _FATAL as e:
                self._give_up(e)
                return
            except Unavailable as e:
                await self._broker_down(e, failures)
                failures += 1
                continue
            self._broker_up()
            failures = 0
            error = await self._consume(stream)
            if isinstance(error, _FATAL):
                self._give_up(error)
            if self._stopping.is_set():
                return
            # The stream broke, or the broker ended it (it is shutting down): reconnect.
            await self._broker_down(error or StreamEnded("the broker ended the stream"), failures)
            failures += 1

    async def _consume(self, stream: AsyncStream) -> WqError | None:  # noqa: C901
        """Run one stream until stop() (returns None) or until it breaks (returns the error)."""
        in_flight: set[asyncio.Task[None]] = set()

        settler = _OnStream(stream, self._judge_ack, self._window, self._clock, self._refused)
        held = self._follow_cancels(stream)
        drain: asyncio.Future[int] | None = None

        def drain_now() -> asyncio.Future[int]:
            nonlocal drain
            if drain is None:
                drain = asyncio.ensure_future(stream.drain())
            return drain

        self._drain_now = drain_now

        async def receive() -> WqError | None:
            create_task, process = asyncio.get_running_loop().create_task, self._process
            async for delivery in stream:
                if held is None or delivery.task.timeout_ms is not None:
                    lease = self._lease(delivery, settler, held)
                else:  # (_lease's usual, inline: this runs for every task)
                    lease = _Lease(delivery.deadline, self, delivery, settler)
                    _set_control(delivery.task, lease)
                    held[delivery.lease_id] = lease
                    lease.holders = held
                task = lease.task = create_task(process(delivery, settler, lease))
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
            coming = await drain_now()
            log.debug("drained: %s deliveries unsettled", coming)
            while in_flight:
                await asyncio.gather(*list(in_flight), return_exceptions=True)
            return None
        finally:
            self._drain_now = None
            if drain is not None and not drain.done():
                drain.cancel()
            stopping.cancel()
            receiver.cancel()
            await stream.close()

    def _follow_cancels(self, stream: AsyncStream) -> dict[str, _Lease] | None:
        """The leases of the tasks in hand, by lease id, for the cancels a stream tells of
        (wqclient's gRPC stream does: ``on_cancel``); None for a stream that does not."""
        on_cancel = getattr(stream, "on_cancel", None)
        if on_cancel is None:
            return None
        held: dict[str, _Lease] = {}

        def cancelled(task_id: str, lease_id: str) -> None:
            lease = held.get(lease_id)
            if lease is not None:
                self._interrupt(lease, _CANCELLED)

        on_cancel(cancelled)
        return held

    # -- one task --------------------------------------------------------------------------------

    def _lease(
        self, delivery: Delivery, settler: _Settler, held: dict[str, _Lease] | None = None
    ) -> _Lease:
        """The lease of a delivery just received, attached to its task as the handler's
        TaskControl; its time limit, if any, counted from now; registered in ``held`` (by lease
        id) until its handler ends, if given."""
        lease = _Lease(delivery.deadline, self, delivery, settler)
        _set_control(delivery.task, lease)  # (a frozen Task: set here, and once it ends)
        timeout_ms = delivery.task.timeout_ms
        if timeout_ms is not None:
            lease.limit = self._clock.monotonic() + timeout_ms / 1000
            lease.timer = self._call_later(
                timeout_ms / 1000, functools.partial(self._interrupt, lease, _TIMED_OUT)
            )
        if held is not None:
            held[delivery.lease_id] = lease
            lease.holders = held
        return lease

    async def _process(  # noqa: C901 (the usual path inlined: this runs for every task)
        self, delivery: Delivery, settler: _Settler, lease: _Lease
    ) -> None:
        """Run the handler on a delivery, keeping its lease alive, then settle it. It is
        stopped (:meth:`_interrupt`) if the task is cancelled or reaches its time limit."""
        span = min(self.lease_ms, MAX_LEASE_MS) / 1000  # the broker caps leases
        expires = self._clock.monotonic() + span

        def keep() -> None:
            # Half the lease has gone by and the handler still runs: keep the lease from now on.
            lease.keeper = asyncio.ensure_future(self._keep(delivery, settler, lease, expires))

        # Watched, not a task that sleeps: most handlers end long before it would be time.
        self._leases.watch(lease, span / 2, keep)
        in_hand = self._in_hand
        in_hand[lease] = None
        if self._handing_back:  # (a task that came after stop_now(): handed back at once)
            self._hand_back(lease)
        # Told at the end (the log line, on_task): only then is the handler timed.
        told = self._on_task is not None or task_log.isEnabledFor(logging.INFO)
        error: Exception | None = None
        value: Any = None  # what the handler returned: the task's result, unless None
        try:
            await self._running.acquire()
            if told or settler.window is not None:
                started = self._clock.monotonic()
                if told and task_log.isEnabledFor(logging.DEBUG):
                    self._starting(delivery.task)
            else:
                started = 0.0
            try:  # (the handler is run here, not in a coroutine of its own: this is per task)
                if self._is_async and lease.stop is None:  # (_start_handler's usual, inline)
                    lease.runner = lease.task or asyncio.current_task()
                    value = await self._handler(delivery.task)
                else:
                    running = self._start_handler(delivery.task, lease)
                    if running is not None:  # (None: stopped while it waited for a handler)
                        value = await running
            except asyncio.CancelledError:
                if not self._stopped_by_us(lease):
                    raise
            except Exception as e:
                error = e
            finally:
                if lease.cancel_sent or settler.window is not None:
                    self._handler_ended(delivery, settler, lease, started)
                else:  # (the usual: nothing to take back, no window to tell)
                    lease.runner = None
                    lease.in_thread = False
                    self._running.release()
        finally:
            del in_hand[lease]
            if lease.keeper is None and lease.timer is None:  # (_ended's usual, inline)
                lease.done = True
                self._leases.drop(lease)
                if lease.holders is not None:
                    lease.holders.pop(delivery.lease_id, None)
            else:
                extending = self._ended(delivery, lease)
                if extending is not None:  # an extension on its way is let finish
                    await asyncio.wait((extending,))
        try:
            if error is None and lease.stop is None and not lease.lost:  # (the usual: an ack)
                if value is None:
                    self.succeeded += 1
                    await self._settle(delivery, lease, lambda: settler.ack(delivery))
                    outcome = SUCCEEDED
                else:
                    outcome = await self._ack_result(delivery, lease, settler, value)
            else:
                outcome = await self._conclude(delivery, lease, settler, error)
            if told:
                self._finished(delivery.task, outcome, self._clock.monotonic() - started)
        finally:
            # The task lets go of its lease (which holds the task: neither waits for the garbage
            # collector, and a task kept holds nothing of the worker's), for a control that
            # says the handler has ended.
            _set_control(delivery.task, _STOPPED if lease.stop else _OVER)

    async def _ack_result(
        self, delivery: Delivery, lease: _Lease, settler: _Settler, value: Any
    ) -> str:
        """Ack a task with its handler's result (docs/design/results.md); nack it if JSON
        cannot encode the result, or if the broker refuses it. What became of it."""
        try:
            data = _result_text(value)
        except (TypeError, ValueError, RecursionError) as e:
            self.failed += 1
            what = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            return await self._settle_failure(
                delivery, lease, settler, Fail(f"result is not JSON: {what}")
            )
        self.succeeded += 1
        outcome = [SUCCEEDED]

        async def ack() -> None:
            try:
                await settler.ack(delivery, data)
            except InvalidArgument as e:  # (too large, say)
                self.succeeded -= 1
                self.failed += 1
                outcome[0] = FAILED
                await settler.nack(delivery, _refused_result(delivery, e), terminal=True)

        await self._settle(delivery, lease, ack)
        return outcome[0]

    def _starting(self, task: Task) -> None:
        """Log a task's start (at DEBUG)."""
        name = task_name(task)
        fields = _fields(task, "started")
        fields["task_name"] = name
        task_log.debug(
            "task %s%s started (attempt %d of %d)",
            f"{name} " if name else "",
            task.id,
            task.attempts,
            task.max_attempts,
            extra=fields,
        )

    def _finished(self, task: Task, outcome: str, seconds: float) -> None:
        """A task is settled: ``on_task`` is told, and a line logged at INFO."""
        name = task_name(task)
        on_task = self._on_task
        if on_task is not None:
            try:
                on_task(task, name, outcome, seconds)
            except Exception:
                log.exception("on_task failed for task %s", task.id)
        if task_log.isEnabledFor(logging.INFO):
            fields = _fields(task, outcome)
            fields["task_name"] = name
            fields["duration_ms"] = round(seconds * 1000, 3)
            task_log.info(
                "task %s%s (attempt %d of %d): %s in %.1f ms",
                f"{name} " if name else "",
                task.id,
                task.attempts,
                task.max_attempts,
                outcome,
                seconds * 1000,
                extra=fields,
            )

    def _start_handler(self, task: Task, lease: _Lease) -> Awaitable[Any] | None:
        """The handler's run on ``task`` (None if it was stopped before it could start): an
        asyncio handler's coroutine, run in the task's own asyncio task (which a cancel
        cancels), or a synchronous one's run in the pool."""
        if lease.stop is not None:
            return None
        if self._is_async:
            lease.runner = lease.task or asyncio.current_task()
            return self._handler(task)  # type: ignore[no-any-return]
        lease.in_thread = True
        loop = asyncio.get_running_loop()
        thread = lease.thread = loop.run_in_executor(self._executor, self._handler, task)
        return thread

    def _handler_ended(
        self, delivery: Delivery, settler: _Settler, lease: _Lease, started: float
    ) -> None:
        """The handler has returned or raised: its slot is free."""
        runner = lease.runner
        lease.runner = None
        lease.in_thread = False
        if lease.cancel_sent and runner is not None:  # (a handler that swallowed the cancel)
            lease.cancel_sent = False
            runner.uncancel()
        self._running.release()
        if settler.window is not None:
            settler.handled(delivery, self._clock.monotonic() - started)

    def _ended(self, delivery: Delivery, lease: _Lease) -> asyncio.Task[None] | None:
        """A handler has ended (or was stopped): its lease is watched and extended no more.
        The keeper's extension on its way, if one is, to be waited for."""
        lease.done = True
        self._leases.drop(lease)
        if lease.timer is not None:
            lease.timer.cancel()
        if lease.holders is not None:
            lease.holders.pop(delivery.lease_id, None)
        keeper = lease.keeper
        if keeper is None:
            return None
        keeper.add_done_callback(functools.partial(_kept, delivery))
        if lease.extending:
            return keeper
        keeper.cancel()  # it is asleep: nothing of it is left to wait for
        return None

    async def _conclude(
        self, delivery: Delivery, lease: _Lease, settler: _Settler, error: Exception | None
    ) -> str:
        """Settle a task whose handler failed, or was stopped, or whose lease was lost; what
        became of it."""
        if lease.stop is not None:
            if lease.early is not None:  # (nacked already, while its thread ran on)
                await lease.early
            else:
                await self._settle_stopped(delivery, lease, settler)
            return DISCARDED if lease.lost else _OUTCOMES[lease.stop]
        if lease.lost:
            self._discard(delivery)
            return DISCARDED
        if error is not None:
            self.failed += 1
            return await self._settle_failure(delivery, lease, settler, error)
        return SUCCEEDED  # (not reached: a handler that neither failed nor was stopped)

    def _discard(self, delivery: Delivery) -> None:
        self.discarded += 1
        log.warning(
            "task %s: its lease was lost while the handler ran; the result is discarded",
            delivery.task.id,
            extra=_fields(delivery.task, "discarded"),
        )

    @staticmethod
    def _stopped_by_us(lease: _Lease) -> bool:
        """Whether the CancelledError an asyncio handler ended with is the worker's stopping
        it (a cancel, its time limit), and that alone: the cancel it asked for is taken back.
        Another (the worker's own task cancelled) is let through."""
        if lease.abandoned:  # (the thread's future, which stop_now() cancelled; not this task)
            current = asyncio.current_task()
            return current is None or current.cancelling() == 0
        runner = lease.runner
        if lease.stop is None or runner is None:
            return False
        if lease.cancel_sent:
            lease.cancel_sent = False
            return runner.uncancel() == 0
        return runner.cancelling() == 0  # (raised by task.progress(): nobody cancelled it)

    def _interrupt(self, lease: _Lease, why: str) -> None:
        """Stop a task's handler: the broker said the task was cancelled (``_CANCELLED``), or
        it reached its time limit (``_TIMED_OUT``), or the worker is stopping now
        (``_HANDED_BACK``: see :meth:`_hand_back` for threads). An asyncio handler is
        cancelled (the task is nacked once it has unwound); a synchronous one sees
        ``task.cancelled`` (it cannot be interrupted), and the task is nacked at once, the
        thread let run on (holding its handler's slot until it returns); a task still waiting
        for a handler is nacked at once and never handled. No extension is sent from now on.
        Nothing is done once the handler has ended."""
        if lease.done or lease.stop is not None:
            return
        lease.stop = why
        lease.done = True  # (no more extensions)
        self._leases.drop(lease)
        runner = lease.runner
        if runner is not None:
            if runner is not asyncio.current_task():  # (else: task.progress() raises it)
                lease.cancel_sent = True
                runner.cancel()
        elif lease.delivery is not None and lease.settler is not None:
            # A thread, or a task still waiting for a handler: nacked now.
            lease.early = asyncio.ensure_future(
                self._settle_stopped(lease.delivery, lease, lease.settler)
            )

    async def _settle_stopped(self, delivery: Delivery, lease: _Lease, settler: _Settler) -> None:
        """Nack a task whose handler was stopped (see :meth:`_interrupt`), saying why once."""
        task = delivery.task
        if lease.lost:
            self._discard(delivery)
            return
        if lease.stop == _CANCELLED:
            self.cancelled += 1
            log.info(
                "task %s was cancelled: its handler was stopped",
                task.id,
                extra=_fields(task, "cancelled"),
            )
            message = "cancelled"
        elif lease.stop == _HANDED_BACK:
            self.handed_back += 1
            log.warning(
                "task %s handed back (attempt %d of %d): the worker stopped before its "
                "handler ended",
                task.id,
                task.attempts,
                task.max_attempts,
                extra=_fields(task, "handed_back"),
            )
            await self._settle(delivery, lease, lambda: self._give_back(delivery, settler))
            return
        else:
            self.failed += 1
            self.timed_out += 1
            message = f"timed out after {task.timeout_ms} ms"
            log.warning(
                "task %s %s (attempt %d of %d): its handler was stopped",
                task.id,
                message,
                task.attempts,
                task.max_attempts,
                extra=_fields(task, "timed_out"),
            )
        await self._settle(
            delivery,
            lease,
            lambda: settler.nack(delivery, message),
            quiet=lease.stop == _CANCELLED,
        )

    async def _give_back(self, delivery: Delivery, settler: _Settler) -> None:
        """Hand a task back unfinished: released, its attempt not counted (on a stream, once the
        broker has answered its drain: it pushes the task back on it no more). A broker without
        release is nacked with delay 0 and HANDED_BACK_ERROR (which counts the attempt), and
        so from then on."""
        if self._releases is not False and self._drain_now is not None:
            asked = asyncio.ensure_future(self._drain_now())
            await asyncio.wait({asked}, timeout=_DRAIN_WAIT)  # (its failure is no matter)
        if self._releases is None:
            async with self._asking:
                if self._releases is None:
                    if await self._released(delivery):
                        return
        if self._releases and await self._released(delivery):
            return
        await settler.nack(delivery, HANDED_BACK_ERROR, delay_ms=0)

    async def _released(self, delivery: Delivery) -> bool:
        """Release the task; False if the broker has no release (remembered, and said once)."""
        try:
            await self._client.release(delivery)
        except Unsupported as e:
            self._releases = False
            log.warning(
                "the broker has no release (%s): tasks are handed back with a nack, which "
                "counts an attempt",
                e.message,
            )
            return False
        self._releases = True
        return True

    async def _progress(
        self, lease: _Lease, delivery: Delivery, data: bytes, *, in_thread: bool
    ) -> None:
        """A handler's progress report: an extension carrying it (see Task.progress)."""
        task = delivery.task
        settler = lease.settler
        assert settler is not None
        if lease.stop is None and lease.done:
            raise WqError(f"task {task.id}: {_ENDED}")
        if lease.stop is None:
            lease.extending = True
            try:
                lease.deadline = await settler.extend(delivery, self.lease_ms, data)
                return
            except Cancelled:
                self._interrupt(lease, _CANCELLED)
            except TimeLimitReached as e:
                log.debug("task %s: progress not recorded: %s", task.id, e.message)
                return  # (it is stopped at its limit, just after the broker's)
            except _GONE as e:
                lease.lost = True
                self._lost(delivery, e)
                raise
            finally:
                lease.extending = False
        # Stopped: an asyncio handler is cancelled; a synchronous one is told so.
        if not in_thread:
            raise asyncio.CancelledError
        if lease.stop == _CANCELLED:
            raise Cancelled(f"task {task.id} was cancelled")
        raise TimeLimitReached(f"task {task.id} timed out after {task.timeout_ms} ms")

    async def _settle_failure(
        self, delivery: Delivery, lease: _Lease, settler: _Settler, error: Exception
    ) -> str:
        """Nack a task whose handler raised; what became of it (RETRIED or FAILED)."""
        task = delivery.task
        message = describe(error)
        delay_ms = error.delay_ms if isinstance(error, Retry) else None
        terminal = isinstance(error, Fail)
        if terminal:
            log.warning(
                "task %s failed for good: %s", task.id, message, extra=_fields(task, "fail")
            )
        elif isinstance(error, Retry):
            when = "after the backoff" if delay_ms is None else f"in {delay_ms} ms"
            log.info(
                "task %s: retry %s asked for: %s",
                task.id,
                when,
                message,
                extra=_fields(task, "retry"),
            )
        else:
            log.warning(
                "task %s failed (attempt %d of %d): %s",
                task.id,
                task.attempts,
                task.max_attempts,
                message,
                extra=_fields(task, "nack"),
            )
        outcome = FAILED if terminal or task.attempts >= task.max_attempts else RETRIED
        if delay_ms is None and not terminal:
            await self._settle(delivery, lease, lambda: settler.nack(delivery, message))
            return outcome

        async def nack() -> None:
            try:
                if terminal:
                    await settler.nack(delivery, message, terminal=True)
                else:
                    await settler.nack(delivery, message, delay_ms=delay_ms)
            except InvalidArgument as e:
                log.warning(
                    "task %s: the broker refused the nack's options (%s); nacking plainly",
                    task.id,
                    e.message,
                    extra=_fields(task, "nack"),
                )
                await settler.nack(delivery, message)

        await self._settle(delivery, lease, nack)
        return outcome

    async def _keep(
        self, delivery: Delivery, settler: _Settler, lease: _Lease, expires: float
    ) -> None:
        """While the handler runs, extend the lease (which runs out at ``expires``) now, and then
        each time half of it has gone by; never past the task's time limit. A refusal because
        the task was cancelled stops the handler."""
        task_id = delivery.task.id
        span = min(self.lease_ms, MAX_LEASE_MS) / 1000  # the broker caps leases
        while not lease.done:
            asked = self._clock.monotonic()
            if lease.limit is not None and asked >= lease.limit:
                return  # (no extension past the time limit: the handler is stopped there)
            lease.extending = True
            try:
                lease.deadline = await settler.extend(delivery, self.lease_ms)
            except Cancelled:
                self._interrupt(lease, _CANCELLED)
                return
            except TimeLimitReached as e:
                # The broker's limit (from hand-out) comes a little before the worker's own
                # (from when it got the task), which stops the handler: nothing to say.
                log.debug("task %s: no extension past its time limit (%s)", task_id, e.message)
                return
            except _GONE as e:
                lease.lost = True
                self._lost(delivery, e)
                return
            except WqError as e:
                wait = self._extend_failed(delivery, e, expires - asked, span)
            else:
                expires, wait = asked + span, span / 2
            finally:
                lease.extending = False
            await self._clock.sleep(wait)

    def _lost(self, delivery: Delivery, error: WqError) -> None:
        log.warning(
            "task %s: the lease could not be extended: it is lost (%s); the handler's "
            "result will be discarded",
            delivery.task.id,
            error.message,
            extra=_fields(delivery.task, "lease_lost"),
        )

    def _extend_failed(self, delivery: Delivery, error: WqError, left: float, span: float) -> float:
        """An extension failed (not for a lost lease): say so; how long to wait to try again."""
        if isinstance(error, _FATAL):
            self._give_up(error)
        wait = max(left / 2, min(span / 2, _EXTEND_RETRY_MIN))
        log.warning(
            "task %s: could not extend the lease (%s: %s); trying again in %.1fs",
            delivery.task.id,
            type(error).__name__,
            error.message,
            wait,
            extra=_fields(delivery.task, "extend_retry"),
        )
        return wait

    async def _settle(
        self,
        delivery: Delivery,
        lease: _Lease,
        call: Callable[[], Awaitable[None]],
        *,
        quiet: bool = False,
    ) -> None:
        """Ack or nack, retrying while the broker is unreachable and the lease still holds.
        ``quiet``: a nack of a cancelled task, which the broker may have dropped already (its
        lease ran out): that it no longer has it is no news."""
        attempt = 0
        while True:
            try:
                await call()
                return
            except (LeaseLost, NotFound) as e:
                if quiet:
                    log.debug("task %s: already gone (%s)", delivery.task.id, e.message)
                else:
                    self._not_settled(delivery, e)
                return
            except (StreamEnded, *_FATAL) as e:
                self._not_settled(delivery, e)
                return
            except Unavailable as e:
                if datetime.now(UTC) >= lease.deadline:
                    log.warning(
                        "task %s: could not report to the broker before the lease ran out (%s)",
                        delivery.task.id,
                        e.message,
                        extra=_fields(delivery.task, "unreported"),
                    )
                    return
                await asyncio.sleep(min(_BACKOFF_MAX, _BACKOFF_START * 2**attempt))
                attempt += 1

    def _refused(self) -> None:
        """A result the broker refused, the ack that carried it on a stream (nacked)."""
        self.succeeded -= 1
        self.failed += 1

    def _judge_ack(self, delivery: Delivery, answer: asyncio.Future[Any]) -> None:
        """The broker's answer to an ack queued on a stream and not waited for."""
        error = StreamEnded("cancelled") if answer.cancelled() else answer.exception()
        if error is None:
            return
        if not isinstance(error, WqError):
            error = StreamEnded(str(error))
        if isinstance(error, Unavailable):  # (a stream's ack cannot go again elsewhere)
            error = StreamEnded(error.message)
        self._not_settled(delivery, error)

    def _not_settled(self, delivery: Delivery, error: WqError) -> None:
        """An ack or nack that did not land, for a reason worth no retry: say so."""
        if isinstance(error, StreamEnded):
            log.warning(
                "task %s: the stream ended before its outcome was sent; the broker has "
                "taken it back and will retry it",
                delivery.task.id,
                extra=_fields(delivery.task, "stream_ended"),
            )
        elif isinstance(error, LeaseLost | NotFound):
            log.warning(
                "task %s: lease no longer valid (%s); it may run again elsewhere",
                delivery.task.id,
                error.message,
                extra=_fields(delivery.task, "lease_lost"),
            )
        elif isinstance(error, _FATAL):
            self._give_up(error)
        else:
            log.warning(
                "task %s: the broker refused its outcome (%s: %s)",
                delivery.task.id,
                type(error).__name__,
                error.message,
                extra=_fields(delivery.task, "refused"),
            )
