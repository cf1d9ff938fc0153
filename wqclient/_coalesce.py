"""Concurrent one-task enqueues on one client, sent to the broker together."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from wqclient.errors import InvalidArgument, Overloaded, PayloadTooLarge, Unavailable
from wqclient.models import Enqueued, EnqueueItem


class Unbatched(Exception):
    """The broker takes no batches (an older one): nothing of the batch was enqueued, so each
    task goes alone."""


class Coalescer:
    """One-task enqueues made in the same turn of the event loop, sent as one batch.

    Thirty-two coroutines each awaiting ``enqueue()`` in a loop resume together when the batch
    that carried their tasks is answered, and enqueue again in that same turn: their next tasks
    go together again. The broker takes a batch in one call (one commit in a durable store), so
    the cost per task is that of ``enqueue_many``. A call made alone goes alone, a loop turn later
    than it would have (no timer, no waiting for company): as a one-task call, or (``lone_batched``,
    where a batch of one costs less than the one-task call: gRPC's producing stream) as a batch
    of one, sent again as a one-task call if it is refused, for that call's own error.

    A batch is all or nothing at the broker. If one is refused for something a task could cause
    by itself (invalid, too large, or the broker full: :class:`InvalidArgument`,
    :class:`Overloaded`), its tasks are sent again one per call, so that each caller gets the
    answer its own call would have had and a bad task never fails the others. Any other failure
    (the broker unreachable, the token refused) is every caller's answer, as it would have been
    for each of them alone.
    """

    MAX_TASKS: Final = 1000  # per batch
    MAX_BYTES: Final = 256 * 1024  # of payloads per batch, well under the broker's message limit

    def __init__(
        self,
        one: Callable[[EnqueueItem], Awaitable[Enqueued]],
        many: Callable[[Sequence[EnqueueItem]], Awaitable[list[Enqueued]]],
        *,
        lone_batched: bool = False,
    ) -> None:
        self._one = one
        self._many = many
        self._lone_batched = lone_batched
        self._pending: list[tuple[EnqueueItem, asyncio.Future[Enqueued]]] = []
        self._sending: set[asyncio.Task[None]] = set()  # (the loop keeps weak references only)
        self._max_bytes = self.MAX_BYTES

    def add(self, item: EnqueueItem) -> asyncio.Future[Enqueued]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Enqueued] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((item, future))
        return future

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        group: list[tuple[EnqueueItem, asyncio.Future[Enqueued]]] = []
        size = 0
        for entry in pending:
            n = len(entry[0].payload_json)
            if group and (len(group) >= self.MAX_TASKS or size + n > self._max_bytes):
                self._send(group)
                group, size = [], 0
            group.append(entry)
            size += n
        if group:
            self._send(group)

    def _send(self, group: list[tuple[EnqueueItem, asyncio.Future[Enqueued]]]) -> None:
        task = asyncio.get_running_loop().create_task(self._deliver(group))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _deliver(self, group: list[tuple[EnqueueItem, asyncio.Future[Enqueued]]]) -> None:
        if len(group) == 1 and not self._lone_batched:
            await self._alone(*group[0])
            return
        try:
            answers = await self._many([item for item, _ in group])
        except (InvalidArgument, Overloaded, Unbatched) as e:
            if isinstance(e, PayloadTooLarge):  # the batch, not a task: smaller batches
                size = sum(len(item.payload_json) for item, _ in group)
                self._max_bytes = max(1, min(self._max_bytes, size // 2))
            await asyncio.gather(*(self._alone(item, future) for item, future in group))
            return
        except BaseException as e:  # every caller's answer, as it would have been alone
            error = e if isinstance(e, Exception) else Unavailable("the client is closing")
            for _, future in group:
                if not future.done():
                    future.set_exception(error)
            if error is not e:
                raise
            return
        for (_, future), answer in zip(group, answers, strict=True):
            if not future.done():
                future.set_result(answer)

    async def _alone(self, item: EnqueueItem, future: asyncio.Future[Enqueued]) -> None:
        try:
            answer = await self._one(item)
        except BaseException as e:
            error = e if isinstance(e, Exception) else Unavailable("the client is closing")
            if not future.done():
                future.set_exception(error)
            if error is not e:
                raise
            return
        if not future.done():
            future.set_result(answer)
