"""The transport seam: what a client needs from the wire, as two protocols.

:class:`Transport` is the unary operations every broker offers; :class:`StreamingTransport` adds
``stream()``, tasks pushed by the broker. The HTTP transport is a ``Transport``, the gRPC one a
``StreamingTransport``; :class:`~wqclient.AsyncClient` picks one by the URL's scheme, or takes one
you pass (``AsyncClient(transport=...)``, for tests or a transport of your own). Either way they
return the same models and raise the same errors: foreign exceptions (aiohttp, grpc) are mapped to
``wqclient.errors`` in the transport, at the boundary, and nowhere else.

Arguments reach a transport already encoded and type-checked by the client (payloads as JSON
bytes; ``None`` for an option left to the broker's default); the broker checks ranges. The
options added since the first version (queues, priorities, idempotency keys, nack options) are
passed by keyword and only when set, so a transport written before them still serves the calls
that leave them unset (the same goes for those of task control: ``expires_in_ms``, ``timeout_ms``,
``unique``, an extension's ``progress``; and for those of results and workflows: an enqueue's
``after`` and ``result_ttl_ms``, an ack's ``result``, docs/design/results.md). The schedules and
a queue's limits (docs/design/schedules.md) are calls of their own: ``put_schedule`` takes a
:class:`~wqclient.models.ScheduleSpec`, ``set_limits`` a :class:`~wqclient.models.Limits`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from wqclient.errors import WqError
from wqclient.models import (
    Delivery,
    Enqueued,
    EnqueueItem,
    Limits,
    QueueInfo,
    Schedule,
    ScheduleSpec,
    Stats,
    Task,
    TaskPage,
    TaskResult,
)


class AsyncStream(Protocol):
    """Tasks pushed by the broker (gRPC StreamJobs): iterate for deliveries, settle each.

    A stream that is told when a task it delivered is cancelled while held (wqclient's gRPC
    stream is) also has ``on_cancel(callback)`` (``callback(task_id, lease_id)`` for each) and
    ``take_cancels()`` (those that came while no callback was set); a
    :class:`~wqclient.Worker` uses them when they are there."""

    def __aiter__(self) -> AsyncStream: ...

    async def __anext__(self) -> Delivery: ...

    async def ack(self, delivery: Delivery, *, confirm: bool = False, result: Any = None) -> None:
        """Settle as done. The ack goes out with the others made meanwhile, in one message;
        without ``confirm`` this returns once it is queued on the stream (no round trip), and a
        refusal (LeaseLost, NotFound) is logged and kept for :meth:`flush`; with ``confirm`` it
        returns once the broker has applied it, and raises its refusal. ``result``: the task's
        result, JSON text (``bytes``) or, for wqclient's gRPC stream, any JSON value (None: no
        result, ``b"null"`` for JSON null; passed only when set)."""
        ...

    async def nack(
        self,
        delivery: Delivery,
        error: str | None = None,
        delay_ms: int | None = None,
        terminal: bool = False,
        *,
        confirm: bool = False,
    ) -> None:
        """Settle as failed: retried after the backoff, or after exactly ``delay_ms`` (still an
        attempt), or buried at once if ``terminal``. ``confirm``: as for :meth:`ack`."""
        ...

    async def flush(self) -> list[tuple[Delivery, WqError]]:
        """Wait for the broker's answer to every settlement sent so far; return the unconfirmed
        acks and nacks it refused since the last flush, each with its error."""
        ...

    async def extend(
        self, delivery: Delivery, lease_ms: int | None, *, progress: bytes | None = None
    ) -> datetime:
        """Extend the delivery's lease to now + ``lease_ms`` (None: the broker's default);
        returns the new deadline. ``progress``: JSON text to record on the task (passed only
        when set). LeaseLost / NotFound as for an ack; Cancelled, TimeLimitReached as for
        :meth:`Transport.extend`."""
        ...

    def set_prefetch(self, prefetch: int) -> None:
        """Change how many unsettled tasks the broker may push (at least 1): more are pushed
        at once if it grows; if it shrinks, none is taken back, and none is pushed until fewer
        than it are unsettled. It goes out with the next message, ahead of the settlements in
        it. (A broker of an earlier version ignores it.)"""
        ...

    async def drain(self) -> int:
        """Ask for no new tasks; those already pushed still arrive and must be settled. Returns
        the broker's answer: how many deliveries are still unsettled (those on their way
        included); the stream ends once they are settled."""
        ...

    async def close(self) -> None:
        """End the stream. Unsettled tasks are reclaimed by the broker at once."""
        ...


class Transport(Protocol):
    """The unary operations, one call each (see :class:`~wqclient.AsyncClient` for their
    meaning). ``None`` for an option leaves it to the broker's default; ``queues`` of a claim is
    the list of queues to take from, in order of preference (None: ``["default"]``)."""

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
        """One task. ``after``: the ids of the tasks it waits for; ``result_ttl_ms``: how long
        its result is kept (both passed only when set)."""
        ...

    async def enqueue_many(self, items: Sequence[EnqueueItem]) -> list[Enqueued]:
        """Several tasks, all or none. An item's ``after`` (a tuple when set) holds task ids
        and indices of earlier items of ``items``."""
        ...

    async def claim(
        self, wait_ms: int | None, lease_ms: int | None, queues: Sequence[str] | None = None
    ) -> Delivery | None: ...

    def ack(self, task_id: str, lease_id: str, *, result: bytes | None = None) -> Awaitable[None]:
        """Ack; ``result``: the task's result, JSON text (passed only when set)."""
        ...

    def nack(
        self,
        task_id: str,
        lease_id: str,
        error: str | None,
        delay_ms: int | None = None,
        terminal: bool = False,
    ) -> Awaitable[None]: ...

    async def extend(
        self, task_id: str, lease_id: str, lease_ms: int | None, *, progress: bytes | None = None
    ) -> datetime:
        """Extend a lease to now + ``lease_ms``; returns the new deadline. ``progress``: JSON
        text to record on the task (passed only when set). Raises Cancelled if the task was
        cancelled, TimeLimitReached once its lease is at its time limit."""
        ...

    # ``release(task_id, lease_id) -> None`` (optional: the client asks ``getattr``, and a
    # transport without it is taken as a broker without the operation): hand the task back
    # without counting the attempt; NotFound / LeaseLost as a nack; Unsupported from a broker
    # that does not have it (:class:`~wqclient.errors.Unsupported`).

    async def get_task(self, task_id: str) -> Task:
        """The task with its ``state`` set (and its ``children``, ``children_count``);
        NotFound once acked without a result (or never known)."""
        ...

    async def wait_result(self, task_id: str, wait_ms: int | None) -> TaskResult | None:
        """How the task ended, waiting up to ``wait_ms`` (None: the broker's default, 0; the
        broker caps it at 30 s) for it to end: None if it is still pending then. NotFound for
        a task the broker does not have (or whose result is gone)."""
        ...

    async def stats(self, queue: str | None = None) -> Stats: ...

    async def queues(self) -> list[QueueInfo]: ...

    async def dead_letters(self, limit: int | None, queue: str | None = None) -> list[Task]: ...

    async def requeue(self, task_id: str) -> None: ...

    async def requeue_all(self, queue: str | None = None) -> int:
        """Requeue every dead task (of ``queue``); returns how many."""
        ...

    async def purge(self, task_id: str) -> None:
        """Drop a dead task for good; NotFound if it is not dead."""
        ...

    async def pause(self, queue: str) -> None: ...

    async def cancel(self, task_id: str) -> str:
        """Cancel a task: ``"cancelled"`` (it was ready or delayed), ``"cancelling"`` (handed
        out) or ``"purged"`` (dead); NotFound for a task the broker does not have."""
        ...

    async def list_tasks(
        self, queue: str | None, state: str | None, limit: int | None, cursor: str | None
    ) -> TaskPage:
        """A page of a queue's tasks in one state (None: the broker's defaults)."""
        ...

    async def empty_queue(self, queue: str) -> int:
        """Cancel every ready and delayed task of a queue; returns how many."""
        ...

    async def delete_queue(self, queue: str) -> None:
        """Forget a queue that holds nothing; Conflict if it holds tasks."""
        ...

    async def resume(self, queue: str) -> None: ...

    # -- schedules and limits (docs/design/schedules.md) ------------------------------------

    async def put_schedule(self, name: str, spec: ScheduleSpec) -> Schedule:
        """Create or replace a schedule; returns it as the broker stores it."""
        ...

    async def get_schedule(self, name: str) -> Schedule:
        """NotFound if there is none of that name."""
        ...

    async def list_schedules(self) -> list[Schedule]:
        """Every schedule, by name."""
        ...

    async def delete_schedule(self, name: str) -> None:
        """NotFound if there is none of that name."""
        ...

    async def pause_schedule(self, name: str) -> Schedule: ...

    async def resume_schedule(self, name: str) -> Schedule: ...

    async def set_limits(self, queue: str, limits: Limits | None) -> Limits | None:
        """Set a queue's limits (None, or both kinds None: clear them); returns those in force
        (None: none)."""
        ...

    async def close(self) -> None:
        """Release connections. The transport is not used again."""
        ...


@runtime_checkable
class StreamingTransport(Transport, Protocol):
    """A transport that can also consume tasks pushed by the broker (gRPC StreamJobs).

    Whether a transport streams is decided by this protocol (it has ``stream``), so a transport
    that cannot stream simply has no ``stream`` method."""

    async def stream(
        self, prefetch: int, lease_ms: int | None, queues: Sequence[str] | None = None
    ) -> AsyncStream:
        """Open a stream: at most ``prefetch`` deliveries unsettled at once, from ``queues`` (in
        order of preference; None: ``["default"]``). Raise (``Unavailable``,
        ``InvalidArgument``, ...) if the broker does not accept it."""
        ...
