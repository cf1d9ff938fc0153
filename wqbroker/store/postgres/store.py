"""The PostgreSQL store's operations: :class:`PostgresStore`, one round trip a call.

Each call of the contract is one statement of ``sql/queries.sql`` (most of them a call of a
PL/pgSQL function of ``sql/functions.sql``) in its own transaction on a pooled connection
(pool.py), grouped with the calls of its kind that came meanwhile (group.py). What it answers is
read from the rows the function returns; the times in them are the database's, handed to the
broker in its own clock (minus :attr:`PostgresStore.skew`). What it makes ready is announced to
the other brokers, and what they announce is heard (listener.py). The schema is made or upgraded
at :meth:`PostgresStore.open` (schema.py). The package's docstring tells the design.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Final

import asyncpg

from wqbroker.clock import Clock
from wqbroker.errors import (
    Cancelled,
    Conflict,
    InvalidArgument,
    LeaseLost,
    NotFound,
    StoreError,
    TimeLimitReached,
    UnknownParent,
    WqError,
    quoted,
)
from wqbroker.models import (
    CANCELLED,
    CANCELLING,
    DEAD,
    DEFAULT_QUEUE,
    DELAYED,
    HANDED_OUT,
    PURGED,
    READY,
    SUCCEEDED,
    WAITING,
    CancelResult,
    Delivery,
    Enqueued,
    Failure,
    Limits,
    NackItem,
    NewTask,
    ParentResult,
    QueueReport,
    QueueStats,
    RateLimit,
    Released,
    Schedule,
    ScheduleTask,
    Stats,
    SweepResult,
    Task,
    TaskPage,
    TaskState,
    Totals,
)
from wqbroker.retry import Backoff
from wqbroker.store import FinishedCallback
from wqbroker.store.index import _MASK, PRIORITIES, _mix, hex_id, parse_id
from wqbroker.store.postgres import dsn as dsns
from wqbroker.store.postgres.dsn import redact
from wqbroker.store.postgres.group import ENQUEUE_WIDTH, Grouped, split
from wqbroker.store.postgres.listener import FINISHED_AS, Listener
from wqbroker.store.postgres.pool import (
    DEADLINE,
    POOL_SIZE,
    UNREACHABLE,
    Pool,
    cancel,
    one_line,
)
from wqbroker.store.postgres.queries import Q
from wqbroker.store.postgres.schema import SCHEMA_VERSION, prepare

log = logging.getLogger("wqbroker.store.postgres")

# Every this many sweeps, a sweep also refreshes the queue names and folds counter rows.
_SWEEPS_PER_REFRESH: Final = 20
# The skew between the broker's clock and the database's is measured from sweeps whose round trip
# took less than this (so the estimate is off by half of it at most).
_SKEW_RTT: Final = 0.01
# Any constant: the key of the advisory lock a broker holds while it vacuums (one at a time does).
_VACUUM_KEY: Final = 0x7771_0000_0002
# A table is vacuumed by the brokers once it has this many dead rows, plus this share of its live
# ones (as autovacuum's threshold and scale factor would; autovacuum may be off, or too slow for
# a queue: its launcher visits a database once a minute by default).
VACUUM_THRESHOLD: Final = 2000
VACUUM_SCALE: Final = 0.1
# The tables the brokers vacuum, and how.
_VACUUM: Final = {
    "tasks": Q.vacuum_tasks,
    "counters": Q.vacuum_counters,
    "keys": Q.vacuum_keys,
    "edges": Q.vacuum_edges,
}
# How long after a claim that came back short its queues are looked at again.
LOOK_AGAIN_AFTER: Final = 0.05
# A rate-limited queue's next token is looked for at least this long after now (the database's
# clock and the broker's agree only to within the skew measured: a hint a little early would
# have claims find no token, again and again, until it comes).
_TOKEN_AFTER: Final = 0.001
_OFFSET: Final = 2**63
# The states of the table's rows (sql/functions.sql), by number.
_STATES: Final = (READY, HANDED_OUT, DELAYED, DEAD, WAITING, SUCCEEDED)
# The SQLSTATE wq.link raises for a parent that is no task (its detail: item, position, id).
_UNKNOWN_PARENT: Final = "WQ404"
_ID_BLOCK: Final = 1024
# The most numbers reserved ahead of a group's need (a broker that stops loses what it held).
_AHEAD_MOST: Final = 64 * _ID_BLOCK


def _key(n: int) -> int:
    """A task id (64 bits, unsigned) as the table's key (bigint)."""
    return n - _OFFSET


def _hex(key: int) -> str:
    return hex_id(key + _OFFSET)


def _task(row: Any, skew: float) -> Task:
    """A view from a row as the lookup statement lists the columns (times in the broker's
    clock: minus ``skew``, how far the database's clock is ahead)."""
    error = row[6]
    if error is not None:
        error = bytes(error).decode("utf-8", "surrogatepass")
    expires = row[9]
    finished = row[14]
    after = row[16]
    return Task(  # (row[18], row[19]: docs/design/schedules.md, the schedule that fired it)
        _hex(row[0]),
        row[1],
        row[2],
        row[3],
        row[4] - skew,
        row[5] - skew,
        error,
        row[7],
        row[8],
        None if expires is None else expires - skew,
        row[10],
        row[11],
        row[12],
        row[13],
        None if finished is None else finished - skew,
        row[15],
        None if after is None else tuple(_hex(k) for k in after),
        row[17],
        row[18],
        row[19],
    )


def _buried(task: Task, buried_at: float | None, skew: float) -> None:
    """A dead task's burial time, from its column (NULL: not dead, or buried before version 8
    of the schema: not known)."""
    if buried_at is not None:
        task.buried_at = buried_at - skew


def _handed(row: Any, skew: float) -> Task:
    """A view from a claim's row (wq.claim's columns after o_rn: the first nine of lookup's,
    then the expiry and the time limit; and, after the deadline, the result TTL given and the
    parents; after o_fin, the schedule that fired it and its scheduled time)."""
    error = row[6]
    if error is not None:
        error = bytes(error).decode("utf-8", "surrogatepass")
    expires = row[9]
    task = Task(
        _hex(row[0]),
        row[1],
        row[2],
        row[3],
        row[4] - skew,
        row[5] - skew,
        error,
        row[7],
        row[8],
        None if expires is None else expires - skew,
        row[10],
    )
    if row[12] is not None:
        task.result_ttl = row[12]
    if row[13] is not None:
        task.after = tuple(_hex(k) for k in row[13])
    if row[16] is not None:  # (docs/design/schedules.md)
        task.schedule, task.scheduled_for = row[16], row[17]
    return task


def _schedule(row: Any, at: int = 0) -> Schedule:
    """A schedule from its columns (sql/queries.sql lists them), from column ``at`` of ``row``.
    Its times are the rule's: never translated between clocks."""
    name, cron, timezone, every, queue, payload, priority, max_attempts = row[at : at + 8]
    expires_in, timeout, result_ttl, paused, created, updated = row[at + 8 : at + 14]
    next_fire_at, last_fire_at, last_task, fires, revision = row[at + 14 : at + 19]
    task = ScheduleTask(payload, queue, priority, max_attempts, expires_in, timeout, result_ttl)
    return Schedule(
        name,
        task,
        cron,
        timezone,
        every,
        paused,
        created,
        updated,
        next_fire_at,
        last_fire_at,
        None if last_task is None else _hex(last_task),
        fires,
        revision,
    )


def _limited(row: QueueStats, limits: Sequence[Any]) -> QueueStats:
    """A queue's row with its limits (docs/design/schedules.md), from the columns rate_tasks,
    rate_per, rate_burst, concurrency and the tokens available (sql/queries.sql)."""
    tasks, per, burst, concurrency, tokens = limits
    if tasks is not None or concurrency is not None:
        rate = None if tasks is None else RateLimit(tasks, per, burst)
        row.limits = Limits(rate, concurrency)
        row.tokens = tokens
    return row


