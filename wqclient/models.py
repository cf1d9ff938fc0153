"""Typed results, the same for both transports.

Each record has a ``from_mapping`` constructor that reads the fields as both protocols name them
(the HTTP API's JSON members and the gRPC messages' fields are the same names), so the transports
only have to present an answer as a mapping: the field lists live here, once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from wqclient.errors import ProtocolError
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


@dataclass(frozen=True, slots=True)
class Task:
    """A task as the broker reports it."""

    id: str
    payload_json: bytes  # the payload's JSON text
    attempts: int
    max_attempts: int
    created_at: datetime
    available_at: datetime
    last_error: str | None = None
    queue: str = DEFAULT_QUEUE
    priority: int = 0  # 0-9, higher is served first
    state: str | None = None  # "ready", "handed_out", "delayed" or "dead": set only by a lookup

    @property
    def payload(self) -> Any:
        """The payload, decoded from JSON."""
        return json.loads(self.payload_json)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Task:
        """A task from the wire's fields: ``payload`` is the JSON text (bytes), timestamps are
        datetimes or RFC 3339 text; ``last_error``, ``queue`` (default ``"default"``),
        ``priority`` (default 0) and ``state`` may be absent (or empty, as a protobuf field left
        unset is). Raises ProtocolError if a field is missing or unreadable."""
        try:
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
            )
        except _UNREADABLE as e:
            raise _unreadable("a task", e) from None


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
    def payload(self) -> Any:
        """The task's payload, decoded from JSON."""
        return self.task.payload

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Delivery:
        """A delivery from the wire's fields: ``task`` (a mapping, see Task.from_mapping),
        ``lease_id`` and ``deadline``. Raises ProtocolError if one is missing or unreadable."""
        try:
            task = Task.from_mapping(data["task"])
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
    idempotency key)."""

    payload_json: bytes  # the payload's JSON text
    max_attempts: int | None = None
    delay_ms: int | None = None
    queue: str | None = None
    priority: int | None = None
    idempotency_key: str | None = None


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

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> QueueInfo:
        """A queue from the wire's fields: ``name``, the four gauges (absent counts 0),
        ``paused`` (absent: false) and ``oldest_ready_at`` (absent or null: None). Raises
        ProtocolError if one is unreadable."""
        try:
            name = data["name"]
            if not isinstance(name, str):
                raise TypeError(f"name is a {type(name).__name__}")
            gauges = {f: int(data.get(f, 0)) for f in ("ready", "handed_out", "delayed", "dead")}
            oldest = data.get("oldest_ready_at")
            return cls(
                name=name,
                paused=bool(data.get("paused", False)),
                oldest_ready_at=None if oldest is None else _when(oldest),
                **gauges,
            )
        except _UNREADABLE as e:
            raise _unreadable("a queue", e) from None


@dataclass(frozen=True, slots=True)
class Totals:
    """Lifetime counters. ``nacked + reclaimed == retried + buried`` always holds."""

    enqueued: int = 0
    delivered: int = 0
    acked: int = 0
    nacked: int = 0
    reclaimed: int = 0
    retried: int = 0
    buried: int = 0
    requeued: int = 0
    purged: int = 0  # dead tasks dropped for good (DELETE /dlq/{id})

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
    """Gauges (tasks in each collection now) and lifetime totals."""

    ready: int = 0
    handed_out: int = 0
    delayed: int = 0
    dead: int = 0
    totals: Totals = field(default_factory=Totals)

    @property
    def idle(self) -> bool:
        """Nothing ready, handed out or delayed."""
        return self.ready == 0 and self.handed_out == 0 and self.delayed == 0

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Stats:
        """The gauges from a mapping of their names, the totals from its ``totals`` member
        (see Totals.from_mapping). A gauge the broker does not report counts 0."""
        try:
            gauges = {f.name: int(data.get(f.name, 0)) for f in fields(cls) if f.name != "totals"}
            return cls(totals=Totals.from_mapping(data.get("totals", {})), **gauges)
        except _UNREADABLE as e:
            raise _unreadable("stats", e) from None
