"""The worker's clock: the seam through which it measures and waits out time (lease extension).

:class:`SystemClock` is the real one; tests hand a :class:`~wqclient.Worker` a fake with the same
methods (``tests/fake_clock.py``) and move its time on by hand, so nothing really sleeps.

A clock may also have ``call_later(seconds, callback)``, returning something with ``cancel()``:
a timer, far cheaper than a task that sleeps (the worker sets one per task, and nearly every one
is cancelled). :func:`call_later` uses it, or such a task for a clock without it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol, cast


class Clock(Protocol):
    """Monotonic seconds, and a sleep measured in them."""

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(seconds, callback)


class Timer(Protocol):
    def cancel(self) -> object: ...


def call_later(clock: Clock, seconds: float, callback: Callable[[], None]) -> Timer:
    """Call ``callback`` once ``seconds`` have gone by on ``clock``, unless cancelled first."""
    method = getattr(clock, "call_later", None)
    if method is not None:
        return cast(Timer, method(seconds, callback))
    return asyncio.ensure_future(_later(clock, seconds, callback))


async def _later(clock: Clock, seconds: float, callback: Callable[[], None]) -> None:
    await clock.sleep(seconds)
    callback()
