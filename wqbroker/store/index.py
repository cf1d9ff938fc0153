"""The in-memory index of tasks: the bookkeeping a store that keeps its state in this process uses.

The memory store *is* an index; the SQLite store keeps one over its file (and reads payloads and
errors back from the file). Neither inherits from it: each contains an :class:`Index` and
implements the store contract itself. A store with no memory of its own (PostgreSQL) needs none.

Every operation is O(1) or O(log n):

- every live task in one dict by id; ready is a deque (oldest first);
- delayed tasks in a heap keyed by the time they become ready;
- leases in a heap keyed by deadline, with lazy deletion: an ack leaves its heap entry behind, and
  the entry is recognised as stale (its lease id is no longer the task's) when it reaches the top.
  When stale entries outnumber live ones the heap is rebuilt, so it stays O(live leases) in size;
- dead tasks in an insertion-ordered dict (the order of burial).

A sweep pops only what is due. Nothing here suspends: each call is one atomic step.

Order: every task carries ``seq``, where it stands. Tasks appended to ready, pushed on a heap or
buried take the next number of one increasing sequence (ties between equal due times break by it,
and burial order is its order); a task put back at the head of ready takes the next number of a
decreasing one. A durable store persists ``seq`` so that a restart rebuilds the same order; without
a journal, only heap entries are numbered (the deque and the dict keep the rest in order), which
saves an integer per ready task.

Changes are reported to a :class:`Journal` as they happen (a durable store writes them down); the
memory store has none.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import Final, Protocol

from wqbroker.errors import LeaseLost, NotFound, WqError
from wqbroker.models import Failure, Stats, SweepResult, Task, Totals

READY: Final = 0
HANDED_OUT: Final = 1
DELAYED: Final = 2
DEAD: Final = 3

_by_seq: Final = attrgetter("seq")

# Rebuild the lease heap once it holds this many stale entries and they outnumber live ones.
_COMPACT_MIN: Final = 4096


class Record:
    """One task. ``payload``, ``created_at`` and ``last_error`` are for views: a store that reads
    views back from a file may drop them (the index itself never reads them)."""

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
        "seq",
    )

    def __init__(
        self,
        task_id: str,
        payload: bytes,
        max_attempts: int,
        created_at: float,
        available_at: float,
        attempts: int = 0,
        state: int = READY,
        seq: int = 0,
        last_error: str | None = None,
        lease_id: str | None = None,
        deadline: float = 0.0,
    ) -> None:
        self.id = task_id
        self.payload = payload
        self.attempts = attempts
        self.max_attempts = max_attempts
        self.created_at = created_at
        self.available_at = available_at
        self.last_error = last_error
        self.lease_id = lease_id
        self.deadline = deadline
        self.state = state
        self.seq = seq

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


class Journal(Protocol):
    """Told of every change, right after it is made (on the event loop, in order)."""

    def created(self, record: Record) -> None:
        """A new task (its payload and creation time are on the record)."""
        ...

    def moved(self, record: Record) -> None:
        """The task's state, attempts, times, lease or place in line changed."""
        ...

    def errored(self, record: Record) -> None:
        """As ``moved``, and its ``last_error`` changed too."""
        ...

    def deleted(self, record: Record) -> None:
        """The task is gone for good (acked)."""
        ...


