"""What the service tells whoever listens: tasks enqueued, handed out, settled, leases gone, and
how long each store call that changes something took.

The service and its dispatcher call an :class:`Events` where the store's answer is known, once per
store call (a batch's deliveries, acks or leases in one event), as dramatiq's middleware hooks
(``after_enqueue``, ``after_ack``) are called. A listener subclasses :class:`Events` and overrides
the events it wants (the base's do nothing); :class:`Fanout` passes every event on to several.
The broker's metrics (``wqbroker.metrics``) listen; nothing else has to know that they do, so a new
store call needs no change anywhere but at its caller: an event where its answer is known, and
:func:`timed` around it if it changes something.

Listeners are called inline, on the event loop's thread, by the request that caused the event:
they must be quick, and they must not raise (an error there would be the request's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final, Literal, TypeVar, get_args

from wqbroker.models import Delivery, Enqueued

R = TypeVar("R")

#: The store calls that change something, as :meth:`Events.store_call` names them: ``settle`` is
#: an ack, a nack or a batch of both; ``requeue`` one task or every dead one; ``pause`` a pause
#: or a resume; ``sweep`` one that reclaimed, promoted or expired something; ``cancel`` a task's
#: cancel or a queue emptied; ``queue`` a queue deleted.
Operation = Literal[
    "enqueue",
    "claim",
    "settle",
    "extend",
    "reclaim",
    "release",
    "sweep",
    "requeue",
    "purge",
    "pause",
    "cancel",
    "queue",
    "schedule",
    "limits",
]
OPERATIONS: Final[tuple[Operation, ...]] = get_args(Operation)


class Events:
    """A listener: every event does nothing unless overridden.

    The store calls are timed only for a listener that overrides :meth:`store_call` (two
    readings of the clock and a frame per call otherwise spent for nothing).
    """

    #: Whether :meth:`store_call` is to be called (set for each subclass: True if it overrides it).
    times_store_calls: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.times_store_calls = cls.store_call is not Events.store_call

    def enqueued(self, done: Sequence[Enqueued]) -> None:
        """An enqueue's answer, one per task asked for (a duplicate, by idempotency key: task
        None)."""

    def handed_out(self, deliveries: Sequence[Delivery]) -> None:
        """Tasks handed out under these leases (by a claim or the pump). One that nobody then
        sees is handed back: its lease is gone (:meth:`leases_gone`)."""

    def settled(self, acked: Sequence[str], nacked: Sequence[str]) -> None:
        """The deliveries of these lease ids were acked, and these nacked (refused ones are not
        here: an unknown task, a lease no longer current)."""

    def leases_gone(self, lease_ids: Sequence[str]) -> None:
        """Leases that ended without a settlement: reclaimed (expired, or their stream ended) or
        handed back (nobody saw the task). Possibly told before the store has answered, and for a
        lease the store then finds no longer current: a listener forgets them, no more."""

    def fired(self, schedule: str, late: float, failed: bool = False) -> None:
        """This broker fired a schedule (docs/design/schedules.md), ``late`` seconds after its
        scheduled time; ``failed``: its enqueue was refused (the fire still counts as done)."""

    def store_call(self, operation: Operation, seconds: float) -> None:
        """A store call that changes something took this long (a commit, in a durable store);
        failed ones included, but a sweep only when it reclaimed or promoted something."""


class Fanout(Events):
    """Every event passed on to each of ``listeners``, in order."""

    def __init__(self, *listeners: Events) -> None:
        self._listeners = listeners
        self._timing = tuple(each for each in listeners if each.times_store_calls)
        self.times_store_calls = bool(self._timing)

    def enqueued(self, done: Sequence[Enqueued]) -> None:
        for each in self._listeners:
            each.enqueued(done)

    def handed_out(self, deliveries: Sequence[Delivery]) -> None:
        for each in self._listeners:
            each.handed_out(deliveries)

    def settled(self, acked: Sequence[str], nacked: Sequence[str]) -> None:
        for each in self._listeners:
            each.settled(acked, nacked)

    def leases_gone(self, lease_ids: Sequence[str]) -> None:
        for each in self._listeners:
            each.leases_gone(lease_ids)

    def fired(self, schedule: str, late: float, failed: bool = False) -> None:
        for each in self._listeners:
            each.fired(schedule, late, failed)

    def store_call(self, operation: Operation, seconds: float) -> None:
        for each in self._timing:
            each.store_call(operation, seconds)


def timed(
    events: Events, operation: Operation, call: Coroutine[Any, Any, R]
) -> Coroutine[Any, Any, R]:
    """``call``, its time told to ``events.store_call`` when it ends (also if it fails); ``call``
    itself, not timed, when nobody listens to store calls: no clock, no frame of its own."""
    if not events.times_store_calls:
        return call
    return _timed(events, operation, call)


def timed_if(
    changed: Callable[[R], bool],
    events: Events,
    operation: Operation,
    call: Coroutine[Any, Any, R],
) -> Coroutine[Any, Any, R]:
    """As :func:`timed`, told only if what ``call`` returns ``changed`` the store."""
    if not events.times_store_calls:
        return call
    return _timed_if(changed, events, operation, call)


async def _timed(events: Events, operation: Operation, call: Coroutine[Any, Any, R]) -> R:
    started = time.perf_counter()
    try:
        return await call
    finally:
        events.store_call(operation, time.perf_counter() - started)


async def _timed_if(
    changed: Callable[[R], bool],
    events: Events,
    operation: Operation,
    call: Coroutine[Any, Any, R],
) -> R:
    started = time.perf_counter()
    result = await call
    if changed(result):
        events.store_call(operation, time.perf_counter() - started)
    return result
