"""Typed results, the same for both transports.

Each record has a ``from_mapping`` constructor that reads the fields as both protocols name them
(the HTTP API's JSON members and the gRPC messages' fields are the same names), so the transports
only have to present an answer as a mapping: the field lists live here, once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, Protocol

from wqclient.errors import ProtocolError, WqError
from wqwire.defaults import DEFAULT_MAX_ATTEMPTS
from wqwire.defaults import DEFAULT_QUEUE as DEFAULT_QUEUE

# What reading a field that is missing or of the wrong kind raises: reported as the broker's fault.
_UNREADABLE = (KeyError, TypeError, ValueError, AttributeError)


def _unreadable(what: str, e: Exception) -> ProtocolError:
    return ProtocolError(
        f"the broker sent {what} this client cannot read ({type(e).__name__}: {e})"
    )


# The datetimes of recent RFC 3339 texts: a batch's deliveries mostly share their creation time
# and their deadline.
_TIMES_KEPT = 256
_times: dict[str, datetime] = {}


def _when(value: datetime | str) -> datetime:
    """A timestamp given as a datetime, or as RFC 3339 text (the HTTP API's)."""
    if isinstance(value, datetime):
        return value
    when = _times.get(value)
    if when is None:
        when = datetime.fromisoformat(value)  # (raises for what is not one: nothing is kept)
        if len(_times) >= _TIMES_KEPT:
            _times.clear()
        _times[value] = when
    return when


# What a cancel did (``AsyncClient.cancel``'s answer).
CANCELLED: Final = "cancelled"  # it was ready or delayed: gone
CANCELLING: Final = "cancelling"  # handed out: gone once its holder nacks it or lets it go
PURGED: Final = "purged"  # it was dead: dropped for good, as purge() does
CANCEL_STATES: Final = (CANCELLED, CANCELLING, PURGED)

# The states a listing can be asked for (``AsyncClient.list_tasks``): the four collections, and
# those of results and workflows (docs/design/results.md): waiting for parents, and succeeded (acked
# with a result that is kept).
WAITING: Final = "waiting"
SUCCEEDED: Final = "succeeded"
LIST_STATES: Final = ("ready", "delayed", "handed_out", "dead", WAITING, SUCCEEDED)

# How a task ended, as a result wait tells it (``TaskResult.state``).
DEAD: Final = "dead"
EXPIRED: Final = "expired"
RESULT_STATES: Final = (SUCCEEDED, DEAD, CANCELLED, EXPIRED)


class TaskControl(Protocol):
    """What a :class:`~wqclient.Worker` attaches to the task it hands its handler: the cancel it
    was told of, and the way a progress report reaches the broker (the delivery's settler)."""

    @property
    def cancelled(self) -> bool: ...

    async def progress(self, value: Any) -> None: ...

    def report_progress(self, value: Any) -> None: ...


_NOT_FROM_A_WORKER: Final = (
    "this task was not handed to a handler by a wqclient Worker, so it has no lease to report "
    "progress on: use AsyncClient.extend(delivery, progress=...) instead"
)


class _Controlled:
    """Where a Worker attaches its TaskControl to a task: a slot that is not a field (neither
    compared, nor copied by ``replace``, nor set, at a cost, for every task made)."""

    __slots__ = ("_control",)


@dataclass(frozen=True, slots=True)
class Task(_Controlled):
    """A task as the broker reports it.

    Handed to a :class:`~wqclient.Worker`'s handler, it can also report how far the work has
    come (``await task.progress(value)``, or ``task.report_progress(value)`` from a synchronous
    handler), and it says when the task was cancelled meanwhile (:attr:`cancelled`)."""

    id: str
    payload_json: bytes  # the payload's JSON text
    attempts: int
    max_attempts: int
    created_at: datetime
    available_at: datetime
    last_error: str | None = None
    queue: str = DEFAULT_QUEUE
    priority: int = 0  # 0-9, higher is served first
    state: str | None = None  # "ready", "handed_out", "delayed" or "dead": set by lookups
    # When set: never handed out at or after this time (enqueue's expires_in_ms).
    expires_at: datetime | None = None
    # When set: the most one attempt may run (enqueue's timeout_ms).
    timeout_ms: int | None = None
    # The JSON text of the progress its holder last reported, while it is handed out; None: none.
    progress_json: bytes | None = None
    # True if it is handed out and a cancel came: it will not be retried.
    cancelling: bool = False
    # Results and workflows (docs/design/results.md). Its result's JSON text once it succeeded
    # (acked with a result, kept), and when; None otherwise.
    result_json: bytes | None = None
    finished_at: datetime | None = None
    # How long its result is kept once it succeeds, if given at enqueue (None: the broker's
    # default).
    result_ttl_ms: int | None = None
    # The tasks it waits for (or waited for), in the order given (enqueue's ``after``); None: none.
    after: tuple[str, ...] | None = None
    # How many of them have not yet succeeded, while it is waiting; 0 otherwise.
    waiting_for: int = 0
    # A lookup's (get_task): the first tasks that wait for (or waited for) it and are not gone,
    # oldest first (None: none), and how many there are in all.
    children: tuple[str, ...] | None = None
    children_count: int = 0
    # A delivered task's (one with ``after``): its parents, in that order, each with its result
    # if one is held; None for a task without parents (or one that was not delivered).
    parents: tuple[ParentResult, ...] | None = None
    # Schedules (docs/design/schedules.md): the schedule that enqueued it (None: none), and the
    # scheduled time of that fire.
    schedule: str | None = None
    scheduled_for: datetime | None = None
    # While it is dead: when it was buried (None: not dead, or buried by a broker that did not
    # keep it).
    buried_at: datetime | None = None

    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            # The fields above that a task made by plain_task() leaves unset (a worker's
            # transport makes one for every task it receives, and these are seldom set): their
            # defaults. (Hidden from the type checker, which would take any name as an attribute.)
            try:
                return _LATER_DEFAULTS[name]
            except KeyError:
                raise AttributeError(
                    f"{type(self).__name__!r} object has no attribute {name!r}"
                ) from None

    @property
    def payload(self) -> Any:
        """The payload, decoded from JSON."""
        return json.loads(self.payload_json)

    @property
    def result(self) -> Any:
        """Its result, decoded from JSON (see :attr:`result_json`); None if it has none."""
        return None if self.result_json is None else json.loads(self.result_json)

    @property
    def progress_value(self) -> Any:
        """The last progress reported (see :attr:`progress_json`), decoded; None if none."""
        return None if self.progress_json is None else json.loads(self.progress_json)

    @property
    def cancelled(self) -> bool:
        """True once the broker has said the task was cancelled while a Worker's handler runs
        it: a synchronous handler should then stop (an asyncio one gets CancelledError).
        Always False for a task that no Worker handed to a handler (see :attr:`cancelling`
        for what a lookup says)."""
        control: TaskControl | None = getattr(self, "_control", None)
        return control is not None and control.cancelled

    async def progress(self, value: Any) -> None:
        """Report how far the work has come (any JSON value, at most 4 KiB encoded; ``bytes``
        are taken as JSON text), and extend the lease, as the Worker would: the broker shows it
        in the task's ``progress`` while it is handed out. Only in a Worker's handler (raises
        WqError otherwise). Raises what the extension raises (LeaseLost, Unavailable ...); a
        task cancelled meanwhile is cancelled (CancelledError in an asyncio handler)."""
        control: TaskControl | None = getattr(self, "_control", None)
        if control is None:
            raise WqError(_NOT_FROM_A_WORKER)
        await control.progress(value)

    def report_progress(self, value: Any) -> None:
        """:meth:`progress` for a synchronous handler: blocks until the broker has it. A task
        cancelled meanwhile raises :class:`~wqclient.Cancelled` (and :attr:`cancelled` is
        then True)."""
        control: TaskControl | None = getattr(self, "_control", None)
        if control is None:
            raise WqError(_NOT_FROM_A_WORKER)
        control.report_progress(value)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Task:
        """A task from the wire's fields: ``payload`` is the JSON text (bytes), timestamps are
        datetimes or RFC 3339 text; ``last_error``, ``queue`` (default ``"default"``),
        ``priority`` (default 0), ``state``, ``expires_at``, ``timeout_ms``, ``progress`` (the
        JSON text) and ``cancelling`` may be absent (or empty, as a protobuf field left unset
        is). So may those of results and workflows: ``result`` (the JSON text),
        ``finished_at``, ``result_ttl_ms``, ``after``, ``waiting_for``, ``children``,
        ``children_count`` and ``parents`` (mappings of ``id`` and ``result``); and those of
        schedules: ``schedule`` and ``scheduled_for``. Raises ProtocolError if a field is missing
        or unreadable."""
        try:
            if _EXTENSIONS.isdisjoint(data):  # (the usual: a delivery's task, none of them set)
                return plain_task(
                    data["id"],
                    bytes(data["payload"]),
                    data["attempts"],
                    data["max_attempts"],
                    _when(data["created_at"]),
                    _when(data["available_at"]),
                    data.get("last_error"),
                    str(data.get("queue") or DEFAULT_QUEUE),
                    int(data.get("priority") or 0),
                )
            expires_at = data.get("expires_at")
            timeout_ms = data.get("timeout_ms")
            progress = data.get("progress")
            if not _RESULT_FIELDS.isdisjoint(data):
                return cls._with_results(data)
            return cls(
                id=data["id"],
                payload_json=bytes(data["payload"]),
                attempts=data["attempts"],
                max_attempts=data["max_attempts"],
                created_at=_when(data["created_at"]),
                available_at=_when(data["available_at"]),
                last_error=data.get("last_error"),
                queue=str(data.get("queue") or DEFAULT_QUEUE),
                priority=int(data.get("priority") or 0),
                state=str(data["state"]) if data.get("state") else None,
                expires_at=None if expires_at is None else _when(expires_at),
                timeout_ms=None if timeout_ms is None else int(timeout_ms),
                progress_json=bytes(progress) if progress else None,
                cancelling=data.get("cancelling") is True,
            )
        except _UNREADABLE as e:
            raise _unreadable("a task", e) from None

    @classmethod
    def _with_results(cls, data: Mapping[str, Any]) -> Task:
        """from_mapping, for a task with fields of results and workflows (raises what reading
        them raises)."""
        expires_at = data.get("expires_at")
        timeout_ms = data.get("timeout_ms")
        progress = data.get("progress")
        result = data.get("result")
        finished_at = data.get("finished_at")
        ttl = data.get("result_ttl_ms")
        children = data.get("children")
        parents = data.get("parents")
        schedule = data.get("schedule")
        scheduled_for = data.get("scheduled_for")
        buried_at = data.get("buried_at")
        return cls(
            id=data["id"],
            payload_json=bytes(data["payload"]),
            attempts=data["attempts"],
            max_attempts=data["max_attempts"],
            created_at=_when(data["created_at"]),
            available_at=_when(data["available_at"]),
            last_error=data.get("last_error"),
            queue=str(data.get("queue") or DEFAULT_QUEUE),
            priority=int(data.get("priority") or 0),
            state=str(data["state"]) if data.get("state") else None,
            expires_at=None if expires_at is None else _when(expires_at),
            timeout_ms=None if timeout_ms is None else int(timeout_ms),
            progress_json=bytes(progress) if progress else None,
            cancelling=data.get("cancelling") is True,
            result_json=None if result is None else _json_text(result),
            finished_at=None if finished_at is None else _when(finished_at),
            result_ttl_ms=None if ttl is None else int(ttl),
            after=_ids(data.get("after")),
            waiting_for=int(data.get("waiting_for") or 0),
            children=_ids(children),
            children_count=int(data.get("children_count") or 0),
            parents=None if not parents else parents_from(parents),
            schedule=_schedule_name(schedule),
            scheduled_for=None if scheduled_for is None else _when(scheduled_for),
            buried_at=None if buried_at is None else _when(buried_at),
        )


def _schedule_name(value: Any) -> str | None:
    """A task's ``schedule`` from the wire (absent, null or empty: None)."""
    if not value:
        return None
    if not isinstance(value, str):
        raise TypeError(f"schedule is a {type(value).__name__}")
    return value


def _ids(value: Any) -> tuple[str, ...] | None:
    """A list of task ids from the wire (absent, null or empty: None)."""
    if not value:
        return None
    if isinstance(value, (str, bytes, Mapping)):
        raise TypeError(f"a list of ids is a {type(value).__name__}")
    ids = tuple(value)
    for task_id in ids:
        if not isinstance(task_id, str):
            raise TypeError(f"a task id is a {type(task_id).__name__}")
    return ids


def _json_text(value: Any) -> bytes:
    """A result as the wire carries it: JSON text (HTTP: the raw member; gRPC: bytes)."""
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"a result is a {type(value).__name__}, not JSON text")
    return bytes(value)


