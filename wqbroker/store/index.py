"""The in-memory index of tasks: the bookkeeping a store that keeps its state in this process uses.

The memory store *is* an index; the SQLite store keeps one over its file (and reads payloads and
errors back from the file). Neither inherits from it: each contains an :class:`Index` and
implements the store contract itself. A store with no memory of its own (PostgreSQL) needs none.

Queues and priorities: every named queue is a :class:`Queue` holding up to ten :class:`Lane`\\ s,
one per priority, each a deque of its ready tasks, oldest first. A bit mask says which lanes hold
anything, so a claim finds the highest non-empty lane of a queue in O(1) (``mask.bit_length()``),
and a claim on a list of queues looks at each listed queue once: the cost of a claim does not grow
with the number of queues, priorities or tasks. A paused queue is skipped by claims, and so is a
queue whose limits (docs/design/schedules.md: a :class:`Limiter`, its rate bucket and its
concurrency) allow no hand-out now.

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

Results and workflows (docs/design/results.md): a task that uses any of it carries a
:class:`Flow` (its parents, how many it still waits for, its children and how many of them pin
its result, its result); a task that uses none carries None, and the hot paths only look at that.
Waiting and succeeded tasks are in dicts by id and in a log per queue (the order enqueued, the
order finished: listings seek in them by ``seq``). Results are pruned from a heap of (due, id),
lazily; one whose time comes while children pin it is parked, and the last of them to go pushes
it back (pruned at once when the time is known to be up). A parent's ack releases its children
and a parent's end buries (or, a waiting one cancelled, cancels) its waiting children in the
same call, so in the same commit of a durable store. The flow of a cold ready task is kept apart
until it is warmed. What a call released (:meth:`Index.take_released`) and which watched tasks
ended (:meth:`Index.take_ended`) are taken by the store after it.

Changes are reported to a :class:`Journal` as they happen (a durable store writes them down); the
memory store has none.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Final, Protocol

from sortedcontainers import SortedKeyList

from wqbroker.errors import (
    Cancelled,
    Conflict,
    LeaseLost,
    NotFound,
    TimeLimitReached,
    UnknownParent,
    WqError,
    quoted,
)
from wqbroker.limits import error_value
from wqbroker.models import (
    ACKED,
    CANCELLED,
    CANCELLED_STATE,
    CANCELLING,
    DEFAULT_QUEUE,
    EXPIRED_STATE,
    PURGED,
    CancelResult,
    Enqueued,
    Failure,
    Limits,
    ListKey,
    NackItem,
    NewTask,
    ParentResult,
    QueueReport,
    QueueStats,
    Released,
    Stats,
    SweepResult,
    Task,
    Totals,
)

READY: Final = 0
HANDED_OUT: Final = 1
DELAYED: Final = 2
DEAD: Final = 3
GONE: Final = 4  # cancelled or expired: in no collection (a hole where it stood, until passed)
WAITING: Final = 5  # waiting for parents (docs/design/results.md)
SUCCEEDED: Final = 6  # acked with a result, kept
#: The states of a task not yet ended (docs/design/results.md: a watched one is told of its end).
PENDING: Final = frozenset({READY, HANDED_OUT, DELAYED, WAITING})
#: A state's name, by its number (GONE has one only to keep the numbers in place).
STATE_NAMES: Final = ("ready", "handed_out", "delayed", "dead", "gone", "waiting", "succeeded")
_STATE_OF: Final = {name: n for n, name in enumerate(STATE_NAMES) if n != GONE}
#: What a result's time to live is when nothing says (NewTask's default).
DEFAULT_RESULT_TTL: Final = 3600.0

PRIORITIES: Final = 10
# Rebuild the lease heap once it holds this many stale entries and they outnumber live ones.
_COMPACT_MIN: Final = 4096
# Cut a line's passed head (or its holes) once there are this many and they are half of it.
_COMPACT_LINE: Final = 1024
_MASK: Final = 2**64 - 1
# Added to a seq (which is negative for a task put back at the head) in a cold line's entries.
_SEQ_OFFSET: Final = 2**62
_HEX_ID: Final = re.compile("[0-9a-f]{16}").fullmatch


# The states a watched task ends in, as on_finished names them (docs/design/results.md).
SUCCEEDED_NAME: Final = "succeeded"
DEAD_NAME: Final = "dead"
# (a dict.pop default that no value is)
_ABSENT: Final = object()


def _cut(error: str) -> str:
    """An error made here (a parent's failure), cut to the usual size."""
    cut = error_value(error)
    assert cut is not None
    return cut


def _is_dead_with(error: str | None) -> str:
    """How a child's error names a dead parent's: ``is dead: <its error>``."""
    return f"is dead: {error}" if error else "is dead"


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


class Control:
    """The part of a task that control over it sets (docs/design/control.md), and the schedule
    that enqueued it (docs/design/schedules.md), made only for a task that uses some of it: most
    tasks never do, and their records carry None instead."""

    __slots__ = (
        "expires_at",
        "timeout",
        "handed_at",
        "progress",
        "cancelling",
        "ukey",
        "schedule",
        "scheduled_for",
    )

    def __init__(self) -> None:
        self.expires_at: float | None = None  # never handed out at or after it
        self.timeout: float | None = None  # seconds one attempt may run
        self.handed_at = 0.0  # when it was handed out last (with a timeout)
        self.progress: bytes | None = None  # JSON text its holder reported (while handed out)
        self.cancelling = False  # handed out, and cancelled: it will not be retried
        self.ukey: str | None = None  # the unique key it holds while active
        # docs/design/schedules.md: the schedule that enqueued it, and that fire's time.
        self.schedule: str | None = None
        self.scheduled_for: float | None = None


class Flow:
    """The part of a task that results and workflows set (docs/design/results.md), made only for
    a task that has parents or children, a result, or a result TTL given: most tasks never do,
    and their records carry None instead.

    ``children`` holds the task's children that still exist (any state, succeeded ones too), in
    the order they were enqueued; ``pins`` counts those of them not yet succeeded: while it is
    above 0 the task's result is kept whatever its TTL. ``parked``: the task's time to be pruned
    came while it was pinned (its heap entry is spent: the last child to go pushes a new one).
    A store that keeps results in a file (SQLite) drops ``result`` once it is written there."""

    __slots__ = (
        "after",
        "waiting_for",
        "delay",
        "children",
        "pins",
        "result",
        "finished_at",
        "ttl_given",
        "parked",
    )

    def __init__(self) -> None:
        self.after: tuple[int, ...] = ()  # its parents' ids, in the order given
        self.waiting_for = 0  # parents not yet succeeded, while waiting
        self.delay = 0.0  # seconds from its release to its first run (a waiting task's delay)
        self.children: dict[int, None] = {}
        self.pins = 0
        self.result: bytes | None = None  # JSON text, once succeeded (memory)
        self.finished_at = 0.0  # when it succeeded
        self.ttl_given = False  # the TTL was given at enqueue (shown in its view)
        self.parked = False


class Record:
    """One task. ``payload``, ``created_at`` and ``last_error`` are for views: a store that reads
    views back from a file may drop them (the index itself never reads them). What control over
    tasks sets is in ``ctl`` (None until something of it is set, and from then on, so a durable
    store writes it all: a value cleared is cleared in storage too); the properties below read
    and set it."""

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
        "ctl",
        "ttl",
        "flow",
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
        expires_at: float | None = None,
        timeout: float | None = None,
        handed_at: float = 0.0,
        progress: bytes | None = None,
        cancelling: bool = False,
        ttl: float = DEFAULT_RESULT_TTL,
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
        self.ctl: Control | None = None
        self.ttl = ttl  # seconds a result is kept after an ack with one
        self.flow: Flow | None = None  # docs/design/results.md
        if expires_at is not None or timeout is not None or progress is not None or cancelling:
            ctl = self.ctl = Control()
            ctl.expires_at, ctl.timeout, ctl.handed_at = expires_at, timeout, handed_at
            ctl.progress, ctl.cancelling = progress, cancelling

    def control(self) -> Control:
        """Its control part, made if it has none yet."""
        ctl = self.ctl
        if ctl is None:
            ctl = self.ctl = Control()
        return ctl

    @property
    def controlled(self) -> bool:
        return self.ctl is not None

    @property
    def expires_at(self) -> float | None:
        return None if self.ctl is None else self.ctl.expires_at

    @expires_at.setter
    def expires_at(self, value: float | None) -> None:
        if value is not None or self.ctl is not None:
            self.control().expires_at = value

    @property
    def timeout(self) -> float | None:
        return None if self.ctl is None else self.ctl.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        if value is not None or self.ctl is not None:
            self.control().timeout = value

    @property
    def handed_at(self) -> float:
        return 0.0 if self.ctl is None else self.ctl.handed_at

    @handed_at.setter
    def handed_at(self, value: float) -> None:
        self.control().handed_at = value

    @property
    def progress(self) -> bytes | None:
        return None if self.ctl is None else self.ctl.progress

    @progress.setter
    def progress(self, value: bytes | None) -> None:
        if value is not None or self.ctl is not None:
            self.control().progress = value

    @property
    def cancelling(self) -> bool:
        return self.ctl is not None and self.ctl.cancelling

    @cancelling.setter
    def cancelling(self, value: bool) -> None:
        if value or self.ctl is not None:
            self.control().cancelling = value

    @property
    def ukey(self) -> str | None:
        return None if self.ctl is None else self.ctl.ukey

    @ukey.setter
    def ukey(self, value: str | None) -> None:
        if value is not None or self.ctl is not None:
            self.control().ukey = value

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
        task = Task(
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
        ctl = self.ctl
        if ctl is not None:
            task.expires_at = ctl.expires_at
            task.timeout = ctl.timeout
            task.progress = ctl.progress  # (set only while handed out)
            task.cancelling = ctl.cancelling
            task.schedule, task.scheduled_for = ctl.schedule, ctl.scheduled_for
        if self.state == DEAD and self.deadline:  # (0.0: not known, buried by an older broker)
            task.buried_at = self.deadline
        flow = self.flow
        if flow is not None:
            flow_view(task, self, flow)
        return task


def flow_view(task: Task, record: Record, flow: Flow) -> None:
    """What results and workflows add to a task's view (its result only if it is held here)."""
    if flow.after:
        task.after = tuple("%016x" % n for n in flow.after)  # noqa: UP031
    if record.state == WAITING:
        task.waiting_for = flow.waiting_for
    if record.state == SUCCEEDED:
        task.result, task.finished_at = flow.result, flow.finished_at
    if flow.ttl_given:
        task.result_ttl = record.ttl


class HotLine:
    """A lane's ready records in line, oldest first: a list read from a head index. Entries
    are in the order of their ``seq``, so any place in the line is found by bisection; a record
    taken from the middle (cancelled, expired) stays as a hole (its state no longer READY) that
    the head skips and a compaction drops. Appending, taking the head and putting one back at
    it are O(1) (putting back when nothing was taken yet: O(n), but that is rare)."""

    __slots__ = ("items", "head", "size", "holes")

    def __init__(self) -> None:
        self.items: list[Record] = []
        self.head = 0
        self.size = 0  # records in line (holes not counted)
        self.holes = 0  # holes at or after the head

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def append(self, record: Record) -> None:
        self.items.append(record)
        self.size += 1

    def appendleft(self, record: Record) -> None:
        if self.head:
            self.head -= 1
            self.items[self.head] = record
        else:
            self.items.insert(0, record)
        self.size += 1

    def first(self) -> Record | None:
        """The record at the head of the line (holes before it are passed), or None."""
        items = self.items
        head = self.head
        end = len(items)
        while head < end and items[head].state != READY:
            head += 1
            self.holes -= 1
        self.head = head
        return items[head] if head < end else None

    def popleft(self) -> Record:
        record = self.first()
        assert record is not None, "popleft from an empty line"
        self.head += 1
        self.size -= 1
        if self.head >= _COMPACT_LINE and self.head * 2 > len(self.items):
            del self.items[: self.head]
            self.head = 0
        return record

    def dropped(self) -> None:
        """A record of the line left it where it stood (its state is no longer READY)."""
        self.size -= 1
        self.holes += 1
        if self.holes >= _COMPACT_LINE and self.holes * 2 > len(self.items) - self.head:
            self.items = [r for r in self.items[self.head :] if r.state == READY]
            self.head = 0
            self.holes = 0

    def index_after(self, seq: int) -> int:
        """Where the first entry whose ``seq`` is above ``seq`` stands (holes included)."""
        return bisect.bisect_right(self.items, seq, lo=self.head, key=_seq_of)

    def live_from(self, at: int) -> Iterator[Record]:
        """The records in line from index ``at`` on."""
        items = self.items
        for i in range(max(at, self.head), len(items)):
            record = items[i]
            if record.state == READY:
                yield record

    def __iter__(self) -> Iterator[Record]:
        return self.live_from(self.head)


def _seq_of(record: Record) -> int:
    return record.seq


class ColdLine:
    """A lane's cold ready tasks (not in memory: a store reads them back), behind its hot ones:
    each entry is ``(seq + _SEQ_OFFSET) << 64 | id``, in the order of ``seq``, read from a head
    index; one taken from the middle is put in ``dropped`` (by id) and passed over."""

    __slots__ = ("items", "head", "dropped")

    def __init__(self) -> None:
        self.items: list[int] = []
        self.head = 0
        self.dropped: set[int] = set()  # ids of entries no longer in line

    def __len__(self) -> int:
        return len(self.items) - self.head - len(self.dropped)

    def __bool__(self) -> bool:
        return len(self) > 0

    def append(self, task_id: int, seq: int) -> None:
        self.items.append((seq + _SEQ_OFFSET) << 64 | task_id)

    def _pass_dropped(self) -> None:
        items, dropped = self.items, self.dropped
        while dropped and self.head < len(items) and (items[self.head] & _MASK) in dropped:
            dropped.discard(items[self.head] & _MASK)
            self.head += 1

    def first(self) -> int | None:
        """The id at the head of the line, or None."""
        self._pass_dropped()
        return self.items[self.head] & _MASK if self.head < len(self.items) else None

    def popleft(self) -> int:
        task_id = self.first()
        assert task_id is not None, "popleft from an empty line"
        self.head += 1
        if self.head >= _COMPACT_LINE and self.head * 2 > len(self.items):
            del self.items[: self.head]
            self.head = 0
        return task_id

    def head_ids(self, n: int) -> list[int]:
        """The first ``n`` ids in line."""
        return list(itertools.islice(iter(self), n))

    def index_after(self, seq: int) -> int:
        return bisect.bisect_right(self.items, (seq + _SEQ_OFFSET) << 64 | _MASK, lo=self.head)

    def find(self, task_id: int, seq: int) -> bool:
        """Whether the entry ``(seq, task_id)`` is in line."""
        value = (seq + _SEQ_OFFSET) << 64 | task_id
        at = bisect.bisect_left(self.items, value, lo=self.head)
        return at < len(self.items) and self.items[at] == value and task_id not in self.dropped

    def drop(self, task_id: int) -> None:
        self.dropped.add(task_id)

    def live_from(self, at: int) -> Iterator[tuple[int, int]]:
        """``(seq, id)`` of the entries in line from index ``at`` on."""
        items, dropped = self.items, self.dropped
        for i in range(max(at, self.head), len(items)):
            value = items[i]
            task_id = value & _MASK
            if task_id not in dropped:
                yield (value >> 64) - _SEQ_OFFSET, task_id

    def __iter__(self) -> Iterator[int]:
        return (task_id for _, task_id in self.live_from(self.head))

    def clear(self) -> list[int]:
        """Every id in line; the line is left empty."""
        ids = list(self)
        self.items, self.head, self.dropped = [], 0, set()
        return ids


class Lane:
    """One priority of one queue: its ready tasks, oldest first (records, then cold ids). A
    record points at its lane, which gives its queue and priority (one slot, not two)."""

    __slots__ = ("queue", "priority", "hot", "cold")

    def __init__(self, queue: Queue, priority: int) -> None:
        self.queue = queue
        self.priority = priority
        self.hot = HotLine()
        self.cold: ColdLine | None = None  # ready tasks behind ``hot``, not in memory

    def __len__(self) -> int:
        return len(self.hot) + (len(self.cold) if self.cold else 0)


class Log:
    """A queue's tasks in one state (dead, waiting, succeeded) in the order they came to it, as
    ``(seq, record)``: one coming appends, one leaving leaves a hole (the record's state or seq
    moved on), so any place is found by bisection on ``seq``."""

    __slots__ = ("state", "items", "holes")

    def __init__(self, state: int) -> None:
        self.state = state
        self.items: list[tuple[int, Record]] = []
        self.holes = 0

    def append(self, record: Record) -> None:
        self.items.append((record.seq, record))

    def left(self) -> None:
        """One of its records left the state."""
        self.holes += 1
        if self.holes >= _COMPACT_LINE and self.holes * 2 > len(self.items):
            state = self.state
            self.items = [e for e in self.items if e[1].state == state and e[1].seq == e[0]]
            self.holes = 0

    def live_after(self, seq: int | None) -> Iterator[Record]:
        items, state = self.items, self.state
        at = 0 if seq is None else bisect.bisect_right(items, seq, key=_first)
        for i in range(at, len(items)):
            seq_at, record = items[i]
            if record.state == state and record.seq == seq_at:
                yield record


def _first(entry: tuple[int, Record]) -> int:
    return entry[0]


# A rate bucket holding a little less than a token has one: what it refills in a microsecond (an
# epoch time in seconds is a float of about that precision), at least 1e-9 and at most 1e-3 of a
# token. (Never a whole one: within any period the hand-outs stay at most tasks + burst.)
_TOKEN_TIME: Final = 1e-6
_SLACK_LEAST: Final = 1e-9
_SLACK_MOST: Final = 1e-3


class Limiter:
    """A queue's limits (docs/design/schedules.md): at most ``concurrency`` of its tasks handed
    out at once, and a token bucket of ``burst`` tokens refilled at ``rate`` tokens a second,
    one taken per hand-out. The bucket is brought up to date lazily, when a claim (or a look)
    meets it: no timer refills it. A queue without limits has no Limiter (None), and the claim
    path only looks at that."""

    __slots__ = ("limits", "concurrency", "rate", "burst", "tokens", "at", "slack")

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.concurrency = limits.concurrency
        rate = limits.rate
        self.rate = 0.0 if rate is None else rate.tasks / rate.per  # tokens a second (0: none)
        self.burst = 0.0 if rate is None else float(rate.burst)
        self.tokens = self.burst  # full when set
        self.at = now  # when ``tokens`` was brought up to date
        self.slack = min(_SLACK_MOST, max(_SLACK_LEAST, self.rate * _TOKEN_TIME))

    def refill(self, now: float) -> float:
        """The tokens in the bucket at ``now`` (kept: the bucket is brought up to date)."""
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
        return self.tokens

    def room(self, held: int, now: float) -> bool:
        """Whether one more task of the queue may be handed out now (``held``: its tasks
        handed out)."""
        if self.concurrency is not None and held >= self.concurrency:
            return False
        return not self.rate or self.refill(now) >= 1.0 - self.slack

    def took(self) -> None:
        """A task was handed out: one token less."""
        if self.rate:
            self.tokens -= 1.0

    def next_token(self, held: int, now: float) -> float | None:
        """When the bucket holds a token again (``now`` if it holds one already: a claim made
        a moment ago, by a store that waits for its commits, found none), if the rate is what
        keeps the queue's tasks from being handed out (None: it has no rate, or its concurrency
        is full: a freed slot says when)."""
        if not self.rate or (self.concurrency is not None and held >= self.concurrency):
            return None
        tokens = self.refill(now)
        if tokens >= 1.0 - self.slack:
            return now
        return self.at + (1.0 - tokens) / self.rate

    def tokens_at(self, now: float | None) -> float | None:
        """The rate tokens available at ``now`` (None: as last brought up to date), or None
        without a rate limit."""
        if not self.rate:
            return None
        return self.tokens if now is None else self.refill(now)

    def same_rate(self, limits: Limits) -> bool:
        return self.limits.rate == limits.rate


class Queue:
    """A named queue: its lanes, its gauges, its dead tasks, its totals, whether it is paused."""

    __slots__ = (
        "name",
        "lanes",
        "mask",
        "paused",
        "delayed",
        "held",
        "dead",
        "totals",
        "out",
        "waiting",
        "graves",
        "blocked",
        "waits",
        "succeeded",
        "results",
        "limiter",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.lanes: list[Lane | None] = [None] * PRIORITIES
        self.mask = 0  # bit p: lane p holds a ready task
        self.paused = False
        self.delayed = 0
        self.held = 0
        self.dead: dict[int, Record] = {}  # in the order of burial
        self.totals = Totals()
        self.out: dict[int, Record] = {}  # its handed-out tasks
        # Its delayed tasks by due time, for listings: (available_at, seq, record).
        self.waiting: SortedKeyList[Record, tuple[float, int]] = SortedKeyList(key=_due)
        self.graves = Log(DEAD)  # its dead tasks, for listings
        # docs/design/results.md: its waiting tasks (how many, and in the order enqueued), its
        # succeeded ones (how many, and in the order they finished).
        self.blocked = 0
        self.waits = Log(WAITING)
        self.succeeded = 0
        self.results = Log(SUCCEEDED)
        # docs/design/schedules.md: its limits and rate bucket (None: no limits).
        self.limiter: Limiter | None = None

    def lane(self, priority: int) -> Lane:
        lane = self.lanes[priority]
        if lane is None:
            lane = self.lanes[priority] = Lane(self, priority)
        return lane

    def stats(self) -> Stats:
        return Stats(
            self.ready,
            self.held,
            self.delayed,
            len(self.dead),
            self.totals.copy(),
            self.blocked,
            self.succeeded,
        )

    @property
    def ready(self) -> int:
        """Its ready tasks (counted when asked: claims and enqueues do not keep a count)."""
        return sum(len(lane) for lane in self.lanes if lane is not None)

    def row(self, now: float | None = None) -> QueueStats:
        """Its gauges; its limits, and its rate tokens at ``now`` (None: as last brought up to
        date)."""
        row = QueueStats(
            self.name,
            self.ready,
            self.held,
            self.delayed,
            len(self.dead),
            self.paused,
            self.blocked,
            self.succeeded,
        )
        limiter = self.limiter
        if limiter is not None:
            row.limits, row.tokens = limiter.limits, limiter.tokens_at(now)
        return row


def _due(record: Record) -> tuple[float, int]:
    return record.available_at, record.seq


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

    def succeeded(self, record: Record) -> None:
        """As ``moved``: the task succeeded, and its result (``record.flow.result``) is to be
        kept (a store that keeps results in a file may drop it from the record once written)."""
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

    def queue_deleted(self, queue: Queue) -> None:
        """The queue (which held nothing) was forgotten."""
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
        # Delayed tasks by due time, with lazy deletion (a cancelled or expired task's entry is
        # passed over: its state or seq moved on); how many are delayed.
        self._delayed: list[tuple[float, int, Record]] = []
        self._delayed_n = 0
        self._leases: list[tuple[float, int, str, Record]] = []
        self._stale_leases = 0
        self._keys: dict[tuple[str, str], tuple[int, float]] = {}
        self._key_expiry: list[tuple[float, str, str]] = []
        # Unique keys held by active tasks: (queue, key) -> task id, and back.
        self._ukeys: dict[tuple[str, str], int] = {}
        self._ukey_of: dict[int, tuple[str, str]] = {}
        # Expiries of ready and delayed tasks: (expires_at, id, seq, lane), lazily: an entry
        # whose task moved on is passed over (the seq finds a cold task in its lane).
        self._expiries: list[tuple[float, int, int, Lane]] = []
        self._seq = 0  # the last number given from the increasing sequence
        self._head = 0  # the last number given from the decreasing one
        # docs/design/results.md: waiting tasks and succeeded ones (results held), by id; when
        # results are due to be pruned, (due, id), lazily (a pruned one's entry is passed over);
        # the flows of cold ready tasks (a store warming one puts it back on its record); the
        # ids of watched tasks, and the (id, state) of those that ended since the store last
        # took them; what became ready or delayed as a side effect since last taken.
        self._waiting: dict[int, Record] = {}
        self._done: dict[int, Record] = {}
        self._prunes: list[tuple[float, int]] = []
        self._cold_flows: dict[int, Flow] = {}
        self.watched: set[int] = set()
        self.ended: list[tuple[str, str]] = []
        self.released: Released | None = None
        self.totals = Totals()
        # The totals of the queues deleted (the broker's totals keep what they counted).
        self._deleted_totals = Totals()
        # docs/design/schedules.md: how many queues have limits (none: no hint to give).
        self._limited = 0

    # -- reading -----------------------------------------------------------------------------

    @property
    def ready_count(self) -> int:
        return self._ready

    @property
    def held_count(self) -> int:
        """Tasks ready, delayed, handed out or waiting, and results held."""
        return self._ready + self._delayed_n + self._held + len(self._waiting) + len(self._done)

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
            delayed=self._delayed_n,
            dead=len(self._dead),
            totals=self.totals.copy(),
            waiting=len(self._waiting),
            succeeded=len(self._done),
        )

    @property
    def queue_count(self) -> int:
        return len(self._queues)

    def has_queue(self, name: str) -> bool:
        return name in self._queues

    def queue_rows(self, now: float | None = None) -> list[QueueStats]:
        """Every queue known, by name (rate tokens as of ``now``)."""
        return [self._queues[name].row(now) for name in sorted(self._queues)]

    def queue_report(
        self, now: float | None = None
    ) -> tuple[list[QueueReport], list[tuple[QueueReport, int]]]:
        """Every queue known, by name, with its totals and when the oldest ready task at the
        head of its lanes became ready (ten lanes a queue at most; no task is visited). A lane
        whose head is cold has no time here: the second list pairs each such head's id with its
        queue's report, for a store to read the time back and lower ``oldest_ready`` to it."""
        reports: list[QueueReport] = []
        cold: list[tuple[QueueReport, int]] = []
        for name in sorted(self._queues):
            q = self._queues[name]
            report = QueueReport(q.row(now), q.totals.copy())
            for lane in q.lanes if q.mask else ():
                if lane is None:
                    continue
                first = lane.hot.first()
                if first is not None:
                    at = first.available_at
                    if report.oldest_ready is None or at < report.oldest_ready:
                        report.oldest_ready = at
                elif lane.cold:
                    head = lane.cold.first()
                    if head is not None:
                        cold.append((report, head))
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
        return self._record_of(n)

    def _record_of(self, n: int) -> Record | None:
        record = self._live.get(n)
        if record is None:
            record = self._dead.get(n)
            if record is None and (self._waiting or self._done):
                record = self._waiting.get(n) or self._done.get(n)
        return record

    def flow_of(self, n: int) -> Flow | None:
        """A task's flow (None: it has none, or it is unknown), whether its record is in memory
        or it is a cold ready task."""
        record = self._record_of(n)
        if record is not None:
            return record.flow
        return self._cold_flows.get(n) if self._cold_flows else None

    def children(self, task_id: str, limit: int) -> tuple[list[str], int]:
        """The first ``limit`` children of a task that still exist (oldest first), and how
        many there are."""
        n = parse_id(task_id)
        flow = self.flow_of(n) if n is not None else None
        if flow is None or not flow.children:
            return [], 0
        first = itertools.islice(flow.children, limit)
        return ["%016x" % c for c in first], len(flow.children)  # noqa: UP031

    def succeeded_parents(self, record: Record) -> list[int]:
        """The parents of a task whose results are held (succeeded), in its ``after`` order."""
        flow = record.flow
        if flow is None or not flow.after or not self._done:
            return []
        done = self._done
        return [p for p in flow.after if p in done]

    def parent_results(self, record: Record) -> list[ParentResult] | None:
        """A delivery's ``parents``, the results from the records (memory): None for a task
        without parents."""
        flow = record.flow
        if flow is None or not flow.after:
            return None
        done = self._done
        out = []
        for p in flow.after:
            parent = done.get(p)
            result = parent.flow.result if parent is not None and parent.flow is not None else None
            out.append(ParentResult("%016x" % p, result))  # noqa: UP031
        return out

    def watch(self, task_id: str) -> None:
        """Mark a task watched (whatever its state: a store that reads it back checks, and
        calls :meth:`unwatch` if it has ended already)."""
        n = parse_id(task_id)
        if n is not None:
            self.watched.add(n)

    def unwatch(self, task_id: str) -> None:
        n = parse_id(task_id)
        if n is not None:
            self.watched.discard(n)

    def take_ended(self) -> list[tuple[str, str]]:
        ended, self.ended = self.ended, []
        return ended

    def take_released(self) -> Released | None:
        released, self.released = self.released, None
        return released

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
        """The id of the task enqueued with this key within its window, or of the active task
        holding it as a unique key, if any."""
        if self._ukeys:
            owner = self._ukeys.get((queue, key))
            if owner is not None:
                return hex_id(owner)
        found = self._keys.get((queue, key))
        if found is None or found[1] <= now:
            return None
        return hex_id(found[0])

    def next_due(self) -> float | None:
        """When the next delayed task, lease or expiry is due, if any."""
        delayed = self._delayed
        while delayed and not _live_delayed(delayed[0]):
            heapq.heappop(delayed)
        due = delayed[0][0] if delayed else None
        leases = self._leases
        while leases and not _live_lease(leases[0]):
            heapq.heappop(leases)
            self._stale_leases -= 1
        if leases and (due is None or leases[0][0] < due):
            due = leases[0][0]
        if self._expiries and (due is None or self._expiries[0][0] < due):
            due = self._expiries[0][0]
        prunes = self._prunes
        while prunes and prunes[0][1] not in self._done:
            heapq.heappop(prunes)
        if prunes and (due is None or prunes[0][0] < due):
            due = prunes[0][0]
        return due

    def cold_lane(self, queues: Sequence[str], now: float) -> Lane | None:
        """The lane the next claim on ``queues`` takes from, if its next task is cold (a store
        must warm it first); None if that task is hot or nothing is ready."""
        if self._delayed and self._delayed[0][0] <= now:
            self._promote(now)
        q = self._pick(queues, now)
        if q is None:
            return None
        lane = q.lanes[q.mask.bit_length() - 1]
        assert lane is not None
        return lane if not lane.hot and lane.cold else None

    def page(
        self, queue: str, state: str, limit: int, after: ListKey | None
    ) -> tuple[list[Record | tuple[int, Lane]], ListKey | None]:
        """Up to ``limit`` tasks of ``queue`` in ``state`` (a name of STATE_NAMES) in that
        state's order, after the one whose key is ``after``: their records, or ``(id, lane)``
        for cold ready tasks (a store reads them back); and the key of the last one if more
        follow (else None). Keys: ready (priority, seq), delayed (available_at, seq), handed out
        (deadline, seq), dead, waiting, succeeded (seq,). O(limit + log n), but for handed-out
        tasks, O(h) in those of the queue (bounded by what its workers hold)."""
        q = self._queues.get(queue)
        if q is None:
            return [], None
        want = limit + 1
        found: list[tuple[ListKey, Record | tuple[int, Lane]]] = []
        which = _STATE_OF[state]
        if which == READY:
            self._page_ready(q, want, after, found)
        else:
            found.extend(itertools.islice(_paged(q, which, want, after), want))
        if len(found) > limit:
            return [entry for _, entry in found[:limit]], found[limit - 1][0]
        return [entry for _, entry in found], None

    def _page_ready(
        self,
        q: Queue,
        want: int,
        after: ListKey | None,
        found: list[tuple[ListKey, Record | tuple[int, Lane]]],
    ) -> None:
        top = PRIORITIES - 1 if after is None else int(after[0])
        for priority in range(min(top, PRIORITIES - 1), -1, -1):
            lane = q.lanes[priority]
            if lane is None:
                continue
            seq = int(after[1]) if after is not None and priority == top else None
            hot = lane.hot
            at = hot.head if seq is None else hot.index_after(seq)
            for record in hot.live_from(at):
                found.append(((priority, record.seq), record))
                if len(found) >= want:
                    return
            cold = lane.cold
            if cold is None:
                continue
            at = cold.head if seq is None else cold.index_after(seq)
            for entry_seq, task_id in cold.live_from(at):
                found.append(((priority, entry_seq), (task_id, lane)))
                if len(found) >= want:
                    return

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
            ttl=new.result_ttl,
        )
        if new.expires_at is not None or new.timeout is not None or new.unique:
            ctl = record.control()
            ctl.expires_at, ctl.timeout = new.expires_at, new.timeout
        if new.result_ttl_given:
            record.flow = Flow()
            record.flow.ttl_given = True
        if new.delay > 0:
            self._delay(record)
        else:
            self._append(record)
        self.totals.enqueued += 1
        q.totals.enqueued += 1
        if self._journal is not None:
            self._journal.created(record)
        if new.key is not None:
            if new.unique:
                self._hold_key(new.queue, new.key, record)
            else:
                self._remember(new.queue, new.key, record.id, new.key_until)
        return record

    def enqueue_many(
        self,
        items: Sequence[NewTask],
        now: float,
        *,
        cold: Mapping[int, tuple[Lane, int]] | None = None,
        errors: Mapping[int, str | None] | None = None,
    ) -> list[Enqueued]:
        """Enqueue tasks in order; one whose idempotency key is in its window (or, unique, held
        by an active task) is answered as a duplicate of the first task's id, and creates
        nothing. Tasks with ``after`` (docs/design/results.md): UnknownParent, and nothing
        enqueued, if a parent is not a live task. A store with cold ready tasks names those
        that are parents in ``cold`` (id -> (lane, seq), as read back: checked here), and the
        errors of dead parents in ``errors`` (dead records do not keep theirs)."""
        for new in items:
            if new.after:
                return self._enqueue_flow(items, now, cold or {}, errors or {})
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
            if new.expires_at is not None or new.timeout is not None:
                task.expires_at, task.timeout = new.expires_at, new.timeout
            if new.result_ttl_given:
                task.result_ttl = new.result_ttl
            out.append(Enqueued(task_id, False, task))
        return out

    def missing_parents(
        self, items: Sequence[NewTask], cold: Mapping[int, tuple[Lane, int]]
    ) -> list[int]:
        """The ids the items name in their ``after`` that are not in memory (nor in ``cold``):
        a store with cold ready tasks reads them back (they may be cold) before enqueuing."""
        out: list[int] = []
        for new in items:
            for ref in new.after:
                if isinstance(ref, str):
                    n = parse_id(ref)
                    if n is not None and n not in cold and self._record_of(n) is None:
                        out.append(n)
        return out

    def dead_parents(self, items: Sequence[NewTask]) -> list[int]:
        """The ids the items name in their ``after`` that are dead tasks."""
        out: list[int] = []
        for new in items:
            for ref in new.after:
                if isinstance(ref, str):
                    n = parse_id(ref)
                    if n is not None and n in self._dead:
                        out.append(n)
        return out

    def _enqueue_flow(  # noqa: C901 (the checks before anything is done, then the doing)
        self,
        items: Sequence[NewTask],
        now: float,
        cold: Mapping[int, tuple[Lane, int]],
        errors: Mapping[int, str | None],
    ) -> list[Enqueued]:
        """enqueue_many for a call where some task names parents: every parent checked first
        (all or nothing), then each task placed as its parents' states say."""
        # Which items would be duplicates (of a task, or of an earlier item of this call).
        dup: list[int | None] = []  # the id an item is a duplicate of (None: a new task)
        dup_of_item: dict[int, int] = {}  # item -> the earlier item it is a duplicate of
        keys: dict[tuple[str, str], int] = {}  # keys of this call's new tasks -> item
        for i, new in enumerate(items):
            dup.append(None)
            if new.key is None:
                continue
            owner = self.key_owner(new.queue, new.key, now)
            if owner is not None:
                dup[i] = int(owner, 16)
            elif (new.queue, new.key) in keys:
                dup_of_item[i] = keys[(new.queue, new.key)]
            else:
                keys[(new.queue, new.key)] = i

        def existing(n: int) -> bool:
            if self._record_of(n) is not None:
                return True
            found = cold.get(n)
            if found is None:
                return False
            lane, seq = found
            return lane.cold is not None and lane.cold.find(n, seq)

        for i, new in enumerate(items):
            for position, ref in enumerate(new.after):
                if isinstance(ref, int):
                    if not 0 <= ref < i:
                        raise UnknownParent(i, position, str(ref))
                    j = dup_of_item.get(ref, ref)
                    first = dup[j]
                    if first is not None and not existing(first):
                        raise UnknownParent(i, position, hex_id(first))
                else:
                    n = parse_id(ref)
                    if n is None or not existing(n):
                        raise UnknownParent(i, position, ref)
        # Every parent is there: enqueue.
        out: list[Enqueued] = []
        made: list[int] = []  # the id each item stands for (new or a duplicate's)
        for new in items:
            if new.key is not None:
                owner = self.key_owner(new.queue, new.key, now)
                if owner is not None:
                    out.append(Enqueued(owner, True, None))
                    made.append(int(owner, 16))
                    continue
            if not new.after:
                record = self.enqueue(new, now)
            else:
                parents: list[int] = []
                for ref in new.after:
                    n = made[ref] if isinstance(ref, int) else int(ref, 16)
                    if n not in parents:
                        parents.append(n)
                record = self._enqueue_child(new, now, parents, errors)
            made.append(record.id)
            task = record.view()
            task.payload, task.created_at = new.payload, now
            out.append(Enqueued(task.id, False, task))
        return out

    def _enqueue_child(
        self,
        new: NewTask,
        now: float,
        parents: list[int],
        errors: Mapping[int, str | None],
    ) -> Record:
        """A task with parents (all of them there): waiting for those pending, born dead if
        one is dead, else placed as any task."""
        dead, pending = self._parents_now(parents)
        if dead is None and not pending:
            record = self.enqueue(new, now)
            flow = record.flow
            if flow is None:
                flow = record.flow = Flow()
            flow.after = tuple(parents)
            if record.state == READY and record.id not in self._live:  # (gone cold at once)
                self._cold_flows[record.id] = flow
            self._link(record.id, flow)
            return record
        q = self._queues.get(new.queue) or self.queue(new.queue)
        record = Record(
            self._new_id(),
            new.payload,
            new.max_attempts,
            now,
            now + new.delay if new.delay > 0 else now,
            lane=q.lanes[new.priority] or q.lane(new.priority),
            ttl=new.result_ttl,
        )
        if new.expires_at is not None or new.timeout is not None or new.unique:
            ctl = record.control()
            ctl.expires_at, ctl.timeout = new.expires_at, new.timeout
        flow = record.flow = Flow()
        flow.after = tuple(parents)
        flow.delay = new.delay
        flow.ttl_given = new.result_ttl_given
        self.totals.enqueued += 1
        q.totals.enqueued += 1
        if dead is not None:
            parent = self._dead[dead]
            error = errors[dead] if dead in errors else parent.last_error
            record.last_error = _cut(f"parent {hex_id(dead)} {_is_dead_with(error)}")
            self._bury(record, now)
        else:
            flow.waiting_for = pending
            self._wait(record)
        self._link(record.id, flow)
        if self._journal is not None:
            self._journal.created(record)
            if dead is not None:
                self._journal.errored(record)
        if new.key is not None and not new.unique:
            self._remember(new.queue, new.key, record.id, new.key_until)
        elif new.key is not None and dead is None:
            self._hold_key(new.queue, new.key, record)
        return record

    def _parents_now(self, parents: list[int]) -> tuple[int | None, int]:
        """The first of a new task's parents that is dead (None: none is), and how many are
        pending (not succeeded nor dead)."""
        pending = 0
        dead: int | None = None
        for n in parents:
            parent = self._record_of(n)
            state = READY if parent is None else parent.state  # (None: a cold ready one)
            if state == DEAD:
                if dead is None:
                    dead = n
            elif state != SUCCEEDED:
                pending += 1
        return dead, pending

    def _wait(self, record: Record) -> None:
        """A new task waits for its parents."""
        record.state = WAITING
        record.seq = self._next_seq()
        self._waiting[record.id] = record
        q = record.lane.queue
        q.blocked += 1
        q.waits.append(record)
        if record.ctl is not None and record.ctl.expires_at is not None:
            self._watch_expiry(record)

    def _link(self, task_id: int, flow: Flow) -> None:
        """A new task is its parents' child (each pinned by it)."""
        for n in flow.after:
            parent = self._made_flow(n)
            parent.children[task_id] = None
            parent.pins += 1

    def _made_flow(self, n: int) -> Flow:
        """A task's flow, made if it has none (the task is there: in memory, or cold)."""
        record = self._record_of(n)
        if record is not None:
            if record.flow is None:
                record.flow = Flow()
            return record.flow
        flow = self._cold_flows.get(n)
        if flow is None:
            flow = self._cold_flows[n] = Flow()
        return flow

    def claim(  # noqa: C901 (inlined: this runs for every task)
        self, queues: Sequence[str], lease: float, now: float
    ) -> Record | None:
        """Hand out the next ready task of the first of ``queues`` (by name) that has one:
        its highest priority, oldest first (promoting due delayed tasks first; a task met at or
        after its expiry is dropped, counted expired). A queue whose limits allow no hand-out now
        (docs/design/schedules.md) is passed over as a paused one is. None if nothing is ready,
        or if that task is cold (a store with cold tasks warms them first)."""
        if self._delayed and self._delayed[0][0] <= now:
            self._promote(now)
        known = self._queues
        while True:
            for name in queues:  # (_pick, inlined: this runs for every task)
                q = known.get(name)
                if q is not None and q.mask and not q.paused:
                    limiter = q.limiter
                    if limiter is None or limiter.room(q.held, now):
                        break
            else:
                return None
            priority = q.mask.bit_length() - 1
            lane = q.lanes[priority]
            assert lane is not None
            hot = lane.hot
            if not hot.size:
                return None
            # (hot.popleft(), inline: this runs for every task)
            items = hot.items
            head = hot.head
            found = items[head]
            if found.state != READY:  # (a hole: passed)
                first = hot.first()
                assert first is not None
                found, head = first, hot.head
            record = found
            hot.head = head + 1
            hot.size -= 1
            if head >= _COMPACT_LINE and head * 2 > len(items):
                del items[: head + 1]
                hot.head = 0
            if not hot.size and (lane.cold is None or not lane.cold):
                q.mask &= ~(1 << priority)
            self._ready -= 1
            self._hot -= 1
            ctl = record.ctl
            if ctl is None or ctl.expires_at is None or now < ctl.expires_at:
                break
            self._expired(record, now)
        if limiter is not None:
            limiter.took()
        q.held += 1
        self._held += 1
        record.state = HANDED_OUT
        record.attempts += 1
        lease_id = "%016x" % self._rng.getrandbits(64)  # noqa: UP031
        record.lease_id = lease_id
        if ctl is not None and ctl.timeout is not None:
            ctl.handed_at = now
            lease = min(lease, ctl.timeout)
        record.deadline = deadline = now + lease
        self._seq = seq = self._seq + 1
        record.seq = seq
        heapq.heappush(self._leases, (deadline, seq, lease_id, record))
        q.out[record.id] = record
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
            if not cold or cold.first() != record.id:
                raise ValueError(f"task {record.task_id} is not the lane's next cold task")
            cold.popleft()
            record.state = READY
            lane.hot.append(record)
            self._live[record.id] = record
            self._hot += 1
            if self._cold_flows:
                flow = self._cold_flows.pop(record.id, None)
                if flow is not None:  # (what the row said of it, and its parents and children)
                    if record.flow is not None:
                        flow.ttl_given = record.flow.ttl_given
                    record.flow = flow

    def ack(
        self, task_id: str, lease_id: str, now: float = 0.0, result: bytes | None = None
    ) -> None:
        """Ack: the task is forgotten, or (a ``result``, and a result TTL above 0) kept,
        succeeded; the children it was the last pending parent of are released."""
        record = self.held(task_id, lease_id)
        self._drop_lease(record)
        del self._live[record.id]
        if self._ukey_of:
            self._free_key(record.id)
        self.totals.acked += 1
        record.lane.queue.totals.acked += 1
        if result is not None and record.ttl > 0:
            self._succeed(record, result, now)
            return
        if self._journal is not None:
            self._journal.deleted(record)
        if record.flow is not None:
            record.state = GONE
            self._parent_done(record.flow, now)
            self._unlink(record.id, record.flow, now, gone=True, pinned=True)
        if self.watched:
            self._ended(record.id, ACKED)

    def _succeed(self, record: Record, result: bytes, now: float) -> None:
        """A task acked with a result: kept, until its TTL runs out and no child pins it."""
        record.state = SUCCEEDED
        record.seq = self._next_seq()
        if record.ctl is not None:
            record.ctl.cancelling = False  # (acked: it ran its course)
        flow = record.flow
        if flow is None:
            flow = record.flow = Flow()
        flow.result = result
        flow.finished_at = now
        self._done[record.id] = record
        q = record.lane.queue
        q.succeeded += 1
        q.results.append(record)
        heapq.heappush(self._prunes, (now + record.ttl, record.id))
        if self._journal is not None:
            self._journal.succeeded(record)
        self._parent_done(flow, now)
        self._unlink(record.id, flow, now, gone=False, pinned=True)
        if self.watched:
            self._ended(record.id, SUCCEEDED_NAME)

    def _parent_done(self, flow: Flow, now: float) -> None:
        """A task succeeded (acked): each waiting child it was the last pending parent of is
        released, ready at the back of its line, or delayed by its delay from ``now``."""
        if not flow.children:
            return
        waiting = self._waiting
        for n in flow.children:
            child = waiting.get(n)
            if child is None:
                continue
            child_flow = child.flow
            assert child_flow is not None
            child_flow.waiting_for -= 1
            if child_flow.waiting_for == 0:
                self._release(child, now)

    def _release(self, record: Record, now: float) -> None:
        """A waiting task whose last pending parent succeeded: ready, or delayed by its delay."""
        flow = record.flow
        assert flow is not None
        self._unwait(record)
        released = self.released
        if released is None:
            released = self.released = Released()
        if flow.delay > 0:
            record.available_at = now + flow.delay
            self._delay(record)
            if released.earliest is None or record.available_at < released.earliest:
                released.earliest = record.available_at
        else:
            record.available_at = now
            self._append(record)
            released.queues.add(record.lane.queue.name)
        self._moved(record)

    def _unwait(self, record: Record) -> None:
        """A waiting task leaves the waiting (its entry in its queue's log is a hole)."""
        del self._waiting[record.id]
        q = record.lane.queue
        q.blocked -= 1
        record.state = GONE
        q.waits.left()

    def _unlink(
        self, task_id: int, flow: Flow, now: float | None, *, gone: bool, pinned: bool
    ) -> None:
        """A child no longer pins its parents (``pinned``: it did; it succeeded or is gone),
        and (``gone``) is no longer one of their children. A parent whose result is due and no
        longer pinned is pruned (at once when ``now`` is known, else at the next sweep)."""
        if not flow.after:
            return
        done = self._done
        for n in flow.after:
            parent = done.get(n)
            parent_flow = parent.flow if parent is not None else self.flow_of(n)
            if parent_flow is None:
                continue
            if gone and parent_flow.children.pop(task_id, _ABSENT) is _ABSENT:
                continue
            if not pinned:
                continue
            parent_flow.pins -= 1
            if parent is not None and not parent_flow.pins and parent_flow.parked:
                parent_flow.parked = False
                due = parent_flow.finished_at + parent.ttl
                if now is not None and due <= now:
                    self._prune(parent)
                else:
                    heapq.heappush(self._prunes, (due, n))

    def _prune(self, record: Record) -> None:
        """A succeeded task's result is dropped: the task is gone."""
        del self._done[record.id]
        q = record.lane.queue
        q.succeeded -= 1
        record.state = GONE
        q.results.left()
        flow = record.flow
        assert flow is not None
        if self._journal is not None:
            self._journal.deleted(record)
        self._unlink(record.id, flow, None, gone=True, pinned=False)

    def _prune_due(self, now: float) -> int:
        """Drop every result whose time is up by ``now`` and that no child pins: how many."""
        prunes = self._prunes
        done = self._done
        n = 0
        while prunes and prunes[0][0] <= now:
            _, task_id = heapq.heappop(prunes)
            record = done.get(task_id)
            if record is None:
                continue
            flow = record.flow
            assert flow is not None
            if flow.pins:
                flow.parked = True  # (the last child to go pushes a new entry)
                continue
            self._prune(record)
            n += 1
        return n

    def _ended(self, task_id: int, state: str) -> None:
        """A task ended: told, if watched."""
        if task_id in self.watched:
            self.watched.discard(task_id)
            self.ended.append(("%016x" % task_id, state))  # noqa: UP031

    def _orphan(self, task_id: int, flow: Flow, why: str, now: float) -> None:
        """A task ended dead, cancelled or expired (``why``: "is dead: ...", "was cancelled",
        "expired"): its waiting children are buried, and theirs, transitively (not counted
        buried: they never ran)."""
        if not flow.children:
            return
        waiting = self._waiting
        todo: deque[tuple[int, Flow, str]] = deque([(task_id, flow, why)])
        while todo:
            parent, parent_flow, reason = todo.popleft()
            error: str | None = None
            for n in list(parent_flow.children):
                child = waiting.get(n)
                if child is None:
                    continue
                if error is None:
                    error = _cut(f"parent {hex_id(parent)} {reason}")
                child_flow = child.flow
                assert child_flow is not None
                self._unwait(child)
                child_flow.waiting_for = 0
                child.last_error = error
                self._bury(child, now)
                if self._journal is not None:
                    self._journal.errored(child)
                if self.watched:
                    self._ended(n, DEAD_NAME)
                if child_flow.children:
                    todo.append((n, child_flow, _is_dead_with(error)))

    def _cancel_waiting(self, record: Record, now: float) -> None:
        """Cancel a waiting task, and its waiting children, transitively (each counted
        cancelled)."""
        waiting = self._waiting
        todo: deque[Record] = deque([record])
        while todo:
            task = todo.popleft()
            if task.state != WAITING:  # (a child of two of them: cancelled already)
                continue
            flow = task.flow
            assert flow is not None
            self._unwait(task)
            self._gone(task, now, cancelled=True, orphans=False)
            for n in list(flow.children):
                child = waiting.get(n)
                if child is not None:
                    todo.append(child)

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
        if record.ctl is not None and record.ctl.cancelling:
            return self._drop_cancelled(record, now)
        self.totals.nacked += 1
        record.lane.queue.totals.nacked += 1
        return self._fail(record, error, now, delay=delay, terminal=terminal)

    def reclaim(self, task_id: str, lease_id: str, error: str, now: float) -> Failure:
        record = self.held(task_id, lease_id)
        if record.cancelling:
            return self._drop_cancelled(record, now)
        self.totals.reclaimed += 1
        record.lane.queue.totals.reclaimed += 1
        return self._fail(record, error, now)

    def extend(
        self,
        task_id: str,
        lease_id: str,
        lease: float,
        now: float,
        progress: bytes | None = None,
    ) -> float:
        """A new deadline, ``now + lease`` (cut to the task's time limit), for a task held
        under ``lease_id``; ``progress`` recorded. Cancelled if it is cancelling,
        TimeLimitReached if its deadline is at its limit already."""
        record = self.held(task_id, lease_id)
        if record.cancelling:
            raise Cancelled(f"task {quoted(task_id)} was cancelled: its lease is not extended")
        if record.timeout is not None:
            limit = record.handed_at + record.timeout
            if record.deadline >= limit:
                ms = round(record.timeout * 1000)
                raise TimeLimitReached(
                    f"task {quoted(task_id)} has reached its time limit of {ms} ms "
                    "(timeout_ms): its lease is not extended"
                )
            deadline = min(now + lease, limit)  # (the limit itself: compared equal next time)
        else:
            deadline = now + lease
        record.deadline = deadline
        record.seq = seq = self._next_seq()
        self._stale_leases += 1  # the entry for the old deadline
        heapq.heappush(self._leases, (deadline, seq, lease_id, record))
        if progress is not None:
            record.control().progress = progress
        self._moved(record)
        return deadline

    def settle(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[NackItem],
        now: float,
        results: Mapping[str, bytes] | None = None,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        """Acks (with their ``results``, by task id), then nacks: for each, None / its Failure,
        or the error it raised."""
        acked: list[WqError | None] = []
        for task_id, lease_id in acks:
            try:
                self.ack(task_id, lease_id, now, results.get(task_id) if results else None)
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

    def release(self, task_id: str, lease_id: str, now: float) -> bool:
        """Undo a hand-out nobody saw: back to the head of its lane (a cancelling one is gone,
        counted cancelled). False if not current."""
        n = parse_id(task_id)
        record = self._live.get(n) if n is not None else None
        if record is None or record.state != HANDED_OUT or record.lease_id != lease_id:
            return False
        if record.cancelling:
            self._drop_cancelled(record, now)
            return True
        self._drop_lease(record)
        record.state = READY
        record.attempts -= 1
        self.totals.delivered -= 1
        lane = record.lane
        q = lane.queue
        q.totals.delivered -= 1
        self._head -= 1
        record.seq = self._head
        lane.hot.appendleft(record)
        q.mask |= 1 << lane.priority
        self._ready += 1
        self._hot += 1
        self._moved(record)
        return True

    def sweep(self, now: float) -> SweepResult:
        """Reclaim every lease due by ``now`` (a cancelling task's: it is gone), promote every
        delayed task due by then, drop every ready or delayed task expired by then."""
        result = SweepResult()
        expired = self.totals.expired
        leases = self._leases
        while leases and leases[0][0] <= now:
            entry = heapq.heappop(leases)
            if not _live_lease(entry):
                self._stale_leases -= 1
                continue
            record = entry[3]
            result.reclaimed.append((record.task_id, entry[2]))
            if record.cancelling:
                self._drop_cancelled(record, now, lease_in_heap=False)
                continue
            self.totals.reclaimed += 1
            record.lane.queue.totals.reclaimed += 1
            self._fail(record, _reclaimed_why(record, entry[0]), now, lease_in_heap=False)
        result.promoted = self._promote(now, result.ready_queues)
        if self._expiries and self._expiries[0][0] <= now:
            self._expire_due(now)
        result.expired = self.totals.expired - expired  # (promoted past its expiry, too)
        if self._prunes and self._prunes[0][0] <= now:
            result.pruned = self._prune_due(now)
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
        q = record.lane.queue
        del q.dead[record.id]
        record.state = GONE
        q.graves.left()
        self.totals.purged += 1
        q.totals.purged += 1
        if self._journal is not None:
            self._journal.deleted(record)
        if record.flow is not None:
            self._unlink(record.id, record.flow, None, gone=True, pinned=True)

    def set_paused(self, name: str, paused: bool) -> bool:
        """Pause or resume a queue (created if new). True if that changed anything."""
        q = self.queue(name)
        if q.paused == paused:
            return False
        q.paused = paused
        if self._journal is not None:
            self._journal.queue_changed(q)
        return True

    # -- control over tasks (docs/design/control.md) ------------------------------------------

    def cancel(self, task_id: str, now: float) -> CancelResult | None:
        """Cancel a task in memory: a ready (hot) or delayed one is gone, a handed-out one
        cancelling, a dead one purged. None if the task is not in memory (unknown, or a cold
        ready one: see :meth:`cancel_cold`)."""
        n = parse_id(task_id)
        record = self._live.get(n) if n is not None else None
        if record is None:
            dead = self._dead.get(n) if n is not None else None
            if dead is None:
                waiting = self._waiting.get(n) if n is not None and self._waiting else None
                if waiting is None:
                    return None
                self._cancel_waiting(waiting, now)
                return CancelResult(task_id, CANCELLED, waiting.lane.queue.name)
            self.purge(task_id)
            return CancelResult(task_id, PURGED, dead.lane.queue.name)
        q = record.lane.queue
        if record.state == HANDED_OUT:
            if not record.cancelling:
                record.control().cancelling = True
                self._moved(record)
            return CancelResult(task_id, CANCELLING, q.name, record.lease_id)
        if record.state == READY:
            self._unready(record)
        else:
            self._undelay(record)
        self._gone(record, now, cancelled=True)
        return CancelResult(task_id, CANCELLED, q.name)

    def cancel_cold(self, lane: Lane, task_id: int, seq: int, now: float) -> bool:
        """Cancel a cold ready task (its lane and ``seq`` read from storage): False if it is not
        in line there."""
        cold = lane.cold
        if cold is None or not cold.find(task_id, seq):
            return False
        self._drop_cold(lane, task_id)
        self._gone_cold(lane, task_id, now, cancelled=True)
        return True

    def empty(self, name: str, now: float) -> int | None:
        """Cancel every waiting, ready and delayed task of a queue (each as a cancel would):
        how many were cancelled (None: unknown queue)."""
        q = self._queues.get(name)
        if q is None:
            return None
        before = self.totals.cancelled
        if q.blocked:  # (first: their cascades cancel their waiting children)
            for record in list(q.waits.live_after(None)):
                if record.state == WAITING:
                    self._cancel_waiting(record, now)
        for lane in q.lanes:
            if lane is not None:
                self._empty_lane(lane, now)
        q.mask = 0
        for record in list(q.waiting):
            self._undelay(record)
            self._gone(record, now, cancelled=True)
        return self.totals.cancelled - before

    def _empty_lane(self, lane: Lane, now: float) -> None:
        """Cancel every ready task of a lane."""
        while lane.hot:
            record = lane.hot.popleft()
            self._ready -= 1
            self._hot -= 1
            self._gone(record, now, cancelled=True)
        if lane.cold:
            for task_id in lane.cold.clear():
                self._ready -= 1
                self._gone_cold(lane, task_id, now, cancelled=True)

    def delete_queue(self, name: str) -> None:
        """Forget a queue that holds nothing. NotFound if unknown, Conflict if it holds tasks."""
        q = self._queues.get(name)
        if q is None:
            raise NotFound(f"queue {quoted(name)} does not exist")
        ready, dead = q.ready, len(q.dead)
        if ready or q.held or q.delayed or dead or q.blocked:
            raise Conflict(
                f"queue {quoted(name)} holds {ready} ready, {q.held} handed-out, {q.delayed} "
                f"delayed, {q.blocked} waiting and {dead} dead tasks: empty it "
                "(POST /queues/{name}/empty), let its handed-out tasks finish and purge its "
                "dead ones first"
            )
        if q.succeeded:  # (its results go with it)
            for record in list(q.results.live_after(None)):
                self._prune(record)
        del self._queues[name]
        for field in Totals.__slots__:
            setattr(
                self._deleted_totals,
                field,
                getattr(self._deleted_totals, field) + getattr(q.totals, field),
            )
        if q.limiter is not None:
            self._limited -= 1
        if self._journal is not None:
            self._journal.queue_deleted(q)

    # -- limits per queue (docs/design/schedules.md) -----------------------------------------

    def set_limits(self, name: str, limits: Limits | None, now: float) -> bool:
        """Set (None or empty: clear) a queue's limits, creating it if new. A rate bucket
        starts full when the rate is set or changed (not when only the concurrency changes).
        True if that changed anything."""
        q = self.queue(name)
        limiter = q.limiter
        if limits is None or limits.empty():
            if limiter is None:
                return False
            q.limiter = None
            self._limited -= 1
        else:
            if limiter is not None and limiter.limits == limits:
                return False
            new = Limiter(limits, now)
            if limiter is None:
                self._limited += 1
            elif limiter.same_rate(limits):  # (the bucket goes on as it stood)
                new.tokens, new.at = limiter.tokens, limiter.at
            q.limiter = new
        if self._journal is not None:
            self._journal.queue_changed(q)
        return True

    def limit_hint(self, queues: Sequence[str], now: float) -> float | None:
        """When a claim of ``queues`` that a rate limit kept from a ready task may get one: the
        earliest time a token comes (``now``: it has come) to a listed rate-limited queue that
        has ready tasks, is not paused and has room under its concurrency limit (None: no such
        queue)."""
        if not self._limited:
            return None
        known = self._queues
        when: float | None = None
        for name in queues:
            q = known.get(name)
            if q is None or q.limiter is None or not q.mask or q.paused:
                continue
            at = q.limiter.next_token(q.held, now)
            if at is not None and (when is None or at < when):
                when = at
        return when

    def _made_claimable(self, q: Queue) -> None:
        """Tasks of ``q`` may be claimed again without having become ready (a concurrency slot
        freed): told as released, so that its consumers are pumped."""
        released = self.released
        if released is None:
            released = self.released = Released()
        released.queues.add(q.name)

    # -- restoring (a durable store rebuilding its index at start) ---------------------------

    def restore_queue(
        self, name: str, paused: bool, totals: Totals, limits: Limits | None = None
    ) -> None:
        """A queue as stored; its limits' rate bucket starts full (it is not stored)."""
        q = self._restored_queue(name)
        q.paused = paused
        q.totals = totals
        if limits is not None and not limits.empty():
            if q.limiter is None:
                self._limited += 1
            q.limiter = Limiter(limits, 0.0)

    def restore_ready(self, rows: Iterable[tuple[int, str, int, int, float | None]]) -> None:
        """The ready tasks as (id, queue, priority, seq, expires_at), in order: they come back
        cold."""
        for task_id, name, priority, seq, expires_at in rows:
            q = self._restored_queue(name)
            lane = q.lane(priority)
            if lane.cold is None:
                lane.cold = ColdLine()
            lane.cold.append(task_id, seq)
            q.mask |= 1 << priority
            self._ready += 1
            self._seq = max(self._seq, seq)
            self._head = min(self._head, seq)
            if expires_at is not None:
                self._expiries.append((expires_at, task_id, seq, lane))

    def restore(self, records: Iterable[tuple[Record, str, int]]) -> None:
        """Put back handed-out, delayed, dead, waiting and succeeded records (with their queue's
        name and their priority) read from storage, in any order (the dead-letter queue and the
        logs of waiting and succeeded tasks are put in the order of ``seq``). Then
        :meth:`restore_edges`; call :meth:`restored` at the end."""
        dead: list[Record] = []
        waiting: list[Record] = []
        done: list[Record] = []
        for record, name, priority in records:
            q = self._restored_queue(name)
            record.lane = q.lane(priority)
            self._seq = max(self._seq, record.seq)
            if record.state == DEAD:
                dead.append(record)
            elif record.state == WAITING:
                waiting.append(record)
            elif record.state == SUCCEEDED:
                done.append(record)
            elif record.state == DELAYED:
                self._delayed.append((record.available_at, record.seq, record))
                self._delayed_n += 1
                self._live[record.id] = record
                q.delayed += 1
                q.waiting.add(record)
                if record.expires_at is not None:
                    self._expiries.append((record.expires_at, record.id, record.seq, record.lane))
            elif record.state == HANDED_OUT and record.lease_id is not None:
                self._leases.append((record.deadline, record.seq, record.lease_id, record))
                self._live[record.id] = record
                self._held += 1
                q.held += 1
                q.out[record.id] = record
            else:
                raise ValueError(f"task {record.task_id} has an unknown state {record.state}")
        dead.sort(key=_seq_of)
        for record in dead:
            self._dead[record.id] = record
            record.lane.queue.dead[record.id] = record
            record.lane.queue.graves.append(record)
        self._restore_flows(waiting, done)

    def _restore_flows(self, waiting: list[Record], done: list[Record]) -> None:
        """Put back waiting and succeeded records (each in the order of ``seq``)."""
        waiting.sort(key=_seq_of)
        for record in waiting:
            self._waiting[record.id] = record
            q = record.lane.queue
            q.blocked += 1
            q.waits.append(record)
            if record.expires_at is not None:
                self._expiries.append((record.expires_at, record.id, record.seq, record.lane))
        done.sort(key=_seq_of)
        for record in done:
            self._done[record.id] = record
            q = record.lane.queue
            q.succeeded += 1
            q.results.append(record)
            assert record.flow is not None
            self._prunes.append((record.flow.finished_at + record.ttl, record.id))

    def restore_edges(self, edges: Iterable[tuple[int, int, int | None]]) -> None:
        """Put back the edges between tasks and their parents, as ``(child, parent, the
        parent's state)`` (None: the parent is gone), in the order they were made, once every
        task is back (a task not in memory is a cold ready one); then count what each waiting
        task waits for."""
        parents: dict[int, list[int]] = {}  # (lists while they grow: a tuple would be copied)
        for child, parent, parent_state in edges:
            after = parents.get(child)
            if after is None:
                after = parents[child] = []
            after.append(parent)
            if parent_state is None:
                continue
            parent_flow = self._made_flow(parent)
            parent_flow.children[child] = None
            child_record = self._record_of(child)
            if child_record is None or child_record.state != SUCCEEDED:
                parent_flow.pins += 1
        for child, after in parents.items():
            self._made_flow(child).after = tuple(after)
        for record in self._waiting.values():
            flow = record.flow
            assert flow is not None
            flow.waiting_for = sum(1 for n in flow.after if self._pending(n))

    def _pending(self, n: int) -> bool:
        """Whether a task is there and not yet succeeded nor dead (a cold one is ready)."""
        record = self._record_of(n)
        if record is None:
            return n in self._cold_flows
        return record.state in PENDING

    def _restored_queue(self, name: str) -> Queue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = Queue(name)
        return q

    def restore_key(self, queue: str, key: str, task_id: int, until: float) -> None:
        self._keys[(queue, key)] = (task_id, until)
        self._key_expiry.append((until, queue, key))

    def restore_unique_key(self, queue: str, key: str, task_id: int) -> None:
        """A unique key held by an active task, as stored."""
        self._ukeys[(queue, key)] = task_id
        self._ukey_of[task_id] = (queue, key)

    def restored(self, totals: Totals, *, first_seq: int, last_seq: int, id_key: int) -> None:
        """Everything is back: ``totals`` as stored; the lowest and highest ``seq`` stored (new
        numbers go on from there); the store's id key. Ids go on from the number issued (every
        enqueue issued one), so they never repeat one issued before."""
        heapq.heapify(self._delayed)
        heapq.heapify(self._leases)
        heapq.heapify(self._key_expiry)
        heapq.heapify(self._expiries)
        heapq.heapify(self._prunes)
        self.totals = totals
        self._id_key = id_key
        self._issued = totals.enqueued
        self._seq = max(self._seq, last_seq)
        self._head = min(self._head, first_seq)
        # Queues gone since (deleted) left their counts in the broker's totals only.
        kept = Totals()
        for q in self._queues.values():
            for field in Totals.__slots__:
                setattr(kept, field, getattr(kept, field) + getattr(q.totals, field))
        for field in Totals.__slots__:
            setattr(self._deleted_totals, field, getattr(totals, field) - getattr(kept, field))

    # -- helpers -----------------------------------------------------------------------------

    def _pick(self, queues: Sequence[str], now: float) -> Queue | None:
        """The first of ``queues`` that has a ready task, is not paused, and whose limits allow
        a hand-out now."""
        known = self._queues
        for name in queues:
            q = known.get(name)
            if q is not None and q.mask and not q.paused:
                limiter = q.limiter
                if limiter is None or limiter.room(q.held, now):
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
        self._seq = seq = self._seq + 1
        record.seq = seq
        lane = record.lane
        lane.queue.mask |= 1 << lane.priority
        self._ready += 1
        cold = lane.cold
        if (cold is not None and cold) or (
            self._hot_max is not None and self._hot >= self._hot_max
        ):
            if lane.cold is None:
                lane.cold = ColdLine()
            lane.cold.append(record.id, seq)  # the store reads it back when its turn comes
            self._live.pop(record.id, None)
            if record.flow is not None:
                self._cold_flows[record.id] = record.flow
        else:
            hot = lane.hot
            hot.items.append(record)  # (hot.append(), inline)
            hot.size += 1
            self._live[record.id] = record
            self._hot += 1
        ctl = record.ctl
        if ctl is not None and ctl.expires_at is not None:
            self._watch_expiry(record)  # (a cold one is found in its line by this seq)

    def _delay(self, record: Record) -> None:
        record.state = DELAYED
        record.seq = seq = self._next_seq()
        heapq.heappush(self._delayed, (record.available_at, seq, record))
        self._delayed_n += 1
        self._live[record.id] = record
        q = record.lane.queue
        q.delayed += 1
        q.waiting.add(record)
        ctl = record.ctl
        if ctl is not None and ctl.expires_at is not None:
            self._watch_expiry(record)

    def _drop_lease(self, record: Record, *, in_heap: bool = True) -> None:
        """The task's lease ends. Its heap entry (unless already popped) is now stale."""
        record.lease_id = None
        if record.ctl is not None:
            record.ctl.progress = None
        q = record.lane.queue
        q.held -= 1
        if q.limiter is not None and q.held + 1 == q.limiter.concurrency and q.mask:
            # A slot of a queue at its concurrency limit is free again, and it has ready tasks:
            # its consumers may take one (take_released tells; docs/design/schedules.md).
            self._made_claimable(q)
        del q.out[record.id]
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
            self._bury(record, now)
            self.totals.buried += 1
            q.totals.buried += 1
            failure = Failure(record.task_id, True, None)
            if record.flow is not None:
                self._orphan(record.id, record.flow, _is_dead_with(error), now)
            if self.watched:
                self._ended(record.id, DEAD_NAME)
        if self._journal is not None:
            self._journal.errored(record)
        return failure

    def _drop_cancelled(self, record: Record, now: float, *, lease_in_heap: bool = True) -> Failure:
        """A cancelling task's holder let go of it (nack, reclaim, its lease ran out): gone,
        counted cancelled."""
        self._drop_lease(record, in_heap=lease_in_heap)
        self._gone(record, now, cancelled=True)
        return Failure(record.task_id, False, None, cancelled=True)

    def _bury(self, record: Record, now: float) -> None:
        record.state = DEAD
        record.deadline = now  # (a dead record's deadline: when it was buried)
        record.seq = self._next_seq()
        self._live.pop(record.id, None)
        self._dead[record.id] = record
        q = record.lane.queue
        q.dead[record.id] = record
        q.graves.append(record)
        if self._ukey_of:
            self._free_key(record.id)

    def _revive(self, record: Record, now: float) -> None:
        """A dead task back to the tail of ready, for a fresh set of attempts (no error, no
        expiry)."""
        del self._dead[record.id]
        q = record.lane.queue
        del q.dead[record.id]
        q.graves.left()
        record.attempts = 0
        record.last_error = None
        record.expires_at = None
        record.available_at = now
        self._append(record)
        self.totals.requeued += 1
        q.totals.requeued += 1
        if self._journal is not None:
            self._journal.errored(record)

    def _promote(self, now: float, queues: set[str] | None = None) -> int:
        delayed = self._delayed
        promoted = 0
        while delayed and delayed[0][0] <= now:
            entry = heapq.heappop(delayed)
            if not _live_delayed(entry):
                continue
            record = entry[2]
            self._undelay(record)
            if record.expires_at is not None and now >= record.expires_at:
                self._gone(record, now, cancelled=False)
                continue
            self._append(record)
            self._moved(record)
            if queues is not None:
                queues.add(record.lane.queue.name)
            promoted += 1
        return promoted

    def _unready(self, record: Record) -> None:
        """A ready (hot) task leaves its lane where it stands."""
        lane = record.lane
        record.state = GONE
        lane.hot.dropped()
        self._ready -= 1
        self._hot -= 1
        if not lane.hot and not lane.cold:
            lane.queue.mask &= ~(1 << lane.priority)

    def _undelay(self, record: Record) -> None:
        """A delayed task leaves the delayed collection (its heap entry goes stale)."""
        q = record.lane.queue
        q.waiting.remove(record)
        q.delayed -= 1
        self._delayed_n -= 1
        record.state = GONE

    def _drop_cold(self, lane: Lane, task_id: int) -> None:
        cold = lane.cold
        assert cold is not None
        cold.drop(task_id)
        self._ready -= 1
        if not lane.hot and not cold:
            lane.queue.mask &= ~(1 << lane.priority)

    def _gone(self, record: Record, now: float, *, cancelled: bool, orphans: bool = True) -> None:
        """A task out of every collection, counted cancelled (else expired); its waiting
        children buried (unless ``orphans`` is False: a cancel's cascade cancels them)."""
        record.state = GONE
        self._live.pop(record.id, None)
        if self._ukey_of:
            self._free_key(record.id)
        self._count_gone(record.lane.queue, cancelled)
        if self._journal is not None:
            self._journal.deleted(record)
        flow = record.flow
        if flow is not None:
            self._unlink(record.id, flow, None, gone=True, pinned=True)
            if orphans:
                self._orphan(record.id, flow, "was cancelled" if cancelled else "expired", now)
        if self.watched:
            self._ended(record.id, CANCELLED_STATE if cancelled else EXPIRED_STATE)

    def _gone_cold(self, lane: Lane, task_id: int, now: float, *, cancelled: bool) -> None:
        """A cold ready task (out of its line already) gone, counted cancelled (else
        expired)."""
        if self._ukey_of:
            self._free_key(task_id)
        self._count_gone(lane.queue, cancelled)
        gone = Record(task_id, b"", 0, 0.0, 0.0, state=GONE, lane=lane)
        flow = self._cold_flows.pop(task_id, None) if self._cold_flows else None
        gone.flow = flow
        if self._journal is not None:
            self._journal.deleted(gone)
        if flow is not None:
            self._unlink(task_id, flow, None, gone=True, pinned=True)
            self._orphan(task_id, flow, "was cancelled" if cancelled else "expired", now)
        if self.watched:
            self._ended(task_id, CANCELLED_STATE if cancelled else EXPIRED_STATE)

    def _count_gone(self, q: Queue, cancelled: bool) -> None:
        if cancelled:
            self.totals.cancelled += 1
            q.totals.cancelled += 1
        else:
            self.totals.expired += 1
            q.totals.expired += 1

    def _expired(self, record: Record, now: float) -> None:
        """A ready record met at its expiry (taken from its lane already)."""
        self._gone(record, now, cancelled=False)

    def _watch_expiry(self, record: Record) -> None:
        assert record.expires_at is not None
        heapq.heappush(self._expiries, (record.expires_at, record.id, record.seq, record.lane))

    def _expire_due(self, now: float) -> int:
        """Drop every ready, delayed or waiting task whose expiry is due by ``now``: how
        many."""
        expiries = self._expiries
        n = 0
        while expiries and expiries[0][0] <= now:
            at, task_id, seq, lane = heapq.heappop(expiries)
            record = self._live.get(task_id)
            if record is not None:
                if record.expires_at != at:
                    continue
                if record.state == READY:
                    self._unready(record)
                elif record.state == DELAYED:
                    self._undelay(record)
                else:
                    continue  # handed out: it runs its course
                self._gone(record, now, cancelled=False)
                n += 1
            elif self._waiting and task_id in self._waiting:
                record = self._waiting[task_id]
                if record.expires_at != at:
                    continue
                self._unwait(record)
                self._gone(record, now, cancelled=False)
                n += 1
            elif lane.cold is not None and lane.cold.find(task_id, seq):
                self._drop_cold(lane, task_id)
                self._gone_cold(lane, task_id, now, cancelled=False)
                n += 1
        return n

    def _hold_key(self, queue: str, key: str, record: Record) -> None:
        """A new task holds a unique key while it is active (a durable store keeps it on the
        task: ``record.ukey``)."""
        self._ukeys[(queue, key)] = record.id
        self._ukey_of[record.id] = (queue, key)
        record.ukey = key

    def _free_key(self, task_id: int) -> None:
        """A task that held a unique key is no longer active: the key is free."""
        held = self._ukey_of.pop(task_id, None)
        if held is not None and self._ukeys.get(held) == task_id:
            del self._ukeys[held]
        record = self._live.get(task_id) or self._dead.get(task_id)
        if record is not None:
            record.ukey = None

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
                    in_line = list(lane.hot)
                    assert len(in_line) == len(lane.hot), f"queue {q.name}: a line's size is off"
                    hot.extend(in_line)
                    cold_ids = list(lane.cold or ())
                    assert len(cold_ids) == (len(lane.cold) if lane.cold else 0)
                    cold.extend(cold_ids)
                    assert all(r.queue is q and r.priority == p for r in in_line)
                    seqs = [r.seq for r in in_line]
                    if lane.cold:
                        seqs += [seq for seq, _ in lane.cold.live_from(lane.cold.head)]
                    assert seqs == sorted(seqs), "a lane is out of order"
                ready += n
            assert ready == q.ready, f"queue {q.name}: ready count out of step"
            assert all(r.queue is q and r.state == DEAD for r in q.dead.values())
            assert [r.id for r in q.graves.live_after(None)] == list(q.dead), "graves off"
            assert all(r.state == HANDED_OUT and r.queue is q for r in q.out.values())
            assert len(q.out) == q.held, f"queue {q.name}: handed-out count out of step"
            assert len(q.waiting) == q.delayed, f"queue {q.name}: delayed count out of step"
            assert all(r.state == DELAYED and r.queue is q for r in q.waiting)
            waits = list(q.waits.live_after(None))
            assert len(waits) == q.blocked, f"queue {q.name}: waiting count out of step"
            assert all(r.state == WAITING and r.queue is q for r in waits)
            assert [r.seq for r in waits] == sorted(r.seq for r in waits)
            results = list(q.results.live_after(None))
            assert len(results) == q.succeeded, f"queue {q.name}: succeeded count out of step"
            assert all(r.state == SUCCEEDED and r.queue is q for r in results)
        held = [r for r in self._live.values() if r.state == HANDED_OUT]
        delayed = [e[2] for e in self._delayed if _live_delayed(e)]
        delayed_ids = [r.id for r in delayed]
        everything = [r.id for r in hot] + cold + delayed_ids + [r.id for r in held]
        everything += list(self._dead)
        everything += list(self._waiting)
        assert len(set(everything + list(self._done))) == len(everything) + len(self._done), (
            "a task is in two places"
        )
        assert sum(q.blocked for q in self._queues.values()) == len(self._waiting)
        assert sum(q.succeeded for q in self._queues.values()) == len(self._done)
        assert all(r.state == WAITING for r in self._waiting.values())
        assert all(r.state == SUCCEEDED for r in self._done.values())
        self._check_flows(set(cold))
        assert len(hot) == self._hot
        assert len(hot) + len(cold) == self._ready
        assert len(held) == self._held
        assert len(delayed) == self._delayed_n, "the delayed count is off"
        assert all(r.state == READY for r in hot)
        assert len(self._live) == len(hot) + len(delayed_ids) + len(held), "live dict off"
        assert sum(len(q.dead) for q in self._queues.values()) == len(self._dead)
        assert sum(q.held for q in self._queues.values()) == self._held
        assert sum(q.limiter is not None for q in self._queues.values()) == self._limited
        assert sum(q.delayed for q in self._queues.values()) == self._delayed_n
        if self._hot_max is None:
            assert not cold, "cold tasks in an index that never goes cold"
        burials = [r.seq for r in self._dead.values()]
        assert burials == sorted(burials), "the dead-letter queue is out of order"
        live = [(e[2], e[0]) for e in self._leases if _live_lease(e)]
        assert sorted(live) == sorted((r.lease_id, r.deadline) for r in held), "lease heap off"
        assert len(self._leases) - len(live) == self._stale_leases
        active = set(everything) - set(self._dead) - set(self._waiting)
        for (queue, key), owner in self._ukeys.items():
            assert owner in active, f"unique key {key!r} of {queue!r} held by a task gone"
            assert self._ukey_of.get(owner) == (queue, key), "unique keys out of step"
        t = self.totals
        assert t.nacked + t.reclaimed == t.retried + t.buried
        gone = t.acked + t.purged + t.cancelled + t.expired
        # ready + handed_out + delayed + dead + waiting == enqueued - acked - purged - ...
        assert len(everything) == t.enqueued - gone, "tasks and totals disagree"
        for field in t.__slots__:
            total = sum(getattr(q.totals, field) for q in self._queues.values())
            total += getattr(self._deleted_totals, field)
            assert total == getattr(t, field), f"queue totals of {field} do not add up"

    def _check_flows(self, cold: set[int]) -> None:  # noqa: C901 (for tests: one sweep)
        """Parents and children agree: each child that exists is among its parents' children,
        and nothing else is; pins count the children not succeeded; a waiting task waits for
        its parents not yet succeeded (none of them dead)."""
        flows: dict[int, tuple[int | None, Flow]] = {}  # id -> (state, flow); None: cold
        for source in (self._live, self._dead, self._waiting, self._done):
            for n, record in source.items():
                if record.flow is not None:
                    flows[n] = (record.state, record.flow)
        for n, flow in self._cold_flows.items():
            assert n in cold, f"the flow of {hex_id(n)} is kept for a cold task that is not"
            flows[n] = (None, flow)
        exists = set(self._live) | set(self._dead) | set(self._waiting) | set(self._done) | cold
        for n, (state, flow) in flows.items():
            for child in flow.children:
                assert child in flows, "a child that does not exist"
                assert n in flows[child][1].after, "a child that does not name its parent"
            pins = sum(1 for c in flow.children if flows[c][0] != SUCCEEDED)
            assert flow.pins == pins, f"{hex_id(n)}: {flow.pins} pins, {pins} pinning children"
            pending = 0
            for parent in flow.after:
                if parent not in exists:
                    continue
                assert parent in flows, "a parent without a flow"
                assert n in flows[parent][1].children, "a child its parent does not know of"
                parent_state = flows[parent][0]
                if parent_state not in (SUCCEEDED, DEAD):
                    pending += 1
                if state == WAITING:
                    assert parent_state != DEAD, f"{hex_id(n)} waits for a dead parent"
            if state == WAITING:
                assert flow.waiting_for == pending > 0, f"{hex_id(n)} waits for {pending}"
            else:
                assert flow.waiting_for == 0
            if state == SUCCEEDED and not flow.pins and not flow.parked:
                assert (flow.finished_at + self._done[n].ttl, n) in self._prunes


def _paged(
    q: Queue, which: int, want: int, after: ListKey | None
) -> Iterator[tuple[ListKey, Record]]:
    """A queue's delayed, handed-out or dead tasks after ``after``, in order, with their keys."""
    if which == DELAYED:
        start = None if after is None else (float(after[0]), int(after[1]))
        for record in q.waiting.irange_key(start, inclusive=(False, True)):
            yield (record.available_at, record.seq), record
    elif which == HANDED_OUT:
        mark = None if after is None else (float(after[0]), int(after[1]))
        out = (r for r in q.out.values() if mark is None or (r.deadline, r.seq) > mark)
        for record in heapq.nsmallest(want, out, key=_deadline_of):
            yield (record.deadline, record.seq), record
    else:
        log = q.graves if which == DEAD else q.waits if which == WAITING else q.results
        for record in log.live_after(None if after is None else int(after[0])):
            yield (record.seq,), record


def _live_delayed(entry: tuple[float, int, Record]) -> bool:
    """A delayed heap entry that still stands (its task is delayed, with that seq)."""
    record = entry[2]
    return record.state == DELAYED and record.seq == entry[1]


def _deadline_of(record: Record) -> tuple[float, int]:
    return record.deadline, record.seq


def _live_lease(entry: tuple[float, int, str, Record]) -> bool:
    """A lease heap entry that still stands (the task holds that lease, and this is its latest
    entry: claims and extensions give the task a new ``seq``)."""
    record = entry[3]
    return record.lease_id == entry[2] and record.seq == entry[1]


def _reclaimed_why(record: Record, deadline: float) -> str:
    """The error of a lease that ran out: its attempt's time limit, if that is where the lease
    ended (the worker did not report in time: the same words as a Worker that stopped it), else
    ``lease expired``."""
    ctl = record.ctl
    if ctl is not None and ctl.timeout is not None and deadline >= ctl.handed_at + ctl.timeout:
        return f"timed out after {round(ctl.timeout * 1000)} ms"
    return "lease expired"
