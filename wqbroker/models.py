"""The records that cross the store contract and the protocol adapters.

They are plain slotted dataclasses and carry no reference into a store's internals, so a SQL backend
can build them from rows just as the memory backend builds them from its records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(slots=True, frozen=True)
class Task:
    """A snapshot of one task, as a client sees it."""

    id: str
    payload: bytes  # the JSON text, exactly as received
    attempts: int
    max_attempts: int
    created_at: float  # epoch seconds
    available_at: float  # epoch seconds
    last_error: str | None = None


@dataclass(slots=True, frozen=True)
class Delivery:
    """A task handed out under a lease."""

    task: Task
    lease_id: str
    deadline: float  # epoch seconds


@dataclass(slots=True)
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

    def as_dict(self) -> dict[str, Any]:
        """The gauges and a ``totals`` mapping, named and ordered as the spec's ``/stats``."""
        return asdict(self)


@dataclass(slots=True, frozen=True)
class Failure:
    """What became of a task whose delivery failed (nacked or reclaimed)."""

    task_id: str
    buried: bool  # True: moved to the dead-letter queue; False: delayed for a retry
    retry_at: float | None  # when it becomes ready again (None when buried)


@dataclass(slots=True)
class SweepResult:
    """What one sweep did."""

    reclaimed: list[tuple[str, str]] = field(default_factory=list)  # (task_id, lease_id)
    promoted: int = 0  # delayed tasks moved to ready
