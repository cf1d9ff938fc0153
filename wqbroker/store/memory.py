"""The in-memory store: the default backend, fast, and lost on restart.

All of its state is an :class:`~wqbroker.store.index.Index` (dicts, deques, heaps), payloads
included. None of its coroutines ever suspends, so each operation is atomic on the event loop and
counts as one transaction.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from wqbroker.errors import NotFound, WqError, quoted
from wqbroker.models import (
    DEFAULT_QUEUE,
    CancelResult,
    Delivery,
    Enqueued,
    Failure,
    Limits,
    ListKey,
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
from wqbroker.retry import Backoff
from wqbroker.store import FinishedCallback
from wqbroker.store.book import Book, enqueue_fired
from wqbroker.store.index import PENDING, STATE_NAMES, Index, Record


def _ignore(pairs: Sequence[tuple[str, str]]) -> None:
    return None


class MemoryStore:
    never_suspends = True
    shared = False  # this broker alone changes it

    def __init__(self, backoff: Backoff | None = None, rng: random.Random | None = None) -> None:
        rng = rng if rng is not None else random.Random()
        backoff = backoff if backoff is not None else Backoff(rng=rng)
        self._index = Index(backoff.delay, rng)
        self.transactions = 0
        self._finished: FinishedCallback = _ignore
        self._book = Book()  # the schedules (docs/design/schedules.md)

    def _delivery(self, record: Record) -> Delivery:
        assert record.lease_id is not None
        delivery = Delivery(record.view(), record.lease_id, record.deadline)
        if record.flow is not None:
            delivery.parents = self._index.parent_results(record)
        return delivery

    def _tell(self) -> None:
        """Tell of the watched tasks that ended (docs/design/results.md)."""
        if self._index.ended:
            self._finished(self._index.take_ended())

    async def enqueue_many(self, items: Sequence[NewTask], *, now: float) -> list[Enqueued]:
        done = self._index.enqueue_many(items, now)
        for enqueued in done:
            if not enqueued.duplicate:
                self.transactions += 1
                break
        return done

    async def claim(
        self, *, lease: float, now: float, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> Delivery | None:
        record = self._index.claim(queues, lease, now)
        if self._index.ended:  # (tasks met at their expiry)
            self._tell()
        if record is None:
            return None
        self.transactions += 1
        return self._delivery(record)

    async def claim_many(
        self, leases: Sequence[float], *, now: float, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> list[Delivery]:
        out: list[Delivery] = []
        claim = self._index.claim
        delivery = self._delivery
        for lease in leases:
            record = claim(queues, lease, now)
            if record is None:
                break
            out.append(delivery(record))
        if out:
            self.transactions += 1
        if self._index.ended:  # (a watched task ended: docs/design/results.md)
            self._tell()
        return out

    async def ack(
        self, task_id: str, lease_id: str, *, now: float, result: bytes | None = None
    ) -> None:
        self._index.ack(task_id, lease_id, now, result)
        self.transactions += 1
        if self._index.ended:  # (a watched task ended: docs/design/results.md)
            self._tell()

    async def nack(
        self,
        task_id: str,
        lease_id: str,
        error: str | None,
        *,
        now: float,
        delay: float | None = None,
        terminal: bool = False,
    ) -> Failure:
        failure = self._index.nack(task_id, lease_id, error, now, delay=delay, terminal=terminal)
        self.transactions += 1
        if self._index.ended:  # (a watched task ended: docs/design/results.md)
            self._tell()
        return failure

    async def extend(
        self,
        task_id: str,
        lease_id: str,
        *,
        lease: float,
        now: float,
        progress: bytes | None = None,
    ) -> float:
        deadline = self._index.extend(task_id, lease_id, lease, now, progress)
        self.transactions += 1
        return deadline

    async def cancel(self, task_id: str, *, now: float) -> CancelResult:
        result = self._index.cancel(task_id, now)
        if result is None:
            raise NotFound(f"task {quoted(task_id)} does not exist (or was acked)")
        self.transactions += 1
        if self._index.ended:  # (a watched task ended: docs/design/results.md)
            self._tell()
        return result

    async def list_tasks(
        self, queue: str, state: str, *, limit: int, after: ListKey | None = None
    ) -> TaskPage:
        entries, last = self._index.page(queue, state, limit, after)
        tasks = []
        for entry in entries:
            assert isinstance(entry, Record)  # (nothing is ever cold here)
            tasks.append(TaskState(entry.view(), state))
        return TaskPage(tasks, last)

    async def empty_queue(self, queue: str, *, now: float) -> int:
        n = self._index.empty(queue, now)
        if n is None:
            raise NotFound(f"queue {quoted(queue)} does not exist")
        self.transactions += n > 0
        if self._index.ended:  # (a watched task ended: docs/design/results.md)
            self._tell()
        return n

    async def delete_queue(self, queue: str) -> None:
        self._index.delete_queue(queue)
        self.transactions += 1

    async def settle_many(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[NackItem],
        *,
        now: float,
        results: Mapping[str, bytes] | None = None,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        acked, nacked = self._index.settle(acks, nacks, now, results)
        if acked.count(None) or any(isinstance(n, Failure) for n in nacked):
            self.transactions += 1
        if self._index.ended:  # (a watched task ended: docs/design/results.md)
            self._tell()
        return acked, nacked

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
        before = self.transactions
        acked, nacked = await self.settle_many(acks, nacks, now=now, results=results)
        claimed = await self.claim_many(leases, now=now, queues=queues)
        self.transactions = min(self.transactions, before + 1)  # (one step: one transaction)
        return acked, nacked, claimed

    async def reclaim(self, task_id: str, lease_id: str, error: str, *, now: float) -> Failure:
        failure = self._index.reclaim(task_id, lease_id, error, now)
        self.transactions += 1
        if self._index.ended:  # (a watched task ended: docs/design/results.md)
            self._tell()
        return failure

    async def release(self, task_id: str, lease_id: str, *, now: float) -> bool:
        released = self._index.release(task_id, lease_id, now)
        self.transactions += released
        if self._index.ended:  # (a cancelling one: gone)
            self._tell()
        return released

    async def sweep(self, *, now: float) -> tuple[SweepResult, float | None]:
        result = self._index.sweep(now)
        if result.reclaimed or result.promoted or result.expired or result.pruned:
            self.transactions += 1
        if self._index.ended:  # (a watched task ended: docs/design/results.md)
            self._tell()
        return result, self._index.next_due()

    async def requeue(self, task_id: str, *, now: float) -> str:
        name = self._index.requeue(task_id, now)
        self.transactions += 1
        return name

    async def requeue_all(self, *, queue: str | None = None, now: float) -> tuple[int, list[str]]:
        done = self._index.requeue_all(queue, now)
        self.transactions += done[0] > 0
        return done

    async def purge(self, task_id: str) -> None:
        self._index.purge(task_id)
        self.transactions += 1

    async def set_paused(self, queue: str, paused: bool) -> None:
        self.transactions += self._index.set_paused(queue, paused)

    async def stats(self, queue: str | None = None) -> Stats:
        return self._index.stats(queue)

    async def queues(self, *, now: float | None = None) -> list[QueueStats]:
        return self._index.queue_rows(now)

    async def queue_report(self, *, now: float | None = None) -> list[QueueReport]:
        return self._index.queue_report(now)[0]  # (nothing is ever cold here)

    async def set_limits(self, queue: str, limits: Limits | None, *, now: float) -> None:
        self.transactions += self._index.set_limits(queue, limits, now)

    async def lookup(self, task_id: str) -> TaskState | None:
        record = self._index.find(task_id)
        if record is None:
            return None
        return TaskState(record.view(), STATE_NAMES[record.state])

    async def watch(self, task_id: str) -> TaskState:
        record = self._index.find(task_id)
        if record is None:
            raise NotFound(f"task {quoted(task_id)} does not exist (or was acked)")
        if record.state in PENDING:
            self._index.watch(task_id)
        return TaskState(record.view(), STATE_NAMES[record.state])

    def on_finished(self, callback: FinishedCallback) -> None:
        self._finished = callback

    def take_released(self) -> Released | None:
        index = self._index
        if index.released is None:  # (the usual: nothing released; this runs for every ack)
            return None
        return index.take_released()

    async def children(self, task_id: str, *, limit: int) -> tuple[list[str], int]:
        return self._index.children(task_id, limit)

    async def dead_letters(
        self, *, limit: int | None = None, queue: str | None = None
    ) -> list[Task]:
        return [record.view() for record in self._index.dead(limit, queue)]

    def problem(self) -> str | None:
        return None

    def held_hint(self) -> int | None:
        return self._index.held_count

    def queue_hint(self, queue: str) -> bool | None:
        return self._index.has_queue(queue)

    def queue_count_hint(self) -> int | None:
        return self._index.queue_count

    def key_hint(self, queue: str, key: str, now: float) -> bool | None:
        return self._index.key_owner(queue, key, now) is not None

    def ready_hint(self) -> int | None:
        return self._index.ready_count

    def limit_hint(self, queues: Sequence[str], now: float) -> float | None:
        return self._index.limit_hint(queues, now)

    # -- schedules (docs/design/schedules.md) ------------------------------------------------

    async def put_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        stored, changed = self._book.put(schedule, now)
        self.transactions += changed
        return stored

    async def get_schedule(self, name: str) -> Schedule | None:
        return self._book.get(name)

    async def list_schedules(self) -> list[Schedule]:
        return self._book.all()

    async def schedule_count(self) -> int:
        return len(self._book)

    async def delete_schedule(self, name: str) -> bool:
        deleted = self._book.delete(name)
        self.transactions += deleted
        return deleted

    async def set_schedule_paused(
        self, name: str, paused: bool, next_fire_at: float | None, *, now: float
    ) -> Schedule | None:
        stored, changed = self._book.set_paused(name, paused, next_fire_at, now)
        self.transactions += changed
        return stored

    async def due_schedules(self, now: float) -> tuple[float, list[Schedule], float | None]:
        due, later = self._book.due(now)
        return now, due, later

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
        book = self._book
        if not book.firable(name, expected, revision):
            return None
        _, done = enqueue_fired(self._index, task, now)
        book.fire(name, expected, revision, scheduled_for, next_fire_at, done.id)
        self.transactions += 1
        return done

    async def skip_schedule(
        self, name: str, expected: float, next_fire_at: float, *, revision: int
    ) -> bool:
        moved = self._book.fire(name, expected, revision, expected, next_fire_at, None)
        self.transactions += moved is not None
        return moved is not None

    async def close(self) -> None:
        return None

    def check_invariants(self) -> None:
        """Assert the index's structures agree with each other (used by the tests)."""
        self._index.check_invariants()
