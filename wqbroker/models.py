"""The records that cross the store contract and the protocol adapters.

They are plain slotted dataclasses and carry no reference into a store's internals, so a SQL backend
can build them from rows just as the memory backend builds them from its records. They are not
frozen (a frozen dataclass takes four times as long to build, and these are built for every task
at every step), but nothing changes one once it is built: treat them as values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final

# DEFAULT_QUEUE: the queue a task goes to, and a claim takes from, when none is named.
from wqwire.defaults import DEFAULT_QUEUE as DEFAULT_QUEUE

# The states a task can be in, as GET /jobs/{id} names them.
READY: Final = "ready"
HANDED_OUT: Final = "handed_out"
DELAYED: Final = "delayed"
DEAD: Final = "dead"
# docs/design/results.md: enqueued with ``after`` and some parent not yet succeeded; acked with a
# result that is kept.
WAITING: Final = "waiting"
SUCCEEDED: Final = "succeeded"
#: The states a listing can be asked for, in the order the API names them.
LIST_STATES: Final = (READY, DELAYED, HANDED_OUT, DEAD, WAITING, SUCCEEDED)


@dataclass(slots=True)
class Task:
    """A snapshot of one task, as a client sees it."""

    id: str
    payload: bytes  # the JSON text, exactly as received
    attempts: int
    max_attempts: int
    created_at: float  # epoch seconds
    available_at: float  # epoch seconds
    last_error: str | None = None
    queue: str = DEFAULT_QUEUE
    priority: int = 0  # 0-9, higher first
    # The extensions of docs/design/control.md; the defaults mean "not set".
    expires_at: float | None = None  # epoch seconds: never handed out at or after this
    timeout: float | None = None  # seconds one attempt may run
    progress: bytes | None = None  # JSON text, while handed out
    cancelling: bool = False  # handed out, and a cancel came
    # The extensions of docs/design/results.md; the defaults mean "not set".
    result: bytes | None = None  # JSON text, once succeeded
    finished_at: float | None = None  # epoch seconds, once succeeded
    result_ttl: float | None = None  # seconds, as given at enqueue (None: the broker's default)
    after: tuple[str, ...] | None = None  # its parents' ids, in order (None: no parents)
    waiting_for: int = 0  # parents not yet succeeded, while waiting
    # docs/design/schedules.md: the schedule that enqueued it, and the time of that fire.
    schedule: str | None = None
    scheduled_for: float | None = None  # epoch seconds
    # When it was buried, while dead (None: not dead, or buried by a broker that did not keep it).
    buried_at: float | None = None  # epoch seconds


@dataclass(slots=True)
class Enqueued:
    """What an enqueue did: a new task, or (an idempotency key matched) nothing."""

    id: str
    duplicate: bool  # True: the key was seen within the window; ``id`` is the first task's
    task: Task | None  # the new task (None for a duplicate)


@dataclass(slots=True)
class TaskState:
    """A task and the collection it is in (``ready``, ``handed_out``, ``delayed``, ``dead``),
    or ``waiting`` or ``succeeded`` (docs/design/results.md)."""

    task: Task
    state: str


@dataclass(slots=True)
class NewTask:
    """A checked task to enqueue. ``key``: its idempotency key, remembered until ``key_until``
    (or, ``unique``, while the task is active, and not in the window)."""

    payload: bytes
    max_attempts: int
    delay: float  # seconds (0: at once)
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    key: str | None = None
    key_until: float = 0.0
    expires_at: float | None = None  # epoch seconds (see Task)
    timeout: float | None = None  # seconds (see Task)
    unique: bool = False  # ``key`` holds while the task is ready, delayed or handed out
    # docs/design/results.md. ``after``: parents, each a task id or (an int) the index of an
    # earlier item of the same enqueue_many call; empty: none. ``result_ttl``: seconds a result
    # is kept after an ack with one (0: none is kept). ``result_ttl_given``: it was given (not
    # the broker's default), so the view shows it.
    after: tuple[str | int, ...] = ()
    result_ttl: float = 3600.0
    result_ttl_given: bool = False
    # docs/design/schedules.md: the schedule firing it and the fire's scheduled time.
    schedule: str | None = None
    scheduled_for: float | None = None


@dataclass(slots=True)
class ParentResult:
    """A parent of a delivered task, and its result if one is held (JSON text; None: none)."""

    id: str
    result: bytes | None = None


@dataclass(slots=True)
class Delivery:
    """A task handed out under a lease."""

    task: Task
    lease_id: str
    deadline: float  # epoch seconds
    # Its parents (docs/design/results.md), in the order of its ``after``; None: it has none.
    parents: list[ParentResult] | None = None


@dataclass(slots=True)
class Totals:
    """Lifetime counters. ``nacked + reclaimed == retried + buried`` always holds, and the four
    gauges add up to ``enqueued - acked - purged - cancelled - expired``."""

    enqueued: int = 0
    delivered: int = 0
    acked: int = 0
    nacked: int = 0
    reclaimed: int = 0
    retried: int = 0
    buried: int = 0
    requeued: int = 0
    purged: int = 0  # dead tasks dropped for good (DELETE /dlq/{id})
    cancelled: int = 0  # ready or delayed tasks cancelled, cancelling ones that came back
    expired: int = 0  # tasks dropped unhanded at their expiry

    def copy(self) -> Totals:
        return replace(self)


@dataclass(slots=True)
class Stats:
    """Gauges (how many tasks are in each collection now) and lifetime totals."""

    ready: int = 0
    handed_out: int = 0
    delayed: int = 0
    dead: int = 0
    totals: Totals = field(default_factory=Totals)
    # docs/design/results.md: tasks waiting for parents (in the invariant's gauges), results held
    # (not: those tasks were acked).
    waiting: int = 0
    succeeded: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The gauges and a ``totals`` mapping, named and ordered as the spec's ``/stats`` (the
        gauges it does not name after its four, ``totals`` last)."""
        out = asdict(self)
        out["totals"] = out.pop("totals")
        return out


