"""Random sequences of store operations against a model of where every task should be.

A Hypothesis state machine drives one store (built from a backend name, so it runs against every
backend in ``BACKENDS``) through enqueue (with and without delay, into named queues, at priorities,
with idempotency keys), claim (from lists of queues), ack, nack (on the backoff, with a delay, or
terminal), extend, reclaim, release, requeue, requeue_all, purge, pause and resume, cancel (of a
task in any state, or gone: a handed-out one becomes cancelling, and its holder's nack, reclaim,
release or lapsed lease drops it), emptying a queue, lookups, listings page by page (each state's
order), lease expiry and clock advances with a sweep, and (SQLite) restarts; results and
workflows (docs/design/results.md): acks with results (kept for their TTL, pruned by sweeps, pinned
by children), tasks enqueued after others (by id, or by index in the same call; waiting, released
by their last parent's ack, born dead, buried or cancelled with their parents, transitively; an
unknown parent refusing the whole call), their deliveries' parents. It mirrors each step in a
plain model: per queue, a ready lane per priority; the handed-out tasks with their leases, the
delayed tasks with their due times, the waiting tasks, the dead-letter queue in burial order, the
results held, the idempotency keys in their window, which queues are paused, and the totals of the
store and of each queue. After every step it checks that each task is in exactly one collection,
that the store's gauges (``waiting`` and ``succeeded`` too), totals (global and per queue), queue
rows and dead-letter queue match the model, that ``nacked + reclaimed == retried + buried`` and
that ``ready + handed_out + delayed + dead + waiting == enqueued - acked - purged - cancelled -
expired``.

Results whose time is up and that no child pins any more: a store drops them at the latest at the
next sweep (one may drop them at once); the model asks the store which it has dropped before it
compares.

The backoff's random draw is pinned (u = 0.5, so a retry waits 3/4 of the nominal delay) so that
the model knows exactly when each retry becomes due; the jitter itself is covered elsewhere.
"""

from __future__ import annotations

import asyncio
import random
import re
import tempfile
from collections import deque
from collections.abc import Collection, Coroutine
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

from tests.helpers import BACKENDS, SQLITE_HOT, examples, invariant_holds, make_store
from wqbroker import limits
from wqbroker.errors import Cancelled, LeaseLost, NotFound, UnknownParent
from wqbroker.models import (
    CANCELLED,
    CANCELLING,
    DEFAULT_QUEUE,
    PURGED,
    Delivery,
    Enqueued,
    Failure,
    NackItem,
    NewTask,
    ParentResult,
    Stats,
    Totals,
)
from wqbroker.retry import Backoff
from wqbroker.store import Store, enqueue_one
from wqbroker.store.memory import MemoryStore
from wqbroker.store.postgres import PostgresStore
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
    queue: str
    priority: int
    available_at: float
    attempts: int = 0
    last_error: str | None = None
    lease_id: str | None = None  # when handed out
    deadline: float = 0.0  # when handed out
    claim_seq: int = 0  # when handed out (or extended): tie-break for equal deadlines
    due: float = 0.0  # when delayed
    delay_seq: int = 0  # when delayed: tie-break for equal due times
    cancelling: bool = False  # when handed out: a cancel came
    # docs/design/results.md
    after: tuple[str, ...] = ()  # its parents
    waiting_for: int = 0  # when waiting: parents not yet succeeded
    delay: float = 0.0  # its delay, from its release when it waits
    ttl: float = limits.DEFAULT_RESULT_TTL_MS / 1000  # seconds its result is kept
    result: bytes | None = None  # when succeeded
    finished_at: float = 0.0  # when succeeded


@dataclass
class ModelQueue:
    lanes: dict[int, deque[str]]  # priority -> ready task ids, oldest first
    totals: Totals
    paused: bool = False

    def ready(self) -> int:
        return sum(len(lane) for lane in self.lanes.values())


