"""The SQLite store: durable, through the standard library's sqlite3.

Design: the SQLite file is the truth. In memory the store keeps an
:class:`~wqbroker.store.index.Index` over it: ids, states, attempts, the order of ready and dead
tasks, delay and lease deadlines, the errors of tasks waiting for a retry -- never payloads (nor
creation times, nor the errors of dead tasks), which are read back from the file when a task is
handed out or listed. So the backlog is bounded by the disk, not by memory (a small cache keeps the
payloads of tasks just enqueued, which are usually handed out at once). Every operation changes the
index atomically on the event loop, exactly as the memory store does (the semantics are the same,
and the sweeper works from heaps keyed by deadline, never a table scan); the index reports each
change to a journal, and the operation then waits until those changes are committed. Only then does
the service answer.

Group commit: one writer thread owns the connection. While it commits one batch, every operation
that arrives joins the next one, so many concurrent requests share one transaction and one sync to
disk, and a call that changes many tasks (a batch enqueue, a batch of settlements) is one
transaction. A batch is a consistent cut of the index (it is sealed between two operations on the
loop), and batches commit in order, so nothing a client was told can be lost by a crash. If a
commit fails (disk full, I/O error) nothing of its batch is in the file, but the index is ahead of
the file: the store stops accepting work and every call fails with StoreError. Restart the broker
to reload what was committed.

The file is opened in WAL mode with an exclusive lock (a second broker on the same file is refused
at start). ``synchronous`` is FULL by default: a commit is on disk before the answer, so nothing
acknowledged is lost even on power loss. With NORMAL, commits survive a crash of the broker
(kill -9) but the last ones may be lost on power loss or an OS crash.

Schema: the numbered files of ``sqlite_migrations/`` (``001`` the first schema, ``002`` payloads
kept apart, ``003`` queues, priorities and keys, ``004`` control over tasks, ``005`` results and
workflows, ``006`` schedules, ``007`` limits per queue), run at open by the runner both SQL
stores share (wqbroker/store/migrate.py) inside the ``BEGIN IMMEDIATE`` transaction that takes the
file's lock; a file of a newer version, or not wq's, is refused. A queue's limits are kept in its
row; its rate bucket is not (it starts full after a restart: docs/design/schedules.md).

Results and workflows (docs/design/results.md): results are kept beside payloads and read back
the same way (for a lookup, a listing, the parents of a task handed out); a task's parents are
rows of ``edges``, written with the task and deleted with it. A parent's ack and its children's
release, a parent's end and its children's burial, are one change of the index and so one commit.
Watched tasks that ended are told to ``on_finished``'s callback once their commit is done.

Restart: the index is rebuilt by streaming the rows (payloads are not read). Every task comes back
in the collection it was in (ready ones in the same order, the dead-letter queue in order of
burial; waiting and succeeded ones, their edges, what each waiting task still waits for counted
from its parents' states). Handed-out tasks keep their lease: a worker still holding one can ack
it after the restart; otherwise it is reclaimed when its deadline passes (at once, if it passed
while the broker was down). Counters survive too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import astuple, replace
from typing import Any, Final, TypeVar

from wqbroker.errors import NotFound, StoreError, WqError, quoted
from wqbroker.models import (
    CANCELLED,
    DEFAULT_QUEUE,
    CancelResult,
    Delivery,
    Enqueued,
    Failure,
    Limits,
    ListKey,
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
from wqbroker.store.book import Book, enqueue_fired
from wqbroker.store.index import (
    DEAD,
    DEFAULT_RESULT_TTL,
    HANDED_OUT,
    PENDING,
    READY,
    STATE_NAMES,
    SUCCEEDED,
    WAITING,
    Flow,
    Index,
    Lane,
    Queue,
    Record,
    flow_view,
    hex_id,
    parse_id,
)
from wqbroker.store.migrate import Migrations

log = logging.getLogger("wqbroker.store.sqlite")

R = TypeVar("R")

SYNC_MODES: Final = ("full", "normal")

# The schema: the numbered files of sqlite_migrations/ (001 the first schema, 002 payloads kept
# apart, 003 queues, priorities and keys), run by the runner both SQL stores share.
MIGRATIONS: Final = Migrations("wqbroker.store", "sqlite_migrations")
SCHEMA_VERSION: Final = MIGRATIONS.latest

_INSERT = (
    "INSERT INTO tasks (id, attempts, max_attempts, available_at, state, lease_id, deadline, ord, "
    "queue, priority, expires_at, timeout, ukey, result_ttl, ttl_given, finished_at, delay, "
    "buried_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_INSERT_BODY = "INSERT INTO bodies (id, payload, created_at) VALUES (?, ?, ?)"
_UPDATE = (
    "UPDATE tasks SET attempts = ?, available_at = ?, state = ?, lease_id = ?, deadline = ?, "
    "ord = ?, buried_at = ? WHERE id = ?"
)
# The same, for a task whose control columns are set (docs/design/control.md) or were.
_UPDATE_CONTROL = (
    "UPDATE tasks SET attempts = ?, available_at = ?, state = ?, lease_id = ?, deadline = ?, "
    "ord = ?, expires_at = ?, timeout = ?, handed_at = ?, progress = ?, cancelling = ?, ukey = ?, "
    "buried_at = ? WHERE id = ?"
)
_SET_ERROR = "UPDATE tasks SET last_error = ? WHERE id = ?"
_DELETE = "DELETE FROM tasks WHERE id = ?"
_DELETE_BODY = "DELETE FROM bodies WHERE id = ?"
# docs/design/results.md: a task's parents (edges, made with it, gone with it), when it succeeded
# and its result.
_INSERT_EDGE = "INSERT INTO edges (child, parent) VALUES (?, ?)"
_DELETE_EDGES = "DELETE FROM edges WHERE child = ?"
_SET_FINISHED = "UPDATE tasks SET finished_at = ? WHERE id = ?"
_SET_RESULT = "UPDATE bodies SET result = ? WHERE id = ?"
# docs/design/schedules.md: a fired task's schedule (set once, after its insert), and the
# schedules' rows.
_SET_SCHEDULE = "UPDATE tasks SET schedule = ?, scheduled_for = ? WHERE id = ?"
_SCHEDULE_COLUMNS = (
    "name, cron, timezone, every, queue, payload, priority, max_attempts, expires_in, timeout, "
    "result_ttl, paused, created_at, updated_at, next_fire_at, last_fire_at, last_task_id, fires, "
    "revision"
)
_PUT_SCHEDULE = (
    f"INSERT OR REPLACE INTO schedules ({_SCHEDULE_COLUMNS}) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_DELETE_SCHEDULE = "DELETE FROM schedules WHERE name = ?"
_LOAD_SCHEDULES = f"SELECT {_SCHEDULE_COLUMNS} FROM schedules"
_TOTALS = (
    "UPDATE totals SET enqueued = ?, delivered = ?, acked = ?, nacked = ?, reclaimed = ?, "
    "retried = ?, buried = ?, requeued = ?, purged = ?, cancelled = ?, expired = ? WHERE id = 1"
)
_QUEUE = (
    "INSERT OR REPLACE INTO queues (name, paused, enqueued, delivered, acked, nacked, reclaimed, "
    "retried, buried, requeued, purged, cancelled, expired, rate_tasks, rate_per, rate_burst, "
    "concurrency) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_DROP_QUEUE = "DELETE FROM queues WHERE name = ?"
_KEY = "INSERT OR REPLACE INTO keys VALUES (?, ?, ?, ?)"
_UNKEY = "DELETE FROM keys WHERE queue = ? AND key = ?"
# The index, streamed at start: ready tasks as (key, queue, priority), in order; the others as
# records, with the error of a live task (a dead task's error stays in the file).
_LOAD_READY = "SELECT id, queue, priority, ord, expires_at FROM tasks WHERE state = 0 ORDER BY ord"
_CONTROL_COLUMNS = "expires_at, timeout, handed_at, progress, cancelling, ukey"
_FLOW_COLUMNS = "result_ttl, ttl_given, finished_at, delay"
_SCHEDULED_COLUMNS = "schedule, scheduled_for"
# (A dead task's record keeps when it was buried as its deadline: its buried_at column, NULL for a
# task buried before version 8.)
_LOAD_OTHERS = (
    "SELECT id, attempts, max_attempts, available_at, state, lease_id, "
    "CASE WHEN state = 3 THEN buried_at ELSE deadline END, ord, "
    "CASE WHEN state = 3 THEN NULL ELSE last_error END, priority, queue, "
    f"{_CONTROL_COLUMNS}, {_FLOW_COLUMNS}, {_SCHEDULED_COLUMNS} FROM tasks WHERE state != 0"
)
# Every edge, in the order made, with the state of its parent (NULL: the parent is gone).
_LOAD_EDGES = (
    "SELECT e.child, e.parent, p.state FROM edges e LEFT JOIN tasks p ON p.id = e.parent "
    "ORDER BY e.n"
)
_LOAD_QUEUES = (
    "SELECT name, paused, enqueued, delivered, acked, nacked, reclaimed, retried, buried, "
    "requeued, purged, cancelled, expired, rate_tasks, rate_per, rate_burst, concurrency "
    "FROM queues"
)
_LOAD_UNIQUE = "SELECT queue, ukey, id FROM tasks WHERE ukey IS NOT NULL AND state IN (0, 1, 2, 5)"
_LOAD_KEYS = "SELECT queue, key, task_id, until FROM keys"
# Cold ready tasks read back, with their payloads.
_WARM = (
    "SELECT id, attempts, max_attempts, available_at, state, lease_id, deadline, "
    f"ord, last_error, priority, queue, {_CONTROL_COLUMNS}, {_FLOW_COLUMNS}, "
    f"{_SCHEDULED_COLUMNS}, payload, created_at "
    "FROM tasks JOIN bodies USING (id) WHERE id IN ({})"
)
# Where a _WARM row has its payload (and its creation time next).
_PAYLOAD_AT: Final = 23
_READ = (
    "SELECT b.id, b.payload, b.created_at, t.last_error, b.result FROM bodies b "
    "JOIN tasks t ON t.id = b.id WHERE b.id IN ({})"
)
_READ_RESULTS = "SELECT id, result FROM bodies WHERE id IN ({}) AND result IS NOT NULL"
# Parents named by new tasks that the index does not hold (cold ready ones), and dead ones'
# errors.
_READ_PARENTS = "SELECT id, state, queue, priority, ord, last_error FROM tasks WHERE id IN ({})"
# One task, any state (a lookup of a task the index holds only as a cold id).
_LOOKUP = (
    "SELECT t.attempts, t.max_attempts, t.available_at, t.state, t.last_error, t.queue, "
    "t.priority, b.payload, b.created_at, t.expires_at, t.timeout, t.progress, t.cancelling, "
    "t.ord, b.result, t.finished_at, t.result_ttl, t.ttl_given, t.schedule, t.scheduled_for, "
    "t.buried_at FROM tasks t JOIN bodies b ON t.id = b.id WHERE t.id = ?"
)
_OFFSET: Final = 2**63
# Before sealing a batch, let the event loop run this many times so that operations already
# under way (the rest of a burst of requests) join it: fewer, larger commits.
_GATHER_ROUNDS: Final = 3
# Payloads of tasks just enqueued, kept until they are handed out: up to this many bytes, counting
# what each entry costs beyond its payload.
_CACHE_BYTES: Final = 8 * 1024 * 1024
_CACHE_ENTRY: Final = 200
#: Ready tasks kept as records; beyond them (and after a restart) ready tasks are kept as ids
#: and read back from the file in batches of at least ``_WARM_BATCH`` when their turn comes.
HOT_READY: Final = 16_384
_WARM_BATCH: Final = 256
# Rows read back by key per SELECT.
_READ_CHUNK: Final = 500
# Rounds of reading back what changed meanwhile (parents, a result) before going on as it stands.
_FLOW_READS: Final = 8
# What a record holds instead of what the file keeps.
_NO_PAYLOAD: Final = b""
_NO_TIME: Final = 0.0

# A row of the file, as read back for a view: payload, created_at, last_error, result.
Row = tuple[bytes, float, str | None, bytes | None]
# What a commit reads back: rows by key, and results by key (of parents of tasks handed out).
Reads = tuple[dict[int, Row], dict[int, bytes]]


def _key(n: int) -> int:
    """A task id (as records hold it: 64 bits, unsigned) as the table's integer key (signed)."""
    return n - _OFFSET


