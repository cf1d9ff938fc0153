"""An in-memory broker behind wqclient's transport seam, for tests that need no broker.

``FakeTransport`` is a :class:`wqclient.Transport` (unary calls only, like HTTP);
``FakeStreamingTransport`` is a :class:`wqclient.StreamingTransport` (it streams too, like gRPC).
Hand either to ``AsyncClient(transport=...)``. They keep the broker's rules that a client can
notice (leases, attempts, burial after ``max_attempts``, prefetch, reclaiming a closed stream's
tasks, named queues claimed in the order listed, priorities (higher first, then oldest), paused
queues, idempotency keys, lease extension, nack options, lookups, the DLQ's bulk operations,
release (the task back at the head, its attempt given back; ``releases = False`` makes it
Unsupported), and task control: cancels (a handed-out task becomes cancelling: its extensions are
refused with Cancelled, its stream is told, its nack drops it), listings with cursors, emptying and
deleting queues, progress, and the new enqueue options, kept on the task; and results and
workflows, docs/design/results.md: acks with results kept as succeeded tasks, result waits (on a
fake clock given as ``clock``, or real time), ``after`` with ids and a batch's indices, waiting
tasks released when their parents succeed, buried or cancelled with them, parents' results on
deliveries, children in lookups; and schedules and limits, docs/design/schedules.md: schedules kept
by name, fired when a test says so (:meth:`FakeTransport.fire`, the task carrying its ``schedule``
and ``scheduled_for``), paused and resumed, and queue limits kept and shown by ``queues()``, though
not applied to claims) and leave out time: delays and backoff are not honoured (a task nacked with
``delay_ms`` is ready at once, as after any nack), idempotency keys never expire, tasks never
expire, time limits are not enforced (make extensions raise TimeLimitReached with
:meth:`FakeTransport.fail`), and a lease never runs out unless a test says so
(:meth:`FakeTransport.take_away`).

Tests steer them and watch them without sleeping: :meth:`FakeTransport.fail` makes the next calls
of an operation raise, and :meth:`FakeTransport.wait_until` waits for a condition on their state,
which every call changes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from tests.fake_clock import FakeClock
from wqclient import (
    Cancelled,
    Conflict,
    Delivery,
    Enqueued,
    EnqueueItem,
    InvalidArgument,
    LeaseLost,
    Limits,
    NotFound,
    QueueInfo,
    Schedule,
    Stats,
    StreamEnded,
    Task,
    TaskPage,
    Totals,
    Unavailable,
    Unsupported,
    WqError,
)
from wqclient.limits import DEFAULT_LEASE_MS, DEFAULT_WAIT_MS, MAX_WAIT_MS
from wqclient.models import DEFAULT_QUEUE, ParentResult, ScheduleSpec, TaskResult

_QUEUE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class Call(NamedTuple):
    """One call made on the fake: the operation's name, and the task it was about (if any)."""

    op: str
    task_id: str | None = None


class Nack(NamedTuple):
    """One accepted nack, with its options."""

    task_id: str
    error: str | None
    delay_ms: int | None = None
    terminal: bool = False


@dataclass
class Counters:
    enqueued: int = 0
    delivered: int = 0
    reclaimed: int = 0
    retried: int = 0
    buried: int = 0
    requeued: int = 0
    purged: int = 0
    cancelled: int = 0


