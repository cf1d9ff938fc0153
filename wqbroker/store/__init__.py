"""The store contract.

A store keeps every task in exactly one of four collections -- ready, handed out, delayed, dead --
and moves tasks between them atomically, keeping the lifetime counters (for the whole store and for
each named queue). It applies the retry policy it was built with, but it never reads the clock:
every method that depends on time is handed ``now`` (epoch seconds) by the service. Everything
above the store (service, protocols) depends only on this contract, so a durable backend is a new
module implementing these methods.

The contract is three protocols, so that a store implements only what it has:

- :class:`Operations`: the calls that change or read tasks (async), and what a store is
  (``never_suspends``, ``shared``, ``transactions``, ``problem``);
- :class:`Hints`: what a store can tell without any I/O (or None when it cannot), used to enforce
  the broker's limits and to size batches;
- :class:`ReadyListener`: ``on_ready``, only for a store that learns of tasks made ready elsewhere
  (PostgreSQL: other brokers). The service asks ``isinstance(store, ReadyListener)``.

:class:`Store` is what the service and the dispatcher hold: the operations and the hints. The
backends: memory.py, sqlite.py (both an :class:`~wqbroker.store.index.Index`), postgres/ (a
package: operations, listener, group commit, SQL files, migrations); migrate.py runs the numbered
migration files of both SQL stores.

Rules every backend follows (the contract test suite checks them against each one):

- ``enqueue_many`` puts each task in ready (``delay == 0``) or delayed, in its queue at its
  priority; ``enqueued`` +1 each. A task whose idempotency key (with its queue) was recorded and
  has not expired creates nothing and is answered as a duplicate of the first task's id, even if
  that task is gone; a new key is recorded until ``key_until``.
- ``claim_many`` first promotes delayed tasks that are due, then hands out ready tasks from the
  first of the listed queues that has one (paused queues are skipped): highest priority first,
  oldest first within a priority, each under a fresh random lease: ``attempts`` +1, ``delivered``
  +1, deadline ``now + lease``.
- ``ack``, ``nack``, ``extend`` and ``reclaim`` need the task to be handed out (else
  :class:`NotFound`) under the given lease (else :class:`LeaseLost`). ``ack`` forgets the task
  (``acked`` +1). ``extend`` moves the deadline to ``now + lease``. ``nack`` (``nacked`` +1) and
  ``reclaim`` (``reclaimed`` +1) record the error, then either delay the task (``retried`` +1) by
  the backoff, or by the nack's ``delay``, when ``attempts < max_attempts`` and the nack is not
  ``terminal``, or bury it in the dead-letter queue (``buried`` +1).
- ``settle_claim`` is ``settle_many`` then ``claim_many``, in one transaction.
- ``release`` undoes a hand-out that no worker ever saw (its long-poller disconnected): the task
  goes back to the head of its lane, ``attempts`` and ``delivered`` are decremented.
- Every method that changes anything returns only once the change is durable (for a durable
  backend: committed), so whatever the service answers after it will survive a crash.
- ``sweep`` reclaims every lease whose deadline is ``<= now`` and promotes every delayed task whose
  time is ``<= now``, at a cost proportional to what is due, and says when the next thing is due.
- ``requeue`` moves a dead task to the tail of ready with ``attempts`` 0 and no error
  (``requeued`` +1); :class:`NotFound` if the task is not dead. ``requeue_all`` does it to every
  dead task (of a queue). ``purge`` drops a dead task for good (``purged`` +1).
- ``set_paused`` pauses or resumes a queue: a paused queue takes tasks but hands none out.

Control over tasks (docs/design/control.md says it in full; the contract suite checks it):

- ``cancel``: a ready or delayed task is gone (``cancelled`` +1); a handed-out one becomes
  cancelling (answered with its lease id); a dead one is purged. A cancelling task's ack counts as
  usual; its nack or reclaim (and its lease running out in a sweep) drops it, counted
  ``cancelled`` only (``Failure.cancelled``); its ``extend`` raises :class:`Cancelled`.
- ``expires_at``: a task is never handed out at or after it. A claim that meets one, and the sweep
  (at a cost in what is due), drop it, counted ``expired``. Dead tasks never expire.
- ``timeout``: a claim records when the task was handed out, and its deadline is at most that
  plus the timeout; ``extend`` cuts the deadline to that limit, and raises
  :class:`TimeLimitReached` when it cannot move it at all.
- ``unique`` keys hold while their task is ready, delayed or handed out (a duplicate is answered
  with that task's id), not in the window; a requeued dead task no longer holds its key.
- ``extend`` with ``progress`` records it on the task (shown while it is handed out).
- ``list_tasks``: a page of a queue's tasks in one state, in that state's order, after a key the
  store gave (``TaskPage.after``), in O(limit + log n).
- ``empty_queue`` cancels every ready and delayed task of a queue; ``delete_queue`` forgets a
  queue that holds nothing.
- The four gauges always add up to ``enqueued - acked - purged - cancelled - expired``.

Results and workflows (docs/design/results.md says it in full; the contract suite checks it):

- an ack with a result (``ack(result=)``, ``settle_many(results=)``) of a task whose
  ``result_ttl`` is above 0 keeps it, ``succeeded``, with ``result`` and ``finished_at``, until
  ``finished_at + result_ttl`` and no child that names it in its ``after`` is left; ``sweep``
  prunes those that are due (``SweepResult.pruned``). It counts ``acked`` as any ack.
- ``NewTask.after``: a task with a parent not yet succeeded is ``waiting``; the ack of its last
  pending parent (with or without a result) makes it ready (or delayed by its ``delay``), in the
  same transaction; ``take_released`` then names the queues (and the earliest due time). A
  parent that ends dead, cancelled or expired buries its waiting children, transitively; a
  cancelled waiting task cancels its waiting children, transitively. An unknown parent raises
  :class:`~wqbroker.errors.UnknownParent` and nothing of the call is enqueued.
- a delivery of a task with parents carries them (``Delivery.parents``), with the results held.
- ``watch`` marks a pending task watched; ``on_finished``'s callback hears of every watched task
  that ends (on any broker of a shared store).
- ``ready + handed_out + delayed + dead + waiting == enqueued - acked - purged - cancelled -
  expired``.

Schedules and limits (docs/design/schedules.md says it in full; the contract suite checks it):

- schedules are rows by name; ``fire_schedule`` enqueues a schedule's task and moves its
  ``next_fire_at`` in one transaction, only if ``next_fire_at`` and ``revision`` are still the
  ones expected and the schedule is not paused (a compare-and-set: each fire enqueues exactly one
  task, whichever broker and however many try). ``due_schedules`` costs what is due.
- ``set_limits``: a claim hands out from a queue no more than its token bucket holds (``rate``)
  and never more than ``concurrency`` tasks of it at once, over every broker of a shared store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from wqbroker.errors import WqError
from wqbroker.models import (
    DEFAULT_QUEUE,
    CancelResult,
    Delivery,
    Enqueued,
    Failure,
    Limits,
    NackItem,
    NewTask,
    QueueReport,
    QueueStats,
    Released,
    Schedule,
    Stats,
    SweepResult,
    Task,
    TaskPage,
    TaskState,
)

__all__ = [
    "CancelListener",
    "FinishedCallback",
    "Hints",
    "Operations",
    "ReadyListener",
    "Store",
    "enqueue_one",
]

#: ``on_finished``'s callback: ``(task_id, state)`` pairs of watched tasks that ended, ``state``
#: one of ``succeeded``, ``acked``, ``dead``, ``cancelled``, ``expired``.
FinishedCallback = Callable[[Sequence[tuple[str, str]]], None]


class Operations(Protocol):
    """The calls every store answers: the tasks' changes and reads, and what the store is."""

    #: True if no method ever suspends (each call is done in one step of the event loop), as
    #: with the memory store; False if calls wait for I/O, and so may be cut short by a caller's
    #: cancellation at that point.
    never_suspends: bool

    #: True if other brokers share the store (PostgreSQL): tasks may become ready without this
    #: broker's doing, and it learns of it by polling, and through ``on_ready`` (such a store is
    #: a :class:`ReadyListener`).
    shared: bool

    #: Transactions committed so far: each changing call is one (a store that commits groups
    #: concurrent calls together may count fewer), never more than one per call.
    transactions: int

    async def enqueue_many(self, items: Sequence[NewTask], *, now: float) -> list[Enqueued]:
        """Accept tasks at once, in order (one transaction)."""
        ...

    async def claim(
        self, *, lease: float, now: float, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> Delivery | None:
        """Hand out the next ready task of ``queues``, or None if none is ready."""
        ...

    async def claim_many(
        self, leases: Sequence[float], *, now: float, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> list[Delivery]:
        """Hand out up to ``len(leases)`` ready tasks of ``queues`` (in order of preference),
        the i-th for ``leases[i]`` seconds (fewer if fewer are ready). One transaction."""
        ...

    async def ack(
        self, task_id: str, lease_id: str, *, now: float, result: bytes | None = None
    ) -> None:
        """Ack: the task is forgotten, or (``result``, JSON text, and a result TTL above 0)
        kept as succeeded. Its waiting children whose last pending parent it was are released
        (``take_released``)."""
        ...

    async def settle_many(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[NackItem],
        *,
        now: float,
        results: Mapping[str, bytes] | None = None,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        """Acks (task_id, lease_id), then nacks, in one transaction: each outcome is None / a
        Failure for success, or the error that ack or nack would raise. ``results``: the
        result of an ack, by task id (as ``ack``'s)."""
        ...

    async def settle_claim(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[NackItem],
        leases: Sequence[float],
        *,
        now: float,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
        results: Mapping[str, bytes] | None = None,
    ) -> tuple[list[WqError | None], list[Failure | WqError], list[Delivery]]:
        """``settle_many`` and ``claim_many`` in one transaction: the outcomes of the acks and
        nacks, and up to ``len(leases)`` tasks handed out (whatever the outcomes: a caller that
        was given more than the settlements freed hands the rest back). A worker's stream that
        acks its tasks gets their successors in the same commit."""
        ...

    async def nack(
        self,
        task_id: str,
        lease_id: str,
        error: str | None,
        *,
        now: float,
        delay: float | None = None,
        terminal: bool = False,
    ) -> Failure: ...

    async def extend(
        self,
        task_id: str,
        lease_id: str,
        *,
        lease: float,
        now: float,
        progress: bytes | None = None,
    ) -> float:
        """A new deadline, ``now + lease`` (cut to its time limit), for a task held under
        ``lease_id``; returns it. ``progress`` (JSON text): recorded on the task. Cancelled if
        the task is cancelling, TimeLimitReached if the deadline is at the limit already."""
        ...

    async def cancel(self, task_id: str, *, now: float) -> CancelResult:
        """Cancel a task: a ready or delayed one is gone (CANCELLED); a handed-out one becomes
        cancelling (CANCELLING, with its lease id; again if it already was); a dead one is
        purged (PURGED). NotFound if there is no such task."""
        ...

    async def list_tasks(
        self, queue: str, state: str, *, limit: int, after: tuple[float, ...] | None = None
    ) -> TaskPage:
        """Up to ``limit`` tasks of ``queue`` in ``state`` (one of LIST_STATES), in that state's
        order, after the task whose key is ``after`` (a page's ``after`` this store gave; None:
        from the start). The page's ``after`` is None when no task follows it."""
        ...

    async def empty_queue(self, queue: str, *, now: float) -> int:
        """Drop every ready, delayed and waiting task of ``queue``, counted cancelled (each as a
        cancel would: their waiting children buried or cancelled): how many. NotFound if the
        queue is unknown."""
        ...

    async def delete_queue(self, queue: str) -> None:
        """Forget a queue that holds nothing (its four gauges and ``waiting`` 0): its paused
        flag and totals, and the results it holds. NotFound if it is unknown; Conflict, naming
        its counts, if it holds tasks."""
        ...

    async def watch(self, task_id: str) -> TaskState:
        """The task and its state (NotFound if there is none); a pending one (ready, delayed,
        handed out, waiting) is marked watched, so that its end is told to ``on_finished``'s
        callback (on whichever broker of a shared store ends it). One call."""
        ...

    def on_finished(self, callback: FinishedCallback) -> None:
        """Have ``callback(pairs)`` called with ``(task_id, state)`` for every watched task that
        ends (see :data:`FinishedCallback`), once the change is durable; a shared store also
        calls it for watched tasks other brokers end."""
        ...

    def take_released(self) -> Released | None:
        """What became ready or delayed as a side effect of the calls since the last
        ``take_released`` (children released by their last parent's ack): the queues, and the
        earliest due time of those delayed; None if nothing was. The queues also name those
        whose tasks may be claimed again though none became ready: a queue at its concurrency
        limit (docs/design/schedules.md) one of whose tasks was acked, nacked or reclaimed. No
        I/O."""
        ...

    async def children(self, task_id: str, *, limit: int) -> tuple[list[str], int]:
        """The first ``limit`` live children of a task (tasks naming it in their ``after``,
        oldest first) and how many there are (0 and [] for a task with none or unknown)."""
        ...

    async def reclaim(self, task_id: str, lease_id: str, error: str, *, now: float) -> Failure:
        """Take a task back from a worker known to be gone, before its lease runs out."""
        ...

    async def release(self, task_id: str, lease_id: str, *, now: float) -> bool:
        """Undo a hand-out nobody saw. False if the lease is no longer current."""
        ...

    async def sweep(self, *, now: float) -> tuple[SweepResult, float | None]:
        """Reclaim expired leases, promote due delayed tasks; return what happened and the
        earliest time anything is due next (None if nothing is scheduled)."""
        ...

    async def stats(self, queue: str | None = None) -> Stats:
        """The gauges and totals of the whole store, or of one queue (zeros if unknown)."""
        ...

    async def queues(self, *, now: float | None = None) -> list[QueueStats]:
        """Every queue known, by name; a rate-limited queue's tokens as of ``now`` (None: as
        its last claim left them; PostgreSQL with the database's clock: its clock)."""
        ...

    async def queue_report(self, *, now: float | None = None) -> list[QueueReport]:
        """Every queue known, by name, with its gauges, its totals and when its oldest ready
        task became ready (for ``/metrics``): one snapshot, at a cost in the number of queues
        and priorities, never in the number of tasks (the oldest ready task of a queue is the
        earliest ``available_at`` among the heads of its priority lanes: an index lookup each)."""
        ...

    async def lookup(self, task_id: str) -> TaskState | None:
        """The task and its state, if it exists (acked or purged tasks do not)."""
        ...

    async def dead_letters(
        self, *, limit: int | None = None, queue: str | None = None
    ) -> list[Task]:
        """Dead tasks (of one queue, or all), in the order they were buried."""
        ...

    async def requeue(self, task_id: str, *, now: float) -> str:
        """Requeue a dead task; returns its queue's name."""
        ...

    async def requeue_all(self, *, queue: str | None = None, now: float) -> tuple[int, list[str]]:
        """Requeue every dead task (of one queue): how many, and the queues that got them."""
        ...

    async def purge(self, task_id: str) -> None: ...

    async def set_paused(self, queue: str, paused: bool) -> None: ...

    async def close(self) -> None: ...

    def problem(self) -> str | None:
        """Why the store cannot work (it failed and refuses further work), or None if it can."""
        ...

    # -- schedules and limits (docs/design/schedules.md) -----------------------------------

    async def put_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        """Insert or replace the schedule of that name (a replace keeps ``created_at``,
        ``fires``, ``last_fire_at`` and ``last_task_id``); returns it as stored. A replace
        also keeps the stored ``next_fire_at`` when both are not paused and have the same
        rule (``cron``, ``timezone``, ``every``): the one given is for a new rule. One the
        same as stored (rule, task, ``paused``) is left as it stands; any other write draws a
        new ``revision``, and sets ``updated_at`` to ``now``."""
        ...

    async def get_schedule(self, name: str) -> Schedule | None: ...

    async def list_schedules(self) -> list[Schedule]:
        """Every schedule, by name."""
        ...

    async def delete_schedule(self, name: str) -> bool:
        """Delete a schedule: False if there was none of that name."""
        ...

    async def schedule_count(self) -> int:
        """How many schedules there are (for the broker's limit on them)."""
        ...

    async def set_schedule_paused(
        self, name: str, paused: bool, next_fire_at: float | None, *, now: float
    ) -> Schedule | None:
        """Pause or resume a schedule, setting its ``next_fire_at`` (None to pause) and drawing
        a new ``revision``; one already paused (or not) is left as it stands. None if there is
        none."""
        ...

    async def due_schedules(self, now: float) -> tuple[float, list[Schedule], float | None]:
        """The store's now (``now``, or the database's clock), the schedules not paused whose
        ``next_fire_at`` is at or before it, and the earliest ``next_fire_at`` of the others
        (None: none)."""
        ...

    async def fire_schedule(
        self,
        name: str,
        expected: float,
        scheduled_for: float,
        next_fire_at: float,
        task: NewTask,
        *,
        now: float,
        revision: int,
    ) -> Enqueued | None:
        """If the schedule exists, is not paused, and its ``next_fire_at`` is ``expected`` and
        its ``revision`` is ``revision`` (it is as it was read): enqueue ``task`` (as
        ``enqueue_many`` would, with its ``schedule`` and ``scheduled_for``, which its views
        show) and set ``next_fire_at``, ``last_fire_at = scheduled_for``, ``last_task_id`` and
        ``fires + 1``, in one transaction. Else nothing (None). PostgreSQL: a row another
        transaction holds is skipped (None), not waited for."""
        ...

    async def skip_schedule(
        self, name: str, expected: float, next_fire_at: float, *, revision: int
    ) -> bool:
        """A fire the broker refused (its task would break the broker's limits): as
        ``fire_schedule``'s compare-and-set, but only ``next_fire_at`` moves (nothing is
        enqueued, nothing counted). Whether it moved."""
        ...

    async def set_limits(self, queue: str, limits: Limits | None, *, now: float) -> None:
        """Set (None or empty: clear) a queue's limits, creating the queue if unknown; a rate
        bucket starts full."""
        ...


class Hints(Protocol):
    """What a store can tell without any I/O: each answers None when the store cannot tell."""

    def held_hint(self) -> int | None:
        """How many tasks are held (ready, delayed, handed out, waiting, and results held; not
        dead), if the store knows without any I/O (else None). Used to enforce the broker's task
        limit."""
        ...

    def queue_hint(self, queue: str) -> bool | None:
        """Whether the store knows a queue of this name, if it can tell without any I/O (else
        None). Used to enforce the broker's queue limit."""
        ...

    def queue_count_hint(self) -> int | None:
        """How many queues the store knows, if it can tell without any I/O (else None)."""
        ...

    def key_hint(self, queue: str, key: str, now: float) -> bool | None:
        """Whether an enqueue with this idempotency key would be a duplicate in that queue (the
        key is in its window, or a unique key held by an active task), if the store can tell
        without any I/O (else None)."""
        ...

    def limit_hint(self, queues: Sequence[str], now: float) -> float | None:
        """When a claim of ``queues`` that got nothing because of a rate limit may get a task
        (the earliest time a limited queue with ready tasks has a token again; ``now`` or
        before if it has one already), if the store can tell without any I/O (else None: no
        such queue, or it cannot tell). The dispatcher pumps the claim's line then."""
        ...

    def ready_hint(self) -> int | None:
        """How many tasks are ready, if the store knows without any I/O (else None). Only a hint,
        used to size batches of claims."""
        ...


class Store(Operations, Hints, Protocol):
    """What the service and the dispatcher hold: a store's operations and its hints."""


@runtime_checkable
class ReadyListener(Protocol):
    """A store that learns of tasks made ready by no call of this broker's (a shared store: other
    brokers enqueue too). A store without one defines nothing; the service asks
    ``isinstance(store, ReadyListener)``."""

    def on_ready(self, callback: Callable[[Iterable[str] | None], None]) -> None:
        """Have ``callback(queues)`` called when tasks become ready in ``queues`` (None: in any
        queue) by no call of this broker's (only a shared store ever calls it)."""
        ...


@runtime_checkable
class CancelListener(Protocol):
    """A store that learns of cancels made on other brokers (a shared store), so that a stream
    of this broker's holding the task is told at once."""

    def on_cancel(self, callback: Callable[[Iterable[str]], None]) -> None:
        """Have ``callback(lease_ids)`` called with the leases of tasks another broker made
        cancelling."""
        ...


async def enqueue_one(
    store: Store,
    payload: bytes,
    *,
    max_attempts: int,
    delay: float,
    now: float,
    queue: str = DEFAULT_QUEUE,
    priority: int = 0,
    key: str | None = None,
    key_until: float = 0.0,
) -> Enqueued:
    """One task, through ``enqueue_many`` (for tests and tools: the service always batches)."""
    new = NewTask(payload, max_attempts, delay, queue, priority, key, key_until)
    return (await store.enqueue_many((new,), now=now))[0]
