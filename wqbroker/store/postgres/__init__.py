"""The PostgreSQL store: durable and shared, through asyncpg.

Design: the database is the truth and the store keeps no index of its own, so any number of brokers
on one database are one store. Every operation is one round trip: a call of a PL/pgSQL function
made with the schema (or one plain statement), run in its own transaction on a connection of a
small pool. Claims take rows with ``FOR UPDATE SKIP LOCKED``, so concurrent claims (from this
broker or another) never wait for each other nor hand out the same task; acks, nacks, extensions
and reclaims are fenced by the lease id, and tell "not held" (NotFound) from "held under another
lease" (LeaseLost) after the guarded change failed, under the same row lock order.

The package, a module for each concern (as River's driver is split from its migrations):

- ``store.py``: :class:`PostgresStore`, the contract's operations and hints, one round trip each;
- ``group.py``: group commit (calls of a kind made while one is in flight share the next
  transaction);
- ``listener.py``: wake-ups between brokers (NOTIFY after a commit, LISTEN on a connection of its
  own, made again when lost);
- ``dsn.py``: the DSN (several servers, the one that takes writes; without its password for logs);
- ``pool.py``: the connections, and the database away (fail fast, probe with backoff, recover);
- ``schema.py``: the schema made, upgraded or checked at open: ``migrations/NNN_*.sql`` through the
  runner every SQL store shares (wqbroker/store/migrate.py), then ``sql/functions.sql``;
- ``queries.py``: the SQL, read from ``sql/*.sql`` at start-up (no SQL is written in Python, and
  nothing a client sends is ever formatted into it: it goes as parameters).

Tables (in the schema ``wq``; ``migrations/001_tables.sql`` describes their columns):

- ``tasks``: one row per task not acked nor purged (or acked with a result still kept), in its
  state (0 ready, 1 handed out, 2 delayed, 3 dead, 4 waiting for its parents, 5 succeeded) with
  its payload (``bytea``: exact bytes). ``ord`` is where it stands: place
  in line (ready), tie-break among equal due times (delayed, handed out), burial order (dead). Each
  call takes one number from the sequence ``wq.ord`` and numbers the rows it changes
  ``number * 2**20 + i``, so order within a call is exact; a release takes the negated number, and
  so goes to the head of its lane. Acked tasks are deleted. Partial indexes by state keep dead
  tasks and leases out of the claim path, and page a queue's listing in each state's order from a
  key (``migrations/003_control.sql``). The columns of control over tasks (docs/design/control.md:
  expiry, time limit and hand-out time, progress, cancelling, unique key) are NULL or false for a
  task that uses none of it; the tasks that expire are in an index of their own (the sweep's cost
  is what is due), and a partial unique index on ``(queue, ukey)`` over ready, delayed and
  handed-out tasks makes "unique while active" the database's to enforce, whichever broker
  enqueues.
- ``edges`` (docs/design/results.md, ``migrations/004_results.sql``): each child's parents, in the
  order of its ``after``, indexed both ways. A task's flags say what its end must look at (it has
  parents, children, a waiter), so a task that uses none of it costs nothing more. The last
  parent's ack releases its children in its own transaction: one statement over the edges, each
  child's row updated once (its count of parents pending less those acked), children locked in
  id order so that brokers releasing overlapping children never wait in a cycle (a deadlock that
  comes anyway, with an enqueue naming both a parent and its child, is retried: pool.py). A
  parent that ends dead, cancelled or expired buries its waiting children transitively (a
  cancelled waiting task cancels them); results are pruned by the sweep (an index on when each is
  looked at: a result a live child still pins is looked at again later, or when that child
  leaves).
- ``counters``: totals and gauges as deltas, one row per (connection slot, queue), changed in the
  same transaction as the tasks. The slot is the backend's pid: two live connections never share
  one, so concurrent transactions never wait on a counter row (no single hot row). ``stats`` sums
  them in one statement: one snapshot, so gauges and totals agree and ``nacked + reclaimed ==
  retried + buried`` in every answer. Totals count since the database was created. Rows of
  connections that are gone are folded into slot 0 every few seconds (``wq.fold``). A queue
  deleted leaves its totals in the row of no queue (``''``), so the broker's totals keep them; an
  enqueue holds a shared advisory lock on its queue until it commits, which ``wq.delete_queue``
  takes exclusively, so a queue is never forgotten while a task is being put in it.
- ``queues`` (every queue known, and whether it is paused; its limits and rate bucket,
  docs/design/schedules.md, ``migrations/006_limits.sql``: a claim locks the row of a queue with
  limits, only that), ``keys`` (idempotency keys in their window), ``meta`` (schema version, the
  key that scatters task ids).
- ``schedules`` (docs/design/schedules.md, ``migrations/005_schedules.sql``): a schedule a row,
  its due ones found through an index on ``next_fire_at``. A fire is one call of ``wq.fire``: a
  compare-and-set on the row's ``(next_fire_at, revision)`` that takes it ``FOR UPDATE SKIP
  LOCKED`` (brokers firing together never queue behind each other), enqueues the task through
  ``wq.enqueue`` and moves the row on, in one transaction: each (schedule, scheduled time)
  enqueues one task, whichever brokers try. ``due_schedules`` reads the database's clock (with
  ``db_clock``), and a schedule's times are compared with it as they are (they are the rule's
  wall-clock times, never translated by the skew).

Ids: each broker reserves blocks of 1024 numbers from the sequence ``wq.id_blocks`` and scatters
them with the same bijection as the index (so they are unique across brokers and never repeat).

Time: the contract hands ``now`` to every call. With ``db_clock=True`` (what the broker uses) the
store passes NULL instead and every function uses the database's clock (``wq.clock``), so brokers
with skewed clocks agree on what is due; the store measures the skew at each sweep and hands the
broker every time in the broker's own clock (and adds it to the key windows it sends). Without it
(the tests, on a fake clock) the functions use the ``now`` they are given.

Between brokers (listener.py): whatever makes tasks ready here is announced after its commit with
a NOTIFY; a connection of its own LISTENs for the others' announcements and tells the service
(:meth:`PostgresStore.on_ready`: this store is a :class:`~wqbroker.store.ReadyListener`), which
pumps the consumers waiting for those queues; the service also polls now and then. A cancel that
makes a handed-out task cancelling sends its lease id on the same channel in its own transaction,
and the others tell their dispatchers (:meth:`PostgresStore.on_cancel`: a
:class:`~wqbroker.store.CancelListener`), which tell the stream holding it, if it is theirs.
Watched tasks that end (a waiter for a result: docs/design/results.md) are sent on it too, in the
transaction that ends them, and heard by every broker (:meth:`PostgresStore.on_finished`).

The database away (pool.py): calls fail with StoreError (503 / UNAVAILABLE) at once until the
database answers again; then every queue is re-checked.

Failover (dsn.py, pool.py): every connection is made through one helper that honours a DSN
listing several servers and asks for one that takes writes (``target_session_attrs=read-write``
unless the DSN says otherwise). A server that turns out read-only (a standby, an old primary back
as one: SQLSTATE 25006, or the probe's ``pg_is_in_recovery()``), shutting down or starting
(57P01, 57P02, 57P03) is a failover under way: the store is unavailable and its connections are
made again until a primary answers. Nothing is cached from the old primary but the reserved id
blocks (dropped when the database comes back, and the sequence moved ahead before the next
reservation, so a standby promoted behind the old primary never hands out an id again) and the
hints; leases are random ids kept in the rows, so the fencing is the new primary's rows, whatever
the old one had.

Retry backoff: the store draws the random part of each delay from its Backoff (as the other
stores do) and sends it with the nack; the database computes the delay (``wq.backoff``, the same
formula as :func:`wqbroker.retry.backoff_delay`, the reference: a test checks they agree), because
only the database knows, inside the settling transaction, the task's attempts and whether it is
retried or buried: computing it here would cost a second round trip.
"""

from wqbroker.store.postgres.dsn import redact
from wqbroker.store.postgres.listener import CHANNEL, LISTENER_NAME
from wqbroker.store.postgres.pool import POOL_SIZE
from wqbroker.store.postgres.schema import SCHEMA_VERSION
from wqbroker.store.postgres.store import LOOK_AGAIN_AFTER, PostgresStore

__all__ = [
    "CHANNEL",
    "LISTENER_NAME",
    "LOOK_AGAIN_AFTER",
    "POOL_SIZE",
    "SCHEMA_VERSION",
    "PostgresStore",
    "redact",
]