def _parents(after: Sequence[int], results: Sequence[bytes | None]) -> list[ParentResult]:
    """A delivery's parents: each with its result, if it holds one."""
    return [ParentResult(_hex(k), r) for k, r in zip(after, results, strict=True)]


# Listing: each state's statement (sql/queries.sql), and its first page's key (before any task).
_LISTS: Final = {
    READY: Q.list_ready,
    DELAYED: Q.list_delayed,
    HANDED_OUT: Q.list_handed_out,
    DEAD: Q.list_dead,
    WAITING: Q.list_waiting,
    SUCCEEDED: Q.list_succeeded,
}
# The states whose listing key is one number (an ord), not two.
_ONE_NUMBER: Final = frozenset({DEAD, WAITING})
_BIGINT: Final = 2**63 - 1


def _whole(x: float, low: int, high: int) -> int:
    """A number of a listing key as the integer column it stands for (a key this store gave is
    one already; any other is only kept in range, never an error of the database's)."""
    if isinstance(x, int):
        return min(max(x, low), high)
    return min(max(math.floor(x), low), high)


def _list_args(state: str, after: tuple[float, ...] | None) -> tuple[Any, ...]:
    """The key parameters of a listing statement: the first page's, or those after ``after``."""
    if state in _ONE_NUMBER:
        if after is None:
            return (-_BIGINT - 1,)
        if len(after) != 1:
            raise _bad_cursor()
        return (_whole(after[0], -_BIGINT - 1, _BIGINT),)
    if after is None:
        if state == READY:
            return (PRIORITIES, 0)  # (above every priority: the second range, all of them)
        return (-math.inf, 0)
    if len(after) != 2:
        raise _bad_cursor()
    ord_ = _whole(after[1], -_BIGINT - 1, _BIGINT)
    if state == READY:
        return (_whole(after[0], -1, PRIORITIES), ord_)
    return (float(after[0]), ord_)


def _bad_cursor() -> InvalidArgument:
    return InvalidArgument("cursor is not one this broker gave (pass next_cursor as it came)")


def _count(result: SweepResult, kind: int, queue: str, n: int) -> None:
    """A sweep's row of tasks promoted (1), expired (8) or results pruned (9), counted; or of a
    queue with a concurrency limit whose leases ran out (11: its consumers may take tasks
    again, docs/design/schedules.md)."""
    if kind == 1:
        result.promoted += n
        result.ready_queues.add(queue)
    elif kind == 11:
        result.ready_queues.add(queue)
    elif kind == 8:
        result.expired += n
    else:
        result.pruned += n


def _first(row: Any) -> Any:
    return row[0]


def _encode(error: str | None) -> bytes | None:
    return None if error is None else error.encode("utf-8", "surrogatepass")


def _edges(
    items: Sequence[NewTask],
) -> tuple[list[int], list[int], list[int | None], list[int | None]]:
    """The ``after`` of a call's items as wq.enqueue takes it: per edge, in the order of (item,
    position), the child item (from 1), the position, the parent's key (None: an earlier item,
    or an id that cannot be one) and that earlier item (from 1)."""
    child: list[int] = []
    pos: list[int] = []
    parent: list[int | None] = []
    item: list[int | None] = []
    for i, t in enumerate(items, 1):
        for j, ref in enumerate(t.after):
            child.append(i)
            pos.append(j)
            if isinstance(ref, int):
                parent.append(None)
                item.append(ref + 1)
            else:
                n = parse_id(ref)
                parent.append(None if n is None else _key(n))
                item.append(None)
    return child, pos, parent, item


def _refused(error: asyncpg.PostgresError, items: Sequence[NewTask]) -> Exception:
    """What an enqueue refused by the database raises: UnknownParent for a parent that is no
    task (wq.link's WQ404: the item, the position and the id it stands for), else the error."""
    if error.sqlstate != _UNKNOWN_PARENT:
        return StoreError(f"the database failed: {one_line(error)}")
    item, pos, task_id = (str(error.detail or "") + "  ").split(" ")[:3]
    i, j = int(item) - 1, int(pos)
    ref = items[i].after[j]
    return UnknownParent(i, j, ref if isinstance(ref, str) else task_id)


