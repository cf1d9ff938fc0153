"""Group commit for the PostgreSQL store: calls of one kind made while one is in flight go
together in the next transaction.

A broker serving many clients one task at a time would otherwise pay a round trip and a commit
for each; grouped, the enqueues (or settlements, or claims for one list of queues) that arrive while
one transaction is under way wait for it and then share the next. One in flight per key: calls
with different keys (claims for different queues; calls handed different ``now`` on a fake clock)
never wait for each other. While the database is away, the calls waiting fail at once
(:meth:`Grouped.fail_waiting`) rather than behind one that may not come back before its deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from wqbroker.errors import StoreError

X = TypeVar("X")
K = TypeVar("K")
Y = TypeVar("Y")


class Grouped(Generic[X, K, Y]):
    """Calls of one kind, grouped by key: a call made while another with its key is in flight
    waits, and goes with every other that came meanwhile with that key, in one call of ``run``.
    One in flight per key (calls with different keys, such as claims for different queues, do
    not wait for each other). A waiting call cancelled before its group ran still runs;
    ``orphaned`` gets what it would have returned (to undo it)."""

    def __init__(
        self,
        run: Callable[[list[X], K], Awaitable[list[Y]]],
        orphaned: Callable[[Y], None] | None = None,
    ) -> None:
        self._run = run
        self._orphaned = orphaned
        self._waiting: dict[K, list[tuple[X, asyncio.Future[Y]]]] = {}
        self._busy: set[K] = set()
        self._running: set[asyncio.Task[None]] = set()  # (the loop keeps only weak references)

    async def call(self, arg: X, key: K) -> Y:
        if key not in self._busy:
            self._busy.add(key)
            try:
                (out,) = await self._run([arg], key)
            finally:
                self._busy.discard(key)
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
        if key in self._waiting and key not in self._busy:
            self._busy.add(key)
            task = asyncio.get_running_loop().create_task(self._run_waiting(key))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run_waiting(self, key: K) -> None:
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
            self._busy.discard(key)
            self._next(key)


def split(values: list[Y], sizes: list[int]) -> list[list[Y]]:
    """``values`` cut into consecutive pieces of ``sizes`` (a group's answers, call by call)."""
    out: list[list[Y]] = []
    at = 0
    for n in sizes:
        out.append(values[at : at + n])
        at += n
    return out
