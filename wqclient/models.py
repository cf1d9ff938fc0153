"""Typed results, the same for both transports."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


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

    @property
    def payload(self) -> Any:
        """The payload, decoded from JSON."""
        return json.loads(self.payload_json)


@dataclass(frozen=True, slots=True)
class Delivery:
    """A task handed to you under a lease: ack or nack it before ``deadline``."""

    task: Task
    lease_id: str
    deadline: datetime

    @property
    def id(self) -> str:
        return self.task.id

    @property
    def payload(self) -> Any:
        return self.task.payload


@dataclass(frozen=True, slots=True)
class Totals:
    enqueued: int = 0
    delivered: int = 0
    acked: int = 0
    nacked: int = 0
    reclaimed: int = 0
    retried: int = 0
    buried: int = 0
    requeued: int = 0


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
