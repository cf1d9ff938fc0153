"""The broker's rules, shared by every protocol.

The HTTP gateway and the gRPC server are thin adapters over one :class:`Service`: they parse a
request, call a method here and render the result. Every value a client sends is checked here
(with the rules of :mod:`wqbroker.limits`); state transitions and counters live in the store; the
hand-off of tasks to waiting consumers lives in :mod:`wqbroker.dispatch`. What happened is told to
the service's listener (:mod:`wqbroker.events`: the broker's metrics) where the store answered,
and every store call that changes something is timed for it, here or in the dispatcher.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import math
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from wqbroker import limits
from wqbroker.clock import Clock
from wqbroker.dispatch import Dispatcher, HandOver, HandOverMany, Stream
from wqbroker.errors import (
    InvalidArgument,
    LeaseLost,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    Unavailable,
    UnknownParent,
    WqError,
    quoted,
)
from wqbroker.events import Events, timed, timed_if
from wqbroker.followthrough import Background, follow_through
from wqbroker.models import (
    ACKED,
    DEAD,
    DEFAULT_QUEUE,
    SUCCEEDED,
    CancelResult,
    Delivery,
    Enqueued,
    Failure,
    Limits,
    ListKey,
    NackItem,
    NewTask,
    Outcome,
    QueueReport,
    QueueStats,
    Released,
    Schedule,
    Stats,
    SweepResult,
    Task,
    TaskState,
)
from wqbroker.schedules import Rule
from wqbroker.store import CancelListener, ReadyListener, Store
from wqbroker.sweeper import Sweeper

log = logging.getLogger("wqbroker.service")

T = TypeVar("T")

# (task id, lease id), as the client sent them; or (task id, lease id, result): the result's JSON
# text (None: no result), docs/design/results.md.
AckItem = tuple[object, object] | tuple[object, object, bytes | None]
# (task id, lease id, error), or with (delay_ms, terminal) too, as the client sent them
NackRequest = tuple[object, object, object | None] | tuple[object, ...]


@dataclass(slots=True)
class Submission:
    """One task to enqueue, its fields as the client sent them (None: the default)."""

    payload: bytes | None
    max_attempts: object | None = None
    delay_ms: object | None = None
    queue: object | None = None
    priority: object | None = None
    key: object | None = None  # its idempotency key
    expires_in_ms: object | None = None
    timeout_ms: object | None = None
    unique: object | None = None  # the key holds while the task is active
    after: object | None = None  # its parents (docs/design/results.md)
    result_ttl_ms: object | None = None  # how long its result is kept


@dataclass(slots=True)
class ScheduleSubmission:
    """A schedule to put (docs/design/schedules.md), its members as the client sent them (None:
    not given). ``payload``: the task's JSON text."""

    payload: bytes | None
    cron: object | None = None
    timezone: object | None = None
    every_ms: object | None = None
    queue: object | None = None
    priority: object | None = None
    max_attempts: object | None = None
    expires_in_ms: object | None = None
    timeout_ms: object | None = None
    result_ttl_ms: object | None = None
    paused: object | None = None


class _Awaited:
    """The waiters of one task's end (docs/design/results.md): one future they all share, and
    how many wait on it."""

    __slots__ = ("future", "count")

    def __init__(self, future: asyncio.Future[Outcome]) -> None:
        self.future = future
        self.count = 0