class PostgresStore:
    """Open with :meth:`open` (it creates or checks the schema); close with :meth:`close`."""

    never_suspends = False  # every call waits for the database
    # Other brokers change the same tasks (a ReadyListener, see on_ready; and a CancelListener,
    # see on_cancel).
    shared = True

    def __init__(
        self,
        dsn: str,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        *,
        pool_size: int = POOL_SIZE,
        db_clock: bool = False,
        deadline: float = DEADLINE,
    ) -> None:
        rng = rng if rng is not None else random.Random()
        self.dsn = dsn
        self.db_clock = db_clock
        self._backoff = backoff if backoff is not None else Backoff(rng=rng)
        self._rng = rng
        self._pool_size = pool_size
        self._id_key = 0
        self._ids: list[int] = []  # numbers reserved for ids, not yet used (last first)
        self._ids_from: int | None = None  # the pool's generation they were reserved in
        # How many numbers are kept reserved ahead of the calls (at least a group's need),
        # doubled whenever a call found too few (at most _AHEAD_MOST).
        self._ahead = 0
        self._reserving = asyncio.Lock()
        self._closed = False
        # How far the database's clock is ahead of the broker's (db_clock only): times from the
        # database are handed to the broker minus this, times from the broker plus this.
        self.skew = 0.0
        # The hints: what this broker knows without I/O, as of its last sweep (every broker sweeps
        # a few times a second) and its own changes since.
        self._queue_names: set[str] = set()
        self._held = 0
        self._keys: dict[tuple[str, str], float] = {}  # keys this broker recorded -> until
        self._sweeps = 0
        self.transactions = 0
        # Group commit: calls made while one of their kind is in flight go together in the next
        # transaction (a broker serving many clients one task at a time pays far fewer round
        # trips and commits).
        self._enqueues = Grouped(self._enqueue_group, width=ENQUEUE_WIDTH)
        self._settles = Grouped(self._settle_group)
        self._claims = Grouped(self._claim_group, self._unclaim)
        self._settle_claims = Grouped(self._settle_claim_group, self._unclaim_settled)
        self._side_tasks: set[asyncio.Task[None]] = set()  # hand-backs, second looks (kept alive)
        # The connections (failing fast while the database is away) and the wake-ups between
        # brokers (what this one announces, what it hears). The database back: every queue is
        # re-checked.
        self._pool = Pool(self._tell_all, self._fail_waiting, deadline)
        self._wake = Listener(dsn, f"{rng.getrandbits(64):016x}", self._pool)
        self._vacuum: asyncio.Task[None] | None = None
        self.vacuums = 0  # tables vacuumed by this broker (for the tests)
        # What acks released since the last take_released (docs/design/results.md).
        self._released: Released | None = None
        # docs/design/schedules.md: when the next token comes to each rate-limited queue that a
        # claim of this broker's found short of one (in the broker's clock), for limit_hint.
        self._token_at: dict[str, float] = {}

    @property
    def announcements(self) -> int:
        """NOTIFYs sent (for the tests)."""
        return self._wake.announcements

    @property
    def retries(self) -> int:
        """Calls made again after a deadlock or a serialization failure (for the tests)."""
        return self._pool.retries

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        dsn: str,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        *,
        pool_size: int = POOL_SIZE,
        db_clock: bool = False,
        clock: Clock | None = None,
        deadline: float = DEADLINE,
    ) -> PostgresStore:
        """Connect, create or check the schema, start listening to other brokers. With
        ``db_clock``, every time is the database's (``clock``, the broker's, is compared with it
        to translate). ``deadline``: the longest any database call may take (pool.py)."""
        store = cls(dsn, backoff, rng, pool_size=pool_size, db_clock=db_clock, deadline=deadline)
        where = redact(dsn)
        await store._pool.connect(dsn, pool_size)
        try:
            await store._prepare(where, clock)
        except ValueError as e:
            await store._pool.close()
            raise StoreError(f"{where} is refused: {e}") from None
        except (*UNREACHABLE, asyncpg.PostgresError) as e:
            await store._pool.close()
            raise StoreError(f"cannot use {where}: {one_line(e)}") from None
        await store._wake.start()
        log.info("opened %s (wq schema version %d)", where, SCHEMA_VERSION)
        return store

    async def _prepare(self, where: str, clock: Clock | None) -> None:
        """Make, upgrade or check the schema (schema.py); read the id key and the hints; measure
        the skew between ``clock`` and the database's."""
        assert self._pool.raw is not None
        async with self._pool.raw.acquire() as conn:
            self._id_key = await prepare(conn, self._rng, where)
            self._queue_names = {name for (name,) in await conn.fetch(Q.queue_names)}
            self._held = int(await conn.fetchval(Q.held))
            if self.db_clock and clock is not None:
                before = clock.now()
                db_now = float(await conn.fetchval(Q.db_now))
                self.skew = db_now - (before + clock.now()) / 2

    # -- between brokers ---------------------------------------------------------------------

    def on_ready(self, callback: Callable[[Iterable[str] | None], None]) -> None:
        """Call ``callback(queues)`` when tasks became ready in ``queues`` without this broker
        making them so: another broker announced them, or a claim promoted delayed tasks. None
        means any queue: after the database or the listening connection came back, when
        announcements may have been missed."""
        self._wake.on_ready(callback)

    def on_cancel(self, callback: Callable[[Iterable[str]], None]) -> None:
        """Call ``callback(lease_ids)`` when another broker made the tasks held under these
        leases cancelling (its cancel's commit announced them)."""
        self._wake.on_cancel(callback)

    def on_finished(self, callback: FinishedCallback) -> None:
        """Call ``callback(pairs)`` with ``(task_id, state)`` for every watched task that ended:
        by a call of this store (once it committed: the functions return them) or of another
        broker's (announced in its transaction: listener.py)."""
        self._wake.on_finished(callback)

    def _tell_finished(self, found: Sequence[tuple[int, int]]) -> None:
        """Watched tasks a call of this store ended, as the functions name them (key, how)."""
        if found:
            self._wake.finished([(_hex(key), FINISHED_AS[how]) for key, how in found])

    def take_released(self) -> Released | None:
        released, self._released = self._released, None
        return released

    def _release(self, queue: str, ready: int, due: float | None) -> None:
        """Children released in ``queue`` by an ack (``ready`` of them ready; the earliest due
        time of those delayed, in the database's clock)."""
        released = self._released
        if released is None:
            released = self._released = Released()
        if ready:
            released.queues.add(queue)
        if due is not None:
            due -= self.skew
            if released.earliest is None or due < released.earliest:
                released.earliest = due

    def _tell_all(self) -> None:
        self._wake.tell(None)

    def _fail_waiting(self, error: StoreError) -> None:
        for grouped in (self._enqueues, self._settles, self._claims, self._settle_claims):
            grouped.fail_waiting(error)

    # -- the contract ------------------------------------------------------------------------

    async def enqueue_many(self, items: Sequence[NewTask], *, now: float) -> list[Enqueued]:
        if not items:
            return []
        if any(t.after for t in items):
            # (A call with an ``after`` is all or nothing, and its indices are its own: it goes
            # in a transaction of its own, never grouped with others.)
            return await self._enqueue(items, now)
        return await self._enqueues.call(items, self._group_key(now))

    async def _enqueue_group(
        self, calls: list[Sequence[NewTask]], now: float
    ) -> list[list[Enqueued]]:
        """The enqueues of several calls in one transaction; each call's answers."""
        items = [t for call in calls for t in call] if len(calls) > 1 else calls[0]
        out = await self._enqueue(items, now)
        return split(out, [len(call) for call in calls])

    async def _enqueue(self, items: Sequence[NewTask], now: float) -> list[Enqueued]:
        ids = await self._new_ids(len(items))
        linked = any(t.after for t in items)
        # Now and then (an idle broker: every time) the announcement of these tasks goes with
        # their commit, and the other brokers hear of them a round trip sooner. (Not a call
        # with an ``after``: which of its tasks are ready only the database tells.)
        notify = None if linked else self._wake.inline(items)
        args, keyed = self._enqueue_args(items, ids, now, notify)
        try:
            rows = await self._fetch(Q.enqueue, *args)
        except asyncpg.PostgresError as e:
            raise _refused(e, items) from None
        changed: dict[int, Any] = {}  # items wq.link changed, by index (from 1)
        if linked:
            changed = {row[0]: row for row in rows if row[2] is None}
            rows = [row for row in rows if row[2] is not None]
        if keyed:
            rows.sort(key=_first)  # (done in the order of their keys: wq.enqueue)
        out, ready = self._enqueued(items, rows, changed)
        if any(not e.duplicate for e in out):
            self.transactions += 1
        if notify is not None:
            self._wake.announcements += 1
        elif ready:
            self._wake.announce(ready)
        return out

    def _enqueue_args(
        self, items: Sequence[NewTask], ids: list[int], now: float, notify: str | None
    ) -> tuple[list[Any], bool]:
        """The arguments of wq.enqueue, and whether any task has an idempotency key."""
        skew = self.skew
        # The options of docs/design/control.md: sent only when a task of the batch has one.
        expires: list[float | None] | None = None
        timeouts: list[float | None] | None = None
        uniques: list[bool] | None = None
        keyed = False
        if any(
            t.key is not None or t.expires_at is not None or t.timeout is not None for t in items
        ):
            expires = [None if t.expires_at is None else t.expires_at + skew for t in items]
            timeouts = [t.timeout for t in items]
            uniques = [t.unique for t in items]
            keyed = any(t.key is not None for t in items)
        # The result TTL: one for all (the broker's default), or each task's when some differ.
        ttl: float | None = items[0].result_ttl
        ttls: list[float] | None = None
        given: list[bool] | None = None
        if any(t.result_ttl_given or t.result_ttl != ttl for t in items):
            ttl = None
            ttls = [t.result_ttl for t in items]
            given = [t.result_ttl_given for t in items]
        edges = _edges(items) if any(t.after for t in items) else (None, None, None, None)
        args = [
            self._now(now),
            [_key(n) for n in ids],
            [t.queue for t in items],
            [t.priority for t in items],
            [t.payload for t in items],
            [t.max_attempts for t in items],
            [t.delay for t in items],
            [t.key for t in items],
            [t.key_until + skew for t in items],
            notify,
            expires,
            timeouts,
            uniques,
            ttl,
            ttls,
            given,
            *edges,
        ]
        return args, keyed

    def _enqueued(
        self, items: Sequence[NewTask], rows: Sequence[Any], changed: dict[int, Any]
    ) -> tuple[list[Enqueued], set[str]]:
        """wq.enqueue's rows (in the items' order) read into the answers (``changed``: the rows
        of the items wq.link changed, by index from 1), and the queues of new ready tasks."""
        skew = self.skew
        out: list[Enqueued] = []
        ready: set[str] = set()
        for i, key, duplicate, at, available, *_ in rows:
            task_id = _hex(key)
            if duplicate:
                out.append(Enqueued(task_id, True, None))
                continue
            t = items[i - 1]
            self._queue_names.add(t.queue)
            if t.key is not None and not t.unique:
                self._keys[(t.queue, t.key)] = t.key_until
            task = Task(
                task_id,
                t.payload,
                0,
                t.max_attempts,
                at - skew,
                available - skew,
                None,
                t.queue,
                t.priority,
                t.expires_at,
                t.timeout,
            )
            if t.result_ttl_given:
                task.result_ttl = t.result_ttl
            state = 2 if t.delay > 0 else 0
            if t.after:
                task.after = tuple(r if isinstance(r, str) else out[r].id for r in t.after)
                link = changed.get(i)
                if link is not None:
                    state = self._linked(task, link)
            if state != 3:
                self._held += 1
            if state == 0:
                ready.add(t.queue)
            out.append(Enqueued(task_id, False, task))
        return out, ready

    def _linked(self, task: Task, row: Any) -> int:
        """A new task as wq.link left it (waiting, or dead at once): its state."""
        _, _, _, _, available, state, waiting, error = row
        task.available_at = available - self.skew
        task.waiting_for = waiting
        if error is not None:
            task.last_error = bytes(error).decode("utf-8", "surrogatepass")
        return int(state)

    async def _new_ids(self, n: int) -> list[int]:
        """``n`` fresh task ids (reserving blocks of numbers from the database as needed).

        After the store opened and whenever the database was away, the numbers still reserved
        are dropped and the sequence is moved ahead (``skip_ids``) before the next reservation:
        the server that answers may be a standby promoted since, which under asynchronous
        replication may not have had the old primary's last reservations, and would hand the
        same blocks out again (to this broker or another). Any reservation on a new primary
        comes after a skip by the broker that makes it, so past whatever the old one handed
        out (unless it ran more than 2^20 blocks ahead of its standby)."""
        if len(self._ids) < n or self._ids_from != self._pool.generation:
            if self._ids_from == self._pool.generation:
                # The stock ran out under the calls (groups side by side took more during a
                # top-up's round trip than it kept ahead): keep twice as many ahead from now on.
                self._ahead = min(max(2 * self._ahead, n, _ID_BLOCK), _AHEAD_MOST)
            async with self._reserving:  # (one reservation at a time: the next may need none)
                await self._reserve(n, max(n, self._ahead))
        taken = [self._ids.pop() for _ in range(n)]
        ahead = max(n, self._ahead)
        if len(self._ids) < ahead and not self._reserving.locked():
            # Topped up beside the calls, so that the next groups take their ids without a
            # round trip first (on a distant database, one more round trip per group).
            self._spawn(self._top_up(ahead))
        return [_mix((x + self._id_key) & _MASK) for x in taken]

    async def _reserve(self, n: int, ahead: int) -> None:
        """Have at least ``n`` numbers reserved, and ``ahead`` more (at most _AHEAD_MOST)
        when a reservation is made. The caller holds ``_reserving``."""
        generation = self._pool.generation
        if self._ids_from != generation:
            self._ids.clear()
            await self._execute(Q.skip_ids)
            self._ids_from = generation
        if len(self._ids) < n:
            want = n + min(ahead, _AHEAD_MOST) - len(self._ids)
            rows = await self._fetch(Q.id_blocks, (want + _ID_BLOCK - 1) // _ID_BLOCK)
            fresh = [b * _ID_BLOCK + j for (b,) in rows for j in range(_ID_BLOCK)]
            self._ids[:0] = reversed(fresh)

    async def _top_up(self, n: int) -> None:
        with contextlib.suppress(StoreError):
            async with self._reserving:
                await self._reserve(n, n)

    async def claim(
        self, *, lease: float, now: float, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> Delivery | None:
        deliveries = await self.claim_many((lease,), now=now, queues=queues)
        return deliveries[0] if deliveries else None

    async def claim_many(
        self, leases: Sequence[float], *, now: float, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> list[Delivery]:
        if not leases:
            return []
        return await self._claims.call(leases, (tuple(queues), self._group_key(now)))

    async def _claim_group(
        self, calls: list[Sequence[float]], key: tuple[tuple[str, ...], float]
    ) -> list[list[Delivery]]:
        """The claims of several calls (for the same queues) in one transaction; the first
        calls are served first."""
        queues, now = key
        leases = [lease for call in calls for lease in call]
        lease_ids = self._lease_ids(len(leases))
        rows = await self._fetch(
            Q.claim, self._now(now), leases, lease_ids, queues, self._wake.finish_head()
        )
        return self._claimed(rows, [len(call) for call in calls], lease_ids, queues)

    def _lease_ids(self, n: int) -> list[str]:
        return ["%016x" % self._rng.getrandbits(64) for _ in range(n)]  # noqa: UP031

    def _claimed(
        self,
        rows: Sequence[Any],
        sizes: list[int],
        lease_ids: list[str],
        queues: tuple[str, ...],
        *,
        offset: int = 0,
    ) -> list[list[Delivery]]:
        """A claim's rows (wq.claim's columns from ``offset`` on) read into each call's
        deliveries (``sizes``: how many each call asked for, in order)."""
        skew = self.skew
        got: dict[int, Delivery] = {}
        promoted: list[str] = []
        finished: list[tuple[int, int]] = []
        limited: dict[str, tuple[bool, float | None]] = {}  # (cut short, next token)
        for row in rows:
            if offset:
                row = row[offset:]
            if row[0] is not None:
                i = row[0] - 1
                d = Delivery(_handed(row[1:], skew), lease_ids[i], row[12] - skew)
                if row[14] is not None:
                    d.parents = _parents(row[14], row[15])
                got[i] = d
            elif row[16] == -1:  # a limited queue's row (docs/design/schedules.md)
                limited[row[8]] = (bool(row[3]), None if row[12] is None else row[12] - skew)
            elif row[16] is not None:
                finished.append((row[1], row[16]))
            else:
                promoted.append(row[8])
        if got or promoted or finished:
            self.transactions += 1
        self._tell_finished(finished)
        if promoted:  # for the others, and for this broker's consumers of other queues
            self._wake.announce(promoted)
            self._wake.tell(promoted)
        self._claim_seen(queues, limited, short=len(got) < len(lease_ids))
        out: list[list[Delivery]] = []
        at = 0
        for size in sizes:
            out.append([got[i] for i in range(at, at + size) if i in got])
            at += size
        return out

    def _claim_seen(
        self,
        queues: tuple[str, ...],
        limited: dict[str, tuple[bool, float | None]],
        *,
        short: bool,
    ) -> None:
        """What a claim of ``queues`` saw of their limits (docs/design/schedules.md; ``limited``:
        per limited queue, whether its limits cut the claim short and when its next token
        comes): kept for limit_hint (forgotten for the queues it did not name). A claim that
        came back ``short`` has its queues looked at again (_look_again), but those its limits
        cut short: their tasks are not locked but held back, and a token or a freed slot says
        when to look again."""
        token_at = self._token_at
        if limited or token_at:
            for name in queues:
                _, at = limited.get(name, (False, None))
                if at is None:
                    token_at.pop(name, None)
                else:
                    token_at[name] = at
        if short:
            look = tuple(q for q in queues if not (q in limited and limited[q][0]))
            if look:
                self._spawn(self._look_again(look))

    def limit_hint(self, queues: Sequence[str], now: float) -> float | None:
        """When the next token comes to one of ``queues``, as this broker's last claims of them
        saw their rows (None: none was short of one). Another broker may take it first: then
        the claim at that time sees when the next comes."""
        token_at = self._token_at
        if not token_at:
            return None
        when: float | None = None
        for name in queues:
            at = token_at.get(name)
            if at is not None and (when is None or at < when):
                when = at
        return None if when is None else max(when, now + _TOKEN_AFTER)

    def _freed(self, queues: Iterable[str]) -> None:
        """Tasks of queues with a concurrency limit were settled or reclaimed: slots are free
        again (docs/design/schedules.md). This broker's consumers are told (take_released), and
        the other brokers' (announced as ready)."""
        released = self._released
        if released is None:
            released = self._released = Released()
        released.queues.update(queues)
        self._wake.announce(queues)

    async def _look_again(self, queues: tuple[str, ...]) -> None:
        """After a claim that came back short: if ready tasks are left in its queues, they were
        locked when it looked (claims skip locked rows), and may be free a moment later. Rows
        stay locked until their transaction ends even when it does not take them: another
        broker's sweep or claim that met a task just promoted re-checks it, locked. Nobody
        announces such a task again, so this broker's consumers are told to look again."""
        with contextlib.suppress(StoreError):
            if await self._fetchval(Q.ready_left, list(queues)):
                loop = asyncio.get_running_loop()
                loop.call_later(LOOK_AGAIN_AFTER, self._wake.tell, queues)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    def _unclaim(self, deliveries: list[Delivery]) -> None:
        """Hand back what was claimed for a caller that went away before it got it."""

        async def release() -> None:
            for d in deliveries:
                with contextlib.suppress(StoreError):
                    await self.release(d.task.id, d.lease_id, now=None)
            self._wake.tell({d.task.queue for d in deliveries})  # this broker's consumers, too

        if deliveries:
            self._spawn(release())

    async def ack(
        self, task_id: str, lease_id: str, *, now: float, result: bytes | None = None
    ) -> None:
        results = None if result is None else {task_id: result}
        acked, _ = await self.settle_many(((task_id, lease_id),), (), now=now, results=results)
        if acked[0] is not None:
            raise acked[0]

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
        item = NackItem(task_id, lease_id, error, delay, terminal)
        _, nacked = await self.settle_many((), (item,), now=now)
        return _raise_or(nacked[0])

    async def reclaim(self, task_id: str, lease_id: str, error: str, *, now: float) -> Failure:
        item = NackItem(task_id, lease_id, error)
        _, nacked = await self._settle((), (item,), None, now, reclaim=True)
        return _raise_or(nacked[0])

    async def settle_many(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[NackItem],
        *,
        now: float,
        results: Mapping[str, bytes] | None = None,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        return await self._settles.call(
            (acks, nacks, _per_ack(acks, results)), self._group_key(now)
        )

    async def _settle_group(self, calls: list[_Settle], now: float) -> list[_Settled]:
        """The acks and nacks of several calls in one transaction; each call's outcomes."""
        if len(calls) == 1:
            return [await self._settle(*calls[0], now, reclaim=False)]
        acks = [a for call in calls for a in call[0]]
        nacks = [n for call in calls for n in call[1]]
        acked, nacked = await self._settle(acks, nacks, _results_of(calls), now, reclaim=False)
        return list(
            zip(
                split(acked, [len(c[0]) for c in calls]),
                split(nacked, [len(c[1]) for c in calls]),
                strict=True,
            )
        )

    async def _settle(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[NackItem],
        results: Sequence[bytes | None] | None,
        now: float,
        *,
        reclaim: bool,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        plan = _SettlePlan(acks, nacks, results)
        if not plan.ack_at and not plan.nack_at:
            return plan.acked, plan.nacked
        rows = await self._fetch(Q.settle, *self._settle_args(plan, now, reclaim))
        return self._settled(plan, rows)

    def _settle_args(self, plan: _SettlePlan, now: float, reclaim: bool) -> list[Any]:
        """The arguments of wq.settle for ``plan``."""
        acks, sent = plan.acks, plan.sent
        # The random part of each backoff that may be needed (as the Backoff would draw it).
        us = [self._draw() if n.delay is None and not n.terminal else 0.0 for n in sent]
        results = plan.results
        return [
            self._now(now),
            [_key(int(acks[i][0], 16)) for i in plan.ack_at],
            [acks[i][1] for i in plan.ack_at],
            [_key(int(n.task_id, 16)) for n in sent],
            [n.lease_id for n in sent],
            [_encode(n.error) for n in sent],
            [n.delay for n in sent],
            [n.terminal for n in sent],
            us,
            reclaim,
            self._backoff.base,
            self._backoff.cap,
            None if results is None else [results[i] for i in plan.ack_at],
            self._wake.finish_head(),
        ]

    def _settled(
        self, plan: _SettlePlan, rows: Iterable[Any]
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        """wq.settle's rows (o_kind, o_i, o_outcome, o_retry_at, o_id, o_queue) read into the
        outcomes; children released (take_released) and announced; watched tasks told."""
        acks, ack_at = plan.acks, plan.ack_at
        acked, results = plan.acked, plan.results
        changed = False
        released: set[str] = set()
        finished: list[tuple[int, int]] = []
        for kind, i, outcome, retry_at, key, queue in rows:
            if kind == 0:
                acked[ack_at[i - 1]] = error = _outcome_error(outcome, acks[ack_at[i - 1]][0])
                if error is None:
                    changed = True
                    if results is None or results[ack_at[i - 1]] is None:
                        self._held -= 1  # (forgotten; a result kept is held)
            elif kind == 1:
                changed = self._nacked(plan, i, outcome, retry_at) or changed
            elif kind == 2 or kind == 4:
                self._settled_queue(kind, queue, outcome, retry_at, released)
            else:
                finished.append((key, outcome))
        if changed:
            self.transactions += 1
        if released:
            self._wake.announce(released)
        self._tell_finished(finished)
        return acked, plan.nacked

    def _settled_queue(
        self, kind: int, queue: str, ready: int, due: float | None, released: set[str]
    ) -> None:
        """A row of wq.settle about a queue: children released in it by an ack (2: ``ready``
        of them ready, the earliest ``due`` of those delayed; ``released`` gathers the queues
        to announce), or slots of its concurrency limit freed (4: docs/design/schedules.md)."""
        if kind == 4:
            self._freed((queue,))
            return
        self._release(queue, ready, due)
        if ready:
            released.add(queue)

    def _nacked(self, plan: _SettlePlan, i: int, outcome: int, retry_at: float | None) -> bool:
        """A nack's row of wq.settle (the ``i``-th sent) read into its outcome; whether it
        changed anything."""
        sent, at = plan.sent, plan.nack_at[i - 1]
        if outcome == 3:  # (it was cancelling: gone)
            plan.nacked[at] = Failure(sent[i - 1].task_id, False, None, True)
        else:
            task_id = sent[i - 1].task_id
            error = _outcome_error(outcome, task_id)
            if retry_at is not None:
                retry_at -= self.skew
            plan.nacked[at] = (
                error if error is not None else Failure(task_id, retry_at is None, retry_at)
            )
        if outcome != 0 and outcome != 3:
            return False
        if retry_at is None:
            self._held -= 1  # buried or cancelled
        return True

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
        """One statement (wq.settle, then wq.claim: one round trip, one commit), grouped with
        the calls of its kind for the same queues that came meanwhile."""
        if not leases:
            acked, nacked = await self.settle_many(acks, nacks, now=now, results=results)
            return acked, nacked, []
        return await self._settle_claims.call(
            (acks, nacks, leases, _per_ack(acks, results)), (tuple(queues), self._group_key(now))
        )

    async def _settle_claim_group(
        self, calls: list[_SettleClaim], key: tuple[tuple[str, ...], float]
    ) -> list[_SettledClaimed]:
        queues, now = key
        plan = _SettlePlan(
            [a for call in calls for a in call[0]],
            [n for call in calls for n in call[1]],
            _results_of(calls),
        )
        leases = [lease for call in calls for lease in call[2]]
        lease_ids = self._lease_ids(len(leases))
        rows = await self._fetch(
            Q.settle_claim,
            *self._settle_args(plan, now, reclaim=False),
            leases,
            lease_ids,
            queues,
        )
        before = self.transactions
        acked, nacked = self._settled(plan, [row[1:7] for row in rows if row[0] == 0])
        claimed = self._claimed(
            [row for row in rows if row[0] == 1],
            [len(call[2]) for call in calls],
            lease_ids,
            queues,
            offset=7,
        )
        self.transactions = min(self.transactions, before + 1)  # (one commit for both)
        return list(
            zip(
                split(acked, [len(c[0]) for c in calls]),
                split(nacked, [len(c[1]) for c in calls]),
                claimed,
                strict=True,
            )
        )

    def _unclaim_settled(self, done: _SettledClaimed) -> None:
        self._unclaim(done[2])

    def _draw(self) -> float:
        rng = self._backoff.rng
        assert rng is not None
        return rng.random()

    async def extend(
        self,
        task_id: str,
        lease_id: str,
        *,
        lease: float,
        now: float,
        progress: bytes | None = None,
    ) -> float:
        n = parse_id(task_id)
        if n is None:
            raise _not_held(task_id)
        row = await self._fetchrow(Q.extend, self._now(now), _key(n), lease_id, lease, progress)
        assert row is not None
        outcome, deadline, timeout = row
        if outcome == 3:
            raise Cancelled(f"task {quoted(task_id)} was cancelled: its lease is not extended")
        if outcome == 4:
            ms = round(timeout * 1000)
            raise TimeLimitReached(
                f"task {quoted(task_id)} has reached its time limit of {ms} ms (timeout_ms): its "
                "lease is not extended"
            )
        error = _outcome_error(outcome, task_id)
        if error is not None:
            raise error
        self.transactions += 1
        return float(deadline) - self.skew

    # -- control over tasks (docs/design/control.md) ------------------------------------------

    async def cancel(self, task_id: str, *, now: float) -> CancelResult:
        """One call of wq.cancel: a handed-out task's lease is announced to the other brokers in
        its own transaction (they hear it once it is committed). A waiting task's waiting
        children are cancelled too, a ready or delayed one's buried (docs/design/results.md)."""
        n = parse_id(task_id)
        rows = []
        if n is not None:
            rows = await self._fetch(
                Q.cancel,
                _key(n),
                self._wake.cancel_head(),
                self._wake.finish_head(),
                self._now(now),
            )
        if not rows or rows[0][0] == 0:
            raise NotFound(f"task {quoted(task_id)} does not exist (or was acked)")
        outcome, queue, lease_id, _, _ = rows[0]
        if outcome == 2:
            return CancelResult(task_id, CANCELLING, queue, lease_id)
        self.transactions += 1
        self._tell_finished([(r[3], r[4]) for r in rows[1:]])
        if outcome == 1:
            self._held -= 1
            return CancelResult(task_id, CANCELLED, queue)
        return CancelResult(task_id, PURGED, queue)

    async def list_tasks(
        self, queue: str, state: str, *, limit: int, after: tuple[float, ...] | None = None
    ) -> TaskPage:
        """One statement: a scan of the state's partial index from ``after`` on, for one more
        task than ``limit`` (whether another page follows)."""
        sql = _LISTS.get(state)
        if sql is None:
            raise InvalidArgument(f"state {quoted(state)} is not one a listing takes")
        rows = await self._fetch(sql, queue, limit + 1, *_list_args(state, after))
        skew = self.skew
        tasks = [TaskState(_task(row, skew), state) for row in rows[:limit]]
        if state == "dead":  # (its first key column: when it was buried)
            for item, row in zip(tasks, rows, strict=False):
                _buried(item.task, row[20], skew)
        if len(rows) <= limit:
            return TaskPage(tasks, None)
        last = rows[limit - 1]
        key: tuple[float, ...] = (last[21],) if state in _ONE_NUMBER else (last[20], last[21])
        return TaskPage(tasks, key)

    async def empty_queue(self, queue: str, *, now: float) -> int:
        rows = await self._fetch(Q.empty, queue, self._wake.finish_head(), self._now(now))
        if not rows:
            raise NotFound(f"queue {quoted(queue)} does not exist")
        count = int(rows[0][0])
        if count:
            self.transactions += 1
            self._held -= count
        self._tell_finished([(r[1], r[2]) for r in rows[1:]])
        return count

    async def delete_queue(self, queue: str) -> None:
        row = await self._fetchrow(Q.delete_queue, queue)
        assert row is not None
        found, ready, handed_out, delayed, dead, waiting = row
        if not found:
            raise NotFound(f"queue {quoted(queue)} does not exist")
        if ready or handed_out or delayed or dead or waiting:
            raise Conflict(
                f"queue {quoted(queue)} holds {ready} ready, {handed_out} handed-out, {delayed} "
                f"delayed, {dead} dead and {waiting} waiting tasks: empty it (POST "
                "/queues/{name}/empty), let its handed-out tasks finish and purge its dead ones "
                "first"
            )
        self.transactions += 1
        self._queue_names.discard(queue)

    async def release(self, task_id: str, lease_id: str, *, now: float | None = None) -> bool:
        n = parse_id(task_id)
        if n is None:
            return False
        when = None if now is None else self._now(now)
        rows = await self._fetch(Q.release, _key(n), lease_id, self._wake.finish_head(), when)
        if not rows:
            return False
        self.transactions += 1
        self._wake.announce((rows[0][0],))
        self._tell_finished([(r[1], r[2]) for r in rows[1:]])
        return True

    async def sweep(self, *, now: float) -> tuple[SweepResult, float | None]:
        entered = time.monotonic()
        when = self._now(now)
        expired = int(await self._fetchval(Q.expired, when) or 0)
        us = [self._draw() for _ in range(expired)]
        refresh = self._sweeps % _SWEEPS_PER_REFRESH == 0
        self._sweeps += 1
        started = time.monotonic()
        rows = await self._fetch(
            Q.sweep,
            when,
            us,
            self._backoff.base,
            self._backoff.cap,
            refresh,
            self._wake.finish_head(),
        )
        took = time.monotonic() - started
        result = SweepResult()
        due, db_now = self._swept(rows, result, refresh, started)
        if self.db_clock and took < _SKEW_RTT:
            self.skew = db_now - (now + (started - entered) + took / 2)
        self._keys = {k: until for k, until in self._keys.items() if until > now}
        if result.reclaimed or result.promoted or result.expired or result.pruned:
            self.transactions += 1
        if result.ready_queues:
            self._wake.announce(result.ready_queues)
        if refresh:
            await self._execute(Q.fold)
        return result, None if due is None else due - self.skew

    def _swept(
        self, rows: list[asyncpg.Record], result: SweepResult, refresh: bool, started: float
    ) -> tuple[float | None, float]:
        """Read a sweep's rows into ``result`` and the hints; when the next thing is due and
        the database's time (its clock). Starts a vacuum of the tables that need one."""
        due: float | None = None
        db_now = 0.0
        names: set[str] = set()
        dirty: list[str] = []
        finished: list[tuple[int, int]] = []
        for kind, key, lease_id, queue, n, at in rows:
            if kind == 0:
                result.reclaimed.append((_hex(key), lease_id))
            elif kind == 2:
                due = at
            elif kind == 5:
                db_now = at
            elif kind == 6:
                self._wake.counted(n, started)
            elif kind == 10:
                finished.append((key, n))
            elif kind in (1, 8, 9, 11):
                _count(result, kind, queue, n)
            else:
                self._hint(kind, queue, n, at, names, dirty)
        if refresh:
            self._queue_names = names
        self._tell_finished(finished)
        if dirty and self._vacuum is None and not self._closed:
            self._vacuum = asyncio.get_running_loop().create_task(self._vacuum_tables(dirty))
        return due, db_now

    def _hint(
        self, kind: int, name: str, n: int, x: float, names: set[str], dirty: list[str]
    ) -> None:
        if kind == 3:
            names.add(name)
        elif kind == 4:
            self._held = n
        elif kind == 7 and n > VACUUM_THRESHOLD + VACUUM_SCALE * x:
            dirty.append(name)

    async def _vacuum_tables(self, tables: list[str]) -> None:
        """VACUUM tables full of dead rows (acked tasks, old counter values), on a connection of
        its own: claims must not wade through dead index entries, whether or not the server's
        autovacuum is on. One broker at a time (an advisory lock); the others skip it."""
        try:
            conn = await dsns.connect(self.dsn, timeout=5)
        except (*UNREACHABLE, asyncpg.PostgresError):
            self._vacuum = None
            return
        try:
            if await conn.fetchval(Q.try_lock, _VACUUM_KEY):
                for table in tables:
                    await conn.execute(_VACUUM[table])
                    self.vacuums += 1
                await conn.execute(Q.unlock, _VACUUM_KEY)
        except (*UNREACHABLE, asyncpg.PostgresError) as e:
            log.info("could not vacuum %s: %s", ", ".join(tables), one_line(e))
        finally:
            self._vacuum = None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 1)

    async def requeue(self, task_id: str, *, now: float) -> str:
        n = parse_id(task_id)
        rows = []
        if n is not None:
            rows = await self._fetch(Q.requeue, self._now(now), _key(n), None)
        if not rows:
            raise NotFound(f"task {quoted(task_id)} is not in the dead-letter queue")
        self.transactions += 1
        self._held += 1
        self._wake.announce((rows[0][0],))
        return str(rows[0][0])

    async def requeue_all(self, *, queue: str | None = None, now: float) -> tuple[int, list[str]]:
        rows = await self._fetch(Q.requeue, self._now(now), None, queue)
        count = sum(int(r[2]) for r in rows)
        names = [str(r[0]) for r in rows]
        if rows:
            self.transactions += 1
            self._held += count
            self._wake.announce(names)
        return count, names

    async def purge(self, task_id: str) -> None:
        n = parse_id(task_id)
        if n is None or not await self._fetchval(Q.purge, _key(n)):
            raise NotFound(f"task {quoted(task_id)} is not in the dead-letter queue")
        self.transactions += 1

    async def set_paused(self, queue: str, paused: bool) -> None:
        status = await self._execute(Q.pause, queue, paused)
        self._queue_names.add(queue)
        if not status.endswith(" 0"):
            self.transactions += 1
            if not paused:
                self._wake.announce((queue,))

    async def set_limits(self, queue: str, limits: Limits | None, *, now: float) -> None:
        """Kept in the queue's row, with its rate bucket (docs/design/schedules.md); the other
        brokers' consumers of the queue look again (a limit raised or cleared)."""
        rate = None if limits is None else limits.rate
        concurrency = None if limits is None else limits.concurrency
        status = await self._execute(
            Q.set_limits,
            queue,
            None if rate is None else rate.tasks,
            None if rate is None else rate.per,
            None if rate is None else rate.burst,
            concurrency,
            self._now(now),
        )
        self._queue_names.add(queue)
        self._token_at.pop(queue, None)
        if not status.endswith(" 0"):
            self.transactions += 1
            self._wake.announce((queue,))

    async def stats(self, queue: str | None = None) -> Stats:
        if queue is None:
            row = await self._fetchrow(Q.stats)
        else:
            row = await self._fetchrow(Q.queue_stats, queue)
        assert row is not None
        ready, handed_out, delayed, dead, *totals, waiting, succeeded = row
        if queue is None:
            self._held = ready + handed_out + delayed + waiting + succeeded
        return Stats(
            ready, handed_out, delayed, dead, Totals(*totals), waiting=waiting, succeeded=succeeded
        )

    def _tokens_now(self, now: float | None) -> tuple[float | None, bool]:
        """The arguments by which the statements queues and report give the tokens of a
        rate-limited queue: at ``now`` (None: as left by its last claim), or at the database's
        clock (db_clock)."""
        if now is None:
            return None, False
        return self._now(now), self.db_clock

    async def queues(self, *, now: float | None = None) -> list[QueueStats]:
        rows = await self._fetch(Q.queues, *self._tokens_now(now))
        out = [
            _limited(QueueStats(r[0], r[2], r[3], r[4], r[5], r[1], r[6], r[7]), r[8:13])
            for r in rows
        ]
        out.sort(key=lambda q: q.name)
        self._queue_names = {q.name for q in out}
        return out

    async def queue_report(self, *, now: float | None = None) -> list[QueueReport]:
        out = []
        rows = await self._fetch(Q.report, PRIORITIES, *self._tokens_now(now))
        for name, paused, ready, handed_out, delayed, dead, *rest in rows:
            *totals, waiting, succeeded, oldest = rest[:-5]
            row = QueueStats(name, ready, handed_out, delayed, dead, paused, waiting, succeeded)
            out.append(
                QueueReport(
                    _limited(row, rest[-5:]),
                    Totals(*totals),
                    None if oldest is None else oldest - self.skew,
                )
            )
        out.sort(key=lambda r: r.queue.name)
        return out

    async def lookup(self, task_id: str) -> TaskState | None:
        n = parse_id(task_id)
        if n is None:
            return None
        row = await self._fetchrow(Q.lookup, _key(n))
        if row is None:
            return None
        task = _task(row, self.skew)
        _buried(task, row[21], self.skew)
        return TaskState(task, _STATES[row[20]])

    async def watch(self, task_id: str) -> TaskState:
        """One statement (wq.watch): the task marked watched if it is pending, then read."""
        n = parse_id(task_id)
        row = None if n is None else await self._fetchrow(Q.watch, _key(n))
        if row is None:
            raise NotFound(f"task {quoted(task_id)} does not exist")
        task = _task(row, self.skew)
        _buried(task, row[21], self.skew)
        return TaskState(task, _STATES[row[20]])

    async def children(self, task_id: str, *, limit: int) -> tuple[list[str], int]:
        n = parse_id(task_id)
        if n is None:
            return [], 0
        row = await self._fetchrow(Q.children, _key(n), limit)
        assert row is not None
        return [_hex(k) for k in row[0]], int(row[1])

    async def dead_letters(
        self, *, limit: int | None = None, queue: str | None = None
    ) -> list[Task]:
        rows = await self._fetch(Q.dead, queue, limit)
        skew = self.skew
        out = []
        for row in rows:
            task = _task(row, skew)
            _buried(task, row[20], skew)
            out.append(task)
        return out

    def problem(self) -> str | None:
        return self._pool.problem()

    # -- schedules (docs/design/schedules.md): rows of wq.schedules, a fire one call of wq.fire

    async def put_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        t = schedule.task
        row = await self._fetchrow(
            Q.put_schedule,
            schedule.name,
            schedule.cron,
            schedule.timezone,
            schedule.every,
            t.queue,
            t.payload,
            t.priority,
            t.max_attempts,
            t.expires_in,
            t.timeout,
            t.result_ttl,
            schedule.paused,
            now,
            None if schedule.paused else schedule.next_fire_at,
        )
        assert row is not None
        self.transactions += 1
        return _schedule(row)

    async def get_schedule(self, name: str) -> Schedule | None:
        row = await self._fetchrow(Q.get_schedule, name)
        return None if row is None else _schedule(row)

    async def list_schedules(self) -> list[Schedule]:
        return [_schedule(row) for row in await self._fetch(Q.list_schedules)]

    async def schedule_count(self) -> int:
        return int(await self._fetchval(Q.schedule_count))

    async def delete_schedule(self, name: str) -> bool:
        deleted = not (await self._execute(Q.delete_schedule, name)).endswith(" 0")
        self.transactions += deleted
        return deleted

    async def set_schedule_paused(
        self, name: str, paused: bool, next_fire_at: float | None, *, now: float
    ) -> Schedule | None:
        row = await self._fetchrow(
            Q.pause_schedule, name, paused, None if paused else next_fire_at, now
        )
        if row is None:
            return None
        self.transactions += 1
        return _schedule(row)

    async def due_schedules(self, now: float) -> tuple[float, list[Schedule], float | None]:
        """One statement: the time (the database's, with ``db_clock``: a schedule's times are
        wall-clock times, compared with the database's clock as they are), the due schedules
        and the earliest next fire of the others."""
        rows = await self._fetch(Q.due_schedules, self._now(now))
        first = rows[0]
        due = [_schedule(row, 2) for row in rows if row[2] is not None]
        return float(first[0]), due, first[1]

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
        """One call of wq.fire: the compare-and-set, the enqueue (wq.enqueue's own) and the
        move, in one transaction (not grouped: each fire is its own compare-and-set)."""
        items = (task,)
        ids = await self._new_ids(1)
        args, _ = self._enqueue_args(items, ids, now, None)
        try:
            rows = await self._fetch(
                Q.fire, name, expected, revision, scheduled_for, next_fire_at, *args[:16]
            )
        except asyncpg.PostgresError as e:
            raise _refused(e, items) from None
        if not rows:
            return None
        out, ready = self._enqueued(items, rows, {})
        done = out[0]
        assert done.task is not None
        done.task.schedule, done.task.scheduled_for = task.schedule, task.scheduled_for
        self.transactions += 1
        if ready:
            self._wake.announce(ready)
        return done

    async def skip_schedule(
        self, name: str, expected: float, next_fire_at: float, *, revision: int
    ) -> bool:
        status = await self._execute(Q.skip_schedule, name, expected, revision, next_fire_at)
        moved = not status.endswith(" 0")
        self.transactions += moved
        return moved

    # Hints (for the service's -max-tasks and -max-queues): the database is shared with other
    # brokers, so they are this broker's view as of its last sweep (a fraction of a second old)
    # plus its own changes since. The limits hold across brokers only that closely.

    def held_hint(self) -> int | None:
        return max(self._held, 0)

    def queue_hint(self, queue: str) -> bool | None:
        return queue in self._queue_names

    def queue_count_hint(self) -> int | None:
        return len(self._queue_names)

    def key_hint(self, queue: str, key: str, now: float) -> bool | None:
        until = self._keys.get((queue, key))
        if until is not None and until > now:
            return True
        return None  # not recorded here: another broker may have (the enqueue will tell)

    def ready_hint(self) -> int | None:
        return None

    async def close(self) -> None:
        self._closed = True
        self._pool.closed = True  # calls are refused from now on
        await self._wake.close()  # (the last announcement goes out)
        await cancel(self._vacuum)
        await self._pool.close()

    # -- for the tests -----------------------------------------------------------------------

    async def wipe(self) -> None:
        """Drop every task, queue, key and counter, and start ids over (the tests start each
        store empty, and give the same ids to the same steps)."""
        await self._execute(Q.wipe)
        self._ids.clear()
        self._ids_from = None
        self._ahead = 0
        self._queue_names.clear()
        self._held = 0
        self._keys.clear()

    async def check_invariants(self) -> None:
        """Assert the gauges kept in the counters agree with the tasks, queue by queue, and with
        the totals: ``ready + handed_out + delayed + dead + waiting == enqueued - acked - purged
        - cancelled - expired`` and ``nacked + reclaimed == retried + buried``; and that every
        edge's child is a task, and every task's count of parents its edges'."""
        for row in await self._fetch(Q.check):
            kept, counted = tuple(row[1:7]), tuple(row[7:13])
            assert kept == counted, f"queue {row[0]}: gauges {kept} but tasks {counted}"
            held, failed, followed = row[13:16]
            assert sum(kept[:5]) == held, f"queue {row[0]}: gauges {kept} but the totals say {held}"
            assert failed == followed, f"queue {row[0]}: nacked + reclaimed {failed}, {followed}"
        edges = await self._fetchrow(Q.edges_check)
        assert edges is not None
        assert tuple(edges) == (0, 0), f"edges of no task, or parents miscounted: {tuple(edges)}"

    # -- talking to the database -------------------------------------------------------------

    def _now(self, now: float) -> float | None:
        return None if self.db_clock else now

    def _group_key(self, now: float) -> float:
        """What calls must share to go in one transaction: their ``now``, unless the database's
        clock is used (then any calls go together)."""
        return 0.0 if self.db_clock else now

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        return await self._pool.fetch(sql, *args)

    async def _fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        rows = await self._fetch(sql, *args)
        return rows[0] if rows else None

    async def _fetchval(self, sql: str, *args: Any) -> Any:
        row = await self._fetchrow(sql, *args)
        return row[0] if row is not None else None

    async def _execute(self, sql: str, *args: Any) -> str:
        return await self._pool.execute(sql, *args)


# A settle call: its acks, its nacks, and the result of each ack (None: none has one).
_Results = Sequence[bytes | None] | None
_Settle = tuple[Sequence[tuple[str, str]], Sequence[NackItem], _Results]
_Settled = tuple[list[WqError | None], list[Failure | WqError]]
_SettleClaim = tuple[Sequence[tuple[str, str]], Sequence[NackItem], Sequence[float], _Results]
_SettledClaimed = tuple[list[WqError | None], list[Failure | WqError], list[Delivery]]


def _per_ack(
    acks: Sequence[tuple[str, str]], results: Mapping[str, bytes] | None
) -> list[bytes | None] | None:
    """The result of each ack (by its task id in ``results``), or None when none has one."""
    if not results:
        return None
    out = [results.get(task_id) for task_id, _ in acks]
    return out if any(r is not None for r in out) else None


def _results_of(calls: Sequence[_Settle] | Sequence[_SettleClaim]) -> list[bytes | None] | None:
    """The results of the acks of several settle calls, in order (None: none has one)."""
    if all(call[-1] is None for call in calls):
        return None
    out: list[bytes | None] = []
    for call in calls:
        results = call[-1]
        out += [None] * len(call[0]) if results is None else results
    return out


class _SettlePlan:
    """Acks and nacks as wq.settle takes them: those whose task id cannot be one are answered
    NotFound without asking (their outcomes start so, the others are filled in). ``results``:
    each ack's result (None: none has one)."""

    __slots__ = ("acks", "nacks", "acked", "nacked", "ack_at", "nack_at", "sent", "results")

    def __init__(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[NackItem],
        results: Sequence[bytes | None] | None = None,
    ) -> None:
        self.acks = acks
        self.nacks = nacks
        self.results = results
        self.acked: list[WqError | None] = [_not_held(t) for t, _ in acks]
        self.nacked: list[Failure | WqError] = [_not_held(n.task_id) for n in nacks]
        self.ack_at = [i for i, (t, _) in enumerate(acks) if parse_id(t) is not None]
        self.nack_at = [i for i, n in enumerate(nacks) if parse_id(n.task_id) is not None]
        self.sent = [nacks[i] for i in self.nack_at]


def _not_held(task_id: str) -> NotFound:
    return NotFound(f"task {quoted(task_id)} is not held by anyone")


def _outcome_error(outcome: int, task_id: str) -> WqError | None:
    if outcome == 0:
        return None
    if outcome == 2:
        return LeaseLost(f"task {quoted(task_id)} is held under a different lease")
    return _not_held(task_id)


def _raise_or(result: Failure | WqError) -> Failure:
    if isinstance(result, WqError):
        raise result
    return result