# Times are sums of binary fractions so the store and the model agree exactly.
LEASES = st.sampled_from([1.0, 2.0, 5.0, 10.0])
DELAYS = st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0])
STEPS = st.sampled_from([0.25, 0.5, 1.0, 2.0, 5.0, 16.0, 31.0])
ERRORS = st.sampled_from([None, "boom", "timeout", ""])
QUEUES = st.sampled_from([DEFAULT_QUEUE, DEFAULT_QUEUE, "a", "b"])
LEASE = 10.0
PRIORITIES = st.sampled_from([0, 0, 1, 9])
KEYS = st.sampled_from([None, None, "k1", "k2"])
WINDOWS = st.sampled_from([1.0, 4.0, 300.0])
# A claim's list of queues, in order of preference ("never" is a queue nothing is put in).
CLAIM_QUEUES = st.lists(
    st.sampled_from([DEFAULT_QUEUE, "a", "b", "never"]), min_size=1, max_size=3, unique=True
)
NACK_DELAYS = st.sampled_from([None, None, 0.0, 0.5, 7.0])
SUBMISSIONS = st.tuples(DELAYS, st.integers(1, 3), QUEUES, PRIORITIES, KEYS, WINDOWS)
# docs/design/results.md: result TTLs (None: the default, an hour: longer than any run), results.
TTLS = st.sampled_from([None, None, 0.0, 2.0, 8.0])
RESULTS = st.sampled_from([None, b"null", b'{"r": [1, 2.50]}', b'"\\u00e9"'])


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
        self.queues: dict[str, ModelQueue] = {}  # every queue known (its ready lanes)
        self.handed: dict[str, ModelTask] = {}
        self.delayed: dict[str, ModelTask] = {}
        self.dead: list[str] = []  # burial order
        self.tasks: dict[str, ModelTask] = {}  # every task not yet acked or purged
        self.acked: set[str] = set()
        self.purged: set[str] = set()
        self.cancelled: set[str] = set()
        self.keys: dict[tuple[str, str], tuple[str, float]] = {}  # -> (task id, until)
        self.old_leases: list[tuple[str, str]] = []  # (task id, lease id) no longer current
        self.totals = Totals()
        # docs/design/results.md: waiting tasks (in the order enqueued; in ``tasks`` too), results
        # held (in the order they finished; not in ``tasks``: acked), each task's children in
        # the order enqueued (gone ones too), and the burials made together with others by a
        # cascade (by step: their order among themselves is the store's own).
        self.waiting: dict[str, ModelTask] = {}
        self.succeeded: dict[str, ModelTask] = {}
        self.children: dict[str, list[str]] = {}
        self.together: dict[str, int] = {}
        self.ended_why: dict[str, str] = {}  # why a task ended, as its children are told
        self.steps = 0
        self.step_buried: list[str] = []  # burials of this step
        self.step_cascaded = False  # one of them buried waiting children

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            self.run(self.store.close())
        finally:
            self.loop.close()
            self.tmp.cleanup()

    # -- model helpers ---------------------------------------------------------------------

    def queue(self, name: str) -> ModelQueue:
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = ModelQueue({}, Totals())
        return q

    def count(self, task: ModelTask, field: str, n: int = 1) -> None:
        """A total moves, for the store and for the task's queue."""
        setattr(self.totals, field, getattr(self.totals, field) + n)
        q = self.queues[task.queue].totals
        setattr(q, field, getattr(q, field) + n)

    def to_ready(self, task: ModelTask, *, head: bool = False) -> None:
        lane = self.queue(task.queue).lanes.setdefault(task.priority, deque())
        if head:
            lane.appendleft(task.id)
        else:
            lane.append(task.id)

    def ready_ids(self) -> list[str]:
        return [i for q in self.queues.values() for lane in q.lanes.values() for i in lane]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def to_delayed(self, task: ModelTask, due: float) -> None:
        task.due = due
        task.available_at = due
        task.delay_seq = self.next_seq()
        self.delayed[task.id] = task

    def promote_due(self) -> int:
        due = sorted(
            (t for t in self.delayed.values() if t.due <= self.now),
            key=lambda t: (t.due, t.delay_seq),
        )
        for task in due:
            del self.delayed[task.id]
            self.to_ready(task)
        return len(due)

    def pick(self, queues: list[str]) -> ModelTask | None:
        """The model of a claim's choice: the first listed queue, not paused, with a ready task;
        its highest priority, oldest first. Taken out of ready."""
        for name in queues:
            q = self.queues.get(name)
            if q is None or q.paused:
                continue
            for priority in sorted(q.lanes, reverse=True):
                lane = q.lanes[priority]
                if lane:
                    return self.tasks[lane.popleft()]
        return None

    def fail(
        self, task: ModelTask, error: str | None, delay: float | None = None, terminal: bool = False
    ) -> tuple[bool, float | None]:
        """The model of a failed delivery: retry or bury. Returns (buried, retry_at)."""
        del self.handed[task.id]
        self.old_leases.append((task.id, task.lease_id or ""))
        task.lease_id = None
        task.last_error = error
        if not terminal and task.attempts < task.max_attempts:
            retry_at = self.now + (retry_wait(task.attempts) if delay is None else delay)
            self.to_delayed(task, retry_at)
            self.count(task, "retried")
            return False, retry_at
        self.dead.append(task.id)
        self.step_buried.append(task.id)
        self.count(task, "buried")
        self.orphan(task.id, f"is dead: {error}" if error else "is dead")
        return True, None

    def drop_cancelled(self, task: ModelTask) -> None:
        """A cancelling task let go of by its holder: gone, counted cancelled."""
        del self.handed[task.id]
        del self.tasks[task.id]
        self.cancelled.add(task.id)
        self.old_leases.append((task.id, task.lease_id or ""))
        self.count(task, "cancelled")
        self.orphan(task.id, "was cancelled")

    # -- results and workflows (docs/design/results.md) --------------------------------------

    def orphan(self, task_id: str, why: str) -> None:
        """A task ended dead, cancelled or expired: its waiting children are buried, and
        theirs (breadth first), not counted buried."""
        todo = deque([(task_id, why)])
        while todo:
            parent, reason = todo.popleft()
            self.ended_why[parent] = reason
            for child_id in self.children.get(parent, ()):
                child = self.waiting.pop(child_id, None)
                if child is None:
                    continue
                error = limits.error_value(f"parent {parent} {reason}")
                assert error is not None
                child.last_error = error
                child.waiting_for = 0
                self.dead.append(child_id)
                self.step_buried.append(child_id)
                self.step_cascaded = True
                todo.append((child_id, f"is dead: {error}"))

    def step_done(self) -> None:
        """A step's burials, if one of them buried waiting children, were made together: their
        order among themselves is the store's own (one may bury the parents of a sweep first,
        then their children)."""
        if self.step_cascaded:
            for task_id in self.step_buried:
                self.together[task_id] = self.steps
        self.step_buried, self.step_cascaded = [], False
        self.steps += 1

    def cancel_waiting(self, task: ModelTask) -> None:
        """A waiting task cancelled: it and its waiting children, transitively."""
        todo = deque([task])
        while todo:
            one = todo.popleft()
            if one.id not in self.waiting:  # (a child of two of them: cancelled already)
                continue
            del self.waiting[one.id]
            del self.tasks[one.id]
            self.cancelled.add(one.id)
            self.count(one, "cancelled")
            todo.extend(self.waiting[c] for c in self.children.get(one.id, ()) if c in self.waiting)

    def acked_now(self, task: ModelTask, result: bytes | None) -> None:
        """A handed-out task acked (its lease is gone already): forgotten, or kept succeeded;
        its waiting children whose last pending parent it was released."""
        del self.tasks[task.id]
        self.acked.add(task.id)
        self.count(task, "acked")
        if result is not None and task.ttl > 0:
            task.result, task.finished_at = result, self.now
            self.succeeded[task.id] = task
        for child_id in self.children.get(task.id, ()):
            child = self.waiting.get(child_id)
            if child is None:
                continue
            child.waiting_for -= 1
            if child.waiting_for == 0:
                del self.waiting[child_id]
                if child.delay > 0:
                    self.to_delayed(child, self.now + child.delay)
                else:
                    child.available_at = self.now
                    self.to_ready(child)

    def pinned(self, task_id: str) -> bool:
        """Whether a child that is not yet succeeded (nor gone) names the task."""
        return any(c in self.tasks for c in self.children.get(task_id, ()))

    def prunable(self) -> list[str]:
        """Results whose time is up and that no child pins: the store drops them by the next
        sweep."""
        return [
            t.id
            for t in self.succeeded.values()
            if t.finished_at + t.ttl <= self.now and not self.pinned(t.id)
        ]

    def sync_pruned(self) -> None:
        """Drop from the model the results the store has dropped already (it may, once they
        are prunable)."""
        for task_id in self.prunable():
            if self.run(self.store.lookup(task_id)) is None:
                del self.succeeded[task_id]

    def live_ids(self) -> list[str]:
        """Tasks a new task may name as a parent."""
        return sorted({*self.tasks, *self.succeeded})

    def gone_ids(self) -> list[str]:
        """Tasks that are not live any more (a new task may not name them)."""
        return sorted((self.acked - set(self.succeeded)) | self.purged | self.cancelled)

    def next_due(self) -> float | None:
        times = [t.deadline for t in self.handed.values()]
        times += [t.due for t in self.delayed.values()]
        times += [t.finished_at + t.ttl for t in self.succeeded.values() if not self.pinned(t.id)]
        return min(times) if times else None

    def sweep_and_check(self) -> None:
        self.sync_pruned()
        must = set(self.prunable())  # (those unpinned by the sweep's reclaims: by the next)
        expired = sorted(
            (t for t in self.handed.values() if t.deadline <= self.now),
            key=lambda t: (t.deadline, t.claim_seq),
        )
        expected_reclaims = sorted((t.id, t.lease_id or "") for t in expired)
        for task in expired:
            if task.cancelling:
                self.drop_cancelled(task)
                continue
            self.count(task, "reclaimed")
            self.fail(task, "lease expired")
        promoted = self.promote_due()
        may = set(self.prunable())
        result, next_due = self.run(self.store.sweep(now=self.now))
        assert sorted(result.reclaimed) == expected_reclaims
        assert result.promoted == promoted
        for task_id in must:
            del self.succeeded[task_id]
        dropped = {i for i in may - must if self.run(self.store.lookup(i)) is None}
        for task_id in dropped:
            del self.succeeded[task_id]
        assert len(must) <= result.pruned <= len(must) + len(dropped), (result.pruned, must)
        expected = self.next_due()
        if not self.succeeded:
            assert next_due == expected
        elif expected is not None:  # (a result's time may wake it while a child pins it)
            assert next_due is not None
            assert next_due <= expected

    def new_task(
        self,
        submission: tuple[float, int, str, int, str | None, float],
        ttl: float | None = None,
        after: tuple[str | int, ...] = (),
    ) -> NewTask:
        delay, max_attempts, queue, priority, key, window = submission
        self.payload_n += 1
        payload = b'{"n": %d}' % self.payload_n
        until = self.now + window if key is not None else 0.0
        new = NewTask(payload, max_attempts, delay, queue, priority, key, until, after=after)
        if ttl is not None:
            new.result_ttl, new.result_ttl_given = ttl, True
        return new

    def enqueued(self, new: NewTask, done: Enqueued, parents: tuple[str, ...] = ()) -> None:
        """Check one enqueue's answer against the model, and put it in the model (``parents``:
        its ``after``, indices made ids)."""
        if new.key is not None:
            found = self.keys.get((new.queue, new.key))
            if found is not None and found[1] > self.now:
                assert done == Enqueued(found[0], True, None), "not answered as a duplicate"
                return
        assert not done.duplicate
        view = done.task
        assert view is not None
        assert view.id == done.id
        assert view.id not in self.tasks
        assert view.id not in self.acked | self.purged
        assert (view.attempts, view.max_attempts, view.payload) == (
            0,
            new.max_attempts,
            new.payload,
        )
        assert (view.queue, view.priority) == (new.queue, new.priority)
        assert view.created_at == self.now
        assert view.available_at == self.now + new.delay
        assert view.after == (parents or None)
        assert view.result_ttl == (new.result_ttl if new.result_ttl_given else None)
        task = ModelTask(view.id, new.payload, new.max_attempts, new.queue, new.priority, self.now)
        task.after, task.delay, task.ttl = parents, new.delay, new.result_ttl
        task.available_at = self.now + new.delay
        self.tasks[task.id] = task
        self.queue(new.queue)
        self.count(task, "enqueued")
        if new.key is not None:
            self.keys[(new.queue, new.key)] = (task.id, new.key_until)
        for parent in parents:
            self.children.setdefault(parent, []).append(task.id)
        dead = [p for p in parents if p in self.tasks and p in self.dead]
        pending = [p for p in parents if p in self.tasks and p not in self.dead]
        if dead:
            error = self.tasks[dead[0]].last_error
            task.last_error = (
                f"parent {dead[0]} is dead: {error}" if error else (f"parent {dead[0]} is dead")
            )
            self.dead.append(task.id)
            self.step_buried.append(task.id)
        elif pending:
            task.waiting_for = len(pending)
            self.waiting[task.id] = task
        elif new.delay > 0:
            self.to_delayed(task, self.now + new.delay)
        else:
            self.to_ready(task)
        assert view.waiting_for == task.waiting_for
        if view.last_error != task.last_error:
            assert dead, (view.last_error, task.last_error)
            self.another_parent_named(task.id, view.last_error, None)

    # -- rules -----------------------------------------------------------------------------

    @initialize(
        tasks=st.lists(SUBMISSIONS, max_size=6),
        claims=st.integers(0, 4),
        lease=LEASES,
        data=st.data(),
        graph=st.lists(st.tuples(SUBMISSIONS, TTLS), max_size=5),
    )
    def start(
        self,
        tasks: list[tuple[float, int, str, int, str | None, float]],
        claims: int,
        lease: float,
        data: st.DataObject,
        graph: list[tuple[tuple[float, int, str, int, str | None, float], float | None]],
    ) -> None:
        stats = self.run(self.store.stats())
        assert stats.totals == Totals()
        assert self.run(self.store.queues()) == []
        for submission in tasks:
            self.enqueue(submission)
        if graph:  # (most runs start with a few tasks waiting for others)
            self.enqueue_after(data, graph)
        for _ in range(claims):
            self.claim(lease, [DEFAULT_QUEUE, "a", "b"])

    @rule(submission=SUBMISSIONS)
    def enqueue(self, submission: tuple[float, int, str, int, str | None, float]) -> None:
        new = self.new_task(submission)
        done = self.run(
            enqueue_one(
                self.store,
                new.payload,
                max_attempts=new.max_attempts,
                delay=new.delay,
                now=self.now,
                queue=new.queue,
                priority=new.priority,
                key=new.key,
                key_until=new.key_until,
            )
        )
        self.enqueued(new, done)

    @rule(submissions=st.lists(SUBMISSIONS, max_size=4), ttl=TTLS)
    def enqueue_many(
        self, submissions: list[tuple[float, int, str, int, str | None, float]], ttl: float | None
    ) -> None:
        items = [self.new_task(s, ttl) for s in submissions]
        done = self.run(self.store.enqueue_many(items, now=self.now))
        assert len(done) == len(items)
        for new, answer in zip(items, done, strict=True):  # in order: a key may repeat
            self.enqueued(new, answer)

    @rule(
        data=st.data(),
        submissions=st.lists(st.tuples(SUBMISSIONS, TTLS), min_size=1, max_size=3),
    )
    def enqueue_after(
        self,
        data: st.DataObject,
        submissions: list[tuple[tuple[float, int, str, int, str | None, float], float | None]],
    ) -> None:
        """Tasks after others (docs/design/results.md): each names live tasks or earlier items
        of the same call (or none)."""
        live = self.live_ids()
        items = []
        for i, (submission, ttl) in enumerate(submissions):
            choices: list[str | int] = [*live, *range(i)]
            after = data.draw(
                st.lists(st.sampled_from(choices), max_size=3, unique=True)
                if choices
                else st.just([]),
                label="after",
            )
            no_key = (*submission[:4], None, submission[5])
            items.append(self.new_task(no_key, ttl, tuple(after)))
        done = self.run(self.store.enqueue_many(items, now=self.now))
        assert len(done) == len(items)
        for new, answer in zip(items, done, strict=True):
            parents = tuple(done[p].id if isinstance(p, int) else p for p in new.after)
            self.enqueued(new, answer, parents)

    @rule(result=RESULTS)
    def drain(self, result: bytes | None) -> None:
        """Workers that run every ready task (those released meanwhile too), each acked at once
        with a result: parents hand their results to their children."""
        for _ in range(10):
            if not self.ran([DEFAULT_QUEUE, "a", "b"], 4, result):
                return

    @rule(queues=CLAIM_QUEUES, n=st.integers(1, 4), result=RESULTS)
    def run_tasks(self, queues: list[str], n: int, result: bytes | None) -> None:
        """Workers that take tasks and ack them at once with a result (the way results and
        children are made, and children released)."""
        self.ran(queues, n, result)

    def ran(self, queues: list[str], n: int, result: bytes | None) -> int:
        """Up to ``n`` tasks of ``queues`` claimed and acked with ``result``: how many."""
        self.promote_due()
        deliveries = self.run(self.store.claim_many([LEASE] * n, now=self.now, queues=queues))
        expected = []
        for _ in range(n):
            task = self.pick(queues)
            if task is None:
                break
            expected.append(task)
        assert [d.task.id for d in deliveries] == [t.id for t in expected]
        for task, delivery in zip(expected, deliveries, strict=True):
            self.handed_out(task, delivery, LEASE)
        acks = [(d.task.id, d.lease_id) for d in deliveries]
        results = {d.task.id: result for d in deliveries} if result is not None else None
        acked, _ = self.run(self.store.settle_many(acks, [], now=self.now, results=results))
        assert acked == [None] * len(acks)
        for task in expected:
            del self.handed[task.id]
            self.old_leases.append((task.id, task.lease_id or ""))
            self.acked_now(task, result)
        return len(expected)

    @rule(data=st.data(), ttl=TTLS)
    def enqueue_after_a_task_gone(self, data: st.DataObject, ttl: float | None) -> None:
        """A call naming a parent that is not live is refused whole: nothing of it is done."""
        gone = data.draw(
            st.sampled_from([*self.gone_ids(), "0123456789abcdef", "not-an-id"]), label="gone"
        )
        live = self.live_ids()
        first = self.new_task((0.0, 1, DEFAULT_QUEUE, 0, None, 1.0))
        after: tuple[str | int, ...] = (*live[:2], 0, gone)
        second = self.new_task((0.0, 1, "a", 0, None, 1.0), ttl, after)
        with pytest.raises(UnknownParent) as raised:
            self.run(self.store.enqueue_many([first, second], now=self.now))
        assert (raised.value.item, raised.value.position) == (1, len(after) - 1)
        assert raised.value.task_id == gone

    @rule(lease=LEASES, queues=CLAIM_QUEUES)
    def claim(self, lease: float, queues: list[str]) -> None:
        self.promote_due()
        delivery = self.run(self.store.claim(lease=lease, now=self.now, queues=queues))
        task = self.pick(queues)
        if task is None:
            assert delivery is None
            return
        assert delivery is not None
        self.handed_out(task, delivery, lease)

    @rule(leases=st.lists(LEASES, max_size=4), queues=CLAIM_QUEUES)
    def claim_many(self, leases: list[float], queues: list[str]) -> None:
        if leases:  # asking for nothing need not touch anything
            self.promote_due()
        deliveries = self.run(self.store.claim_many(leases, now=self.now, queues=queues))
        expected = []
        for _ in leases:
            task = self.pick(queues)
            if task is None:
                break
            expected.append(task)
        assert [d.task.id for d in deliveries] == [t.id for t in expected]
        for task, delivery, lease in zip(expected, deliveries, leases, strict=False):
            self.handed_out(task, delivery, lease)

    def handed_out(self, task: ModelTask, delivery: Delivery, lease: float) -> None:
        """The model of a hand-out: ``task`` (the one the model picked), under a fresh lease."""
        assert delivery.task.id == task.id, "not the task the model picked"
        task.attempts += 1
        assert delivery.task.attempts == task.attempts
        assert delivery.task.max_attempts == task.max_attempts
        assert delivery.task.payload == task.payload
        assert delivery.task.last_error == task.last_error
        assert (delivery.task.queue, delivery.task.priority) == (task.queue, task.priority)
        assert delivery.task.available_at == task.available_at
        assert delivery.deadline == self.now + lease
        assert all(delivery.lease_id != lease_id for _, lease_id in self.old_leases)
        assert all(delivery.lease_id != t.lease_id for t in self.handed.values())
        if task.after:
            parents = [
                ParentResult(p, self.succeeded[p].result if p in self.succeeded else None)
                for p in task.after
            ]
            assert delivery.parents == parents
        else:
            assert delivery.parents is None
        task.lease_id = delivery.lease_id
        task.deadline = delivery.deadline
        task.claim_seq = self.next_seq()
        self.handed[task.id] = task
        self.count(task, "delivered")

    def pick_handed(self, data: st.DataObject) -> ModelTask:
        return self.handed[data.draw(st.sampled_from(sorted(self.handed)), label="handed")]

    @precondition(lambda self: self.handed)
    @rule(data=st.data(), result=RESULTS)
    def ack(self, data: st.DataObject, result: bytes | None) -> None:
        task = self.pick_handed(data)
        self.run(self.store.ack(task.id, task.lease_id or "", now=self.now, result=result))
        del self.handed[task.id]
        self.old_leases.append((task.id, task.lease_id or ""))
        self.acked_now(task, result)

    @precondition(lambda self: self.handed)
    @rule(data=st.data(), error=ERRORS, delay=NACK_DELAYS, terminal=st.booleans())
    def nack(
        self, data: st.DataObject, error: str | None, delay: float | None, terminal: bool
    ) -> None:
        task = self.pick_handed(data)
        failure = self.run(
            self.store.nack(
                task.id, task.lease_id or "", error, now=self.now, delay=delay, terminal=terminal
            )
        )
        if task.cancelling:
            assert failure == Failure(task.id, False, None, cancelled=True)
            self.drop_cancelled(task)
            return
        self.count(task, "nacked")
        buried, retry_at = self.fail(task, error, delay, terminal)
        assert (failure.task_id, failure.buried, failure.retry_at) == (task.id, buried, retry_at)

    @rule(data=st.data())
    def settle_many(self, data: st.DataObject) -> None:
        """Acks then nacks in one call, some of them with leases that are no longer good."""
        held = sorted(self.handed)
        chosen = (
            data.draw(st.lists(st.sampled_from(held), unique=True), label="settled") if held else []
        )
        split = data.draw(st.integers(0, len(chosen)), label="acks")
        acks = [(i, self.handed[i].lease_id or "") for i in chosen[:split]]
        nacks = [
            NackItem(
                i,
                self.handed[i].lease_id or "",
                "batch",
                data.draw(NACK_DELAYS, label="delay"),
                data.draw(st.booleans(), label="terminal"),
            )
            for i in chosen[split:]
        ]
        stale = data.draw(st.booleans(), label="stale")
        if self.old_leases and stale:
            task_id, lease_id = data.draw(st.sampled_from(self.old_leases), label="stale lease")
            acks.append((task_id, lease_id))
        results: dict[str, bytes] = {}
        for task_id, _ in acks:
            kept = data.draw(RESULTS, label="result")
            if kept is not None:
                results[task_id] = kept
        acked, nacked = self.run(
            self.store.settle_many(acks, nacks, now=self.now, results=results or None)
        )
        for (task_id, lease_id), outcome in zip(acks, acked, strict=True):
            if task_id not in self.handed or self.handed[task_id].lease_id != lease_id:
                expected = LeaseLost if task_id in self.handed else NotFound
                assert type(outcome) is expected
                continue
            assert outcome is None
            task = self.handed.pop(task_id)
            self.old_leases.append((task_id, lease_id))
            self.acked_now(task, results.get(task_id))
        for item, result in zip(nacks, nacked, strict=True):
            task = self.handed[item.task_id]
            if task.cancelling:
                assert result == Failure(task.id, False, None, cancelled=True)
                self.drop_cancelled(task)
                continue
            self.count(task, "nacked")
            buried, retry_at = self.fail(task, item.error, item.delay, item.terminal)
            assert not isinstance(result, Exception)
            assert (result.task_id, result.buried, result.retry_at) == (task.id, buried, retry_at)

    @precondition(lambda self: self.handed)
    @rule(data=st.data(), lease=LEASES)
    def extend(self, data: st.DataObject, lease: float) -> None:
        task = self.pick_handed(data)
        if task.cancelling:
            with pytest.raises(Cancelled):
                self.run(self.store.extend(task.id, task.lease_id or "", lease=lease, now=self.now))
            return
        deadline = self.run(
            self.store.extend(task.id, task.lease_id or "", lease=lease, now=self.now)
        )
        assert deadline == self.now + lease
        task.deadline = deadline
        task.claim_seq = self.next_seq()

    @precondition(lambda self: self.handed)
    @rule(data=st.data())
    def reclaim(self, data: st.DataObject) -> None:
        task = self.pick_handed(data)
        failure = self.run(self.store.reclaim(task.id, task.lease_id or "", "gone", now=self.now))
        if task.cancelling:
            assert failure == Failure(task.id, False, None, cancelled=True)
            self.drop_cancelled(task)
            return
        self.count(task, "reclaimed")
        buried, retry_at = self.fail(task, "gone")
        assert (failure.task_id, failure.buried, failure.retry_at) == (task.id, buried, retry_at)

    @precondition(lambda self: self.handed)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        task = self.pick_handed(data)
        assert self.run(self.store.release(task.id, task.lease_id or "", now=self.now)) is True
        if task.cancelling:
            self.drop_cancelled(task)
            return
        del self.handed[task.id]
        self.old_leases.append((task.id, task.lease_id or ""))
        task.lease_id = None
        task.attempts -= 1
        self.to_ready(task, head=True)
        self.count(task, "delivered", -1)

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

    def revive(self, task_id: str) -> None:
        self.dead.remove(task_id)
        self.together.pop(task_id, None)
        task = self.tasks[task_id]
        task.attempts = 0
        task.last_error = None
        task.available_at = self.now
        self.to_ready(task)
        self.count(task, "requeued")

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        task_id = data.draw(st.sampled_from(self.dead), label="dead")
        name = self.run(self.store.requeue(task_id, now=self.now))
        assert name == self.tasks[task_id].queue
        self.revive(task_id)

    @rule(queue=st.sampled_from([None, DEFAULT_QUEUE, "a", "b", "never"]))
    def requeue_all(self, queue: str | None) -> None:
        # The order of burial among tasks buried together is the store's own (the_dead_letter_
        # queue_matches_the_model checks the rest): requeued in that order, they take it on.
        self.step_done()
        order = [view.id for view in self.run(self.store.dead_letters())]
        assert self.canonical(order) == self.canonical(self.dead)
        self.dead = order
        chosen = [i for i in self.dead if queue is None or self.tasks[i].queue == queue]
        count, names = self.run(self.store.requeue_all(queue=queue, now=self.now))
        assert count == len(chosen)
        assert set(names) == {self.tasks[i].queue for i in chosen}
        for task_id in chosen:
            self.revive(task_id)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def purge(self, data: st.DataObject) -> None:
        task_id = data.draw(st.sampled_from(self.dead), label="dead")
        self.run(self.store.purge(task_id))
        self.dead.remove(task_id)
        self.together.pop(task_id, None)
        task = self.tasks.pop(task_id)
        self.purged.add(task_id)
        self.count(task, "purged")

    def not_dead(self, data: st.DataObject) -> str:
        candidates = {*self.tasks, *self.acked, *self.purged} - set(self.dead)
        return data.draw(st.sampled_from([*sorted(candidates), "no-such-task"]), label="not dead")

    @rule(data=st.data())
    def requeue_not_dead(self, data: st.DataObject) -> None:
        task_id = self.not_dead(data)
        with pytest.raises(NotFound):
            self.run(self.store.requeue(task_id, now=self.now))

    @rule(data=st.data())
    def purge_not_dead(self, data: st.DataObject) -> None:
        task_id = self.not_dead(data)
        with pytest.raises(NotFound):
            self.run(self.store.purge(task_id))

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """Cancel any task, or one gone, or none (a succeeded one: it was acked)."""
        known = {*self.tasks, *self.acked, *self.purged, *self.cancelled}
        task_id = data.draw(st.sampled_from([*sorted(known), "0123456789abcdef"]), label="cancel")
        task = self.tasks.get(task_id)
        if task is None:
            with pytest.raises(NotFound):
                self.run(self.store.cancel(task_id, now=self.now))
            return
        result = self.run(self.store.cancel(task_id, now=self.now))
        assert (result.task_id, result.queue) == (task_id, task.queue)
        if task_id in self.handed:
            task.cancelling = True
            assert (result.state, result.lease_id) == (CANCELLING, task.lease_id)
            return
        if task_id in self.dead:
            assert result.state == PURGED
            self.dead.remove(task_id)
            self.together.pop(task_id, None)
            del self.tasks[task_id]
            self.purged.add(task_id)
            self.count(task, "purged")
            return
        assert (result.state, result.lease_id) == (CANCELLED, None)
        if task_id in self.waiting:
            self.cancel_waiting(task)
            return
        if task_id in self.delayed:
            del self.delayed[task_id]
        else:
            self.queues[task.queue].lanes[task.priority].remove(task_id)
        del self.tasks[task_id]
        self.cancelled.add(task_id)
        self.count(task, "cancelled")
        self.orphan(task_id, "was cancelled")

    @rule(queue=st.sampled_from([DEFAULT_QUEUE, "a", "b", "never"]))
    def empty_queue(self, queue: str) -> None:
        if queue not in self.queues:
            with pytest.raises(NotFound):
                self.run(self.store.empty_queue(queue, now=self.now))
            return
        before = self.totals.cancelled
        for task in [t for t in self.waiting.values() if t.queue == queue]:
            if task.id in self.waiting:  # (not cancelled with a parent already)
                self.cancel_waiting(task)
        lanes = self.queues[queue].lanes
        gone = [i for p in sorted(lanes) for i in lanes[p]]
        gone += [
            t.id
            for t in sorted(self.delayed.values(), key=lambda t: (t.due, t.delay_seq))
            if t.queue == queue
        ]
        for lane in lanes.values():
            lane.clear()
        for task_id in gone:
            self.delayed.pop(task_id, None)
            task = self.tasks.pop(task_id)
            self.cancelled.add(task_id)
            self.count(task, "cancelled")
            self.orphan(task_id, "was cancelled")
        n = self.run(self.store.empty_queue(queue, now=self.now))
        assert n == self.totals.cancelled - before

    @rule(size=st.sampled_from([1, 2, 5, 1000]))
    def listings_match_the_model(self, size: int) -> None:
        """Every queue's tasks in each state, page after page of ``size``, in the order of
        that state."""
        for name, q in self.queues.items():
            ready = [i for p in sorted(q.lanes, reverse=True) for i in q.lanes[p]]
            delayed = sorted(
                (t for t in self.delayed.values() if t.queue == name),
                key=lambda t: (t.due, t.delay_seq),
            )
            handed = sorted(
                (t for t in self.handed.values() if t.queue == name),
                key=lambda t: (t.deadline, t.claim_seq),
            )
            dead = [i for i in self.dead if self.tasks[i].queue == name]
            expected = {
                "ready": ready,
                "delayed": [t.id for t in delayed],
                "handed_out": [t.id for t in handed],
                "waiting": [i for i, t in self.waiting.items() if t.queue == name],
            }
            for state, ids in expected.items():
                assert self.listed(name, state, size) == ids, (name, state)
            # succeeded by finish time; tasks that finished at the same moment (one settle, on
            # the fake clock) in the store's order (PostgreSQL: the order they were enqueued)
            listed = self.listed(name, "succeeded", size)
            mine = [t for t in self.succeeded.values() if t.queue == name]
            assert [self.succeeded[i].finished_at for i in listed if i in self.succeeded] == [
                t.finished_at for t in mine
            ], (name, "succeeded")
            assert sorted(listed) == sorted(t.id for t in mine), (name, "succeeded")
            assert self.canonical(self.listed(name, "dead", size)) == self.canonical(dead)

    def listed(self, queue: str, state: str, size: int) -> list[str]:
        out: list[str] = []
        after = None
        while True:
            page = self.run(self.store.list_tasks(queue, state, limit=size, after=after))
            out += [t.task.id for t in page.tasks]
            assert all(t.state == state for t in page.tasks)
            if page.after is None:
                return out
            after = page.after

    @rule(queue=st.sampled_from([DEFAULT_QUEUE, "a", "b"]), paused=st.booleans())
    def pause_or_resume(self, queue: str, paused: bool) -> None:
        self.run(self.store.set_paused(queue, paused))
        self.queue(queue).paused = paused

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        candidates = [*sorted({*self.tasks, *self.acked, *self.purged}), "no-such-task"]
        task_id = data.draw(st.sampled_from(candidates), label="looked up")
        found = self.run(self.store.lookup(task_id))
        task = self.tasks.get(task_id) or self.succeeded.get(task_id)
        if task is None:
            assert found is None
            return
        assert found is not None
        if task_id in self.handed:
            state = "handed_out"
        elif task_id in self.delayed:
            state = "delayed"
        elif task_id in self.dead:
            state = "dead"
        elif task_id in self.waiting:
            state = "waiting"
        elif task_id in self.succeeded:
            state = "succeeded"
        else:
            state = "ready"
        assert found.state == state
        assert (found.task.after, found.task.waiting_for) == (task.after or None, task.waiting_for)
        if state == "succeeded":
            assert (found.task.result, found.task.finished_at) == (task.result, task.finished_at)
        else:
            assert (found.task.result, found.task.finished_at) == (None, None)
        view = found.task
        assert view.id == task_id
        assert (view.payload, view.attempts, view.max_attempts) == (
            task.payload,
            task.attempts,
            task.max_attempts,
        )
        assert (view.queue, view.priority) == (task.queue, task.priority)
        if view.last_error != task.last_error:
            self.another_parent_named(task_id, view.last_error, None)
        assert view.available_at == task.available_at
        assert view.cancelling == (task_id in self.handed and task.cancelling)

    @precondition(lambda self: self.handed)
    @rule(data=st.data(), op=st.sampled_from(["ack", "nack", "reclaim", "release", "extend"]))
    def use_a_wrong_lease(self, data: st.DataObject, op: str) -> None:
        task = self.pick_handed(data)
        self.try_stale(op, task.id, "not-a-lease")

    @precondition(lambda self: self.old_leases)
    @rule(data=st.data(), op=st.sampled_from(["ack", "nack", "reclaim", "release", "extend"]))
    def use_a_stale_lease(self, data: st.DataObject, op: str) -> None:
        task_id, lease_id = data.draw(st.sampled_from(self.old_leases), label="stale lease")
        self.try_stale(op, task_id, lease_id)

    def try_stale(self, op: str, task_id: str, lease_id: str) -> None:
        """A lease that is not the task's current one: nothing may change."""
        if op == "release":
            assert self.run(self.store.release(task_id, lease_id, now=self.now)) is False
            return
        expected = LeaseLost if task_id in self.handed else NotFound
        stale: Coroutine[Any, Any, object]
        if op == "ack":
            stale = self.store.ack(task_id, lease_id, now=self.now)
        elif op == "nack":
            stale = self.store.nack(task_id, lease_id, "late", now=self.now, terminal=True)
        elif op == "extend":
            stale = self.store.extend(task_id, lease_id, lease=300.0, now=self.now)
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
        the collection it was in, ready ones in order in their queue and priority, leases, the
        DLQ, the paused queues, the idempotency keys and the totals (of each queue too)."""
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
        self.step_done()
        self.sync_pruned()
        ready = self.ready_ids()
        collections = [
            set(ready),
            set(self.handed),
            set(self.delayed),
            set(self.dead),
            set(self.waiting),
        ]
        assert len(ready) == len(collections[0]), "a task is twice in ready"
        assert sum(len(c) for c in collections) == len(self.tasks)
        assert set().union(*collections) == set(self.tasks)
        assert not (self.acked | self.purged) & set(self.tasks)
        assert set(self.succeeded) <= self.acked

    def expect_stats(self, stats: Stats, tasks: list[ModelTask], totals: Totals) -> None:
        def n(ids: Collection[str]) -> int:
            return sum(1 for t in tasks if t.id in ids)

        ready = set(self.ready_ids())
        gauges = (stats.ready, stats.handed_out, stats.delayed, stats.dead, stats.waiting)
        assert gauges == (
            n(ready),
            n(self.handed),
            n(self.delayed),
            n(set(self.dead)),
            n(self.waiting),
        )
        assert stats.totals == totals
        assert invariant_holds(stats), stats.totals
        t = stats.totals
        assert sum(gauges) == t.enqueued - t.acked - t.purged - t.cancelled - t.expired, stats

    @invariant()
    def gauges_and_totals_match_the_model(self) -> None:
        self.sync_pruned()
        tasks = list(self.tasks.values())
        stats = self.run(self.store.stats())
        self.expect_stats(stats, tasks, self.totals)
        assert stats.succeeded == len(self.succeeded)
        for name, q in self.queues.items():
            mine = [t for t in tasks if t.queue == name]
            stats = self.run(self.store.stats(name))
            self.expect_stats(stats, mine, q.totals)
            assert stats.succeeded == sum(1 for t in self.succeeded.values() if t.queue == name)
        assert self.run(self.store.stats("never")) == Stats()
        held = self.store.held_hint()
        assert held is None or held == len(self.tasks) - len(self.dead) + len(self.succeeded)

    @invariant()
    def queue_rows_match_the_model(self) -> None:
        rows = self.run(self.store.queues())
        assert [r.name for r in rows] == sorted(self.queues)
        for row in rows:
            q = self.queues[row.name]
            mine = [t for t in self.tasks.values() if t.queue == row.name]
            handed = sum(1 for t in mine if t.id in self.handed)
            delayed = sum(1 for t in mine if t.id in self.delayed)
            dead = sum(1 for t in mine if t.id in self.dead)
            waiting = sum(1 for t in mine if t.id in self.waiting)
            self.sync_pruned()
            succeeded = sum(1 for t in self.succeeded.values() if t.queue == row.name)
            assert (row.ready, row.handed_out, row.delayed, row.dead, row.paused) == (
                q.ready(),
                handed,
                delayed,
                dead,
                q.paused,
            )
            assert (row.waiting, row.succeeded) == (waiting, succeeded)

    def another_parent_named(
        self, task_id: str, error: str | None, errors: dict[str, str | None] | None
    ) -> None:
        """A task buried because of its parents may name another of them than the model's
        (several ended in one step, or were dead already: which the store met first is its
        own), or one whose own error names another of its parents (the same, a generation up);
        but the one it names is one of its parents, with that parent's own reason (its last
        error as the store has it, if it is dead). ``errors``: the dead tasks' errors as the
        store has them (None: looked up)."""
        task = self.tasks[task_id]
        assert task_id in self.dead, (task_id, error, task.last_error)
        assert (task.last_error or "").startswith("parent "), (error, task.last_error)
        found = re.match(r"parent ([0-9a-f]{16}) ", error or "")
        assert found is not None, error
        parent = found.group(1)
        assert parent in task.after, (error, task.after)
        if parent in self.dead:
            if errors is not None and parent in errors:
                theirs = errors[parent]
            else:
                seen = self.run(self.store.lookup(parent))
                assert seen is not None, parent
                theirs = seen.task.last_error
            why = f"is dead: {theirs}" if theirs else "is dead"
        elif parent in self.ended_why:
            why = self.ended_why[parent]
        else:  # dead when the child was buried, and requeued since
            assert (error or "").startswith(f"parent {parent} is dead"), error
            return
        if (error or "").startswith(f"parent {parent} is dead: parent ") and error != (
            limits.error_value(f"parent {parent} {why}")
        ):
            # The parent died of one of its own parents too, in the same cascade: the reason its
            # child gives may name another of them (the same rule, a generation up), and the
            # parent may have been requeued, purged or cancelled since.
            head = f"parent {parent} is dead: "
            assert (error or "").startswith(head), (error, why)
            nested = (error or "")[len(head) :]
            found = re.match(r"parent ([0-9a-f]{16}) ", nested)
            assert found is not None, (error, why)
            if parent in self.tasks:  # (not purged since)
                assert found.group(1) in self.tasks[parent].after, (error, why)
            return
        assert error == limits.error_value(f"parent {parent} {why}"), (error, why)

    def canonical(self, ids: list[str]) -> list[str]:
        """A burial order, tasks buried together by one cascade sorted among themselves (their
        order is the store's own)."""
        out: list[str] = []
        run: list[str] = []
        group: int | None = None
        for task_id in ids:
            mine = self.together.get(task_id)
            if mine is not None and mine == group:
                run.append(task_id)
                continue
            out += sorted(run)
            run, group = [task_id], mine
        return out + sorted(run)

    @invariant()
    def the_dead_letter_queue_matches_the_model(self) -> None:
        self.step_done()  # (idempotent)
        views = self.run(self.store.dead_letters())
        assert self.canonical([v.id for v in views]) == self.canonical(self.dead)
        errors = {view.id: view.last_error for view in views}
        for view in views:
            task = self.tasks[view.id]
            assert view.attempts == task.attempts
            if view.last_error != task.last_error:
                self.another_parent_named(view.id, view.last_error, errors)
            assert (view.queue, view.priority) == (task.queue, task.priority)
            assert view.attempts <= task.max_attempts
        for name in self.queues:
            mine = [i for i in self.dead if self.tasks[i].queue == name]
            listed = [v.id for v in self.run(self.store.dead_letters(queue=name))]
            assert self.canonical(listed) == self.canonical(mine)

    @invariant()
    def index_internals_agree(self) -> None:
        # the index's heaps, lanes and dicts agree with each other (the backends that keep one);
        # PostgreSQL: the gauges kept in its counter rows agree with its tasks
        if isinstance(self.store, PostgresStore):
            self.run(self.store.check_invariants())
            return
        assert isinstance(self.store, (MemoryStore, SqliteStore))
        self.store.check_invariants()


# (The durable stores' runs take some forty seconds of CPU each under the ci profile: the slow
# tier, `make test-slow`, which CI runs after `make test`; the memory store's stays in both.)
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "backend",
    [b if b == "memory" else pytest.param(b, marks=pytest.mark.slow) for b in BACKENDS],
)
def test_store_state_machine(backend: str) -> None:
    machine = type(f"StoreMachine_{backend}", (StoreMachine,), {"backend": backend})
    run_state_machine_as_test(
        machine,
        settings=settings(
            # (every step is a few round trips to PostgreSQL, and each of its invariants a few
            # more: fewer runs keep it to about a minute; the SQLite and memory runs to under
            # one between them, so that `make test` stays short on two cores)
            max_examples=examples(60 if backend == "postgres" else 100),
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