@dataclass(frozen=True, slots=True)
class ParentResult:
    """A parent of a delivered task (``task.parents``, ``delivery.parents``): its id, and its
    result's JSON text if one is held (None: it succeeded without a result kept)."""

    id: str
    result_json: bytes | None = None

    @property
    def result(self) -> Any:
        """Its result, decoded from JSON; None if none is held."""
        return None if self.result_json is None else json.loads(self.result_json)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ParentResult:
        """From the wire's fields: ``id``, and ``result`` (JSON text; absent: none)."""
        try:
            task_id = data["id"]
            if not isinstance(task_id, str):
                raise TypeError(f"id is a {type(task_id).__name__}")
            result = data.get("result")
            return cls(task_id, None if result is None else _json_text(result))
        except _UNREADABLE as e:
            raise _unreadable("a parent's result", e) from None


def parents_from(rows: Any) -> tuple[ParentResult, ...]:
    """A delivery's ``parents`` from the wire (a list of mappings)."""
    if isinstance(rows, (str, bytes, Mapping)):
        raise _unreadable("a delivery's parents", TypeError(f"parents is a {type(rows).__name__}"))
    return tuple(ParentResult.from_mapping(row) for row in rows)


@dataclass(frozen=True, slots=True)
class TaskResult:
    """How a task ended, as :meth:`~wqclient.AsyncClient.wait_result` tells it.

    ``state``: ``"succeeded"`` (its result in :attr:`result` / ``result_json``, None if it was
    acked without one: it is then gone), ``"dead"`` (``last_error``, ``attempts``: it stays in
    the dead-letter queue until requeued or purged), ``"cancelled"`` or ``"expired"``."""

    id: str
    state: str
    result_json: bytes | None = None
    finished_at: datetime | None = None
    last_error: str | None = None
    attempts: int = 0

    @property
    def succeeded(self) -> bool:
        return self.state == SUCCEEDED

    @property
    def result(self) -> Any:
        """The result, decoded from JSON; None if it has none."""
        return None if self.result_json is None else json.loads(self.result_json)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], task_id: str = "") -> TaskResult:
        """From the wire's fields: ``state``, ``id`` (else ``task_id``), ``result`` (JSON
        text), ``finished_at``, ``last_error``, ``attempts`` (each absent when not set)."""
        try:
            state = data["state"]
            if not isinstance(state, str) or not state:
                raise ValueError(f"state is {state!r}")
            result = data.get("result")
            finished_at = data.get("finished_at")
            return cls(
                id=str(data.get("id") or task_id),
                state=state,
                result_json=None if result is None else _json_text(result),
                finished_at=None if finished_at is None else _when(finished_at),
                last_error=data.get("last_error") or None,
                attempts=int(data.get("attempts") or 0),
            )
        except _UNREADABLE as e:
            raise _unreadable("a task's result", e) from None


