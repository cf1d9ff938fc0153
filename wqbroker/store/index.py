"""The in-memory index of tasks: the bookkeeping a store that keeps its state in this process uses.

The memory store *is* an index; the SQLite store keeps one over its file (and reads payloads and
errors back from the file). Neither inherits from it: each contains an :class:`Index` and
implements the store contract itself. A store with no memory of its own (PostgreSQL) needs none.

Queues and priorities: every named queue is a :class:`Queue` holding up to ten :class:`Lane`\\ s,
one per priority, each a deque of its ready tasks, oldest first. A bit mask says which lanes hold
anything, so a claim finds the highest non-empty lane of a queue in O(1) (``mask.bit_length()``),
and a claim on a list of queues looks at each listed queue once: the cost of a claim does not grow
with the number of queues, priorities or tasks. A paused queue is skipped by claims.

Every other operation is O(1) or O(log n):

- live tasks (ready in memory, delayed, handed out) are in a dict by id, so any task can be looked
  up; dead tasks are in an insertion-ordered dict (the order of burial), and in one per queue;
- delayed tasks are in a heap keyed by the time they become ready;
- leases are in a heap keyed by deadline, with lazy deletion: an ack (or an extension) leaves its
  heap entry behind, and the entry is recognised as stale (its lease id or deadline is no longer
  the task's) when it reaches the top. When stale entries outnumber live ones the heap is rebuilt,
  so it stays O(live leases) in size.

A sweep pops only what is due. Nothing here suspends: each call is one atomic step.

Cold ready tasks: a store that can read tasks back (SQLite) may keep only the *ids* of ready tasks
beyond the first ``hot_max`` (and of every ready task found at a restart), in a second deque of
their lane behind the first. Before claiming, such a store asks which lane the claim would take
from (:meth:`cold_lane`) and moves the head of its cold deque back into records (:meth:`warm`).
Order is kept: a lane's ready tasks are its hot deque, then its cold one; a task becoming ready goes
to the cold tail while its lane has any cold task.

Ids are unique by construction: the n-th id an index issues is a fixed bijection of ``n`` (mixed
with a key of the store's), so ids look random but never repeat, and no lookup is needed to check.
Records hold them as integers (smaller than their text); :func:`hex_id` and :func:`parse_id`
convert.

Order: every task carries ``seq``, where it stands. Tasks appended to ready, pushed on a heap or
buried take the next number of one increasing sequence (ties between equal due times break by it,
and burial order is its order); a task put back at the head of ready takes the next number of a
decreasing one. A durable store persists ``seq`` so that a restart rebuilds the same order; without
a journal, only heap entries are numbered (the deques and dicts keep the rest in order).

Idempotency keys: (queue, key) -> (task id, until when), with a heap of expiries pruned as time
passes. A key is remembered for its window even after its task was acked.

Changes are reported to a :class:`Journal` as they happen (a durable store writes them down); the
memory store has none.
"""

from __future__ import annotations

import heapq
import itertools
import random
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final, Protocol

from wqbroker.errors import LeaseLost, NotFound, WqError, quoted
from wqbroker.models import (
    DEFAULT_QUEUE,
    Enqueued,
    Failure,
    NackItem,
    NewTask,
    QueueReport,
    QueueStats,
    Stats,
    SweepResult,
    Task,
    Totals,
)

READY: Final = 0
HANDED_OUT: Final = 1
DELAYED: Final = 2
DEAD: Final = 3
STATE_NAMES: Final = ("ready", "handed_out", "delayed", "dead")

PRIORITIES: Final = 10
# Rebuild the lease heap once it holds this many stale entries and they outnumber live ones.
_COMPACT_MIN: Final = 4096
_MASK: Final = 2**64 - 1
_HEX_ID: Final = re.compile("[0-9a-f]{16}").fullmatch


