"""The SQLite store: durable, through the standard library's sqlite3.

Design: the SQLite file is the truth; the in-memory structures of :class:`MemoryStore` (dict, deque,
heaps) are an index over it, rebuilt from the file at start. Every operation changes the index
atomically on the event loop, exactly as the memory store does (so the semantics are identical and
the sweeper still works from heaps keyed by deadline, never a table scan), records which tasks it
touched, and then waits until those changes are committed. Only then does the service answer.

Group commit: one writer thread owns the connection. While it commits one batch, every operation
that arrives joins the next one, so many concurrent requests share one transaction and one sync to
disk. A batch is a consistent cut of the index (it is sealed between two operations on the loop),
and batches commit in order, so nothing a client was told can be lost by a crash. If a commit fails
(disk full, I/O error) the store stops accepting work and every call fails with StoreError, because
the index would be ahead of the file: restart the broker to reload what was committed.

The file is opened in WAL mode with an exclusive lock (a second broker on the same file is refused
at start). ``synchronous`` is FULL by default: a commit is on disk before the answer, so nothing
acknowledged is lost even on power loss. With NORMAL, commits survive a crash of the broker
(kill -9) but the last ones may be lost on power loss or an OS crash.

Restart: every task comes back in the collection it was in (ready ones in the same order, the
dead-letter queue in order of burial). Handed-out tasks keep their lease: a worker still holding
one can ack it after the restart; otherwise it is reclaimed when its deadline passes (at once, if
it passed while the broker was down). Counters survive too.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import random
import sqlite3
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple
from typing import Any, Final

from wqbroker.errors import StoreError, WqError
from wqbroker.models import Delivery, Failure, Stats, SweepResult, Task, Totals
from wqbroker.retry import Backoff
from wqbroker.store.memory import DEAD, DELAYED, HANDED_OUT, READY, MemoryStore, _Task

log = logging.getLogger("wqbroker.store.sqlite")

SCHEMA_VERSION: Final = 1
SYNC_MODES: Final = ("full", "normal")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    id INTEGER PRIMARY KEY,           -- the task id (16 hex digits) as a signed 64-bit integer
    payload BLOB NOT NULL,            -- the JSON text as received
    attempts INTEGER NOT NULL,
    max_attempts INTEGER NOT NULL,
    created_at REAL NOT NULL,
    available_at REAL NOT NULL,       -- delayed: when it becomes ready
    last_error TEXT,
    state INTEGER NOT NULL,           -- 0 ready, 1 handed out, 2 delayed, 3 dead
    lease_id TEXT,
    deadline REAL,                    -- handed out: when the lease runs out
    ord INTEGER                       -- ready: place in line; delayed, handed out: tie-break
                                      -- among equal due times; dead: order of burial
);
CREATE TABLE IF NOT EXISTS totals (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    enqueued INTEGER NOT NULL, delivered INTEGER NOT NULL, acked INTEGER NOT NULL,
    nacked INTEGER NOT NULL, reclaimed INTEGER NOT NULL, retried INTEGER NOT NULL,
    buried INTEGER NOT NULL, requeued INTEGER NOT NULL
);
INSERT OR IGNORE INTO totals VALUES (1, 0, 0, 0, 0, 0, 0, 0, 0);
"""

_INSERT = (
    "INSERT INTO tasks (id, payload, attempts, max_attempts, created_at, available_at, "
    "last_error, state, lease_id, deadline, ord) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_UPDATE = (
    "UPDATE tasks SET attempts = ?, available_at = ?, last_error = ?, state = ?, lease_id = ?, "
    "deadline = ?, ord = ? WHERE id = ?"
)
_DELETE = "DELETE FROM tasks WHERE id = ?"
_TOTALS = (
    "UPDATE totals SET enqueued = ?, delivered = ?, acked = ?, nacked = ?, reclaimed = ?, "
    "retried = ?, buried = ?, requeued = ? WHERE id = 1"
)


_OFFSET: Final = 2**63
# Before sealing a batch, let the event loop run this many times so that operations already
# under way (the rest of a burst of requests) join it: fewer, larger commits.
_GATHER_ROUNDS: Final = 3


