"""The sweeper: the broker's clock-driven half.

It reclaims tasks whose lease ran out and promotes delayed tasks whose wait is over, then wakes
any parked consumer so the retry happens promptly; and it fires the schedules that are due
(docs/design/schedules.md: the service's tick says when the next one is). It ticks every
``interval`` seconds (250 ms by default) as a safety net, and also exactly when the next thing is
due: the service tells it
(``wake_by``) each time it schedules something sooner than the planned tick, so a delayed task
becomes claimable within a few milliseconds of its time rather than at the next tick.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

from wqbroker.clock import Clock, TimerHandle
from wqbroker.errors import WqError

log = logging.getLogger("wqbroker.sweeper")

# Never schedule a tick closer than this to the previous one, whatever a store says is due.
_MIN_GAP = 0.0005


class Sweeper:
    def __init__(
        self, clock: Clock, interval: float, tick: Callable[[], Awaitable[float | None]]
    ) -> None:
        if interval <= 0:
            raise ValueError("sweep interval must be positive")
        self._clock = clock
        self._interval = interval
        self._tick = tick
        self._wake_at = math.inf
        self._handle: TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._due_now = False  # a timer fired while a tick was running
        self._failing = False
        self.ticks = 0

    def start(self) -> None:
        if self._task is None:
            self._schedule(self._clock.now() + self._interval)
            self._task = asyncio.get_running_loop().create_task(self._run(), name="wq-sweeper")

    async def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def wake_by(self, when: float) -> None:
        """Make sure a tick happens no later than ``when``."""
        if when < self._wake_at and self._task is not None:
            self._schedule(when)

    def _schedule(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._wake_at = when
        self._handle = self._clock.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._wake_at = math.inf
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        else:
            self._due_now = True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._due_now:
                self._waiter = loop.create_future()
                await self._waiter
                self._waiter = None
            self._due_now = False
            started = self._clock.now()
            next_due: float | None = None
            try:
                next_due = await self._tick()
            except asyncio.CancelledError:
                raise
            except WqError as e:  # the store is away: said once, without a traceback
                if not self._failing:
                    log.warning("sweeper tick failed (it keeps trying): %s", e.message)
                self._failing = True
            except Exception:  # a failing tick must not stop the sweeper
                if not self._failing:  # say it once, not four times a second
                    log.exception("sweeper tick failed (it keeps trying)")
                self._failing = True
            else:
                if self._failing:
                    log.info("sweeper ticks again")
                self._failing = False
            self.ticks += 1
            self._after_tick(started, next_due)

    def _after_tick(self, started: float, next_due: float | None) -> None:
        """Schedule the next tick: in an interval at the latest, or when the store says."""
        now = self._clock.now()
        if next_due is not None and started < next_due <= now:
            # It came due while the tick waited for the store (a store whose calls suspend):
            # tick again at once, as a timer set for it would have.
            self._due_now = True
            return
        when = now + self._interval
        if next_due is not None:
            when = min(when, max(next_due, now + _MIN_GAP))
        if when < self._wake_at:
            self._schedule(when)
