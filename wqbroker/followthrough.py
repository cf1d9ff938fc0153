"""Keeping an operation going when its caller goes away.

A client that disconnects cancels the request that serves it. With a store whose calls suspend
(it waits for a commit), the cancellation can land half-way through an operation: the store has
changed, but what must follow (feeding a parked consumer, freeing a stream's slot, handing back a
task nobody saw) would never happen. An operation marked :func:`follow_through` runs as a task of
its own that the caller's cancellation cannot reach; the caller still stops waiting at once.
With a store that never suspends nothing can be cut short, and the method runs as it is (no extra
task, no extra frame).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class CanBeCutShort(Protocol):
    @property
    def follows_through(self) -> bool:
        """True when its operations may suspend, and so must be run to their end."""
        ...


S = TypeVar("S", bound=CanBeCutShort)


def follow_through(
    method: Callable[Concatenate[S, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """Run the method to its end even if its caller is cancelled half-way."""

    @functools.wraps(method)
    def run(owner: S, /, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        operation = method(owner, *args, **kwargs)
        if not owner.follows_through:
            return operation
        return run_to_end(operation)

    return run


async def run_to_end(operation: Coroutine[Any, Any, R]) -> R:
    """Await ``operation`` as a task a cancellation of the caller does not cancel."""
    task = asyncio.get_running_loop().create_task(operation)
    task.add_done_callback(_outcome_seen)
    return await asyncio.shield(task)


def _outcome_seen(task: asyncio.Task[Any]) -> None:
    # The caller may have gone: fetch the outcome so asyncio does not report it as unretrieved.
    if not task.cancelled():
        task.exception()


class Background:
    """Tasks started for work nobody waits for (handing back a task after a disconnect); they are
    awaited when the broker closes."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