class Index:
    """Tasks in four collections (ready, handed out, delayed, dead) and the lifetime totals."""

    def __init__(
        self,
        backoff: Callable[[int], float],
        rng: random.Random,
        journal: Journal | None = None,
    ) -> None:
        self._backoff = backoff  # attempts so far -> seconds until the retry
        self._rng = rng
        self._journal = journal
        self._tasks: dict[str, Record] = {}
        self._ready: deque[Record] = deque()
        self._delayed: list[tuple[float, int, Record]] = []
        self._leases: list[tuple[float, int, str, Record]] = []
        self._stale_leases = 0
        self._handed_out = 0
        self._dead: dict[str, Record] = {}
        self._seq = 0  # the last number given from the increasing sequence
        self._head = 0  # the last number given from the decreasing one
        self.totals = Totals()

    # -- reading -----------------------------------------------------------------------------

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    def stats(self) -> Stats:
        return Stats(
            ready=len(self._ready),
            handed_out=self._handed_out,
            delayed=len(self._delayed),
            dead=len(self._dead),
            totals=self.totals.copy(),
        )

    def dead(self, limit: int | None = None) -> list[Record]:
        """Dead tasks in the order they were buried (the first ``limit``)."""
        out: list[Record] = []
        for record in self._dead.values():
            if limit is not None and len(out) >= limit:
                break
            out.append(record)
        return out

    def held(self, task_id: str, lease_id: str) -> Record:
        """The task, handed out under ``lease_id``; else NotFound / LeaseLost."""
        record = self._tasks.get(task_id)
        if record is None or record.state != HANDED_OUT:
            raise NotFound(f"task {task_id} is not held by anyone")
        if record.lease_id != lease_id:
            raise LeaseLost(f"task {task_id} is held under a different lease")
        return record

    def next_due(self) -> float | None:
        """When the next delayed task or lease is due, if any."""
        due = self._delayed[0][0] if self._delayed else None
        leases = self._leases
        while leases and leases[0][3].lease_id != leases[0][2]:
            heapq.heappop(leases)
            self._stale_leases -= 1
        if leases and (due is None or leases[0][0] < due):
            due = leases[0][0]
        return due

    # -- changes -----------------------------------------------------------------------------

    def enqueue(self, payload: bytes, max_attempts: int, delay: float, now: float) -> Record:
        record = Record(
            self._new_id(), payload, max_attempts, now, now + delay if delay > 0 else now
        )
        self._tasks[record.id] = record
        if delay > 0:
            self._delay(record)
        else:
            self._append(record)
        self.totals.enqueued += 1
        if self._journal is not None:
            self._journal.created(record)
        return record

    def claim(self, lease: float, now: float) -> Record | None:
        """Hand out the oldest ready task (promoting due delayed tasks first)."""
        if self._delayed and self._delayed[0][0] <= now:
            self._promote(now)
        if not self._ready:
            return None
        record = self._ready.popleft()
        record.state = HANDED_OUT
        record.attempts += 1
        lease_id = f"{self._rng.getrandbits(64):016x}"
        record.lease_id = lease_id
        record.deadline = deadline = now + lease
        record.seq = seq = self._next_seq()
        heapq.heappush(self._leases, (deadline, seq, lease_id, record))
        self._handed_out += 1
        self.totals.delivered += 1
        self._moved(record)
        return record

    def ack(self, task_id: str, lease_id: str) -> None:
        record = self.held(task_id, lease_id)
        self._drop_lease(record)
        del self._tasks[task_id]
        self.totals.acked += 1
        if self._journal is not None:
            self._journal.deleted(record)

    def nack(self, task_id: str, lease_id: str, error: str | None, now: float) -> Failure:
        record = self.held(task_id, lease_id)
        self.totals.nacked += 1
        return self._fail(record, error, now)

    def reclaim(self, task_id: str, lease_id: str, error: str, now: float) -> Failure:
        record = self.held(task_id, lease_id)
        self.totals.reclaimed += 1
        return self._fail(record, error, now)

    def settle(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[tuple[str, str, str | None]],
        now: float,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        """Acks, then nacks: for each, None / its Failure, or the error it raised."""
        acked: list[WqError | None] = []
        for task_id, lease_id in acks:
            try:
                self.ack(task_id, lease_id)
                acked.append(None)
            except WqError as e:
                acked.append(e)
        nacked: list[Failure | WqError] = []
        for task_id, lease_id, error in nacks:
            try:
                nacked.append(self.nack(task_id, lease_id, error, now))
            except WqError as e:
                nacked.append(e)
        return acked, nacked

    def release(self, task_id: str, lease_id: str) -> bool:
        """Undo a hand-out nobody saw: back to the head of ready. False if not current."""
        record = self._tasks.get(task_id)
        if record is None or record.state != HANDED_OUT or record.lease_id != lease_id:
            return False
        self._drop_lease(record)
        record.state = READY
        record.attempts -= 1
        self.totals.delivered -= 1
        if self._journal is not None:
            self._head -= 1
            record.seq = self._head
        self._ready.appendleft(record)
        self._moved(record)
        return True

    def sweep(self, now: float) -> SweepResult:
        """Reclaim every lease due by ``now``, then promote every delayed task due by then."""
        result = SweepResult()
        leases = self._leases
        while leases and leases[0][0] <= now:
            _, _, lease_id, record = heapq.heappop(leases)
            if record.lease_id != lease_id:
                self._stale_leases -= 1
                continue
            self.totals.reclaimed += 1
            self._fail(record, "lease expired", now, lease_in_heap=False)
            result.reclaimed.append((record.id, lease_id))
        result.promoted = self._promote(now)
        return result

    def requeue(self, task_id: str, now: float) -> None:
        record = self._dead.pop(task_id, None)
        if record is None:
            raise NotFound(f"task {task_id} is not in the dead-letter queue")
        record.attempts = 0
        record.last_error = None
        record.available_at = now
        self._tasks[task_id] = record
        self._append(record)
        self.totals.requeued += 1
        if self._journal is not None:
            self._journal.errored(record)

    # -- restoring (a durable store rebuilding its index at start) ---------------------------

    def restore(self, state: int, records: Iterable[Record]) -> None:
        """Put back the records of one state read from storage, in any order (ready and dead
        ones are put in the order of their ``seq``). Call :meth:`restored` once all are in."""
        tasks = self._tasks
        if state == READY or state == DEAD:
            ordered = sorted(records, key=_by_seq)
            if state == READY:
                self._ready.extend(ordered)
                tasks.update((r.id, r) for r in ordered)
                if ordered:
                    self._head = min(self._head, ordered[0].seq)
            else:
                self._dead.update((r.id, r) for r in ordered)
            if ordered:
                self._seq = max(self._seq, ordered[-1].seq)
            return
        for record in records:
            tasks[record.id] = record
            self._seq = max(self._seq, record.seq)
            if state == DELAYED:
                self._delayed.append((record.available_at, record.seq, record))
            elif record.lease_id is not None:  # handed out
                self._leases.append((record.deadline, record.seq, record.lease_id, record))
                self._handed_out += 1
            else:
                raise ValueError(f"task {record.id} (state {state}) has no lease")

    def restored(self, totals: Totals) -> None:
        heapq.heapify(self._delayed)
        heapq.heapify(self._leases)
        self.totals = totals

    # -- helpers -----------------------------------------------------------------------------

    def _new_id(self) -> str:
        while True:
            task_id = f"{self._rng.getrandbits(64):016x}"
            if task_id not in self._tasks and task_id not in self._dead:
                return task_id

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _moved(self, record: Record) -> None:
        if self._journal is not None:
            self._journal.moved(record)

    def _append(self, record: Record) -> None:
        record.state = READY
        if self._journal is not None:  # (only a journal needs ready tasks numbered: 32 B each)
            record.seq = self._next_seq()
        self._ready.append(record)

    def _delay(self, record: Record) -> None:
        record.state = DELAYED
        record.seq = seq = self._next_seq()
        heapq.heappush(self._delayed, (record.available_at, seq, record))

    def _drop_lease(self, record: Record, *, in_heap: bool = True) -> None:
        """The task's lease ends. Its heap entry (unless already popped) is now stale."""
        record.lease_id = None
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
        self, record: Record, error: str | None, now: float, *, lease_in_heap: bool = True
    ) -> Failure:
        """A handed-out task's delivery failed: delay it for a retry or bury it."""
        self._drop_lease(record, in_heap=lease_in_heap)
        record.last_error = error
        if record.attempts < record.max_attempts:
            record.available_at = now + self._backoff(record.attempts)
            self._delay(record)
            self.totals.retried += 1
            failure = Failure(record.id, False, record.available_at)
        else:
            record.state = DEAD
            if self._journal is not None:
                record.seq = self._next_seq()
            del self._tasks[record.id]
            self._dead[record.id] = record
            self.totals.buried += 1
            failure = Failure(record.id, True, None)
        if self._journal is not None:
            self._journal.errored(record)
        return failure

    def _promote(self, now: float) -> int:
        delayed = self._delayed
        promoted = 0
        while delayed and delayed[0][0] <= now:
            record = heapq.heappop(delayed)[2]
            self._append(record)
            self._moved(record)
            promoted += 1
        return promoted

    # -- for tests ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the structures agree with each other (used by the tests)."""
        ready_ids = [r.id for r in self._ready]
        delayed_ids = [e[2].id for e in self._delayed]
        handed = [r for r in self._tasks.values() if r.state == HANDED_OUT]
        assert len(set(ready_ids)) == len(ready_ids), "a task is twice in ready"
        assert len(set(delayed_ids)) == len(delayed_ids), "a task is twice in delayed"
        assert all(self._tasks[i].state == READY for i in ready_ids)
        assert all(self._tasks[i].state == DELAYED for i in delayed_ids)
        if self._journal is not None:
            seqs = [r.seq for r in self._ready]
            assert seqs == sorted(seqs), "ready is out of order"
        assert len(ready_ids) + len(delayed_ids) + len(handed) == len(self._tasks)
        assert self._handed_out == len(handed)
        assert all(r.state == DEAD and r.id not in self._tasks for r in self._dead.values())
        if self._journal is not None:
            burials = [r.seq for r in self._dead.values()]
            assert burials == sorted(burials), "the dead-letter queue is out of order"
        live = {e[2] for e in self._leases if e[3].lease_id == e[2]}
        assert live == {r.lease_id for r in handed}, "lease heap out of step with handed-out tasks"
        assert len(self._leases) - len(live) == self._stale_leases
        t = self.totals
        assert t.nacked + t.reclaimed == t.retried + t.buried