@dataclass(frozen=True, slots=True)
class TaskPage:
    """A page of a queue's tasks in one state (``list_tasks``), each with its ``state``, and
    where the next page starts: pass ``next_cursor`` back as ``cursor`` (None: this page reached
    the end)."""

    tasks: list[Task]
    next_cursor: str | None = None

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> TaskPage:
        """From the wire's fields: ``tasks`` (task views, each with its ``state``) and
        ``next_cursor`` (absent, null or empty at the end)."""
        try:
            rows = data["tasks"]
            if not isinstance(rows, list):
                raise TypeError(f"tasks is a {type(rows).__name__}")
            cursor = data.get("next_cursor")
            if cursor is not None and not isinstance(cursor, str):
                raise TypeError(f"next_cursor is a {type(cursor).__name__}")
            return cls([Task.from_mapping(row) for row in rows], cursor or None)
        except _UNREADABLE as e:
            raise _unreadable("a page of tasks", e) from None


_FIELDS_SET: Final = tuple(
    Task.__dict__[name].__set__  # (each slot's own descriptor)
    for name in (
        "id",
        "payload_json",
        "attempts",
        "max_attempts",
        "created_at",
        "available_at",
        "last_error",
        "queue",
        "priority",
        "state",
        "expires_at",
        "timeout_ms",
        "progress_json",
        "cancelling",
    )
)
(
    _set_id,
    _set_payload,
    _set_attempts,
    _set_max_attempts,
    _set_created,
    _set_available,
    _set_error,
    _set_queue,
    _set_priority,
    _set_state,
    _set_expires,
    _set_timeout,
    _set_progress,
    _set_cancelling,
) = _FIELDS_SET
_new_object: Final = object.__new__

