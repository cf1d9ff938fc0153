"""Random sequences of store operations against a model of where every task should be.

A Hypothesis state machine drives one store (built from a backend name, so it runs against every
backend in ``BACKENDS``) through enqueue (with and without delay), claim, ack, nack, reclaim,
release, requeue, lease expiry and clock advances with a sweep, and mirrors each step in a plain
model: a ready queue, the handed-out tasks with their leases, the delayed tasks with their due
times, and the dead-letter queue in burial order. After every step it checks that each task is in
exactly one collection, that the store's gauges, totals and dead-letter queue match the model, and
that ``nacked + reclaimed == retried + buried``.

The backoff's random draw is pinned (u = 0.5, so a retry waits 3/4 of the nominal delay) so that
the model knows exactly when each retry becomes due; the jitter itself is covered elsewhere.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.helpers import BACKENDS, SQLITE_HOT, invariant_holds, make_store
from wqbroker.errors import LeaseLost, NotFound
from wqbroker.models import Delivery, Totals
from wqbroker.retry import Backoff
from wqbroker.store import Store
from wqbroker.store.memory import MemoryStore
from wqbroker.store.sqlite import SqliteStore

T = TypeVar("T")

START = 1_000_000.0
U = 0.5  # the pinned backoff draw


class PinnedRandom(random.Random):
    def random(self) -> float:
        return U


def retry_wait(attempts: int) -> float:
    nominal = min(30.0, 2.0 ** (attempts - 1))
    return nominal / 2 + nominal / 2 * U


@dataclass
class ModelTask:
    id: str
    payload: bytes
    max_attempts: int
    attempts: int = 0
    last_error: str | None = None
    lease_id: str | None = None  # when handed out
    deadline: float = 0.0  # when handed out
    claim_seq: int = 0  # when handed out: tie-break for equal deadlines
    due: float = 0.0  # when delayed
    delay_seq: int = 0  # when delayed: tie-break for equal due times


# Times are sums of binary fractions so the store and the model agree exactly.
LEASES = st.sampled_from([1.0, 2.0, 5.0, 10.0])
DELAYS = st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0])
STEPS = st.sampled_from([0.25, 0.5, 1.0, 2.0, 5.0, 16.0, 31.0])
ERRORS = st.sampled_from([None, "boom", "timeout", ""])


class StoreMachine(RuleBasedStateMachine):
    backend = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = tempfile.TemporaryDirectory(prefix="wq-stateful-")
        self.backoff = Backoff(1.0, 30.0, PinnedRandom())
        self.store: Store = self.loop.run_until_complete(
            make_store(self.backend, self.backoff, random.Random(0), self.tmp.name)
        )
        self.now = START
        self.seq = 0
        self.payload_n = 0
        # the model: every live task in exactly one of these
        self.ready: deque[str] = deque()
        self.handed: dict[str, ModelTask] = {}
        self.delayed: dict[str, ModelTask] = {}
        self.dead: list[str] = []  # burial order
        self.tasks: dict[str, ModelTask] = {}  # every task not yet acked
        self.acked: set[str] = set()
        self.old_leases: list[tuple[str, str]] = []  # (task id, lease id) no longer current
        self.totals = Totals()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            self.run(self.store.close())
        finally:
            self.loop.close()
            self.tmp.cleanup()

    # -- model helpers ---------------------------------------------------------------------

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def to_delayed(self, task: ModelTask, due: float) -> None:
        task.due = due
        task.delay_seq = self.next_seq()
        self.delayed[task.id] = task

    def promote_due(self) -> int:
        due = sorted(
            (t for t in self.delayed.values() if t.due <= self.now),
            key=lambda t: (t.due, t.delay_seq),
        )
        for task in due:
            del self.delayed[task.id]
            self.ready.append(task.id)
        return len(due)

    def fail(self, task: ModelTask, error: str | None) -> tuple[bool, float | None]:
        """The model of a failed delivery: retry or bury. Returns (buried, retry_at)."""
        del self.handed[task.id]
        self.old_leases.append((task.id, task.lease_id or ""))
        task.lease_id = None
        task.last_error = error
        if task.attempts < task.max_attempts:
            retry_at = self.now + retry_wait(task.attempts)
            self.to_delayed(task, retry_at)
            self.totals.retried += 1
            return False, retry_at
        self.dead.append(task.id)
        self.totals.buried += 1
        return True, None

    def next_due(self) -> float | None:
        times = [t.deadline for t in self.handed.values()]
        times += [t.due for t in self.delayed.values()]
        return min(times) if times else None

    def sweep_and_check(self) -> None:
        expired = sorted(
            (t for t in self.handed.values() if t.deadline <= self.now),
            key=lambda t: (t.deadline, t.claim_seq),
        )
        expected_reclaims = sorted((t.id, t.lease_id or "") for t in expired)
        for task in expired:
            self.totals.reclaimed += 1
            self.fail(task, "lease expired")
        promoted = self.promote_due()
        result, next_due = self.run(self.store.sweep(now=self.now))
        assert sorted(result.reclaimed) == expected_reclaims
        assert result.promoted == promoted
        assert next_due == self.next_due()

    # -- rules -----------------------------------------------------------------------------

    @initialize(
        tasks=st.lists(st.tuples(DELAYS, st.integers(1, 3)), max_size=6),
        claims=st.integers(0, 4),
        lease=LEASES,
    )
    def start(self, tasks: list[tuple[float, int]], claims: int, lease: float) -> None:
        stats = self.run(self.store.stats())
        assert stats.totals == Totals()
        for delay, max_attempts in tasks:
            self.enqueue(delay, max_attempts)
        for _ in range(claims):
            self.claim(lease)

    @rule(delay=DELAYS, max_attempts=st.integers(1, 3))
    def enqueue(self, delay: float, max_attempts: int) -> None:
        self.payload_n += 1
        payload = b'{"n": %d}' % self.payload_n
        view = self.run(
            self.store.enqueue(payload, max_attempts=max_attempts, delay=delay, now=self.now)
        )
        assert view.id not in self.tasks
        assert view.id not in self.acked
        assert (view.attempts, view.max_attempts, view.payload) == (0, max_attempts, payload)
        assert view.available_at == self.now + delay
        task = ModelTask(view.id, payload, max_attempts)
        self.tasks[task.id] = task
        if delay > 0:
            self.to_delayed(task, self.now + delay)
        else:
            self.ready.append(task.id)
        self.totals.enqueued += 1

    @rule(tasks=st.lists(st.tuples(DELAYS, st.integers(1, 3)), max_size=4))
    def enqueue_many(self, tasks: list[tuple[float, int]]) -> None:
        items = []
        for delay, max_attempts in tasks:
            self.payload_n += 1
            items.append((b'{"n": %d}' % self.payload_n, max_attempts, delay))
        views = self.run(self.store.enqueue_many(items, now=self.now))
        assert [(v.payload, v.max_attempts) for v in views] == [(p, m) for p, m, _ in items]
        for view, (payload, max_attempts, delay) in zip(views, items, strict=True):
            assert view.id not in self.tasks
            assert view.id not in self.acked
            assert view.attempts == 0
            assert view.available_at == self.now + delay
            task = ModelTask(view.id, payload, max_attempts)
            self.tasks[task.id] = task
            if delay > 0:
                self.to_delayed(task, self.now + delay)
            else:
                self.ready.append(task.id)
            self.totals.enqueued += 1

    @rule(lease=LEASES)
    def claim(self, lease: float) -> None:
        self.promote_due()
        delivery = self.run(self.store.claim(lease=lease, now=self.now))
        if not self.ready:
            assert delivery is None
            return
        assert delivery is not None
        self.handed_out(delivery, lease)

    @rule(leases=st.lists(LEASES, max_size=4))
    def claim_many(self, leases: list[float]) -> None:
        if leases:  # asking for nothing need not touch anything
            self.promote_due()
        deliveries = self.run(self.store.claim_many(leases, now=self.now))
        assert len(deliveries) == min(len(leases), len(self.ready))
        for delivery, lease in zip(deliveries, leases, strict=False):
            self.handed_out(delivery, lease)

    def handed_out(self, delivery: Delivery, lease: float) -> None:
        """The model of a hand-out: the oldest ready task, under a fresh lease."""
        task = self.tasks[self.ready.popleft()]
        assert delivery.task.id == task.id, "not the oldest ready task"
        task.attempts += 1
        assert delivery.task.attempts == task.attempts
        assert delivery.task.max_attempts == task.max_attempts
        assert delivery.task.payload == task.payload
        assert delivery.task.last_error == task.last_error
        assert delivery.deadline == self.now + lease
        assert all(delivery.lease_id != lease_id for _, lease_id in self.old_leases)
        assert all(delivery.lease_id != t.lease_id for t in self.handed.values())
        task.lease_id = delivery.lease_id
        task.deadline = delivery.deadline
        task.claim_seq = self.next_seq()
        self.handed[task.id] = task
        self.totals.delivered += 1

    def pick_handed(self, data: st.DataObject) -> ModelTask:
        return self.handed[data.draw(st.sampled_from(sorted(self.handed)), label="handed")]

    @precondition(lambda self: self.handed)
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        task = self.pick_handed(data)
        self.run(self.store.ack(task.id, task.lease_id or "", now=self.now))
        del self.handed[task.id]
        del self.tasks[task.id]
        self.acked.add(task.id)
        self.old_leases.append((task.id, task.lease_id or ""))
        self.totals.acked += 1

    @precondition(lambda self: self.handed)
    @rule(data=st.data(), error=ERRORS)
    def nack(self, data: st.DataObject, error: str | None) -> None:
        task = self.pick_handed(data)
        failure = self.run(self.store.nack(task.id, task.lease_id or "", error, now=self.now))
        self.totals.nacked += 1
        buried, retry_at = self.fail(task, error)
        assert (failure.task_id, failure.buried, failure.retry_at) == (task.id, buried, retry_at)

    @precondition(lambda self: self.handed)
    @rule(data=st.data())
    def reclaim(self, data: st.DataObject) -> None:
        task = self.pick_handed(data)
        failure = self.run(self.store.reclaim(task.id, task.lease_id or "", "gone", now=self.now))
        self.totals.reclaimed += 1
        buried, retry_at = self.fail(task, "gone")
        assert (failure.task_id, failure.buried, failure.retry_at) == (task.id, buried, retry_at)

    @precondition(lambda self: self.handed)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        task = self.pick_handed(data)
        assert self.run(self.store.release(task.id, task.lease_id or "")) is True
        del self.handed[task.id]
        self.old_leases.append((task.id, task.lease_id or ""))
        task.lease_id = None
        task.attempts -= 1
        self.ready.appendleft(task.id)
        self.totals.delivered -= 1

    @precondition(lambda self: self.handed)
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        """A worker goes silent: time reaches its deadline and the sweeper runs."""
        task = self.pick_handed(data)
        self.now = max(self.now, task.deadline)
        self.sweep_and_check()
        assert task.id not in self.handed

    @rule(step=STEPS)
    def advance_and_sweep(self, step: float) -> None:
        self.now += step
        self.sweep_and_check()

    @rule(step=STEPS)
    def advance_without_sweep(self, step: float) -> None:
        # nothing moves until a claim or a sweep looks at the clock
        self.now += step

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        task_id = data.draw(st.sampled_from(self.dead), label="dead")
        self.run(self.store.requeue(task_id, now=self.now))
        self.dead.remove(task_id)
        task = self.tasks[task_id]
        task.attempts = 0
        task.last_error = None
        self.ready.append(task_id)
        self.totals.requeued += 1

    @rule(data=st.data())
    def requeue_not_dead(self, data: st.DataObject) -> None:
        candidates = [*sorted({*self.tasks, *self.acked} - set(self.dead)), "no-such-task"]
        task_id = data.draw(st.sampled_from(candidates), label="not dead")
        try:
            self.run(self.store.requeue(task_id, now=self.now))
        except NotFound:
            return
        raise AssertionError(f"requeue of {task_id}, which is not dead, did not raise NotFound")

    @precondition(lambda self: self.handed)
    @rule(data=st.data(), op=st.sampled_from(["ack", "nack", "reclaim", "release"]))
    def use_a_wrong_lease(self, data: st.DataObject, op: str) -> None:
        task = self.pick_handed(data)
        self.try_stale(op, task.id, "not-a-lease")

    @precondition(lambda self: self.old_leases)
    @rule(data=st.data(), op=st.sampled_from(["ack", "nack", "reclaim", "release"]))
    def use_a_stale_lease(self, data: st.DataObject, op: str) -> None:
        task_id, lease_id = data.draw(st.sampled_from(self.old_leases), label="stale lease")
        self.try_stale(op, task_id, lease_id)

    def try_stale(self, op: str, task_id: str, lease_id: str) -> None:
        """A lease that is not the task's current one: nothing may change."""
        if op == "release":
            assert self.run(self.store.release(task_id, lease_id)) is False
            return
        expected = LeaseLost if task_id in self.handed else NotFound
        stale: Coroutine[Any, Any, object]
        if op == "ack":
            stale = self.store.ack(task_id, lease_id, now=self.now)
        elif op == "nack":
            stale = self.store.nack(task_id, lease_id, "late", now=self.now)
        else:
            stale = self.store.reclaim(task_id, lease_id, "late", now=self.now)
        with pytest.raises((LeaseLost, NotFound)) as raised:
            self.run(stale)
        got = type(raised.value)
        assert got is expected, (op, got.__name__, expected.__name__)

    @precondition(lambda self: isinstance(self.store, SqliteStore))
    @rule()
    def restart(self) -> None:
        """A durable store closed and opened again holds exactly what it held: every task in
        the collection it was in, ready ones in order, leases, the DLQ and the totals."""
        store = self.store
        assert isinstance(store, SqliteStore)
        self.run(store.close())
        self.store = self.run(
            SqliteStore.open(
                store.path,
                self.backoff,
                random.Random(self.seq),
                sync="normal",
                hot_ready=SQLITE_HOT,
            )
        )

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def each_task_is_in_exactly_one_collection(self) -> None:
        collections = [set(self.ready), set(self.handed), set(self.delayed), set(self.dead)]
        assert len(self.ready) == len(collections[0]), "a task is twice in ready"
        assert sum(len(c) for c in collections) == len(self.tasks)
        assert set().union(*collections) == set(self.tasks)
        assert not self.acked & set(self.tasks)

    @invariant()
    def gauges_and_totals_match_the_model(self) -> None:
        stats = self.run(self.store.stats())
        gauges = (stats.ready, stats.handed_out, stats.delayed, stats.dead)
        model = (len(self.ready), len(self.handed), len(self.delayed), len(self.dead))
        assert gauges == model
        assert stats.totals == self.totals
        assert invariant_holds(stats), stats.totals

    @invariant()
    def the_dead_letter_queue_matches_the_model(self) -> None:
        views = self.run(self.store.dead_letters())
        assert [v.id for v in views] == self.dead
        for view in views:
            task = self.tasks[view.id]
            assert (view.attempts, view.last_error) == (task.attempts, task.last_error)
            assert view.attempts == task.max_attempts

    @invariant()
    def index_internals_agree(self) -> None:
        # the index's heaps, deque and dicts agree with each other (both backends keep one)
        assert isinstance(self.store, (MemoryStore, SqliteStore))
        self.store.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_state_machine(backend: str) -> None:
    machine = type(f"StoreMachine_{backend}", (StoreMachine,), {"backend": backend})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=150,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
