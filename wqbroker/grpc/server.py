"""grpc.aio servicer, pb <-> model conversion, and the error -> status code table.

Like the HTTP handlers, each method parses its request, calls the service and renders the answer;
the service holds every default, cap and rule, so both protocols behave the same. Requests that
cannot be decoded never reach these methods as messages (see :mod:`wqbroker.grpc.decoding`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, Final, NamedTuple, NoReturn

import grpc
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from wqbroker.dispatch import Stream
from wqbroker.errors import (
    Cancelled,
    Conflict,
    InvalidArgument,
    LeaseLost,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    WqError,
    lookup,
)
from wqbroker.grpc import reflection
from wqbroker.grpc.decoding import guarded, handler_table
from wqbroker.models import (
    DEAD,
    SUCCEEDED,
    Delivery,
    Enqueued,
    Limits,
    Outcome,
    QueueStats,
    Schedule,
    Task,
    TaskState,
)
from wqbroker.service import ScheduleSubmission, Service, Submission
from wqwire.defaults import CANCELLED_KEY, MAX_GRPC_MESSAGE, RETRY_AFTER_MS_KEY
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

log = logging.getLogger("wqbroker.grpc")

# The one table from the error tree to gRPC status codes (a subclass maps as its parent).
CODES: Final[dict[type[WqError], grpc.StatusCode]] = {
    WqError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    LeaseLost: grpc.StatusCode.FAILED_PRECONDITION,  # Cancelled and TimeLimitReached are ones
    Conflict: grpc.StatusCode.FAILED_PRECONDITION,
    PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,  # StoreError is one
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

# Status details and Settled messages: at most this many bytes of UTF-8 (a longer one is cut and
# ends with TRUNCATED). gRPC percent-encodes details into metadata, so this is at most 3 KiB there.
MAX_DETAILS_BYTES: Final = 1024
TRUNCATED: Final = " [truncated]"

SERVICE_NAME: Final = pb.DESCRIPTOR.services_by_name["Broker"].full_name
# Each streamed response is at most this many bytes encoded, well under the 4 MiB that gRPC
# clients accept by default, unless one delivery or outcome alone is larger (a payload of up to
# -max-body-bytes, plus its envelope): it then comes alone.
STREAM_CHUNK_BYTES: Final = 2 * 1024 * 1024

# What a gRPC client accepts by default (grpc.max_receive_message_length): a NextJob answer that
# its outcomes put over it would be refused, so it carries no task then (the task stays ready).
CLIENT_RECEIVE_LIMIT: Final = 4 * 1024 * 1024

# A stream reads no more of its worker's requests while this many outcomes wait to be written
# (a worker that sends acks and reads nothing is held back instead of filling the broker's memory).
MAX_UNSENT_OUTCOMES: Final = 10_000
#: Batches of one Produce call enqueued at once (read ahead of their answers).
PRODUCE_AHEAD: Final = 8

Context = grpc.aio.ServicerContext[Any, Any]


def code_for(error: WqError) -> grpc.StatusCode:
    return lookup(CODES, error)


#: Trailing metadata on RESOURCE_EXHAUSTED when the broker is at a limit (not a size limit): how
#: long to wait before trying again.
RETRY_AFTER_KEY: Final = RETRY_AFTER_MS_KEY
#: Trailing metadata (value ``1``) on the FAILED_PRECONDITION of a call refused because its task
#: was cancelled (an ExtendLease): the worker stops, and does not retry it.
CANCELLED_METADATA: Final = ((CANCELLED_KEY, "1"),)


class _Errors:
    """``async with _Errors(context):`` turns a WqError into the matching gRPC status."""

    __slots__ = ("_context",)

    def __init__(self, context: Context) -> None:
        self._context = context

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, WqError):
            await abort(self._context, exc)


async def abort(context: Context, error: WqError) -> NoReturn:
    """End the call with the status for ``error`` (its message bounded: :func:`details`; for a
    limit, when to retry)."""
    metadata: tuple[tuple[str, str], ...] = ()
    if error.retry_after is not None:
        metadata = ((RETRY_AFTER_KEY, str(round(error.retry_after * 1000))),)
    elif isinstance(error, Cancelled):
        metadata = CANCELLED_METADATA
    await context.abort(code_for(error), details(error.message), trailing_metadata=metadata)


def details(message: str) -> str:
    """``message`` as it may be sent to a client: as status details (which travel in metadata,
    percent-encoded: at most three bytes there for each of ours) or as Settled.message. At most
    MAX_DETAILS_BYTES of UTF-8, cut at a character and marked as cut, so no message can overflow
    a client's metadata limit (8 KiB by default) however much of the request it quotes."""
    text = utf8(message)
    data = text.encode()
    if len(data) <= MAX_DETAILS_BYTES:
        return text
    return data[: MAX_DETAILS_BYTES - len(TRUNCATED)].decode("utf-8", "ignore") + TRUNCATED


