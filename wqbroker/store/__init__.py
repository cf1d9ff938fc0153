"""The store contract.

A store keeps every task in exactly one of four collections -- ready, handed out, delayed, dead --
and moves tasks between them atomically, keeping the lifetime counters. It applies the retry policy
it was built with, but it never reads the clock: every method that depends on time is handed ``now``
(epoch seconds) by the service. Everything above the store (service, protocols) depends only on this
contract, so a durable backend is a new module implementing these methods.

Rules every backend follows (the contract test suite checks them against each one):

- ``enqueue`` puts a task in ready (``delay == 0``) or delayed; ``enqueued`` +1.
- ``claim`` first promotes delayed tasks that are due, then hands out the oldest ready task under a
  fresh random lease: ``attempts`` +1, ``delivered`` +1, deadline ``now + lease``.
- ``ack``, ``nack`` and ``reclaim`` need the task to be handed out (else :class:`NotFound`) under
  the given lease (else :class:`LeaseLost`). ``ack`` forgets the task (``acked`` +1). ``nack``
  (``nacked`` +1) and ``reclaim`` (``reclaimed`` +1) record the error, then either delay the task
  by the backoff (``retried`` +1) when ``attempts < max_attempts``, or bury it in the dead-letter
  queue (``buried`` +1).
- ``release`` undoes a hand-out that no worker ever saw (its long-poller disconnected): the task
  goes back to the head of ready, ``attempts`` and ``delivered`` are decremented.
- Every method that changes anything returns only once the change is durable (for a durable
  backend: committed), so whatever the service answers after it will survive a crash.
- ``sweep`` reclaims every lease whose deadline is ``<= now`` and promotes every delayed task whose
  time is ``<= now``, at a cost proportional to what is due, and says when the next thing is due.
- ``requeue`` moves a dead task to the tail of ready with ``attempts`` 0 and no error
  (``requeued`` +1); :class:`NotFound` if the task is not dead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from wqbroker.errors import WqError
from wqbroker.models import Delivery, Failure, Stats, SweepResult, Task

__all__ = ["Store"]


class Store(Protocol):
    #: True if no method ever suspends (each call is done in one step of the event loop), as
    #: with the memory store; False if calls wait for I/O, and so may be cut short by a caller's
    #: cancellation at that point.
    never_suspends: bool

    #: Transactions committed so far: each changing call is one (a store that commits groups
    #: concurrent calls together may count fewer), never more than one per call.
    transactions: int

    async def enqueue(self, payload: bytes, *, max_attempts: int, delay: float, now: float) -> Task:
        """Accept a new task. ``delay`` is in seconds (0 for at once)."""
        ...

    async def enqueue_many(
        self, items: Sequence[tuple[bytes, int, float]], *, now: float
    ) -> list[Task]:
        """Accept (payload, max_attempts, delay) tasks at once, in order (one transaction)."""
        ...

    async def claim(self, *, lease: float, now: float) -> Delivery | None:
        """Hand out the oldest ready task for ``lease`` seconds, or None if nothing is ready."""
        ...

    async def claim_many(self, leases: Sequence[float], *, now: float) -> list[Delivery]:
        """Hand out up to ``len(leases)`` ready tasks, oldest first, the i-th for ``leases[i]``
        seconds (fewer if fewer are ready). One transaction in a durable store."""
        ...

    async def ack(self, task_id: str, lease_id: str, *, now: float) -> None: ...

    async def settle_many(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[tuple[str, str, str | None]],
        *,
        now: float,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        """Acks (task_id, lease_id), then nacks (task_id, lease_id, error), in one transaction:
        each outcome is None / a Failure for success, or the error that ack or nack would raise."""
        ...

    async def nack(
        self, task_id: str, lease_id: str, error: str | None, *, now: float
    ) -> Failure: ...

    async def reclaim(self, task_id: str, lease_id: str, error: str, *, now: float) -> Failure:
        """Take a task back from a worker known to be gone, before its lease runs out."""
        ...

    async def release(self, task_id: str, lease_id: str) -> bool:
        """Undo a hand-out nobody saw. False if the lease is no longer current."""
        ...

    async def sweep(self, *, now: float) -> tuple[SweepResult, float | None]:
        """Reclaim expired leases, promote due delayed tasks; return what happened and the
        earliest time anything is due next (None if nothing is scheduled)."""
        ...

    async def stats(self) -> Stats: ...

    def problem(self) -> str | None:
        """Why the store cannot work (it failed and refuses further work), or None if it can."""
        ...

    def held_hint(self) -> int | None:
        """How many tasks are held (ready, delayed and handed out; not dead), if the store knows
        without any I/O (else None). Used to enforce the broker's task limit."""
        ...

    def ready_hint(self) -> int | None:
        """How many tasks are ready, if the store knows without any I/O (else None). Only a hint,
        used to size batches of claims."""
        ...

    async def dead_letters(self, *, limit: int | None = None) -> list[Task]:
        """Dead tasks, in the order they were buried."""
        ...

    async def requeue(self, task_id: str, *, now: float) -> None: ...

    async def close(self) -> None: ...
