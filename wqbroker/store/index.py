"""The in-memory index of tasks: the bookkeeping a store that keeps its state in this process uses.

The memory store *is* an index; the SQLite store keeps one over its file (and reads payloads and
errors back from the file). Neither inherits from it: each contains an :class:`Index` and
implements the store contract itself. A store with no memory of its own (PostgreSQL) needs none.

Every operation is O(1) or O(log n):

- ready tasks in a deque, oldest first; handed-out tasks in a dict by id (the only tasks looked up
  by id, with the dead ones); dead tasks in an insertion-ordered dict (the order of burial);
- delayed tasks in a heap keyed by the time they become ready;
- leases in a heap keyed by deadline, with lazy deletion: an ack leaves its heap entry behind, and
  the entry is recognised as stale (its lease id is no longer the task's) when it reaches the top.
  When stale entries outnumber live ones the heap is rebuilt, so it stays O(live leases) in size.

A sweep pops only what is due. Nothing here suspends: each call is one atomic step.

Cold ready tasks: a store that can read tasks back (SQLite) may keep only the *ids* of ready tasks
beyond the first ``hot_max`` (and of every ready task found at a restart), in a second deque behind
the first: about 75 bytes a task instead of a record. Before claiming, such a store moves the head
of that deque back into records (:meth:`cold_ids`, then :meth:`warm`). Order is kept: ready tasks
are the hot deque, then the cold one; a task becoming ready goes to the cold tail while any task is
cold.

Ids are unique by construction: the n-th id an index issues is a fixed bijection of ``n`` (mixed
with a key of the store's), so ids look random but never repeat, and no lookup is needed to check.

Order: every task carries ``seq``, where it stands. Tasks appended to ready, pushed on a heap or
buried take the next number of one increasing sequence (ties between equal due times break by it,
and burial order is its order); a task put back at the head of ready takes the next number of a
decreasing one. A durable store persists ``seq`` so that a restart rebuilds the same order; without
a journal, only heap entries are numbered (the deques and dicts keep the rest in order), which
saves an integer per ready task.

Changes are reported to a :class:`Journal` as they happen (a durable store writes them down); the
memory store has none.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Protocol

from wqbroker.errors import LeaseLost, NotFound, WqError, quoted
from wqbroker.models import Failure, Stats, SweepResult, Task, Totals

READY: Final = 0
HANDED_OUT: Final = 1
DELAYED: Final = 2
DEAD: Final = 3

# Rebuild the lease heap once it holds this many stale entries and they outnumber live ones.
_COMPACT_MIN: Final = 4096
_MASK: Final = 2**64 - 1


def _mix(x: int) -> int:
    """A bijection of 64-bit integers that scatters its input (SplitMix64's finalizer)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


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
        *,
        hot_max: int | None = None,
        id_key: int | None = None,
    ) -> None:
        self._backoff = backoff  # attempts so far -> seconds until the retry
        self._rng = rng
        self._journal = journal
        self._hot_max = hot_max  # ready records kept before ready tasks go cold (None: never)
        self._id_key = rng.getrandbits(64) if id_key is None else id_key
        self._issued = 0  # ids issued so far
        self._ready: deque[Record] = deque()
        self._cold: deque[str] = deque()  # ids of ready tasks behind ``_ready``, not in memory
        self._held: dict[str, Record] = {}
        self._delayed: list[tuple[float, int, Record]] = []
        self._leases: list[tuple[float, int, str, Record]] = []
        self._stale_leases = 0
        self._dead: dict[str, Record] = {}
        self._seq = 0  # the last number given from the increasing sequence
        self._head = 0  # the last number given from the decreasing one
        self.totals = Totals()

    # -- reading -----------------------------------------------------------------------------

    @property
    def ready_count(self) -> int:
        return len(self._ready) + len(self._cold)

    @property
    def held_count(self) -> int:
        """Tasks ready, delayed or handed out."""
        return len(self._ready) + len(self._cold) + len(self._delayed) + len(self._held)

    @property
    def hot_count(self) -> int:
        """Ready tasks that can be claimed without warming any."""
        return len(self._ready)

    def stats(self) -> Stats:
        return Stats(
            ready=len(self._ready) + len(self._cold),
            handed_out=len(self._held),
            delayed=len(self._delayed),
            dead=len(self._dead),
            totals=self.totals.copy(),
        )

    def dead(self, limit: int | None = None) -> list[Record]:
        """Dead tasks in the order they were buried (the first ``limit``)."""
        return list(itertools.islice(self._dead.values(), limit))

    def held(self, task_id: str, lease_id: str) -> Record:
        """The task, handed out under ``lease_id``; else NotFound / LeaseLost."""
        record = self._held.get(task_id)
        if record is None:
            raise NotFound(f"task {quoted(task_id)} is not held by anyone")
        if record.lease_id != lease_id:
            raise LeaseLost(f"task {quoted(task_id)} is held under a different lease")
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

    def cold_ids(self, n: int) -> list[str]:
        """The ids of the first ``n`` cold ready tasks, in order."""
        return list(itertools.islice(self._cold, n))

    # -- changes -----------------------------------------------------------------------------

    def enqueue(self, payload: bytes, max_attempts: int, delay: float, now: float) -> Record:
        record = Record(
            self._new_id(), payload, max_attempts, now, now + delay if delay > 0 else now
        )
        if delay > 0:
            self._delay(record)
        else:
            self._append(record)
        self.totals.enqueued += 1
        if self._journal is not None:
            self._journal.created(record)
        return record

    def claim(self, lease: float, now: float) -> Record | None:
        """Hand out the oldest hot ready task (promoting due delayed tasks first). None if no
        ready task is hot (a store with cold ones warms them first)."""
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
        self._held[record.id] = record
        self.totals.delivered += 1
        self._moved(record)
        return record

    def warm(self, records: Sequence[Record]) -> None:
        """The records of the first ``len(records)`` cold tasks (as read back, in that order):
        they become hot. Nothing changes for a journal."""
        cold = self._cold
        for record in records:
            if not cold or cold[0] != record.id:
                raise ValueError(f"task {record.id} is not the next cold ready task")
            cold.popleft()
            record.state = READY
            self._ready.append(record)

    def ack(self, task_id: str, lease_id: str) -> None:
        record = self.held(task_id, lease_id)
        self._drop_lease(record)
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
        record = self._held.get(task_id)
        if record is None or record.lease_id != lease_id:
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
            raise NotFound(f"task {quoted(task_id)} is not in the dead-letter queue")
        record.attempts = 0
        record.last_error = None
        record.available_at = now
        self._append(record)
        self.totals.requeued += 1
        if self._journal is not None:
            self._journal.errored(record)

    # -- restoring (a durable store rebuilding its index at start) ---------------------------

    def restore_ready(self, ids: Iterable[str]) -> None:
        """The ids of the ready tasks, in order: they come back cold."""
        self._cold.extend(ids)

    def restore(self, records: Iterable[Record]) -> None:
        """Put back handed-out, delayed and dead records read from storage, in any order (the
        dead-letter queue is put in the order of ``seq``). Call :meth:`restored` at the end."""
        dead: list[Record] = []
        for record in records:
            self._seq = max(self._seq, record.seq)
            if record.state == DEAD:
                dead.append(record)
            elif record.state == DELAYED:
                self._delayed.append((record.available_at, record.seq, record))
            elif record.state == HANDED_OUT and record.lease_id is not None:
                self._leases.append((record.deadline, record.seq, record.lease_id, record))
                self._held[record.id] = record
            else:
                raise ValueError(f"task {record.id} has an unknown state {record.state}")
        dead.sort(key=lambda r: r.seq)
        self._dead.update((r.id, r) for r in dead)

    def restored(self, totals: Totals, *, first_seq: int, last_seq: int, id_key: int) -> None:
        """Everything is back: ``totals`` as stored; the lowest and highest ``seq`` stored (new
        numbers go on from there); the store's id key. Ids go on from the number issued (every
        enqueue issued one), so they never repeat one issued before."""
        heapq.heapify(self._delayed)
        heapq.heapify(self._leases)
        self.totals = totals
        self._id_key = id_key
        self._issued = totals.enqueued
        self._seq = max(self._seq, last_seq)
        self._head = min(self._head, first_seq)

    # -- helpers -----------------------------------------------------------------------------

    def _new_id(self) -> str:
        self._issued += 1
        return f"{_mix((self._issued + self._id_key) & _MASK):016x}"

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
        if self._cold or (self._hot_max is not None and len(self._ready) >= self._hot_max):
            self._cold.append(record.id)  # the store reads it back when its turn comes
        else:
            self._ready.append(record)

    def _delay(self, record: Record) -> None:
        record.state = DELAYED
        record.seq = seq = self._next_seq()
        heapq.heappush(self._delayed, (record.available_at, seq, record))

    def _drop_lease(self, record: Record, *, in_heap: bool = True) -> None:
        """The task's lease ends. Its heap entry (unless already popped) is now stale."""
        record.lease_id = None
        del self._held[record.id]
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
        ready_ids = [r.id for r in self._ready] + list(self._cold)
        delayed_ids = [e[2].id for e in self._delayed]
        everything = ready_ids + delayed_ids + list(self._held) + list(self._dead)
        assert len(set(everything)) == len(everything), "a task is in two places"
        assert all(r.state == READY for r in self._ready)
        assert all(e[2].state == DELAYED for e in self._delayed)
        assert all(r.state == HANDED_OUT and r.lease_id for r in self._held.values())
        assert all(r.state == DEAD for r in self._dead.values())
        if self._hot_max is None:
            assert not self._cold, "cold tasks in an index that never goes cold"
        if self._journal is not None:
            seqs = [r.seq for r in self._ready]
            assert seqs == sorted(seqs), "ready is out of order"
            burials = [r.seq for r in self._dead.values()]
            assert burials == sorted(burials), "the dead-letter queue is out of order"
        live = {e[2] for e in self._leases if e[3].lease_id == e[2]}
        assert live == {r.lease_id for r in self._held.values()}, "lease heap out of step"
        assert len(self._leases) - len(live) == self._stale_leases
        t = self.totals
        assert t.nacked + t.reclaimed == t.retried + t.buried
        live_tasks = len(ready_ids) + len(delayed_ids) + len(self._held) + len(self._dead)
        assert live_tasks == t.enqueued - t.acked, "tasks and totals disagree"
