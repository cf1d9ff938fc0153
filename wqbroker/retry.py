"""Retry backoff as a pure function.

A failed task waits before its next attempt: roughly 1 s, 2 s, 4 s, 8 s ... capped at 30 s. Each
delay is half fixed and half random (the second half is scaled by a uniform draw), so tasks that
failed together do not all retry at the same instant.

:func:`backoff_delay` is the reference. The PostgreSQL store computes the same delay in the
database (``wq.backoff`` in wqbroker/store/postgres/sql/functions.sql: the same operations in the
same order, with :data:`MAX_DOUBLINGS`), since only the settling transaction knows a task's
attempts; tests/store/test_backoff_in_sql.py checks that the two agree.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DEFAULT_BASE = 1.0
DEFAULT_CAP = 30.0
#: The nominal delay doubles at most this many times (so a huge attempt count cannot overflow).
MAX_DOUBLINGS = 64


def backoff_delay(attempts: int, base: float, cap: float, u: float) -> float:
    """Seconds to wait after the ``attempts``-th delivery failed.

    ``u`` is a uniform draw in [0, 1). The nominal delay is ``base * 2**(attempts-1)`` capped at
    ``cap``; the result lies in ``[nominal/2, nominal]``.
    """
    exponent = max(0, min(attempts - 1, MAX_DOUBLINGS))
    nominal = min(cap, base * float(2**exponent))
    half = nominal / 2.0
    return half + half * u


@dataclass(slots=True)
class Backoff:
    """The retry policy a store applies when a delivery fails."""

    base: float = DEFAULT_BASE
    cap: float = DEFAULT_CAP
    rng: random.Random | None = None

    def __post_init__(self) -> None:
        if self.rng is None:
            self.rng = random.Random()

    def delay(self, attempts: int) -> float:
        assert self.rng is not None
        return backoff_delay(attempts, self.base, self.cap, self.rng.random())
