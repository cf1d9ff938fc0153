"""The gRPC transport (grpc.aio) on the generated stubs, one channel per client."""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from datetime import UTC, datetime
from typing import Any, Final

import grpc
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from wqclient._coalesce import Coalescer
from wqclient._tls import ca_error, certificate_error, ssl_context, system_roots
from wqclient.errors import (
    Cancelled,
    Conflict,
    InvalidArgument,
    LeaseLost,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    PermissionDenied,
    ProtocolError,
    StreamEnded,
    TimeLimitReached,
    Unauthenticated,
    Unavailable,
    Unsupported,
    WqError,
)
from wqclient.limits import DEFAULT_TIMEOUT, poll_timeout
from wqclient.models import (
    CANCEL_STATES,
    DEFAULT_QUEUE,
    Delivery,
    Enqueued,
    EnqueueItem,
    Limits,
    ParentResult,
    QueueInfo,
    Schedule,
    ScheduleSpec,
    Stats,
    Task,
    TaskPage,
    TaskResult,
    plain_task,
    with_parents,
    with_schedule,
)
from wqwire.defaults import MAX_GRPC_MESSAGE, RETRY_AFTER_MS_KEY
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

_CODES: dict[grpc.StatusCode, type[WqError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: LeaseLost,
    grpc.StatusCode.ABORTED: LeaseLost,
    grpc.StatusCode.RESOURCE_EXHAUSTED: PayloadTooLarge,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.CANCELLED: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNIMPLEMENTED: Unsupported,  # (a method the broker does not have)
}
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # (not in grpc-stubs)
_BY_NUMBER: dict[int, type[WqError]] = {code.value[0]: kind for code, kind in _CODES.items()}

log = logging.getLogger("wqclient")

_MAX_MESSAGE = MAX_GRPC_MESSAGE
_INT64_MAX: Final = 2**63 - 1

Metadata = tuple[tuple[str, str], ...]


# Sent with RESOURCE_EXHAUSTED when the broker is at a limit (without it: a size limit).
_RETRY_AFTER_KEY = RETRY_AFTER_MS_KEY


# Sent with FAILED_PRECONDITION when the lease was refused because the task was cancelled.
_CANCELLED_KEY: Final = "wq-cancelled"
_FAILED_PRECONDITION: Final = grpc.StatusCode.FAILED_PRECONDITION.value[0]
# How a refusal names the task's time limit (there is no metadata of its own for it:
# docs/design/control.md words it "has reached its time limit of N ms").
_TIME_LIMIT: Final = re.compile(r"\btime limit\b")


def _lease_refusal(message: str, cancelled: bool) -> LeaseLost:
    """The LeaseLost a FAILED_PRECONDITION stands for: Cancelled (``wq-cancelled: 1``, or a
    stream's ``Settled.cancelled``), TimeLimitReached when it names the time limit."""
    if cancelled:
        return Cancelled(message)
    if _TIME_LIMIT.search(message):
        return TimeLimitReached(message)
    return LeaseLost(message)


def _error(e: grpc.aio.AioRpcError) -> WqError:
    message = e.details() or e.code().name
    code = e.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        metadata: Any = e.trailing_metadata()  # a grpc.aio.Metadata (the stubs say otherwise)
        value = str(metadata.get(_RETRY_AFTER_KEY, "")) if metadata else ""
        if value.isdigit():
            return Overloaded(message, retry_after=int(value) / 1000)
    elif code == grpc.StatusCode.FAILED_PRECONDITION:
        trailing: Any = e.trailing_metadata()
        flag = str(trailing.get(_CANCELLED_KEY, "")) if trailing else ""
        return _lease_refusal(message, flag == "1")
    kind = _CODES.get(code, WqError)
    return kind(message)


# How gRPC's core reports a certificate that failed verification: OpenSSL's reason (an unknown
# issuer, an expired certificate ...), or its own check of the host name.
_VERIFY_FAILED: Final = re.compile(r"CERTIFICATE_VERIFY_FAILED(?::\s*([^:;]*[^:;\s]))?")
_WRONG_HOST: Final = ("Hostname Verification Check failed", "is not in peer certificate")


def _certificate_problem(details: str) -> tuple[str, bool] | None:
    """Why a call's details say the broker's certificate failed verification, and whether it is
    for the host name; None if they say something else."""
    found = _VERIFY_FAILED.search(details)
    if found is not None:
        reason = found[0] if found[1] is None else f"CERTIFICATE_VERIFY_FAILED: {found[1]}"
        return reason, False
    if any(words in details for words in _WRONG_HOST):
        return "host name mismatch", True
    return None


def _ts(ts: Timestamp) -> datetime:
    return datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, UTC)


# The datetimes of recent times, by (seconds, nanos): the deliveries of one message mostly share
# their creation time (enqueued together) and their deadline (claimed together).
_TIMES_KEPT = 256
_times: dict[tuple[int, int], datetime] = {}


def _time_of(ts: Timestamp) -> datetime:
    key = (ts.seconds, ts.nanos)
    when = _times.get(key)
    if when is None:
        if len(_times) >= _TIMES_KEPT:
            _times.clear()
        when = _times[key] = datetime.fromtimestamp(key[0] + key[1] / 1e9, UTC)
    return when


