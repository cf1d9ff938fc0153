"""Time, injected.

Only :class:`SystemClock` reads the real clock. Everything that depends on time (lease deadlines,
backoff, delayed tasks, long-poll time-outs, the sweeper) asks a :class:`Clock` for ``now()`` and
schedules callbacks with ``call_at()``, so tests can drive it all with a :class:`FakeClock`.

Times are seconds since the Unix epoch (floats), because they are rendered as RFC 3339 timestamps
and, in durable stores, must survive a restart.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the Unix epoch."""
        ...

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        """Run ``callback`` in the event loop once ``now() >= when``."""
        ...


class SystemClock:
    """The real clock; callbacks go through the running event loop."""

    def now(self) -> float:
        return time.time()

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        loop = asyncio.get_running_loop()
        return loop.call_later(max(0.0, when - time.time()), callback)


class _FakeTimer:
    __slots__ = ("when", "callback", "cancelled")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A clock that only moves when told to. For tests.

    ``advance()`` moves time forward and runs every timer that has come due, in order of due time.
    Callbacks typically resolve futures; let the event loop run (``await asyncio.sleep(0)``) for the
    coroutines waiting on them to proceed.
    """

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _FakeTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        timer = _FakeTimer(when, callback)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        return timer

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, when)
            timer.callback()
        self._now = target
