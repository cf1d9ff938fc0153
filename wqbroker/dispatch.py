"""Handing ready tasks to whoever waits for them.

Consumers are whatever waits for tasks: a long-polling claim (a :class:`Poller`, room for one task)
or a :class:`Stream` (room for up to its prefetch of unfinished tasks). Each takes tasks from a list
of queues, in order of preference. Consumers with room wait in a line per list of queues (most
brokers see a handful of distinct lists), served first come, first served; a stream that still has
room after receiving a task goes to the back of its line, so streams and long-pollers share ready
tasks fairly. When tasks become ready in a queue, the lines that listen to it are pumped.

The :class:`Dispatcher` owns that queue, the streams and which stream holds which lease, and the
pump that claims ready tasks from the store for them. It is also the one place where a task that no
worker saw is handed back (:meth:`Dispatcher.give_back`): a long-poller that went away, a stream
closed with deliveries still queued, an answer that could not be written. Its store calls (claims,
hand-backs, the reclaims of a closed stream) are told to the service's listener
(:mod:`wqbroker.events`) as the service's own are.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Final, TypeVar

from wqbroker.clock import Clock, TimerHandle
from wqbroker.errors import Overloaded, WqError
from wqbroker.events import Events, timed
from wqbroker.followthrough import Background
from wqbroker.limits import RETRY_AFTER
from wqbroker.models import DEFAULT_QUEUE, Delivery
from wqbroker.store import Store

log = logging.getLogger("wqbroker.dispatch")

T = TypeVar("T")

RECLAIM_STREAM_ENDED: Final = "worker stream ended"

#: Puts a delivery in the hands of its consumer (writes the answer). If it raises, nobody saw the
#: task, and it is handed back.
HandOver = Callable[[Delivery], Awaitable[None]]
#: The same for a batch claim's deliveries, all at once.
HandOverMany = Callable[[list[Delivery]], Awaitable[None]]

# How many tasks the pump claims from the store in one call (one commit in a durable store).
_PUMP_BATCH: Final = 1024

Queues = tuple[str, ...]  # the queues a consumer takes from, in order of preference
_DEFAULT_QUEUES: Final[Queues] = (DEFAULT_QUEUE,)


def _fields(delivery: Delivery, outcome: str) -> dict[str, object]:
    """The fields of a log record about a delivery (``-log-format json`` shows them; never the
    lease id: it would let a reader of the log settle the task)."""
    return {
        "task_id": delivery.task.id,
        "queue": delivery.task.queue,
        "outcome": outcome,
    }


class Consumer:
    """Something waiting for deliveries."""

    __slots__ = ("lease", "room", "closed", "queues")

    def __init__(self, lease: float, room: int, queues: Queues = _DEFAULT_QUEUES) -> None:
        self.lease = lease
        self.room = room  # how many more tasks it can take now
        self.closed = False
        self.queues = queues

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

    def __init__(
        self,
        lease: float,
        future: asyncio.Future[Delivery | None],
        queues: Queues = _DEFAULT_QUEUES,
    ) -> None:
        super().__init__(lease, 1, queues)
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


class BatchPoller(Consumer):
    """One long-polling claim of up to ``room`` tasks: its future is answered with the first
    delivery, and the ones the same hand-out (or another before its caller runs) brings are
    added to what it answered."""

    __slots__ = ("future", "deliveries")

    def __init__(
        self,
        lease: float,
        future: asyncio.Future[list[Delivery]],
        room: int,
        queues: Queues = _DEFAULT_QUEUES,
    ) -> None:
        super().__init__(lease, room, queues)
        self.future = future
        self.deliveries: list[Delivery] = []

    def gone(self) -> bool:
        # Its future is cancelled once its caller went away (or done empty: timed out).
        return (
            self.closed or self.future.cancelled() or (self.future.done() and not self.deliveries)
        )

    def deliver(self, delivery: Delivery) -> None:
        self.deliveries.append(delivery)
        if not self.future.done():
            self.future.set_result(self.deliveries)

    def shutdown(self) -> None:
        self.closed = True
        if not self.future.done():
            self.future.set_result([])


class Stream(Consumer):
    """Tasks pushed to a worker as soon as they are ready, never more than ``prefetch`` unfinished.

    ``await stream.next()`` returns the next delivery, or None once the stream is closed. A task is
    finished when it is acked or nacked (over any protocol) or its lease is reclaimed; each finished
    task frees a slot. Closing the stream hands back the tasks it was given but never passed on and
    reclaims the ones it passed on and that are still unfinished.
    """

    __slots__ = (
        "prefetch",
        "draining",
        "_dispatcher",
        "_pending",
        "_waiter",
        "_sent",
        "_cancels",
        "_told",
        "_cancel_on_take",
    )

    def __init__(
        self,
        dispatcher: Dispatcher,
        prefetch: int,
        lease: float,
        queues: Queues = _DEFAULT_QUEUES,
    ) -> None:
        super().__init__(lease, prefetch, queues)
        self.prefetch = prefetch
        self.draining = False
        self._dispatcher = dispatcher
        self._pending: deque[Delivery] = deque()  # pushed to us, not yet taken by next()
        self._waiter: asyncio.Future[None] | None = None
        self._sent: dict[str, str] = {}  # lease_id -> task_id, taken by next() and unfinished
        # Cancels to tell the worker, (task_id, lease_id), oldest first; the leases told so far
        # (each is told once); those of deliveries not yet taken (told once they are).
        self._cancels: list[tuple[str, str]] = []
        self._told: set[str] = set()
        self._cancel_on_take: set[str] = set()

    def gone(self) -> bool:
        # A draining stream takes no new task, also one claimed for it before the drain (by a
        # pump that was waiting for the store): that one is handed back.
        return self.closed or self.draining

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
            if self._cancel_on_take and delivery.lease_id in self._cancel_on_take:
                self._cancel_on_take.discard(delivery.lease_id)
                self._tell_cancel(delivery.task.id, delivery.lease_id)
        return out

    def cancel(self, lease_id: str) -> None:
        """The task this stream holds under ``lease_id`` was cancelled: tell the worker (once;
        for a delivery not yet taken, once it is)."""
        task_id = self._sent.get(lease_id)
        if task_id is not None:
            self._tell_cancel(task_id, lease_id)
        elif any(d.lease_id == lease_id for d in self._pending):
            self._cancel_on_take.add(lease_id)

    def _tell_cancel(self, task_id: str, lease_id: str) -> None:
        if lease_id not in self._told:
            self._told.add(lease_id)
            self._cancels.append((task_id, lease_id))
            self.poke()

    def take_cancels(self) -> list[tuple[str, str]]:
        """The cancels to tell the worker, (task_id, lease_id), oldest first; taken."""
        cancels, self._cancels = self._cancels, []
        return cancels

    @property
    def unsettled(self) -> int:
        """Deliveries passed on to the worker (taken) and not yet finished."""
        return len(self._sent)

    @property
    def pending(self) -> int:
        """Deliveries queued here, not yet taken."""
        return len(self._pending)

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
        if self._told:
            self._told.discard(lease_id)
        if self.draining:
            self.poke()  # an adapter may be waiting for the last one to be settled


class Dispatcher:
    """The lines of waiting consumers and the pump that feeds them from the store."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        wake_by: Callable[[float], None],
        background: Background,
        events: Events,
        *,
        max_waiters: int = 0,
        others: Callable[[], int] | None = None,
    ) -> None:
        """``others``: how many other waiters (result waits) count toward ``max_waiters``."""
        self._store = store
        self._events = events
        self._clock = clock
        self._wake_by = wake_by  # the sweeper must look again by then (a lease's deadline)
        self._background = background
        # Consumers with room, per list of queues, in the order they are to be served. An
        # OrderedDict is a queue with O(1) removal from the middle (a long-poller that times out
        # or disconnects).
        self._lines: dict[Queues, OrderedDict[Consumer, None]] = {}
        self._listening: dict[str, set[Queues]] = {}  # queue -> the lines that take from it
        self._stream_leases: dict[str, Stream] = {}  # lease_id -> stream holding it
        self._streams: set[Stream] = set()
        self._pumping = False
        self._to_pump: set[Queues] = set()  # lines to pump (by the pump running now)
        # Times tasks were said to be ready (every pump call): a claim that found nothing in a
        # store that suspends looks again if this moved while it asked (see _park_pumped).
        self._readied = 0
        self._closing = False
        self._max_waiters = max_waiters  # parked long-polls and open streams (0: no limit)
        self._others = others
        self._parked = 0  # long-polls waiting now
        # Limits per queue (docs/design/schedules.md): lines whose consumers a rate limit kept
        # from ready tasks, and when a token comes for them (the store's limit_hint); one timer,
        # at the earliest, pumps those lines whose token has come.
        self._token_lines: dict[Queues, float] = {}
        self._token_timer: TimerHandle | None = None
        self._token_at = math.inf

    @property
    def waiting(self) -> int:
        """Consumers with room waiting for a task (long-pollers and streams)."""
        return sum(len(line) for line in self._lines.values())

    @property
    def parked(self) -> int:
        """Long-polling claims waiting now."""
        return self._parked

    @property
    def streams(self) -> int:
        """Streams open now."""
        return len(self._streams)

    def holder(self, lease_id: str) -> Stream | None:
        """The stream holding ``lease_id``, if a stream does."""
        return self._stream_leases.get(lease_id)

    async def close(self) -> None:
        """Answer every parked long-poll (with nothing) and end every stream."""
        self._closing = True
        if self._token_timer is not None:
            self._token_timer.cancel()
            self._token_timer = None
        self._token_lines.clear()
        for line in list(self._lines.values()):
            for consumer in list(line):
                consumer.shutdown()
        self._lines.clear()
        self._listening.clear()
        for stream in list(self._streams):
            await self.close_stream(stream)

    # -- the lines ---------------------------------------------------------------------------

    def _join(self, consumer: Consumer) -> None:
        """Put a consumer at the back of its line."""
        key = consumer.queues
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = OrderedDict()
            for name in key:
                self._listening.setdefault(name, set()).add(key)
        line[consumer] = None

    def _leave(self, consumer: Consumer) -> None:
        """Take a consumer out of its line (if it is in it)."""
        key = consumer.queues
        line = self._lines.get(key)
        if line is None:
            return
        line.pop(consumer, None)
        if not line:
            self._drop_line(key)

    def _drop_line(self, key: Queues) -> None:
        del self._lines[key]
        for name in key:
            lines = self._listening.get(name)
            if lines is not None:
                lines.discard(key)
                if not lines:
                    del self._listening[name]

    def _in_line(self, consumer: Consumer) -> bool:
        line = self._lines.get(consumer.queues)
        return line is not None and consumer in line

    # -- long-polls --------------------------------------------------------------------------

    async def claim(
        self,
        wait: float,
        lease: float,
        hand_over: HandOver | None = None,
        queues: Queues = _DEFAULT_QUEUES,
    ) -> Delivery | None:
        """The next ready task of ``queues``, waiting up to ``wait`` seconds for one (None if
        none came).

        ``hand_over`` puts the delivery in the consumer's hands (an adapter writes its answer);
        if it raises or is cancelled, nobody saw the task: it is handed back, and the claim
        answers None (or the cancellation goes on). The waiting is done in this one frame: a
        parked long-poll costs as little as it can."""
        if self._closing:
            return None
        queued_behind = queues in self._lines
        asked = self._readied
        delivery = await self._claim_now(lease, queues) if not queued_behind else None
        if delivery is None and wait > 0:
            self._room_for_a_waiter()
            future: asyncio.Future[Delivery | None] = asyncio.get_running_loop().create_future()
            poller = Poller(lease, future, queues)
            claimed = not queued_behind
            queued_behind = queues in self._lines
            self._join(poller)
            self._parked += 1
            if claimed:
                self._wait_for_token(queues)  # (a rate limit may be what kept it from a task)
            timer = self._clock.call_at(self._clock.now() + wait, poller.shutdown)
            try:
                await self._park_pumped(queues, queued_behind, asked)
                delivery = await future
            except asyncio.CancelledError:
                # The caller went away. If a task was handed to it meanwhile, nobody saw it.
                if future.done() and not future.cancelled():
                    self.give_back_later(future.result())
                raise
            finally:
                timer.cancel()
                poller.closed = True
                self._leave(poller)
                self._parked -= 1
        if delivery is None:
            return None
        self._wake_by(delivery.deadline)
        return delivery if hand_over is None else await self._hand_over(delivery, hand_over)

    async def claim_batch(
        self,
        wait: float,
        lease: float,
        count: int,
        hand_over: HandOverMany | None = None,
        queues: Queues = _DEFAULT_QUEUES,
    ) -> list[Delivery]:
        """Up to ``count`` ready tasks of ``queues``, waiting up to ``wait`` seconds for the
        first (then as many as are ready with it: it does not wait for more); none if none
        came. ``hand_over`` puts them in the consumer's hands, as for :meth:`claim` (if it
        fails, all of them are handed back)."""
        if self._closing:
            return []
        queued_behind = queues in self._lines
        asked = self._readied
        got = [] if queued_behind else await self._claim_now_many(lease, count, queues)
        if not got and wait > 0:
            got = await self._park_batch(wait, lease, count, queues, asked)
        if not got:
            return []
        self._wake_by(min(d.deadline for d in got))
        return got if hand_over is None else await self._hand_over_many(got, hand_over)

    async def _park_batch(
        self, wait: float, lease: float, count: int, queues: Queues, asked: int
    ) -> list[Delivery]:
        self._room_for_a_waiter()
        future: asyncio.Future[list[Delivery]] = asyncio.get_running_loop().create_future()
        poller = BatchPoller(lease, future, count, queues)
        queued_behind = queues in self._lines
        self._join(poller)
        self._parked += 1
        self._wait_for_token(queues)  # (a rate limit may be what kept it from a task)
        timer = self._clock.call_at(self._clock.now() + wait, poller.shutdown)
        try:
            await self._park_pumped(queues, queued_behind, asked)
            await future
        except asyncio.CancelledError:
            # The caller went away: whatever was handed to it meanwhile, nobody saw.
            poller.closed = True
            self.give_back_all_later(poller.deliveries)
            raise
        finally:
            timer.cancel()
            poller.closed = True
            self._leave(poller)
            self._parked -= 1
        return list(poller.deliveries)  # (closed: nothing more is added)

    async def _park_pumped(self, queues: Queues, queued_behind: bool, asked: int) -> None:
        """Pump a consumer's line as it parks, if it is to be served now: it joined a line of
        others (it waits its turn, the pump serves them in order), or tasks were said to be
        ready while its own claim was with the store (``asked``: the count then). That claim
        may have read the store before they were there, and their pump found nobody parked
        yet: without this, they would wait for the next wake-up or poll."""
        if queued_behind or self._readied != asked:
            await self.pump(queues)

    async def _hand_over_many(
        self, deliveries: list[Delivery], hand_over: HandOverMany
    ) -> list[Delivery]:
        try:
            await hand_over(deliveries)
        except asyncio.CancelledError:
            self.give_back_all_later(deliveries)
            raise
        except Exception as e:
            log.debug("%d tasks could not be handed over (%r)", len(deliveries), e)
            self.give_back_all_later(deliveries)
            return []
        return deliveries

    async def _claim_now_many(self, lease: float, count: int, queues: Queues) -> list[Delivery]:
        claimed = self._store.claim_many([lease] * count, now=self._clock.now(), queues=queues)
        deliveries = await self._committed(claimed, list)
        if deliveries:
            self._events.handed_out(deliveries)
        return deliveries

    async def _hand_over(self, delivery: Delivery, hand_over: HandOver) -> Delivery | None:
        try:
            await hand_over(delivery)
        except asyncio.CancelledError:
            self.give_back_later(delivery)
            raise
        except Exception as e:
            log.debug(
                "task %s could not be handed over (%r)",
                delivery.task.id,
                e,
                extra=_fields(delivery, "handed_back"),
            )
            self.give_back_later(delivery)
            return None
        return delivery

    async def _claim_now(self, lease: float, queues: Queues) -> Delivery | None:
        claimed = self._store.claim(lease=lease, now=self._clock.now(), queues=queues)
        delivery = await self._committed(claimed, lambda found: [] if found is None else [found])
        if delivery is not None:
            self._events.handed_out((delivery,))
        return delivery

    async def _committed(
        self, claimed: Coroutine[Any, Any, T], handed: Callable[[T], list[Delivery]]
    ) -> T:
        """What a claim of the store answers (timed for the listener). With a store that
        suspends, it runs on its own: if the caller goes away while the store commits the
        hand-outs (``handed`` lists them), they are undone once done."""
        timed_claim = timed(self._events, "claim", claimed)
        if self._store.never_suspends:
            return await timed_claim
        task = asyncio.get_running_loop().create_task(timed_claim)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:

            def undo(done: asyncio.Task[T]) -> None:
                if not done.cancelled() and done.exception() is None:
                    self._undo(handed(done.result()))

            task.add_done_callback(undo)
            raise

    def _undo(self, deliveries: list[Delivery]) -> None:
        """Hand-outs that no caller is left to take (it went away while the store committed
        them): handed out, as far as the listener is told, then handed back."""
        if deliveries:
            self._events.handed_out(deliveries)
            self.give_back_all_later(deliveries)

    # -- handing back ------------------------------------------------------------------------

    async def give_back(self, delivery: Delivery, *, pump: bool = True) -> bool:
        """Hand back a delivery that never reached a worker: the task goes back to the head of
        its lane as if it had not been handed out. False if its lease is no longer current."""
        stream = self._stream_leases.pop(delivery.lease_id, None)
        if stream is not None:
            stream.finished(delivery.lease_id)
        self._events.leases_gone((delivery.lease_id,))
        released = self._store.release(delivery.task.id, delivery.lease_id, now=self._clock.now())
        if not await timed(self._events, "release", released):
            return False
        log.debug(
            "task %s handed back: its consumer went away",
            delivery.task.id,
            extra=_fields(delivery, "released"),
        )
        if stream is not None:
            self._freed(stream)
        if pump:
            await self.pump((delivery.task.queue,))
        return True

    def give_back_later(self, delivery: Delivery | None) -> None:
        """Hand back in the background (from a callback, or a caller being cancelled)."""
        if delivery is not None:
            self._background.spawn(self._give_back_quietly(delivery))

    def give_back_all_later(self, deliveries: list[Delivery]) -> None:
        """Hand back deliveries in the background, one after the other: each goes to the head of
        its lane, so the last first, and they are back in their order."""
        if deliveries:
            self._background.spawn(self._give_back_all(list(reversed(deliveries))))

    async def _give_back_all(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            await self._give_back_quietly(delivery)

    async def _give_back_quietly(self, delivery: Delivery) -> None:
        try:
            await self.give_back(delivery)
        except WqError as e:  # the store failed: the lease runs out instead
            log.warning(
                "could not hand back task %s: %s",
                delivery.task.id,
                e.message,
                extra=_fields(delivery, "release_failed"),
            )

    # -- streams -----------------------------------------------------------------------------

    def _room_for_a_waiter(self) -> None:
        waiters = self._parked + len(self._streams)
        if self._others is not None:
            waiters += self._others()  # (docs/design/results.md: result waits count too)
        if self._max_waiters and waiters >= self._max_waiters:
            raise Overloaded(
                f"{waiters} consumers are already waiting, the most this broker parks: retry later",
                retry_after=RETRY_AFTER,
            )

    async def open_stream(
        self, prefetch: int, lease: float, queues: Queues = _DEFAULT_QUEUES
    ) -> Stream:
        self._room_for_a_waiter()
        stream = Stream(self, prefetch, lease, queues)
        self._streams.add(stream)
        self._join(stream)
        try:
            await self.pump(queues)
        except BaseException:
            # The caller went away while a store that suspends claimed for the new stream: it
            # never gets the stream, so it could never close it, and the stream would go on
            # taking tasks that nobody reads. Close it here, whatever else gets cancelled.
            await asyncio.shield(self.close_stream(stream))
            raise
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
            self._events.leases_gone((lease_id,))
            reclaimed = self._store.reclaim(task_id, lease_id, RECLAIM_STREAM_ENDED, now=now)
            try:
                failure = await timed(self._events, "reclaim", reclaimed)
            except WqError:  # finished meanwhile (a unary ack) or its lease already ran out
                continue
            if failure.retry_at is not None:
                self._wake_by(failure.retry_at)
        await self.take_released()  # (a slot of a concurrency-limited queue freed by a reclaim)
        if handed_back:
            await self.pump(handed_back)

    async def drain(self, stream: Stream) -> None:
        stream.draining = True
        handed_back = await self._hand_back_pending(stream)
        if handed_back:
            await self.pump(handed_back)

    async def _hand_back_pending(self, stream: Stream) -> set[str]:
        """Take the stream out of line and hand back the tasks queued for it, not yet taken, to
        the head of their lanes in their order. The queues of those that went back."""
        self._leave(stream)
        handed_back: set[str] = set()
        for delivery in reversed(stream.take_pending()):  # each goes to the head: oldest last
            if self._stream_leases.get(delivery.lease_id) is stream:
                if await self.give_back(delivery, pump=False):
                    handed_back.add(delivery.task.queue)
        return handed_back

    async def finished(self, lease_ids: Iterable[str], *, later: bool = False) -> None:
        """Leases ended (ack, nack, reclaim): free the slots of the streams that held them, then
        hand out what is ready (once, for all of them; ``later``: in the background, so that the
        caller need not wait for the store)."""
        wanted: set[Queues] = set()
        for lease_id in lease_ids:
            stream = self._stream_leases.pop(lease_id, None)
            if stream is not None:
                stream.finished(lease_id)
                if self._freed(stream):
                    wanted.add(stream.queues)
        if wanted:
            if later:
                self._background.spawn(self._pump_lines(wanted))
            else:
                await self._pump_lines(wanted)

    def cancelled(self, lease_ids: Iterable[str]) -> None:
        """Tasks under these leases were cancelled (here or on another broker): the streams of
        this broker that hold them tell their workers."""
        for lease_id in lease_ids:
            stream = self._stream_leases.get(lease_id)
            if stream is not None:
                stream.cancel(lease_id)

    def refill_for(self, lease_ids: Iterable[str]) -> Stream | None:
        """The stream whose slots the settlement of ``lease_ids`` frees, if its successors can
        be claimed in the same transaction (:meth:`refilled`): every lease is held by that one
        stream, which is full (out of line), still taking tasks, and nobody waits in its line
        (the pump would serve them first; they wait because nothing was ready)."""
        if self._closing:
            return None
        holder = self._stream_leases.get
        stream: Stream | None = None
        count = 0
        for lease_id in lease_ids:
            count += 1
            held = holder(lease_id)
            if held is None or (stream is not None and held is not stream):
                return None
            stream = held
        if stream is None or stream.gone() or self._in_line(stream):
            return None
        if self._lines.get(stream.queues):
            return None
        if stream.room + count <= 0:  # its prefetch was lowered: no slot is freed
            return None
        return stream

    async def refilled(
        self, stream: Stream, ended: Iterable[str], claimed: list[Delivery], *, later: bool = False
    ) -> None:
        """Leases ended (``ended``, as :meth:`finished`) and ``claimed`` in the same transaction
        for ``stream`` (:meth:`refill_for`): the stream gets as many as it has room for now (the
        claim did not wait for the outcomes: an ack refused frees no slot), the rest go back.
        A stream left with room goes back in line, and its line is pumped."""
        wanted = self._ended_beside(stream, ended)
        if claimed:
            self._events.handed_out(claimed)
        room = 0 if stream.gone() else max(0, stream.room)
        take, rest = claimed[:room], claimed[room:]
        if take:
            await self._hand_out([stream] * len(take), take)
        for delivery in reversed(rest):  # each to the head of its lane: oldest last
            await self.give_back(delivery, pump=False)
        for name in {d.task.queue for d in rest}:
            wanted.update(self._listening.get(name, ()))
        if stream.room > 0 and not stream.gone():
            if not self._in_line(stream):
                self._join(stream)
            wanted.add(stream.queues)
        if wanted and later:
            self._background.spawn(self._pump_lines(wanted))
        elif wanted:
            await self._pump_lines(wanted)

    def _ended_beside(self, stream: Stream, ended: Iterable[str]) -> set[Queues]:
        """Free the slots of ended leases; ``stream``'s stay out of line (a refill fills them).
        The lines of the other streams that went back in line."""
        wanted: set[Queues] = set()
        for lease_id in ended:
            held = self._stream_leases.pop(lease_id, None)
            if held is None:
                continue
            held.finished(lease_id)
            if held is stream:
                held.room += 1
            elif self._freed(held):
                wanted.add(held.queues)
        return wanted

    def _freed(self, stream: Stream) -> bool:
        """One of the stream's slots is free. True if it went back in line for tasks (it has
        room: after its prefetch was lowered, a freed slot may leave it still full)."""
        stream.room += 1
        # (_back_in_line, inline: this runs for every task a stream finishes)
        if stream.room > 0 and not stream.closed and not stream.draining:
            line = self._lines.get(stream.queues)
            if line is None or stream not in line:
                self._join(stream)
                return True
        return False

    def _back_in_line(self, stream: Stream) -> bool:
        if (
            stream.room > 0
            and not stream.closed
            and not stream.draining
            and not self._in_line(stream)
        ):
            self._join(stream)
            return True
        return False

    async def resize(self, stream: Stream, prefetch: int) -> None:
        """The stream's prefetch is ``prefetch`` from now on. Its room grows or shrinks by the
        difference (below zero once it holds more than the new prefetch: nothing is taken back,
        and it takes no task until it holds fewer); with room it goes back in line and is
        pumped, without it leaves its line."""
        stream.room += prefetch - stream.prefetch
        stream.prefetch = prefetch
        if stream.room <= 0:
            self._leave(stream)
        elif self._back_in_line(stream):
            await self._pump_lines({stream.queues})

    # -- the pump ----------------------------------------------------------------------------

    def wants(self, queues: Iterable[str] | None) -> bool:
        """Whether a consumer waits for tasks of any of ``queues`` (None: of any queue)."""
        if not self._lines:
            return False
        if queues is None:
            return True
        listening = self._listening
        return any(name in listening for name in queues)

    async def pump(self, queues: Iterable[str] | None = None) -> None:
        """Hand ready tasks of ``queues`` (None: of any queue) to the consumers waiting for
        them, first come first served in each line, until they run out."""
        self._readied += 1
        if not self._lines:
            return
        if queues is None:
            keys = set(self._lines)
        else:
            keys = set()
            listening = self._listening
            for name in queues:
                keys.update(listening.get(name, ()))
        if keys:
            await self._pump_lines(keys)

    async def _pump_lines(self, keys: set[Queues]) -> None:
        self._to_pump.update(keys)
        if self._pumping:  # a pump is already running (only possible with a store that suspends)
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
            to_pump = self._to_pump
            while to_pump:
                key = to_pump.pop()
                if key in self._lines:
                    await self._pump_line(key)
        except WqError as e:
            # The store failed (its database is away): the caller's own work is done, and is not
            # to be reported as failed. The consumers wait on; the pump runs again when the store
            # is back (a shared store says so) or at the next change or sweep.
            log.info("could not hand out ready tasks: %s", e.message)
            self._to_pump.clear()
        finally:
            self._pumping = False

    async def _pump_line(self, key: Queues) -> None:
        # Claim about as many tasks as are ready (one commit in a durable store), and more per
        # call while they keep coming: a single enqueue costs one slot however many consumers
        # wait, and a burst moves in large batches.
        hint = self._store.ready_hint()
        batch = _PUMP_BATCH if hint is None else max(1, min(hint, _PUMP_BATCH))
        while key in self._lines:
            slots = self._slots(key, batch)
            if not slots:
                return
            leases = [consumer.lease for consumer in slots]
            claimed = self._store.claim_many(leases, now=self._clock.now(), queues=key)
            deliveries = await timed(self._events, "claim", claimed)
            if deliveries:
                self._events.handed_out(deliveries)
            await self._hand_out(slots, deliveries)
            if len(deliveries) < len(slots):
                # Nothing more is ready, or the queues' limits allow no more now: a rate limit's
                # next token pumps the line again.
                self._wait_for_token(key)
                return
            batch = min(batch * 8, _PUMP_BATCH)

    # -- limits per queue (docs/design/schedules.md) -----------------------------------------

    def _wait_for_token(self, key: Queues) -> None:
        """A claim for the line ``key`` came back short: if a rate limit kept its consumers from
        ready tasks, have the line pumped when the next token comes (the store says when: its
        limit_hint). One timer for all lines, at the earliest; the pump then claims only what
        the limits allow, for as many consumers as that serves (the others wait on)."""
        when = self._store.limit_hint(key, self._clock.now())
        if when is None:
            return
        known = self._token_lines.get(key)
        if known is None or when < known:
            self._token_lines[key] = when
        if when < self._token_at:
            if self._token_timer is not None:
                self._token_timer.cancel()
            self._token_at = when
            self._token_timer = self._clock.call_at(when, self._token_due)

    def _token_due(self) -> None:
        """The timer of :meth:`_wait_for_token`: pump the lines whose token has come, and set
        it again for the others."""
        self._token_timer = None
        self._token_at = math.inf
        if self._closing:
            return
        now = self._clock.now()
        due = {key for key, when in self._token_lines.items() if when <= now}
        for key in due:
            del self._token_lines[key]
        if self._token_lines:
            self._token_at = when = min(self._token_lines.values())
            self._token_timer = self._clock.call_at(when, self._token_due)
        wanted = {key for key in due if key in self._lines}
        if wanted:
            self._background.spawn(self._pump_lines(wanted))

    async def take_released(self) -> None:
        """What the store's last calls made claimable as a side effect (children released, a
        concurrency slot freed: its ``take_released``): the sweeper woken for the delayed, the
        consumers of those queues fed."""
        released = self._store.take_released()
        if released is None:
            return
        if released.earliest is not None:
            self._wake_by(released.earliest)
        if released.queues:
            await self.pump(released.queues)

    async def _hand_out(self, slots: list[Consumer], deliveries: list[Delivery]) -> None:
        served: dict[Consumer, None] = {}
        stream_leases = self._stream_leases
        earliest = math.inf  # the sweeper must look by the first deadline handed out
        for consumer, delivery in zip(slots, deliveries, strict=False):
            if consumer.gone():
                # It went away while the store was working; nobody saw the task.
                await self.give_back(delivery, pump=False)
                continue
            consumer.room -= 1
            served.pop(consumer, None)  # in the order of their last delivery: round robin goes on
            served[consumer] = None
            if isinstance(consumer, Stream):
                stream_leases[delivery.lease_id] = consumer
            consumer.deliver(delivery)
            if delivery.deadline < earliest:
                earliest = delivery.deadline
        if earliest < math.inf:
            self._wake_by(earliest)
        for consumer in served:  # served ones go to the back of their line: round robin
            self._leave(consumer)
            if consumer.room > 0 and not consumer.gone():
                self._join(consumer)

    def _slots(self, key: Queues, limit: int) -> list[Consumer]:
        """The next ``limit`` claims to make for a line: one per consumer in order, round after
        round while they have room, from no more than ``limit`` consumers at the front."""
        line = self._lines[key]
        front: list[Consumer] = []
        gone: list[Consumer] = []
        for consumer in line:
            if consumer.gone():
                gone.append(consumer)
                continue
            front.append(consumer)
            if len(front) >= limit:
                break
        for consumer in gone:
            self._leave(consumer)
        slots: list[Consumer] = []
        round_ = 0
        while front and len(slots) < limit:
            front = [c for c in front if c.room > round_]
            if not front:
                break
            # Every round until the one whose consumer has least room has the same consumers:
            # those rounds at once (a stream with room for 64 is not 64 rounds of one).
            rounds = min(c.room for c in front) - round_
            left = limit - len(slots)
            whole = min(rounds, left // len(front))
            if whole > 0:
                slots.extend(front * whole)
                round_ += whole
            else:
                slots.extend(front[:left])
                round_ += 1
        return slots
