"""The in-memory store: the default backend, fast, and lost on restart.

Every operation is O(1) or O(log n):

- all live tasks in one dict by id; ready is a deque (oldest first);
- delayed tasks in a heap keyed by the time they become ready;
- leases in a heap keyed by deadline, with lazy deletion: an ack leaves its heap entry behind, and
  the entry is recognised as stale (its lease id is no longer the task's) when it reaches the top.
  When stale entries outnumber live ones the heap is rebuilt, so it stays O(live leases) in size;
- dead tasks in an insertion-ordered dict (the order of burial).

A sweep pops only what is due. Records are slotted and keep the payload as the received bytes.
None of the coroutines here ever suspends, so each operation is atomic on the event loop.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from typing import Final

from wqbroker.errors import LeaseLost, NotFound, WqError
from wqbroker.models import Delivery, Failure, Stats, SweepResult, Task, Totals
from wqbroker.retry import Backoff

READY: Final = 0
HANDED_OUT: Final = 1
DELAYED: Final = 2
DEAD: Final = 3

# Rebuild the lease heap once it holds this many stale entries and they outnumber live ones.
_COMPACT_MIN: Final = 4096


class _Task:
    __slots__ = (
        "id",
        "payload",
        "attempts",
        "max_attempts",
        "created_at",
        "available_at",
        "last_error",
        "lease_id",
        "deadline",
        "state",
    )

    def __init__(
        self, task_id: str, payload: bytes, max_attempts: int, now: float, available_at: float
    ) -> None:
        self.id = task_id
        self.payload = payload
        self.attempts = 0
        self.max_attempts = max_attempts
        self.created_at = now
        self.available_at = available_at
        self.last_error: str | None = None
        self.lease_id: str | None = None
        self.deadline = 0.0
        self.state = READY

    def view(self) -> Task:
        return Task(
            self.id,
            self.payload,
            self.attempts,
            self.max_attempts,
            self.created_at,
            self.available_at,
            self.last_error,
        )


class MemoryStore:
    never_suspends = True

    def __init__(self, backoff: Backoff | None = None, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()
        self._backoff = backoff if backoff is not None else Backoff(rng=self._rng)
        self._tasks: dict[str, _Task] = {}
        self._ready: deque[_Task] = deque()
        self._delayed: list[tuple[float, int, _Task]] = []
        self._leases: list[tuple[float, int, str, _Task]] = []
        self._stale_leases = 0
        self._handed_out = 0
        self._dead: dict[str, _Task] = {}
        self._seq = 0
        self._totals = Totals()

    # -- hooks for a durable subclass ----------------------------------------------------------

    def _created(self, task: _Task) -> None:
        """``task`` is new. The memory store keeps nothing else up to date."""

    def _touch(self, task: _Task) -> None:
        """``task`` changed."""

    def _forget(self, task: _Task) -> None:
        """``task`` is gone for good (acked)."""

    # -- helpers -----------------------------------------------------------------------------

    def _new_id(self) -> str:
        while True:
            task_id = f"{self._rng.getrandbits(64):016x}"
            if task_id not in self._tasks and task_id not in self._dead:
                return task_id

    def _held(self, task_id: str, lease_id: str) -> _Task:
        task = self._tasks.get(task_id)
        if task is None or task.state != HANDED_OUT:
            raise NotFound(f"task {task_id} is not held by anyone")
        if task.lease_id != lease_id:
            raise LeaseLost(f"task {task_id} is held under a different lease")
        return task

    def _drop_lease(self, task: _Task, *, in_heap: bool = True) -> None:
        """The task's lease ends. Its heap entry (unless already popped) is now stale."""
        task.lease_id = None
        self._handed_out -= 1
        if not in_heap:
            return
        self._stale_leases += 1
        leases = self._leases
        if self._stale_leases >= _COMPACT_MIN and self._stale_leases * 2 > len(leases):
            # Rebuilt in place: a sweep in progress holds a reference to this list.
            leases[:] = [e for e in leases if e[3].lease_id == e[2]]
            heapq.heapify(leases)
            self._stale_leases = 0

    def _fail(
        self, task: _Task, error: str | None, now: float, *, lease_in_heap: bool = True
    ) -> Failure:
        """A handed-out task's delivery failed: delay it for a retry or bury it."""
        self._drop_lease(task, in_heap=lease_in_heap)
        task.last_error = error
        if task.attempts < task.max_attempts:
            task.state = DELAYED
            task.available_at = now + self._backoff.delay(task.attempts)
            self._seq += 1
            heapq.heappush(self._delayed, (task.available_at, self._seq, task))
            self._totals.retried += 1
            self._touch(task)
            return Failure(task.id, False, task.available_at)
        task.state = DEAD
        del self._tasks[task.id]
        self._dead[task.id] = task
        self._totals.buried += 1
        self._touch(task)
        return Failure(task.id, True, None)

    def _promote(self, now: float) -> int:
        delayed = self._delayed
        promoted = 0
        while delayed and delayed[0][0] <= now:
            task = heapq.heappop(delayed)[2]
            task.state = READY
            self._ready.append(task)
            self._touch(task)
            promoted += 1
        return promoted

    def _next_due(self) -> float | None:
        due = self._delayed[0][0] if self._delayed else None
        leases = self._leases
        while leases and leases[0][3].lease_id != leases[0][2]:
            heapq.heappop(leases)
            self._stale_leases -= 1
        if leases and (due is None or leases[0][0] < due):
            due = leases[0][0]
        return due

    # -- the contract ------------------------------------------------------------------------

    async def enqueue(self, payload: bytes, *, max_attempts: int, delay: float, now: float) -> Task:
        task = _Task(self._new_id(), payload, max_attempts, now, now + delay if delay > 0 else now)
        self._tasks[task.id] = task
        if delay > 0:
            task.state = DELAYED
            self._seq += 1
            heapq.heappush(self._delayed, (task.available_at, self._seq, task))
        else:
            self._ready.append(task)
        self._totals.enqueued += 1
        self._created(task)
        return task.view()

    async def enqueue_many(
        self, items: Sequence[tuple[bytes, int, float]], *, now: float
    ) -> list[Task]:
        return [
            await self.enqueue(payload, max_attempts=attempts, delay=delay, now=now)
            for payload, attempts, delay in items
        ]

    def _claim(self, lease: float, now: float) -> Delivery | None:
        if self._delayed and self._delayed[0][0] <= now:
            self._promote(now)
        if not self._ready:
            return None
        task = self._ready.popleft()
        task.state = HANDED_OUT
        task.attempts += 1
        lease_id = f"{self._rng.getrandbits(64):016x}"
        task.lease_id = lease_id
        task.deadline = deadline = now + lease
        self._seq += 1
        heapq.heappush(self._leases, (deadline, self._seq, lease_id, task))
        self._handed_out += 1
        self._totals.delivered += 1
        self._touch(task)
        return Delivery(task.view(), lease_id, deadline)

    async def claim(self, *, lease: float, now: float) -> Delivery | None:
        return self._claim(lease, now)

    async def claim_many(self, leases: Sequence[float], *, now: float) -> list[Delivery]:
        out = []
        for lease in leases:
            delivery = self._claim(lease, now)
            if delivery is None:
                break
            out.append(delivery)
        return out

    async def ack(self, task_id: str, lease_id: str, *, now: float) -> None:
        task = self._held(task_id, lease_id)
        self._drop_lease(task)
        del self._tasks[task_id]
        self._totals.acked += 1
        self._forget(task)

    async def settle_many(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[tuple[str, str, str | None]],
        *,
        now: float,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        # MemoryStore's own ack and nack: a durable subclass commits once, after all of them.
        acked: list[WqError | None] = []
        for task_id, lease_id in acks:
            try:
                await MemoryStore.ack(self, task_id, lease_id, now=now)
                acked.append(None)
            except WqError as e:
                acked.append(e)
        nacked: list[Failure | WqError] = []
        for task_id, lease_id, error in nacks:
            try:
                nacked.append(await MemoryStore.nack(self, task_id, lease_id, error, now=now))
            except WqError as e:
                nacked.append(e)
        return acked, nacked

    async def nack(self, task_id: str, lease_id: str, error: str | None, *, now: float) -> Failure:
        task = self._held(task_id, lease_id)
        self._totals.nacked += 1
        return self._fail(task, error, now)

    async def reclaim(self, task_id: str, lease_id: str, error: str, *, now: float) -> Failure:
        task = self._held(task_id, lease_id)
        self._totals.reclaimed += 1
        return self._fail(task, error, now)

    async def release(self, task_id: str, lease_id: str) -> bool:
        task = self._tasks.get(task_id)
        if task is None or task.state != HANDED_OUT or task.lease_id != lease_id:
            return False
        self._drop_lease(task)
        task.state = READY
        task.attempts -= 1
        self._totals.delivered -= 1
        self._ready.appendleft(task)
        self._touch(task)
        return True

    async def sweep(self, *, now: float) -> tuple[SweepResult, float | None]:
        result = SweepResult()
        leases = self._leases
        while leases and leases[0][0] <= now:
            _, _, lease_id, task = heapq.heappop(leases)
            if task.lease_id != lease_id:
                self._stale_leases -= 1
                continue
            self._totals.reclaimed += 1
            self._fail(task, "lease expired", now, lease_in_heap=False)
            result.reclaimed.append((task.id, lease_id))
        result.promoted = self._promote(now)
        return result, self._next_due()

    def problem(self) -> str | None:
        return None

    def ready_hint(self) -> int | None:
        return len(self._ready)

    async def stats(self) -> Stats:
        return Stats(
            ready=len(self._ready),
            handed_out=self._handed_out,
            delayed=len(self._delayed),
            dead=len(self._dead),
            totals=self._totals.copy(),
        )

    async def dead_letters(self, *, limit: int | None = None) -> list[Task]:
        views: list[Task] = []
        for task in self._dead.values():
            if limit is not None and len(views) >= limit:
                break
            views.append(task.view())
        return views

    async def requeue(self, task_id: str, *, now: float) -> None:
        task = self._dead.pop(task_id, None)
        if task is None:
            raise NotFound(f"task {task_id} is not in the dead-letter queue")
        task.state = READY
        task.attempts = 0
        task.last_error = None
        task.available_at = now
        self._tasks[task_id] = task
        self._ready.append(task)
        self._totals.requeued += 1
        self._touch(task)

    async def close(self) -> None:
        return None

    # -- for tests ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the internal structures agree with each other (used by the tests)."""
        ready_ids = [t.id for t in self._ready]
        delayed_ids = [e[2].id for e in self._delayed]
        handed = [t for t in self._tasks.values() if t.state == HANDED_OUT]
        assert len(set(ready_ids)) == len(ready_ids), "a task is twice in ready"
        assert len(set(delayed_ids)) == len(delayed_ids), "a task is twice in delayed"
        assert all(self._tasks[i].state == READY for i in ready_ids)
        assert all(self._tasks[i].state == DELAYED for i in delayed_ids)
        assert len(ready_ids) + len(delayed_ids) + len(handed) == len(self._tasks)
        assert self._handed_out == len(handed)
        assert all(t.state == DEAD and t.id not in self._tasks for t in self._dead.values())
        live = {e[2] for e in self._leases if e[3].lease_id == e[2]}
        assert live == {t.lease_id for t in handed}, "lease heap out of step with handed-out tasks"
        assert len(self._leases) - len(live) == self._stale_leases
        t = self._totals
        assert t.nacked + t.reclaimed == t.retried + t.buried