class _Fields(Mapping[str, Any]):
    """A message seen as the mapping of its fields that the models' ``from_mapping``
    constructors read: a Timestamp field as an aware datetime, another message field as such a
    mapping, and a field with presence (``optional``, or a message) that is unset as absent."""

    __slots__ = ("_message",)

    def __init__(self, message: Message) -> None:
        self._message = message

    def __getitem__(self, name: str) -> Any:
        message = self._message
        field = message.DESCRIPTOR.fields_by_name.get(name)
        if field is None or (field.has_presence and not message.HasField(name)):
            raise KeyError(name)
        value = getattr(message, name)
        if isinstance(value, Timestamp):
            return _ts(value)
        if isinstance(value, Message):
            return _Fields(value)
        return value

    def __iter__(self) -> Iterator[str]:
        message = self._message
        for field in message.DESCRIPTOR.fields:
            if not field.has_presence or message.HasField(field.name):
                yield field.name

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _delivery(d: pb.Delivery) -> Delivery:
    t = d.task
    if not (
        d.HasField("task")
        and d.HasField("deadline")
        and t.HasField("created_at")
        and t.HasField("available_at")
    ):
        return Delivery.from_mapping(_Fields(d))  # (raises ProtocolError, naming what is missing)
    # The fields read directly: a worker reads one of these per task. (The control fields,
    # seldom set, are looked at once: a time limit, progress or a cancel is never 0 or empty.)
    if t.timeout_ms or t.progress or t.cancelling or t.HasField("expires_at"):
        task = Task(
            t.id,
            t.payload,
            t.attempts,
            t.max_attempts,
            _time_of(t.created_at),
            _time_of(t.available_at),
            t.last_error if t.HasField("last_error") else None,
            t.queue or DEFAULT_QUEUE,
            t.priority,
            None,
            _time_of(t.expires_at) if t.HasField("expires_at") else None,
            t.timeout_ms if t.HasField("timeout_ms") else None,
            t.progress or None,
            t.cancelling,
        )
    else:
        task = plain_task(
            t.id,
            t.payload,
            t.attempts,
            t.max_attempts,
            _time_of(t.created_at),
            _time_of(t.available_at),
            t.last_error if t.HasField("last_error") else None,
            t.queue or DEFAULT_QUEUE,
            t.priority,
        )
    # A task with parents (docs/design/results.md): them, and its after. (A delivered task's
    # result_ttl_ms is left to lookups: reading it would cost every delivery a presence check.)
    if d.parents:
        task = with_parents(task, _parents(d.parents), tuple(t.after) or None)
    if t.schedule:  # (a task a schedule fired: docs/design/schedules.md)
        fired = _time_of(t.scheduled_for) if t.HasField("scheduled_for") else None
        task = with_schedule(task, t.schedule, fired)
    return Delivery(task, d.lease_id, _time_of(d.deadline))


def _parents(parents: Iterable[pb.ParentResult]) -> tuple[ParentResult, ...]:
    return tuple(ParentResult(p.id, p.result if p.HasField("result") else None) for p in parents)


def _enqueue_request(item: EnqueueItem) -> pb.EnqueueRequest:
    out = pb.EnqueueRequest()
    _fill_enqueue(out, item)
    return out


def _fill_enqueue(out: pb.EnqueueRequest, item: EnqueueItem) -> None:
    """``out`` (empty) made the task ``item``, in place: only what is set (a batch's tasks are
    set this way, rather than built and copied in)."""
    out.payload = item.payload_json
    if item.max_attempts is not None:
        out.max_attempts = item.max_attempts
    if item.delay_ms is not None:
        out.delay_ms = item.delay_ms
    if item.queue:
        out.queue = item.queue
    if item.priority is not None:
        out.priority = item.priority
    if item.idempotency_key:
        out.idempotency_key = item.idempotency_key
    if item.expires_in_ms is not None:
        out.expires_in_ms = item.expires_in_ms
    if item.timeout_ms is not None:
        out.timeout_ms = item.timeout_ms
    if item.unique:
        out.unique = True
    if item.after is not None or item.result_ttl_ms is not None:
        _fill_results(out, item)


def _fill_results(out: pb.EnqueueRequest, item: EnqueueItem) -> None:
    """The options of results and workflows (docs/design/results.md): an ``after`` of ids and
    indices (TaskRef), a result TTL."""
    if item.after is not None:
        add = out.after.add
        for ref in item.after:
            if isinstance(ref, str):
                add(id=ref)
            else:
                add(index=ref)
    if item.result_ttl_ms is not None:
        out.result_ttl_ms = item.result_ttl_ms


def _nack_request(
    task_id: str, lease_id: str, error: str | None, delay_ms: int | None, terminal: bool
) -> pb.NackRequest:
    return pb.NackRequest(
        id=task_id, lease_id=lease_id, error=error, delay_ms=delay_ms, terminal=terminal
    )


def _task(
    task: pb.Task,
    state: str | None = None,
    children: Sequence[str] = (),
    children_count: int = 0,
) -> Task:
    fields = dict(_Fields(task))
    if state:
        fields["state"] = state
    if children:
        fields["children"] = list(children)
    if children_count:
        fields["children_count"] = children_count
    return Task.from_mapping(fields)


def _schedule_request(name: str, spec: ScheduleSpec) -> pb.PutScheduleRequest:
    """PutSchedule's request: the members that are set (None leaves a field unset)."""
    return pb.PutScheduleRequest(
        name=name,
        payload=spec.payload_json,
        cron=spec.cron,
        timezone=spec.timezone,
        every_ms=spec.every_ms,
        queue=spec.queue or "",
        priority=spec.priority,
        max_attempts=spec.max_attempts,
        expires_in_ms=spec.expires_in_ms,
        timeout_ms=spec.timeout_ms,
        result_ttl_ms=spec.result_ttl_ms,
        paused=True if spec.paused else None,
    )


def _schedule(response: Any) -> Schedule:
    """The schedule of a response (ProtocolError if it has none)."""
    if not response.HasField("schedule"):
        raise ProtocolError("the broker's answer has no schedule")
    return Schedule.from_mapping(_Fields(response.schedule))