def utf8(text: str) -> str:
    """``text`` as protobuf can carry it: a lone surrogate (which JSON sent to the HTTP API can
    smuggle into an error text) is written as its escape, ``\\ud800``, rather than failing the
    call."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


# -- conversion ---------------------------------------------------------------------------------


def _split(ts: float) -> tuple[int, int]:
    """Epoch seconds as a Timestamp's (seconds, nanos)."""
    seconds = int(ts // 1)
    nanos = round((ts - seconds) * 1e9)
    if nanos >= 1_000_000_000:
        seconds, nanos = seconds + 1, nanos - 1_000_000_000
    return seconds, nanos


def timestamp(ts: float) -> Timestamp:
    seconds, nanos = _split(ts)
    return Timestamp(seconds=seconds, nanos=nanos)


# The (seconds, nanos) of recent times: the tasks of a batch share their creation time, and the
# deliveries of a claim their deadline, so most entries are found here.
_SPLIT_KEPT: Final = 256
_splits: dict[float, tuple[int, int]] = {}


def _set_time(out: Timestamp, ts: float) -> None:
    split = _splits.get(ts)
    if split is None:
        if len(_splits) >= _SPLIT_KEPT:
            _splits.clear()
        split = _splits[ts] = _split(ts)
    out.seconds, out.nanos = split


def _fill_task(out: pb.Task, task: Task) -> None:
    """``out`` (empty) made ``task``, in place: set field by field, the messages inside it
    included, which is twice as fast as building each and copying it in."""
    out.id = task.id
    out.payload = task.payload
    out.attempts = task.attempts
    out.max_attempts = task.max_attempts
    _set_time(out.created_at, task.created_at)
    if task.available_at == task.created_at:
        out.available_at.CopyFrom(out.created_at)
    else:
        _set_time(out.available_at, task.available_at)
    if task.last_error is not None:
        out.last_error = utf8(task.last_error)
    out.queue = task.queue
    out.priority = task.priority
    if (
        task.expires_at is not None
        or task.timeout is not None
        or task.progress is not None
        or task.cancelling
        or task.result is not None
        or task.finished_at is not None
        or task.result_ttl is not None
        or task.after is not None
    ):
        _fill_extensions(out, task)
    if task.schedule is not None:  # docs/design/schedules.md: fired by a schedule
        out.schedule = task.schedule
        if task.scheduled_for is not None:
            _set_time(out.scheduled_for, task.scheduled_for)
    if task.buried_at is not None:  # (dead)
        _set_time(out.buried_at, task.buried_at)


def _fill_extensions(out: pb.Task, task: Task) -> None:
    """The fields of docs/design/control.md and docs/design/results.md, each only when set
    (unset: as before)."""
    if task.expires_at is not None:
        _set_time(out.expires_at, task.expires_at)
    if task.timeout is not None:
        out.timeout_ms = round(task.timeout * 1000)
    if task.progress is not None:
        out.progress = task.progress
    if task.cancelling:
        out.cancelling = True
    if task.result is not None:
        out.result = task.result
    if task.finished_at is not None:
        _set_time(out.finished_at, task.finished_at)
    if task.result_ttl is not None:
        out.result_ttl_ms = round(task.result_ttl * 1000)
    if task.after:  # (None, or (): no parents)
        out.after.extend(task.after)
        out.waiting_for = task.waiting_for


def _fill_delivery(out: pb.Delivery, delivery: Delivery) -> None:
    _fill_task(out.task, delivery.task)
    out.lease_id = delivery.lease_id
    _set_time(out.deadline, delivery.deadline)
    if delivery.parents:
        add = out.parents.add
        for parent in delivery.parents:
            if parent.result is None:
                add(id=parent.id)
            else:
                add(id=parent.id, result=parent.result)


def task_pb(task: Task) -> pb.Task:
    out = pb.Task()
    _fill_task(out, task)
    return out


def task_in_state_pb(found: TaskState) -> pb.TaskInState:
    out = pb.TaskInState(state=found.state)
    _fill_task(out.task, found.task)
    return out


def delivery_pb(delivery: Delivery) -> pb.Delivery:
    out = pb.Delivery()
    _fill_delivery(out, delivery)
    return out


def queue_pb(queue: QueueStats, oldest_ready: float | None = None) -> pb.QueueInfo:
    return pb.QueueInfo(
        name=queue.name,
        ready=queue.ready,
        handed_out=queue.handed_out,
        delayed=queue.delayed,
        dead=queue.dead,
        paused=queue.paused,
        oldest_ready_at=None if oldest_ready is None else timestamp(oldest_ready),
        waiting=queue.waiting,
        succeeded=queue.succeeded,
        limits=limits_pb(queue.limits),
        tokens=queue.tokens,
    )


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def limits_pb(limits: Limits | None) -> pb.QueueLimits | None:
    """A queue's limits (docs/design/schedules.md); None (unset) when it has none."""
    if limits is None or limits.empty():
        return None
    rate = limits.rate
    return pb.QueueLimits(
        rate=None
        if rate is None
        else pb.RateLimit(tasks=rate.tasks, per_ms=round(rate.per * 1000), burst=rate.burst),
        concurrency=limits.concurrency,
    )


def _rate(message: pb.QueueLimits) -> dict[str, object] | None:
    """A rate limit as the service takes it (the members of HTTP's ``rate`` object; a burst of 0
    is unset: the default); None when unset."""
    if not message.HasField("rate"):
        return None
    rate = message.rate
    return {"tasks": rate.tasks, "per_ms": rate.per_ms, "burst": rate.burst or None}


def schedule_pb(schedule: Schedule) -> pb.Schedule:
    """A schedule as gRPC gives it (docs/design/schedules.md): ``cron`` and ``timezone`` for a
    cron rule, ``every_ms`` for an interval; unset times and task members where none is set."""
    task = schedule.task
    out = pb.Schedule(
        name=schedule.name,
        cron=schedule.cron,
        timezone=schedule.timezone if schedule.cron is not None else "",
        every_ms=_ms(schedule.every),
        payload=task.payload,
        queue=task.queue,
        priority=task.priority,
        max_attempts=task.max_attempts,
        expires_in_ms=_ms(task.expires_in),
        timeout_ms=_ms(task.timeout),
        result_ttl_ms=_ms(task.result_ttl),
        paused=schedule.paused,
        last_task_id=schedule.last_task_id or "",
        fires=schedule.fires,
    )
    _set_time(out.created_at, schedule.created_at)
    _set_time(out.updated_at, schedule.updated_at)
    if schedule.next_fire_at is not None:
        _set_time(out.next_fire_at, schedule.next_fire_at)
    if schedule.last_fire_at is not None:
        _set_time(out.last_fire_at, schedule.last_fire_at)
    return out


def _schedule_submission(request: pb.PutScheduleRequest) -> ScheduleSubmission:
    """A PutSchedule request as the service takes it (None: not given)."""
    has = request.HasField
    return ScheduleSubmission(
        request.payload,
        cron=request.cron if has("cron") else None,
        timezone=request.timezone if has("timezone") else None,
        every_ms=request.every_ms if has("every_ms") else None,
        queue=request.queue or None,
        priority=request.priority if has("priority") else None,
        max_attempts=request.max_attempts if has("max_attempts") else None,
        expires_in_ms=request.expires_in_ms if has("expires_in_ms") else None,
        timeout_ms=request.timeout_ms if has("timeout_ms") else None,
        result_ttl_ms=request.result_ttl_ms if has("result_ttl_ms") else None,
        paused=request.paused if has("paused") else None,
    )


def outcome_pb(task_id: str, outcome: Outcome | None) -> pb.WaitResultResponse:
    """A result wait's answer (docs/design/results.md): an empty state for a task still pending;
    a succeeded one's result (unset: acked without one) and when; a dead one's last error and
    attempts."""
    out = pb.WaitResultResponse(id=task_id)
    if outcome is None:
        return out
    out.state = outcome.state
    if outcome.state == SUCCEEDED:
        if outcome.result is not None:
            out.result = outcome.result
        if outcome.finished_at is not None:
            _set_time(out.finished_at, outcome.finished_at)
    elif outcome.state == DEAD:
        if outcome.last_error is not None:
            out.last_error = utf8(outcome.last_error)
        out.attempts = outcome.attempts
    return out


class _Outcome(NamedTuple):
    """How one ack, nack or extension went (a Settled before it is written)."""

    id: str
    lease_id: str
    error: WqError | None
    nack: bool = False
    extend: bool = False
    deadline: float | None = None  # an extension's new deadline


def _fill_settled(out: pb.Settled, outcome: _Outcome) -> None:
    out.id = outcome.id
    out.lease_id = outcome.lease_id
    if outcome.nack:
        out.nack = True
    if outcome.extend:
        out.extend = True
    if outcome.error is not None:
        out.code = code_for(outcome.error).value[0]
        out.message = details(outcome.error.message)
        if isinstance(outcome.error, Cancelled):
            out.cancelled = True
    if outcome.deadline is not None:
        _set_time(out.deadline, outcome.deadline)


def _settled(outcome: _Outcome) -> pb.Settled:
    out = pb.Settled()
    _fill_settled(out, outcome)
    return out


async def _written(context: Context, message: Message) -> bool:
    """Write ``message`` on a stream; False if the call is over (its caller gone): grpc.aio then
    raises from the write, and the servicer's error would be logged with a traceback."""
    try:
        await context.write(message)
    except Exception:
        if context.done():
            return False
        raise
    return True


def _refused(error: WqError) -> pb.ProduceResponse:
    """A Produce batch's refusal: the status its EnqueueBatch call would have ended with."""
    response = pb.ProduceResponse(code=code_for(error).value[0], message=details(error.message))
    if error.retry_after is not None:
        response.retry_after_ms = round(error.retry_after * 1000)
    return response


def _refused_for(response: pb.NextJobResponse) -> bool:
    """True if a client with default limits would refuse ``response`` for its outcomes (when
    its delivery alone is larger, the client must have raised its limit)."""
    return response.ByteSize() > CLIENT_RECEIVE_LIMIT >= _entry_size(response.delivery)


def _optional(message: Any, name: str) -> int | None:
    return getattr(message, name) if message.HasField(name) else None


def _error(message: pb.NackRequest) -> str | None:
    return message.error if message.HasField("error") else None


def _text(value: str) -> str | None:
    """A string field whose empty value means "the default" (or "none"): None then."""
    return value or None


def _queues(queues: Sequence[str]) -> list[str] | None:
    """A repeated queues field: None (the default queue) when empty."""
    return list(queues) or None


def _terminal(message: pb.NackRequest) -> bool | None:
    return True if message.terminal else None


def _submission(item: pb.EnqueueRequest) -> Submission:
    # (Runs for every task of a batch: the fields are read inline, in Submission's order.)
    has = item.HasField
    return Submission(
        item.payload,
        item.max_attempts if has("max_attempts") else None,
        item.delay_ms if has("delay_ms") else None,
        item.queue or None,
        item.priority if has("priority") else None,
        item.idempotency_key or None,
        item.expires_in_ms if has("expires_in_ms") else None,
        item.timeout_ms if has("timeout_ms") else None,
        item.unique or None,
        [_parent_ref(ref) for ref in item.after] if item.after else None,
        item.result_ttl_ms if has("result_ttl_ms") else None,
    )


def _parent_ref(ref: pb.TaskRef) -> str | int | None:
    """An ``after`` entry as the service takes it: a task id, an index of an earlier item of the
    batch, or None (neither set: the service refuses it, naming it)."""
    which = ref.WhichOneof("ref")
    if which == "id":
        return ref.id
    if which == "index":
        return ref.index
    return None


def _ack(a: pb.AckRequest) -> tuple[str, str] | tuple[str, str, bytes]:
    """An ack as the service takes it: with its result (JSON text) if it has one."""
    if a.HasField("result"):
        return a.id, a.lease_id, a.result
    return a.id, a.lease_id


def _nack_item(n: pb.NackRequest) -> tuple[str, str, str | None, int | None, bool | None]:
    return (n.id, n.lease_id, _error(n), _optional(n, "delay_ms"), _terminal(n))


async def _extend(service: Service, extends: Sequence[pb.ExtendLeaseRequest]) -> list[_Outcome]:
    """Extend each lease, in order; their outcomes, with the new deadlines."""
    outcomes = []
    for e in extends:
        try:
            deadline = await service.extend(
                e.id, e.lease_id, _optional(e, "lease_ms"), progress=e.progress or None
            )
        except WqError as error:
            outcomes.append(_Outcome(e.id, e.lease_id, error, extend=True))
        else:
            outcomes.append(_Outcome(e.id, e.lease_id, None, extend=True, deadline=deadline))
    return outcomes


async def _settle(
    service: Service, acks: Sequence[pb.AckRequest], nacks: Sequence[pb.NackRequest] = ()
) -> list[_Outcome]:
    """Settle acks, then nacks, at once; their outcomes, in that order."""
    # (Each field read once, inline: this is per task. With its result, if it has one.)
    items = [
        (a.id, a.lease_id, a.result) if a.HasField("result") else (a.id, a.lease_id) for a in acks
    ]
    ack_errors, nack_errors = await service.settle_many(items, [_nack_item(n) for n in nacks])
    return [
        _Outcome(item[0], item[1], error) for item, error in zip(items, ack_errors, strict=True)
    ] + [
        _Outcome(n.id, n.lease_id, error, nack=True)
        for n, error in zip(nacks, nack_errors, strict=True)
    ]


class BrokerServicer(pb_grpc.BrokerServicer):
    def __init__(self, service: Service) -> None:
        self._service = service
        self._producing: set[asyncio.Task[Any]] = set()  # Produce calls between batches
        self._enqueueing: set[asyncio.Future[Any]] = set()  # their batches being enqueued
        service.on_close(self._end_producing)

    async def Enqueue(self, request: pb.EnqueueRequest, context: Context) -> pb.EnqueueResponse:
        async with _Errors(context):
            item = _submission(request)
            result = await self._service.enqueue(
                item.payload,
                item.max_attempts,
                item.delay_ms,
                queue=item.queue,
                priority=item.priority,
                key=item.key,
                expires_in_ms=item.expires_in_ms,
                timeout_ms=item.timeout_ms,
                unique=item.unique,
                after=item.after,
                result_ttl_ms=item.result_ttl_ms,
            )
            return pb.EnqueueResponse(id=result.id, duplicate=result.duplicate)

    async def EnqueueBatch(
        self, request: pb.EnqueueBatchRequest, context: Context
    ) -> pb.EnqueueBatchResponse:
        async with _Errors(context):
            results = await self._enqueue_batch(request)
            return pb.EnqueueBatchResponse(
                ids=[r.id for r in results], duplicates=[r.duplicate for r in results]
            )

    async def _enqueue_batch(self, request: pb.EnqueueBatchRequest) -> list[Enqueued]:
        items = [_submission(item) for item in request.tasks]
        return await self._service.enqueue_many(items, what="tasks")

    async def Produce(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.EnqueueBatchRequest], context: Context
    ) -> None:
        """Batches read are enqueued up to PRODUCE_AHEAD at once (on a distant database, a
        batch waits for a round trip of its own, not for those of the batches before it) and
        answered in the order read. Ends OK when the client half-closes, or when the broker
        shuts down (no batch read after that), every batch read answered first; the batches it
        did not read were not enqueued: the client sends them again."""
        call = asyncio.current_task()
        assert call is not None
        answers: asyncio.Queue[asyncio.Future[pb.ProduceResponse] | None] = asyncio.Queue(
            PRODUCE_AHEAD
        )
        writer = asyncio.ensure_future(self._answer(context, answers))
        try:
            refusal = await self._read_batches(call, request_iterator, answers, writer)
            if not writer.done():
                await answers.put(None)
            await writer  # (every batch read is answered, unless the caller went away)
            if refusal is not None:
                raise refusal  # (a token withdrawn: after the batches read before it)
        finally:
            # The caller gone: its batches still being enqueued finish (what it sent was
            # taken, their answers lost with it).
            writer.cancel()

    async def _read_batches(
        self,
        call: asyncio.Task[Any],
        request_iterator: AsyncIterator[pb.EnqueueBatchRequest],
        answers: asyncio.Queue[asyncio.Future[pb.ProduceResponse] | None],
        writer: asyncio.Future[None],
    ) -> Exception | None:
        """Read a Produce call's batches and start enqueueing each, until the client
        half-closes, the broker shuts down or the writer ends (the caller gone); what a read
        raised other than an undecodable batch (a refused token), to end the call with."""
        requests = aiter(request_iterator)
        first = True  # (read even when the broker is stopping: grpc warns of a stream never read)
        while not writer.done() and (first or not self._service.closing):
            first = False
            self._producing.add(call)  # (only while it waits for the next batch)
            try:
                request: pb.EnqueueBatchRequest | WqError = await anext(requests)
            except StopAsyncIteration:
                return None
            except InvalidArgument as e:  # a request that could not be decoded
                request = e
            except asyncio.CancelledError:
                if not self._service.closing:
                    raise
                call.uncancel()  # cancelled by _end_producing, between batches: end OK
                return None
            except Exception as e:
                return e
            finally:
                self._producing.discard(call)
            if self._service.closing:
                return None  # (read just now: not enqueued, not answered)
            answer: asyncio.Future[pb.ProduceResponse]
            if isinstance(request, WqError):
                answer = asyncio.get_running_loop().create_future()
                answer.set_result(_refused(request))
            else:
                answer = asyncio.ensure_future(self._produced(request))
                self._enqueueing.add(answer)
                answer.add_done_callback(self._enqueueing.discard)
            await answers.put(answer)  # (waits while PRODUCE_AHEAD are unanswered)
        return None

    async def _answer(
        self,
        context: Context,
        answers: asyncio.Queue[asyncio.Future[pb.ProduceResponse] | None],
    ) -> None:
        """Write a Produce call's answers in the order its batches were read."""
        while (answer := await answers.get()) is not None:
            response = await asyncio.shield(answer)
            if not await _written(context, response):
                return  # (the caller gone)

    async def _produced(self, request: pb.EnqueueBatchRequest) -> pb.ProduceResponse:
        try:
            results = await self._enqueue_batch(request)
        except WqError as e:
            return _refused(e)
        return pb.ProduceResponse(
            ids=[r.id for r in results], duplicates=[r.duplicate for r in results]
        )

    def _end_producing(self) -> None:
        """The broker is shutting down: end the Produce calls waiting for their next batch (the
        others end once the batches they are enqueueing are answered)."""
        for call in list(self._producing):
            call.cancel()

    async def NextJob(self, request: pb.NextJobRequest, context: Context) -> pb.NextJobResponse:
        async with _Errors(context):

            async def hand_over(delivery: Delivery) -> None:
                if context.done():
                    raise ConnectionResetError("the caller went away")

            acks = request.acks
            outcomes, delivery = await self._service.next_job(
                _optional(request, "wait_ms"),
                _optional(request, "lease_ms"),
                [_ack(a) for a in acks],
                hand_over,
                queues=_queues(request.queues),
            )
            settled = [
                _settled(_Outcome(a.id, a.lease_id, error))
                for a, error in zip(acks, outcomes, strict=True)
            ]
            if delivery is None:
                return pb.NextJobResponse(settled=settled)
            response = pb.NextJobResponse(delivery=delivery_pb(delivery), settled=settled)
            if settled and _refused_for(response):
                # A client with default limits would refuse the answer, for the outcomes it
                # carries: nobody would see the task. It goes back.
                await self._service.give_back(delivery)
                return pb.NextJobResponse(settled=settled)
            return response

    async def Ack(self, request: pb.AckRequest, context: Context) -> pb.AckResponse:
        async with _Errors(context):
            result = request.result if request.HasField("result") else None
            await self._service.ack(request.id, request.lease_id, result)
            return pb.AckResponse()

    async def Nack(self, request: pb.NackRequest, context: Context) -> pb.NackResponse:
        async with _Errors(context):
            await self._service.nack(
                request.id,
                request.lease_id,
                _error(request),
                delay_ms=_optional(request, "delay_ms"),
                terminal=_terminal(request),
            )
            return pb.NackResponse()

    async def Release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseResponse:
        async with _Errors(context):
            await self._service.release(request.id, request.lease_id)
            return pb.ReleaseResponse()

    async def ExtendLease(
        self, request: pb.ExtendLeaseRequest, context: Context
    ) -> pb.ExtendLeaseResponse:
        async with _Errors(context):
            deadline = await self._service.extend(
                request.id,
                request.lease_id,
                _optional(request, "lease_ms"),
                progress=request.progress or None,
            )
            return pb.ExtendLeaseResponse(deadline=timestamp(deadline))

    async def GetTask(self, request: pb.GetTaskRequest, context: Context) -> pb.GetTaskResponse:
        async with _Errors(context):
            found = await self._service.lookup(request.id)
            children, count = await self._service.children(request.id)
            return pb.GetTaskResponse(
                task=task_pb(found.task),
                state=found.state,
                children=children,
                children_count=count,
            )

    async def WaitResult(
        self, request: pb.WaitResultRequest, context: Context
    ) -> pb.WaitResultResponse:
        async with _Errors(context):
            outcome = await self._service.wait_result(request.id, _optional(request, "wait_ms"))
            return outcome_pb(request.id, outcome)

    async def Stats(self, request: pb.StatsRequest, context: Context) -> pb.StatsResponse:
        async with _Errors(context):
            stats = (await self._service.stats(_text(request.queue))).as_dict()
            totals = pb.Totals(**stats.pop("totals"))
            return pb.StatsResponse(**stats, totals=totals)

    async def ListQueues(
        self, request: pb.ListQueuesRequest, context: Context
    ) -> pb.ListQueuesResponse:
        async with _Errors(context):
            reports = await self._service.queue_report()
            return pb.ListQueuesResponse(
                queues=[queue_pb(r.queue, r.oldest_ready) for r in reports]
            )

    async def PauseQueue(
        self, request: pb.PauseQueueRequest, context: Context
    ) -> pb.PauseQueueResponse:
        async with _Errors(context):
            await self._service.pause(request.queue)  # required: "" is refused, not a default
            return pb.PauseQueueResponse()

    async def ResumeQueue(
        self, request: pb.ResumeQueueRequest, context: Context
    ) -> pb.ResumeQueueResponse:
        async with _Errors(context):
            await self._service.resume(request.queue)
            return pb.ResumeQueueResponse()

    async def ListDead(self, request: pb.ListDeadRequest, context: Context) -> pb.ListDeadResponse:
        async with _Errors(context):
            tasks = await self._service.dead_letters(
                _optional(request, "limit"), queue=_text(request.queue)
            )
            return pb.ListDeadResponse(tasks=[task_pb(t) for t in tasks])

    async def Requeue(self, request: pb.RequeueRequest, context: Context) -> pb.RequeueResponse:
        async with _Errors(context):
            await self._service.requeue(request.id)
            return pb.RequeueResponse()

    async def RequeueAll(
        self, request: pb.RequeueAllRequest, context: Context
    ) -> pb.RequeueAllResponse:
        async with _Errors(context):
            requeued = await self._service.requeue_all(_text(request.queue))
            return pb.RequeueAllResponse(requeued=requeued)

    async def PurgeDead(
        self, request: pb.PurgeDeadRequest, context: Context
    ) -> pb.PurgeDeadResponse:
        async with _Errors(context):
            await self._service.purge(request.id)
            return pb.PurgeDeadResponse()

    async def CancelTask(
        self, request: pb.CancelTaskRequest, context: Context
    ) -> pb.CancelTaskResponse:
        async with _Errors(context):
            result = await self._service.cancel(request.id)
            return pb.CancelTaskResponse(state=result.state)

    async def ListTasks(
        self, request: pb.ListTasksRequest, context: Context
    ) -> pb.ListTasksResponse:
        async with _Errors(context):
            tasks, next_cursor = await self._service.list_tasks(
                _text(request.queue),
                _text(request.state),
                _optional(request, "limit"),
                _text(request.cursor),
            )
            return pb.ListTasksResponse(
                tasks=[task_in_state_pb(t) for t in tasks], next_cursor=next_cursor or ""
            )

    async def EmptyQueue(
        self, request: pb.EmptyQueueRequest, context: Context
    ) -> pb.EmptyQueueResponse:
        async with _Errors(context):
            cancelled = await self._service.empty_queue(request.queue)  # required, as PauseQueue
            return pb.EmptyQueueResponse(cancelled=cancelled)

    async def DeleteQueue(
        self, request: pb.DeleteQueueRequest, context: Context
    ) -> pb.DeleteQueueResponse:
        async with _Errors(context):
            await self._service.delete_queue(request.queue)
            return pb.DeleteQueueResponse()

    # -- schedules and limits (docs/design/schedules.md) ------------------------------------

    async def PutSchedule(
        self, request: pb.PutScheduleRequest, context: Context
    ) -> pb.PutScheduleResponse:
        async with _Errors(context):
            schedule = await self._service.put_schedule(request.name, _schedule_submission(request))
            return pb.PutScheduleResponse(schedule=schedule_pb(schedule))

    async def GetSchedule(
        self, request: pb.GetScheduleRequest, context: Context
    ) -> pb.GetScheduleResponse:
        async with _Errors(context):
            schedule = await self._service.get_schedule(request.name)
            return pb.GetScheduleResponse(schedule=schedule_pb(schedule))

    async def ListSchedules(
        self, request: pb.ListSchedulesRequest, context: Context
    ) -> pb.ListSchedulesResponse:
        async with _Errors(context):
            schedules = await self._service.list_schedules()
            return pb.ListSchedulesResponse(schedules=[schedule_pb(s) for s in schedules])

    async def DeleteSchedule(
        self, request: pb.DeleteScheduleRequest, context: Context
    ) -> pb.DeleteScheduleResponse:
        async with _Errors(context):
            await self._service.delete_schedule(request.name)
            return pb.DeleteScheduleResponse()

    async def PauseSchedule(
        self, request: pb.PauseScheduleRequest, context: Context
    ) -> pb.PauseScheduleResponse:
        async with _Errors(context):
            schedule = await self._service.pause_schedule(request.name)
            return pb.PauseScheduleResponse(schedule=schedule_pb(schedule))

    async def ResumeSchedule(
        self, request: pb.ResumeScheduleRequest, context: Context
    ) -> pb.ResumeScheduleResponse:
        async with _Errors(context):
            schedule = await self._service.resume_schedule(request.name)
            return pb.ResumeScheduleResponse(schedule=schedule_pb(schedule))

    async def SetQueueLimits(
        self, request: pb.SetQueueLimitsRequest, context: Context
    ) -> pb.SetQueueLimitsResponse:
        async with _Errors(context):
            # Unset limits, or both of its members unset: none (the service clears them).
            given = request.limits if request.HasField("limits") else None
            rate = None if given is None else _rate(given)
            concurrency = None if given is None else _optional(given, "concurrency")
            limits = await self._service.set_limits(request.queue, rate, concurrency)
            return pb.SetQueueLimitsResponse(limits=limits_pb(limits))

    async def StreamJobs(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.StreamJobsRequest], context: Context
    ) -> None:
        async with _Errors(context):
            try:
                first = await anext(aiter(request_iterator))
            except StopAsyncIteration:
                return
            if not first.HasField("open"):
                raise InvalidArgument("the first StreamJobsRequest must carry open")
            stream = await self._service.open_stream(
                _optional(first.open, "prefetch"),
                _optional(first.open, "lease_ms"),
                queues=_queues(first.open.queues),
            )
        await _StreamCall(self._service, stream, context).run(first, request_iterator)


