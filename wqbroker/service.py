"""The broker's rules, shared by every protocol.

The HTTP gateway and the gRPC server are thin adapters over one :class:`Service`: they parse a
request, call a method here and render the result. Defaults, caps, validation and the hand-off of
tasks to waiting consumers all live here (state transitions and counters live in the store).

Consumers are whatever waits for tasks: a long-polling claim (room for one task) or a stream (room
for up to its prefetch of unfinished tasks). Consumers with room wait in one queue, served first
come, first served; a stream that still has room after receiving a task goes to the back of the
queue, so streams and long-pollers share ready tasks fairly.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

from wqbroker.clock import Clock
from wqbroker.errors import InvalidArgument, Unavailable, WqError
from wqbroker.models import Delivery, Stats, Task
from wqbroker.store import Store
from wqbroker.sweeper import Sweeper

log = logging.getLogger("wqbroker.service")

# The spec's defaults and caps.
DEFAULT_MAX_ATTEMPTS: Final = 3
DEFAULT_WAIT_MS: Final = 20_000
MAX_WAIT_MS: Final = 30_000
DEFAULT_LEASE_MS: Final = 30_000
MAX_LEASE_MS: Final = 300_000
DEFAULT_SWEEP_INTERVAL: Final = 0.25

# Our own limits on values the spec leaves open (documented in the README and the .proto).
MAX_MAX_ATTEMPTS: Final = 2**31 - 1
MAX_DELAY_MS: Final = 365 * 24 * 3600 * 1000  # a year
MAX_PREFETCH: Final = 10_000

RECLAIM_STREAM_ENDED: Final = "worker stream ended"

# How many tasks the hand-off claims from the store in one call (one commit in a durable store).
_PUMP_BATCH: Final = 128


def _integer(name: str, value: object) -> int:
    # bool is an int subclass in Python; JSON true/false is not a number.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {_describe(value)}")
    return value


def _describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def max_attempts_value(value: object | None) -> int:
    if value is None:
        return DEFAULT_MAX_ATTEMPTS
    n = _integer("max_attempts", value)
    if n < 1:
        raise InvalidArgument(f"max_attempts must be at least 1, got {n}")
    if n > MAX_MAX_ATTEMPTS:
        raise InvalidArgument(f"max_attempts must be at most {MAX_MAX_ATTEMPTS}, got {n}")
    return n


def delay_seconds(value: object | None) -> float:
    if value is None:
        return 0.0
    n = _integer("delay_ms", value)
    if n < 0:
        raise InvalidArgument(f"delay_ms must not be negative, got {n}")
    if n > MAX_DELAY_MS:
        raise InvalidArgument(f"delay_ms must be at most {MAX_DELAY_MS} (a year), got {n}")
    return n / 1000.0


def _capped_ms(name: str, value: object | None, default: int, minimum: int, cap: int) -> float:
    """A duration in ms: ``default`` when absent, at least ``minimum``, clamped to ``cap`` (the
    spec clamps values above a cap rather than refusing them). Returns seconds."""
    if value is None:
        return default / 1000.0
    n = _integer(name, value)
    if n < minimum:
        rule = "must not be negative" if minimum == 0 else f"must be at least {minimum}"
        raise InvalidArgument(f"{name} {rule}, got {n}")
    return min(n, cap) / 1000.0


def wait_seconds(value: object | None) -> float:
    """``wait_ms``: default 20 s, values above 30 s are clamped to 30 s."""
    return _capped_ms("wait_ms", value, DEFAULT_WAIT_MS, 0, MAX_WAIT_MS)


def lease_seconds(value: object | None) -> float:
    """``lease_ms``: default 30 s, at least 1 ms, values above 5 min are clamped to 5 min."""
    return _capped_ms("lease_ms", value, DEFAULT_LEASE_MS, 1, MAX_LEASE_MS)


def prefetch_value(value: object | None) -> int:
    if value is None:
        return 1
    n = _integer("prefetch", value)
    if n < 1:
        raise InvalidArgument(f"prefetch must be at least 1, got {n}")
    return min(n, MAX_PREFETCH)


def error_value(value: object | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise InvalidArgument(f"error must be a string, got {_describe(value)}")


def id_value(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {_describe(value)}")
    if not value:
        raise InvalidArgument(f"{name} is required")
    return value


P = ParamSpec("P")
R = TypeVar("R")


def _follow_through(
    method: Callable[Concatenate[Service, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[Service, P], Coroutine[Any, Any, R]]:
    """Run an operation to its end even if its caller is cancelled half-way (a client that goes
    away while a durable store commits): what it changed in the store must be followed through,
    a waiting consumer fed or a stream's slot freed. Only a store whose calls suspend needs it."""

    @functools.wraps(method)
    def run(service: Service, /, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        operation = method(service, *args, **kwargs)
        if service._store.never_suspends:
            return operation  # nothing can cut it short: no extra task, no extra frame
        return _to_the_end(operation)

    return run


async def _to_the_end(operation: Coroutine[Any, Any, R]) -> R:
    task = asyncio.get_running_loop().create_task(operation)
    task.add_done_callback(_outcome_seen)
    return await asyncio.shield(task)


def _outcome_seen(task: asyncio.Task[Any]) -> None:
    # The caller may have gone: fetch the outcome so asyncio does not report it as unretrieved.
    if not task.cancelled():
        task.exception()


class Consumer:
    """Something waiting for deliveries."""

    __slots__ = ("lease", "room", "closed")

    def __init__(self, lease: float, room: int) -> None:
        self.lease = lease
        self.room = room  # how many more tasks it can take now
        self.closed = False

    def _gone(self) -> bool:
        """True once it can take no more deliveries."""
        return self.closed

    def _deliver(self, delivery: Delivery) -> None:
        raise NotImplementedError

    def _shutdown(self) -> None:
        """The broker is stopping."""
        raise NotImplementedError


class _Poller(Consumer):
    """One long-polling claim."""

    __slots__ = ("future",)

    def __init__(self, lease: float, future: asyncio.Future[Delivery | None]) -> None:
        super().__init__(lease, 1)
        self.future = future

    def _gone(self) -> bool:
        # Its future is done once it timed out or its caller was cancelled (client disconnected),
        # which may be a moment before the caller gets to run and set ``closed``.
        return self.closed or self.future.done()

    def _deliver(self, delivery: Delivery) -> None:
        self.closed = True
        self.future.set_result(delivery)

    def _shutdown(self) -> None:
        self.closed = True
        if not self.future.done():
            self.future.set_result(None)


class Stream(Consumer):
    """Tasks pushed to a worker as soon as they are ready, never more than ``prefetch`` unfinished.

    ``await stream.next()`` returns the next delivery, or None once the stream is closed. A task is
    finished when it is acked or nacked (over any protocol) or its lease is reclaimed; each finished
    task frees a slot. Closing the stream releases the tasks it was given but never passed on and
    reclaims the ones it passed on and that are still unfinished.
    """

    __slots__ = ("prefetch", "draining", "_service", "_pending", "_waiter", "_sent")

    def __init__(self, service: Service, prefetch: int, lease: float) -> None:
        super().__init__(lease, prefetch)
        self.prefetch = prefetch
        self.draining = False
        self._service = service
        self._pending: deque[Delivery] = deque()  # pushed to us, not yet taken by next()
        self._waiter: asyncio.Future[None] | None = None
        self._sent: dict[str, str] = {}  # lease_id -> task_id, taken by next() and unfinished

    def _deliver(self, delivery: Delivery) -> None:
        self._pending.append(delivery)
        self.poke()

    def _shutdown(self) -> None:
        self.closed = True
        self.poke()

    async def wait(self) -> None:
        """Return once a delivery is waiting, the stream is closed, or ``poke()`` was called."""
        if self._pending or self.closed:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def poke(self) -> None:
        """Wake ``wait()`` (used by a protocol adapter that has something else to send)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self) -> Delivery | None:
        """The next delivery, waiting for one; None once the stream is closed."""
        while True:
            await self.wait()
            if self.closed:
                return None
            taken = self.take_ready(limit=1)
            if taken:
                return taken[0]

    def take_ready(self, limit: int | None = None) -> list[Delivery]:
        """Deliveries already waiting (up to ``limit``), without blocking; they count as sent."""
        out: list[Delivery] = []
        if self.closed:
            return out
        current = self._service._stream_leases
        pending = self._pending
        while pending and (limit is None or len(out) < limit):
            delivery = pending.popleft()
            if current.get(delivery.lease_id) is not self:
                continue  # reclaimed (its lease ran out) before the worker took it
            self._sent[delivery.lease_id] = delivery.task.id
            out.append(delivery)
        return out

    async def drain(self) -> None:
        """Take no new tasks; the ones queued here but not yet taken go back to ready."""
        await self._service._drain_stream(self)

    async def close(self) -> None:
        await self._service._close_stream(self)


class Service:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        *,
        sweep_interval: float = DEFAULT_SWEEP_INTERVAL,
    ) -> None:
        self._store = store
        self._clock = clock
        self._sweeper = Sweeper(clock, sweep_interval, self._tick)
        # Consumers with room, in the order they are to be served. An OrderedDict is a queue with
        # O(1) removal from the middle (a long-poller that times out or disconnects).
        self._consumers: OrderedDict[Consumer, None] = OrderedDict()
        self._stream_leases: dict[str, Stream] = {}  # lease_id -> stream holding it
        self._streams: set[Stream] = set()
        self._pumping = False
        self._pump_again = False
        self._closing = False
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def store(self) -> Store:
        return self._store

    @property
    def sweeper(self) -> Sweeper:
        return self._sweeper

    @property
    def waiting(self) -> int:
        """Consumers with room waiting for a task (long-pollers and streams)."""
        return len(self._consumers)

    async def start(self) -> None:
        self._sweeper.start()

    async def close(self) -> None:
        """Answer every parked long-poll (with nothing), end every stream, stop the sweeper."""
        self._closing = True
        for consumer in list(self._consumers):
            consumer._shutdown()
        self._consumers.clear()
        for stream in list(self._streams):
            await self._close_stream(stream)
        await self._sweeper.stop()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # -- operations --------------------------------------------------------------------------

    @_follow_through
    async def enqueue(
        self, payload: bytes, max_attempts: object | None = None, delay_ms: object | None = None
    ) -> Task:
        attempts = max_attempts_value(max_attempts)
        delay = delay_seconds(delay_ms)
        task = await self._store.enqueue(
            payload, max_attempts=attempts, delay=delay, now=self._clock.now()
        )
        if delay > 0:
            self._sweeper.wake_by(task.available_at)
        elif self._consumers:
            await self._pump()
        return task

    @_follow_through
    async def enqueue_many(
        self, items: Sequence[tuple[bytes, object | None, object | None]], *, what: str = "tasks"
    ) -> list[Task]:
        """Enqueue (payload, max_attempts, delay_ms) triples, all or none: an invalid one is
        reported as ``{what}[i]: problem`` and nothing is enqueued."""
        checked = []
        for i, (payload, max_attempts, delay_ms) in enumerate(items):
            try:
                checked.append((payload, max_attempts_value(max_attempts), delay_seconds(delay_ms)))
            except InvalidArgument as e:
                raise InvalidArgument(f"{what}[{i}].{e.message}") from None
        now = self._clock.now()
        tasks = await self._store.enqueue_many(checked, now=now)
        earliest = min((t.available_at for t in tasks if t.available_at > now), default=None)
        if earliest is not None:
            self._sweeper.wake_by(earliest)
        if self._consumers and any(t.available_at <= now for t in tasks):
            await self._pump()
        return tasks

    async def claim(
        self, wait_ms: object | None = None, lease_ms: object | None = None
    ) -> Delivery | None:
        """Claim the oldest ready task, waiting up to ``wait_ms`` for one (None if none came)."""
        wait = wait_seconds(wait_ms)
        lease = lease_seconds(lease_ms)
        if self._closing:
            return None
        if not self._consumers:
            delivery = await self._claim_now(lease)
            if delivery is not None:
                self._sweeper.wake_by(delivery.deadline)
                return delivery
        if wait <= 0:
            return None
        future: asyncio.Future[Delivery | None] = asyncio.get_running_loop().create_future()
        poller = _Poller(lease, future)
        queued_behind = bool(self._consumers)
        self._consumers[poller] = None
        timer = self._clock.call_at(self._clock.now() + wait, poller._shutdown)
        try:
            if queued_behind:
                await self._pump()
            return await future
        except asyncio.CancelledError:
            # The caller went away. If a task was handed to it in the meantime, nobody saw it.
            if future.done() and not future.cancelled():
                delivery = future.result()
                if delivery is not None:
                    self._spawn(self.release(delivery))
            raise
        finally:
            timer.cancel()
            poller.closed = True
            self._consumers.pop(poller, None)

    async def _claim_now(self, lease: float) -> Delivery | None:
        claimed = self._store.claim(lease=lease, now=self._clock.now())
        if self._store.never_suspends:
            return await claimed
        task = asyncio.get_running_loop().create_task(claimed)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # The caller went away while the store committed the hand-out: undo it once done.
            def undo(done: asyncio.Task[Delivery | None]) -> None:
                if not done.cancelled() and done.exception() is None:
                    delivery = done.result()
                    if delivery is not None:
                        self._spawn(self.release(delivery))

            task.add_done_callback(undo)
            raise

    @_follow_through
    async def ack(self, task_id: object, lease_id: object) -> None:
        tid, lid = id_value("id", task_id), id_value("lease_id", lease_id)
        await self._store.ack(tid, lid, now=self._clock.now())
        await self._finished(lid)

    @_follow_through
    async def nack(self, task_id: object, lease_id: object, error: object | None = None) -> None:
        tid, lid = id_value("id", task_id), id_value("lease_id", lease_id)
        message = error_value(error)
        failure = await self._store.nack(tid, lid, message, now=self._clock.now())
        if failure.retry_at is not None:
            self._sweeper.wake_by(failure.retry_at)
        await self._finished(lid)

    @_follow_through
    async def settle_many(
        self,
        acks: Sequence[tuple[object, object]],
        nacks: Sequence[tuple[object, object, object | None]],
    ) -> tuple[list[WqError | None], list[WqError | None]]:
        """Acks, then nacks, all at once (one transaction in a durable store). Returns, for each,
        None on success or the error the single call would have raised."""
        ack_errors: list[WqError | None] = []
        ack_items: list[tuple[str, str]] = []
        for task_id, lease_id in acks:
            try:
                ack_items.append((id_value("id", task_id), id_value("lease_id", lease_id)))
                ack_errors.append(None)
            except WqError as e:
                ack_errors.append(e)
        nack_errors: list[WqError | None] = []
        nack_items: list[tuple[str, str, str | None]] = []
        for task_id, lease_id, error in nacks:
            try:
                lid = id_value("lease_id", lease_id)
                nack_items.append((id_value("id", task_id), lid, error_value(error)))
                nack_errors.append(None)
            except WqError as e:
                nack_errors.append(e)
        acked, nacked = await self._store.settle_many(ack_items, nack_items, now=self._clock.now())
        finished: list[str] = []
        ack_results = iter(zip(ack_items, acked, strict=True))
        for i, error in enumerate(ack_errors):
            if error is None:
                (_, lid), outcome = next(ack_results)
                ack_errors[i] = outcome
                if outcome is None:
                    finished.append(lid)
        nack_results = iter(zip(nack_items, nacked, strict=True))
        for i, error in enumerate(nack_errors):
            if error is None:
                (_, lid, _), result = next(nack_results)
                if isinstance(result, WqError):
                    nack_errors[i] = result
                    continue
                finished.append(lid)
                if result.retry_at is not None:
                    self._sweeper.wake_by(result.retry_at)
        await self._finished(*finished)
        return ack_errors, nack_errors

    @_follow_through
    async def release(self, delivery: Delivery) -> None:
        """Hand back a delivery that never reached a worker (its client disconnected)."""
        stream = self._stream_leases.pop(delivery.lease_id, None)
        if stream is not None:
            stream._sent.pop(delivery.lease_id, None)
        if await self._store.release(delivery.task.id, delivery.lease_id):
            log.debug("released task %s: its consumer went away", delivery.task.id)
            if stream is not None:
                self._freed(stream)
            await self._pump()

    def problem(self) -> str | None:
        """Why the broker cannot serve (for health checks), or None when it can."""
        if self._closing:
            return "the broker is shutting down"
        return self._store.problem()

    async def stats(self) -> Stats:
        return await self._store.stats()

    async def dead_letters(self, limit: object | None = None) -> list[Task]:
        n = None
        if limit is not None:
            n = _integer("limit", limit)
            if n < 0:
                raise InvalidArgument(f"limit must not be negative, got {n}")
        return await self._store.dead_letters(limit=n)

    @_follow_through
    async def requeue(self, task_id: object) -> None:
        tid = id_value("id", task_id)
        await self._store.requeue(tid, now=self._clock.now())
        if self._consumers:
            await self._pump()

    async def sweep(self) -> float | None:
        """One sweep: reclaim expired leases, promote due delayed tasks, feed waiting consumers.
        Returns when the next thing is due. The sweeper calls this; tests may call it directly."""
        result, next_due = await self._store.sweep(now=self._clock.now())
        if result.reclaimed:
            await self._finished(*(lease_id for _, lease_id in result.reclaimed))
        if result.promoted and self._consumers:
            await self._pump()
        return next_due

    # -- streams -----------------------------------------------------------------------------

    async def open_stream(
        self, prefetch: object | None = None, lease_ms: object | None = None
    ) -> Stream:
        if self._closing:
            raise Unavailable("the broker is shutting down")
        stream = Stream(self, prefetch_value(prefetch), lease_seconds(lease_ms))
        self._streams.add(stream)
        self._consumers[stream] = None
        await self._pump()
        return stream

    async def _close_stream(self, stream: Stream) -> None:
        if stream not in self._streams:
            return
        self._streams.discard(stream)
        stream._shutdown()
        released = await self._release_pending(stream)
        sent, stream._sent = stream._sent, {}
        now = self._clock.now()
        for lease_id, task_id in sent.items():
            self._stream_leases.pop(lease_id, None)
            try:
                failure = await self._store.reclaim(
                    task_id, lease_id, RECLAIM_STREAM_ENDED, now=now
                )
            except WqError:  # finished meanwhile (a unary ack) or its lease already ran out
                continue
            if failure.retry_at is not None:
                self._sweeper.wake_by(failure.retry_at)
        if released and self._consumers:
            await self._pump()

    async def _drain_stream(self, stream: Stream) -> None:
        stream.draining = True
        if await self._release_pending(stream) and self._consumers:
            await self._pump()

    async def _release_pending(self, stream: Stream) -> bool:
        """Take the stream out of line and put the tasks queued for it, not yet taken, back at
        the head of ready in their order. True if any went back."""
        self._consumers.pop(stream, None)
        pending, stream._pending = list(stream._pending), deque()
        released = False
        for delivery in reversed(pending):  # each goes to the head of ready: oldest last
            if self._stream_leases.pop(delivery.lease_id, None) is stream:
                released |= await self._store.release(delivery.task.id, delivery.lease_id)
        return released

    async def _finished(self, *lease_ids: str) -> None:
        """Leases ended (ack, nack, reclaim): free the slots of the streams that held them, then
        hand out what is ready (once, for all of them)."""
        wanted = False
        for lease_id in lease_ids:
            stream = self._stream_leases.pop(lease_id, None)
            if stream is not None:
                stream._sent.pop(lease_id, None)
                wanted |= self._freed(stream)
        if wanted:
            await self._pump()

    def _freed(self, stream: Stream) -> bool:
        """One of the stream's slots is free. True if it went back in line for tasks."""
        stream.room += 1
        if not stream.closed and not stream.draining and stream not in self._consumers:
            self._consumers[stream] = None
            return True
        return False

    # -- the hand-off ------------------------------------------------------------------------

    async def _pump(self) -> None:
        """Hand ready tasks to waiting consumers, first come first served, until one runs out."""
        if self._pumping:  # a pump is already running (only possible with a store that suspends)
            self._pump_again = True
            return
        self._pumping = True
        if self._store.never_suspends:
            await self._pump_all()
        else:
            # Claimed tasks must reach their consumers even if the request that started the pump
            # is cancelled (its client went away) while the store commits: run it on its own.
            await asyncio.shield(asyncio.get_running_loop().create_task(self._pump_all()))

    async def _pump_all(self) -> None:
        try:
            again = True
            while again:
                self._pump_again = False
                await self._pump_once()
                again = self._pump_again
        finally:
            self._pumping = False

    async def _pump_once(self) -> None:
        consumers = self._consumers
        store = self._store
        # Claim about as many tasks as are ready (one commit in a durable store), and more per
        # call while they keep coming: a single enqueue costs one slot however many consumers
        # wait, and a burst moves in large batches.
        hint = store.ready_hint()
        batch = _PUMP_BATCH if hint is None else max(1, min(hint, _PUMP_BATCH))
        while consumers:
            slots = self._slots(batch)
            if not slots:
                return
            deliveries = await store.claim_many(
                [consumer.lease for consumer in slots], now=self._clock.now()
            )
            served: dict[Consumer, None] = {}
            for consumer, delivery in zip(slots, deliveries, strict=False):
                if consumer._gone():
                    # It went away while the store was working; nobody saw the task.
                    await store.release(delivery.task.id, delivery.lease_id)
                    continue
                consumer.room -= 1
                served[consumer] = None
                if isinstance(consumer, Stream):
                    self._stream_leases[delivery.lease_id] = consumer
                consumer._deliver(delivery)
                self._sweeper.wake_by(delivery.deadline)
            for consumer in served:  # served ones go to the back of the queue: round robin
                consumers.pop(consumer, None)
                if consumer.room > 0 and not consumer._gone():
                    consumers[consumer] = None
            if len(deliveries) < len(slots):
                return  # nothing more is ready
            batch = min(batch * 8, _PUMP_BATCH)

    def _slots(self, limit: int) -> list[Consumer]:
        """The next ``limit`` claims to make: one per consumer in queue order, round after round
        while they have room, from no more than ``limit`` consumers at the front."""
        consumers = self._consumers
        front: list[Consumer] = []
        gone: list[Consumer] = []
        for consumer in consumers:
            if consumer._gone():
                gone.append(consumer)
                continue
            front.append(consumer)
            if len(front) >= limit:
                break
        for consumer in gone:
            del consumers[consumer]
        slots: list[Consumer] = []
        round_ = 0
        while front and len(slots) < limit:
            front = [c for c in front if c.room > round_]
            slots.extend(front[: limit - len(slots)])
            round_ += 1
        return slots

    async def _tick(self) -> float | None:
        return await self.sweep()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