def _queue_limits(limits: Limits) -> pb.QueueLimits:
    out = pb.QueueLimits()
    if limits.rate is not None:
        out.rate.tasks = limits.rate.tasks
        out.rate.per_ms = limits.rate.per_ms
        if limits.rate.burst is not None:
            out.rate.burst = limits.rate.burst
    if limits.concurrency is not None:
        out.concurrency = limits.concurrency
    return out


def _outcome(outcome: pb.Settled) -> datetime | None:
    """What a settlement's future resolves to: an extend's new deadline; None for the rest."""
    return _ts(outcome.deadline) if outcome.extend else None


class GrpcStream:
    """One StreamJobs call. Acks, nacks and extends issued close together go out in one request
    (the broker applies a request's extends, then its acks, then its nacks, and answers each in
    that order)."""

    def __init__(
        self,
        stub: pb_grpc.BrokerAsyncStub,
        prefetch: int,
        lease_ms: int | None,
        metadata: Metadata | None = None,
        queues: Sequence[str] | None = None,
    ) -> None:
        opening = pb.StreamOpen(prefetch=prefetch, lease_ms=lease_ms, queues=queues or ())
        self._loop = asyncio.get_running_loop()
        self._outbox: list[pb.StreamJobsRequest] = [pb.StreamJobsRequest(open=opening)]
        # The request being gathered (settlements are set in it field by field), and what it
        # holds: a settlement of a kind the broker applies before one already in it starts the
        # next request.
        self._batch: pb.StreamJobsRequest | None = None
        self._batch_settles = False  # it has acks or nacks
        self._batch_nacks = False  # it has nacks
        self._wake = asyncio.Event()
        self._wake.set()
        self._closing = False
        # Futures for settlements in the order the broker will answer them.
        self._settling: deque[asyncio.Future[Any]] = deque()
        # Deliveries received and not yet taken; then, once the call is over, how it ended.
        self._ready: deque[Delivery] = deque()
        self._waiter: asyncio.Future[None] | None = None  # an __anext__ waiting for one
        self._over = False
        self._end: BaseException | None = None  # the error the iteration ends with, if any
        self._opened = asyncio.Event()
        self._drained: asyncio.Future[int] | None = None  # the answer to our drain, once sent
        # Unconfirmed acks and nacks the broker refused, until flush() hands them over.
        self._refused: list[tuple[Delivery, WqError]] = []
        # Cancels of tasks this stream holds (StreamJobsResponse.cancels), as (task id, lease
        # id): given to the on_cancel callback, or kept for take_cancels() until there is one;
        # and those of deliveries not yet taken, by lease, held back until they are.
        self._on_cancel: Callable[[str, str], None] | None = None
        self._cancels: list[tuple[str, str]] = []
        self._held_back: dict[str, str] = {}
        self._call = stub.StreamJobs(self._requests(), metadata=metadata)
        self._reader = self._loop.create_task(self._read())

    def _batched(self) -> bool:
        return self._batch is not None

    def _gathering(self) -> pb.StreamJobsRequest:
        batch = self._batch
        if batch is None:
            batch = self._batch = pb.StreamJobsRequest()
        return batch

    def _flush(self) -> None:
        """Queue the batch being gathered as one request."""
        if self._batch is not None:
            self._outbox.append(self._batch)
            self._batch = None
            self._batch_settles = self._batch_nacks = False

    async def _requests(self) -> AsyncIterator[pb.StreamJobsRequest]:
        while True:
            await self._wake.wait()
            # One turn of the loop more: the settlements made by whatever else is ready to run
            # (the handlers of other deliveries) go in the same message.
            await asyncio.sleep(0)
            self._wake.clear()
            self._flush()
            outbox, self._outbox = self._outbox, []
            for request in outbox:
                yield request
            if self._closing and not self._batched():
                return

    async def _read(self) -> None:
        """Take the broker's responses until the call ends, then end the stream."""
        end: BaseException | None = None
        try:
            async for response in self._call:
                self._opened.set()
                if response.settled:
                    self._settled(response.settled)
                if response.deliveries:
                    self._received(response.deliveries)
                if response.cancels:
                    self._cancelled(response.cancels)
                if response.HasField("drained") and self._drained and not self._drained.done():
                    self._drained.set_result(response.drained.unsettled)
        except grpc.aio.AioRpcError as e:
            end = self._why_broken(e)
        except WqError as e:  # a response this client cannot read
            end = e
            self._call.cancel()
        except asyncio.CancelledError:
            end = StreamEnded("the stream was closed")
        finally:
            self._ended(end)

    def _settled(self, outcomes: Iterable[pb.Settled]) -> None:
        """Resolve the waiting settlements with the broker's outcomes, oldest first."""
        settling = self._settling
        for outcome in outcomes:
            future = settling.popleft() if settling else None
            if future is None or future.done():
                continue
            if outcome.code == 0:
                future.set_result(_outcome(outcome))
            elif outcome.code == _FAILED_PRECONDITION:
                future.set_exception(_lease_refusal(outcome.message, outcome.cancelled))
            else:
                kind = _BY_NUMBER.get(outcome.code, WqError)
                future.set_exception(kind(outcome.message))

    def _received(self, deliveries: Iterable[pb.Delivery]) -> None:
        ready = self._ready
        try:
            for delivery in deliveries:
                ready.append(_delivery(delivery))
        finally:  # (the ones read before one that cannot be are handed over)
            self._wake_taker()

    def _cancelled(self, cancels: Iterable[pb.Cancel]) -> None:
        """Tell of the cancels (those of deliveries not yet taken once they are)."""
        for cancel in cancels:
            lease_id = cancel.lease_id
            if any(d.lease_id == lease_id for d in self._ready):
                self._held_back[lease_id] = cancel.id
            else:
                self._tell_cancel(cancel.id, lease_id)

    def _tell_cancel(self, task_id: str, lease_id: str) -> None:
        callback = self._on_cancel
        if callback is None:
            self._cancels.append((task_id, lease_id))
            return
        try:
            callback(task_id, lease_id)
        except Exception:  # (a callback's bug must not end the stream)
            log.exception("task %s: the stream's cancel callback failed", task_id)

    def on_cancel(self, callback: Callable[[str, str], None] | None) -> None:
        """Call ``callback(task_id, lease_id)`` for each task this stream delivered that is
        cancelled while it is held (the broker's ``StreamJobsResponse.cancels``; a delivery not
        yet taken from the stream, once it is taken, after the code that took it has run): stop
        working on it, and nack it (the broker then drops it without a retry). The cancels that
        came before a callback was set go to it at once. None: keep them for
        :meth:`take_cancels` again."""
        self._on_cancel = callback
        if callback is not None:
            pending, self._cancels = self._cancels, []
            for task_id, lease_id in pending:
                self._tell_cancel(task_id, lease_id)

    def take_cancels(self) -> list[tuple[str, str]]:
        """The cancels that came while no callback was set (see :meth:`on_cancel`), as
        ``(task_id, lease_id)``, oldest first; each is returned once."""
        taken, self._cancels = self._cancels, []
        return taken

    def _wake_taker(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _why_broken(self, e: grpc.aio.AioRpcError) -> WqError | None:
        """The error a call that failed with ``e`` ends the stream with: None if close()
        cancelled it; StreamEnded if the connection broke or the broker went away."""
        if self._closing and e.code() == grpc.StatusCode.CANCELLED:
            return None
        error = _error(e)
        if isinstance(error, Unavailable) and not isinstance(error, Overloaded):
            return StreamEnded(f"the stream broke: {error.message}")
        return error

    def _ended(self, end: BaseException | None) -> None:
        """The call is over: fail the settlements (and the drain) still waiting (with ``end``,
        or StreamEnded), and end the iteration (raising ``end`` if it is an error)."""
        self._opened.set()
        failure = end or StreamEnded("the stream has ended")
        waiting = [*self._settling, *([self._drained] if self._drained else [])]
        self._settling.clear()
        for future in waiting:
            if not future.done():
                future.set_exception(failure)
                future.exception()  # retrieved: nobody may be waiting for a drain's answer
        self._over, self._end = True, end
        self._wake_taker()

    def __aiter__(self) -> GrpcStream:
        return self

    async def __anext__(self) -> Delivery:
        ready = self._ready
        while not ready:
            if self._over:  # (the deliveries received before the end come first)
                if self._end is not None:
                    raise self._end
                raise StopAsyncIteration
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        delivery = ready.popleft()
        if self._held_back:
            task_id = self._held_back.pop(delivery.lease_id, None)
            if task_id is not None:  # (told once the taker has run on with it)
                self._loop.call_soon(self._tell_cancel, task_id, delivery.lease_id)
        return delivery

    async def wait_open(self, timeout: float) -> None:
        """Return once the broker has accepted the stream; raise if it ended first."""
        try:
            await asyncio.wait_for(self._opened.wait(), timeout)
        except TimeoutError:
            self._call.cancel()
            raise Unavailable("the broker did not accept the stream in time") from None
        if self._reader.done():
            if isinstance(self._end, WqError):
                raise self._end
            raise StreamEnded("the stream ended as it opened")

    def _settle(self) -> asyncio.Future[Any]:
        if self._reader.done() or self._closing:
            raise StreamEnded("the stream has ended")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._settling.append(future)
        self._wake.set()
        return future

    def _check_open(self) -> None:
        if self._reader.done() or self._closing:
            raise StreamEnded("the stream has ended")

    async def extend(
        self, delivery: Delivery, lease_ms: int | None = None, *, progress: bytes | None = None
    ) -> datetime:
        """Extend a delivery's lease (``progress``: JSON text to record on the task). Raises
        Cancelled if the task was cancelled, TimeLimitReached at its time limit, LeaseLost or
        NotFound as an ack does."""
        self._check_open()
        # Extends go first in a request: one after acks or nacks starts a new request.
        if self._batch_settles:
            self._flush()
        added = self._gathering().extends.add()
        added.id = delivery.task.id
        added.lease_id = delivery.lease_id
        if lease_ms is not None:
            added.lease_ms = lease_ms
        if progress is not None:
            added.progress = progress
        deadline: datetime = await self._settle()
        return deadline

    def _ack(self, delivery: Delivery, result: bytes | None = None) -> asyncio.Future[Any]:
        """Gather an ack (with the task's result, JSON text, if given); the future of its
        outcome."""
        self._check_open()
        # The broker settles a request's acks before its nacks: keep the futures in that order.
        if self._batch_nacks:
            self._flush()
        added = self._gathering().acks.add()
        added.id = delivery.task.id
        added.lease_id = delivery.lease_id
        if result is not None:
            added.result = result
        self._batch_settles = True
        return self._settle()

    def ack_soon(self, delivery: Delivery, result: bytes | None = None) -> asyncio.Future[Any]:
        """Queue an ack (raising StreamEnded if the stream is over); the future of the broker's
        answer, for the caller to judge (nothing is logged, nothing kept for :meth:`flush`).
        ``result``: the task's result, JSON text."""
        return self._ack(delivery, result)

    async def ack(self, delivery: Delivery, *, confirm: bool = False, result: Any = None) -> None:
        """As :meth:`AsyncStream.ack <wqclient.AsyncStream.ack>`; ``result``: the task's
        result, JSON text (``bytes``) or any JSON value, encoded here (None: no result;
        ``b"null"`` for JSON null)."""
        if result is not None and not isinstance(result, bytes):
            from wqclient.client import encode_result  # (not at the top: it imports this)

            result = encode_result(result)
        future = self._ack(delivery, result)
        if confirm:
            await future
        else:
            self._later(delivery, "ack", future)

    async def nack(
        self,
        delivery: Delivery,
        error: str | None = None,
        delay_ms: int | None = None,
        terminal: bool = False,
        *,
        confirm: bool = False,
    ) -> None:
        self._check_open()
        self._gathering().nacks.append(
            _nack_request(delivery.task.id, delivery.lease_id, error, delay_ms, terminal)
        )
        self._batch_settles = self._batch_nacks = True
        future = self._settle()
        if confirm:
            await future
        else:
            self._later(delivery, "nack", future)

    def _later(self, delivery: Delivery, what: str, future: asyncio.Future[Any]) -> None:
        """Let a settlement's outcome come later (no ``confirm``): a refusal is then logged and
        kept for :meth:`flush`."""

        def landed(done: asyncio.Future[Any]) -> None:
            error = None if done.cancelled() else done.exception()
            if error is None:
                return
            wq_error = error if isinstance(error, WqError) else WqError(str(error))
            log.warning("task %s: the %s was refused: %s", delivery.task.id, what, wq_error)
            self._refused.append((delivery, wq_error))

        future.add_done_callback(landed)

    async def flush(self) -> list[tuple[Delivery, WqError]]:
        """Wait until the broker has answered every ack, nack and extend sent on this stream so
        far; return the acks and nacks it refused that were not confirmed, since the last
        flush (each with its error: LeaseLost, NotFound, or StreamEnded if the stream ended
        before the answer came, when the settlement may or may not have been applied)."""
        self._flush()
        self._wake.set()
        waiting = list(self._settling)
        if waiting:
            await asyncio.gather(*waiting, return_exceptions=True)
        refused, self._refused = self._refused, []
        return refused

    def set_prefetch(self, prefetch: int) -> None:
        """The stream's prefetch from now on: it goes out with the next request, ahead of the
        settlements gathered in it (the broker applies it first). No answer comes."""
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise InvalidArgument(f"prefetch must be an integer from 1, got {prefetch!r}")
        self._check_open()
        self._gathering().prefetch = min(prefetch, _INT64_MAX)  # (the broker clamps it)
        self._wake.set()

    def _send_drain(self) -> asyncio.Future[int]:
        if self._drained is None:
            self._drained = self._loop.create_future()
            if self._reader.done():
                self._drained.set_exception(StreamEnded("the stream has ended"))
                self._drained.exception()
            else:
                self._flush()  # the settlements asked for before it go first
                self._outbox.append(pb.StreamJobsRequest(drain=True))
                self._wake.set()
        return self._drained

    async def drain(self) -> int:
        """Ask for no new tasks; returns the broker's answer, how many deliveries sent on this
        stream are not yet settled (those not yet received included). The broker ends the stream
        once they are settled (iteration then stops)."""
        return await asyncio.shield(self._send_drain())

    async def close(self) -> None:
        """Drain, half-close after sending what is queued, and wait for the broker to end the
        call. Tasks received and not settled are reclaimed by the broker."""
        if not self._closing:
            self._send_drain()
            self._closing = True
            self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), 10)
        except TimeoutError:
            self._call.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