class _StreamCall:
    """One StreamJobs call once its stream is open: a reader settles what the worker sends; the
    writer pushes deliveries, outcomes and cancels (``Stream.take_cancels``: the tasks it holds
    that were cancelled, here or on another broker; ``Stream.poke`` wakes it for them) until the
    worker half-closes, a drained stream has no unsettled task left, or the broker stops."""

    def __init__(self, service: Service, stream: Stream, context: Context) -> None:
        self._service = service
        self._stream = stream
        self._context = context
        self._settled: list[_Outcome] = []  # outcomes not yet taken by the writer
        self._taken = asyncio.Event()  # set when the writer takes them
        self._applying = False  # the reader is between reading a request and queuing its outcomes
        self._applied = asyncio.Event()  # set while it is not
        self._applied.set()
        self._drain_asked = False  # the worker sent drain (the first one is answered)
        self._drain_unanswered = False  # ... and the writer has not yet answered it
        self._drained = False  # Drained was sent: the call ends once nothing is unsettled

    async def run(
        self, first: pb.StreamJobsRequest, requests: AsyncIterator[pb.StreamJobsRequest]
    ) -> None:
        stream = self._stream
        try:
            await self._context.write(pb.StreamJobsResponse())  # "open" accepted
        except BaseException:
            await stream.close()
            raise
        reader = asyncio.get_running_loop().create_task(self._read(first, requests))
        reader.add_done_callback(lambda _: stream.poke())
        try:
            await self._write(reader)
        finally:
            reader.cancel()
            await stream.close()

    async def _write(self, reader: asyncio.Task[None]) -> None:
        stream = self._stream
        while True:
            # While the reader settles a request, deliveries wait: they may fill slots its acks
            # freed (a durable store claims them in the same transaction), and the .proto
            # promises that outcomes come no later than the deliveries made after them.
            holding = self._applying
            deliveries = [] if holding else stream.take_ready()
            # Taken after the deliveries (taking one that was cancelled while it waited here
            # adds its cancel), and sent after them: a cancel never comes before the delivery
            # it is about (that one is in these responses, or was written before).
            cancels = stream.take_cancels()
            if deliveries or self._settled or self._drain_unanswered or cancels:
                for response in self._responses(deliveries, cancels):
                    if not await _written(self._context, response):
                        return  # the worker is gone: what it held is reclaimed as the call ends
                continue
            if self._drained and not self._applying and stream.unsettled == 0:
                return  # drained, every task settled and every outcome sent: the call ends OK
            if reader.done():
                await self._reader_ended(reader)
                return  # the worker half-closed: the stream is over
            if stream.closed:
                return  # the broker is shutting down
            if holding:
                await self._applied.wait()
            else:
                await stream.wait()

    def _responses(
        self, deliveries: list[Delivery], cancels: list[tuple[str, str]]
    ) -> list[pb.StreamJobsResponse]:
        """What to write now: the outcomes waiting (taken: the reader may add more while they
        are written), the deliveries, the cancels, and the answer to a drain."""
        outcomes, self._settled = self._settled, []
        self._taken.set()
        responses = stream_responses(deliveries, outcomes)
        last = responses[-1]
        if cancels:
            add = last.cancels.add
            for task_id, lease_id in cancels:
                add(id=task_id, lease_id=lease_id)
        if self._drain_unanswered:
            # After the last delivery: the stream is draining, none can follow.
            self._drain_unanswered, self._drained = False, True
            last.drained.CopyFrom(pb.Drained(unsettled=self._stream.unsettled))
        return responses

    async def _reader_ended(self, reader: asyncio.Task[None]) -> None:
        if reader.cancelled():  # (the call is being torn down: the broker stops)
            return
        error = reader.exception()
        if isinstance(error, WqError):
            await abort(self._context, error)
        if error is not None:
            raise error

    async def _read(
        self, first: pb.StreamJobsRequest, requests: AsyncIterator[pb.StreamJobsRequest]
    ) -> None:
        request = first
        while True:
            self._applying = True
            self._applied.clear()
            try:
                await self._apply(request)
            finally:
                self._applying = False
                self._applied.set()
            self._stream.poke()
            if len(self._settled) >= MAX_UNSENT_OUTCOMES:
                # The worker is not reading: read nothing more from it (gRPC's flow control then
                # holds it back) until the writer takes these.
                self._taken.clear()
                await self._taken.wait()
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                # The worker half-closed: push nothing more (what is queued goes back to ready).
                if not self._stream.draining:
                    await self._stream.drain()
                return
            if request.HasField("open"):
                raise InvalidArgument("open may only be sent in the first StreamJobsRequest")

    async def _apply(self, request: pb.StreamJobsRequest) -> None:
        # Never `self._settled += await ...`: that reads the list before the await, and the
        # writer may take (and send) it meanwhile; its outcomes would then be sent again.
        if request.HasField("prefetch"):
            await self._service.resize_stream(self._stream, request.prefetch)
        if request.extends:
            outcomes = await _extend(self._service, request.extends)
            self._settled.extend(outcomes)
        if request.acks or request.nacks:
            outcomes = await _settle(self._service, request.acks, request.nacks)
            self._settled.extend(outcomes)
        if request.drain and not self._drain_asked:
            self._drain_asked = True
            if not self._stream.draining:
                await self._stream.drain()
            self._drain_unanswered = True