class FakeTransport:
    """An in-memory broker, as a unary transport. ``clock``: what its result waits wait on
    (default: real time)."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock
        self.tasks: dict[str, Task] = {}  # every task, as the broker would report it now
        self.ready: deque[str] = deque()  # ids, oldest first
        self.held: dict[str, str] = {}  # id -> the lease it is held under
        self.dead: list[str] = []
        self.acked: list[str] = []  # ids, in the order their acks were accepted
        self.nacked: list[tuple[str, str | None]] = []  # (id, error), accepted nacks in order
        self.nacks: list[Nack] = []  # the same nacks, with their options
        self.released: list[str] = []  # ids, accepted releases in order
        self.releases = True  # it has release (False: Unsupported, as a broker without it)
        self.extends: list[tuple[str, int | None]] = []  # (id, lease_ms), accepted extends
        self.claim_queues: list[list[str]] = []  # the queues each claim (or stream) asked for
        self.keys: dict[tuple[str, str], str] = {}  # (queue, idempotency key) -> the first id
        self.paused: set[str] = set()
        self.known_queues: set[str] = {DEFAULT_QUEUE}
        self.calls: list[Call] = []
        self.claims: list[tuple[int | None, int | None]] = []  # (wait_ms, lease_ms) asked for
        self.purged: set[str] = set()
        self.gone: set[str] = set()  # cancelled (or emptied out) for good
        self.cancelling: set[str] = set()  # handed out, and cancelled meanwhile
        self.progress: dict[str, bytes] = {}  # the last progress reported, while handed out
        self.progress_reports: list[tuple[str, bytes]] = []  # (id, JSON text), in order
        self.options: dict[str, EnqueueItem] = {}  # what each enqueue asked for, by task id
        # Results and workflows (docs/design/results.md).
        self.results: list[tuple[str, bytes]] = []  # (id, JSON text) of each ack with a result
        self.succeeded: dict[str, None] = {}  # ids of the tasks kept with a result, by finish
        self.waiting: dict[str, set[str]] = {}  # a waiting task's id -> parents not yet done
        self.children_of: dict[str, list[str]] = {}  # a parent's id -> its children, in order
        self.ended: dict[str, TaskResult] = {}  # how each task that ended did (for waiters)
        self.result_waits: list[tuple[str, int | None]] = []  # (id, wait_ms) of each wait
        # Schedules and limits (docs/design/schedules.md).
        self.schedules: dict[str, Schedule] = {}
        self.limits: dict[str, Limits] = {}
        self._seq = itertools.count(1)  # positions, for listings (see _key)
        self.position: dict[str, int] = {}  # a task's place in its state, for listings
        self.closed = False
        self.counters = Counters()
        self._failures: dict[str, deque[WqError]] = {}
        self._changed = asyncio.Event()
        self._ids = itertools.count(1)
        self._leases = itertools.count(1)

    # -- steering and watching -------------------------------------------------------------------

    def add(
        self,
        payload: Any = None,
        *,
        max_attempts: int = 3,
        queue: str = DEFAULT_QUEUE,
        priority: int = 0,
        timeout_ms: int | None = None,
    ) -> str:
        """Enqueue a task directly (no call recorded); returns its id."""
        return self._add(
            json.dumps(payload).encode(), max_attempts, queue, priority, timeout_ms=timeout_ms
        )

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
    ) -> Enqueued:
        self._call("enqueue")
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
        self._check(item, "")
        self._check_parents(item, "", None, [])
        return self._submit(item, [])

    async def enqueue_many(self, items: Sequence[EnqueueItem]) -> list[Enqueued]:
        self._call("enqueue_many")
        for i, item in enumerate(items):  # all or none
            self._check(item, f"tasks[{i}].")
            self._check_parents(item, f"tasks[{i}].", i, [])
        done: list[Enqueued] = []
        for item in items:
            done.append(self._submit(item, done))
        return done

    async def claim(
        self, wait_ms: int | None, lease_ms: int | None, queues: Sequence[str] | None = None
    ) -> Delivery | None:
        self._call("claim")
        self.claims.append((wait_ms, lease_ms))
        wanted = self.queue_list(queues)
        self.claim_queues.append(wanted)
        wait = DEFAULT_WAIT_MS if wait_ms is None else wait_ms
        if wait <= 0 or self.next_ready(wanted) is not None:
            return self.hand_out(lease_ms, wanted) if self.next_ready(wanted) else None
        try:
            return await asyncio.wait_for(self._next_ready(lease_ms, wanted), wait / 1000)
        except TimeoutError:
            return None

    async def _next_ready(self, lease_ms: int | None, queues: list[str]) -> Delivery:
        await self.until(lambda: self.next_ready(queues) is not None)
        return self.hand_out(lease_ms, queues)  # at once: no other claim can take it in between

    async def ack(self, task_id: str, lease_id: str, *, result: bytes | None = None) -> None:
        self._call("ack", task_id)
        if result is not None:
            json.loads(result)  # (the fake trusts the client to send JSON)
        self._release(task_id, lease_id)
        self.acked.append(task_id)
        task = self.tasks[task_id]
        now = datetime.now(UTC)
        ttl = self.options[task_id].result_ttl_ms if task_id in self.options else None
        if result is not None:
            self.results.append((task_id, result))
        if result is not None and ttl != 0:
            self.tasks[task_id] = replace(task, result_json=result, finished_at=now)
            self.succeeded[task_id] = None
        self.ended[task_id] = TaskResult(task_id, "succeeded", result if ttl != 0 else None, now)
        for child in self.children_of.get(task_id, ()):
            pending = self.waiting.get(child)
            if pending is not None:
                pending.discard(task_id)
                if not pending:
                    del self.waiting[child]
                    self.position[child] = next(self._seq)
                    self.ready.append(child)
        self.notify()

    async def nack(
        self,
        task_id: str,
        lease_id: str,
        error: str | None,
        delay_ms: int | None = None,
        terminal: bool = False,
    ) -> None:
        self._call("nack", task_id)
        if terminal and delay_ms is not None:
            raise InvalidArgument("delay_ms and terminal cannot both be given")
        if delay_ms is not None and delay_ms < 0:
            raise InvalidArgument("delay_ms must be an integer from 0")
        self._release(task_id, lease_id)
        self.nacked.append((task_id, error))
        self.nacks.append(Nack(task_id, error, delay_ms, terminal))
        if task_id in self.cancelling:  # dropped, counted cancelled: no retry
            self.cancelling.discard(task_id)
            self._cancelled(task_id)
            self.notify()
            return
        self.failed(task_id, error, terminal=terminal)

    async def release(self, task_id: str, lease_id: str) -> None:
        """Back to the head of the ready tasks, its attempt given back (a cancelling task is
        dropped); Unsupported if ``releases`` is False."""
        self._call("release", task_id)
        if not self.releases:
            raise Unsupported("no release (HTTP 404 on POST /jobs/{id}/release)")
        self._release(task_id, lease_id)
        self.released.append(task_id)
        if task_id in self.cancelling:  # (its delivery stays counted, as in the stores)
            self.cancelling.discard(task_id)
            self._cancelled(task_id)
        else:
            self.counters.delivered -= 1
            task = self.tasks[task_id]
            self.tasks[task_id] = replace(task, attempts=task.attempts - 1)
            self.position[task_id] = next(self._seq)
            self.ready.appendleft(task_id)
        self.notify()

    async def extend(
        self, task_id: str, lease_id: str, lease_ms: int | None, *, progress: bytes | None = None
    ) -> datetime:
        self._call("extend", task_id)
        if lease_ms is not None and lease_ms <= 0:
            raise InvalidArgument("lease_ms must be a positive integer")
        self._check_lease(task_id, lease_id)
        if task_id in self.cancelling:
            raise Cancelled(f"task {task_id} was cancelled")
        if progress is not None:
            if len(progress) > 4096:
                raise InvalidArgument(f"progress must be at most 4096 bytes, got {len(progress)}")
            json.loads(progress)  # (the fake trusts the client to send JSON)
            self.progress[task_id] = progress
            self.progress_reports.append((task_id, progress))
        self.extends.append((task_id, lease_ms))
        self.notify()
        return self.deadline(lease_ms)

    async def cancel(self, task_id: str) -> str:
        self._call("cancel", task_id)
        if task_id in self.held:
            if task_id not in self.cancelling:
                self.cancelling.add(task_id)
                self.told_cancel(task_id, self.held[task_id])
            self.notify()
            return "cancelling"
        if task_id in self.ready or task_id in self.waiting:
            if task_id in self.ready:
                self.ready.remove(task_id)
            self.waiting.pop(task_id, None)
            self._cancelled(task_id)
            self.notify()
            return "cancelled"
        if task_id in self.dead:
            self.dead.remove(task_id)
            self.purged.add(task_id)
            self.counters.purged += 1
            self.notify()
            return "purged"
        raise NotFound(f"task {task_id} not found")

    def told_cancel(self, task_id: str, lease_id: str) -> None:
        """A handed-out task was cancelled: whoever holds it on a stream is told (none here)."""

    async def list_tasks(
        self, queue: str | None, state: str | None, limit: int | None, cursor: str | None
    ) -> TaskPage:
        self._call("list_tasks")
        name = DEFAULT_QUEUE if queue is None else queue
        self._check_queue(name, "queue")
        which = "ready" if state is None else state
        count = 100 if limit is None else limit
        if not 1 <= count <= 1000:
            raise InvalidArgument(f"limit must be from 1 to 1000, got {count}")
        members: dict[str, Iterable[str]] = {
            "ready": self.ready,
            "handed_out": self.held,
            "dead": self.dead,
            "delayed": (),
            "waiting": self.waiting,
            "succeeded": self.succeeded,
        }
        if which not in members:
            raise InvalidArgument(
                f"state {which!r} is not one of ready, delayed, handed_out, dead, waiting, "
                "succeeded"
            )
        ids = sorted(
            (i for i in members[which] if self.tasks[i].queue == name),
            key=lambda i: self._key(i, which),
        )
        if cursor:
            state_of, _, at = cursor.partition(":")
            if state_of != which:
                raise InvalidArgument(f"cursor is not one of this listing's: {cursor!r}")
            after = tuple(int(n) for n in at.split(","))
            ids = [i for i in ids if self._key(i, which) > after]
        page = ids[:count]
        tasks = [replace(self._view(i), state=which) for i in page]
        more = len(ids) > count
        next_cursor = f"{which}:" + ",".join(map(str, self._key(page[-1], which))) if more else None
        return TaskPage(tasks, next_cursor)

    def _key(self, task_id: str, state: str) -> tuple[int, ...]:
        """A task's place in a listing of its state: ready ones by priority, then oldest."""
        if state == "ready":
            return (-self.tasks[task_id].priority, self.position[task_id])
        return (self.position[task_id],)

    async def empty_queue(self, queue: str) -> int:
        self._call("empty_queue")
        self._check_queue(queue, "queue")
        if queue not in self.known_queues:
            raise NotFound(f"queue {queue} not found")
        ids = [i for i in [*self.ready, *self.waiting] if self.tasks[i].queue == queue]
        for task_id in ids:
            if task_id in self.ready:
                self.ready.remove(task_id)
            if task_id in self.waiting:
                del self.waiting[task_id]
            if task_id not in self.gone:
                self._cancelled(task_id)
        self.notify()
        return len(ids)

    async def delete_queue(self, queue: str) -> None:
        self._call("delete_queue")
        self._check_queue(queue, "queue")
        if queue not in self.known_queues:
            raise NotFound(f"queue {queue} not found")
        info = self._queue_info(queue)
        if info.ready or info.handed_out or info.dead:
            raise Conflict(
                f"queue {queue} holds tasks: {info.ready} ready, {info.handed_out} handed out, "
                f"0 delayed, {info.dead} dead"
            )
        self.known_queues.discard(queue)
        self.paused.discard(queue)
        self.notify()

    async def get_task(self, task_id: str) -> Task:
        self._call("get_task", task_id)
        if not self.known(task_id):
            raise NotFound(f"task {task_id} not found")
        children = [c for c in self.children_of.get(task_id, ()) if self.live(c)]
        return replace(
            self._view(task_id),
            state=self.state_of(task_id),
            waiting_for=len(self.waiting.get(task_id, ())),
            children=tuple(children[:100]) or None,
            children_count=len(children),
        )

    def known(self, task_id: str) -> bool:
        """Whether the broker still has the task (succeeded ones kept with their results)."""
        if task_id in self.succeeded:
            return True
        gone = task_id in self.acked or task_id in self.purged or task_id in self.gone
        return task_id in self.tasks and not gone

    def live(self, task_id: str) -> bool:
        """Whether a task is not yet gone (waiting, ready, handed out or dead): a child that
        pins its parents' results, and shows in their lookups."""
        return self.known(task_id) and task_id not in self.succeeded

    async def wait_result(self, task_id: str, wait_ms: int | None) -> TaskResult | None:
        self._call("wait_result", task_id)
        self.result_waits.append((task_id, wait_ms))
        if not self.known(task_id):
            raise NotFound(f"task {task_id} not found")
        if wait_ms is not None and wait_ms < 0:
            raise InvalidArgument("wait_ms must be an integer from 0")
        wait = min(MAX_WAIT_MS, wait_ms or 0) / 1000
        if self._outcome(task_id) is None and wait > 0:
            ended = asyncio.ensure_future(self.until(lambda: self._outcome(task_id) is not None))
            waits = [ended]
            if self.clock is not None:
                waits.append(asyncio.ensure_future(self.clock.sleep(wait)))
            await asyncio.wait(
                waits, timeout=None if self.clock else wait, return_when=asyncio.FIRST_COMPLETED
            )
            for waited in waits:
                waited.cancel()
        return self._outcome(task_id)

    def _outcome(self, task_id: str) -> TaskResult | None:
        """How the task ended (None: it is still pending)."""
        if task_id in self.dead:
            task = self.tasks[task_id]
            return TaskResult(task_id, "dead", last_error=task.last_error, attempts=task.attempts)
        if task_id in self.succeeded:
            task = self.tasks[task_id]
            return TaskResult(task_id, "succeeded", task.result_json, task.finished_at)
        return self.ended.get(task_id)

    def _view(self, task_id: str) -> Task:
        """The task as a lookup shows it: with its progress and cancelling while handed out."""
        task = self.tasks[task_id]
        if task_id not in self.held:
            return task
        return replace(
            task,
            progress_json=self.progress.get(task_id),
            cancelling=task_id in self.cancelling,
        )

    def state_of(self, task_id: str) -> str:
        """The task's state as a lookup reports it (the fake has no delayed tasks)."""
        if task_id in self.held:
            return "handed_out"
        if task_id in self.succeeded:
            return "succeeded"
        if task_id in self.waiting:
            return "waiting"
        return "dead" if task_id in self.dead else "ready"

    async def stats(self, queue: str | None = None) -> Stats:
        """The gauges of one queue (or all); the totals are always the whole fake's."""
        self._call("stats")
        if queue is not None:
            info = self._queue_info(queue)
            return Stats(
                info.ready,
                info.handed_out,
                0,
                info.dead,
                self._totals(),
                waiting=info.waiting,
                succeeded=info.succeeded,
            )
        return Stats(
            ready=len(self.ready),
            handed_out=len(self.held),
            dead=len(self.dead),
            totals=self._totals(),
            waiting=len(self.waiting),
            succeeded=len(self.succeeded),
        )

    async def queues(self) -> list[QueueInfo]:
        self._call("queues")
        return [self._queue_info(name) for name in sorted(self.known_queues)]

    def _queue_info(self, name: str) -> QueueInfo:
        def count(ids: Iterable[str]) -> int:
            return sum(1 for task_id in ids if self.tasks[task_id].queue == name)

        paused = name in self.paused
        limits = self.limits.get(name)
        rate = None if limits is None else limits.rate
        return QueueInfo(
            name,
            count(self.ready),
            count(self.held),
            0,
            count(self.dead),
            paused,
            waiting=count(self.waiting),
            succeeded=count(self.succeeded),
            limits=limits,
            tokens=None if rate is None else float(rate.burst or rate.tasks),
        )

    def _totals(self) -> Totals:
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
            purged=c.purged,
            cancelled=c.cancelled,
        )
        return totals

    async def dead_letters(self, limit: int | None, queue: str | None = None) -> list[Task]:
        self._call("dead_letters")
        ids = [i for i in self.dead if queue is None or self.tasks[i].queue == queue]
        return [self.tasks[task_id] for task_id in (ids if limit is None else ids[:limit])]

    async def requeue(self, task_id: str) -> None:
        self._call("requeue", task_id)
        if task_id not in self.dead:
            raise NotFound(f"task {task_id} is not in the dead-letter queue")
        self.dead.remove(task_id)
        self.tasks[task_id] = replace(self.tasks[task_id], attempts=0, last_error=None)
        self.ready.append(task_id)
        self.counters.requeued += 1
        self.notify()

    def _cancelled(self, task_id: str) -> None:
        """A task is cancelled (gone, counted), and so is every task waiting on it, in turn."""
        self.gone.add(task_id)
        self.counters.cancelled += 1
        self.ended[task_id] = TaskResult(task_id, "cancelled")
        for child in self.children_of.get(task_id, ()):
            if child in self.waiting:
                del self.waiting[child]
                self._cancelled(child)

    def _bury_children(self, task_id: str, why: str) -> None:
        """The tasks waiting on a task that died are buried (not counted buried: they never
        ran), each naming its parent, and theirs in turn."""
        for child in self.children_of.get(task_id, ()):
            if child in self.waiting:
                del self.waiting[child]
                error = f"parent {task_id} {why}"
                self.tasks[child] = replace(self.tasks[child], last_error=error)
                self.position[child] = next(self._seq)
                self.dead.append(child)
                self._bury_children(child, f"is dead: {error}")

    async def requeue_all(self, queue: str | None = None) -> int:
        self._call("requeue_all")
        ids = [i for i in self.dead if queue is None or self.tasks[i].queue == queue]
        for task_id in ids:
            self.dead.remove(task_id)
            self.tasks[task_id] = replace(self.tasks[task_id], attempts=0, last_error=None)
            self.ready.append(task_id)
        self.counters.requeued += len(ids)
        self.notify()
        return len(ids)

    async def purge(self, task_id: str) -> None:
        self._call("purge", task_id)
        if task_id not in self.dead:
            raise NotFound(f"task {task_id} is not in the dead-letter queue")
        self.dead.remove(task_id)
        self.purged.add(task_id)
        self.counters.purged += 1
        self.notify()

    async def pause(self, queue: str) -> None:
        self._call("pause")
        self._check_queue(queue, "queue")
        self.known_queues.add(queue)
        self.paused.add(queue)
        self.notify()

    async def resume(self, queue: str) -> None:
        self._call("resume")
        self._check_queue(queue, "queue")
        self.known_queues.add(queue)
        self.paused.discard(queue)
        self.notify()

    # -- schedules and limits (docs/design/schedules.md) ---------------------------------------

    async def put_schedule(self, name: str, spec: ScheduleSpec) -> Schedule:
        self._call("put_schedule")
        self._check_queue(name, "name")
        if (spec.cron is None) == (spec.every_ms is None):
            raise InvalidArgument("give exactly one of cron and every_ms")
        if spec.timezone is not None and spec.cron is None:
            raise InvalidArgument("timezone goes with cron only")
        if spec.every_ms is not None and not 1000 <= spec.every_ms <= 31_536_000_000:
            raise InvalidArgument(f"every_ms must be from 1000 to 31536000000, got {spec.every_ms}")
        if spec.cron is not None and len(spec.cron.split()) != 5 and not spec.cron.startswith("@"):
            raise InvalidArgument(f"cron {spec.cron!r} is not a cron expression")
        if spec.queue is not None:
            self._check_queue(spec.queue, "queue")
        now = datetime.now(UTC)
        before = self.schedules.get(name)
        every = spec.every_ms
        schedule = Schedule(
            name,
            spec.payload_json,
            cron=spec.cron,
            timezone=None if spec.cron is None else spec.timezone or "UTC",
            every_ms=every,
            queue=spec.queue or DEFAULT_QUEUE,
            priority=spec.priority or 0,
            max_attempts=spec.max_attempts or 3,
            expires_in_ms=spec.expires_in_ms,
            timeout_ms=spec.timeout_ms,
            result_ttl_ms=spec.result_ttl_ms,
            paused=spec.paused,
            created_at=now if before is None else before.created_at,
            updated_at=now,
            next_fire_at=None if spec.paused else self._next_fire(every, now),
            last_fire_at=None if before is None else before.last_fire_at,
            last_task_id=None if before is None else before.last_task_id,
            fires=0 if before is None else before.fires,
        )
        self.schedules[name] = schedule
        return schedule

    @staticmethod
    def _next_fire(every_ms: int | None, now: datetime) -> datetime:
        """The next fire after ``now``: ``every_ms`` on, or (a cron rule: not computed here) the
        next minute."""
        if every_ms is not None:
            return now + timedelta(milliseconds=every_ms)
        return now.replace(second=0, microsecond=0) + timedelta(minutes=1)

    def _schedule_named(self, name: str) -> Schedule:
        schedule = self.schedules.get(name)
        if schedule is None:
            raise NotFound(f"schedule {name} not found")
        return schedule

    async def get_schedule(self, name: str) -> Schedule:
        self._call("get_schedule")
        return self._schedule_named(name)

    async def list_schedules(self) -> list[Schedule]:
        self._call("list_schedules")
        return [self.schedules[name] for name in sorted(self.schedules)]

    async def delete_schedule(self, name: str) -> None:
        self._call("delete_schedule")
        self._schedule_named(name)
        del self.schedules[name]

    async def pause_schedule(self, name: str) -> Schedule:
        self._call("pause_schedule")
        schedule = replace(self._schedule_named(name), paused=True, next_fire_at=None)
        self.schedules[name] = schedule
        return schedule

    async def resume_schedule(self, name: str) -> Schedule:
        self._call("resume_schedule")
        schedule = self._schedule_named(name)
        if schedule.paused:
            now = datetime.now(UTC)
            schedule = replace(
                schedule, paused=False, next_fire_at=self._next_fire(schedule.every_ms, now)
            )
            self.schedules[name] = schedule
        return schedule

    def fire(self, name: str) -> str:
        """Fire a schedule now, as the broker's sweeper would at its ``next_fire_at``: its task
        enqueued (with ``schedule`` and ``scheduled_for``), its last fire and count moved on.
        Returns the task's id."""
        schedule = self.schedules[name]
        when = schedule.next_fire_at or datetime.now(UTC)
        task_id = self._add(
            schedule.payload_json,
            schedule.max_attempts,
            schedule.queue,
            schedule.priority,
            timeout_ms=schedule.timeout_ms,
            expires_in_ms=schedule.expires_in_ms,
            result_ttl_ms=schedule.result_ttl_ms,
        )
        self.tasks[task_id] = replace(self.tasks[task_id], schedule=name, scheduled_for=when)
        self.schedules[name] = replace(
            schedule,
            last_fire_at=when,
            last_task_id=task_id,
            fires=schedule.fires + 1,
            next_fire_at=self._next_fire(schedule.every_ms, when),
        )
        return task_id

    async def set_limits(self, queue: str, limits: Limits | None) -> Limits | None:
        self._call("set_limits")
        self._check_queue(queue, "queue")
        self.known_queues.add(queue)
        if limits is None or limits.empty:
            self.limits.pop(queue, None)
            return None
        rate = limits.rate
        if rate is not None:
            if not 1 <= rate.tasks <= 1_000_000:
                raise InvalidArgument(f"rate.tasks must be from 1 to 1000000, got {rate.tasks}")
            if not 1 <= rate.per_ms <= 86_400_000:
                raise InvalidArgument(f"rate.per_ms must be from 1 to 86400000, got {rate.per_ms}")
            if rate.burst is None:  # (the broker's default: tasks)
                limits = replace(limits, rate=replace(rate, burst=rate.tasks))
        if limits.concurrency is not None and not 1 <= limits.concurrency <= 1_000_000:
            raise InvalidArgument(
                f"concurrency must be from 1 to 1000000, got {limits.concurrency}"
            )
        self.limits[queue] = limits
        return limits

    async def close(self) -> None:
        self.calls.append(Call("close"))
        self.closed = True
        self.notify()

    # -- the broker's side -----------------------------------------------------------------------

    @staticmethod
    def queue_list(queues: Sequence[str] | None) -> list[str]:
        """The queues a claim names, in order, without repeats (none: the default queue)."""
        if not queues:
            return [DEFAULT_QUEUE]
        for name in queues:
            FakeTransport._check_queue(name, "queue")
        return list(dict.fromkeys(queues))

    def next_ready(self, queues: Sequence[str] = (DEFAULT_QUEUE,)) -> str | None:
        """The ready task a claim on ``queues`` would get: from the first unpaused queue listed
        that has one, the highest priority, then the oldest."""
        for name in queues:
            if name in self.paused:
                continue
            candidates = [i for i in self.ready if self.tasks[i].queue == name]  # oldest first
            if candidates:
                return max(candidates, key=lambda i: self.tasks[i].priority)  # the first of ties
        return None

    def hand_out(self, lease_ms: int | None, queues: Sequence[str] = (DEFAULT_QUEUE,)) -> Delivery:
        """Hand the next ready task of ``queues`` out under a fresh lease."""
        task_id = self.next_ready(queues)
        assert task_id is not None, f"nothing ready in {queues}"
        self.ready.remove(task_id)
        task = replace(self.tasks[task_id], attempts=self.tasks[task_id].attempts + 1)
        self.tasks[task_id] = task
        self.position[task_id] = next(self._seq)
        lease_id = self.held[task_id] = self._lease()
        self.counters.delivered += 1
        self.notify()
        parents = task.after
        if parents:  # each with its result, if one is held
            task = replace(
                task,
                parents=tuple(
                    ParentResult(p, self.tasks[p].result_json if p in self.succeeded else None)
                    for p in parents
                ),
            )
        return Delivery(task, lease_id, self.deadline(lease_ms))

    @staticmethod
    def deadline(lease_ms: int | None) -> datetime:
        return datetime.now(UTC) + timedelta(
            milliseconds=DEFAULT_LEASE_MS if lease_ms is None else lease_ms
        )

    def failed(self, task_id: str, error: str | None, *, terminal: bool = False) -> None:
        """A delivery of the task failed: it is retried at once, or buried when out of attempts
        (or ``terminal``)."""
        task = self.tasks[task_id] = replace(self.tasks[task_id], last_error=error)
        self.position[task_id] = next(self._seq)
        if terminal or task.attempts >= task.max_attempts:
            self.dead.append(task_id)
            self.counters.buried += 1
            self._bury_children(task_id, f"is dead: {error}")
        else:
            self.ready.append(task_id)
            self.counters.retried += 1
        self.notify()

    def reclaim(self, task_id: str, lease_id: str) -> None:
        """Take back a task held under ``lease_id`` whose holder went away (its stream ended)."""
        if self.held.get(task_id) == lease_id:
            del self.held[task_id]
            self.progress.pop(task_id, None)
            if task_id in self.cancelling:
                self.cancelling.discard(task_id)
                self._cancelled(task_id)
                self.notify()
                return
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

    def _add(
        self,
        payload_json: bytes,
        max_attempts: int,
        queue: str = DEFAULT_QUEUE,
        priority: int = 0,
        timeout_ms: int | None = None,
        expires_in_ms: int | None = None,
        after: tuple[str, ...] | None = None,
        result_ttl_ms: int | None = None,
    ) -> str:
        task_id = f"t{next(self._ids)}"
        now = datetime.now(UTC)
        expires_at = None if expires_in_ms is None else now + timedelta(milliseconds=expires_in_ms)
        self.tasks[task_id] = Task(
            task_id,
            payload_json,
            0,
            max_attempts,
            now,
            now,
            queue=queue,
            priority=priority,
            timeout_ms=timeout_ms,
            expires_at=expires_at,
            after=after,
            result_ttl_ms=result_ttl_ms,
        )
        self.position[task_id] = next(self._seq)
        self.known_queues.add(queue)
        pending = {p for p in after or () if p not in self.succeeded and p not in self.acked}
        for parent in after or ():
            self.children_of.setdefault(parent, []).append(task_id)
        dead = [p for p in after or () if p in self.dead]
        if dead:  # a dead parent buries it at once
            error = f"parent {dead[0]} is dead: {self.tasks[dead[0]].last_error}"
            self.tasks[task_id] = replace(self.tasks[task_id], last_error=error)
            self.dead.append(task_id)
        elif pending:
            self.waiting[task_id] = pending
        else:
            self.ready.append(task_id)
        self.counters.enqueued += 1
        self.notify()
        return task_id

    @staticmethod
    def _check_queue(name: object, field: str) -> None:
        if not isinstance(name, str) or not _QUEUE_NAME.fullmatch(name):
            raise InvalidArgument(f"{field} must be 1-64 characters of [A-Za-z0-9_.-]")

    def _check(self, item: EnqueueItem, where: str) -> None:
        """The broker's checks of the new options (the others are left to it)."""
        if item.queue is not None:
            self._check_queue(item.queue, f"{where}queue")
        if item.priority is not None and not 0 <= item.priority <= 9:
            raise InvalidArgument(f"{where}priority must be an integer from 0 to 9")
        key = item.idempotency_key
        if key is not None and not (0 < len(key) <= 256 and key.isprintable()):
            raise InvalidArgument(f"{where}idempotency_key must be 1-256 printable characters")
        if item.unique and key is None:
            raise InvalidArgument(f"{where}unique needs an idempotency key")
        for name in ("expires_in_ms", "timeout_ms"):
            value = getattr(item, name)
            if value is not None and not 1 <= value <= 31_536_000_000:
                raise InvalidArgument(f"{where}{name} must be from 1 to 31536000000, got {value}")

    def _check_parents(
        self, item: EnqueueItem, where: str, index: int | None, earlier: list[Enqueued]
    ) -> None:
        """An ``after``'s parents: live tasks, or (in a batch: ``index``) earlier items."""
        for j, ref in enumerate(item.after or ()):
            if isinstance(ref, int):
                if index is None or not 0 <= ref < index:
                    raise InvalidArgument(
                        f"{where}after[{j}] must name an earlier item of the batch, got {ref}"
                    )
            elif not self.known(ref) or (ref in self.acked and ref not in self.succeeded):
                raise InvalidArgument(f"{where}after[{j}]: task {ref} does not exist")

    def _submit(self, item: EnqueueItem, earlier: list[Enqueued]) -> Enqueued:
        queue = DEFAULT_QUEUE if item.queue is None else item.queue
        if item.idempotency_key is not None:
            first = self.keys.get((queue, item.idempotency_key))
            if first is not None:
                return Enqueued(first, duplicate=True)
        attempts = 3 if item.max_attempts is None else item.max_attempts
        after = None
        if item.after:
            after = tuple(str(earlier[r]) if isinstance(r, int) else r for r in item.after)
        task_id = self._add(
            item.payload_json,
            attempts,
            queue,
            item.priority or 0,
            timeout_ms=item.timeout_ms,
            expires_in_ms=item.expires_in_ms,
            after=after,
            result_ttl_ms=item.result_ttl_ms,
        )
        self.options[task_id] = item
        if item.idempotency_key is not None:
            self.keys[(queue, item.idempotency_key)] = task_id
        return Enqueued(task_id)

    def _lease(self) -> str:
        return f"lease{next(self._leases)}"

    def _check_lease(self, task_id: str, lease_id: str) -> None:
        holder = self.held.get(task_id)
        if holder is None:
            raise NotFound(f"task {task_id} is not handed out")
        if holder != lease_id:
            raise LeaseLost(f"task {task_id} is held under another lease")

    def _release(self, task_id: str, lease_id: str) -> None:
        self._check_lease(task_id, lease_id)
        del self.held[task_id]
        self.progress.pop(task_id, None)

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

    def __init__(
        self,
        broker: FakeStreamingTransport,
        prefetch: int,
        lease_ms: int | None,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
    ) -> None:
        self.broker = broker
        self.prefetch = prefetch
        self.lease_ms = lease_ms
        self.queues = list(queues)
        self.unsettled: dict[str, Delivery] = {}
        self.draining = False
        self.closed = False
        self.broken: StreamEnded | None = None
        self.stream_extends: list[str] = []  # ids of the tasks extended on this stream
        self.resized: list[int] = []  # the prefetches set after the stream opened
        self.on_cancel_callback: Callable[[str, str], None] | None = None
        self.cancels: list[tuple[str, str]] = []  # told while no callback was set

    def on_cancel(self, callback: Callable[[str, str], None] | None) -> None:
        """As GrpcStream.on_cancel: cancels of the tasks this stream holds go to ``callback``."""
        self.on_cancel_callback = callback
        if callback is not None:
            pending, self.cancels = self.cancels, []
            for task_id, lease_id in pending:
                callback(task_id, lease_id)

    def take_cancels(self) -> list[tuple[str, str]]:
        taken, self.cancels = self.cancels, []
        return taken

    def tell_cancel(self, task_id: str, lease_id: str) -> None:
        """The broker tells this stream a task it holds was cancelled (a turn of the loop
        later, as a message would come)."""
        callback = self.on_cancel_callback
        if callback is None:
            self.cancels.append((task_id, lease_id))
        else:
            asyncio.get_running_loop().call_soon(callback, task_id, lease_id)

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Delivery:
        await self.broker.until(self._can_go_on)
        if self.broken is not None:
            raise self.broken
        if self.closed:
            raise StopAsyncIteration
        delivery = self.broker.hand_out(self.lease_ms, self.queues)
        self.unsettled[delivery.task.id] = delivery
        return delivery

    def _can_go_on(self) -> bool:
        if self.closed or self.broken is not None:
            return True
        has_room = len(self.unsettled) < self.prefetch and not self.draining
        return has_room and self.broker.next_ready(self.queues) is not None

    async def ack(self, delivery: Delivery, *, confirm: bool = False, result: Any = None) -> None:
        # (Every settlement here is applied before the call returns: confirmed or not.)
        self._check_open()
        if result is not None and not isinstance(result, bytes):
            result = json.dumps(result).encode()
        try:
            if result is None:
                await self.broker.ack(delivery.task.id, delivery.lease_id)
            else:
                await self.broker.ack(delivery.task.id, delivery.lease_id, result=result)
        finally:
            self._settled(delivery)

    async def flush(self) -> list[tuple[Delivery, WqError]]:
        return []

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
        try:
            await self.broker.nack(
                delivery.task.id, delivery.lease_id, error, delay_ms=delay_ms, terminal=terminal
            )
        finally:
            self._settled(delivery)

    async def extend(
        self, delivery: Delivery, lease_ms: int | None, *, progress: bytes | None = None
    ) -> datetime:
        self._check_open()
        self.stream_extends.append(delivery.task.id)
        return await self.broker.extend(
            delivery.task.id, delivery.lease_id, lease_ms, progress=progress
        )

    def set_prefetch(self, prefetch: int) -> None:
        self._check_open()
        self.prefetch = prefetch
        self.resized.append(prefetch)
        self.broker.notify()

    async def drain(self) -> int:
        self.draining = True
        self.broker.notify()
        return len(self.unsettled)

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

    def __init__(self, clock: FakeClock | None = None) -> None:
        super().__init__(clock)
        self.streams: list[FakeStream] = []

    async def stream(
        self, prefetch: int, lease_ms: int | None, queues: Sequence[str] | None = None
    ) -> FakeStream:
        self._call("stream")
        wanted = self.queue_list(queues)
        self.claim_queues.append(wanted)
        stream = FakeStream(self, prefetch, lease_ms, wanted)
        self.streams.append(stream)
        return stream

    def told_cancel(self, task_id: str, lease_id: str) -> None:
        """The stream that holds a task cancelled (if any) is told at once."""
        for stream in self.streams:
            if task_id in stream.unsettled and not stream.closed and stream.broken is None:
                stream.tell_cancel(task_id, lease_id)

    def take_away(self, task_id: str) -> None:
        """As FakeTransport.take_away; a stream that had the task is finished with it (the
        broker frees its prefetch slot, as for a lease reclaimed when it ran out)."""
        for stream in self.streams:
            stream.unsettled.pop(task_id, None)
        super().take_away(task_id)

    def break_streams(self, why: str = "the connection broke") -> None:
        """Break every open stream (see FakeStream.break_)."""
        for stream in self.streams:
            if not stream.closed and stream.broken is None:
                stream.break_(why)
