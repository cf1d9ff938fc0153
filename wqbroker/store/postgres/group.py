"""Group commit for the PostgreSQL store: calls of one kind made while one is in flight go
together in the next transaction.

A broker serving many clients one task at a time would otherwise pay a round trip and a commit
for each; grouped, the enqueues (or settlements, or claims for one list of queues) that arrive while
one transaction is under way wait for it and then share the next. One in flight per key while
the database answers quickly; when it is far away (a group took longer than SLOW), up to WIDTH
per key (ENQUEUE_WIDTH for enqueues), so that a call waits for a round trip of its own and not
for the one before it too (pipelining over the pool's connections). Calls with different keys
(claims for different queues; calls handed different ``now`` on a fake clock) never wait for
each other. While the database is away, the calls waiting fail at once
(:meth:`Grouped.fail_waiting`) rather than behind one that may not come back before its deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Final, Generic, TypeVar

from wqbroker.errors import StoreError

X = TypeVar("X")
K = TypeVar("K")
Y = TypeVar("Y")

#: A group that takes longer than this (a round trip to a distant database, or a busy one) lets
#: calls start groups of their own beside it, up to WIDTH in flight per key.
SLOW: Final = 0.004
#: Groups in flight at once per key on a slow link (a share of the pool's connections).
WIDTH: Final = 4
#: The same for enqueues: every producer waiting for its answer has its batch in one of them, so
#: on a slow link the enqueues in flight at once bound the rate (in flight / round trip).
ENQUEUE_WIDTH: Final = 12


class Grouped(Generic[X, K, Y]):
    """Calls of one kind, grouped by key: a call made while another with its key is in flight
    waits, and goes with every other that came meanwhile with that key, in one call of ``run``.
    Calls with different keys (such as claims for different queues) never wait for each other.

    One group in flight per key while groups are quick (a database nearby: waiting for the one in
    flight costs less than a transaction of one's own, and batches stay large). Once the last
    group of a key took longer than ``slow`` seconds (a database far away: waiting for it would
    cost a whole round trip), a call starts a group beside those in flight, up to ``width`` of
    them; only when that many are in flight does it wait (with the others that came meanwhile).
    A waiting call cancelled before its group ran still runs; ``orphaned`` gets what it would
    have returned (to undo it)."""

    def __init__(
        self,
        run: Callable[[list[X], K], Awaitable[list[Y]]],
        orphaned: Callable[[Y], None] | None = None,
        *,
        width: int = WIDTH,
        slow: float = SLOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._run = run
        self._orphaned = orphaned
        self._width = max(1, width)
        self._slow = slow
        self._clock = clock
        self._waiting: dict[K, list[tuple[X, asyncio.Future[Y]]]] = {}
        self._busy: dict[K, int] = {}  # groups in flight, by key
        self._took: dict[K, float] = {}  # how long the last group of each key took
        self._running: set[asyncio.Task[None]] = set()  # (the loop keeps only weak references)
        self.most_in_flight = 0  # the most groups of one key ever in flight at once (tests)

    def _room(self, key: K) -> bool:
        """Whether a group of ``key`` may start now."""
        busy = self._busy.get(key, 0)
        if busy == 0:
            return True
        return busy < self._width and self._took.get(key, 0.0) > self._slow

    def _started(self, key: K) -> None:
        busy = self._busy[key] = self._busy.get(key, 0) + 1
        self.most_in_flight = max(self.most_in_flight, busy)

    def _ended(self, key: K, started: float) -> None:
        self._took[key] = self._clock() - started
        busy = self._busy[key] - 1
        if busy:
            self._busy[key] = busy
        else:
            del self._busy[key]

    async def call(self, arg: X, key: K) -> Y:
        if key not in self._waiting and self._room(key):
            self._started(key)
            started = self._clock()
            try:
                (out,) = await self._run([arg], key)
            finally:
                self._ended(key, started)
                self._next(key)
            return out
        waiter: asyncio.Future[Y] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append((arg, waiter))
        return await waiter

    def fail_waiting(self, error: Exception) -> None:
        """Fail every call still waiting for its group with ``error`` (the database is away:
        nothing of theirs was sent, and none is to wait behind a call that may never come
        back)."""
        waiting, self._waiting = self._waiting, {}
        for group in waiting.values():
            for _, waiter in group:
                if not waiter.done():
                    waiter.set_exception(error)

    def _next(self, key: K) -> None:
        if key in self._waiting and self._room(key):
            self._started(key)
            task = asyncio.get_running_loop().create_task(self._run_waiting(key))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run_waiting(self, key: K) -> None:
        started = self._clock()
        try:
            group = self._waiting.pop(key, [])
            if not group:
                return  # (failed meanwhile: fail_waiting)
            try:
                outs = await self._run([arg for arg, _ in group], key)
            except BaseException as e:
                error = e if isinstance(e, Exception) else StoreError("the store is closed")
                for _, waiter in group:
                    if not waiter.done():
                        waiter.set_exception(error)
                if error is not e:
                    raise
                return
            for (_, waiter), out in zip(group, outs, strict=True):
                if not waiter.done():
                    waiter.set_result(out)
                elif self._orphaned is not None:
                    self._orphaned(out)
        finally:
            self._ended(key, started)
            self._next(key)


def split(values: list[Y], sizes: list[int]) -> list[list[Y]]:
    """``values`` cut into consecutive pieces of ``sizes`` (a group's answers, call by call)."""
    out: list[list[Y]] = []
    at = 0
    for n in sizes:
        out.append(values[at : at + n])
        at += n
    return out