def stream_responses(
    deliveries: Sequence[Delivery], outcomes: Sequence[_Outcome], limit: int = STREAM_CHUNK_BYTES
) -> list[pb.StreamJobsResponse]:
    """The outcomes, then the deliveries, packed into responses of at most ``limit`` bytes
    each, by their encoded size (a delivery or outcome larger than that comes alone). The
    outcomes go first: they freed the slots these deliveries fill. Each entry is made in place,
    in the response that carries it; its size is taken only when all of them might not fit in
    one response (:func:`_bound`)."""
    response = pb.StreamJobsResponse()
    if _bound(deliveries, outcomes) <= limit:
        add_settled, add_delivery = response.settled.add, response.deliveries.add
        for outcome in outcomes:
            _fill_settled(add_settled(), outcome)
        for delivery in deliveries:
            _fill_delivery(add_delivery(), delivery)
        return [response]
    responses = [response]
    size = 0
    entries: list[tuple[str, Callable[[Any, Any], None], Any]] = [
        ("settled", _fill_settled, outcome) for outcome in outcomes
    ]
    entries += [("deliveries", _fill_delivery, delivery) for delivery in deliveries]
    for field, fill, item in entries:
        added = getattr(responses[-1], field)
        fill(added.add(), item)
        n = _entry_size(added[-1])
        if size and size + n > limit:
            del added[-1]
            responses.append(pb.StreamJobsResponse())
            fill(getattr(responses[-1], field).add(), item)
            size = 0
        size += n
    return responses