# The fields plain_task() leaves unset, and what reading one gives (Task.__getattr__).
_LATER_DEFAULTS: Final[dict[str, Any]] = {
    "result_json": None,
    "finished_at": None,
    "result_ttl_ms": None,
    "after": None,
    "waiting_for": 0,
    "children": None,
    "children_count": 0,
    "parents": None,
    "schedule": None,
    "scheduled_for": None,
    "buried_at": None,
}
_set_parents: Final = Task.__dict__["parents"].__set__
_set_after: Final = Task.__dict__["after"].__set__
_set_schedule: Final = Task.__dict__["schedule"].__set__
_set_scheduled_for: Final = Task.__dict__["scheduled_for"].__set__
# The members of a task's view beyond a delivered task's usual ones (those of results and
# workflows, and of schedules).
_RESULT_FIELDS: Final = frozenset(_LATER_DEFAULTS) | {"result"}
_EXTENSIONS: Final = (
    frozenset({"state", "expires_at", "timeout_ms", "progress", "cancelling"}) | _RESULT_FIELDS
)


def with_parents(
    task: Task, parents: tuple[ParentResult, ...], after: tuple[str, ...] | None = None
) -> Task:
    """``task`` (just made, not yet shared) given its delivery's parents (and, if given, its
    ``after``)."""
    _set_parents(task, parents)
    if after is not None:
        _set_after(task, after)
    return task