# The largest batch sent over the producing stream (encoded): under the 4 MiB that every broker
# receives, so the stream is never ended for a message's size (which would leave the batches
# before it in doubt). A larger one goes in an EnqueueBatch call of its own.
_PRODUCE_MAX_BYTES = 3 * 1024 * 1024
# Batches go round this many producing streams, each a call the channel's balancer placed (so a
# client given several brokers spreads its batches over them, as it does its calls)...
_PRODUCE_STREAMS = 4
# ... and each is replaced by a new call after this many seconds (a broker added since, or one
# back from a restart, gets its share).
_PRODUCE_STREAM_AGE = 60.0


class _NotTaken(Exception):
    """The producing stream ended OK (the broker is shutting down) without answering this
    batch: nothing of it was enqueued, it may be sent again."""


class _NoProduce(Exception):
    """The broker has no Produce method (an older one): nothing was enqueued."""


def _refusal(response: pb.ProduceResponse) -> WqError:
    """The error of a batch the broker refused, as its EnqueueBatch call would have raised."""
    message = response.message or f"the broker refused the batch (code {response.code})"
    if response.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and response.retry_after_ms:
        return Overloaded(message, retry_after=response.retry_after_ms / 1000)
    return _BY_NUMBER.get(response.code, WqError)(message)