# What an entry may take at most beside its texts and payload: tags, lengths, numbers (a
# negative int32 takes ten bytes) and timestamps, with room to spare. A text is counted at six
# bytes a character: a lone surrogate is sent as its six-character escape (``utf8``).
_DELIVERY_FRAME: Final = 256
_OUTCOME_FRAME: Final = 64


def _bound(deliveries: Sequence[Delivery], outcomes: Sequence[_Outcome]) -> int:
    """At least the encoded size of one response carrying all of these (cheaper to add up than
    the sizes themselves: no message is made)."""
    total = 0
    for d in deliveries:
        t = d.task
        texts = len(t.id) + len(d.lease_id) + len(t.queue) + len(t.last_error or "")
        total += len(t.payload) + 6 * texts + _DELIVERY_FRAME
        if t.progress is not None:  # (a hand-out has none: progress is a holder's)
            total += len(t.progress)
        if d.parents:  # (docs/design/results.md: the parents, their results)
            total += _parents_bound(d)
    for o in outcomes:
        total += 6 * (len(o.id) + len(o.lease_id)) + _OUTCOME_FRAME
        if o.error is not None:
            total += MAX_DETAILS_BYTES
    return total


def _parents_bound(delivery: Delivery) -> int:
    """At least what a delivery's task's ``after`` and its ``parents`` add to its encoding."""
    assert delivery.parents is not None
    total = 0
    for parent in delivery.parents:
        total += 2 * (6 * len(parent.id) + _PARENT_FRAME)  # (in after, and in parents)
        if parent.result is not None:
            total += len(parent.result)
    return total