def with_schedule(task: Task, schedule: str, scheduled_for: datetime | None) -> Task:
    """``task`` (just made, not yet shared) given the schedule that fired it and the fire's
    scheduled time (docs/design/schedules.md)."""
    _set_schedule(task, schedule)
    _set_scheduled_for(task, scheduled_for)
    return task


def plain_task(
    task_id: str,
    payload_json: bytes,
    attempts: int,
    max_attempts: int,
    created_at: datetime,
    available_at: datetime,
    last_error: str | None,
    queue: str,
    priority: int,
) -> Task:
    """``Task(...)`` with none of the later fields set (no state, expiry, time limit, progress
    or cancel), made in half the time: each slot set by its own descriptor, not through the
    frozen dataclass's checks (a worker's transport makes one for every task it receives). The
    fields of results and workflows are not even set: they read as their defaults
    (``Task.__getattr__``)."""
    task: Task = _new_object(Task)
    _set_id(task, task_id)
    _set_payload(task, payload_json)
    _set_attempts(task, attempts)
    _set_max_attempts(task, max_attempts)
    _set_created(task, created_at)
    _set_available(task, available_at)
    _set_error(task, last_error)
    _set_queue(task, queue)
    _set_priority(task, priority)
    _set_state(task, None)
    _set_expires(task, None)
    _set_timeout(task, None)
    _set_progress(task, None)
    _set_cancelling(task, False)
    return task


@dataclass(frozen=True, slots=True)
class Delivery:
    """A task handed to you under a lease: ack or nack it before ``deadline``."""

    task: Task
    lease_id: str
    deadline: datetime

    @property
    def id(self) -> str:
        """The task's id."""
        return self.task.id

    @property
    def parents(self) -> tuple[ParentResult, ...] | None:
        """The task's parents (it was enqueued with ``after``), in that order, each with its
        result if one is held; None for a task without parents. (The task has them too:
        ``delivery.task.parents``, as a Worker's handler sees them.)"""
        return self.task.parents

    @property
    def payload(self) -> Any:
        """The task's payload, decoded from JSON."""
        return self.task.payload

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Delivery:
        """A delivery from the wire's fields: ``task`` (a mapping, see Task.from_mapping),
        ``lease_id`` and ``deadline``. Raises ProtocolError if one is missing or unreadable."""
        try:
            task = Task.from_mapping(data["task"])
            parents = data.get("parents")
            if parents:  # (docs/design/results.md: a task with parents; absent otherwise)
                task = with_parents(task, parents_from(parents))
            return cls(task, data["lease_id"], _when(data["deadline"]))
        except _UNREADABLE as e:
            raise _unreadable("a delivery", e) from None