class _Producer:
    """One Produce call: batches written in order, one at a time; each answer is the oldest
    unanswered batch's (the broker answers in order)."""

    def __init__(self, stub: pb_grpc.BrokerAsyncStub, metadata: Metadata | None) -> None:
        self._loop = asyncio.get_running_loop()
        # (write() and read(), not iterators: one message costs less that way.)
        produce: Any = stub.Produce
        self._call: Any = produce(metadata=metadata)
        self._writing = asyncio.Lock()
        self._waiting: deque[asyncio.Future[pb.ProduceResponse]] = deque()
        self.over = False  # no batch may be sent on it any more
        self.born = self._loop.time()
        self._cancelled: Unavailable | None = None  # why cancel() cut it short
        self._reader = self._loop.create_task(self._read())
        self._half_closing: asyncio.Task[None] | None = None

    async def send(self, request: pb.EnqueueBatchRequest) -> pb.ProduceResponse:
        """The broker's answer to ``request``; raises _NotTaken, _NoProduce, or the error the
        stream ended with (Unavailable: the batch is in doubt)."""
        future: asyncio.Future[pb.ProduceResponse] = self._loop.create_future()
        async with self._writing:
            if self.over:
                raise _NotTaken("the producing stream has ended")
            self._waiting.append(future)
            try:
                await self._call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
                raise self._unsent(future, e) from None
            except asyncio.CancelledError:
                # Sent or not, nobody can tell: the answers could no longer be matched with
                # their batches.
                self.cancel("the sending of a batch was interrupted")
                task = asyncio.current_task()
                if task is not None and task.cancelling() == 0:
                    # Not this caller cancelled, but the call under it (the client closing):
                    # the batch is in doubt, as for a stream that broke.
                    raise Unavailable(
                        "the producing stream was cancelled (the client is closing)"
                    ) from None
                raise
        return await future

    def _unsent(self, future: asyncio.Future[pb.ProduceResponse], error: Exception) -> Exception:
        """What a batch whose write failed raises. The call was over before the batch went out
        (a write that fails sends nothing), so nothing of it was enqueued: _NotTaken, unless
        the call ended with a refusal of the stream itself (no Produce method, a token's).
        Whatever else the call reports does not put the batch in doubt: grpc.aio may report
        INTERNAL, "Internal error from Core", for a write that failed after the broker ended
        the call OK (grpc/grpc#36066)."""
        if future in self._waiting:
            self._waiting.remove(future)
        elif future.done() and not future.cancelled():
            future.exception()  # (failed by the reader already: the error here is the one)
        if isinstance(error, grpc.aio.AioRpcError):
            end = self._why_ended(error)
            if not isinstance(end, Unavailable):
                return end  # (_NoProduce, or a token's refusal)
        return _NotTaken("the producing stream ended before the batch was sent")

    async def _read(self) -> None:
        end: BaseException = _NotTaken("the broker ended the producing stream")
        try:
            while True:
                response = await self._call.read()
                if response is _EOF:
                    break
                if not self._waiting:
                    self._call.cancel()
                    end = ProtocolError("the broker answered a batch that was not sent")
                    break
                future = self._waiting.popleft()
                if not future.done():
                    future.set_result(response)
        except grpc.aio.AioRpcError as e:
            end = self._why_ended(e)
        except asyncio.CancelledError:  # (what read() raises once the call is cancelled)
            end = self._cancelled or Unavailable("the client is closing")
        finally:
            self.over = True
            waiting, self._waiting = self._waiting, deque()
            for future in waiting:
                if not future.done():
                    future.set_exception(end)

    @staticmethod
    def _why_ended(e: grpc.aio.AioRpcError) -> Exception:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            return _NoProduce(e.details() or "no Produce method")
        error = _error(e)
        if isinstance(error, Unauthenticated | PermissionDenied):
            # (Checked before the broker reads a batch: the batches not answered were not read.)
            return error
        # Anything else may have cut a batch short, enqueued and not answered: in doubt.
        return Unavailable(f"the producing stream broke: {error.message}")

    def ended(self, callback: Callable[[_Producer], None]) -> None:
        """Call ``callback`` with this stream once its call is over."""
        self._reader.add_done_callback(lambda _: callback(self))

    def retire(self) -> None:
        """Send no more batches on it: half-close once the last is written (the broker answers
        every batch sent, then ends the call)."""
        self.over = True
        self._half_closing = self._loop.create_task(self._half_close())

    async def _half_close(self) -> None:
        async with self._writing:
            try:
                await self._call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # already over

    def cancel(self, why: str) -> None:
        """Cut the stream short: its unanswered batches fail (in doubt) with ``why``."""
        self.over = True
        self._cancelled = Unavailable(why)
        self._call.cancel()

    async def close(self) -> None:
        self.cancel("the client is closing")
        await asyncio.gather(self._reader, return_exceptions=True)


