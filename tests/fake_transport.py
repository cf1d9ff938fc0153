"""An in-memory broker behind wqclient's transport seam, for tests that need no broker.

``FakeTransport`` is a :class:`wqclient.Transport` (unary calls only, like HTTP);
``FakeStreamingTransport`` is a :class:`wqclient.StreamingTransport` (it streams too, like gRPC).
Hand either to ``AsyncClient(transport=...)``. They keep the broker's rules that a client can
notice (leases, attempts, burial after ``max_attempts``, prefetch, reclaiming a closed stream's
tasks) and leave out time: delays and backoff are not honoured, and a lease never runs out unless
a test says so (:meth:`FakeTransport.take_away`).

Tests steer them and watch them without sleeping: :meth:`FakeTransport.fail` makes the next calls
of an operation raise, and :meth:`FakeTransport.wait_until` waits for a condition on their state,
which every call changes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from wqclient import (
    Delivery,
    LeaseLost,
    NotFound,
    Stats,
    StreamEnded,
    Task,
    Totals,
    Unavailable,
    WqError,
)
from wqclient.limits import DEFAULT_LEASE_MS, DEFAULT_WAIT_MS


class Call(NamedTuple):
    """One call made on the fake: the operation's name, and the task it was about (if any)."""

    op: str
    task_id: str | None = None


@dataclass
class Counters:
    enqueued: int = 0
    delivered: int = 0
    reclaimed: int = 0
    retried: int = 0
    buried: int = 0
    requeued: int = 0