class Enqueued(str):
    """What an enqueue did: the task's id (a ``str``, so code that took the id keeps working),
    and ``duplicate``: True when an idempotency key matched a task enqueued earlier within the
    broker's window, whose id this is; nothing new was created then."""

    duplicate: bool

    def __new__(cls, task_id: str, duplicate: bool = False) -> Enqueued:
        self = super().__new__(cls, task_id)
        self.duplicate = duplicate
        return self

    @property
    def id(self) -> str:
        """The task's id, as a plain ``str``."""
        return str(self)

    def __repr__(self) -> str:
        return f"Enqueued({str(self)!r}, duplicate={self.duplicate})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Enqueued, (str(self), self.duplicate))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Enqueued:
        """From the wire's fields: ``id``, and ``duplicate`` (absent or false for a new task)."""
        try:
            task_id = data["id"]
            if not isinstance(task_id, str):
                raise TypeError(f"id is a {type(task_id).__name__}")
            return cls(task_id, bool(data.get("duplicate", False)))
        except _UNREADABLE as e:
            raise _unreadable("an enqueue's answer", e) from None


@dataclass(frozen=True, slots=True)
class EnqueueItem:
    """One task of a batch (``enqueue_many``), with options of its own. ``None`` leaves an
    option to the broker's default (3 attempts, no delay, queue ``"default"``, priority 0, no
    idempotency key, no expiry, no time limit, no parents, the broker's result TTL);
    ``unique`` (with an idempotency key): the key holds while the task is ready, delayed or
    handed out, instead of for the broker's window. ``after``: the tasks it waits for, each a
    task id (or anything with an ``id``: an Enqueued, a Task, a workflow's handle) or the index
    of an earlier item of the same batch; ``result_ttl_ms``: how long its result is kept once it
    is acked with one (0: none is kept). See docs/design/results.md."""

    payload_json: bytes  # the payload's JSON text
    max_attempts: int | None = None
    delay_ms: int | None = None
    queue: str | None = None
    priority: int | None = None
    idempotency_key: str | None = None
    expires_in_ms: int | None = None
    timeout_ms: int | None = None
    unique: bool = False
    after: Sequence[Any] | None = None
    result_ttl_ms: int | None = None


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """One named queue: its gauges now, and whether it is paused (it accepts tasks but hands
    none out)."""

    name: str
    ready: int = 0
    handed_out: int = 0
    delayed: int = 0
    dead: int = 0
    paused: bool = False
    # When the oldest ready task (at the head of a priority lane) became ready; None: none is
    # ready (or a broker too old to say).
    oldest_ready_at: datetime | None = None
    # Tasks waiting for parents, and results held (docs/design/results.md).
    waiting: int = 0
    succeeded: int = 0
    # Its rate and concurrency limits (docs/design/schedules.md; None: none), and the rate
    # tokens available now (None: no rate limit). The concurrency in use is ``handed_out``.
    limits: Limits | None = None
    tokens: float | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> QueueInfo:
        """A queue from the wire's fields: ``name``, the gauges (absent counts 0),
        ``paused`` (absent: false), ``oldest_ready_at`` (absent or null: None), ``limits`` (a
        mapping, see Limits.from_mapping; absent or null: None) and ``tokens`` (absent or null:
        None). Raises ProtocolError if one is unreadable."""
        try:
            name = data["name"]
            if not isinstance(name, str):
                raise TypeError(f"name is a {type(name).__name__}")
            gauges = {f: int(data.get(f, 0)) for f in _QUEUE_GAUGES}
            oldest = data.get("oldest_ready_at")
            limits = None if data.get("limits") is None else Limits.from_mapping(data["limits"])
            tokens = data.get("tokens")
            return cls(
                name=name,
                paused=bool(data.get("paused", False)),
                oldest_ready_at=None if oldest is None else _when(oldest),
                limits=None if limits is None or limits.empty else limits,
                tokens=None if tokens is None else _number("tokens", tokens),
                **gauges,
            )
        except _UNREADABLE as e:
            raise _unreadable("a queue", e) from None


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} is a {type(value).__name__}")
    return float(value)


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} is a {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A queue's rate limit (docs/design/schedules.md): at most ``tasks`` hand-outs per
    ``per_ms`` milliseconds, from a token bucket holding up to ``burst`` tokens (None: the
    broker's default, ``tasks``). ``RateLimit(20, 1000)``: 20 a second.

    The broker checks the ranges (``tasks`` and ``burst`` 1 to 1,000,000, ``per_ms`` 1 to
    86,400,000) and says why."""

    tasks: int
    per_ms: int = 1000
    burst: int | None = None

    @property
    def per_second(self) -> float:
        """The refill rate, in tasks a second."""
        return self.tasks * 1000 / self.per_ms

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> RateLimit:
        """From the wire's fields: ``tasks``, ``per_ms``, ``burst`` (absent, null or 0: None)."""
        try:
            burst = data.get("burst")
            return cls(
                _count("tasks", data["tasks"]),
                _count("per_ms", data["per_ms"]),
                None if not burst else _count("burst", burst),
            )
        except _UNREADABLE as e:
            raise _unreadable("a rate limit", e) from None


@dataclass(frozen=True, slots=True)
class Limits:
    """A queue's limits (docs/design/schedules.md): ``rate`` (a :class:`RateLimit`) and
    ``concurrency`` (at most that many of its tasks handed out at once); None: no limit of that
    kind. They hold over every worker, and every broker of a shared store."""

    rate: RateLimit | None = None
    concurrency: int | None = None

    @property
    def empty(self) -> bool:
        """No limit of either kind."""
        return self.rate is None and self.concurrency is None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Limits:
        """From the wire's fields: ``rate`` (a mapping; absent or null: None) and
        ``concurrency`` (absent or null: None)."""
        try:
            rate = data.get("rate")
            concurrency = data.get("concurrency")
            return cls(
                None if rate is None else RateLimit.from_mapping(rate),
                None if concurrency is None else _count("concurrency", concurrency),
            )
        except _UNREADABLE as e:
            raise _unreadable("a queue's limits", e) from None


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What :meth:`~wqclient.AsyncClient.put_schedule` sends (the members of ``PUT
    /schedules/{name}``; None: not given, the broker's default): the rule (``cron`` in
    ``timezone``, or ``every_ms``) and the task each fire enqueues."""

    payload_json: bytes  # the payload's JSON text
    cron: str | None = None
    timezone: str | None = None
    every_ms: int | None = None
    queue: str | None = None
    priority: int | None = None
    max_attempts: int | None = None
    expires_in_ms: int | None = None
    timeout_ms: int | None = None
    result_ttl_ms: int | None = None
    paused: bool = False


@dataclass(frozen=True, slots=True)
class Schedule:
    """A schedule, as the broker reports it (docs/design/schedules.md).

    Its rule: ``cron`` (five fields or a macro such as ``@hourly``, as given) in ``timezone``
    (an IANA name), or ``every_ms``, a fixed interval (``timezone`` None then). The task each
    fire enqueues: ``payload_json`` (its JSON text; :attr:`payload` decoded), ``queue``,
    ``priority``, ``max_attempts``, ``expires_in_ms`` (counted from the fire),
    ``timeout_ms``, ``result_ttl_ms`` (None: not set). ``next_fire_at``: the scheduled time of
    its next fire (None while paused); ``last_fire_at``: that of its last one, and
    ``last_task_id`` the task it enqueued (None: none yet); ``fires``: how many so far, by
    every broker."""

    name: str
    payload_json: bytes
    cron: str | None = None
    timezone: str | None = None
    every_ms: int | None = None
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    expires_in_ms: int | None = None
    timeout_ms: int | None = None
    result_ttl_ms: int | None = None
    paused: bool = False
    created_at: datetime | None = None
    updated_at: datetime | None = None
    next_fire_at: datetime | None = None
    last_fire_at: datetime | None = None
    last_task_id: str | None = None
    fires: int = 0

    @property
    def payload(self) -> Any:
        """The payload each fire enqueues, decoded from JSON."""
        return json.loads(self.payload_json)

    @property
    def rule(self) -> str:
        """The rule in words: the cron expression (with its timezone when it is not UTC), or
        ``every N ms``."""
        if self.cron is not None:
            zone = self.timezone or "UTC"
            return self.cron if zone == "UTC" else f"{self.cron} ({zone})"
        return f"every {self.every_ms} ms"

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Schedule:
        """From the wire's fields: ``name``, ``payload`` (JSON text), ``cron``, ``timezone``
        and ``every_ms`` (absent, null or empty where not set), the task's members,
        ``paused``, the times (datetimes or RFC 3339 text; absent or null: None),
        ``last_task_id`` (absent, null or empty: None) and ``fires``. Raises ProtocolError if
        one is missing or unreadable."""
        try:
            name = data["name"]
            if not isinstance(name, str):
                raise TypeError(f"name is a {type(name).__name__}")
            priority = data.get("priority")
            max_attempts = data.get("max_attempts")
            return cls(
                name=name,
                payload_json=bytes(data["payload"]),
                cron=_text_or_none("cron", data.get("cron")),
                timezone=_text_or_none("timezone", data.get("timezone")),
                every_ms=_int_or_none("every_ms", data.get("every_ms")),
                queue=_text_or_none("queue", data.get("queue")) or DEFAULT_QUEUE,
                priority=0 if priority is None else _count("priority", priority),
                max_attempts=(
                    DEFAULT_MAX_ATTEMPTS
                    if not max_attempts
                    else _count("max_attempts", max_attempts)
                ),
                expires_in_ms=_int_or_none("expires_in_ms", data.get("expires_in_ms")),
                timeout_ms=_int_or_none("timeout_ms", data.get("timeout_ms")),
                result_ttl_ms=_int_or_none("result_ttl_ms", data.get("result_ttl_ms")),
                paused=data.get("paused") is True,
                created_at=_when_or_none(data.get("created_at")),
                updated_at=_when_or_none(data.get("updated_at")),
                next_fire_at=_when_or_none(data.get("next_fire_at")),
                last_fire_at=_when_or_none(data.get("last_fire_at")),
                last_task_id=_text_or_none("last_task_id", data.get("last_task_id")),
                fires=int(data.get("fires") or 0),
            )
        except _UNREADABLE as e:
            raise _unreadable("a schedule", e) from None


def _text_or_none(name: str, value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} is a {type(value).__name__}")
    return value


def _int_or_none(name: str, value: Any) -> int | None:
    return None if value is None else _count(name, value)


def _when_or_none(value: Any) -> datetime | None:
    return None if value is None else _when(value)


_QUEUE_GAUGES: Final = ("ready", "handed_out", "delayed", "dead", WAITING, SUCCEEDED)


@dataclass(frozen=True, slots=True)
class Totals:
    """Lifetime counters. ``nacked + reclaimed == retried + buried`` always holds, and the
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
    cancelled: int = 0  # tasks cancelled (cancel, empty_queue), none of them retried
    expired: int = 0  # tasks dropped at their expiry, never handed out after it

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Totals:
        """The counters from a mapping of their names. A counter the broker does not report
        counts 0; names this client does not know are ignored."""
        try:
            return cls(**{f.name: int(data.get(f.name, 0)) for f in fields(cls)})
        except _UNREADABLE as e:
            raise _unreadable("totals", e) from None


@dataclass(frozen=True, slots=True)
class Stats:
    """Gauges (tasks in each collection now) and lifetime totals. ``waiting``: tasks waiting for
    their parents (they are in the invariant's gauges: ``ready + handed_out + delayed + dead +
    waiting == enqueued - acked - purged - cancelled - expired``); ``succeeded``: results held
    (those tasks were counted acked)."""

    ready: int = 0
    handed_out: int = 0
    delayed: int = 0
    dead: int = 0
    totals: Totals = field(default_factory=Totals)
    waiting: int = 0
    succeeded: int = 0

    @property
    def idle(self) -> bool:
        """Nothing ready, handed out, delayed or waiting for parents."""
        return self.ready == 0 and self.handed_out == 0 and self.delayed == 0 and not self.waiting

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Stats:
        """The gauges from a mapping of their names, the totals from its ``totals`` member
        (see Totals.from_mapping). A gauge the broker does not report counts 0."""
        try:
            gauges = {f.name: int(data.get(f.name, 0)) for f in fields(cls) if f.name != "totals"}
            return cls(totals=Totals.from_mapping(data.get("totals", {})), **gauges)
        except _UNREADABLE as e:
            raise _unreadable("stats", e) from None
