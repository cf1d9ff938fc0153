"""The broker's rules, shared by every protocol.

The HTTP gateway and the gRPC server are thin adapters over one :class:`Service`: they parse a
request, call a method here and render the result. Every value a client sends is checked here
(with the rules of :mod:`wqbroker.limits`); state transitions and counters live in the store; the
hand-off of tasks to waiting consumers lives in :mod:`wqbroker.dispatch`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from wqbroker import limits
from wqbroker.clock import Clock
from wqbroker.dispatch import Dispatcher, HandOver, Stream
from wqbroker.errors import InvalidArgument, Overloaded, PayloadTooLarge, Unavailable, WqError
from wqbroker.followthrough import Background, follow_through
from wqbroker.models import Delivery, Failure, Stats, Task
from wqbroker.store import Store
from wqbroker.sweeper import Sweeper

log = logging.getLogger("wqbroker.service")

T = TypeVar("T")

AckItem = tuple[object, object]  # (task id, lease id), as the client sent them
NackItem = tuple[object, object, object | None]  # (task id, lease id, error)


class Service:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        *,
        sweep_interval: float = limits.DEFAULT_SWEEP_INTERVAL,
        max_payload: int = limits.DEFAULT_MAX_PAYLOAD,
        max_tasks: int = limits.DEFAULT_MAX_TASKS,
        max_waiters: int = limits.DEFAULT_MAX_WAITERS,
    ) -> None:
        self._store = store
        self._clock = clock
        self.max_payload = max_payload
        self.max_tasks = max_tasks  # 0: no limit
        self._sweeper = Sweeper(clock, sweep_interval, self.sweep)
        self._background = Background()
        self._dispatch = Dispatcher(
            store, clock, self._sweeper.wake_by, self._background, max_waiters=max_waiters
        )
        self._closing = False

    @property
    def store(self) -> Store:
        return self._store

    @property
    def sweeper(self) -> Sweeper:
        return self._sweeper

    @property
    def follows_through(self) -> bool:
        """Operations run to their end when their caller goes away (the store may suspend)."""
        return not self._store.never_suspends

    @property
    def waiting(self) -> int:
        """Consumers with room waiting for a task (long-pollers and streams)."""
        return self._dispatch.waiting

    async def start(self) -> None:
        self._sweeper.start()

    async def close(self) -> None:
        """Answer every parked long-poll (with nothing), end every stream, stop the sweeper."""
        self._closing = True
        await self._dispatch.close()
        await self._sweeper.stop()
        await self._background.wait()

    def problem(self) -> str | None:
        """Why the broker cannot serve (for health checks), or None when it can."""
        if self._closing:
            return "the broker is shutting down"
        return self._store.problem()

    # -- producing ---------------------------------------------------------------------------

    @follow_through
    async def enqueue(
        self,
        payload: bytes | None,
        max_attempts: object | None = None,
        delay_ms: object | None = None,
    ) -> Task:
        """Accept a task. ``payload`` is JSON text (checked here: present, within the size
        limit, valid JSON)."""
        checked = limits.payload_value(payload, self.max_payload)
        attempts = limits.max_attempts_value(max_attempts)
        delay = limits.delay_seconds(delay_ms)
        self._room_for(1)
        task = await self._store.enqueue(
            checked, max_attempts=attempts, delay=delay, now=self._clock.now()
        )
        if delay > 0:
            self._sweeper.wake_by(task.available_at)
        else:
            await self._dispatch.pump()
        return task

    @follow_through
    async def enqueue_many(
        self,
        items: Sequence[tuple[bytes | None, object | None, object | None]],
        *,
        what: str = "tasks",
    ) -> list[Task]:
        """Enqueue (payload, max_attempts, delay_ms) triples, all or none: an invalid one is
        reported as ``{what}[i].field problem`` and nothing is enqueued."""
        limits.batch_size(what, len(items))
        checked = [self._checked_item(item, f"{what}[{i}]") for i, item in enumerate(items)]
        self._room_for(len(checked))
        now = self._clock.now()
        tasks = await self._store.enqueue_many(checked, now=now)
        earliest = min((t.available_at for t in tasks if t.available_at > now), default=None)
        if earliest is not None:
            self._sweeper.wake_by(earliest)
        if any(t.available_at <= now for t in tasks):
            await self._dispatch.pump()
        return tasks

    def _room_for(self, n: int) -> None:
        """Refuse ``n`` more tasks (all of them) if they would take the broker past its limit."""
        held = self._store.held_hint() if self.max_tasks else None
        if held is not None and held + n > self.max_tasks:
            more = "a task" if n == 1 else f"{n} tasks"
            raise Overloaded(
                f"the broker holds {held} tasks and takes at most {self.max_tasks}: "
                f"{more} more would not fit; retry later",
                retry_after=limits.RETRY_AFTER,
            )

    def _checked_item(
        self, item: tuple[bytes | None, object | None, object | None], where: str
    ) -> tuple[bytes, int, float]:
        payload, max_attempts, delay_ms = item
        try:
            return (
                limits.payload_value(payload, self.max_payload),
                limits.max_attempts_value(max_attempts),
                limits.delay_seconds(delay_ms),
            )
        except (InvalidArgument, PayloadTooLarge) as e:
            raise type(e)(f"{where}.{e.message}") from None

    # -- consuming ---------------------------------------------------------------------------

    def claim(
        self,
        wait_ms: object | None = None,
        lease_ms: object | None = None,
        hand_over: HandOver | None = None,
    ) -> Coroutine[Any, Any, Delivery | None]:
        """Claim the oldest ready task, waiting up to ``wait_ms`` for one (None if none came).
        ``hand_over`` writes the answer; if it fails, the task is handed back (see
        :meth:`Dispatcher.claim`). The values are checked at the call."""
        wait = limits.wait_seconds(wait_ms)
        lease = limits.lease_seconds(lease_ms)
        return self._dispatch.claim(wait, lease, hand_over)

    async def next_job(
        self,
        wait_ms: object | None,
        lease_ms: object | None,
        acks: Sequence[AckItem] = (),
        hand_over: HandOver | None = None,
    ) -> tuple[list[WqError | None], Delivery | None]:
        """Ack ``acks`` (each outcome: None or its error), then claim as :meth:`claim` does.
        Everything is checked before anything is done."""
        wait = limits.wait_seconds(wait_ms)
        lease = limits.lease_seconds(lease_ms)
        settled = (await self.settle_many(acks, ()))[0] if acks else []
        return settled, await self._dispatch.claim(wait, lease, hand_over)

    @follow_through
    async def release(self, delivery: Delivery) -> None:
        """Hand back a delivery that never reached a worker (its client disconnected)."""
        await self._dispatch.give_back(delivery)

    async def open_stream(
        self, prefetch: object | None = None, lease_ms: object | None = None
    ) -> Stream:
        if self._closing:
            raise Unavailable("the broker is shutting down")
        count = limits.prefetch_value(prefetch)
        lease = limits.lease_seconds(lease_ms)
        return await self._dispatch.open_stream(count, lease)

    # -- settling ----------------------------------------------------------------------------

    @follow_through
    async def ack(self, task_id: object, lease_id: object) -> None:
        tid, lid = _ack_item((task_id, lease_id))
        await self._store.ack(tid, lid, now=self._clock.now())
        await self._dispatch.finished((lid,))

    @follow_through
    async def nack(self, task_id: object, lease_id: object, error: object | None = None) -> None:
        tid, lid, message = _nack_item((task_id, lease_id, error))
        failure = await self._store.nack(tid, lid, message, now=self._clock.now())
        if failure.retry_at is not None:
            self._sweeper.wake_by(failure.retry_at)
        await self._dispatch.finished((lid,))

    @follow_through
    async def settle_many(
        self, acks: Sequence[AckItem], nacks: Sequence[NackItem]
    ) -> tuple[list[WqError | None], list[WqError | None]]:
        """Acks, then nacks, all at once (one transaction in a durable store). Returns, for each,
        None on success or the error the single call would have raised."""
        limits.batch_size("acks and nacks", len(acks) + len(nacks))
        ack_items, ack_errors = _parse_each(acks, _ack_item)
        nack_items, nack_errors = _parse_each(nacks, _nack_item)
        acked, nacked = await self._store.settle_many(ack_items, nack_items, now=self._clock.now())
        finished = [lid for (_, lid), error in zip(ack_items, acked, strict=True) if error is None]
        for (_, lid, _), result in zip(nack_items, nacked, strict=True):
            if isinstance(result, Failure):
                finished.append(lid)
                if result.retry_at is not None:
                    self._sweeper.wake_by(result.retry_at)
        await self._dispatch.finished(finished)
        nack_outcomes = [r if isinstance(r, WqError) else None for r in nacked]
        return _fill(ack_errors, acked), _fill(nack_errors, nack_outcomes)

    # -- the dead-letter queue, stats, the clock ----------------------------------------------

    async def stats(self) -> Stats:
        return await self._store.stats()

    async def dead_letters(self, limit: object | None = None) -> list[Task]:
        return await self._store.dead_letters(limit=limits.limit_value(limit))

    @follow_through
    async def requeue(self, task_id: object) -> None:
        tid = limits.id_value("id", task_id)
        await self._store.requeue(tid, now=self._clock.now())
        await self._dispatch.pump()

    async def sweep(self) -> float | None:
        """One sweep: reclaim expired leases, promote due delayed tasks, feed waiting consumers.
        Returns when the next thing is due. The sweeper calls this; tests may call it directly."""
        result, next_due = await self._store.sweep(now=self._clock.now())
        if result.reclaimed:
            await self._dispatch.finished(lease_id for _, lease_id in result.reclaimed)
        if result.promoted:
            await self._dispatch.pump()
        return next_due


def _ack_item(item: AckItem) -> tuple[str, str]:
    task_id, lease_id = item
    return limits.id_value("id", task_id), limits.id_value("lease_id", lease_id)


def _nack_item(item: NackItem) -> tuple[str, str, str | None]:
    task_id, lease_id, error = item
    tid, lid = _ack_item((task_id, lease_id))
    return tid, lid, limits.error_value(error)


def _parse_each(
    items: Sequence[tuple[object, ...]], parse: Callable[..., T]
) -> tuple[list[T], list[WqError | None]]:
    """Each item parsed; the ones that parse, and for every item None or why it did not."""
    parsed: list[T] = []
    errors: list[WqError | None] = []
    for item in items:
        try:
            parsed.append(parse(item))
            errors.append(None)
        except WqError as e:
            errors.append(e)
    return parsed, errors


def _fill(errors: list[WqError | None], outcomes: Sequence[WqError | None]) -> list[WqError | None]:
    """The items that parsed (None in ``errors``) take their outcomes, in order."""
    results = iter(outcomes)
    return [error if error is not None else next(results) for error in errors]