class FakeTransport:
    """An in-memory broker, as a unary transport."""

    def __init__(self) -> None:
        self.tasks: dict[str, Task] = {}  # every task, as the broker would report it now
        self.ready: deque[str] = deque()  # ids, oldest first
        self.held: dict[str, str] = {}  # id -> the lease it is held under
        self.dead: list[str] = []
        self.acked: list[str] = []  # ids, in the order their acks were accepted
        self.nacked: list[tuple[str, str | None]] = []  # (id, error), accepted nacks in order
        self.calls: list[Call] = []
        self.claims: list[tuple[int | None, int | None]] = []  # (wait_ms, lease_ms) asked for
        self.closed = False
        self.counters = Counters()
        self._failures: dict[str, deque[WqError]] = {}
        self._changed = asyncio.Event()
        self._ids = itertools.count(1)
        self._leases = itertools.count(1)

    # -- steering and watching -------------------------------------------------------------------

    def add(self, payload: Any = None, *, max_attempts: int = 3) -> str:
        """Enqueue a task directly (no call recorded); returns its id."""
        return self._add(json.dumps(payload).encode(), max_attempts)

    def fail(self, op: str, error: WqError, times: int = 1) -> None:
        """Make the next ``times`` calls of ``op`` ("claim", "ack", "stream", ...) raise
        ``error`` instead of doing anything."""
        self._failures.setdefault(op, deque()).extend([error] * times)

    def take_away(self, task_id: str) -> None:
        """The task's lease passes to somebody else (as when it ran out and the task was claimed
        again): acks and nacks under the old lease get LeaseLost."""
        self.held[task_id] = self._lease()
        self.notify()

    def calls_to(self, op: str) -> list[str | None]:
        """The task ids of the calls made to ``op`` (None for calls about no task), in order."""
        return [call.task_id for call in self.calls if call.op == op]

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Return once ``predicate()`` holds; it is checked after every change to the fake."""
        try:
            await asyncio.wait_for(self.until(predicate), timeout)
        except TimeoutError:
            raise AssertionError(
                f"timed out after {timeout}s; calls so far: {self.calls}"
            ) from None

    # -- Transport -------------------------------------------------------------------------------

    async def enqueue(
        self, payload_json: bytes, max_attempts: int | None, delay_ms: int | None
    ) -> str:
        self._call("enqueue")
        return self._add(payload_json, 3 if max_attempts is None else max_attempts)

    async def enqueue_many(
        self, items: Sequence[tuple[bytes, int | None, int | None]]
    ) -> list[str]:
        self._call("enqueue_many")
        return [
            self._add(payload, 3 if attempts is None else attempts)
            for payload, attempts, _ in items
        ]

    async def claim(self, wait_ms: int | None, lease_ms: int | None) -> Delivery | None:
        self._call("claim")
        self.claims.append((wait_ms, lease_ms))
        wait = DEFAULT_WAIT_MS if wait_ms is None else wait_ms
        if wait <= 0 or self.ready:
            return self.hand_out(lease_ms) if self.ready else None
        try:
            return await asyncio.wait_for(self._next_ready(lease_ms), wait / 1000)
        except TimeoutError:
            return None

    async def _next_ready(self, lease_ms: int | None) -> Delivery:
        await self.until(lambda: bool(self.ready))
        return self.hand_out(lease_ms)  # at once: no other claim can take it in between

    async def ack(self, task_id: str, lease_id: str) -> None:
        self._call("ack", task_id)
        self._release(task_id, lease_id)
        self.acked.append(task_id)
        self.notify()

    async def nack(self, task_id: str, lease_id: str, error: str | None) -> None:
        self._call("nack", task_id)
        self._release(task_id, lease_id)
        self.nacked.append((task_id, error))
        self.failed(task_id, error)

    async def stats(self) -> Stats:
        self._call("stats")
        c = self.counters
        totals = Totals(
            enqueued=c.enqueued,
            delivered=c.delivered,
            acked=len(self.acked),
            nacked=len(self.nacked),
            reclaimed=c.reclaimed,
            retried=c.retried,
            buried=c.buried,
            requeued=c.requeued,
        )
        return Stats(
            ready=len(self.ready), handed_out=len(self.held), dead=len(self.dead), totals=totals
        )

    async def dead_letters(self, limit: int | None) -> list[Task]:
        self._call("dead_letters")
        ids = self.dead if limit is None else self.dead[:limit]
        return [self.tasks[task_id] for task_id in ids]

    async def requeue(self, task_id: str) -> None:
        self._call("requeue", task_id)
        if task_id not in self.dead:
            raise NotFound(f"task {task_id} is not in the dead-letter queue")
        self.dead.remove(task_id)
        self.tasks[task_id] = replace(self.tasks[task_id], attempts=0, last_error=None)
        self.ready.append(task_id)
        self.counters.requeued += 1
        self.notify()

    async def close(self) -> None:
        self.calls.append(Call("close"))
        self.closed = True
        self.notify()

    # -- the broker's side -----------------------------------------------------------------------

    def hand_out(self, lease_ms: int | None) -> Delivery:
        """Hand the oldest ready task out under a fresh lease."""
        task_id = self.ready.popleft()
        task = replace(self.tasks[task_id], attempts=self.tasks[task_id].attempts + 1)
        self.tasks[task_id] = task
        lease_id = self.held[task_id] = self._lease()
        self.counters.delivered += 1
        self.notify()
        lease = timedelta(milliseconds=DEFAULT_LEASE_MS if lease_ms is None else lease_ms)
        return Delivery(task, lease_id, datetime.now(UTC) + lease)

    def failed(self, task_id: str, error: str | None) -> None:
        """A delivery of the task failed: it is retried at once, or buried when out of attempts."""
        task = self.tasks[task_id] = replace(self.tasks[task_id], last_error=error)
        if task.attempts >= task.max_attempts:
            self.dead.append(task_id)
            self.counters.buried += 1
        else:
            self.ready.append(task_id)
            self.counters.retried += 1
        self.notify()

    def reclaim(self, task_id: str, lease_id: str) -> None:
        """Take back a task held under ``lease_id`` whose holder went away (its stream ended)."""
        if self.held.get(task_id) == lease_id:
            del self.held[task_id]
            self.counters.reclaimed += 1
            self.failed(task_id, "reclaimed")

    # -- internals -------------------------------------------------------------------------------

    def _call(self, op: str, task_id: str | None = None) -> None:
        self.calls.append(Call(op, task_id))
        self.notify()
        if self.closed:
            raise Unavailable("the transport is closed")
        failures = self._failures.get(op)
        if failures:
            raise failures.popleft()

    def _add(self, payload_json: bytes, max_attempts: int) -> str:
        task_id = f"t{next(self._ids)}"
        now = datetime.now(UTC)
        self.tasks[task_id] = Task(task_id, payload_json, 0, max_attempts, now, now)
        self.ready.append(task_id)
        self.counters.enqueued += 1
        self.notify()
        return task_id

    def _lease(self) -> str:
        return f"lease{next(self._leases)}"

    def _release(self, task_id: str, lease_id: str) -> None:
        holder = self.held.get(task_id)
        if holder is None:
            raise NotFound(f"task {task_id} is not handed out")
        if holder != lease_id:
            raise LeaseLost(f"task {task_id} is held under another lease")
        del self.held[task_id]

    def notify(self) -> None:
        """Wake everything waiting (in :meth:`until`) for a change."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, checking it after every change. It returns without
        yielding to the event loop when the predicate holds, so the caller can act on what it
        saw before anybody else runs."""
        while not predicate():
            await self._changed.wait()


class FakeStream:
    """One stream from a FakeStreamingTransport: pushes ready tasks, never more than
    ``prefetch`` unsettled, none after ``drain()``."""

    def __init__(self, broker: FakeStreamingTransport, prefetch: int, lease_ms: int | None) -> None:
        self.broker = broker
        self.prefetch = prefetch
        self.lease_ms = lease_ms
        self.unsettled: dict[str, Delivery] = {}
        self.draining = False
        self.closed = False
        self.broken: StreamEnded | None = None

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Delivery:
        await self.broker.until(self._can_go_on)
        if self.broken is not None:
            raise self.broken
        if self.closed:
            raise StopAsyncIteration
        delivery = self.broker.hand_out(self.lease_ms)
        self.unsettled[delivery.task.id] = delivery
        return delivery

    def _can_go_on(self) -> bool:
        if self.closed or self.broken is not None:
            return True
        has_room = len(self.unsettled) < self.prefetch and not self.draining
        return has_room and bool(self.broker.ready)

    async def ack(self, delivery: Delivery) -> None:
        self._check_open()
        try:
            await self.broker.ack(delivery.task.id, delivery.lease_id)
        finally:
            self._settled(delivery)

    async def nack(self, delivery: Delivery, error: str | None = None) -> None:
        self._check_open()
        try:
            await self.broker.nack(delivery.task.id, delivery.lease_id, error)
        finally:
            self._settled(delivery)

    async def drain(self) -> None:
        self.draining = True
        self.broker.notify()

    async def close(self) -> None:
        """End the stream: its unsettled tasks are reclaimed at once."""
        if not self.closed:
            self.closed = True
            self._give_back()

    def break_(self, why: str = "the connection broke") -> None:
        """The stream breaks (as a lost connection would): iteration and settlements raise
        StreamEnded, and its unsettled tasks are reclaimed."""
        self.broken = StreamEnded(f"the stream broke: {why}")
        self._give_back()

    def _check_open(self) -> None:
        if self.broken is not None:
            raise self.broken
        if self.closed:
            raise StreamEnded("the stream has ended")

    def _settled(self, delivery: Delivery) -> None:
        if self.unsettled.pop(delivery.task.id, None) is not None:
            self.broker.notify()

    def _give_back(self) -> None:
        for delivery in self.unsettled.values():
            self.broker.reclaim(delivery.task.id, delivery.lease_id)
        self.unsettled.clear()
        self.broker.notify()


class FakeStreamingTransport(FakeTransport):
    """An in-memory broker, as a transport that also streams."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[FakeStream] = []

    async def stream(self, prefetch: int, lease_ms: int | None) -> FakeStream:
        self._call("stream")
        stream = FakeStream(self, prefetch, lease_ms)
        self.streams.append(stream)
        return stream

    def break_streams(self, why: str = "the connection broke") -> None:
        """Break every open stream (see FakeStream.break_)."""
        for stream in self.streams:
            if not stream.closed and stream.broken is None:
                stream.break_(why)
