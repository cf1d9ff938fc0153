"""The worker's clock: the seam through which it measures and waits out time (lease extension).

:class:`SystemClock` is the real one; tests hand a :class:`~wqclient.Worker` a fake with the same
two methods (``tests/fake_clock.py``) and move its time on by hand, so nothing really sleeps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


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