@dataclass(slots=True)
class QueueStats:
    """One queue's gauges, and whether it is paused."""

    name: str
    ready: int
    handed_out: int
    delayed: int
    dead: int
    paused: bool
    waiting: int = 0  # docs/design/results.md
    succeeded: int = 0
    # docs/design/schedules.md: its limits (None: none set), and the rate tokens available now
    # (None: no rate limit). The concurrency in use is ``handed_out``.
    limits: Limits | None = None
    tokens: float | None = None


@dataclass(slots=True)
class QueueReport:
    """One queue as monitoring sees it: its gauges, its totals, and when the oldest ready task at
    the head of its priority lanes became ready (``available_at``, epoch seconds; None: nothing
    is ready)."""

    queue: QueueStats
    totals: Totals
    oldest_ready: float | None = None


@dataclass(slots=True)
class NackItem:
    """A checked nack: ``delay`` (seconds) replaces the backoff; ``terminal`` buries at once."""

    task_id: str
    lease_id: str
    error: str | None = None
    delay: float | None = None
    terminal: bool = False


@dataclass(slots=True)
class Failure:
    """What became of a task whose delivery failed (nacked or reclaimed)."""

    task_id: str
    buried: bool  # True: moved to the dead-letter queue; False: delayed for a retry
    retry_at: float | None  # when it becomes ready again (None when buried)
    cancelled: bool = False  # True: it was cancelling, and is gone (neither retried nor buried)


# What a cancel did (CancelResult.state).
CANCELLED: Final = "cancelled"  # a ready or delayed task: gone
CANCELLING: Final = "cancelling"  # a handed-out task: gone once its holder nacks or lets go
PURGED: Final = "purged"  # a dead task: dropped, as DELETE /dlq/{id}