def _mix(x: int) -> int:
    """A bijection of 64-bit integers that scatters its input (SplitMix64's finalizer)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def hex_id(n: int) -> str:
    """A task id as clients see it: 16 lowercase hex digits."""
    # (printf-style: twice as fast as an f-string with a format spec, and it runs per task)
    return "%016x" % n  # noqa: UP031


def parse_id(task_id: str) -> int | None:
    """A task id as records hold it; None if it is not one this broker could have issued."""
    if _HEX_ID(task_id) is None:
        return None
    return int(task_id, 16)


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
        "lane",
    )

    def __init__(
        self,
        task_id: int,
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
        lane: Lane | None = None,
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
        self.lane: Lane = lane if lane is not None else _NOWHERE

    @property
    def queue(self) -> Queue:
        return self.lane.queue

    @property
    def priority(self) -> int:
        return self.lane.priority

    @property
    def task_id(self) -> str:
        return "%016x" % self.id  # noqa: UP031

    def view(self) -> Task:
        return Task(
            "%016x" % self.id,  # noqa: UP031
            self.payload,
            self.attempts,
            self.max_attempts,
            self.created_at,
            self.available_at,
            self.last_error,
            self.lane.queue.name,
            self.lane.priority,
        )


class Lane:
    """One priority of one queue: its ready tasks, oldest first (records, then cold ids). A
    record points at its lane, which gives its queue and priority (one slot, not two)."""

    __slots__ = ("queue", "priority", "hot", "cold")

    def __init__(self, queue: Queue, priority: int) -> None:
        self.queue = queue
        self.priority = priority
        self.hot: deque[Record] = deque()
        self.cold: deque[int] | None = None  # ids of ready tasks behind ``hot``, not in memory

    def __len__(self) -> int:
        return len(self.hot) + (len(self.cold) if self.cold else 0)


class Queue:
    """A named queue: its lanes, its gauges, its dead tasks, its totals, whether it is paused."""

    __slots__ = ("name", "lanes", "mask", "paused", "delayed", "held", "dead", "totals")

    def __init__(self, name: str) -> None:
        self.name = name
        self.lanes: list[Lane | None] = [None] * PRIORITIES
        self.mask = 0  # bit p: lane p holds a ready task
        self.paused = False
        self.delayed = 0
        self.held = 0
        self.dead: dict[int, Record] = {}  # in the order of burial
        self.totals = Totals()

    def lane(self, priority: int) -> Lane:
        lane = self.lanes[priority]
        if lane is None:
            lane = self.lanes[priority] = Lane(self, priority)
        return lane

    def stats(self) -> Stats:
        return Stats(self.ready, self.held, self.delayed, len(self.dead), self.totals.copy())

    @property
    def ready(self) -> int:
        """Its ready tasks (counted when asked: claims and enqueues do not keep a count)."""
        return sum(len(lane) for lane in self.lanes if lane is not None)

    def row(self) -> QueueStats:
        return QueueStats(
            self.name, self.ready, self.held, self.delayed, len(self.dead), self.paused
        )


# Only a record's default lane, before it is placed.
_NOWHERE: Final = Lane(Queue(DEFAULT_QUEUE), 0)


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
        """The task is gone for good (acked or purged)."""
        ...

    def queue_changed(self, queue: Queue) -> None:
        """The queue was created or paused or resumed."""
        ...

    def keyed(self, queue: str, key: str, task_id: int, until: float) -> None:
        """An idempotency key was recorded."""
        ...

    def unkeyed(self, queue: str, key: str) -> None:
        """An idempotency key expired."""
        ...


class Index:
    """Tasks in four collections (ready, handed out, delayed, dead), by queue, and the totals."""

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
        self._queues: dict[str, Queue] = {}
        self._live: dict[int, Record] = {}  # ready (hot), delayed and handed-out tasks
        self._dead: dict[int, Record] = {}  # in the order of burial
        self._ready = 0  # ready tasks, hot and cold
        self._hot = 0  # ready tasks held as records
        self._held = 0
        self._delayed: list[tuple[float, int, Record]] = []
        self._leases: list[tuple[float, int, str, Record]] = []
        self._stale_leases = 0
        self._keys: dict[tuple[str, str], tuple[int, float]] = {}
        self._key_expiry: list[tuple[float, str, str]] = []
        self._seq = 0  # the last number given from the increasing sequence
        self._head = 0  # the last number given from the decreasing one
        self.totals = Totals()

    # -- reading -----------------------------------------------------------------------------

    @property
    def ready_count(self) -> int:
        return self._ready

    @property
    def held_count(self) -> int:
        """Tasks ready, delayed or handed out."""
        return self._ready + len(self._delayed) + self._held

    @property
    def hot_count(self) -> int:
        """Ready tasks held as records."""
        return self._hot

    def stats(self, queue: str | None = None) -> Stats:
        if queue is not None:
            q = self._queues.get(queue)
            return q.stats() if q is not None else Stats()
        return Stats(
            ready=self._ready,
            handed_out=self._held,
            delayed=len(self._delayed),
            dead=len(self._dead),
            totals=self.totals.copy(),
        )

    @property
    def queue_count(self) -> int:
        return len(self._queues)

    def has_queue(self, name: str) -> bool:
        return name in self._queues

    def queue_rows(self) -> list[QueueStats]:
        """Every queue known, by name."""
        return [self._queues[name].row() for name in sorted(self._queues)]

    def queue_report(self) -> tuple[list[QueueReport], list[tuple[QueueReport, int]]]:
        """Every queue known, by name, with its totals and when the oldest ready task at the
        head of its lanes became ready (ten lanes a queue at most; no task is visited). A lane
        whose head is cold has no time here: the second list pairs each such head's id with its
        queue's report, for a store to read the time back and lower ``oldest_ready`` to it."""
        reports: list[QueueReport] = []
        cold: list[tuple[QueueReport, int]] = []
        for name in sorted(self._queues):
            q = self._queues[name]
            report = QueueReport(q.row(), q.totals.copy())
            for lane in q.lanes if q.mask else ():
                if lane is None:
                    continue
                if lane.hot:
                    at = lane.hot[0].available_at
                    if report.oldest_ready is None or at < report.oldest_ready:
                        report.oldest_ready = at
                elif lane.cold:
                    cold.append((report, lane.cold[0]))
            reports.append(report)
        return reports, cold

    def queues(self) -> Iterator[Queue]:
        return iter(self._queues.values())

    def dead(self, limit: int | None = None, queue: str | None = None) -> list[Record]:
        """Dead tasks in the order they were buried (the first ``limit``), of one queue or all."""
        if queue is None:
            source = self._dead
        else:
            q = self._queues.get(queue)
            source = q.dead if q is not None else {}
        return list(itertools.islice(source.values(), limit))

    def find(self, task_id: str) -> Record | None:
        """The task's record, if it is in memory (a cold ready task is not: see is_cold)."""
        n = parse_id(task_id)
        if n is None:
            return None
        record = self._live.get(n)
        return record if record is not None else self._dead.get(n)

    def held(self, task_id: str, lease_id: str) -> Record:
        """The task, handed out under ``lease_id``; else NotFound / LeaseLost."""
        n = parse_id(task_id)
        record = self._live.get(n) if n is not None else None
        if record is None or record.state != HANDED_OUT:
            raise NotFound(f"task {quoted(task_id)} is not held by anyone")
        if record.lease_id != lease_id:
            raise LeaseLost(f"task {quoted(task_id)} is held under a different lease")
        return record

    def key_owner(self, queue: str, key: str, now: float) -> str | None:
        """The id of the task enqueued with this key within its window, if any."""
        found = self._keys.get((queue, key))
        if found is None or found[1] <= now:
            return None
        return hex_id(found[0])

    def next_due(self) -> float | None:
        """When the next delayed task or lease is due, if any."""
        due = self._delayed[0][0] if self._delayed else None
        leases = self._leases
        while leases and not _live_lease(leases[0]):
            heapq.heappop(leases)
            self._stale_leases -= 1
        if leases and (due is None or leases[0][0] < due):
            due = leases[0][0]
        return due

    def cold_lane(self, queues: Sequence[str], now: float) -> Lane | None:
        """The lane the next claim on ``queues`` takes from, if its next task is cold (a store
        must warm it first); None if that task is hot or nothing is ready."""
        if self._delayed and self._delayed[0][0] <= now:
            self._promote(now)
        q = self._pick(queues)
        if q is None:
            return None
        lane = q.lanes[q.mask.bit_length() - 1]
        assert lane is not None
        return lane if not lane.hot and lane.cold else None

    # -- changes -----------------------------------------------------------------------------

    def queue(self, name: str) -> Queue:
        """The queue of this name, created if new."""
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = Queue(name)
            if self._journal is not None:
                self._journal.queue_changed(q)
        return q

    def enqueue(self, new: NewTask, now: float) -> Record:
        q = self._queues.get(new.queue) or self.queue(new.queue)
        self._issued += 1
        record = Record(
            _mix((self._issued + self._id_key) & _MASK),
            new.payload,
            new.max_attempts,
            now,
            now + new.delay if new.delay > 0 else now,
            lane=q.lanes[new.priority] or q.lane(new.priority),
        )
        if new.delay > 0:
            self._delay(record)
        else:
            self._append(record)
        self.totals.enqueued += 1
        q.totals.enqueued += 1
        if self._journal is not None:
            self._journal.created(record)
        if new.key is not None:
            self._remember(new.queue, new.key, record.id, new.key_until)
        return record

    def enqueue_many(self, items: Sequence[NewTask], now: float) -> list[Enqueued]:
        """Enqueue tasks in order; one whose idempotency key is in its window is answered as a
        duplicate of the first task's id, and creates nothing."""
        out: list[Enqueued] = []
        for new in items:
            if new.key is not None:
                owner = self.key_owner(new.queue, new.key, now)
                if owner is not None:
                    out.append(Enqueued(owner, True, None))
                    continue
            record = self.enqueue(new, now)
            task_id = "%016x" % record.id  # noqa: UP031
            task = Task(
                task_id,
                new.payload,
                0,
                new.max_attempts,
                now,
                record.available_at,
                None,
                new.queue,
                new.priority,
            )
            out.append(Enqueued(task_id, False, task))
        return out

    def claim(self, queues: Sequence[str], lease: float, now: float) -> Record | None:
        """Hand out the next ready task of the first of ``queues`` (by name) that has one:
        its highest priority, oldest first (promoting due delayed tasks first). None if nothing
        is ready, or if that task is cold (a store with cold tasks warms them first)."""
        if self._delayed and self._delayed[0][0] <= now:
            self._promote(now)
        known = self._queues
        for name in queues:  # (_pick, inlined: this runs for every task)
            q = known.get(name)
            if q is not None and q.mask and not q.paused:
                break
        else:
            return None
        priority = q.mask.bit_length() - 1
        lane = q.lanes[priority]
        assert lane is not None
        if not lane.hot:
            return None
        record = lane.hot.popleft()
        if not lane.hot and not lane.cold:
            q.mask &= ~(1 << priority)
        q.held += 1
        self._ready -= 1
        self._hot -= 1
        self._held += 1
        record.state = HANDED_OUT
        record.attempts += 1
        lease_id = "%016x" % self._rng.getrandbits(64)  # noqa: UP031
        record.lease_id = lease_id
        record.deadline = deadline = now + lease
        self._seq = seq = self._seq + 1
        record.seq = seq
        heapq.heappush(self._leases, (deadline, seq, lease_id, record))
        self.totals.delivered += 1
        q.totals.delivered += 1
        if self._journal is not None:
            self._journal.moved(record)
        return record

    def warm(self, lane: Lane, records: Sequence[Record]) -> None:
        """The records of the first ``len(records)`` cold tasks of ``lane`` (as read back, in
        that order): they become hot. Nothing changes for a journal."""
        cold = lane.cold
        for record in records:
            if not cold or cold[0] != record.id:
                raise ValueError(f"task {record.task_id} is not the lane's next cold task")
            cold.popleft()
            record.state = READY
            lane.hot.append(record)
            self._live[record.id] = record
            self._hot += 1

    def ack(self, task_id: str, lease_id: str) -> None:
        record = self.held(task_id, lease_id)
        self._drop_lease(record)
        del self._live[record.id]
        self.totals.acked += 1
        record.lane.queue.totals.acked += 1
        if self._journal is not None:
            self._journal.deleted(record)

    def nack(
        self,
        task_id: str,
        lease_id: str,
        error: str | None,
        now: float,
        *,
        delay: float | None = None,
        terminal: bool = False,
    ) -> Failure:
        record = self.held(task_id, lease_id)
        self.totals.nacked += 1
        record.lane.queue.totals.nacked += 1
        return self._fail(record, error, now, delay=delay, terminal=terminal)

    def reclaim(self, task_id: str, lease_id: str, error: str, now: float) -> Failure:
        record = self.held(task_id, lease_id)
        self.totals.reclaimed += 1
        record.lane.queue.totals.reclaimed += 1
        return self._fail(record, error, now)

    def extend(self, task_id: str, lease_id: str, lease: float, now: float) -> float:
        """A new deadline, ``now + lease``, for a task held under ``lease_id``."""
        record = self.held(task_id, lease_id)
        record.deadline = deadline = now + lease
        record.seq = seq = self._next_seq()
        self._stale_leases += 1  # the entry for the old deadline
        heapq.heappush(self._leases, (deadline, seq, lease_id, record))
        self._moved(record)
        return deadline

    def settle(
        self, acks: Sequence[tuple[str, str]], nacks: Sequence[NackItem], now: float
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
        for n in nacks:
            try:
                failure = self.nack(
                    n.task_id, n.lease_id, n.error, now, delay=n.delay, terminal=n.terminal
                )
                nacked.append(failure)
            except WqError as e:
                nacked.append(e)
        return acked, nacked

    def release(self, task_id: str, lease_id: str) -> bool:
        """Undo a hand-out nobody saw: back to the head of its lane. False if not current."""
        n = parse_id(task_id)
        record = self._live.get(n) if n is not None else None
        if record is None or record.state != HANDED_OUT or record.lease_id != lease_id:
            return False
        self._drop_lease(record)
        record.state = READY
        record.attempts -= 1
        self.totals.delivered -= 1
        lane = record.lane
        q = lane.queue
        q.totals.delivered -= 1
        if self._journal is not None:
            self._head -= 1
            record.seq = self._head
        lane.hot.appendleft(record)
        q.mask |= 1 << lane.priority
        self._ready += 1
        self._hot += 1
        self._moved(record)
        return True

    def sweep(self, now: float) -> SweepResult:
        """Reclaim every lease due by ``now``, then promote every delayed task due by then."""
        result = SweepResult()
        leases = self._leases
        while leases and leases[0][0] <= now:
            entry = heapq.heappop(leases)
            if not _live_lease(entry):
                self._stale_leases -= 1
                continue
            record = entry[3]
            self.totals.reclaimed += 1
            record.lane.queue.totals.reclaimed += 1
            result.reclaimed.append((record.task_id, entry[2]))
            self._fail(record, "lease expired", now, lease_in_heap=False)
        result.promoted = self._promote(now, result.ready_queues)
        self._forget_keys(now)
        return result

    def requeue(self, task_id: str, now: float) -> str:
        """Requeue a dead task; returns its queue's name (the task may have gone cold)."""
        n = parse_id(task_id)
        record = self._dead.get(n) if n is not None else None
        if record is None:
            raise NotFound(f"task {quoted(task_id)} is not in the dead-letter queue")
        self._revive(record, now)
        return record.lane.queue.name

    def requeue_all(self, queue: str | None, now: float) -> tuple[int, list[str]]:
        """Requeue every dead task (of one queue): how many, and the queues that got them."""
        records = self.dead(None, queue)
        for record in records:
            self._revive(record, now)
        return len(records), list(dict.fromkeys(r.lane.queue.name for r in records))

    def purge(self, task_id: str) -> None:
        """Drop a dead task for good."""
        n = parse_id(task_id)
        record = self._dead.pop(n, None) if n is not None else None
        if record is None:
            raise NotFound(f"task {quoted(task_id)} is not in the dead-letter queue")
        del record.lane.queue.dead[record.id]
        self.totals.purged += 1
        record.lane.queue.totals.purged += 1
        if self._journal is not None:
            self._journal.deleted(record)

    def set_paused(self, name: str, paused: bool) -> bool:
        """Pause or resume a queue (created if new). True if that changed anything."""
        q = self.queue(name)
        if q.paused == paused:
            return False
        q.paused = paused
        if self._journal is not None:
            self._journal.queue_changed(q)
        return True

    # -- restoring (a durable store rebuilding its index at start) ---------------------------

    def restore_queue(self, name: str, paused: bool, totals: Totals) -> None:
        q = self._restored_queue(name)
        q.paused = paused
        q.totals = totals

    def restore_ready(self, rows: Iterable[tuple[int, str, int]]) -> None:
        """The ready tasks as (id, queue, priority), in order: they come back cold."""
        for task_id, name, priority in rows:
            q = self._restored_queue(name)
            lane = q.lane(priority)
            if lane.cold is None:
                lane.cold = deque()
            lane.cold.append(task_id)
            q.mask |= 1 << priority
            self._ready += 1

    def restore(self, records: Iterable[tuple[Record, str, int]]) -> None:
        """Put back handed-out, delayed and dead records (with their queue's name and their
        priority) read from
        storage, in any order (the dead-letter queue is put in the order of ``seq``). Call
        :meth:`restored` at the end."""
        dead: list[Record] = []
        for record, name, priority in records:
            q = self._restored_queue(name)
            record.lane = q.lane(priority)
            self._seq = max(self._seq, record.seq)
            if record.state == DEAD:
                dead.append(record)
            elif record.state == DELAYED:
                self._delayed.append((record.available_at, record.seq, record))
                self._live[record.id] = record
                q.delayed += 1
            elif record.state == HANDED_OUT and record.lease_id is not None:
                self._leases.append((record.deadline, record.seq, record.lease_id, record))
                self._live[record.id] = record
                self._held += 1
                q.held += 1
            else:
                raise ValueError(f"task {record.task_id} has an unknown state {record.state}")
        dead.sort(key=lambda r: r.seq)
        for record in dead:
            self._dead[record.id] = record
            record.lane.queue.dead[record.id] = record

    def _restored_queue(self, name: str) -> Queue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = Queue(name)
        return q

    def restore_key(self, queue: str, key: str, task_id: int, until: float) -> None:
        self._keys[(queue, key)] = (task_id, until)
        self._key_expiry.append((until, queue, key))

    def restored(self, totals: Totals, *, first_seq: int, last_seq: int, id_key: int) -> None:
        """Everything is back: ``totals`` as stored; the lowest and highest ``seq`` stored (new
        numbers go on from there); the store's id key. Ids go on from the number issued (every
        enqueue issued one), so they never repeat one issued before."""
        heapq.heapify(self._delayed)
        heapq.heapify(self._leases)
        heapq.heapify(self._key_expiry)
        self.totals = totals
        self._id_key = id_key
        self._issued = totals.enqueued
        self._seq = max(self._seq, last_seq)
        self._head = min(self._head, first_seq)

    # -- helpers -----------------------------------------------------------------------------

    def _pick(self, queues: Sequence[str]) -> Queue | None:
        """The first of ``queues`` that has a ready task and is not paused."""
        known = self._queues
        for name in queues:
            q = known.get(name)
            if q is not None and q.mask and not q.paused:
                return q
        return None

    def _new_id(self) -> int:
        self._issued += 1
        return _mix((self._issued + self._id_key) & _MASK)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _moved(self, record: Record) -> None:
        if self._journal is not None:
            self._journal.moved(record)

    def _append(self, record: Record) -> None:
        """Put a task at the tail of its lane (cold if the lane has cold tasks or hot ones are
        at their limit)."""
        record.state = READY
        if self._journal is not None:  # (only a journal needs ready tasks numbered)
            record.seq = self._next_seq()
        lane = record.lane
        lane.queue.mask |= 1 << lane.priority
        self._ready += 1
        if lane.cold or (self._hot_max is not None and self._hot >= self._hot_max):
            if lane.cold is None:
                lane.cold = deque()
            lane.cold.append(record.id)  # the store reads it back when its turn comes
            self._live.pop(record.id, None)
        else:
            lane.hot.append(record)
            self._live[record.id] = record
            self._hot += 1

    def _delay(self, record: Record) -> None:
        record.state = DELAYED
        record.seq = seq = self._next_seq()
        heapq.heappush(self._delayed, (record.available_at, seq, record))
        self._live[record.id] = record
        record.lane.queue.delayed += 1

    def _drop_lease(self, record: Record, *, in_heap: bool = True) -> None:
        """The task's lease ends. Its heap entry (unless already popped) is now stale."""
        record.lease_id = None
        record.lane.queue.held -= 1
        self._held -= 1
        if not in_heap:
            return
        self._stale_leases += 1
        leases = self._leases
        if self._stale_leases >= _COMPACT_MIN and self._stale_leases * 2 > len(leases):
            # Rebuilt in place: a sweep in progress holds a reference to this list.
            leases[:] = [e for e in leases if _live_lease(e)]
            heapq.heapify(leases)
            self._stale_leases = 0

    def _fail(
        self,
        record: Record,
        error: str | None,
        now: float,
        *,
        delay: float | None = None,
        terminal: bool = False,
        lease_in_heap: bool = True,
    ) -> Failure:
        """A handed-out task's delivery failed: delay it for a retry or bury it."""
        self._drop_lease(record, in_heap=lease_in_heap)
        record.last_error = error
        q = record.queue
        if not terminal and record.attempts < record.max_attempts:
            wait = self._backoff(record.attempts) if delay is None else delay
            record.available_at = now + wait
            self._delay(record)
            self.totals.retried += 1
            q.totals.retried += 1
            failure = Failure(record.task_id, False, record.available_at)
        else:
            self._bury(record)
            self.totals.buried += 1
            q.totals.buried += 1
            failure = Failure(record.task_id, True, None)
        if self._journal is not None:
            self._journal.errored(record)
        return failure

    def _bury(self, record: Record) -> None:
        record.state = DEAD
        if self._journal is not None:
            record.seq = self._next_seq()
        del self._live[record.id]
        self._dead[record.id] = record
        record.lane.queue.dead[record.id] = record

    def _revive(self, record: Record, now: float) -> None:
        """A dead task back to the tail of ready, for a fresh set of attempts."""
        del self._dead[record.id]
        del record.lane.queue.dead[record.id]
        record.attempts = 0
        record.last_error = None
        record.available_at = now
        self._append(record)
        self.totals.requeued += 1
        record.lane.queue.totals.requeued += 1
        if self._journal is not None:
            self._journal.errored(record)

    def _promote(self, now: float, queues: set[str] | None = None) -> int:
        delayed = self._delayed
        promoted = 0
        while delayed and delayed[0][0] <= now:
            record = heapq.heappop(delayed)[2]
            record.lane.queue.delayed -= 1
            self._append(record)
            self._moved(record)
            if queues is not None:
                queues.add(record.lane.queue.name)
            promoted += 1
        return promoted

    def _remember(self, queue: str, key: str, task_id: int, until: float) -> None:
        self._keys[(queue, key)] = (task_id, until)
        heapq.heappush(self._key_expiry, (until, queue, key))
        if self._journal is not None:
            self._journal.keyed(queue, key, task_id, until)

    def _forget_keys(self, now: float) -> None:
        """Drop the idempotency keys whose window is over."""
        expiry = self._key_expiry
        keys = self._keys
        while expiry and expiry[0][0] <= now:
            until, queue, key = heapq.heappop(expiry)
            found = keys.get((queue, key))
            if found is not None and found[1] == until:
                del keys[(queue, key)]
                if self._journal is not None:
                    self._journal.unkeyed(queue, key)

    def next_key_expiry(self) -> float | None:
        return self._key_expiry[0][0] if self._key_expiry else None

    # -- for tests ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the structures agree with each other (used by the tests)."""
        hot: list[Record] = []
        cold: list[int] = []
        for q in self._queues.values():
            ready = 0
            for p, lane in enumerate(q.lanes):
                n = len(lane) if lane is not None else 0
                assert bool(q.mask & (1 << p)) == (n > 0), f"queue {q.name}: mask out of step"
                if lane is not None:
                    hot.extend(lane.hot)
                    cold.extend(lane.cold or ())
                    assert all(r.queue is q and r.priority == p for r in lane.hot)
                    if self._journal is not None:
                        seqs = [r.seq for r in lane.hot]
                        assert seqs == sorted(seqs), "a lane is out of order"
                ready += n
            assert ready == q.ready, f"queue {q.name}: ready count out of step"
            assert all(r.queue is q and r.state == DEAD for r in q.dead.values())
        held = [r for r in self._live.values() if r.state == HANDED_OUT]
        delayed_ids = [e[2].id for e in self._delayed]
        everything = [r.id for r in hot] + cold + delayed_ids + [r.id for r in held]
        everything += list(self._dead)
        assert len(set(everything)) == len(everything), "a task is in two places"
        assert len(hot) == self._hot
        assert len(hot) + len(cold) == self._ready
        assert len(held) == self._held
        assert all(r.state == READY for r in hot)
        assert all(e[2].state == DELAYED for e in self._delayed)
        assert len(self._live) == len(hot) + len(delayed_ids) + len(held), "live dict off"
        assert sum(len(q.dead) for q in self._queues.values()) == len(self._dead)
        assert sum(q.held for q in self._queues.values()) == self._held
        assert sum(q.delayed for q in self._queues.values()) == len(self._delayed)
        if self._hot_max is None:
            assert not cold, "cold tasks in an index that never goes cold"
        if self._journal is not None:
            burials = [r.seq for r in self._dead.values()]
            assert burials == sorted(burials), "the dead-letter queue is out of order"
        live = [(e[2], e[0]) for e in self._leases if _live_lease(e)]
        assert sorted(live) == sorted((r.lease_id, r.deadline) for r in held), "lease heap off"
        assert len(self._leases) - len(live) == self._stale_leases
        t = self.totals
        assert t.nacked + t.reclaimed == t.retried + t.buried
        assert len(everything) == t.enqueued - t.acked - t.purged, "tasks and totals disagree"
        for field in t.__slots__:
            total = sum(getattr(q.totals, field) for q in self._queues.values())
            assert total == getattr(t, field), f"queue totals of {field} do not add up"


def _live_lease(entry: tuple[float, int, str, Record]) -> bool:
    """A lease heap entry that still stands (the task holds that lease, and this is its latest
    entry: claims and extensions give the task a new ``seq``)."""
    record = entry[3]
    return record.lease_id == entry[2] and record.seq == entry[1]