_PARENT_FRAME: Final = 16  # a parent's tags and lengths, with room to spare


def _entry_size(message: Message) -> int:
    """What ``message`` adds to its parent as an entry of a repeated field numbered below 16:
    a one-byte tag, its length as a varint, and its encoding."""
    n = message.ByteSize()
    return 1 + max(1, (n.bit_length() + 6) // 7) + n


# grpc-stubs' grpc_health stubs predate the asyncio servicer in ``health.aio``.
class _Health(health.aio.HealthServicer):  # type: ignore[name-defined,misc]
    """The standard health service, a status per service as Kubernetes' gRPC probes ask: the
    server as a whole (``""``) is liveness, SERVING from start until shutdown; ``wq.v1.Broker``
    is readiness, NOT_SERVING while the broker cannot serve (its store cannot be reached, or it
    is shutting down), as ``GET /readyz`` says. A ``Check`` reads readiness as it is now; a
    ``Watch`` hears it change (the broker keeps it up to date: :func:`watch_readiness`)."""

    def __init__(self, service: Service) -> None:
        super().__init__()
        self._service = service

    async def Check(self, request: Any, context: Context) -> Any:
        if request.service == SERVICE_NAME and self._service.problem() is not None:
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return await super().Check(request, context)


def server_options(max_payload: int) -> list[tuple[str, int]]:
    """The gRPC server's options for a broker taking payloads of up to ``max_payload`` bytes."""
    receive_limit = max(4 * 1024 * 1024, max_payload + 64 * 1024)
    return [
        ("grpc.max_receive_message_length", receive_limit),
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE),
        # Without this a second broker could bind the same port and steal half the calls.
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def create_server(
    service: Service, interceptors: Sequence[grpc.aio.ServerInterceptor[Any, Any]] = ()
) -> tuple[grpc.aio.Server, Any]:
    """A grpc.aio server with the Broker service, health checking and reflection, calls passing
    through ``interceptors`` (bearer tokens: ``wqbroker.grpc.auth``).
    Returns the server and its health servicer (to flip to NOT_SERVING on shutdown)."""
    # Explicit limits: a request may carry one payload of max_payload plus its envelope, or a
    # batch; anything larger is refused by gRPC itself with RESOURCE_EXHAUSTED.
    server = grpc.aio.server(
        interceptors=interceptors or None, options=server_options(service.max_payload)
    )
    # The generated table, with requests that cannot be decoded answered INVALID_ARGUMENT.
    handlers = guarded(
        handler_table(pb_grpc.add_BrokerServicer_to_server, BrokerServicer(service)),
        pb.DESCRIPTOR.services_by_name["Broker"],
        abort,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # type: ignore[attr-defined]
    health_servicer = _Health(service)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable(server, [SERVICE_NAME, health.SERVICE_NAME])  # (v1 and v1alpha)
    return server, health_servicer


def _status(serving: bool) -> Any:
    return (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )


async def set_serving(health_servicer: Any, serving: bool) -> None:
    """Liveness and readiness both (at start, SERVING; at shutdown, NOT_SERVING)."""
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, _status(serving))


async def watch_readiness(health_servicer: Any, service: Service, every: float) -> None:
    """Keep ``wq.v1.Broker``'s status (what a ``Watch`` hears) on what the service says, looking
    every ``every`` seconds, until cancelled."""
    ready = True
    while True:
        await asyncio.sleep(every)
        now = service.problem() is None
        if now != ready:
            ready = now
            await health_servicer.set(SERVICE_NAME, _status(ready))