_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Reconnect quickly after a broker restart, and do not share a failed connection's
    # backoff with other clients in this process.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 5_000),
    ("grpc.use_local_subchannel_pool", 1),
    # Several brokers behind one target (``ipv4:a:p,b:p``, or a DNS name with several addresses):
    # calls and streams are spread over them, and go to the others while one is down.
    ("grpc.lb_policy_name", "round_robin"),
]


def channel_credentials(ca_file: str | None) -> grpc.ChannelCredentials:
    """Channel credentials for ``grpcs://``, trusting ``ca_file`` or the system store. Raises
    WqError if ``ca_file`` cannot be read or holds no certificate."""
    if ca_file is None:
        return grpc.ssl_channel_credentials(system_roots())
    ssl_context(ca_file)  # the same checks (readable, PEM certificates) as for https://
    try:
        with open(ca_file, "rb") as f:
            roots = f.read()
    except OSError as e:
        raise ca_error(ca_file, e) from None
    return grpc.ssl_channel_credentials(roots)


class GrpcTransport:
    """The gRPC API over one channel: a :class:`~wqclient.transport.StreamingTransport`.

    ``token``: sent with every call as ``authorization: Bearer`` metadata. ``credentials``: TLS
    channel credentials (``grpcs://``); None for a plaintext channel."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._target = target
        self._timeout = timeout
        self._metadata: Metadata | None = (("authorization", f"Bearer {token}"),) if token else None
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=_OPTIONS)
        self._stub = pb_grpc.BrokerStub(self._channel)
        # (A lone task too goes over the producing stream, a message rather than a call.)
        self._coalescer = Coalescer(self._enqueue_one, self.enqueue_many, lone_batched=True)
        self._producers: list[_Producer | None] = [None] * _PRODUCE_STREAMS
        self._turn = 0  # the next batch's producing stream
        self._retiring: set[_Producer] = set()  # replaced, and answering their last batches
        self._produces = True  # until the broker turns out to have no Produce method

    def _unreachable(self, error: Unavailable) -> Unavailable:
        """The error for a broker that cannot be reached (a CertificateError if its certificate
        failed verification)."""
        where = f"cannot reach the broker at {self._target}"
        problem = _certificate_problem(error.message)
        if problem is not None:
            return certificate_error(where, *problem)
        return Unavailable(f"{where}: {error.message}")

    async def _unary(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return await method(request, timeout=timeout or self._timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            error = _error(e)
            if isinstance(error, Unavailable) and not isinstance(error, Overloaded):
                error = self._unreachable(error)
            raise error from None

    def enqueue(
        self,
        payload_json: bytes,
        max_attempts: int | None,
        delay_ms: int | None,
        queue: str | None = None,
        priority: int | None = None,
        idempotency_key: str | None = None,
        *,
        expires_in_ms: int | None = None,
        timeout_ms: int | None = None,
        unique: bool = False,
        after: Sequence[str] | None = None,
        result_ttl_ms: int | None = None,
    ) -> Awaitable[Enqueued]:
        """One task. Enqueues made in the same turn of the event loop (concurrent callers) go
        to the broker together, as one batch (:meth:`enqueue_many`), each caller getting its
        own answer (see :class:`~wqclient._coalesce.Coalescer`); a lone call goes as a batch
        of one (sent again with an Enqueue call if refused, for its own error). (The answer's
        future itself: no coroutine of its own per task.)"""
        item = EnqueueItem(
            payload_json,
            max_attempts,
            delay_ms,
            queue,
            priority,
            idempotency_key,
            expires_in_ms,
            timeout_ms,
            unique,
            None if after is None else tuple(after),
            result_ttl_ms,
        )
        return self._coalescer.add(item)

    async def _enqueue_one(self, item: EnqueueItem) -> Enqueued:
        response = await self._unary(self._stub.Enqueue, _enqueue_request(item))
        return Enqueued(str(response.id), bool(response.duplicate))

    async def enqueue_many(self, items: Sequence[EnqueueItem]) -> list[Enqueued]:
        """A batch, all or none: over the producing stream (one message each way, no call of
        its own), or in an EnqueueBatch call if it is large or the broker has no Produce."""
        request = pb.EnqueueBatchRequest()
        add = request.tasks.add
        for item in items:
            _fill_enqueue(add(), item)
        response: pb.ProduceResponse | pb.EnqueueBatchResponse | None = None
        if self._produces and request.ByteSize() <= _PRODUCE_MAX_BYTES:
            response = await self._produce(request)
        if response is None:
            response = await self._unary(self._stub.EnqueueBatch, request)
        ids = response.ids
        duplicates = response.duplicates
        if not duplicates:
            return [Enqueued(i) for i in ids]
        if len(duplicates) != len(ids):
            raise ProtocolError("the broker answered a batch with not as many duplicates as ids")
        return [Enqueued(i, d) for i, d in zip(ids, duplicates, strict=True)]

    async def _produce(self, request: pb.EnqueueBatchRequest) -> pb.ProduceResponse | None:
        """The broker's answer to a batch sent over the producing stream (opened when needed);
        None if the broker has no Produce method, or two streams ended without taking the
        batch (a broker shutting down, say): it was not enqueued, and goes in an EnqueueBatch
        call instead, answered (or refused) for itself."""
        again = True  # a batch the broker did not take is sent once more, on a new stream
        while True:
            producer = self._next_producer()
            try:
                async with asyncio.timeout(self._timeout):
                    response = await producer.send(request)
            except TimeoutError:
                why = f"no answer to a batch in {self._timeout:g} s"
                producer.cancel(why)  # (the batches behind this one would wait as long)
                raise self._unreachable(Unavailable(why)) from None
            except _NoProduce:
                self._produces = False
                return None
            except _NotTaken:
                if not again:
                    return None  # (a stream ended twice without it: it goes in a call)
                again = False
                continue
            except Unavailable as e:
                raise (e if isinstance(e, Overloaded) else self._unreachable(e)) from None
            if response.code:
                raise _refusal(response)
            return response

    def _next_producer(self) -> _Producer:
        """The producing stream whose turn it is: opened if it is not (or no longer) open, and
        replaced by a new one once it is old."""
        turn = self._turn
        self._turn = (turn + 1) % _PRODUCE_STREAMS
        producer = self._producers[turn]
        if producer is not None and not producer.over:
            if asyncio.get_running_loop().time() - producer.born < _PRODUCE_STREAM_AGE:
                return producer
            producer.retire()
            self._retiring.add(producer)
            producer.ended(self._retiring.discard)
        producer = self._producers[turn] = _Producer(self._stub, self._metadata)
        return producer

    async def claim(
        self, wait_ms: int | None, lease_ms: int | None, queues: Sequence[str] | None = None
    ) -> Delivery | None:
        response = await self._unary(
            self._stub.NextJob,
            pb.NextJobRequest(wait_ms=wait_ms, lease_ms=lease_ms, queues=queues or ()),
            timeout=poll_timeout(wait_ms),
        )
        if not response.HasField("delivery"):
            return None
        return _delivery(response.delivery)

    async def ack(self, task_id: str, lease_id: str, *, result: bytes | None = None) -> None:
        request = pb.AckRequest(id=task_id, lease_id=lease_id)
        if result is not None:
            request.result = result
        await self._unary(self._stub.Ack, request)

    async def nack(
        self,
        task_id: str,
        lease_id: str,
        error: str | None,
        delay_ms: int | None = None,
        terminal: bool = False,
    ) -> None:
        request = _nack_request(task_id, lease_id, error, delay_ms, terminal)
        await self._unary(self._stub.Nack, request)

    async def release(self, task_id: str, lease_id: str) -> None:
        """Release: the task back without counting the attempt. Unsupported from a broker
        without the method (UNIMPLEMENTED)."""
        await self._unary(self._stub.Release, pb.ReleaseRequest(id=task_id, lease_id=lease_id))

    async def extend(
        self, task_id: str, lease_id: str, lease_ms: int | None, *, progress: bytes | None = None
    ) -> datetime:
        request = pb.ExtendLeaseRequest(
            id=task_id, lease_id=lease_id, lease_ms=lease_ms, progress=progress or b""
        )
        response = await self._unary(self._stub.ExtendLease, request)
        return _ts(response.deadline)

    async def get_task(self, task_id: str) -> Task:
        response = await self._unary(self._stub.GetTask, pb.GetTaskRequest(id=task_id))
        return _task(response.task, response.state, response.children, response.children_count)

    async def wait_result(self, task_id: str, wait_ms: int | None) -> TaskResult | None:
        request = pb.WaitResultRequest(id=task_id, wait_ms=wait_ms)
        timeout = self._timeout if not wait_ms else poll_timeout(wait_ms)
        response = await self._unary(self._stub.WaitResult, request, timeout=timeout)
        if not response.state:
            return None
        return TaskResult.from_mapping(_Fields(response), task_id)

    async def stats(self, queue: str | None = None) -> Stats:
        response = await self._unary(self._stub.Stats, pb.StatsRequest(queue=queue or ""))
        return Stats.from_mapping(_Fields(response))

    async def queues(self) -> list[QueueInfo]:
        response = await self._unary(self._stub.ListQueues, pb.ListQueuesRequest())
        return [QueueInfo.from_mapping(_Fields(q)) for q in response.queues]

    async def dead_letters(self, limit: int | None, queue: str | None = None) -> list[Task]:
        request = pb.ListDeadRequest(limit=limit, queue=queue or "")
        response = await self._unary(self._stub.ListDead, request)
        return [_task(t) for t in response.tasks]

    async def requeue(self, task_id: str) -> None:
        await self._unary(self._stub.Requeue, pb.RequeueRequest(id=task_id))

    async def requeue_all(self, queue: str | None = None) -> int:
        response = await self._unary(self._stub.RequeueAll, pb.RequeueAllRequest(queue=queue or ""))
        return int(response.requeued)

    async def purge(self, task_id: str) -> None:
        await self._unary(self._stub.PurgeDead, pb.PurgeDeadRequest(id=task_id))

    async def pause(self, queue: str) -> None:
        await self._unary(self._stub.PauseQueue, pb.PauseQueueRequest(queue=queue))

    async def resume(self, queue: str) -> None:
        await self._unary(self._stub.ResumeQueue, pb.ResumeQueueRequest(queue=queue))

    async def cancel(self, task_id: str) -> str:
        response = await self._unary(self._stub.CancelTask, pb.CancelTaskRequest(id=task_id))
        if response.state not in CANCEL_STATES:
            raise ProtocolError(f"the broker answered a cancel with state {response.state!r}")
        return str(response.state)

    async def list_tasks(
        self, queue: str | None, state: str | None, limit: int | None, cursor: str | None
    ) -> TaskPage:
        request = pb.ListTasksRequest(
            queue=queue or "", state=state or "", limit=limit, cursor=cursor or ""
        )
        response = await self._unary(self._stub.ListTasks, request)
        tasks = [_task(row.task, row.state) for row in response.tasks]
        return TaskPage(tasks, response.next_cursor or None)

    async def empty_queue(self, queue: str) -> int:
        response = await self._unary(self._stub.EmptyQueue, pb.EmptyQueueRequest(queue=queue))
        return int(response.cancelled)

    async def delete_queue(self, queue: str) -> None:
        try:
            await self._unary(self._stub.DeleteQueue, pb.DeleteQueueRequest(queue=queue))
        except LeaseLost as e:  # (FAILED_PRECONDITION here: the queue holds tasks)
            raise Conflict(e.message) from None

    # -- schedules and limits (docs/design/schedules.md) ------------------------------------

    async def put_schedule(self, name: str, spec: ScheduleSpec) -> Schedule:
        response = await self._unary(self._stub.PutSchedule, _schedule_request(name, spec))
        return _schedule(response)

    async def get_schedule(self, name: str) -> Schedule:
        response = await self._unary(self._stub.GetSchedule, pb.GetScheduleRequest(name=name))
        return _schedule(response)

    async def list_schedules(self) -> list[Schedule]:
        response = await self._unary(self._stub.ListSchedules, pb.ListSchedulesRequest())
        return [Schedule.from_mapping(_Fields(s)) for s in response.schedules]

    async def delete_schedule(self, name: str) -> None:
        await self._unary(self._stub.DeleteSchedule, pb.DeleteScheduleRequest(name=name))

    async def pause_schedule(self, name: str) -> Schedule:
        response = await self._unary(self._stub.PauseSchedule, pb.PauseScheduleRequest(name=name))
        return _schedule(response)

    async def resume_schedule(self, name: str) -> Schedule:
        request = pb.ResumeScheduleRequest(name=name)
        return _schedule(await self._unary(self._stub.ResumeSchedule, request))

    async def set_limits(self, queue: str, limits: Limits | None) -> Limits | None:
        request = pb.SetQueueLimitsRequest(queue=queue)
        if limits is not None and not limits.empty:
            request.limits.CopyFrom(_queue_limits(limits))
        response = await self._unary(self._stub.SetQueueLimits, request)
        if not response.HasField("limits"):
            return None
        found = Limits.from_mapping(_Fields(response.limits))
        return None if found.empty else found

    async def stream(
        self, prefetch: int, lease_ms: int | None, queues: Sequence[str] | None = None
    ) -> GrpcStream:
        stream = GrpcStream(self._stub, prefetch, lease_ms, self._metadata, queues)
        try:
            await stream.wait_open(self._timeout)
        except Unavailable as e:
            if isinstance(e, Overloaded):
                raise
            raise self._unreachable(e) from None
        return stream

    async def close(self) -> None:
        producers = [p for p in self._producers if p is not None] + list(self._retiring)
        self._producers = [None] * _PRODUCE_STREAMS
        await asyncio.gather(*(p.close() for p in producers))
        await self._channel.close(None)
