"""Handing ready tasks to whoever waits for them.

Consumers are whatever waits for tasks: a long-polling claim (a :class:`Poller`, room for one task)
or a :class:`Stream` (room for up to its prefetch of unfinished tasks). Consumers with room wait in
one queue, served first come, first served; a stream that still has room after receiving a task
goes to the back of the queue, so streams and long-pollers share ready tasks fairly.

The :class:`Dispatcher` owns that queue, the streams and which stream holds which lease, and the
pump that claims ready tasks from the store for them. It is also the one place where a task that no
worker saw is handed back (:meth:`Dispatcher.give_back`): a long-poller that went away, a stream
closed with deliveries still queued, an answer that could not be written.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Final

from wqbroker.clock import Clock
from wqbroker.errors import Overloaded, WqError
from wqbroker.followthrough import Background
from wqbroker.limits import RETRY_AFTER
from wqbroker.models import Delivery
from wqbroker.store import Store

log = logging.getLogger("wqbroker.dispatch")

RECLAIM_STREAM_ENDED: Final = "worker stream ended"

#: Puts a delivery in the hands of its consumer (writes the answer). If it raises, nobody saw the
#: task, and it is handed back.
HandOver = Callable[[Delivery], Awaitable[None]]

# How many tasks the pump claims from the store in one call (one commit in a durable store).
_PUMP_BATCH: Final = 128


class Consumer:
    """Something waiting for deliveries."""

    __slots__ = ("lease", "room", "closed")

    def __init__(self, lease: float, room: int) -> None:
        self.lease = lease
        self.room = room  # how many more tasks it can take now
        self.closed = False

    def gone(self) -> bool:
        """True once it can take no more deliveries."""
        return self.closed

    def deliver(self, delivery: Delivery) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        """No more deliveries will come (the broker is stopping, or the wait is over)."""
        raise NotImplementedError


class Poller(Consumer):
    """One long-polling claim."""

    __slots__ = ("future",)

    def __init__(self, lease: float, future: asyncio.Future[Delivery | None]) -> None:
        super().__init__(lease, 1)
        self.future = future

    def gone(self) -> bool:
        # Its future is done once it timed out or its caller was cancelled (client disconnected),
        # which may be a moment before the caller gets to run and set ``closed``.
        return self.closed or self.future.done()

    def deliver(self, delivery: Delivery) -> None:
        self.closed = True
        self.future.set_result(delivery)

    def shutdown(self) -> None:
        self.closed = True
        if not self.future.done():
            self.future.set_result(None)


class Stream(Consumer):
    """Tasks pushed to a worker as soon as they are ready, never more than ``prefetch`` unfinished.

    ``await stream.next()`` returns the next delivery, or None once the stream is closed. A task is
    finished when it is acked or nacked (over any protocol) or its lease is reclaimed; each finished
    task frees a slot. Closing the stream hands back the tasks it was given but never passed on and
    reclaims the ones it passed on and that are still unfinished.
    """

    __slots__ = ("prefetch", "draining", "_dispatcher", "_pending", "_waiter", "_sent")

    def __init__(self, dispatcher: Dispatcher, prefetch: int, lease: float) -> None:
        super().__init__(lease, prefetch)
        self.prefetch = prefetch
        self.draining = False
        self._dispatcher = dispatcher
        self._pending: deque[Delivery] = deque()  # pushed to us, not yet taken by next()
        self._waiter: asyncio.Future[None] | None = None
        self._sent: dict[str, str] = {}  # lease_id -> task_id, taken by next() and unfinished

    def deliver(self, delivery: Delivery) -> None:
        self._pending.append(delivery)
        self.poke()

    def shutdown(self) -> None:
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
        holder = self._dispatcher.holder
        pending = self._pending
        while pending and (limit is None or len(out) < limit):
            delivery = pending.popleft()
            if holder(delivery.lease_id) is not self:
                continue  # reclaimed (its lease ran out) before the worker took it
            self._sent[delivery.lease_id] = delivery.task.id
            out.append(delivery)
        return out

    async def drain(self) -> None:
        """Take no new tasks; the ones queued here but not yet taken go back to ready."""
        await self._dispatcher.drain(self)

    async def close(self) -> None:
        await self._dispatcher.close_stream(self)

    # -- for the dispatcher ------------------------------------------------------------------

    def take_pending(self) -> list[Delivery]:
        """Deliveries queued here and not taken, oldest first; the queue is left empty."""
        pending, self._pending = list(self._pending), deque()
        return pending

    def take_sent(self) -> dict[str, str]:
        """lease_id -> task_id of the deliveries taken and unfinished; forgotten here."""
        sent, self._sent = self._sent, {}
        return sent

    def finished(self, lease_id: str) -> None:
        self._sent.pop(lease_id, None)


class Dispatcher:
    """The queue of waiting consumers and the pump that feeds them from the store."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        wake_by: Callable[[float], None],
        background: Background,
        *,
        max_waiters: int = 0,
    ) -> None:
        self._store = store
        self._clock = clock
        self._wake_by = wake_by  # the sweeper must look again by then (a lease's deadline)
        self._background = background
        # Consumers with room, in the order they are to be served. An OrderedDict is a queue with
        # O(1) removal from the middle (a long-poller that times out or disconnects).
        self._consumers: OrderedDict[Consumer, None] = OrderedDict()
        self._stream_leases: dict[str, Stream] = {}  # lease_id -> stream holding it
        self._streams: set[Stream] = set()
        self._pumping = False
        self._pump_again = False
        self._closing = False
        self._max_waiters = max_waiters  # parked long-polls and open streams (0: no limit)
        self._parked = 0  # long-polls waiting now

    @property
    def waiting(self) -> int:
        """Consumers with room waiting for a task (long-pollers and streams)."""
        return len(self._consumers)

    def holder(self, lease_id: str) -> Stream | None:
        """The stream holding ``lease_id``, if a stream does."""
        return self._stream_leases.get(lease_id)

    async def close(self) -> None:
        """Answer every parked long-poll (with nothing) and end every stream."""
        self._closing = True
        for consumer in list(self._consumers):
            consumer.shutdown()
        self._consumers.clear()
        for stream in list(self._streams):
            await self.close_stream(stream)

    # -- long-polls --------------------------------------------------------------------------

    async def claim(
        self, wait: float, lease: float, hand_over: HandOver | None = None
    ) -> Delivery | None:
        """The oldest ready task, waiting up to ``wait`` seconds for one (None if none came).

        ``hand_over`` puts the delivery in the consumer's hands (an adapter writes its answer);
        if it raises or is cancelled, nobody saw the task: it is handed back, and the claim
        answers None (or the cancellation goes on). The waiting is done in this one frame: a
        parked long-poll costs as little as it can."""
        if self._closing:
            return None
        delivery = await self._claim_now(lease) if not self._consumers else None
        if delivery is None and wait > 0:
            self._room_for_a_waiter()
            future: asyncio.Future[Delivery | None] = asyncio.get_running_loop().create_future()
            poller = Poller(lease, future)
            queued_behind = bool(self._consumers)
            self._consumers[poller] = None
            self._parked += 1
            timer = self._clock.call_at(self._clock.now() + wait, poller.shutdown)
            try:
                if queued_behind:
                    await self.pump()
                delivery = await future
            except asyncio.CancelledError:
                # The caller went away. If a task was handed to it meanwhile, nobody saw it.
                if future.done() and not future.cancelled():
                    self.give_back_later(future.result())
                raise
            finally:
                timer.cancel()
                poller.closed = True
                self._consumers.pop(poller, None)
                self._parked -= 1
        if delivery is None:
            return None
        self._wake_by(delivery.deadline)
        return delivery if hand_over is None else await self._hand_over(delivery, hand_over)

    async def _hand_over(self, delivery: Delivery, hand_over: HandOver) -> Delivery | None:
        try:
            await hand_over(delivery)
        except asyncio.CancelledError:
            self.give_back_later(delivery)
            raise
        except Exception as e:
            log.debug("task %s could not be handed over (%r)", delivery.task.id, e)
            self.give_back_later(delivery)
            return None
        return delivery

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
                    self.give_back_later(done.result())

            task.add_done_callback(undo)
            raise

    # -- handing back ------------------------------------------------------------------------

    async def give_back(self, delivery: Delivery, *, pump: bool = True) -> bool:
        """Hand back a delivery that never reached a worker: the task goes back to the head of
        ready as if it had not been handed out. False if its lease is no longer current."""
        stream = self._stream_leases.pop(delivery.lease_id, None)
        if stream is not None:
            stream.finished(delivery.lease_id)
        if not await self._store.release(delivery.task.id, delivery.lease_id):
            return False
        log.debug("task %s handed back: its consumer went away", delivery.task.id)
        if stream is not None:
            self._freed(stream)
        if pump:
            await self.pump()
        return True

    def give_back_later(self, delivery: Delivery | None) -> None:
        """Hand back in the background (from a callback, or a caller being cancelled)."""
        if delivery is not None:
            self._background.spawn(self._give_back_quietly(delivery))

    async def _give_back_quietly(self, delivery: Delivery) -> None:
        try:
            await self.give_back(delivery)
        except WqError as e:  # the store failed: the lease runs out instead
            log.warning("could not hand back task %s: %s", delivery.task.id, e.message)

    # -- streams -----------------------------------------------------------------------------

    def _room_for_a_waiter(self) -> None:
        waiters = self._parked + len(self._streams)
        if self._max_waiters and waiters >= self._max_waiters:
            raise Overloaded(
                f"{waiters} consumers are already waiting, the most this broker parks: retry later",
                retry_after=RETRY_AFTER,
            )

    async def open_stream(self, prefetch: int, lease: float) -> Stream:
        self._room_for_a_waiter()
        stream = Stream(self, prefetch, lease)
        self._streams.add(stream)
        self._consumers[stream] = None
        await self.pump()
        return stream

    async def close_stream(self, stream: Stream) -> None:
        if stream not in self._streams:
            return
        self._streams.discard(stream)
        stream.shutdown()
        handed_back = await self._hand_back_pending(stream)
        now = self._clock.now()
        for lease_id, task_id in stream.take_sent().items():
            self._stream_leases.pop(lease_id, None)
            try:
                failure = await self._store.reclaim(
                    task_id, lease_id, RECLAIM_STREAM_ENDED, now=now
                )
            except WqError:  # finished meanwhile (a unary ack) or its lease already ran out
                continue
            if failure.retry_at is not None:
                self._wake_by(failure.retry_at)
        if handed_back and self._consumers:
            await self.pump()

    async def drain(self, stream: Stream) -> None:
        stream.draining = True
        if await self._hand_back_pending(stream) and self._consumers:
            await self.pump()

    async def _hand_back_pending(self, stream: Stream) -> bool:
        """Take the stream out of line and hand back the tasks queued for it, not yet taken, to
        the head of ready in their order. True if any went back."""
        self._consumers.pop(stream, None)
        handed_back = False
        for delivery in reversed(stream.take_pending()):  # each goes to the head: oldest last
            if self._stream_leases.get(delivery.lease_id) is stream:
                handed_back |= await self.give_back(delivery, pump=False)
        return handed_back

    async def finished(self, lease_ids: Iterable[str]) -> None:
        """Leases ended (ack, nack, reclaim): free the slots of the streams that held them, then
        hand out what is ready (once, for all of them)."""
        wanted = False
        for lease_id in lease_ids:
            stream = self._stream_leases.pop(lease_id, None)
            if stream is not None:
                stream.finished(lease_id)
                wanted |= self._freed(stream)
        if wanted:
            await self.pump()

    def _freed(self, stream: Stream) -> bool:
        """One of the stream's slots is free. True if it went back in line for tasks."""
        stream.room += 1
        if not stream.closed and not stream.draining and stream not in self._consumers:
            self._consumers[stream] = None
            return True
        return False

    # -- the pump ----------------------------------------------------------------------------

    async def pump(self) -> None:
        """Hand ready tasks to waiting consumers, first come first served, until one runs out."""
        if not self._consumers:
            return
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
        # Claim about as many tasks as are ready (one commit in a durable store), and more per
        # call while they keep coming: a single enqueue costs one slot however many consumers
        # wait, and a burst moves in large batches.
        hint = self._store.ready_hint()
        batch = _PUMP_BATCH if hint is None else max(1, min(hint, _PUMP_BATCH))
        while self._consumers:
            slots = self._slots(batch)
            if not slots:
                return
            deliveries = await self._store.claim_many(
                [consumer.lease for consumer in slots], now=self._clock.now()
            )
            await self._hand_out(slots, deliveries)
            if len(deliveries) < len(slots):
                return  # nothing more is ready
            batch = min(batch * 8, _PUMP_BATCH)

    async def _hand_out(self, slots: list[Consumer], deliveries: list[Delivery]) -> None:
        served: dict[Consumer, None] = {}
        for consumer, delivery in zip(slots, deliveries, strict=False):
            if consumer.gone():
                # It went away while the store was working; nobody saw the task.
                await self.give_back(delivery, pump=False)
                continue
            consumer.room -= 1
            served[consumer] = None
            if isinstance(consumer, Stream):
                self._stream_leases[delivery.lease_id] = consumer
            consumer.deliver(delivery)
            self._wake_by(delivery.deadline)
        consumers = self._consumers
        for consumer in served:  # served ones go to the back of the queue: round robin
            consumers.pop(consumer, None)
            if consumer.room > 0 and not consumer.gone():
                consumers[consumer] = None

    def _slots(self, limit: int) -> list[Consumer]:
        """The next ``limit`` claims to make: one per consumer in queue order, round after round
        while they have room, from no more than ``limit`` consumers at the front."""
        consumers = self._consumers
        front: list[Consumer] = []
        gone: list[Consumer] = []
        for consumer in consumers:
            if consumer.gone():
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
