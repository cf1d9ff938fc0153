"""The in-memory store: the default backend, fast, and lost on restart.

All of its state is an :class:`~wqbroker.store.index.Index` (a dict, a deque, heaps), payloads
included. None of its coroutines ever suspends, so each operation is atomic on the event loop and
counts as one transaction.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from wqbroker.errors import WqError
from wqbroker.models import Delivery, Failure, Stats, SweepResult, Task
from wqbroker.retry import Backoff
from wqbroker.store.index import Index, Record


def _delivery(record: Record) -> Delivery:
    assert record.lease_id is not None
    return Delivery(record.view(), record.lease_id, record.deadline)


class MemoryStore:
    never_suspends = True

    def __init__(self, backoff: Backoff | None = None, rng: random.Random | None = None) -> None:
        rng = rng if rng is not None else random.Random()
        backoff = backoff if backoff is not None else Backoff(rng=rng)
        self._index = Index(backoff.delay, rng)
        self.transactions = 0

    async def enqueue(self, payload: bytes, *, max_attempts: int, delay: float, now: float) -> Task:
        self.transactions += 1
        return self._index.enqueue(payload, max_attempts, delay, now).view()

    async def enqueue_many(
        self, items: Sequence[tuple[bytes, int, float]], *, now: float
    ) -> list[Task]:
        enqueue = self._index.enqueue
        tasks = [enqueue(payload, tries, delay, now).view() for payload, tries, delay in items]
        self.transactions += 1
        return tasks

    async def claim(self, *, lease: float, now: float) -> Delivery | None:
        record = self._index.claim(lease, now)
        if record is None:
            return None
        self.transactions += 1
        return _delivery(record)

    async def claim_many(self, leases: Sequence[float], *, now: float) -> list[Delivery]:
        out: list[Delivery] = []
        claim = self._index.claim
        for lease in leases:
            record = claim(lease, now)
            if record is None:
                break
            out.append(_delivery(record))
        if out:
            self.transactions += 1
        return out

    async def ack(self, task_id: str, lease_id: str, *, now: float) -> None:
        self._index.ack(task_id, lease_id)
        self.transactions += 1

    async def nack(self, task_id: str, lease_id: str, error: str | None, *, now: float) -> Failure:
        failure = self._index.nack(task_id, lease_id, error, now)
        self.transactions += 1
        return failure

    async def settle_many(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[tuple[str, str, str | None]],
        *,
        now: float,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        acked, nacked = self._index.settle(acks, nacks, now)
        if acked.count(None) or any(isinstance(n, Failure) for n in nacked):
            self.transactions += 1
        return acked, nacked

    async def reclaim(self, task_id: str, lease_id: str, error: str, *, now: float) -> Failure:
        failure = self._index.reclaim(task_id, lease_id, error, now)
        self.transactions += 1
        return failure

    async def release(self, task_id: str, lease_id: str) -> bool:
        released = self._index.release(task_id, lease_id)
        self.transactions += released
        return released

    async def sweep(self, *, now: float) -> tuple[SweepResult, float | None]:
        result = self._index.sweep(now)
        if result.reclaimed or result.promoted:
            self.transactions += 1
        return result, self._index.next_due()

    async def requeue(self, task_id: str, *, now: float) -> None:
        self._index.requeue(task_id, now)
        self.transactions += 1

    async def stats(self) -> Stats:
        return self._index.stats()

    async def dead_letters(self, *, limit: int | None = None) -> list[Task]:
        return [record.view() for record in self._index.dead(limit)]

    def problem(self) -> str | None:
        return None

    def held_hint(self) -> int | None:
        return self._index.held_count

    def ready_hint(self) -> int | None:
        return self._index.ready_count

    async def close(self) -> None:
        return None

    def check_invariants(self) -> None:
        """Assert the index's structures agree with each other (used by the tests)."""
        self._index.check_invariants()