def _buried_at(record: Record) -> float | None:
    """A dead task's burial time (its record's deadline; 0.0, not known), else None."""
    return (record.deadline or None) if record.state == DEAD else None


def _record(row: Sequence[Any]) -> tuple[Record, str, int]:
    """A task's record, its queue's name and its priority, from a row as _LOAD_OTHERS (or
    _WARM) reads it."""
    key, attempts, max_attempts, available_at, state, lease_id, deadline, seq, error = row[:9]
    expires_at, timeout, handed_at, progress, cancelling, ukey = row[11:17]
    record = Record(
        key + _OFFSET,
        _NO_PAYLOAD,
        max_attempts,
        _NO_TIME,
        available_at,
        attempts,
        state,
        seq,
        error,
        lease_id,
        deadline or _NO_TIME,
        expires_at=expires_at,
        timeout=timeout,
        handed_at=handed_at or _NO_TIME,
        progress=None if progress is None else bytes(progress),
        cancelling=bool(cancelling),
    )
    record.ukey = ukey
    if len(row) > 17:
        ttl, ttl_given, finished_at, delay = row[17:21]
        record.ttl = DEFAULT_RESULT_TTL if ttl is None else ttl
        if ttl_given or state == WAITING or state == SUCCEEDED:
            flow = record.flow = Flow()
            flow.ttl_given = bool(ttl_given)
            flow.finished_at = finished_at or _NO_TIME
            flow.delay = delay or 0.0
        schedule = row[21]
        if schedule is not None:  # (docs/design/schedules.md: a fired task)
            ctl = record.control()
            ctl.schedule, ctl.scheduled_for = schedule, row[22]
    return record, row[10], row[9]


def _limit_columns(q: Queue) -> tuple[int | None, float | None, int | None, int | None]:
    """A queue's limits as its row keeps them (docs/design/schedules.md): rate_tasks,
    rate_per (seconds), rate_burst, concurrency; NULL where there is none. Its rate bucket is not
    kept: it starts full after a restart."""
    limiter = q.limiter
    if limiter is None:
        return None, None, None, None
    rate = limiter.limits.rate
    if rate is None:
        return None, None, None, limiter.concurrency
    return rate.tasks, rate.per, rate.burst, limiter.concurrency


def _limits_of(tasks: Any, per: Any, burst: Any, concurrency: Any) -> Limits | None:
    """A queue's limits from its row (see _limit_columns)."""
    rate = None if tasks is None else RateLimit(int(tasks), float(per), int(burst))
    limits = Limits(rate, None if concurrency is None else int(concurrency))
    return None if limits.empty() else limits


def _blob(value: Any) -> bytes | None:
    """A BLOB read back (sqlite3 may give text for a value written as text)."""
    if value is None:
        return None
    return value.encode() if isinstance(value, str) else bytes(value)


