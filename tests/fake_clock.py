"""A fake :class:`wqclient.clock.Clock`: time stands still until a test moves it on.

``await clock.sleep(s)`` (and a timer, ``clock.call_later(s, f)``) parks until
:meth:`FakeClock.advance` carries the time past its end; :meth:`FakeClock.sleeping` waits until
so many sleeps are parked, so a test moves time only once the code under test is waiting for it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []  # every sleep asked for, in seconds, in order
        self._parked: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._changed = asyncio.Event()

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._parked, (self.now + max(0.0, seconds), next(self._seq), future))
        self._poke()
        await future

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.Future[None]:
        """A timer: parked (and counted in ``sleeps``) as a sleep is, until cancelled."""
        self.sleeps.append(seconds)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: None if f.cancelled() else callback())
        heapq.heappush(self._parked, (self.now + max(0.0, seconds), next(self._seq), future))
        self._poke()
        return future

    @property
    def parked(self) -> int:
        """How many sleeps are waiting for time to pass."""
        return sum(1 for _, _, future in self._parked if not future.done())

    async def sleeping(self, count: int = 1, timeout: float = 5.0) -> None:
        """Return once at least ``count`` sleeps are parked."""

        async def wait() -> None:
            while self.parked < count:
                changed = self._changed
                await changed.wait()

        try:
            await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {count} sleeps") from None

    async def advance(self, seconds: float) -> None:
        """Move time on by ``seconds``, waking (in order) every sleep that ends by then and
        letting the event loop run what each wakes."""
        end = self.now + seconds
        while self._parked and self._parked[0][0] <= end:
            when, _, future = heapq.heappop(self._parked)
            self.now = max(self.now, when)
            if not future.done():
                future.set_result(None)
            for _ in range(10):
                await asyncio.sleep(0)
        self.now = end

    def _poke(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