@dataclass(slots=True)
class CancelResult:
    """What a cancel did: ``state`` is CANCELLED, CANCELLING or PURGED. A cancelling task's
    ``lease_id`` is the lease its holder has (to tell the stream holding it, on any broker)."""

    task_id: str
    state: str
    queue: str
    lease_id: str | None = None


#: Where a listing stands: the key of the last task of a page (a store's own numbers, at most
#: three of them); the next page starts after it.
ListKey = tuple[float, ...]


@dataclass(slots=True)
class TaskPage:
    """A page of a queue's tasks in one state, and where the next starts (None: no more)."""

    tasks: list[TaskState]
    after: ListKey | None


@dataclass(slots=True)
class SweepResult:
    """What one sweep did."""

    # (task_id, lease_id) of every lease that ran out: its task retried, buried, or (cancelling)
    # gone, counted cancelled.
    reclaimed: list[tuple[str, str]] = field(default_factory=list)
    promoted: int = 0  # delayed tasks moved to ready
    ready_queues: set[str] = field(default_factory=set)  # queues where tasks became ready
    expired: int = 0  # ready, delayed or waiting tasks dropped at their expiry
    pruned: int = 0  # results dropped at the end of their time (docs/design/results.md)


# How a task ended, for a result wait (Outcome.state; on_finished's states, but ``acked``).
CANCELLED_STATE: Final = "cancelled"
EXPIRED_STATE: Final = "expired"
ACKED: Final = "acked"  # on_finished only: acked without a result kept (forgotten)


@dataclass(slots=True)
class Outcome:
    """How a task ended, as a result wait answers: ``state`` is ``succeeded`` (``result`` None:
    acked without one kept), ``dead`` (``last_error``, ``attempts``), ``cancelled`` or
    ``expired``."""

    task_id: str
    state: str
    result: bytes | None = None
    finished_at: float | None = None
    last_error: str | None = None
    attempts: int = 0


@dataclass(slots=True)
class Released:
    """What became ready or delayed as a side effect (waiting children released by the ack of
    their last pending parent): the queues where tasks became ready, and the earliest due time
    of those that became delayed (None: none did)."""

    queues: set[str] = field(default_factory=set)
    earliest: float | None = None


@dataclass(slots=True)
class RateLimit:
    """At most ``tasks`` hand-outs per ``per`` seconds, from a token bucket holding up to
    ``burst`` tokens (docs/design/schedules.md)."""

    tasks: int
    per: float  # seconds
    burst: int


@dataclass(slots=True)
class Limits:
    """A queue's limits: None means no limit of that kind."""

    rate: RateLimit | None = None
    concurrency: int | None = None

    def empty(self) -> bool:
        return self.rate is None and self.concurrency is None


@dataclass(slots=True)
class ScheduleTask:
    """The task a schedule enqueues at each fire (the enqueue members; seconds for times)."""

    payload: bytes  # JSON text
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    max_attempts: int = 3
    expires_in: float | None = None  # seconds after the fire (None: never)
    timeout: float | None = None  # seconds (None: no time limit)
    result_ttl: float | None = None  # seconds (None: the broker's default)


@dataclass(slots=True)
class Schedule:
    """A named schedule: ``cron`` (five fields or a macro, in ``timezone``) or ``every``
    (seconds), exactly one of them, and the task each fire enqueues. ``next_fire_at`` is the
    scheduled time of its next fire (epoch seconds); ``last_fire_at`` that of its last one, and
    ``last_task_id`` the task it enqueued; ``fires`` counts them."""

    name: str
    task: ScheduleTask
    cron: str | None = None
    timezone: str = "UTC"
    every: float | None = None
    paused: bool = False
    created_at: float = 0.0
    updated_at: float = 0.0
    next_fire_at: float | None = None
    last_fire_at: float | None = None
    last_task_id: str | None = None
    fires: int = 0
    # Changes so far, as a number the store draws from one increasing sequence at each put,
    # pause or resume (not at a fire): a fire's compare-and-set checks it, so a fire computed
    # from a schedule read before a change does nothing.
    revision: int = 0