class Service:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        *,
        sweep_interval: float = limits.DEFAULT_SWEEP_INTERVAL,
        poll_interval: float = limits.DEFAULT_POLL_INTERVAL,
        max_payload: int = limits.DEFAULT_MAX_PAYLOAD,
        max_tasks: int = limits.DEFAULT_MAX_TASKS,
        max_waiters: int = limits.DEFAULT_MAX_WAITERS,
        dedup_window: float = limits.DEFAULT_DEDUP_WINDOW_MS / 1000,
        max_queues: int = limits.DEFAULT_MAX_QUEUES,
        max_schedules: int = limits.DEFAULT_MAX_SCHEDULES,
        result_ttl: float = limits.DEFAULT_RESULT_TTL_MS / 1000,
        events: Events | None = None,
    ) -> None:
        """``events``: the listener (several: a :class:`~wqbroker.events.Fanout`)."""
        self._store = store
        self._clock = clock
        self._events = events = events if events is not None else Events()
        self.dedup_window = dedup_window  # seconds an idempotency key is remembered
        self.max_payload = max_payload
        self.max_tasks = max_tasks  # 0: no limit
        self.max_queues = max_queues  # 0: no limit
        self.max_schedules = max_schedules  # 0: no limit
        self.result_ttl = result_ttl  # seconds a result is kept, unless a task says
        self.max_waiters = max_waiters
        # Result waiters (docs/design/results.md), by task id.
        self._awaited: dict[str, _Awaited] = {}
        self._result_waiters = 0
        self._sweeper = Sweeper(clock, sweep_interval, self.sweep)
        self._background = Background()
        self._dispatch = Dispatcher(
            store,
            clock,
            self._sweeper.wake_by,
            self._background,
            events,
            max_waiters=max_waiters,
            others=lambda: self._result_waiters,
        )
        self._closing = False
        self._on_close: list[Callable[[], None]] = []
        # A shared store: other brokers make tasks ready too. They say so (on_ready); a poll now
        # and then (in the sweeper's ticks) covers a wake-up that got lost.
        self.poll_interval = poll_interval
        self._next_poll = 0.0
        if isinstance(store, ReadyListener):
            store.on_ready(self._ready_elsewhere)
        if isinstance(store, CancelListener):
            store.on_cancel(self._cancelled_elsewhere)
        store.on_finished(self._finished)
        # Feed waiting consumers after an enqueue or an ack in the background rather than before
        # answering (a shared store: each hand-out is a round trip to the database).
        self._later = store.shared
        # Schedules (docs/design/schedules.md): the earliest next fire time known (the broker's
        # clock; the sweep looks for due ones then, and at its first tick), when it looks anyway
        # (a shared store: another broker may put one sooner), the earliest next fire a change
        # made here while a look was under way (kept by that look), the store's clock less the
        # broker's at the last look (PostgreSQL: the database's), and the rules by what they
        # are written as.
        self._sweep_interval = sweep_interval
        self._schedules_at = 0.0
        self._schedules_poll = math.inf
        self._schedules_changed = math.inf
        self._schedule_skew = 0.0
        self._rules: dict[tuple[str | None, str, float | None], Rule] = {}

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

    @property
    def parked_polls(self) -> int:
        """Long-polling claims waiting now."""
        return self._dispatch.parked

    @property
    def open_streams(self) -> int:
        """Task streams open now."""
        return self._dispatch.streams

    @property
    def result_waiters(self) -> int:
        """Result waits (docs/design/results.md) waiting now."""
        return self._result_waiters

    async def start(self) -> None:
        self._sweeper.start()

    @property
    def closing(self) -> bool:
        return self._closing

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the broker starts shutting down (a protocol's own streams
        end then)."""
        self._on_close.append(callback)

    async def close(self) -> None:
        """Answer every parked long-poll (with nothing), end every stream, stop the sweeper."""
        self._closing = True
        for callback in self._on_close:
            callback()
        for awaited in self._awaited.values():  # (result waiters: still pending)
            if not awaited.future.done():
                awaited.future.cancel()
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
        *,
        queue: object | None = None,
        priority: object | None = None,
        key: object | None = None,
        expires_in_ms: object | None = None,
        timeout_ms: object | None = None,
        unique: object | None = None,
        after: object | None = None,
        result_ttl_ms: object | None = None,
    ) -> Enqueued:
        """Accept a task. ``payload`` is JSON text (checked here: present, within the size
        limit, valid JSON). With an idempotency ``key`` seen in the same queue within the
        window (``unique``: held by a task still ready, delayed or handed out), nothing is
        created and the first task's id comes back as a duplicate. ``expires_in_ms``,
        ``timeout_ms``: see docs/design/control.md; ``after``, ``result_ttl_ms``:
        docs/design/results.md."""
        new = self._checked(
            Submission(
                payload,
                max_attempts,
                delay_ms,
                queue,
                priority,
                key,
                expires_in_ms,
                timeout_ms,
                unique,
                after,
                result_ttl_ms,
            )
        )
        self._room_for((new,))
        now = self._clock.now()
        try:
            done = await timed(self._events, "enqueue", self._store.enqueue_many((new,), now=now))
        except UnknownParent as e:
            raise InvalidArgument(f"after[{e.position}]: {e.message}") from None
        await self._placed(done, (new,))
        return done[0]

    @follow_through
    async def enqueue_many(
        self, items: Sequence[Submission], *, what: str = "tasks"
    ) -> list[Enqueued]:
        """Enqueue submissions, all or none: an invalid one is reported as
        ``{what}[i].field problem`` and nothing is enqueued. Duplicates (by idempotency key)
        are answered per item."""
        limits.batch_size(what, len(items))
        checked = [
            _named(
                # (an ``after`` may name earlier items by index: it is told its own)
                self._checked if item.after is None else functools.partial(self._checked, index=i),
                item,
                f"{what}[{i}]",
            )
            for i, item in enumerate(items)
        ]
        self._room_for(checked)
        now = self._clock.now()
        try:
            done = await timed(self._events, "enqueue", self._store.enqueue_many(checked, now=now))
        except UnknownParent as e:
            raise InvalidArgument(f"{what}[{e.item}].after[{e.position}]: {e.message}") from None
        await self._placed(done, checked)
        return done

    async def _placed(self, done: Sequence[Enqueued], items: Sequence[NewTask]) -> None:
        """New tasks are in the store: wake the sweeper for the delayed, feed consumers. (Which
        are delayed is what was asked, not a comparison of times: a store on the database's
        clock translates its times into the broker's only to within a millisecond or so.)"""
        self._events.enqueued(done)
        earliest = None
        ready: set[str] = set()
        for enqueued, item in zip(done, items, strict=True):
            task = enqueued.task
            if task is None:
                continue
            if task.waiting_for:  # (waiting for its parents: nothing to feed)
                continue
            if item.delay > 0:
                if earliest is None or task.available_at < earliest:
                    earliest = task.available_at
            else:
                ready.add(task.queue)
        if earliest is not None:
            self._sweeper.wake_by(earliest)
        if ready:
            if not self._later:
                await self._dispatch.pump(ready)
            elif self._dispatch.wants(ready):
                # (The answer need not wait for the hand-out: on a shared store that is a
                # round trip to the database.)
                self._background.spawn(self._dispatch.pump(ready))

    def _room_for(self, tasks: Sequence[NewTask]) -> None:
        """Refuse the tasks (all of them) if they would take the broker past its limits of
        tasks or of queues. Duplicates (by idempotency key) take no room."""
        store = self._store
        if self.max_queues:
            # (Each queue named once: a batch's tasks mostly go to one.)
            new = [q for q in dict.fromkeys(t.queue for t in tasks) if store.queue_hint(q) is False]
            if new:
                self._room_for_queues(new)
        n = len(tasks)
        keys: set[tuple[str, str]] = set()
        for t in tasks:
            if t.key is not None:
                if (t.queue, t.key) in keys or store.key_hint(t.queue, t.key, self._clock.now()):
                    n -= 1
                keys.add((t.queue, t.key))
        if n and self.max_tasks:
            self._room_for_tasks(n)

    def _room_for_queues(self, new: Sequence[str]) -> None:
        """Refuse to create the ``new`` queues past the broker's limit."""
        count = self._store.queue_count_hint()
        if self.max_queues and count is not None and count + len(new) > self.max_queues:
            raise Overloaded(
                f"the broker keeps at most {self.max_queues} queues and has {count}: queue "
                f"{quoted(new[0])} would be a new one; use an existing queue",
                retry_after=limits.RETRY_AFTER,
            )

    def _room_for_tasks(self, n: int) -> None:
        held = self._store.held_hint() if self.max_tasks else None
        if held is not None and held + n > self.max_tasks:
            more = "a task" if n == 1 else f"{n} tasks"
            raise Overloaded(
                f"the broker holds {held} tasks and takes at most {self.max_tasks}: "
                f"{more} more would not fit; retry later",
                retry_after=limits.RETRY_AFTER,
            )

    def _checked(self, item: Submission, index: int | None = None) -> NewTask:
        """A submission checked. ``index``: its place in a batch (an ``after`` may name an
        earlier item by its index), None for a lone enqueue."""
        # (Options left to their defaults skip their checks: this runs for every task.)
        key = None if item.key is None else limits.key_value(item.key)
        new = NewTask(
            limits.payload_value(item.payload, self.max_payload),
            limits.DEFAULT_MAX_ATTEMPTS
            if item.max_attempts is None
            else limits.max_attempts_value(item.max_attempts),
            0.0 if item.delay_ms is None else limits.delay_seconds(item.delay_ms),
            DEFAULT_QUEUE if item.queue is None else limits.queue_value(item.queue),
            0 if item.priority is None else limits.priority_value(item.priority),
            key,
            self._clock.now() + self.dedup_window if key is not None else 0.0,
            result_ttl=self.result_ttl,
        )
        if item.after is not None or item.result_ttl_ms is not None:
            new.after = limits.after_value(item.after, index)
            if item.result_ttl_ms is not None:
                new.result_ttl = limits.result_ttl_seconds(item.result_ttl_ms, self.result_ttl)
                new.result_ttl_given = True
        if (
            item.expires_in_ms is not None
            or item.timeout_ms is not None
            or item.unique is not None  # (not falsy: "unique": 0 is refused, not taken as false)
        ):
            self._controlled(new, item)
        return new

    def _controlled(self, new: NewTask, item: Submission) -> None:
        """The options of docs/design/control.md, checked onto ``new``."""
        expires_in = limits.expires_in_seconds(item.expires_in_ms)
        if expires_in is not None:
            new.expires_at = self._clock.now() + expires_in
        new.timeout = limits.timeout_seconds(item.timeout_ms)
        if limits.flag_value("unique", item.unique):
            if new.key is None:
                raise InvalidArgument("unique needs an idempotency key (the key it keeps unique)")
            new.unique = True
            new.key_until = 0.0

    # -- consuming ---------------------------------------------------------------------------

    def claim(
        self,
        wait_ms: object | None = None,
        lease_ms: object | None = None,
        hand_over: HandOver | None = None,
        *,
        queues: object | None = None,
    ) -> Coroutine[Any, Any, Delivery | None]:
        """Claim the next ready task of ``queues`` (see :func:`limits.queues_value`), waiting up
        to ``wait_ms`` for one (None if none came). ``hand_over`` writes the answer; if it
        fails, the task is handed back (see :meth:`Dispatcher.claim`). The values are checked
        at the call."""
        wait = limits.wait_seconds(wait_ms)
        lease = limits.lease_seconds(lease_ms)
        names = limits.queues_value(queues)
        return self._dispatch.claim(wait, lease, hand_over, names)

    def claim_batch(
        self,
        wait_ms: object | None = None,
        lease_ms: object | None = None,
        max_tasks: object | None = None,
        hand_over: HandOverMany | None = None,
        *,
        queues: object | None = None,
    ) -> Coroutine[Any, Any, list[Delivery]]:
        """Claim up to ``max_tasks`` (default 1, at most limits.MAX_CLAIM_BATCH: more is clamped)
        ready tasks of ``queues``, waiting up to ``wait_ms`` for the first one (then taking as
        many as are ready with it). ``hand_over``: as for :meth:`claim`, for all of them."""
        wait = limits.wait_seconds(wait_ms)
        lease = limits.lease_seconds(lease_ms)
        count = limits.claim_count_value(max_tasks)
        names = limits.queues_value(queues)
        return self._dispatch.claim_batch(wait, lease, count, hand_over, names)

    async def next_job(
        self,
        wait_ms: object | None,
        lease_ms: object | None,
        acks: Sequence[AckItem] = (),
        hand_over: HandOver | None = None,
        *,
        queues: object | None = None,
    ) -> tuple[list[WqError | None], Delivery | None]:
        """Ack ``acks`` (each outcome: None or its error), then claim as :meth:`claim` does.
        Everything is checked before anything is done."""
        wait = limits.wait_seconds(wait_ms)
        lease = limits.lease_seconds(lease_ms)
        names = limits.queues_value(queues)
        settled = (await self.settle_many(acks, ()))[0] if acks else []
        return settled, await self._dispatch.claim(wait, lease, hand_over, names)

    @follow_through
    async def give_back(self, delivery: Delivery) -> None:
        """Hand back a delivery that never reached a worker (its client disconnected)."""
        await self._dispatch.give_back(delivery)

    async def open_stream(
        self,
        prefetch: object | None = None,
        lease_ms: object | None = None,
        *,
        queues: object | None = None,
    ) -> Stream:
        if self._closing:
            raise Unavailable("the broker is shutting down")
        count = limits.prefetch_value(prefetch)
        lease = limits.lease_seconds(lease_ms)
        names = limits.queues_value(queues)
        return await self._dispatch.open_stream(count, lease, names)

    async def resize_stream(self, stream: Stream, prefetch: object) -> None:
        """A stream's new prefetch (as for :meth:`open_stream`), from now on."""
        await self._dispatch.resize(stream, limits.prefetch_value(prefetch))

    # -- settling ----------------------------------------------------------------------------

    @follow_through
    async def ack(self, task_id: object, lease_id: object, result: bytes | None = None) -> None:
        """Ack a task; with ``result`` (JSON text, checked here), it is kept, succeeded
        (docs/design/results.md)."""
        tid, lid = _ack_item((task_id, lease_id))
        kept = None if result is None else limits.result_value(result, self.max_payload)
        await timed(
            self._events, "settle", self._store.ack(tid, lid, now=self._clock.now(), result=kept)
        )
        self._events.settled((lid,), ())
        await self._dispatch.finished((lid,), later=self._later)
        released = self._store.take_released()
        if released is not None:
            await self._released(released)

    async def _released(self, released: Released) -> None:
        """Children released by the acks just made (docs/design/results.md): feed consumers
        of their queues, wake the sweeper for the delayed."""
        if released.earliest is not None:
            self._sweeper.wake_by(released.earliest)
        if released.queues:
            if not self._later:
                await self._dispatch.pump(released.queues)
            elif self._dispatch.wants(released.queues):
                self._background.spawn(self._dispatch.pump(released.queues))

    @follow_through
    async def nack(
        self,
        task_id: object,
        lease_id: object,
        error: object | None = None,
        *,
        delay_ms: object | None = None,
        terminal: object | None = None,
    ) -> None:
        """Report a failure: retry on the backoff, or after exactly ``delay_ms``, or (with
        ``terminal``) bury the task now."""
        item = _nack_item((task_id, lease_id, error, delay_ms, terminal))
        failure = await timed(
            self._events,
            "settle",
            self._store.nack(
                item.task_id,
                item.lease_id,
                item.error,
                now=self._clock.now(),
                delay=item.delay,
                terminal=item.terminal,
            ),
        )
        self._events.settled((), (item.lease_id,))
        if failure.retry_at is not None:
            self._sweeper.wake_by(failure.retry_at)
        await self._dispatch.finished((item.lease_id,), later=self._later)
        released = self._store.take_released()  # (a concurrency slot freed: schedules.md)
        if released is not None:
            await self._released(released)

    @follow_through
    async def release(self, task_id: object, lease_id: object) -> None:
        """Its holder hands a task back without counting the attempt (its worker is stopping):
        the task is ready again at the head of its lane, ``attempts`` as before it was handed
        out; a cancelling task is gone (counted cancelled). The store's ``release``, the one
        that undoes a hand-out nobody saw, so its counters are the same: ``delivered`` -1 (it
        counts attempts), nothing else. Refused as a nack is: NotFound, LeaseLost."""
        tid, lid = _ack_item((task_id, lease_id))
        if not await timed(
            self._events, "release", self._store.release(tid, lid, now=self._clock.now())
        ):
            held = await self._store.lookup(tid)
            if held is None or held.state != "handed_out":
                raise NotFound(f"task {quoted(tid)} is not held by anyone")
            raise LeaseLost(f"task {quoted(tid)} is held under a different lease")
        self._events.leases_gone((lid,))
        await self._dispatch.finished((lid,), later=self._later)
        if self._dispatch.wants(None):  # (its queue, to feed a consumer waiting here for it)
            back = await self._store.lookup(tid)
            if back is not None and back.state == "ready":
                if self._later:
                    self._background.spawn(self._dispatch.pump((back.task.queue,)))
                else:
                    await self._dispatch.pump((back.task.queue,))
        released = self._store.take_released()  # (a concurrency slot freed: schedules.md)
        if released is not None:
            await self._released(released)

    @follow_through
    async def settle_many(
        self, acks: Sequence[AckItem], nacks: Sequence[NackRequest], *, strict: bool = False
    ) -> tuple[list[WqError | None], list[WqError | None]]:
        """Acks, then nacks, all at once (one transaction in a durable store). Returns, for each,
        None on success or the error the single call would have raised. ``strict``: one that
        is malformed (not one that is refused: an unknown task, another lease) refuses them
        all, as ``acks[i].field problem``, and nothing is settled."""
        limits.batch_size("acks and nacks", len(acks) + len(nacks))
        results: dict[str, bytes] | None = None
        parse_ack: Callable[[Any], tuple[str, str]] = _ack_item
        if any(len(a) > 2 and a[2] is not None for a in acks):
            # (Acks with results, docs/design/results.md: an ack whose result is refused is
            # refused, as one whose id is.)
            results = {}
            parse_ack = functools.partial(self._ack_with_result, results)
        if strict:
            ack_items = [_named(parse_ack, a, f"acks[{i}]") for i, a in enumerate(acks)]
            nack_items = [_named(_nack_item, n, f"nacks[{i}]") for i, n in enumerate(nacks)]
            ack_errors: list[WqError | None] = [None] * len(acks)
            nack_errors: list[WqError | None] = [None] * len(nacks)
        else:
            ack_items, ack_errors = _parse_each(acks, parse_ack)
            nack_items, nack_errors = _parse_each(nacks, _nack_item)
        # A stream's acks and the claim of their successors, in one transaction (a store that
        # waits for a commit, or the database, saves one per batch); see Dispatcher.refill_for.
        refill = None
        if not self._store.never_suspends:
            lease_ids = [lid for _, lid in ack_items]
            lease_ids += [n.lease_id for n in nack_items]
            refill = self._dispatch.refill_for(lease_ids)
        claimed: list[Delivery] = []
        if refill is None:
            acked, nacked = await timed(
                self._events,
                "settle",
                self._store.settle_many(
                    ack_items, nack_items, now=self._clock.now(), results=results
                ),
            )
        else:
            acked, nacked, claimed = await timed(
                self._events,
                "settle",
                self._store.settle_claim(
                    ack_items,
                    nack_items,
                    # (as many as it will have room for: fewer after its prefetch was lowered)
                    [refill.lease] * min(len(lease_ids), refill.room + len(lease_ids)),
                    now=self._clock.now(),
                    queues=refill.queues,
                    results=results,
                ),
            )
        done = [lid for (_, lid), error in zip(ack_items, acked, strict=True) if error is None]
        failed: list[str] = []
        for item, result in zip(nack_items, nacked, strict=True):
            if isinstance(result, Failure):
                failed.append(item.lease_id)
                if result.retry_at is not None:
                    self._sweeper.wake_by(result.retry_at)
        self._events.settled(done, failed)
        ended = done + failed if failed else done
        if refill is None:
            await self._dispatch.finished(ended, later=self._later)
        else:
            await self._dispatch.refilled(refill, ended, claimed, later=self._later)
        released = self._store.take_released()
        if released is not None:
            await self._released(released)
        nack_outcomes = [r if isinstance(r, WqError) else None for r in nacked]
        return _fill(ack_errors, acked), _fill(nack_errors, nack_outcomes)

    def _ack_with_result(self, results: dict[str, bytes], item: AckItem) -> tuple[str, str]:
        """An ack checked, its result (if any) checked into ``results`` by task id."""
        tid, lid = _ack_item((item[0], item[1]))
        if len(item) > 2 and item[2] is not None:
            kept = limits.result_value(item[2], self.max_payload)
            assert kept is not None
            results[tid] = kept
        return tid, lid

    @follow_through
    async def extend(
        self,
        task_id: object,
        lease_id: object,
        lease_ms: object | None = None,
        *,
        progress: bytes | None = None,
    ) -> float:
        """Extend a lease: the new deadline (returned, epoch seconds) is now + ``lease_ms``
        (default and cap as for claims; never past the task's time limit). ``progress``: JSON
        text to record on the task. Cancelled if the task was cancelled, TimeLimitReached at
        its limit."""
        tid, lid = _ack_item((task_id, lease_id))
        lease = limits.lease_seconds(lease_ms)
        report = limits.progress_value(progress)
        deadline = await timed(
            self._events,
            "extend",
            self._store.extend(tid, lid, lease=lease, now=self._clock.now(), progress=report),
        )
        self._sweeper.wake_by(deadline)  # a shortened lease is reclaimed at its new deadline
        return deadline

    # -- control over tasks (docs/design/control.md) ------------------------------------------

    @follow_through
    async def cancel(self, task_id: object) -> CancelResult:
        """Cancel a task: a ready or delayed one is gone, a handed-out one cancelling (its holder
        told, on a stream at once), a dead one purged. NotFound for an unknown task."""
        tid = limits.id_value("id", task_id)
        result = await timed(self._events, "cancel", self._store.cancel(tid, now=self._clock.now()))
        if result.lease_id is not None:
            self._dispatch.cancelled((result.lease_id,))
        return result

    def _cancelled_elsewhere(self, lease_ids: Iterable[str]) -> None:
        """Another broker made tasks cancelling: tell the streams of ours that hold them."""
        self._dispatch.cancelled(lease_ids)

    async def list_tasks(
        self,
        queue: object | None = None,
        state: object | None = None,
        limit: object | None = None,
        cursor: object | None = None,
    ) -> tuple[list[TaskState], str | None]:
        """A page of a queue's tasks in one state, and the cursor of the next page (None at the
        end)."""
        name = limits.queue_value(queue)
        which = limits.list_state_value(state)
        count = limits.list_limit_value(limit)
        after = None if cursor is None or cursor == "" else decode_cursor(cursor, which)
        page = await self._store.list_tasks(name, which, limit=count, after=after)
        return page.tasks, None if page.after is None else encode_cursor(which, page.after)

    @follow_through
    async def empty_queue(self, queue: object) -> int:
        """Cancel every ready and delayed task of a queue: how many. NotFound if unknown."""
        name = limits.queue_value(queue)
        return await timed(
            self._events, "cancel", self._store.empty_queue(name, now=self._clock.now())
        )

    @follow_through
    async def delete_queue(self, queue: object) -> None:
        """Forget a queue that holds nothing. NotFound if unknown, Conflict if it holds tasks."""
        name = limits.queue_value(queue)
        await timed(self._events, "queue", self._store.delete_queue(name))

    # -- looking, the dead-letter queue, queues, stats, the clock -----------------------------

    async def lookup(self, task_id: object) -> TaskState:
        """A task and its state; NotFound once acked or purged, or if never known."""
        tid = limits.id_value("id", task_id)
        found = await self._store.lookup(tid)
        if found is None:
            raise NotFound(f"task {quoted(tid)} does not exist (or was acked)")
        return found

    async def children(self, task_id: object) -> tuple[list[str], int]:
        """The first few live children of a task (docs/design/results.md) and how many."""
        tid = limits.id_value("id", task_id)
        return await self._store.children(tid, limit=limits.MAX_CHILDREN_SHOWN)

    # -- results (docs/design/results.md) ---------------------------------------------------

    async def wait_result(self, task_id: object, wait_ms: object | None = None) -> Outcome | None:
        """How a task ended: at once if it has (succeeded with its result kept, or dead), else
        once it does within ``wait_ms`` (default 0, cap 30 s); None if it is still pending then.
        NotFound for an unknown task, or one gone (its result pruned)."""
        tid = limits.id_value("id", task_id)
        wait = limits.result_wait_seconds(wait_ms)
        if wait > 0 and not self._awaited.get(tid):
            self._room_for_waiter()
        found = await self._store.watch(tid)
        done = _outcome(found)
        if done is not None or wait <= 0:
            return done
        if self._closing:
            return None
        awaited = self._awaited.get(tid)
        if awaited is None:
            future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
            awaited = self._awaited[tid] = _Awaited(future)
        awaited.count += 1
        self._result_waiters += 1
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self._clock.call_at(self._clock.now() + wait, lambda: _wake(mine))
        awaited.future.add_done_callback(lambda _: _wake(mine))
        try:
            await mine
        finally:
            timer.cancel()
            self._result_waiters -= 1
            awaited.count -= 1
            if not awaited.count and self._awaited.get(tid) is awaited:
                del self._awaited[tid]
        if awaited.future.done() and not awaited.future.cancelled():
            return awaited.future.result()
        return None

    def _room_for_waiter(self) -> None:
        if self.max_waiters and self._dispatch.waiting + self._result_waiters >= self.max_waiters:
            raise Overloaded(
                f"the broker holds at most {self.max_waiters} waiting consumers and result "
                "waiters: retry later",
                retry_after=limits.RETRY_AFTER,
            )

    def _finished(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Watched tasks ended (on this broker or another): answer their waiters, looking a
        succeeded or dead one up once for all of them."""
        if not self._awaited:
            return
        now = self._clock.now()
        for tid, state in pairs:
            awaited = self._awaited.get(tid)
            if awaited is None or awaited.future.done():
                continue
            if state == SUCCEEDED or state == DEAD:
                self._background.spawn(self._answer(tid, state, awaited))
            else:
                outcome_state = SUCCEEDED if state == ACKED else state
                awaited.future.set_result(Outcome(tid, outcome_state, finished_at=now))

    async def _answer(self, tid: str, state: str, awaited: _Awaited) -> None:
        """Answer the waiters of a task that succeeded or died, from one look at it."""
        try:
            found = await self._store.lookup(tid)
        except WqError:
            found = None
        outcome = _outcome(found) if found is not None else None
        if outcome is None and state == SUCCEEDED:  # (pruned meanwhile: it did succeed)
            outcome = Outcome(tid, state, finished_at=self._clock.now())
        # (A dead one requeued meanwhile runs again: its waiters wait on, to the end of theirs.)
        if outcome is not None and not awaited.future.done():
            awaited.future.set_result(outcome)

    async def stats(self, queue: object | None = None) -> Stats:
        """The whole broker's gauges and totals, or one queue's."""
        name = None if queue is None else limits.queue_value(queue)
        return await self._store.stats(name)

    async def queues(self) -> list[QueueStats]:
        """Every queue known, by name (its limits and rate tokens now, if it has limits)."""
        return await self._store.queues(now=self._clock.now())

    async def queue_report(self) -> list[QueueReport]:
        """Every queue with its gauges, totals and oldest ready task (for monitoring)."""
        return await self._store.queue_report(now=self._clock.now())

    async def dead_letters(
        self, limit: object | None = None, *, queue: object | None = None
    ) -> list[Task]:
        name = None if queue is None else limits.queue_value(queue)
        return await self._store.dead_letters(limit=limits.limit_value(limit), queue=name)

    @follow_through
    async def requeue(self, task_id: object) -> None:
        tid = limits.id_value("id", task_id)
        queue = await timed(
            self._events, "requeue", self._store.requeue(tid, now=self._clock.now())
        )
        await self._dispatch.pump((queue,))

    @follow_through
    async def requeue_all(self, queue: object | None = None) -> int:
        """Requeue every dead task (of one queue); how many."""
        name = None if queue is None else limits.queue_value(queue)
        count, queues = await timed(
            self._events, "requeue", self._store.requeue_all(queue=name, now=self._clock.now())
        )
        await self._dispatch.pump(queues)
        return count

    @follow_through
    async def purge(self, task_id: object) -> None:
        """Drop a dead task for good."""
        tid = limits.id_value("id", task_id)
        await timed(self._events, "purge", self._store.purge(tid))

    @follow_through
    async def pause(self, queue: object) -> None:
        """Hand out no task of the queue (it still takes tasks) until it is resumed."""
        name = limits.queue_value(queue)
        if self._store.queue_hint(name) is False:
            self._room_for_queues((name,))
        await timed(self._events, "pause", self._store.set_paused(name, True))

    @follow_through
    async def resume(self, queue: object) -> None:
        name = limits.queue_value(queue)
        if self._store.queue_hint(name) is False:
            self._room_for_queues((name,))
        await timed(self._events, "pause", self._store.set_paused(name, False))
        await self._dispatch.pump((name,))

    # -- schedules and limits (docs/design/schedules.md) -------------------------------------

    @follow_through
    async def put_schedule(self, name: object, sub: ScheduleSubmission) -> Schedule:
        """Create or replace a schedule; InvalidArgument naming the member for a bad one. A new
        one (or one put with another rule, or resumed by the put) fires first at its rule's
        first time after now; one put with the same rule keeps its next fire time; one the
        same as stored (rule, task, paused) is left as it stands."""
        checked = limits.schedule_value(limits.schedule_name_value(name), sub, self.max_payload)
        rule = self._rule(checked.cron, checked.timezone, checked.every)
        now = self._clock.now()
        checked.created_at = checked.updated_at = now
        if not checked.paused:
            checked.next_fire_at = rule.next_after(now + self._schedule_skew)
        await self._room_for_schedule(checked.name)
        stored = await timed(self._events, "schedule", self._store.put_schedule(checked, now=now))
        self._schedule_changed(stored)
        return stored

    async def get_schedule(self, name: object) -> Schedule:
        """NotFound if there is none of that name."""
        checked = limits.schedule_name_value(name)
        found = await self._store.get_schedule(checked)
        if found is None:
            raise _no_schedule(checked)
        return found

    async def list_schedules(self) -> list[Schedule]:
        """Every schedule, by name."""
        return await self._store.list_schedules()

    @follow_through
    async def delete_schedule(self, name: object) -> None:
        """NotFound if there is none of that name."""
        checked = limits.schedule_name_value(name)
        if not await timed(self._events, "schedule", self._store.delete_schedule(checked)):
            raise _no_schedule(checked)

    @follow_through
    async def pause_schedule(self, name: object) -> Schedule:
        """No fire until it is resumed (its next fire time is forgotten). NotFound if there is
        none of that name; one paused already is left as it stands."""
        checked = limits.schedule_name_value(name)
        now = self._clock.now()
        paused = await timed(
            self._events,
            "schedule",
            self._store.set_schedule_paused(checked, True, None, now=now),
        )
        if paused is None:
            raise _no_schedule(checked)
        return paused

    @follow_through
    async def resume_schedule(self, name: object) -> Schedule:
        """Fire again, first at the rule's first time after now (the times it was paused over
        are not fired). NotFound if there is none of that name; one not paused is left as it
        stands."""
        checked = limits.schedule_name_value(name)
        found = await self._store.get_schedule(checked)
        if found is None:
            raise _no_schedule(checked)
        if not found.paused:
            return found
        now = self._clock.now()
        rule = self._rule(found.cron, found.timezone, found.every)
        resumed = await timed(
            self._events,
            "schedule",
            self._store.set_schedule_paused(
                checked, False, rule.next_after(now + self._schedule_skew), now=now
            ),
        )
        if resumed is None:
            raise _no_schedule(checked)
        self._schedule_changed(resumed)
        return resumed

    async def _room_for_schedule(self, name: str) -> None:
        """Refuse a new schedule past the broker's limit (a replace always has room). (Puts are
        rare: the store is asked, rather than a count kept here that other brokers change.)"""
        if not self.max_schedules or await self._store.get_schedule(name) is not None:
            return
        count = await self._store.schedule_count()
        if count >= self.max_schedules:
            raise Overloaded(
                f"the broker keeps at most {self.max_schedules} schedules and has {count}: "
                f"schedule {quoted(name)} would be a new one; delete one, or replace one",
                retry_after=limits.RETRY_AFTER,
            )

    def _rule(self, cron: str | None, timezone: str, every: float | None) -> Rule:
        """The rule written so (parsed once: the sweep asks for it at every fire)."""
        key = (cron, timezone, every)
        rule = self._rules.get(key)
        if rule is None:
            if len(self._rules) >= _RULES_KEPT:
                self._rules.clear()
            rule = self._rules[key] = Rule.parse(cron, timezone, every)
        return rule

    def _schedule_changed(self, schedule: Schedule) -> None:
        """A schedule was put or resumed here: the sweep looks for due ones by its next fire
        time (also if a look is under way: see _fire_schedules)."""
        if schedule.paused or schedule.next_fire_at is None:
            return
        at = schedule.next_fire_at - self._schedule_skew
        self._schedules_changed = min(self._schedules_changed, at)
        self._schedules_at = min(self._schedules_at, at)
        self._sweeper.wake_by(at)  # (nothing if a tick is planned before it)

    def _schedules_due(self, now: float) -> bool:
        """Whether the sweep at ``now`` looks for due schedules."""
        return now >= self._schedules_at or now >= self._schedules_poll

    async def _fire_schedules(self, now: float) -> None:
        """Fire the due schedules (docs/design/schedules.md): each a compare-and-set in the
        store, together (a store that commits in groups commits them as one); then set when to
        look next: at the earliest next fire time known (on a shared store, within a sweep
        interval too: another broker may put one sooner). A fire that failed (the store away)
        is tried again at the next tick, the others go on; the first error is raised once they
        are done (the sweeper says it, once)."""
        self._schedules_changed = math.inf
        self._schedules_poll = now + self._sweep_interval if self._store.shared else math.inf
        store_now, due, later = await self._store.due_schedules(now)
        skew = self._schedule_skew = store_now - now
        at = math.inf if later is None else later - skew
        error: BaseException | None = None
        for start in range(0, len(due), _FIRES_AT_ONCE):
            chunk = due[start : start + _FIRES_AT_ONCE]
            fired = await asyncio.gather(
                *(self._fire(s, store_now, now) for s in chunk), return_exceptions=True
            )
            for outcome in fired:
                if isinstance(outcome, asyncio.CancelledError):
                    raise outcome
                if isinstance(outcome, BaseException):
                    error = error or outcome
                    at = min(at, now + self._sweep_interval)  # (again at the next tick)
                elif outcome is None:  # (changed meanwhile, or fired by another broker)
                    self._schedules_poll = min(self._schedules_poll, now + self._sweep_interval)
                else:
                    at = min(at, outcome - skew)
        self._schedules_at = min(at, self._schedules_changed)
        if error is not None:
            raise error

    async def _fire(self, schedule: Schedule, store_now: float, now: float) -> float | None:
        """One due schedule's fire: its task enqueued and its next fire time moved on, in one
        compare-and-set (None: it was not as read, nothing done); the next fire time. A fire
        whose task the broker's limits refuse (the task or queue limit, a payload larger than
        -max-body allows now) only moves on, logged and told as failed."""
        expected = schedule.next_fire_at
        assert expected is not None
        rule = self._rule(schedule.cron, schedule.timezone, schedule.every)
        scheduled, following = rule.due(expected, store_now)
        late = max(0.0, store_now - scheduled)
        new = self._fired_task(schedule, scheduled, now)
        store = self._store
        try:
            if len(new.payload) > self.max_payload:
                raise PayloadTooLarge(
                    f"payload is larger than the limit of {self.max_payload} bytes"
                )
            self._room_for((new,))
        except WqError as e:
            moved = await timed(
                self._events,
                "schedule",
                store.skip_schedule(schedule.name, expected, following, revision=schedule.revision),
            )
            if not moved:
                return None
            log.warning(
                "schedule %s: its fire for %s enqueued nothing: %s",
                quoted(schedule.name),
                _when(scheduled),
                e.message,
                extra={"schedule": schedule.name, "queue": new.queue},
            )
            self._events.fired(schedule.name, late, failed=True)
            return following
        done = await timed(
            self._events,
            "schedule",
            store.fire_schedule(
                schedule.name,
                expected,
                scheduled,
                following,
                new,
                now=now,
                revision=schedule.revision,
            ),
        )
        if done is None:
            return None
        self._events.fired(schedule.name, late)
        await self._placed((done,), (new,))
        return following

    def _fired_task(self, schedule: Schedule, scheduled: float, now: float) -> NewTask:
        """The task a fire enqueues: the schedule's task members, as an enqueue would take
        them (the broker's result TTL unless it gives one; its expiry counted from the fire)."""
        task = schedule.task
        new = NewTask(
            task.payload,
            task.max_attempts,
            0.0,
            task.queue,
            task.priority,
            result_ttl=self.result_ttl if task.result_ttl is None else task.result_ttl,
            result_ttl_given=task.result_ttl is not None,
            schedule=schedule.name,
            scheduled_for=scheduled,
        )
        if task.expires_in is not None:
            new.expires_at = now + task.expires_in
        new.timeout = task.timeout
        return new

    @follow_through
    async def set_limits(
        self, queue: object, rate: object | None, concurrency: object | None
    ) -> Limits | None:
        """Set a queue's limits: ``rate`` the JSON object ``{"tasks", "per_ms", "burst"}`` as
        received (None: no rate limit), ``concurrency`` an int (None: no limit). Both None
        clears them. Returns the limits in force (None: none). An unknown queue is created (as
        a pause creates it: within -max-queues)."""
        name = limits.queue_value(queue)
        checked = limits.limits_value(rate, concurrency)
        await self._put_limits(name, checked)
        return checked

    @follow_through
    async def clear_limits(self, queue: object) -> None:
        """No limits on the queue from now on (an unknown queue is created, as by set_limits)."""
        await self._put_limits(limits.queue_value(queue), None)

    async def _put_limits(self, name: str, checked: Limits | None) -> None:
        if self._store.queue_hint(name) is False:
            self._room_for_queues((name,))
        await timed(
            self._events,
            "queue",
            self._store.set_limits(name, checked, now=self._clock.now()),
        )
        # A limit raised or cleared may let the consumers waiting for the queue take tasks now
        # (one lowered: the pump finds nothing more to take).
        await self._dispatch.pump((name,))

    def _ready_elsewhere(self, queues: Iterable[str] | None) -> None:
        """Tasks became ready in ``queues`` (None: any) without this broker's doing: feed the
        consumers waiting for them, if any."""
        if not self._closing and self._dispatch.wants(queues):
            self._background.spawn(self._dispatch.pump(queues))

    async def sweep(self) -> float | None:
        """One sweep: reclaim expired leases, promote due delayed tasks, feed waiting consumers
        (on a shared store, also look for ready tasks now and then), fire the due schedules
        when one may be due (docs/design/schedules.md). Returns when the next thing is due (a
        schedule's next fire among them). The sweeper calls this; tests may call it directly."""
        now = self._clock.now()
        if self._store.shared and now >= self._next_poll:
            self._next_poll = now + self.poll_interval
            if self._dispatch.wants(None):
                self._background.spawn(self._dispatch.pump(None))
        result, next_due = await timed_if(
            _swept_something, self._events, "sweep", self._store.sweep(now=now)
        )
        if result.reclaimed:
            gone = [lease_id for _, lease_id in result.reclaimed]
            self._events.leases_gone(gone)
            await self._dispatch.finished(gone)
            # (a lease of a concurrency-limited queue ran out: a slot is free again)
            await self._dispatch.take_released()
        if result.ready_queues:
            await self._dispatch.pump(result.ready_queues)
        if self._schedules_due(now):
            await self._fire_schedules(now)
        if self._schedules_at < math.inf and (next_due is None or self._schedules_at < next_due):
            next_due = self._schedules_at
        return next_due


# Schedules fired together (the store's calls under way at once), and rules kept parsed.
_FIRES_AT_ONCE: Final = 64
_RULES_KEPT: Final = 1024


def _no_schedule(name: str) -> NotFound:
    return NotFound(f"schedule {quoted(name)} does not exist")


def _when(t: float) -> str:
    """An epoch time in logs: RFC 3339, UTC, to the millisecond."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _swept_something(swept: tuple[SweepResult, float | None]) -> bool:
    """Whether a sweep changed the store (most find nothing due: no commit to time)."""
    result, _ = swept
    return bool(result.reclaimed or result.promoted or result.expired or result.pruned)


def _outcome(found: TaskState) -> Outcome | None:
    """How a task ended, if it has (succeeded with its result kept, or dead); None if pending."""
    task = found.task
    if found.state == SUCCEEDED:
        return Outcome(task.id, SUCCEEDED, task.result, task.finished_at, attempts=task.attempts)
    if found.state == DEAD:
        return Outcome(task.id, DEAD, last_error=task.last_error, attempts=task.attempts)
    return None


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _ack_item(item: AckItem) -> tuple[str, str]:
    task_id, lease_id = item[0], item[1]
    return limits.id_value("id", task_id), limits.id_value("lease_id", lease_id)


def _nack_item(item: NackRequest) -> NackItem:
    task_id, lease_id, error, *options = item
    tid, lid = _ack_item((task_id, lease_id))
    delay_ms, terminal = (*options, None, None)[:2]
    delay = limits.retry_delay_seconds(delay_ms)
    bury = limits.flag_value("terminal", terminal)
    if bury and delay is not None:
        raise InvalidArgument(
            "terminal and delay_ms cannot both be given: a buried task is not retried"
        )
    return NackItem(tid, lid, limits.error_value(error), delay, bury)


def _named(parse: Callable[[Any], T], item: object, where: str) -> T:
    """``parse(item)``, its refusal naming where the item is (``acks[2].id must be ...``)."""
    try:
        return parse(item)
    except (InvalidArgument, PayloadTooLarge) as e:
        raise type(e)(f"{where}.{e.message}") from None


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


# -- listing cursors ------------------------------------------------------------------------------

_CURSOR_MAX: Final = 200  # characters: a cursor is a state and at most three numbers


def encode_cursor(state: str, key: ListKey) -> str:
    """The cursor text of a page's end: URL-safe base64 of ``[state, key...]`` as JSON."""
    raw = json.dumps([state, *key], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: object, state: str) -> ListKey:
    """A listing key from cursor text this broker made, for ``state``; InvalidArgument naming
    ``cursor`` otherwise."""
    if not isinstance(cursor, str):
        raise InvalidArgument(f"cursor must be a string, got {limits.describe(cursor)}")
    bad = InvalidArgument("cursor is not one this broker gave (pass next_cursor as it came)")
    if len(cursor) > _CURSOR_MAX or not cursor.isascii():
        raise bad
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad from None
    if (
        not isinstance(value, list)
        or not 2 <= len(value) <= 4
        or not isinstance(value[0], str)
        or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            for x in value[1:]
        )
    ):
        raise bad
    if value[0] != state:
        raise InvalidArgument(
            f"cursor is for state {value[0]!r}, not {state!r} (a cursor goes with its state)"
        )
    return tuple(value[1:])