def _key(task_id: str) -> int:
    """A task id (16 hex digits, 64 random bits) as the table's integer key."""
    return int(task_id, 16) - _OFFSET


def _task_id(key: int) -> str:
    return f"{key + _OFFSET:016x}"


class _Batch:
    """Changes made since the last seal, and the future their commit resolves."""

    __slots__ = ("new", "changed", "deleted", "future")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.new: dict[str, _Task] = {}  # not yet in the file
        self.changed: dict[str, _Task] = {}  # in the file, to update
        self.deleted: set[str] = set()  # in the file, to delete
        self.future = future


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


class SqliteStore(MemoryStore):
    """Open with :meth:`open` (it loads the file); close with :meth:`close`."""

    never_suspends = False  # every change waits for its commit

    def __init__(
        self,
        path: str,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        *,
        sync: str = "full",
    ) -> None:
        super().__init__(backoff, rng)
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        self.path = path
        self.sync = sync
        self._conn: sqlite3.Connection | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="wq-sqlite")
        self._batch: _Batch | None = None
        self._flushing: asyncio.Task[None] | None = None
        self._last_commit: asyncio.Future[None] | None = None
        self._failed: str | None = None
        # Order to persist: a ready task's place in line (appended: counting up from 0; put back
        # at the head: counting down), a delayed or handed-out task's heap sequence (ties between
        # equal due times), a dead task's order of burial.
        self._ord: dict[str, int] = {}
        self._tail = 0
        self._head = 0
        self._burials = 0
        self.commits = 0  # for tests and benchmarks

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        path: str,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        *,
        sync: str = "full",
    ) -> SqliteStore:
        store = cls(path, backoff, rng, sync=sync)
        loop = asyncio.get_running_loop()
        try:
            rows, totals = await loop.run_in_executor(store._writer, store._open_file)
        except sqlite3.Error as e:
            store._writer.shutdown(wait=False)
            raise StoreError(_describe_open_error(path, e)) from None
        store._load(rows, totals)
        return store

    def _open_file(self) -> tuple[list[tuple[Any, ...]], tuple[int, ...]]:
        """In the writer thread: open, lock, create or check the schema, read everything."""
        conn = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=0.5
        )
        try:
            # Exclusive locking: the lock taken by the first write below is held until close,
            # so a second broker on the same file is refused at its start.
            conn.execute("PRAGMA locking_mode = EXCLUSIVE")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"cannot switch to WAL mode (got {mode})")
            conn.execute(f"PRAGMA synchronous = {self.sync.upper()}")
            conn.executescript(_SCHEMA)
            conn.execute("BEGIN IMMEDIATE")
            found = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if found is None:
                conn.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif found[0] != str(SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"unsupported schema version {found[0]}")
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('pid', ?)", (str(os.getpid()),))
            conn.execute("COMMIT")
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"database disk image is malformed: {check}")
            rows = conn.execute(
                "SELECT id, payload, attempts, max_attempts, created_at, available_at, "
                "last_error, state, lease_id, deadline, ord FROM tasks"
            ).fetchall()
            totals = conn.execute(
                "SELECT enqueued, delivered, acked, nacked, reclaimed, retried, buried, requeued "
                "FROM totals WHERE id = 1"
            ).fetchone()
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return rows, tuple(totals)

    def _load(self, rows: list[tuple[Any, ...]], totals: tuple[int, ...]) -> None:
        """Rebuild the index from the file's rows."""
        ready: list[tuple[int, _Task]] = []
        dead: list[tuple[int, _Task]] = []
        for (
            key,
            payload,
            attempts,
            max_attempts,
            created_at,
            available_at,
            last_error,
            state,
            lease_id,
            deadline,
            ord_,
        ) in rows:
            task_id = _task_id(key)
            task = _Task(task_id, bytes(payload), max_attempts, created_at, available_at)
            task.attempts = attempts
            task.last_error = last_error
            task.state = state
            if state == DEAD:
                dead.append((ord_ or 0, task))
                continue
            self._tasks[task_id] = task
            if state == READY:
                ready.append((ord_ or 0, task))
            elif state == DELAYED:
                self._delayed.append((available_at, ord_, task))
                self._seq = max(self._seq, ord_)
            elif state == HANDED_OUT:
                task.lease_id = lease_id
                task.deadline = deadline
                self._leases.append((deadline, ord_, lease_id, task))
                self._seq = max(self._seq, ord_)
                self._handed_out += 1
            else:
                raise StoreError(f"{self.path}: task {task_id} has an unknown state {state}")
        ready.sort(key=lambda e: e[0])
        self._ready.extend(t for _, t in ready)
        for position, task in ready:
            self._ord[task.id] = position
            self._tail = max(self._tail, position)
            self._head = min(self._head, position)
        heapq.heapify(self._delayed)
        heapq.heapify(self._leases)
        dead.sort(key=lambda e: e[0])
        for burial, task in dead:
            self._dead[task.id] = task
            self._ord[task.id] = burial
            self._burials = max(self._burials, burial)
        self._totals = Totals(*totals)
        log.info(
            "loaded %s: %d ready, %d handed out, %d delayed, %d dead",
            self.path,
            len(self._ready),
            self._handed_out,
            len(self._delayed),
            len(self._dead),
        )

    # -- recording changes ---------------------------------------------------------------------

    def _open_batch(self) -> _Batch:
        batch = self._batch
        if batch is None:
            batch = self._batch = _Batch(asyncio.get_running_loop().create_future())
        return batch

    def _place(self, task: _Task) -> None:
        """Note where ``task`` now stands, for the file (called right after each move)."""
        state = task.state
        if state == READY:
            ready = self._ready
            if ready and ready[-1] is task:
                self._tail += 1
                self._ord[task.id] = self._tail
            else:  # released: put back at the head
                self._head -= 1
                self._ord[task.id] = self._head
        elif state == DEAD:
            self._burials += 1
            self._ord[task.id] = self._burials
        else:  # delayed or handed out: the heap entry just pushed has the latest sequence
            self._ord[task.id] = self._seq

    def _created(self, task: _Task) -> None:
        self._open_batch().new[task.id] = task
        self._place(task)

    def _touch(self, task: _Task) -> None:
        batch = self._open_batch()
        if task.id not in batch.new:  # a new one is inserted with its state at the seal
            batch.changed[task.id] = task
        self._place(task)

    def _forget(self, task: _Task) -> None:
        batch = self._open_batch()
        task_id = task.id
        self._ord.pop(task_id, None)
        if batch.new.pop(task_id, None) is None:  # else it never reached the file
            batch.changed.pop(task_id, None)
            batch.deleted.add(task_id)

    def _seal(self, batch: _Batch) -> tuple[list[Any], list[Any], list[Any], tuple[int, ...]]:
        """Rows for the batch, as the tasks are now (on the loop: a consistent cut)."""
        position = self._ord.get
        inserts = [
            (
                _key(t.id),
                t.payload,
                t.attempts,
                t.max_attempts,
                t.created_at,
                t.available_at,
                t.last_error,
                t.state,
                t.lease_id,
                t.deadline if t.lease_id is not None else None,
                position(t.id),
            )
            for t in batch.new.values()
        ]
        updates = [
            (
                t.attempts,
                t.available_at,
                t.last_error,
                t.state,
                t.lease_id,
                t.deadline if t.lease_id is not None else None,
                position(t.id),
                _key(t.id),
            )
            for t in batch.changed.values()
        ]
        deletes = [(_key(task_id),) for task_id in batch.deleted]
        return inserts, updates, deletes, astuple(self._totals)

    def _write(self, rows: tuple[list[Any], list[Any], list[Any], tuple[int, ...]]) -> None:
        """In the writer thread: one transaction for the whole batch."""
        inserts, updates, deletes, totals = rows
        conn = self._conn
        assert conn is not None
        conn.execute("BEGIN")
        try:
            if deletes:
                conn.executemany(_DELETE, deletes)
            if inserts:
                conn.executemany(_INSERT, inserts)
            if updates:
                conn.executemany(_UPDATE, updates)
            conn.execute(_TOTALS, totals)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    async def _flush(self) -> None:
        """Commit batches until none is open (group commit)."""
        loop = asyncio.get_running_loop()
        while self._batch is not None:
            for _ in range(_GATHER_ROUNDS):
                await asyncio.sleep(0)  # let what is already runnable join this batch
            batch, self._batch = self._batch, None
            rows = self._seal(batch)
            try:
                await loop.run_in_executor(self._writer, self._write, rows)
            except Exception as e:
                self._fail_stop(f"a commit to {self.path} failed: {e}")
                batch.future.set_exception(StoreError(self._failed or "commit failed"))
                continue
            self.commits += 1
            batch.future.set_result(None)
        self._flushing = None

    def _fail_stop(self, reason: str) -> None:
        if self._failed is None:
            log.error("%s; the store refuses further work: restart the broker", reason)
            self._failed = reason
            batch, self._batch = self._batch, None
            if batch is not None:
                batch.future.set_exception(StoreError(reason))

    async def _durable(self) -> None:
        """Wait until every change made so far is committed."""
        batch = self._batch
        if batch is None:
            last = self._last_commit
            if last is not None and not last.done():
                await asyncio.shield(last)
            return
        future = batch.future
        self._last_commit = future
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
        await asyncio.shield(future)

    def problem(self) -> str | None:
        if self._failed is not None:
            return f"the store is unavailable: {self._failed}"
        return None

    def _check(self) -> None:
        if self._failed is not None:
            raise StoreError(f"the store is unavailable: {self._failed}")
        if self._conn is None:
            raise StoreError("the store is closed")

    # -- the contract: each change, then wait for it to be durable ------------------------------

    async def enqueue(self, payload: bytes, *, max_attempts: int, delay: float, now: float) -> Task:
        self._check()
        view = await super().enqueue(payload, max_attempts=max_attempts, delay=delay, now=now)
        await self._durable()
        return view

    async def enqueue_many(
        self, items: Sequence[tuple[bytes, int, float]], *, now: float
    ) -> list[Task]:
        self._check()
        views = await super().enqueue_many(items, now=now)
        await self._durable()
        return views

    async def claim(self, *, lease: float, now: float) -> Delivery | None:
        self._check()
        delivery = await super().claim(lease=lease, now=now)
        await self._durable()
        return delivery

    async def claim_many(self, leases: Sequence[float], *, now: float) -> list[Delivery]:
        self._check()
        deliveries = await super().claim_many(leases, now=now)
        await self._durable()
        return deliveries

    async def ack(self, task_id: str, lease_id: str, *, now: float) -> None:
        self._check()
        await super().ack(task_id, lease_id, now=now)
        await self._durable()

    async def settle_many(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[tuple[str, str, str | None]],
        *,
        now: float,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        self._check()
        outcomes = await super().settle_many(acks, nacks, now=now)
        await self._durable()
        return outcomes

    async def nack(self, task_id: str, lease_id: str, error: str | None, *, now: float) -> Failure:
        self._check()
        failure = await super().nack(task_id, lease_id, error, now=now)
        await self._durable()
        return failure

    async def reclaim(self, task_id: str, lease_id: str, error: str, *, now: float) -> Failure:
        self._check()
        failure = await super().reclaim(task_id, lease_id, error, now=now)
        await self._durable()
        return failure

    async def release(self, task_id: str, lease_id: str) -> bool:
        self._check()
        released = await super().release(task_id, lease_id)
        await self._durable()
        return released

    async def sweep(self, *, now: float) -> tuple[SweepResult, float | None]:
        self._check()
        result = await super().sweep(now=now)
        await self._durable()
        return result

    async def requeue(self, task_id: str, *, now: float) -> None:
        self._check()
        await super().requeue(task_id, now=now)
        await self._durable()

    async def stats(self) -> Stats:
        self._check()
        await self._durable()  # never report what is not yet committed
        return await super().stats()

    async def dead_letters(self, *, limit: int | None = None) -> list[Task]:
        self._check()
        await self._durable()
        return await super().dead_letters(limit=limit)

    async def close(self) -> None:
        if self._conn is None:
            return
        if self._failed is None and (self._batch is not None or self._flushing is not None):
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