def _schema_version(conn: sqlite3.Connection) -> int | None:
    """The file's wq schema version; None for an empty file. ValueError if it is not wq's."""
    listed = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
    tables = {name for (name,) in listed}
    if not tables:
        return None
    found = None
    if "meta" in tables:
        found = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
    if found is None or not str(found[0]).isdigit():
        raise ValueError("not a wq database: it holds other tables and no wq schema version")
    return int(found[0])


def _run_script(conn: sqlite3.Connection, script: str) -> None:
    """Run a file's statements, one by one, inside the open transaction (executescript would
    commit): each ends with the line on which it is complete (a ``;`` in a comment or a string
    does not end one)."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            conn.execute(statement)
            statement = ""
    if statement.strip():  # (comments; or a statement cut short, which fails here)
        conn.execute(statement)


def _describe_open_error(path: str, error: sqlite3.Error) -> str:
    text = str(error)
    if "locked" in text or "busy" in text:
        return f"{path} is locked: is another broker using it?"
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return f"{path} is not a valid wq database (corrupt, or some other file): {text}"
    if "unable to open" in text or "readonly" in text or "read-only" in text:
        directory = os.path.dirname(os.path.abspath(path))
        return f"cannot open {path} for writing (check that {directory} exists and is writable)"
    return f"cannot use {path}: {text}"


class _File:
    """The file as the migration runner uses it (migrate.Database): every step in the writer
    thread; the transaction is BEGIN IMMEDIATE, which takes the file's write lock (held, with
    exclusive locking, until the broker closes it)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        in_writer: Callable[..., Awaitable[Any]],
    ) -> None:
        self._conn = conn
        self._in_writer = in_writer

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        await self._in_writer(self._conn.execute, "BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self._conn.in_transaction:
                await self._in_writer(self._conn.execute, "ROLLBACK")
            raise
        await self._in_writer(self._conn.execute, "COMMIT")

    async def version(self) -> int | None:
        version: int | None = await self._in_writer(_schema_version, self._conn)
        return version

    async def run(self, sql: str) -> None:
        await self._in_writer(_run_script, self._conn, sql)

    async def record(self, version: int) -> None:
        await self._in_writer(
            self._conn.execute, "INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (str(version),)
        )


def _flow_columns(record: Record, flow: Flow) -> tuple[int, float | None, float | None]:
    """ttl_given, finished_at and delay of a new task that has a flow."""
    finished_at = flow.finished_at if record.state == SUCCEEDED else None
    return int(flow.ttl_given), finished_at, flow.delay if record.state == WAITING else None


def _fired_columns(record: Record) -> tuple[str | None, float | None, int]:
    """A fired task's schedule and scheduled time, as _SET_SCHEDULE writes them."""
    ctl = record.ctl
    assert ctl is not None
    return ctl.schedule, ctl.scheduled_for, _key(record.id)


def _schedule_columns(s: Schedule) -> tuple[Any, ...]:
    """A schedule's row (_SCHEDULE_COLUMNS)."""
    t = s.task
    return (
        s.name,
        s.cron,
        s.timezone,
        s.every,
        t.queue,
        t.payload,
        t.priority,
        t.max_attempts,
        t.expires_in,
        t.timeout,
        t.result_ttl,
        int(s.paused),
        s.created_at,
        s.updated_at,
        s.next_fire_at,
        s.last_fire_at,
        s.last_task_id,
        s.fires,
        s.revision,
    )


def _schedule(row: Sequence[Any]) -> Schedule:
    """A schedule from its row (_SCHEDULE_COLUMNS)."""
    payload, priority, max_attempts, expires_in, timeout, result_ttl = row[5:11]
    task = ScheduleTask(
        _blob(payload) or b"", row[4], priority, max_attempts, expires_in, timeout, result_ttl
    )
    return Schedule(
        row[0],
        task,
        row[1],
        row[2],
        row[3],
        bool(row[11]),
        row[12],
        row[13],
        row[14],
        row[15],
        row[16],
        row[17],
        row[18],
    )


class _Batch:
    """Changes made since the last seal, rows to read back once they are committed, and the
    future the commit resolves (with the rows read)."""

    __slots__ = (
        "new",
        "moved",
        "errors",
        "deleted",
        "queues",
        "dropped_queues",
        "keys",
        "unkeys",
        "reads",
        "future",
        "results",
        "unlinks",
        "result_reads",
        "fired",
        "schedules",
    )

    def __init__(self, future: asyncio.Future[Reads]) -> None:
        self.new: dict[int, tuple[Record, bytes, float]] = {}  # with payload and created_at
        self.moved: dict[int, Record] = {}  # in the file: update
        self.errors: dict[int, str | None] = {}  # last_error to write
        self.deleted: set[int] = set()  # in the file: delete
        self.queues: set[Queue] = set()  # whose row (paused, totals) to write
        self.dropped_queues: set[Queue] = set()  # whose row to delete (before those written)
        self.keys: dict[tuple[str, str], tuple[int, float]] = {}  # idempotency keys to write
        self.unkeys: set[tuple[str, str]] = set()  # and to delete
        self.reads: set[int] = set()  # keys to read back after the commit
        self.future = future
        self.results: dict[int, bytes | None] = {}  # results to write (docs/design/results.md)
        self.unlinks: set[int] = set()  # tasks whose edges to delete
        self.result_reads: set[int] = set()  # keys whose results to read back after the commit
        # docs/design/schedules.md (None until a batch has some): tasks fired by a schedule, and
        # the schedules' rows to write by name (None: to delete).
        self.fired: list[Record] | None = None
        self.schedules: dict[str, Schedule | None] | None = None


class _Cache:
    """Payloads (and creation times) of tasks not handed out yet, up to a number of bytes."""

    __slots__ = ("_entries", "_bytes")

    def __init__(self) -> None:
        self._entries: dict[int, tuple[bytes, float]] = {}
        self._bytes = 0

    def put(self, task_id: int, payload: bytes, created_at: float) -> None:
        cost = len(payload) + _CACHE_ENTRY
        if self._bytes + cost <= _CACHE_BYTES:
            self._entries[task_id] = (payload, created_at)
            self._bytes += cost

    def take(self, task_id: int) -> tuple[bytes, float] | None:
        entry = self._entries.pop(task_id, None)
        if entry is not None:
            self._bytes -= len(entry[0]) + _CACHE_ENTRY
        return entry

    def peek(self, task_id: int) -> tuple[bytes, float] | None:
        return self._entries.get(task_id)


class _Journal:
    """Writes the index's changes down in the open batch (implements index.Journal)."""

    __slots__ = ("batch", "cache")

    def __init__(self) -> None:
        self.batch: _Batch | None = None
        self.cache = _Cache()

    def open(self) -> _Batch:
        batch = self.batch
        if batch is None:
            batch = self.batch = _Batch(asyncio.get_running_loop().create_future())
        return batch

    def created(self, record: Record) -> None:
        batch = self.open()
        batch.new[record.id] = (record, record.payload, record.created_at)
        batch.queues.add(record.queue)
        self.cache.put(record.id, record.payload, record.created_at)
        record.payload, record.created_at = _NO_PAYLOAD, _NO_TIME  # the file keeps them

    def moved(self, record: Record) -> None:
        batch = self.open()
        batch.queues.add(record.queue)
        if record.id not in batch.new:  # a new one is inserted as it stands at the seal
            batch.moved[record.id] = record

    def errored(self, record: Record) -> None:
        self.moved(record)
        self.open().errors[record.id] = record.last_error

    def deleted(self, record: Record) -> None:
        batch = self.open()
        task_id = record.id
        batch.queues.add(record.queue)
        batch.errors.pop(task_id, None)
        self.cache.take(task_id)
        if batch.results:
            batch.results.pop(task_id, None)
        if batch.new.pop(task_id, None) is None:  # else it never reached the file
            batch.moved.pop(task_id, None)
            batch.deleted.add(task_id)
            if record.flow is not None and record.flow.after:
                batch.unlinks.add(task_id)

    def succeeded(self, record: Record) -> None:
        self.moved(record)
        flow = record.flow
        assert flow is not None
        self.open().results[record.id] = flow.result
        flow.result = None  # the file keeps it

    def queue_changed(self, queue: Queue) -> None:
        self.open().queues.add(queue)

    def keyed(self, queue: str, key: str, task_id: int, until: float) -> None:
        batch = self.open()
        batch.unkeys.discard((queue, key))
        batch.keys[(queue, key)] = (task_id, until)

    def unkeyed(self, queue: str, key: str) -> None:
        batch = self.open()
        batch.keys.pop((queue, key), None)
        batch.unkeys.add((queue, key))

    def queue_deleted(self, queue: Queue) -> None:
        batch = self.open()
        batch.queues.discard(queue)
        batch.dropped_queues.add(queue)

    # docs/design/schedules.md (not the index's: the store's own calls write these down)

    def fired(self, record: Record) -> None:
        """A task a schedule fired: its schedule columns are written after its insert."""
        batch = self.open()
        if batch.fired is None:
            batch.fired = []
        batch.fired.append(record)

    def schedule_changed(self, name: str, schedule: Schedule | None) -> None:
        """A schedule's row to write as it stands (None: to delete)."""
        batch = self.open()
        if batch.schedules is None:
            batch.schedules = {}
        batch.schedules[name] = schedule


class _Rows:
    """What one batch writes, taken on the event loop at the seal."""

    __slots__ = (
        "inserts",
        "bodies",
        "updates",
        "controls",
        "dropped_queues",
        "errors",
        "deletes",
        "totals",
        "queues",
        "keys",
        "unkeys",
        "reads",
        "edges",
        "unlinks",
        "finished",
        "results",
        "result_reads",
        "ended",
        "fired",
        "schedules",
        "unschedules",
    )

    def __init__(self, batch: _Batch, totals: Totals, ended: list[tuple[str, str]]) -> None:
        self.inserts = [
            (
                _key(r.id),
                r.attempts,
                r.max_attempts,
                r.available_at,
                r.state,
                r.lease_id,
                r.deadline if r.lease_id is not None else None,
                r.seq,
                r.queue.name,
                r.priority,
                r.expires_at,
                r.timeout,
                r.ukey,
                r.ttl,
                *((0, None, None) if r.flow is None else _flow_columns(r, r.flow)),
                _buried_at(r),
            )
            for r, _, _ in batch.new.values()
        ]
        # docs/design/results.md: the edges of new tasks with parents, in the order made.
        self.edges = [
            (_key(r.id), _key(parent))
            for r, _, _ in batch.new.values()
            if r.flow is not None and r.flow.after
            for parent in r.flow.after
        ]
        self.unlinks = [(_key(task_id),) for task_id in batch.unlinks]
        self.finished = [
            (r.flow.finished_at, _key(r.id))
            for r in batch.moved.values()
            if r.state == SUCCEEDED and r.flow is not None
        ]
        self.results = [(result, _key(task_id)) for task_id, result in batch.results.items()]
        self.result_reads = list(batch.result_reads)
        self.ended = ended
        self.bodies = [
            (_key(r.id), payload, created_at) for r, payload, created_at in batch.new.values()
        ]
        self.updates = [
            (
                r.attempts,
                r.available_at,
                r.state,
                r.lease_id,
                r.deadline if r.lease_id is not None else None,
                r.seq,
                _buried_at(r),
                _key(r.id),
            )
            for r in batch.moved.values()
            if not r.controlled
        ]
        self.controls = [
            (
                r.attempts,
                r.available_at,
                r.state,
                r.lease_id,
                r.deadline if r.lease_id is not None else None,
                r.seq,
                r.expires_at,
                r.timeout,
                r.handed_at if r.timeout is not None else None,
                r.progress,
                int(r.cancelling),
                r.ukey,
                _buried_at(r),
                _key(r.id),
            )
            for r in batch.moved.values()
            if r.controlled
        ]
        self.errors = [(error, _key(task_id)) for task_id, error in batch.errors.items()]
        self.deletes = [(_key(task_id),) for task_id in batch.deleted]
        self.totals = astuple(totals)
        self.dropped_queues = [(q.name,) for q in batch.dropped_queues]
        self.queues = [
            (q.name, int(q.paused), *astuple(q.totals), *_limit_columns(q)) for q in batch.queues
        ]
        self.keys = [(q, k, _key(n), until) for (q, k), (n, until) in batch.keys.items()]
        self.unkeys = list(batch.unkeys)
        self.reads = list(batch.reads)
        # docs/design/schedules.md: fired tasks' schedules, the schedules' rows.
        self.fired: list[tuple[str | None, float | None, int]] = []
        self.schedules: list[tuple[Any, ...]] = []
        self.unschedules: list[tuple[str]] = []
        if batch.fired is not None:
            self.fired = [_fired_columns(r) for r in batch.fired]
        if batch.schedules is not None:
            for name, schedule in batch.schedules.items():
                if schedule is None:
                    self.unschedules.append((name,))
                else:
                    self.schedules.append(_schedule_columns(schedule))
        # The error of a dead task is kept by the file alone.
        for task_id in batch.errors:
            record = batch.moved.get(task_id) or batch.new.get(task_id, (None,))[0]
            if record is not None and record.state == DEAD:
                record.last_error = None

    def statements(self) -> list[tuple[str, Sequence[Sequence[Any]]]]:
        """What the transaction runs, in order, with the rows of each (the totals' own)."""
        return [
            (_DELETE, self.deletes),
            (_DELETE_BODY, self.deletes),
            (_DELETE_EDGES, self.unlinks),
            (_INSERT, self.inserts),
            (_INSERT_BODY, self.bodies),
            (_INSERT_EDGE, self.edges),
            (_UPDATE, self.updates),
            (_UPDATE_CONTROL, self.controls),
            (_SET_FINISHED, self.finished),
            (_SET_RESULT, self.results),
            (_SET_ERROR, self.errors),
            (_DROP_QUEUE, self.dropped_queues),
            (_QUEUE, self.queues),
            (_UNKEY, self.unkeys),
            (_KEY, self.keys),
            (_SET_SCHEDULE, self.fired),
            (_DELETE_SCHEDULE, self.unschedules),
            (_PUT_SCHEDULE, self.schedules),
        ]


class SqliteStore:
    """Open with :meth:`open` (it loads the index from the file); close with :meth:`close`."""

    never_suspends = False  # every change waits for its commit
    shared = False  # this broker alone changes it

    def __init__(
        self,
        path: str,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        *,
        sync: str = "full",
        hot_ready: int = HOT_READY,
    ) -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        rng = rng if rng is not None else random.Random()
        backoff = backoff if backoff is not None else Backoff(rng=rng)
        self.path = path
        self.sync = sync
        self._journal = _Journal()
        self._rng = rng
        self._index = Index(backoff.delay, rng, self._journal, hot_max=hot_ready)
        self._warming = asyncio.Lock()
        self._conn: sqlite3.Connection | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="wq-sqlite")
        self._flushing: asyncio.Task[None] | None = None
        self._last_commit: asyncio.Future[Reads] | None = None
        self._failed: str | None = None
        self.transactions = 0
        self._finished: FinishedCallback | None = None
        self._book = Book()  # the schedules (docs/design/schedules.md), loaded at open

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        path: str,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        *,
        sync: str = "full",
        hot_ready: int = HOT_READY,
    ) -> SqliteStore:
        store = cls(path, backoff, rng, sync=sync, hot_ready=hot_ready)
        try:
            await store._open_file()
        except sqlite3.Error as e:
            store._writer.shutdown(wait=False)
            raise StoreError(_describe_open_error(path, e)) from None
        except ValueError as e:
            store._writer.shutdown(wait=False)
            raise StoreError(f"{path} is refused: {e}") from None
        stats = store._index.stats()
        log.info(
            "loaded %s: %d ready, %d handed out, %d delayed, %d dead, %d waiting, %d results",
            path,
            stats.ready,
            stats.handed_out,
            stats.delayed,
            stats.dead,
            stats.waiting,
            stats.succeeded,
        )
        return store

    async def _open_file(self) -> None:
        """Open and lock the file, create or upgrade the schema (the migration runner, each step
        in the writer thread), check the file, load the index."""
        conn = await self._in_writer(self._connect)
        try:
            async with MIGRATIONS.migrate(_File(conn, self._in_writer), self.path):
                await self._in_writer(self._stamp, conn)
            await self._in_writer(self._check_and_load, conn)
        except BaseException:
            await self._in_writer(conn.close)
            raise
        self._conn = conn

    async def _in_writer(self, work: Callable[..., R], *args: Any) -> R:
        """``work(*args)`` in the writer thread (the one that owns the connection)."""
        return await asyncio.get_running_loop().run_in_executor(self._writer, work, *args)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=0.5
        )
        try:
            # Exclusive locking: the lock taken by the first write (the migration's transaction)
            # is held until close, so a second broker on the same file is refused at its start.
            conn.execute("PRAGMA locking_mode = EXCLUSIVE")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"cannot switch to WAL mode (got {mode})")
            conn.execute(f"PRAGMA synchronous = {self.sync.upper()}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _stamp(self, conn: sqlite3.Connection) -> None:
        """In the migration's transaction: this broker's pid, and the key that scatters the
        file's task ids (see index.py; one per file, made with it)."""
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('pid', ?)", (str(os.getpid()),))
        conn.execute(
            "INSERT OR IGNORE INTO meta VALUES ('id_key', ?)", (str(self._rng.getrandbits(64)),)
        )

    def _check_and_load(self, conn: sqlite3.Connection) -> None:
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise sqlite3.DatabaseError(f"database disk image is malformed: {check}")
        self._load(conn)

    def _load(self, conn: sqlite3.Connection) -> None:
        """Rebuild the index from the tasks table, streamed: ready tasks come back cold (ids
        only, in order); the others as records."""
        index = self._index
        for name, paused, *counts in conn.execute(_LOAD_QUEUES):
            limits = _limits_of(*counts[-4:])  # (docs/design/schedules.md)
            index.restore_queue(name, bool(paused), Totals(*counts[:-4]), limits)
        index.restore_ready(
            (key + _OFFSET, queue, priority, seq, expires_at)
            for key, queue, priority, seq, expires_at in conn.execute(_LOAD_READY)
        )
        index.restore(_record(row) for row in conn.execute(_LOAD_OTHERS))
        index.restore_edges(
            (child + _OFFSET, parent + _OFFSET, state)
            for child, parent, state in conn.execute(_LOAD_EDGES)
        )
        for queue, key, task_key, until in conn.execute(_LOAD_KEYS):
            index.restore_key(queue, key, task_key + _OFFSET, until)
        for queue, key, task_key in conn.execute(_LOAD_UNIQUE):
            index.restore_unique_key(queue, key, task_key + _OFFSET)
        totals = conn.execute(
            "SELECT enqueued, delivered, acked, nacked, reclaimed, retried, buried, requeued, "
            "purged, cancelled, expired FROM totals WHERE id = 1"
        ).fetchone()
        first, last = conn.execute("SELECT min(ord), max(ord) FROM tasks").fetchone()
        (id_key,) = conn.execute("SELECT value FROM meta WHERE key = 'id_key'").fetchone()
        index.restored(
            Totals(*totals), first_seq=first or 0, last_seq=last or 0, id_key=int(id_key)
        )
        self._book.load(_schedule(row) for row in conn.execute(_LOAD_SCHEDULES))

    # -- the contract ------------------------------------------------------------------------

    async def enqueue_many(self, items: Sequence[NewTask], *, now: float) -> list[Enqueued]:
        self._check()
        for new in items:
            if new.after:
                done = await self._enqueue_flow(items, now)
                break
        else:
            done = self._index.enqueue_many(items, now)
        if done:  # (a duplicate too: never answer with a task that is not yet committed)
            await self._durable()
        return done

    async def _enqueue_flow(self, items: Sequence[NewTask], now: float) -> list[Enqueued]:
        """Tasks some of which name parents (docs/design/results.md): the parents the index
        does not hold (cold ready ones, or unknown) and the errors of dead ones (the file keeps
        them) are read back first; then the index enqueues, checking every parent again as it
        stands then (what changed while the file was read is read again)."""
        index = self._index
        cold: dict[int, tuple[Lane, int]] = {}
        errors: dict[int, str | None] = {}
        for _ in range(_FLOW_READS):
            missing = index.missing_parents(items, cold)
            dead = [n for n in index.dead_parents(items) if n not in errors]
            if not missing and not dead:
                break
            await self._durable()  # the file as the index has it
            rows = await self._in_writer(self._read_parents, [_key(n) for n in missing + dead])
            self._check()
            found = False
            for key, state, queue, priority, seq, error in rows:
                n = key + _OFFSET
                if state == READY and n in missing:
                    cold[n] = (index.queue(queue).lane(priority), seq)
                    found = True
                elif state == DEAD:
                    errors[n] = error
            if not found and not [n for n in index.dead_parents(items) if n not in errors]:
                break  # (what is missing is not in the file either: the index says so)
        return index.enqueue_many(items, now, cold=cold, errors=errors)

    def _read_parents(self, keys: list[int]) -> list[tuple[Any, ...]]:
        """In the writer thread: the rows of tasks named as parents (see _READ_PARENTS)."""
        conn = self._conn
        assert conn is not None
        out: list[tuple[Any, ...]] = []
        for i in range(0, len(keys), _READ_CHUNK):
            chunk = keys[i : i + _READ_CHUNK]
            marks = ",".join("?" * len(chunk))
            out += conn.execute(_READ_PARENTS.format(marks), chunk).fetchall()
        return out

    async def claim(
        self, *, lease: float, now: float, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> Delivery | None:
        deliveries = await self.claim_many((lease,), now=now, queues=queues)
        return deliveries[0] if deliveries else None

    async def claim_many(
        self, leases: Sequence[float], *, now: float, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> list[Delivery]:
        self._check()
        return await self._claim_many(leases, now, queues)

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
        """The settlements change the index at once; the claims join them in the open batch:
        one commit for both (nothing is answered before it)."""
        self._check()
        acked, nacked = self._index.settle(acks, nacks, now, results)
        claimed = await self._claim_many(leases, now, queues) if leases else []
        if not claimed:
            await self._durable()
        return acked, nacked, claimed

    async def _claim_many(
        self, leases: Sequence[float], now: float, queues: Sequence[str]
    ) -> list[Delivery]:
        index = self._index
        claimed: list[tuple[Record, Delivery]] = []
        while len(claimed) < len(leases):
            lane = index.cold_lane(queues, now)
            if lane is not None:
                await self._warm(lane, max(len(leases) - len(claimed), _WARM_BATCH))
                continue
            record = index.claim(queues, leases[len(claimed)], now)
            if record is None:
                break
            claimed.append((record, self._delivery(record)))
        if not claimed:
            return []
        batch = self._journal.open()
        reads = batch.reads
        for record, delivery in claimed:
            if not delivery.task.payload:
                reads.add(_key(record.id))
            if record.flow is not None and record.flow.after:
                # (its parents' results, read back after the commit: docs/design/results.md)
                batch.result_reads.update(_key(n) for n in index.succeeded_parents(record))
        rows, results = await self._durable()
        return [self._complete(delivery, rows, results) for _, delivery in claimed]

    async def _warm(self, lane: Lane, n: int) -> None:
        """Read the next ``n`` cold ready tasks of ``lane`` back from the file; make them hot."""
        async with self._warming:  # one at a time: each takes the head of a lane's cold ones
            ids = lane.cold.head_ids(n) if lane.cold else []
            if not ids:
                return
            if self._unwritten(ids):
                await self._durable()  # every cold task is in the file, as it stands
            loop = asyncio.get_running_loop()
            rows = await loop.run_in_executor(self._writer, self._read_cold, ids)
            self._check()
            if not lane.cold or lane.cold.first() != ids[0]:
                return  # the lane changed while the rows were read (say, it was emptied)
            records = []
            for n_id in itertools.takewhile(lambda i: i in rows, ids):
                row = rows[n_id]
                record, queue, priority = _record(row)
                record.lane = self._index.queue(queue).lane(priority)
                records.append(record)
                self._journal.cache.put(n_id, row[_PAYLOAD_AT], row[_PAYLOAD_AT + 1])
            if not records:
                self._fail_stop(f"ready task {hex_id(ids[0])} is missing from {self.path}")
                self._check()
            self._index.warm(lane, records)

    def _unwritten(self, ids: list[int]) -> bool:
        """True if a row of these tasks may not be in the file as the index has it (a commit is
        under way, or the open batch holds one). Otherwise a warm need not commit the open batch
        (the claims made so far by the same claim_many): it stays one transaction."""
        if self._flushing is not None:
            return True
        batch = self._journal.batch
        return batch is not None and any(n in batch.new or n in batch.moved for n in ids)

    def _read_cold(self, ids: list[int]) -> dict[int, tuple[Any, ...]]:
        """In the writer thread: the rows of cold ready tasks, by id."""
        conn = self._conn
        assert conn is not None
        keys = [_key(n) for n in ids]
        out: dict[int, tuple[Any, ...]] = {}
        for i in range(0, len(keys), _READ_CHUNK):
            chunk = keys[i : i + _READ_CHUNK]
            marks = ",".join("?" * len(chunk))
            for row in conn.execute(_WARM.format(marks), chunk):
                row = list(row)
                payload = row[_PAYLOAD_AT]
                row[_PAYLOAD_AT] = _blob(payload)
                out[row[0] + _OFFSET] = tuple(row)
        return out

    def _delivery(self, record: Record) -> Delivery:
        """A hand-out as it stands now; the payload comes from the cache, or (when it is empty
        here) from the file once committed."""
        assert record.lease_id is not None
        cached = self._journal.cache.take(record.id)
        if cached is None or record.flow is not None:
            delivery = Delivery(record.view(), record.lease_id, record.deadline)
            if cached is not None:
                delivery.task.payload, delivery.task.created_at = cached
            return delivery
        lane = record.lane
        task = Task(  # (record.view(), with the cached payload: one Task made, not two)
            "%016x" % record.id,  # noqa: UP031
            cached[0],
            record.attempts,
            record.max_attempts,
            cached[1],
            record.available_at,
            record.last_error,
            lane.queue.name,
            lane.priority,
        )
        ctl = record.ctl
        if ctl is not None:
            task.expires_at, task.timeout = ctl.expires_at, ctl.timeout
            task.progress, task.cancelling = ctl.progress, ctl.cancelling
            task.schedule, task.scheduled_for = ctl.schedule, ctl.scheduled_for
        return Delivery(task, record.lease_id, record.deadline)

    @staticmethod
    def _complete(delivery: Delivery, rows: dict[int, Row], results: dict[int, bytes]) -> Delivery:
        task = delivery.task
        if task.after is not None:  # (docs/design/results.md: its parents, with their results)
            delivery.parents = [ParentResult(p, results.get(_key(int(p, 16)))) for p in task.after]
        if task.payload:
            return delivery
        payload, created_at, _, _ = rows[_key(int(task.id, 16))]
        task = replace(task, payload=payload, created_at=created_at)
        return Delivery(task, delivery.lease_id, delivery.deadline, delivery.parents)

    async def ack(
        self, task_id: str, lease_id: str, *, now: float, result: bytes | None = None
    ) -> None:
        await self._change(lambda: self._index.ack(task_id, lease_id, now, result))

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
        return await self._change(
            lambda: self._index.nack(task_id, lease_id, error, now, delay=delay, terminal=terminal)
        )

    async def extend(
        self,
        task_id: str,
        lease_id: str,
        *,
        lease: float,
        now: float,
        progress: bytes | None = None,
    ) -> float:
        return await self._change(
            lambda: self._index.extend(task_id, lease_id, lease, now, progress)
        )

    async def cancel(self, task_id: str, *, now: float) -> CancelResult:
        self._check()
        result = self._index.cancel(task_id, now)
        if result is None:
            result = await self._cancel_cold(task_id, now)
        await self._durable()
        return result

    async def _cancel_cold(self, task_id: str, now: float) -> CancelResult:
        """A task not in memory: a cold ready one (its place read from the file) is cancelled;
        else there is no such task."""
        n = parse_id(task_id)
        missing = NotFound(f"task {quoted(task_id)} does not exist (or was acked)")
        if n is None:
            raise missing
        await self._durable()  # the file as the index has it
        row = await self._in_writer(self._read_one, _key(n))
        self._check()
        if row is None or row[3] != READY:
            raise missing
        queue, priority, seq = row[5], row[6], row[13]
        lane = self._index.queue(queue).lane(priority)
        if not self._index.cancel_cold(lane, n, seq, now):
            # It moved while the row was read (claimed, say): try again as it stands now.
            result = self._index.cancel(task_id, now)
            if result is None:
                raise missing
            return result
        return CancelResult(task_id, CANCELLED, queue)

    async def list_tasks(
        self, queue: str, state: str, *, limit: int, after: ListKey | None = None
    ) -> TaskPage:
        self._check()
        await self._durable()  # never show what is not yet committed
        entries, last = self._index.page(queue, state, limit, after)
        records = [e for e in entries if isinstance(e, Record)]
        cold = [e[0] for e in entries if not isinstance(e, Record)]
        rows = await self._in_writer(self._read, [_key(r.id) for r in records]) if records else {}
        cold_rows = await self._in_writer(self._read_cold, cold) if cold else {}
        self._check()
        tasks: list[TaskState] = []
        for entry in entries:
            if isinstance(entry, Record):
                row = rows.get(_key(entry.id))
                if row is None:
                    continue  # gone while the rows were read
                payload, created_at, error, result = row
                view = replace(entry.view(), payload=payload, created_at=created_at)
                if entry.state == DEAD:
                    view.last_error = error
                elif entry.state == SUCCEEDED:
                    view.result = result
            else:
                full = cold_rows.get(entry[0])
                if full is None:
                    continue
                record, _, _ = _record(full)
                record.lane = entry[1]
                view = replace(
                    record.view(),
                    payload=full[_PAYLOAD_AT],
                    created_at=full[_PAYLOAD_AT + 1],
                )
                flow = self._index.flow_of(entry[0])
                if flow is not None and flow.after:
                    view.after = tuple(hex_id(p) for p in flow.after)
            tasks.append(TaskState(view, state))
        return TaskPage(tasks, last)

    async def empty_queue(self, queue: str, *, now: float) -> int:
        n = await self._change(lambda: self._index.empty(queue, now))
        if n is None:
            raise NotFound(f"queue {quoted(queue)} does not exist")
        return n

    async def delete_queue(self, queue: str) -> None:
        await self._change(lambda: self._index.delete_queue(queue))

    async def settle_many(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[NackItem],
        *,
        now: float,
        results: Mapping[str, bytes] | None = None,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        return await self._change(lambda: self._index.settle(acks, nacks, now, results))

    async def reclaim(self, task_id: str, lease_id: str, error: str, *, now: float) -> Failure:
        return await self._change(lambda: self._index.reclaim(task_id, lease_id, error, now))

    async def release(self, task_id: str, lease_id: str, *, now: float) -> bool:
        return await self._change(lambda: self._index.release(task_id, lease_id, now))

    async def sweep(self, *, now: float) -> tuple[SweepResult, float | None]:
        result = await self._change(lambda: self._index.sweep(now))
        return result, self._index.next_due()

    async def requeue(self, task_id: str, *, now: float) -> str:
        return await self._change(lambda: self._index.requeue(task_id, now))

    async def requeue_all(self, *, queue: str | None = None, now: float) -> tuple[int, list[str]]:
        return await self._change(lambda: self._index.requeue_all(queue, now))

    async def purge(self, task_id: str) -> None:
        await self._change(lambda: self._index.purge(task_id))

    async def set_paused(self, queue: str, paused: bool) -> None:
        await self._change(lambda: self._index.set_paused(queue, paused))

    async def set_limits(self, queue: str, limits: Limits | None, *, now: float) -> None:
        """Kept in the queue's row; its rate bucket is not (docs/design/schedules.md): it
        starts full when the limits are set, and again after a restart."""
        await self._change(lambda: self._index.set_limits(queue, limits, now))

    async def stats(self, queue: str | None = None) -> Stats:
        self._check()
        await self._durable()  # never report what is not yet committed
        return self._index.stats(queue)

    async def queues(self, *, now: float | None = None) -> list[QueueStats]:
        self._check()
        await self._durable()
        return self._index.queue_rows(now)

    async def queue_report(self, *, now: float | None = None) -> list[QueueReport]:
        self._check()
        await self._durable()
        reports, cold = self._index.queue_report(now)
        if cold:  # lane heads held as ids: their times, by primary key
            loop = asyncio.get_running_loop()
            keys = [_key(n) for _, n in cold]
            times = await loop.run_in_executor(self._writer, self._read_times, keys)
            for (report, _), key in zip(cold, keys, strict=True):
                at = times.get(key)
                if at is not None and (report.oldest_ready is None or at < report.oldest_ready):
                    report.oldest_ready = at
        return reports

    def _read_times(self, keys: list[int]) -> dict[int, float]:
        """In the writer thread: ``available_at`` by key."""
        conn = self._conn
        assert conn is not None
        out: dict[int, float] = {}
        for i in range(0, len(keys), _READ_CHUNK):
            chunk = keys[i : i + _READ_CHUNK]
            marks = ",".join("?" * len(chunk))
            sql = f"SELECT id, available_at FROM tasks WHERE id IN ({marks})"
            out.update(conn.execute(sql, chunk).fetchall())
        return out

    async def lookup(self, task_id: str) -> TaskState | None:
        self._check()
        await self._durable()
        n = parse_id(task_id)
        if n is None:
            return None
        loop = asyncio.get_running_loop()
        for _ in range(_FLOW_READS):
            row = await loop.run_in_executor(self._writer, self._read_one, _key(n))
            if row is None:
                return None
            record = self._index.find(task_id)
            if record is None or record.state != SUCCEEDED or row[3] == SUCCEEDED:
                break
            await self._durable()  # it succeeded while the row was read: read its result
        assert row is not None
        attempts, max_attempts, available_at, state, error, queue, priority, payload, created = row[
            :9
        ]
        expires_at, timeout, progress, cancelling = row[9:13]
        if record is not None:  # the index is ahead of a row read while it changed
            attempts, available_at, state = record.attempts, record.available_at, record.state
            error = record.last_error if state != DEAD else error
            expires_at, timeout = record.expires_at, record.timeout
            progress, cancelling = record.progress, record.cancelling
        task = Task(
            task_id, payload, attempts, max_attempts, created, available_at, error, queue, priority
        )
        if expires_at is not None or timeout is not None or progress is not None or cancelling:
            task.expires_at, task.timeout = expires_at, timeout
            if state == HANDED_OUT:
                task.progress = None if progress is None else bytes(progress)
                task.cancelling = bool(cancelling)
        if row[18] is not None:  # (docs/design/schedules.md: a fired task)
            task.schedule, task.scheduled_for = row[18], row[19]
        if state == DEAD:  # (the index is ahead of the row; NULL: buried before version 8)
            task.buried_at = (record.deadline or None) if record is not None else row[20]
        self._flow_view(task, n, record, state, row)
        return TaskState(task, STATE_NAMES[state])

    def _flow_view(
        self, task: Task, n: int, record: Record | None, state: int, row: tuple[Any, ...]
    ) -> None:
        """What results and workflows add to a looked-up task's view (docs/design/results.md):
        its parents and what it waits for from the index, its result from the row."""
        result, finished_at, result_ttl, ttl_given = row[14:18]
        flow = record.flow if record is not None else self._index.flow_of(n)
        if flow is not None and record is not None:
            flow_view(task, record, flow)
        elif flow is not None and flow.after:  # (a cold ready task)
            task.after = tuple(hex_id(p) for p in flow.after)
        if state == SUCCEEDED:
            task.result = _blob(result)
            task.finished_at = finished_at if flow is None else flow.finished_at
        if ttl_given:
            task.result_ttl = DEFAULT_RESULT_TTL if result_ttl is None else result_ttl

    def _read_one(self, key: int) -> tuple[Any, ...] | None:
        """In the writer thread: one task's row and body (see _LOOKUP)."""
        conn = self._conn
        assert conn is not None
        row = conn.execute(_LOOKUP, (key,)).fetchone()
        if row is None:
            return None
        row = list(row)
        payload = row[7]
        row[7] = payload.encode() if isinstance(payload, str) else bytes(payload)
        return tuple(row)

    async def dead_letters(
        self, *, limit: int | None = None, queue: str | None = None
    ) -> list[Task]:
        self._check()
        await self._durable()
        records = self._index.dead(limit, queue)
        keys = [_key(r.id) for r in records]
        loop = asyncio.get_running_loop()
        rows = await loop.run_in_executor(self._writer, self._read, keys)
        views = []
        for r in records:
            row = rows.get(_key(r.id))
            if row is None:  # requeued and acked while the rows were read: no longer dead
                continue
            payload, created_at, error, _ = row
            views.append(
                replace(r.view(), payload=payload, created_at=created_at, last_error=error)
            )
        return views

    # -- results and workflows (docs/design/results.md) --------------------------------------

    async def watch(self, task_id: str) -> TaskState:
        self._check()
        # Marked first, then read: an end that comes while the row is read is told.
        self._index.watch(task_id)
        found = await self.lookup(task_id)
        if found is None:
            self._index.unwatch(task_id)
            raise NotFound(f"task {quoted(task_id)} does not exist (or was acked)")
        if STATE_NAMES.index(found.state) not in PENDING:
            self._index.unwatch(task_id)
        return found

    def on_finished(self, callback: FinishedCallback) -> None:
        self._finished = callback

    def take_released(self) -> Released | None:
        return self._index.take_released()

    async def children(self, task_id: str, *, limit: int) -> tuple[list[str], int]:
        self._check()
        await self._durable()
        return self._index.children(task_id, limit)

    def problem(self) -> str | None:
        if self._failed is not None:
            return f"the store is unavailable: {self._failed}"
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

    # -- schedules (docs/design/schedules.md): in a Book, each change written in the next commit

    async def put_schedule(self, schedule: Schedule, *, now: float) -> Schedule:
        self._check()
        stored, changed = self._book.put(schedule, now)
        if changed:
            self._journal.schedule_changed(stored.name, stored)
        await self._durable()
        return stored

    async def get_schedule(self, name: str) -> Schedule | None:
        self._check()
        await self._durable()  # (never show what is not yet committed)
        return self._book.get(name)

    async def list_schedules(self) -> list[Schedule]:
        self._check()
        await self._durable()
        return self._book.all()

    async def schedule_count(self) -> int:
        self._check()
        return len(self._book)

    async def delete_schedule(self, name: str) -> bool:
        self._check()
        deleted = self._book.delete(name)
        if deleted:
            self._journal.schedule_changed(name, None)
        await self._durable()
        return deleted

    async def set_schedule_paused(
        self, name: str, paused: bool, next_fire_at: float | None, *, now: float
    ) -> Schedule | None:
        self._check()
        stored, changed = self._book.set_paused(name, paused, next_fire_at, now)
        if stored is not None and changed:
            self._journal.schedule_changed(name, stored)
        await self._durable()
        return stored

    async def due_schedules(self, now: float) -> tuple[float, list[Schedule], float | None]:
        self._check()
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
        """The task enqueued and the schedule moved in one step of the index and the book, so
        in one commit."""
        self._check()
        book = self._book
        if not book.firable(name, expected, revision):
            return None
        record, done = enqueue_fired(self._index, task, now)
        stored = book.fire(name, expected, revision, scheduled_for, next_fire_at, done.id)
        self._journal.fired(record)
        self._journal.schedule_changed(name, stored)
        await self._durable()
        return done

    async def skip_schedule(
        self, name: str, expected: float, next_fire_at: float, *, revision: int
    ) -> bool:
        self._check()
        stored = self._book.fire(name, expected, revision, expected, next_fire_at, None)
        if stored is not None:
            self._journal.schedule_changed(name, stored)
        await self._durable()
        return stored is not None

    async def close(self) -> None:
        if self._conn is None:
            return
        if self._failed is None and (self._journal.batch is not None or self._flushing):
            try:
                await self._durable()
            except StoreError:
                pass
        flushing = self._flushing
        if flushing is not None:
            await asyncio.gather(flushing, return_exceptions=True)
        conn, self._conn = self._conn, None
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._writer, conn.close)
        self._writer.shutdown(wait=True)

    def check_invariants(self) -> None:
        """Assert the index's structures agree with each other (used by the tests)."""
        self._index.check_invariants()

    # -- the one mechanism: change the index, then wait for the change to be committed ---------

    async def _change(self, change: Callable[[], R]) -> R:
        self._check()
        result = change()
        await self._durable()
        return result

    def _check(self) -> None:
        if self._failed is not None:
            raise StoreError(f"the store is unavailable: {self._failed}")
        if self._conn is None:
            raise StoreError("the store is closed")
        if self._conn is None:
            raise StoreError("the store is closed")

    async def _durable(self) -> Reads:
        """Wait until every change made so far is committed; the rows (and results) the open
        batch was asked to read back."""
        batch = self._journal.batch
        if batch is None:
            last = self._last_commit
            if last is not None and not last.done():
                await asyncio.shield(last)
            return {}, {}
        future = batch.future
        self._last_commit = future
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
        return await asyncio.shield(future)

    async def _flush(self) -> None:
        """Commit batches until none is open (group commit)."""
        loop = asyncio.get_running_loop()
        journal = self._journal
        while journal.batch is not None:
            for _ in range(_GATHER_ROUNDS):
                await asyncio.sleep(0)  # let what is already runnable join this batch
            batch, journal.batch = journal.batch, None
            if batch is None:  # the store failed meanwhile
                break
            rows = _Rows(batch, self._index.totals, self._index.take_ended())
            try:
                read = await loop.run_in_executor(self._writer, self._write, rows)
            except Exception as e:
                if self._conn is None:  # closed meanwhile (a call that came during close)
                    batch.future.set_exception(StoreError("the store is closed"))
                    continue
                self._fail_stop(f"a commit to {self.path} failed: {e!r}")
                batch.future.set_exception(StoreError(self._failed or "commit failed"))
                continue
            self.transactions += 1
            if rows.ended and self._finished is not None:
                self._tell(rows.ended)  # (committed: before the calls are answered)
            batch.future.set_result(read)
            if self._last_commit is batch.future:
                self._last_commit = None  # done: nothing to wait for (nor rows to keep alive)
        self._flushing = None

    def _tell(self, ended: list[tuple[str, str]]) -> None:
        """Tell ``on_finished``'s callback of watched tasks that ended (committed now)."""
        assert self._finished is not None
        try:
            self._finished(ended)
        except Exception:  # (the service's: it must not stop the commits)
            log.exception("telling of %d tasks that ended failed", len(ended))

    def _write(self, rows: _Rows) -> Reads:
        """In the writer thread: one transaction for the whole batch, then the reads."""
        conn = self._conn
        assert conn is not None
        conn.execute("BEGIN")
        try:
            for statement, values in rows.statements():
                if values:
                    conn.executemany(statement, values)
            conn.execute(_TOTALS, rows.totals)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        # (The payloads and results written go now: the thread pool's work item may hold the
        # rows a moment after the commit is answered.)
        rows.bodies.clear()
        rows.results.clear()
        read = self._read(rows.reads) if rows.reads else {}
        return read, self._read_results(rows.result_reads) if rows.result_reads else {}

    def _read(self, keys: Iterable[int]) -> dict[int, Row]:
        """In the writer thread: payload, created_at, last_error and result by key."""
        conn = self._conn
        assert conn is not None
        wanted = list(keys)
        out: dict[int, Row] = {}
        for i in range(0, len(wanted), _READ_CHUNK):
            chunk = wanted[i : i + _READ_CHUNK]
            marks = ",".join("?" * len(chunk))
            for key, payload, created_at, last_error, result in conn.execute(
                _READ.format(marks), chunk
            ):
                text = payload.encode() if isinstance(payload, str) else bytes(payload)
                out[key] = (text, created_at, last_error, _blob(result))
        return out

    def _read_results(self, keys: Iterable[int]) -> dict[int, bytes]:
        """In the writer thread: the results of these tasks (those that have one), by key."""
        conn = self._conn
        assert conn is not None
        wanted = list(keys)
        out: dict[int, bytes] = {}
        for i in range(0, len(wanted), _READ_CHUNK):
            chunk = wanted[i : i + _READ_CHUNK]
            marks = ",".join("?" * len(chunk))
            for key, result in conn.execute(_READ_RESULTS.format(marks), chunk):
                out[key] = _blob(result) or b""
        return out

    def _fail_stop(self, reason: str) -> None:
        if self._failed is None:
            log.error("%s; the store refuses further work: restart the broker", reason)
            self._failed = reason
            batch, self._journal.batch = self._journal.batch, None
            if batch is not None:
                batch.future.set_exception(StoreError(reason))
