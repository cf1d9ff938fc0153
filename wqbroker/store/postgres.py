"""The PostgreSQL store: durable and shared, through asyncpg.

Design: the database is the truth and the store keeps no index of its own, so any number of brokers
on one database are one store. Every operation is one round trip: a call of a PL/pgSQL function
created with the schema (or one plain statement), run in its own transaction on a connection of a
small pool. Claims take rows with ``FOR UPDATE SKIP LOCKED``, so concurrent claims (from this
broker or another) never wait for each other nor hand out the same task; acks, nacks, extensions
and reclaims are fenced by the lease id, and tell "not held" (NotFound) from "held under another
lease" (LeaseLost) after the guarded change failed, under the same row lock order.

Tables (in the schema ``wq``):

- ``tasks``: one row per task not acked nor purged, in its state (0 ready, 1 handed out,
  2 delayed, 3 dead) with its payload (``bytea``: exact bytes). ``ord`` is where it stands: place
  in line (ready), tie-break among equal due times (delayed, handed out), burial order (dead). Each
  call takes one number from the sequence ``wq.ord`` and numbers the rows it changes
  ``number * 2**20 + i``, so order within a call is exact; a release takes the negated number, and
  so goes to the head of its lane. Acked tasks are deleted. Partial indexes by state keep dead
  tasks and leases out of the claim path.
- ``counters``: totals and gauges as deltas, one row per (connection slot, queue), changed in the
  same transaction as the tasks. The slot is the backend's pid: two live connections never share
  one, so concurrent transactions never wait on a counter row (no single hot row). ``stats`` sums
  them in one statement: one snapshot, so gauges and totals agree and ``nacked + reclaimed ==
  retried + buried`` in every answer. Totals count since the database was created. Rows of
  connections that are gone are folded into slot 0 every few seconds (``wq.fold``).
- ``queues`` (every queue known, and whether it is paused), ``keys`` (idempotency keys in their
  window), ``meta`` (schema version, the key that scatters task ids).

Ids: each broker reserves blocks of 1024 numbers from the sequence ``wq.id_blocks`` and scatters
them with the same bijection as the index (so they are unique across brokers and never repeat).

Time: the contract hands ``now`` to every call. With ``db_clock=True`` (what the broker uses) the
store passes NULL instead and every function uses the database's clock (``clock_timestamp()``),
so brokers with skewed clocks agree on what is due; the store measures the skew at each sweep and
hands the broker every time in the broker's own clock (and adds it to the key windows it sends).
Without it (the tests, on a fake clock) the functions use the ``now`` they are given.

Between brokers: whatever makes tasks ready here (an enqueue, a promotion, a requeue, a release,
a resume) is announced after its commit with a NOTIFY on ``wq_ready`` carrying the queue names
(one in flight at a time, gathering the rest); a connection of its own LISTENs for the others'
announcements and tells the service (:meth:`PostgresStore.on_ready`), which pumps the consumers
waiting for those queues. That connection is made again when lost, and then every queue is
re-checked (announcements may have been missed); the service also polls now and then.

The database away: a call that cannot reach it fails with StoreError (503 / UNAVAILABLE) and marks
the store failed (:meth:`problem`, for the health checks); until a probe (with backoff) or the
listener reaches the database again, calls fail at once without trying the network. Then the old
connections are replaced and every queue is re-checked.

Retry backoff: the store draws the random part of each delay from its Backoff (as the other
stores do); the function computes the delay exactly as :func:`wqbroker.retry.backoff_delay`.

Schema: created at open inside a transaction holding ``pg_advisory_xact_lock``, so brokers starting
together create it once. A database holding other tables and no wq schema, or a wq schema of a
newer version, is refused with a one-line StoreError.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import asyncpg

from wqbroker.clock import Clock
from wqbroker.errors import LeaseLost, NotFound, StoreError, WqError, quoted
from wqbroker.models import (
    DEFAULT_QUEUE,
    Delivery,
    Enqueued,
    Failure,
    NackItem,
    NewTask,
    QueueReport,
    QueueStats,
    Stats,
    SweepResult,
    Task,
    TaskState,
    Totals,
)
from wqbroker.retry import Backoff
from wqbroker.store.index import _MASK, PRIORITIES, STATE_NAMES, _mix, hex_id, parse_id

log = logging.getLogger("wqbroker.store.postgres")

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    _Conn = asyncpg.Connection | PoolConnectionProxy[Any]

# 2: set-based enqueue and acks, promotions reported by claims, fold, an index of key expiries
SCHEMA_VERSION: Final = 2
# The channel on which brokers tell each other which queues have tasks ready.
CHANNEL: Final = "wq_ready"
# A broker that lost its database (or its listening connection) tries again after this long,
# doubling up to the cap.
RETRY_FIRST: Final = 0.05
RETRY_CAP: Final = 2.0
# Every this many sweeps, a sweep also refreshes the queue names and folds counter rows.
_SWEEPS_PER_REFRESH: Final = 20
# The skew between the broker's clock and the database's is measured from sweeps whose round trip
# took less than this (so the estimate is off by half of it at most).
_SKEW_RTT: Final = 0.01
# Any constant: the key of the advisory lock taken while the schema is checked or created.
_LOCK_KEY: Final = 0x7771_0000_0001
# ... and the one a broker holds while it vacuums (one broker at a time does).
_VACUUM_KEY: Final = 0x7771_0000_0002
# An enqueue carries its own announcement (NOTIFY in its transaction) at most this often.
_INLINE_GAP: Final = 0.005
# What a broker announces when it starts listening (so that the others announce to it).
_HELLO: Final = "+"
# The application_name of the connections that LISTEN (so brokers can count each other).
LISTENER_NAME: Final = "wq listener"
# A table is vacuumed by the brokers once it has this many dead rows, plus this share of its live
# ones (as autovacuum's threshold and scale factor would; autovacuum may be off, or too slow for
# a queue: its launcher visits a database once a minute by default).
VACUUM_THRESHOLD: Final = 2000
VACUUM_SCALE: Final = 0.1
_OFFSET: Final = 2**63
_ID_BLOCK: Final = 1024
POOL_SIZE: Final = 8

_TOTALS: Final = tuple(f.name for f in dataclasses.fields(Totals))  # a column each
_GAUGES: Final = ("ready", "handed_out", "delayed", "dead")
_COUNTS: Final = _TOTALS + _GAUGES
_UPSERT: Final = "ON CONFLICT (slot, queue) DO UPDATE SET " + ", ".join(
    f"{c} = k.{c} + excluded.{c}" for c in _COUNTS
)


def _d(**deltas: int | str) -> str:
    """A counters delta array for wq.bump, in SQL (a value may be an SQL expression)."""
    unknown = set(deltas) - set(_COUNTS)
    assert not unknown, unknown
    return "ARRAY[" + ", ".join(str(deltas.get(c, 0)) for c in _COUNTS) + "]::bigint[]"


# A failed delivery (nk: 1 for a nack, rc: 1 for a reclaim), retried or buried.
_RETRIED: Final = _d(nacked="nk", reclaimed="rc", retried=1, handed_out=-1, delayed=1)
_BURIED: Final = _d(nacked="nk", reclaimed="rc", buried=1, handed_out=-1, dead=1)
_NOW: Final = "coalesce(p_now, extract(epoch FROM clock_timestamp())::float8)"


_TABLES: Final = f"""
CREATE SCHEMA IF NOT EXISTS wq;
CREATE TABLE wq.meta (key text PRIMARY KEY, value text NOT NULL);
CREATE SEQUENCE wq.ord;
CREATE SEQUENCE wq.id_blocks;
CREATE TABLE wq.tasks (
    id bigint PRIMARY KEY,              -- the task id (16 hex digits) minus 2**63
    queue text NOT NULL,
    state smallint NOT NULL,            -- 0 ready, 1 handed out, 2 delayed, 3 dead
    priority smallint NOT NULL,
    ord bigint NOT NULL,                -- where it stands (see the module's docstring)
    payload bytea NOT NULL,             -- the JSON text as received
    attempts int NOT NULL,
    max_attempts int NOT NULL,
    created_at float8 NOT NULL,         -- epoch seconds
    available_at float8 NOT NULL,
    lease_id text,
    deadline float8,
    last_error bytea                    -- UTF-8 (bytea: an error may hold NUL characters)
) WITH (fillfactor = 90, autovacuum_vacuum_scale_factor = 0.0,
        autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_cost_delay = 0);
CREATE INDEX tasks_ready ON wq.tasks (queue, priority DESC, ord) WHERE state = 0;
CREATE INDEX tasks_leased ON wq.tasks (deadline, ord) WHERE state = 1;
CREATE INDEX tasks_delayed ON wq.tasks (available_at, ord) WHERE state = 2;
CREATE INDEX tasks_dead ON wq.tasks (queue, ord) WHERE state = 3;
CREATE INDEX tasks_burials ON wq.tasks (ord) WHERE state = 3;
CREATE TABLE wq.queues (name text PRIMARY KEY, paused boolean NOT NULL DEFAULT false);
CREATE TABLE wq.counters (
    slot int NOT NULL,                  -- the backend pid of the connection that wrote it
    queue text NOT NULL,
    {", ".join(f"{c} bigint NOT NULL DEFAULT 0" for c in _COUNTS)},
    PRIMARY KEY (slot, queue)
) WITH (fillfactor = 50);
CREATE TABLE wq.keys (
    queue text NOT NULL,
    key text NOT NULL,
    task_id bigint NOT NULL,            -- as tasks.id (the task may be gone)
    until float8 NOT NULL,
    PRIMARY KEY (queue, key)
);
CREATE INDEX keys_until ON wq.keys (until);  -- every sweep forgets the expired ones
"""

_FUNCTIONS: Final = f"""
CREATE FUNCTION wq.bump(p_queue text, d bigint[]) RETURNS void LANGUAGE sql AS $$
INSERT INTO wq.counters AS k (slot, queue, {", ".join(_COUNTS)})
VALUES (pg_backend_pid(), p_queue, {", ".join(f"d[{i + 1}]" for i in range(len(_COUNTS)))})
{_UPSERT}
$$;

CREATE FUNCTION wq.backoff(p_attempts int, p_base float8, p_cap float8, p_u float8)
RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
SELECT h + h * p_u FROM (
    SELECT least(p_cap, p_base * power(2::float8, greatest(0, least(p_attempts - 1, 64))))
           / 2::float8 AS h) s
$$;

-- Why a guarded change failed: 2 (LeaseLost) if the task is held, else 1 (NotFound).
CREATE FUNCTION wq.miss(p_id bigint) RETURNS int LANGUAGE sql AS $$
SELECT CASE WHEN (SELECT state FROM wq.tasks WHERE id = p_id) = 1 THEN 2 ELSE 1 END
$$;

-- p_notify: an announcement to send with the commit (when the broker sends none of its own at
-- the moment, so that commits rarely contend for the notification lock), or NULL.
CREATE FUNCTION wq.enqueue(p_now float8, p_ids bigint[], p_queues text[], p_prios int[],
    p_payloads bytea[], p_max int[], p_delays float8[], p_keys text[], p_untils float8[],
    p_notify text)
RETURNS TABLE (o_i int, o_id bigint, o_dup boolean, o_at float8, o_available float8)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := {_NOW};
    base bigint := nextval('wq.ord') * 1048576;
    q text;
    owner bigint;
    avail float8;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM unnest(p_keys) k WHERE k IS NOT NULL) THEN
        -- No idempotency keys (the common case): the batch as a set.
        INSERT INTO wq.queues (name) SELECT DISTINCT u FROM unnest(p_queues) u
            ON CONFLICT DO NOTHING;
        RETURN QUERY
        WITH n AS (
            SELECT * FROM unnest(p_ids, p_queues, p_prios, p_payloads, p_max, p_delays)
                WITH ORDINALITY AS n(id, queue, prio, payload, max, delay, i)),
        ins AS (
            INSERT INTO wq.tasks (id, queue, state, priority, ord, payload, attempts,
                                  max_attempts, created_at, available_at)
            SELECT n.id, n.queue, CASE WHEN n.delay > 0 THEN 2 ELSE 0 END, n.prio, base + n.i,
                n.payload, 0, n.max, now_, now_ + greatest(n.delay, 0) FROM n
            RETURNING queue, state),
        g AS (SELECT ins.queue, count(*) AS n, count(*) FILTER (WHERE ins.state = 0) AS r
              FROM ins GROUP BY ins.queue),
        bump AS (
            INSERT INTO wq.counters AS k (slot, queue, enqueued, ready, delayed)
            SELECT pg_backend_pid(), g.queue, g.n, g.r, g.n - g.r FROM g
            {_UPSERT})
        SELECT n.i::int, n.id, false, now_, now_ + greatest(n.delay, 0) FROM n ORDER BY n.i;
        IF p_notify IS NOT NULL THEN
            PERFORM pg_notify('{CHANNEL}', p_notify);
        END IF;
        RETURN;
    END IF;
    FOR j IN 1..coalesce(array_length(p_ids, 1), 0) LOOP
        q := p_queues[j];
        IF p_keys[j] IS NOT NULL THEN
            INSERT INTO wq.keys AS k (queue, key, task_id, until)
                VALUES (q, p_keys[j], p_ids[j], p_untils[j])
                ON CONFLICT (queue, key) DO UPDATE
                SET task_id = excluded.task_id, until = excluded.until WHERE k.until <= now_
                RETURNING k.task_id INTO owner;
            IF NOT FOUND THEN
                SELECT k.task_id INTO owner FROM wq.keys k
                    WHERE k.queue = q AND k.key = p_keys[j];
                o_i := j; o_id := owner; o_dup := true; o_at := now_; o_available := NULL;
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;
        INSERT INTO wq.queues (name) VALUES (q) ON CONFLICT DO NOTHING;
        IF p_delays[j] > 0 THEN
            avail := now_ + p_delays[j];
            PERFORM wq.bump(q, {_d(enqueued=1, delayed=1)});
        ELSE
            avail := now_;
            PERFORM wq.bump(q, {_d(enqueued=1, ready=1)});
        END IF;
        INSERT INTO wq.tasks (id, queue, state, priority, ord, payload, attempts, max_attempts,
                              created_at, available_at)
            VALUES (p_ids[j], q, CASE WHEN p_delays[j] > 0 THEN 2 ELSE 0 END, p_prios[j],
                    base + j, p_payloads[j], 0, p_max[j], now_, avail);
        o_i := j; o_id := p_ids[j]; o_dup := false; o_at := now_; o_available := avail;
        RETURN NEXT;
    END LOOP;
    IF p_notify IS NOT NULL THEN
        PERFORM pg_notify('{CHANNEL}', p_notify);
    END IF;
END $$;

-- Delayed tasks due by now, to the tail of ready (in order of due time): per queue, how many.
-- Rows another call is promoting are skipped, not waited for: that call announces them once it
-- commits. (Waiting would be worse: a row that was waited for and found promoted by the other
-- call stays locked -- PostgreSQL keeps the lock of a row that fails the recheck -- until this
-- transaction ends, hiding the task from the claims made for waiting consumers, which skip
-- locked rows, after its announcement.)
CREATE FUNCTION wq.promote(now_ float8) RETURNS TABLE (o_queue text, o_n bigint)
LANGUAGE plpgsql AS $$
DECLARE
    base bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM wq.tasks t WHERE t.state = 2 AND t.available_at <= now_) THEN
        RETURN;
    END IF;
    base := nextval('wq.ord') * 1048576;
    RETURN QUERY
    WITH due AS (
        SELECT s.id, row_number() OVER (ORDER BY s.available_at, s.ord) AS rn FROM (
            SELECT t.id, t.available_at, t.ord FROM wq.tasks t
            WHERE t.state = 2 AND t.available_at <= now_ FOR UPDATE SKIP LOCKED) s),
    upd AS (
        UPDATE wq.tasks t SET state = 0, ord = base + d.rn FROM due d WHERE t.id = d.id
        RETURNING t.queue),
    g AS (SELECT u.queue, count(*) AS n FROM upd u GROUP BY u.queue),
    bump AS (
        INSERT INTO wq.counters AS k (slot, queue, ready, delayed)
        SELECT pg_backend_pid(), g.queue, g.n, -g.n FROM g
        {_UPSERT})
    SELECT g.queue, g.n FROM g;
END $$;

CREATE FUNCTION wq.claim(p_now float8, p_leases float8[], p_lease_ids text[], p_queues text[])
RETURNS TABLE (o_rn bigint, o_id bigint, o_payload bytea, o_attempts int, o_max int,
    o_created float8, o_available float8, o_error bytea, o_queue text, o_priority smallint,
    o_deadline float8)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := {_NOW};
    base bigint;
    want int := coalesce(array_length(p_leases, 1), 0);
    got bigint := 0;
    n bigint;
    q text;
BEGIN
    -- First the queues in which delayed tasks were promoted (o_rn NULL): other consumers may
    -- want them.
    RETURN QUERY SELECT NULL::bigint, NULL::bigint, NULL::bytea, NULL::int, NULL::int,
        NULL::float8, NULL::float8, NULL::bytea, p.o_queue, NULL::smallint, NULL::float8
        FROM wq.promote(now_) p;
    base := nextval('wq.ord') * 1048576;
    FOREACH q IN ARRAY p_queues LOOP
        EXIT WHEN got >= want;
        CONTINUE WHEN EXISTS (SELECT 1 FROM wq.queues p WHERE p.name = q AND p.paused);
        RETURN QUERY
        WITH cand AS (
            SELECT s.id, got + row_number() OVER (ORDER BY s.priority DESC, s.ord) AS rn FROM (
                SELECT t.id, t.priority, t.ord FROM wq.tasks t
                WHERE t.state = 0 AND t.queue = q
                ORDER BY t.priority DESC, t.ord LIMIT want - got
                FOR UPDATE SKIP LOCKED) s),
        upd AS (
            UPDATE wq.tasks t SET state = 1, attempts = t.attempts + 1,
                lease_id = p_lease_ids[c.rn], deadline = now_ + p_leases[c.rn], ord = base + c.rn
            FROM cand c WHERE t.id = c.id
            RETURNING c.rn, t.id, t.payload, t.attempts, t.max_attempts, t.created_at,
                t.available_at, t.last_error, t.queue, t.priority, t.deadline),
        bump AS (
            INSERT INTO wq.counters AS k (slot, queue, delivered, ready, handed_out)
            SELECT pg_backend_pid(), q, count(*), -count(*), count(*) FROM upd HAVING count(*) > 0
            {_UPSERT})
        SELECT * FROM upd ORDER BY 1;
        GET DIAGNOSTICS n = ROW_COUNT;
        got := got + n;
    END LOOP;
END $$;

-- A handed-out task (locked by the caller) whose delivery failed: delayed for a retry or
-- buried. Its retry time, or NULL if buried.
CREATE FUNCTION wq.fail(p_id bigint, p_queue text, p_attempts int, p_max int, now_ float8,
    p_error bytea, p_delay float8, p_terminal boolean, p_u float8, p_reclaim boolean,
    p_base float8, p_cap float8, p_ord bigint)
RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE
    avail float8;
    nk int := CASE WHEN p_reclaim THEN 0 ELSE 1 END;
    rc int := CASE WHEN p_reclaim THEN 1 ELSE 0 END;
BEGIN
    IF NOT coalesce(p_terminal, false) AND p_attempts < p_max THEN
        avail := now_ + coalesce(p_delay, wq.backoff(p_attempts, p_base, p_cap, p_u));
        UPDATE wq.tasks SET state = 2, available_at = avail, lease_id = NULL, deadline = NULL,
            last_error = p_error, ord = p_ord WHERE id = p_id;
        PERFORM wq.bump(p_queue, {_RETRIED});
        RETURN avail;
    END IF;
    UPDATE wq.tasks SET state = 3, lease_id = NULL, deadline = NULL, last_error = p_error,
        ord = p_ord WHERE id = p_id;
    PERFORM wq.bump(p_queue, {_BURIED});
    RETURN NULL;
END $$;

-- Acks, then nacks (or reclaims), in order. o_kind 0: an ack, 1: a nack; o_outcome 0: done,
-- 1: NotFound, 2: LeaseLost; o_retry_at: when a nacked task is retried (NULL: buried).
CREATE FUNCTION wq.settle(p_now float8, p_ack_ids bigint[], p_ack_leases text[],
    p_ids bigint[], p_leases text[], p_errors bytea[], p_delays float8[], p_terminal boolean[],
    p_us float8[], p_reclaim boolean, p_base float8, p_cap float8)
RETURNS TABLE (o_kind int, o_i int, o_outcome int, o_retry_at float8)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := {_NOW};
    base bigint := nextval('wq.ord') * 1048576;
    q text;
    a int;
    m int;
    done int[];
BEGIN
    IF (SELECT count(DISTINCT x) FROM unnest(p_ack_ids) x) = array_length(p_ack_ids, 1) THEN
        -- Acks of distinct tasks (the usual batch): deleted as a set, counted once per queue.
        WITH a AS (
            SELECT * FROM unnest(p_ack_ids, p_ack_leases) WITH ORDINALITY AS a(id, lease, i)),
        d AS (
            DELETE FROM wq.tasks t USING a
            WHERE t.id = a.id AND t.state = 1 AND t.lease_id = a.lease RETURNING a.i, t.queue),
        g AS (SELECT d.queue, count(*) AS n FROM d GROUP BY d.queue),
        bump AS (
            INSERT INTO wq.counters AS k (slot, queue, acked, handed_out)
            SELECT pg_backend_pid(), g.queue, g.n, -g.n FROM g
            {_UPSERT})
        SELECT array_agg(d.i) INTO done FROM d;
        RETURN QUERY SELECT 0, a.i::int,
            CASE WHEN a.i = ANY(done) THEN 0 ELSE wq.miss(a.id) END, NULL::float8
            FROM unnest(p_ack_ids) WITH ORDINALITY AS a(id, i) ORDER BY a.i;
        p_ack_ids := '{{}}';
    END IF;
    FOR j IN 1..coalesce(array_length(p_ack_ids, 1), 0) LOOP
        DELETE FROM wq.tasks t
            WHERE t.id = p_ack_ids[j] AND t.state = 1 AND t.lease_id = p_ack_leases[j]
            RETURNING t.queue INTO q;
        o_kind := 0; o_i := j; o_retry_at := NULL;
        IF FOUND THEN
            PERFORM wq.bump(q, {_d(acked=1, handed_out=-1)});
            o_outcome := 0;
        ELSE
            o_outcome := wq.miss(p_ack_ids[j]);
        END IF;
        RETURN NEXT;
    END LOOP;
    FOR j IN 1..coalesce(array_length(p_ids, 1), 0) LOOP
        SELECT t.attempts, t.max_attempts, t.queue INTO a, m, q FROM wq.tasks t
            WHERE t.id = p_ids[j] AND t.state = 1 AND t.lease_id = p_leases[j] FOR UPDATE;
        o_kind := 1; o_i := j; o_retry_at := NULL;
        IF FOUND THEN
            o_outcome := 0;
            o_retry_at := wq.fail(p_ids[j], q, a, m, now_, p_errors[j], p_delays[j],
                p_terminal[j], p_us[j], p_reclaim, p_base, p_cap, base + j);
        ELSE
            o_outcome := wq.miss(p_ids[j]);
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;

CREATE FUNCTION wq.extend(p_now float8, p_id bigint, p_lease_id text, p_lease float8)
RETURNS TABLE (o_outcome int, o_deadline float8) LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := {_NOW};
BEGIN
    UPDATE wq.tasks t SET deadline = now_ + p_lease, ord = nextval('wq.ord') * 1048576
        WHERE t.id = p_id AND t.state = 1 AND t.lease_id = p_lease_id
        RETURNING t.deadline INTO o_deadline;
    o_outcome := CASE WHEN FOUND THEN 0 ELSE wq.miss(p_id) END;
    RETURN NEXT;
END $$;

-- Its queue, or NULL if the lease is not current.
CREATE FUNCTION wq.release(p_id bigint, p_lease_id text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    UPDATE wq.tasks t SET state = 0, attempts = t.attempts - 1, lease_id = NULL,
        deadline = NULL, ord = -nextval('wq.ord') * 1048576
        WHERE t.id = p_id AND t.state = 1 AND t.lease_id = p_lease_id
        RETURNING t.queue INTO q;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM wq.bump(q, {_d(delivered=-1, handed_out=-1, ready=1)});
    RETURN q;
END $$;

-- Reclaim up to array_length(p_us) expired leases (oldest deadline first), promote what is due,
-- forget expired keys. o_kind 0: a reclaimed task (o_id, o_lease); 1: promoted (o_queue, o_n);
-- 2: when the next thing is due (o_due, NULL if nothing is scheduled); then, for the broker's
-- hints: 3: each queue known (o_queue; only if p_names); 4: how many tasks are held (o_n);
-- 5: the database's clock (o_due).
CREATE FUNCTION wq.sweep(p_now float8, p_us float8[], p_base float8, p_cap float8,
    p_names boolean)
RETURNS TABLE (o_kind int, o_id bigint, o_lease text, o_queue text, o_n bigint, o_due float8)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := {_NOW};
    base bigint := nextval('wq.ord') * 1048576;
    j int := 0;
    r record;
BEGIN
    FOR r IN SELECT t.id, t.lease_id, t.queue, t.attempts, t.max_attempts FROM wq.tasks t
             WHERE t.state = 1 AND t.deadline <= now_ ORDER BY t.deadline, t.ord
             LIMIT coalesce(array_length(p_us, 1), 0) FOR UPDATE SKIP LOCKED LOOP
        j := j + 1;
        PERFORM wq.fail(r.id, r.queue, r.attempts, r.max_attempts, now_,
            convert_to('lease expired', 'UTF8'), NULL, false, p_us[j], true, p_base, p_cap,
            base + j);
        o_kind := 0; o_id := r.id; o_lease := r.lease_id; o_queue := r.queue; o_n := NULL;
        o_due := NULL;
        RETURN NEXT;
    END LOOP;
    RETURN QUERY SELECT 1, NULL::bigint, NULL::text, p.o_queue, p.o_n, NULL::float8
        FROM wq.promote(now_) p;
    DELETE FROM wq.keys k WHERE k.until <= now_;
    RETURN QUERY SELECT 2, NULL::bigint, NULL::text, NULL::text, NULL::bigint, least(
        (SELECT min(t.available_at) FROM wq.tasks t WHERE t.state = 2),
        (SELECT min(t.deadline) FROM wq.tasks t WHERE t.state = 1));
    IF p_names THEN
        RETURN QUERY SELECT 3, NULL::bigint, NULL::text, q.name, NULL::bigint, NULL::float8
            FROM wq.queues q;
    END IF;
    RETURN QUERY SELECT 4, NULL::bigint, NULL::text, NULL::text,
        coalesce(sum(k.ready + k.handed_out + k.delayed), 0)::bigint, NULL::float8
        FROM wq.counters k;
    RETURN QUERY SELECT 5, NULL::bigint, NULL::text, NULL::text, NULL::bigint,
        extract(epoch FROM clock_timestamp())::float8;
    -- 6: the brokers listening for announcements (o_n); 7: per table, its dead rows (o_n) and
    -- live rows (o_due), for the vacuum.
    RETURN QUERY SELECT 6, NULL::bigint, NULL::text, NULL::text, count(*), NULL::float8
        FROM pg_stat_activity a
        WHERE a.datname = current_database() AND a.application_name = '{LISTENER_NAME}';
    RETURN QUERY SELECT 7, NULL::bigint, NULL::text, c.relname::text,
        pg_stat_get_dead_tuples(c.oid), pg_stat_get_live_tuples(c.oid)::float8
        FROM pg_class c WHERE c.oid IN ('wq.tasks'::regclass, 'wq.counters'::regclass,
                                        'wq.keys'::regclass);
END $$;

-- Counter rows of connections that are gone, added into slot 0 (so the rows to sum stay about
-- as many as live connections times queues). One statement: a sum never sees a row twice.
CREATE FUNCTION wq.fold() RETURNS void LANGUAGE sql AS $$
WITH gone AS (
    DELETE FROM wq.counters k WHERE k.slot <> 0
        AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = k.slot)
    RETURNING k.*)
INSERT INTO wq.counters AS k (slot, queue, {", ".join(_COUNTS)})
SELECT 0, g.queue, {", ".join(f"sum(g.{c})" for c in _COUNTS)} FROM gone g GROUP BY g.queue
{_UPSERT}
$$;

-- Dead tasks (one, or all, or all of a queue) to the tail of ready, in burial order: per
-- queue, how many and the place of its first (so the caller can list queues in order).
CREATE FUNCTION wq.requeue(p_now float8, p_id bigint, p_queue text)
RETURNS TABLE (o_queue text, o_first bigint, o_n bigint) LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := {_NOW};
    base bigint := nextval('wq.ord') * 1048576;
BEGIN
    RETURN QUERY
    WITH d AS (
        SELECT s.id, row_number() OVER (ORDER BY s.ord) AS rn FROM (
            SELECT t.id, t.ord FROM wq.tasks t WHERE t.state = 3
            AND (p_id IS NULL OR t.id = p_id) AND (p_queue IS NULL OR t.queue = p_queue)
            FOR UPDATE) s),
    upd AS (
        UPDATE wq.tasks t SET state = 0, attempts = 0, last_error = NULL, available_at = now_,
            ord = base + d.rn FROM d WHERE t.id = d.id RETURNING t.queue, d.rn),
    g AS (SELECT u.queue, min(u.rn) AS first, count(*) AS n FROM upd u GROUP BY u.queue),
    bump AS (
        INSERT INTO wq.counters AS k (slot, queue, requeued, dead, ready)
        SELECT pg_backend_pid(), g.queue, g.n, -g.n, g.n FROM g
        {_UPSERT})
    SELECT g.queue, g.first, g.n FROM g ORDER BY g.first;
END $$;

-- Tell the other brokers which queues have tasks ready. Its transaction commits without waiting
-- for the disk (a NOTIFY takes a transaction id, so its commit would otherwise wait for a flush of
-- the log: a lost announcement costs at most a poll, and this one is sent after the durable
-- commit of what it announces).
CREATE FUNCTION wq.announce(p_payload text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_notify('{CHANNEL}', p_payload);
END $$;

CREATE FUNCTION wq.purge(p_id bigint) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    DELETE FROM wq.tasks t WHERE t.id = p_id AND t.state = 3 RETURNING t.queue INTO q;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM wq.bump(q, {_d(purged=1, dead=-1)});
    RETURN true;
END $$;
"""

_SUMS: Final = ", ".join(f"coalesce(sum({c}), 0)::bigint" for c in _GAUGES + _TOTALS)
_STATS: Final = f"SELECT {_SUMS} FROM wq.counters"
_QUEUE_STATS: Final = f"SELECT {_SUMS} FROM wq.counters WHERE queue = $1"
_QUEUES: Final = (
    "SELECT q.name, q.paused, "
    + ", ".join(f"coalesce(sum(c.{g}), 0)::bigint" for g in _GAUGES)
    + " FROM wq.queues q LEFT JOIN wq.counters c ON c.queue = q.name GROUP BY q.name, q.paused"
)
# Every queue with its gauges and totals, and the earliest available_at among the heads of its
# priority lanes (one probe of tasks_ready per priority, only for a queue with ready tasks).
_REPORT: Final = f"""
SELECT q.name, q.paused, {_SUMS},
       CASE WHEN coalesce(sum(c.ready), 0) > 0 THEN (
           SELECT min(h.available_at) FROM generate_series(0, {PRIORITIES - 1}) AS p (n),
           LATERAL (SELECT t.available_at FROM wq.tasks t
                    WHERE t.state = 0 AND t.queue = q.name AND t.priority = p.n
                    ORDER BY t.ord LIMIT 1) h
       ) END
FROM wq.queues q LEFT JOIN wq.counters c ON c.queue = q.name GROUP BY q.name, q.paused
"""
_VIEW: Final = (
    "id, payload, attempts, max_attempts, created_at, available_at, last_error, queue, priority"
)
_LOOKUP: Final = f"SELECT {_VIEW}, state FROM wq.tasks WHERE id = $1"
_DEAD: Final = (
    f"SELECT {_VIEW} FROM wq.tasks WHERE state = 3 AND ($1::text IS NULL OR queue = $1) "
    "ORDER BY ord LIMIT $2"
)
_PAUSE: Final = (
    "INSERT INTO wq.queues AS q (name, paused) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE "
    "SET paused = excluded.paused WHERE q.paused <> excluded.paused"
)
_HELD: Final = "SELECT coalesce(sum(ready + handed_out + delayed), 0)::bigint FROM wq.counters"
_EXPIRED: Final = (
    "SELECT count(*) FROM wq.tasks WHERE state = 1 "
    "AND deadline <= coalesce($1, extract(epoch FROM clock_timestamp())::float8)"
)
_DB_NOW: Final = "SELECT extract(epoch FROM clock_timestamp())::float8"
# Whether ready tasks are left in these queues (not paused) after a claim came back short: rows
# it skipped because another transaction held them locked.
_READY_LEFT: Final = (
    "SELECT EXISTS (SELECT 1 FROM wq.tasks t WHERE t.state = 0 AND t.queue = ANY($1) "
    "AND NOT EXISTS (SELECT 1 FROM wq.queues p WHERE p.name = t.queue AND p.paused))"
)
# How long after such a claim the queues are looked at again.
LOOK_AGAIN_AFTER: Final = 0.05
# Every function of the schema, to drop before an upgrade recreates them.
_OUR_FUNCTIONS: Final = (
    "SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p "
    "JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'wq'"
)
_WIPE: Final = (
    "DELETE FROM wq.tasks; DELETE FROM wq.counters; DELETE FROM wq.queues; DELETE FROM wq.keys; "
    "ALTER SEQUENCE wq.ord RESTART; ALTER SEQUENCE wq.id_blocks RESTART"
)
# Gauges that disagree with the tasks (for the tests): one row per (queue, gauge, kept, counted).
_CHECK: Final = """
SELECT c.queue, c.ready, c.handed_out, c.delayed, c.dead,
       coalesce(t.ready, 0), coalesce(t.handed_out, 0), coalesce(t.delayed, 0), coalesce(t.dead, 0)
FROM (SELECT queue, sum(ready) ready, sum(handed_out) handed_out, sum(delayed) delayed,
             sum(dead) dead FROM wq.counters GROUP BY queue) c
FULL JOIN (SELECT queue, count(*) FILTER (WHERE state = 0) ready,
                  count(*) FILTER (WHERE state = 1) handed_out,
                  count(*) FILTER (WHERE state = 2) delayed,
                  count(*) FILTER (WHERE state = 3) dead FROM wq.tasks GROUP BY queue) t
USING (queue)
"""

_UNREACHABLE: Final = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    # A pooled connection whose server side was killed can be left in a state where asyncpg
    # refuses to use it ("cannot switch to state ..."): it is replaced like a lost one.
    asyncpg.InternalClientError,
)


def _key(n: int) -> int:
    """A task id (64 bits, unsigned) as the table's key (bigint)."""
    return n - _OFFSET


def _hex(key: int) -> str:
    return hex_id(key + _OFFSET)


def _task(row: Any, skew: float) -> Task:
    """A view from a row as _VIEW lists the columns (times in the broker's clock: minus
    ``skew``, how far the database's clock is ahead)."""
    error = row[6]
    if error is not None:
        error = bytes(error).decode("utf-8", "surrogatepass")
    return Task(
        _hex(row[0]),
        row[1],
        row[2],
        row[3],
        row[4] - skew,
        row[5] - skew,
        error,
        row[7],
        row[8],
    )


def _encode(error: str | None) -> bytes | None:
    return None if error is None else error.encode("utf-8", "surrogatepass")


def redact(dsn: str) -> str:
    """The DSN without its password, for messages."""
    parts = urllib.parse.urlsplit(dsn)
    if parts.password is None:
        return dsn
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class PostgresStore:
    """Open with :meth:`open` (it creates or checks the schema); close with :meth:`close`."""

    never_suspends = False  # every call waits for the database
    shared = True  # other brokers change the same tasks

    def __init__(
        self,
        dsn: str,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        *,
        pool_size: int = POOL_SIZE,
        db_clock: bool = False,
    ) -> None:
        rng = rng if rng is not None else random.Random()
        self.dsn = dsn
        self.db_clock = db_clock
        self._backoff = backoff if backoff is not None else Backoff(rng=rng)
        self._rng = rng
        self._pool_size = pool_size
        self._pool: asyncpg.Pool | None = None
        self._id_key = 0
        self._ids: list[int] = []  # numbers reserved for ids, not yet used (last first)
        self._failed: str | None = None
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
        self._enqueues = _Grouped(self._enqueue_group)
        self._settles = _Grouped(self._settle_group)
        self._claims = _Grouped(self._claim_group, self._unclaim)
        self._side_tasks: set[asyncio.Task[None]] = set()  # hand-backs, second looks (kept alive)
        # Wake-ups between brokers: queues with tasks made ready here, to announce (one NOTIFY in
        # flight at a time, carrying every queue gathered meanwhile); who to tell when another
        # broker announces some.
        self._me = f"{rng.getrandbits(64):016x}"  # tells our own announcements apart
        self._to_announce: set[str] = set()
        self._announcer: asyncio.Task[None] | None = None
        self._ready_elsewhere: Callable[[Iterable[str] | None], None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()
        self._recovery: asyncio.Task[None] | None = None
        self._listens = 0  # LISTENs made (the first at open, then one per reconnection)
        # Brokers listening, this one included, as of the last sweep (None: not known yet). With
        # no other, there is nobody to announce anything to.
        self._listeners: int | None = None
        self._hello_at = 0.0  # when another broker last said it started listening (monotonic)
        self._inline_after = 0.0  # when an enqueue may next carry its announcement (monotonic)
        self._vacuum: asyncio.Task[None] | None = None
        self.vacuums = 0  # tables vacuumed by this broker (for the tests)
        self.announcements = 0  # NOTIFYs sent (for the tests)

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
    ) -> PostgresStore:
        """Connect, create or check the schema, start listening to other brokers. With
        ``db_clock``, every time is the database's (``clock``, the broker's, is compared with it
        to translate)."""
        store = cls(dsn, backoff, rng, pool_size=pool_size, db_clock=db_clock)
        where = redact(dsn)
        try:
            pool = await asyncpg.create_pool(
                dsn,
                min_size=1,
                max_size=pool_size,
                timeout=10,
                command_timeout=60,
                reset=_as_it_is,
            )
        except (*_UNREACHABLE, asyncpg.PostgresError, ValueError) as e:
            raise StoreError(f"cannot connect to {where}: {_one_line(e)}") from None
        store._pool = pool
        try:
            async with pool.acquire() as conn:
                await store._prepare(conn)
                if db_clock and clock is not None:
                    before = clock.now()
                    db_now = float(await conn.fetchval(_DB_NOW))
                    store.skew = db_now - (before + clock.now()) / 2
        except ValueError as e:
            await pool.close()
            raise StoreError(f"{where} is refused: {e}") from None
        except (*_UNREACHABLE, asyncpg.PostgresError) as e:
            await pool.close()
            raise StoreError(f"cannot use {where}: {_one_line(e)}") from None
        store._listener = asyncio.get_running_loop().create_task(
            store._listen(), name="wq-postgres-listener"
        )
        # Wait (briefly) for the first LISTEN, so that a broker that answers has heard everything
        # announced since; if it fails, the listener keeps trying and polling covers the gap.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(store._listening.wait(), 10)
        log.info("opened %s (wq schema version %d)", where, SCHEMA_VERSION)
        return store

    async def _prepare(self, conn: _Conn) -> None:
        """Create the schema, upgrade it or check its version, under an advisory lock (brokers
        starting together wait for each other); read the id key."""
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_KEY)
            version = await _schema_version(conn)
            if version is None:
                await conn.execute(_TABLES)
                await conn.execute(_FUNCTIONS)
                await conn.execute(
                    "INSERT INTO wq.meta VALUES ('schema', $1), ('id_key', $2)",
                    str(SCHEMA_VERSION),
                    str(self._rng.getrandbits(64)),
                )
                log.info("created the wq schema (version %d)", SCHEMA_VERSION)
            elif version > SCHEMA_VERSION:
                raise ValueError(
                    f"schema version {version} is not one this broker knows (it knows up to "
                    f"{SCHEMA_VERSION}): was it written by a newer wq?"
                )
            elif version < SCHEMA_VERSION:
                await _upgrade(conn, version)
            id_key = await conn.fetchval("SELECT value FROM wq.meta WHERE key = 'id_key'")
        self._id_key = int(id_key)
        self._queue_names = {name for (name,) in await conn.fetch("SELECT name FROM wq.queues")}
        self._held = int(await conn.fetchval(_HELD))

    # -- between brokers ---------------------------------------------------------------------

    def on_ready(self, callback: Callable[[Iterable[str] | None], None]) -> None:
        """Call ``callback(queues)`` when tasks became ready in ``queues`` without this broker
        making them so: another broker announced them, or a claim promoted delayed tasks. None
        means any queue: after the database or the listening connection came back, when
        announcements may have been missed."""
        self._ready_elsewhere = callback

    def _tell(self, queues: Iterable[str] | None) -> None:
        if self._ready_elsewhere is not None and not self._closed:
            self._ready_elsewhere(queues)

    def _announce(self, queues: Iterable[str]) -> None:
        """Tell the other brokers these queues have tasks ready (NOTIFY, after the commit: a
        NOTIFY inside every changing transaction would serialize the commits on the database's
        notification lock)."""
        if not self._others_listen():
            return
        self._to_announce.update(queues)
        if self._to_announce and self._announcer is None and not self._closed:
            self._announcer = asyncio.get_running_loop().create_task(self._send_announcements())

    def _others_listen(self) -> bool:
        """Whether another broker may be listening (as of the last sweep, or a hello since)."""
        return self._listeners is None or self._listeners > self._listening.is_set()

    def _payload(self, queues: Iterable[str]) -> str:
        payload = self._me + "\n" + "\n".join(sorted(queues))
        if len(payload) > 7000:  # NOTIFY payloads stop at 8000 bytes: say "any queue"
            payload = self._me + "\n*"
        return payload

    async def _send_announcements(self) -> None:
        try:
            while self._to_announce and not self._closed and self._pool is not None:
                queues, self._to_announce = self._to_announce, set()
                payload = self._payload(queues)
                try:
                    await self._pool.execute("SELECT wq.announce($1)", payload)
                    self.announcements += 1
                except (*_UNREACHABLE, asyncpg.PostgresError) as e:
                    # The others poll (and re-check everything when they reconnect).
                    log.debug("could not announce ready queues: %s", _one_line(e))
                    return
        finally:
            self._announcer = None

    def _heard(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        sender, _, body = str(payload).partition("\n")
        if sender == self._me:
            return
        if body == _HELLO:
            # Another broker listens now: announce again (a count from a sweep that began
            # before this is out of date).
            self._listeners = None
            self._hello_at = time.monotonic()
            return
        self._tell(None if body == "*" else body.split("\n"))

    async def _listen(self) -> None:
        """Keep a connection LISTENing for other brokers' announcements: reconnect with backoff
        when it is lost, and then re-check every queue (announcements may have been missed)."""
        delay = RETRY_FIRST
        while not self._closed:
            try:
                conn = await asyncpg.connect(
                    self.dsn, timeout=5, server_settings={"application_name": LISTENER_NAME}
                )
            except (*_UNREACHABLE, asyncpg.PostgresError) as e:
                log.debug("listener: cannot connect (%s); again in %.2f s", _one_line(e), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_CAP)
                continue
            delay = RETRY_FIRST
            try:
                await self._hear_on(conn)
            except Exception:  # whatever it was, listen again (the polls cover the gap)
                log.exception("the listening connection failed; listening again")
                await asyncio.sleep(RETRY_CAP)
            finally:
                self._listening.clear()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(), 1)

    async def _hear_on(self, conn: asyncpg.Connection) -> None:
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _c: lost.set())
        try:
            await conn.add_listener(CHANNEL, self._heard)
        except (*_UNREACHABLE, asyncpg.PostgresError):
            return
        self._listens += 1
        self._listening.set()
        with contextlib.suppress(*_UNREACHABLE, asyncpg.PostgresError):
            await conn.execute("SELECT wq.announce($1)", f"{self._me}\n{_HELLO}")
        if self._failed is not None:
            await self._recovered()
        elif self._listens > 1:
            self._tell(None)
        while not lost.is_set() and not self._closed:
            # A connection that died quietly (a network cut) is found by a ping now and then.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lost.wait(), 5)
                return
            try:
                await conn.fetchval("SELECT 1", timeout=5)
            except (*_UNREACHABLE, asyncpg.PostgresError):
                return

    async def _recovered(self) -> None:
        """The database answers again: forget the failure, drop connections made before it,
        and re-check for ready work (announcements may have been missed)."""
        if self._failed is None:
            return
        log.warning("the database is reachable again")
        self._failed = None
        if self._pool is not None:
            await self._pool.expire_connections()
        self._tell(None)

    async def _recover(self) -> None:
        """While the database is unreachable, try it with backoff until it answers."""
        delay = RETRY_FIRST
        try:
            while self._failed is not None and not self._closed and self._pool is not None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_CAP)
                try:
                    await self._pool.fetchval("SELECT 1", timeout=5)
                except (*_UNREACHABLE, asyncpg.PostgresError):
                    continue
                await self._recovered()
        finally:
            self._recovery = None

    # -- the contract ------------------------------------------------------------------------

    async def enqueue_many(self, items: Sequence[NewTask], *, now: float) -> list[Enqueued]:
        if not items:
            return []
        return await self._enqueues.call(items, self._group_key(now))

    async def _enqueue_group(
        self, calls: list[Sequence[NewTask]], now: float
    ) -> list[list[Enqueued]]:
        """The enqueues of several calls in one transaction; each call's answers."""
        items = [t for call in calls for t in call] if len(calls) > 1 else calls[0]
        out = await self._enqueue(items, now)
        return _split(out, [len(call) for call in calls])

    async def _enqueue(self, items: Sequence[NewTask], now: float) -> list[Enqueued]:
        ids = await self._new_ids(len(items))
        # Now and then (an idle broker: every time) the announcement of these tasks goes with
        # their commit, and the other brokers hear of them a round trip sooner. Not more often:
        # a transaction that notifies holds the database's notification lock through its
        # commit's flush to disk, and busy brokers would queue on it.
        notify = None
        started = time.monotonic()
        if started >= self._inline_after and self._announcer is None and self._others_listen():
            queues = {t.queue for t in items if t.delay <= 0}
            if queues:
                notify = self._payload(queues)
                self._inline_after = started + _INLINE_GAP
        rows = await self._fetch(
            "SELECT * FROM wq.enqueue($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            self._now(now),
            [_key(n) for n in ids],
            [t.queue for t in items],
            [t.priority for t in items],
            [t.payload for t in items],
            [t.max_attempts for t in items],
            [t.delay for t in items],
            [t.key for t in items],
            [t.key_until + self.skew for t in items],
            notify,
        )
        out: list[Enqueued] = []
        skew = self.skew
        ready: set[str] = set()
        for i, key, duplicate, at, available in rows:
            task_id = _hex(key)
            if duplicate:
                out.append(Enqueued(task_id, True, None))
                continue
            t = items[i - 1]
            self._queue_names.add(t.queue)
            self._held += 1
            if t.key is not None:
                self._keys[(t.queue, t.key)] = t.key_until
            if t.delay <= 0:
                ready.add(t.queue)
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
            )
            out.append(Enqueued(task_id, False, task))
        if any(not e.duplicate for e in out):
            self.transactions += 1
        if notify is not None:
            self.announcements += 1
        elif ready:
            self._announce(ready)
        return out

    async def _new_ids(self, n: int) -> list[int]:
        """``n`` fresh task ids (reserving blocks of numbers from the database as needed)."""
        if len(self._ids) < n:
            blocks = (n - len(self._ids) + _ID_BLOCK - 1) // _ID_BLOCK
            rows = await self._fetch(
                "SELECT nextval('wq.id_blocks') FROM generate_series(1, $1)", blocks
            )
            fresh = [b * _ID_BLOCK + j for (b,) in rows for j in range(_ID_BLOCK)]
            self._ids[:0] = reversed(fresh)
        taken = [self._ids.pop() for _ in range(n)]
        return [_mix((x + self._id_key) & _MASK) for x in taken]

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
        lease_ids = ["%016x" % self._rng.getrandbits(64) for _ in leases]  # noqa: UP031
        rows = await self._fetch(
            "SELECT * FROM wq.claim($1, $2, $3, $4)", self._now(now), leases, lease_ids, queues
        )
        skew = self.skew
        got: dict[int, Delivery] = {}
        promoted: list[str] = []
        for row in rows:
            if row[0] is None:
                promoted.append(row[8])
            else:
                i = row[0] - 1
                got[i] = Delivery(_task(row[1:10], skew), lease_ids[i], row[10] - skew)
        if got or promoted:
            self.transactions += 1
        if promoted:  # for the others, and for this broker's consumers of other queues
            self._announce(promoted)
            self._tell(promoted)
        if len(got) < len(leases):
            self._spawn(self._look_again(queues))
        out: list[list[Delivery]] = []
        at = 0
        for call in calls:
            out.append([got[i] for i in range(at, at + len(call)) if i in got])
            at += len(call)
        return out

    async def _look_again(self, queues: tuple[str, ...]) -> None:
        """After a claim that came back short: if ready tasks are left in its queues, they were
        locked when it looked (claims skip locked rows), and may be free a moment later. Rows
        stay locked until their transaction ends even when it does not take them: another
        broker's sweep or claim that met a task just promoted re-checks it, locked. Nobody
        announces such a task again, so this broker's consumers are told to look again."""
        with contextlib.suppress(StoreError):
            if await self._fetchval(_READY_LEFT, list(queues)):
                loop = asyncio.get_running_loop()
                loop.call_later(LOOK_AGAIN_AFTER, self._tell, queues)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    def _unclaim(self, deliveries: list[Delivery]) -> None:
        """Hand back what was claimed for a caller that went away before it got it."""

        async def release() -> None:
            for d in deliveries:
                with contextlib.suppress(StoreError):
                    await self.release(d.task.id, d.lease_id)
            self._tell({d.task.queue for d in deliveries})  # this broker's consumers, too

        if deliveries:
            self._spawn(release())

    async def ack(self, task_id: str, lease_id: str, *, now: float) -> None:
        acked, _ = await self.settle_many(((task_id, lease_id),), (), now=now)
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
        _, nacked = await self._settle((), (item,), now, reclaim=True)
        return _raise_or(nacked[0])

    async def settle_many(
        self, acks: Sequence[tuple[str, str]], nacks: Sequence[NackItem], *, now: float
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        return await self._settles.call((acks, nacks), self._group_key(now))

    async def _settle_group(self, calls: list[_Settle], now: float) -> list[_Settled]:
        """The acks and nacks of several calls in one transaction; each call's outcomes."""
        if len(calls) == 1:
            return [await self._settle(*calls[0], now, reclaim=False)]
        acks = [a for call in calls for a in call[0]]
        nacks = [n for call in calls for n in call[1]]
        acked, nacked = await self._settle(acks, nacks, now, reclaim=False)
        return list(
            zip(
                _split(acked, [len(c[0]) for c in calls]),
                _split(nacked, [len(c[1]) for c in calls]),
                strict=True,
            )
        )

    async def _settle(
        self,
        acks: Sequence[tuple[str, str]],
        nacks: Sequence[NackItem],
        now: float,
        *,
        reclaim: bool,
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        acked: list[WqError | None] = [_not_held(t) for t, _ in acks]
        nacked: list[Failure | WqError] = [_not_held(n.task_id) for n in nacks]
        ack_at = [i for i, (t, _) in enumerate(acks) if parse_id(t) is not None]
        nack_at = [i for i, n in enumerate(nacks) if parse_id(n.task_id) is not None]
        if not ack_at and not nack_at:
            return acked, nacked
        sent = [nacks[i] for i in nack_at]
        # The random part of each backoff that may be needed (as the Backoff would draw it).
        us = [self._draw() if n.delay is None and not n.terminal else 0.0 for n in sent]
        rows = await self._fetch(
            "SELECT * FROM wq.settle($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
            self._now(now),
            [_key(int(acks[i][0], 16)) for i in ack_at],
            [acks[i][1] for i in ack_at],
            [_key(int(n.task_id, 16)) for n in sent],
            [n.lease_id for n in sent],
            [_encode(n.error) for n in sent],
            [n.delay for n in sent],
            [n.terminal for n in sent],
            us,
            reclaim,
            self._backoff.base,
            self._backoff.cap,
        )
        changed = False
        for kind, i, outcome, retry_at in rows:
            if kind == 0:
                task_id = acks[ack_at[i - 1]][0]
                acked[ack_at[i - 1]] = _outcome_error(outcome, task_id)
            else:
                task_id = sent[i - 1].task_id
                error = _outcome_error(outcome, task_id)
                if retry_at is not None:
                    retry_at -= self.skew
                nacked[nack_at[i - 1]] = (
                    error if error is not None else Failure(task_id, retry_at is None, retry_at)
                )
            if outcome == 0:
                changed = True
                if kind == 0 or retry_at is None:
                    self._held -= 1  # acked or buried
        if changed:
            self.transactions += 1
        return acked, nacked

    def _draw(self) -> float:
        rng = self._backoff.rng
        assert rng is not None
        return rng.random()

    async def extend(self, task_id: str, lease_id: str, *, lease: float, now: float) -> float:
        n = parse_id(task_id)
        if n is None:
            raise _not_held(task_id)
        row = await self._fetchrow(
            "SELECT * FROM wq.extend($1, $2, $3, $4)", self._now(now), _key(n), lease_id, lease
        )
        assert row is not None
        error = _outcome_error(row[0], task_id)
        if error is not None:
            raise error
        self.transactions += 1
        return float(row[1]) - self.skew

    async def release(self, task_id: str, lease_id: str) -> bool:
        n = parse_id(task_id)
        if n is None:
            return False
        queue = await self._fetchval("SELECT wq.release($1, $2)", _key(n), lease_id)
        if queue is None:
            return False
        self.transactions += 1
        self._announce((queue,))
        return True

    async def sweep(self, *, now: float) -> tuple[SweepResult, float | None]:
        entered = time.monotonic()
        when = self._now(now)
        expired = int(await self._fetchval(_EXPIRED, when) or 0)
        us = [self._draw() for _ in range(expired)]
        refresh = self._sweeps % _SWEEPS_PER_REFRESH == 0
        self._sweeps += 1
        started = time.monotonic()
        rows = await self._fetch(
            "SELECT * FROM wq.sweep($1, $2, $3, $4, $5)",
            when,
            us,
            self._backoff.base,
            self._backoff.cap,
            refresh,
        )
        took = time.monotonic() - started
        result = SweepResult()
        due, db_now = self._swept(rows, result, refresh, started)
        if self.db_clock and took < _SKEW_RTT:
            self.skew = db_now - (now + (started - entered) + took / 2)
        self._keys = {k: until for k, until in self._keys.items() if until > now}
        if result.reclaimed or result.promoted:
            self.transactions += 1
        if result.ready_queues:
            self._announce(result.ready_queues)
        if refresh:
            await self._execute("SELECT wq.fold()")
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
        for kind, key, lease_id, queue, n, at in rows:
            if kind == 0:
                result.reclaimed.append((_hex(key), lease_id))
            elif kind == 1:
                result.promoted += n
                result.ready_queues.add(queue)
            elif kind == 2:
                due = at
            elif kind == 5:
                db_now = at
            elif kind != 6 or started > self._hello_at:
                self._hint(kind, queue, n, at, names, dirty)
        if refresh:
            self._queue_names = names
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
        elif kind == 6:
            self._listeners = n
        elif kind == 7 and n > VACUUM_THRESHOLD + VACUUM_SCALE * x:
            dirty.append(name)

    async def _vacuum_tables(self, tables: list[str]) -> None:
        """VACUUM tables full of dead rows (acked tasks, old counter values), on a connection of
        its own: claims must not wade through dead index entries, whether or not the server's
        autovacuum is on. One broker at a time (an advisory lock); the others skip it."""
        try:
            conn = await asyncpg.connect(self.dsn, timeout=5)
        except (*_UNREACHABLE, asyncpg.PostgresError):
            self._vacuum = None
            return
        try:
            if await conn.fetchval("SELECT pg_try_advisory_lock($1)", _VACUUM_KEY):
                for table in tables:
                    await conn.execute(f"VACUUM wq.{table}")
                    self.vacuums += 1
                await conn.execute("SELECT pg_advisory_unlock($1)", _VACUUM_KEY)
        except (*_UNREACHABLE, asyncpg.PostgresError) as e:
            log.info("could not vacuum %s: %s", ", ".join(tables), _one_line(e))
        finally:
            self._vacuum = None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 1)

    async def requeue(self, task_id: str, *, now: float) -> str:
        n = parse_id(task_id)
        rows = []
        if n is not None:
            rows = await self._fetch(
                "SELECT * FROM wq.requeue($1, $2, NULL)", self._now(now), _key(n)
            )
        if not rows:
            raise NotFound(f"task {quoted(task_id)} is not in the dead-letter queue")
        self.transactions += 1
        self._held += 1
        self._announce((rows[0][0],))
        return str(rows[0][0])

    async def requeue_all(self, *, queue: str | None = None, now: float) -> tuple[int, list[str]]:
        rows = await self._fetch("SELECT * FROM wq.requeue($1, NULL, $2)", self._now(now), queue)
        count = sum(int(r[2]) for r in rows)
        names = [str(r[0]) for r in rows]
        if rows:
            self.transactions += 1
            self._held += count
            self._announce(names)
        return count, names

    async def purge(self, task_id: str) -> None:
        n = parse_id(task_id)
        if n is None or not await self._fetchval("SELECT wq.purge($1)", _key(n)):
            raise NotFound(f"task {quoted(task_id)} is not in the dead-letter queue")
        self.transactions += 1

    async def set_paused(self, queue: str, paused: bool) -> None:
        status = await self._execute(_PAUSE, queue, paused)
        self._queue_names.add(queue)
        if not status.endswith(" 0"):
            self.transactions += 1
            if not paused:
                self._announce((queue,))

    async def stats(self, queue: str | None = None) -> Stats:
        if queue is None:
            row = await self._fetchrow(_STATS)
        else:
            row = await self._fetchrow(_QUEUE_STATS, queue)
        assert row is not None
        ready, handed_out, delayed, dead, *totals = row
        if queue is None:
            self._held = ready + handed_out + delayed
        return Stats(ready, handed_out, delayed, dead, Totals(*totals))

    async def queues(self) -> list[QueueStats]:
        rows = await self._fetch(_QUEUES)
        out = [QueueStats(r[0], r[2], r[3], r[4], r[5], r[1]) for r in rows]
        out.sort(key=lambda q: q.name)
        self._queue_names = {q.name for q in out}
        return out

    async def queue_report(self) -> list[QueueReport]:
        out = []
        for name, paused, ready, handed_out, delayed, dead, *rest in await self._fetch(_REPORT):
            *totals, oldest = rest
            out.append(
                QueueReport(
                    QueueStats(name, ready, handed_out, delayed, dead, paused),
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
        row = await self._fetchrow(_LOOKUP, _key(n))
        if row is None:
            return None
        return TaskState(_task(row, self.skew), STATE_NAMES[row[9]])

    async def dead_letters(
        self, *, limit: int | None = None, queue: str | None = None
    ) -> list[Task]:
        rows = await self._fetch(_DEAD, queue, limit)
        skew = self.skew
        return [_task(row, skew) for row in rows]

    def problem(self) -> str | None:
        if self._failed is not None:
            return f"the store is unavailable: {self._failed}"
        return None

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
        for task in (self._listener, self._recovery, self._vacuum):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._announcer is not None:  # the last announcement goes out
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._announcer), 1)
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    # -- for the tests -----------------------------------------------------------------------

    async def wipe(self) -> None:
        """Drop every task, queue, key and counter, and start ids over (the tests start each
        store empty, and give the same ids to the same steps)."""
        await self._execute(_WIPE)
        self._ids.clear()
        self._queue_names.clear()
        self._held = 0
        self._keys.clear()

    async def check_invariants(self) -> None:
        """Assert the gauges kept in the counters agree with the tasks, queue by queue."""
        for row in await self._fetch(_CHECK):
            kept, counted = tuple(row[1:5]), tuple(row[5:9])
            assert kept == counted, f"queue {row[0]}: gauges {kept} but tasks {counted}"

    # -- talking to the database -------------------------------------------------------------

    def _now(self, now: float) -> float | None:
        return None if self.db_clock else now

    def _group_key(self, now: float) -> float:
        """What calls must share to go in one transaction: their ``now``, unless the database's
        clock is used (then any calls go together)."""
        return 0.0 if self.db_clock else now

    def _ready_pool(self) -> asyncpg.Pool:
        if self._closed or self._pool is None:
            raise StoreError("the store is closed")
        if self._failed is not None:
            # Fail fast while the database is away (the recovery task tries it with backoff):
            # clients get their 503 at once instead of waiting for a connection to time out.
            raise StoreError(self._failed)
        return self._pool

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        pool = self._ready_pool()
        try:
            return await pool.fetch(sql, *args)
        except _UNREACHABLE as e:
            raise self._unreachable(e) from None
        except asyncpg.PostgresError as e:
            raise _failed(e) from None

    async def _fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        rows = await self._fetch(sql, *args)
        return rows[0] if rows else None

    async def _fetchval(self, sql: str, *args: Any) -> Any:
        row = await self._fetchrow(sql, *args)
        return row[0] if row is not None else None

    async def _execute(self, sql: str, *args: Any) -> str:
        pool = self._ready_pool()
        try:
            return await pool.execute(sql, *args)
        except _UNREACHABLE as e:
            raise self._unreachable(e) from None
        except asyncpg.PostgresError as e:
            raise _failed(e) from None

    def _unreachable(self, error: BaseException) -> StoreError:
        if self._failed is None:
            self._failed = f"the database is unreachable: {_one_line(error)}"
            log.warning("%s (retrying with backoff)", self._failed)
            if self._recovery is None and not self._closed:
                self._recovery = asyncio.get_running_loop().create_task(self._recover())
        return StoreError(self._failed)


_Settle = tuple[Sequence[tuple[str, str]], Sequence[NackItem]]
_Settled = tuple[list[WqError | None], list[Failure | WqError]]
X = TypeVar("X")
K = TypeVar("K")
Y = TypeVar("Y")


class _Grouped(Generic[X, K, Y]):
    """Calls of one kind, grouped by key: a call made while another with its key is in flight
    waits, and goes with every other that came meanwhile with that key, in one call of ``run``.
    One in flight per key (calls with different keys, such as claims for different queues, do
    not wait for each other). A waiting call cancelled before its group ran still runs;
    ``orphaned`` gets what it would have returned (to undo it)."""

    def __init__(
        self,
        run: Callable[[list[X], K], Awaitable[list[Y]]],
        orphaned: Callable[[Y], None] | None = None,
    ) -> None:
        self._run = run
        self._orphaned = orphaned
        self._waiting: dict[K, list[tuple[X, asyncio.Future[Y]]]] = {}
        self._busy: set[K] = set()
        self._running: set[asyncio.Task[None]] = set()  # (the loop keeps only weak references)

    async def call(self, arg: X, key: K) -> Y:
        if key not in self._busy:
            self._busy.add(key)
            try:
                (out,) = await self._run([arg], key)
            finally:
                self._busy.discard(key)
                self._next(key)
            return out
        waiter: asyncio.Future[Y] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append((arg, waiter))
        return await waiter

    def _next(self, key: K) -> None:
        if key in self._waiting and key not in self._busy:
            self._busy.add(key)
            task = asyncio.get_running_loop().create_task(self._run_waiting(key))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run_waiting(self, key: K) -> None:
        try:
            group = self._waiting.pop(key)
            try:
                outs = await self._run([arg for arg, _ in group], key)
            except BaseException as e:
                error = e if isinstance(e, Exception) else StoreError("the store is closed")
                for _, waiter in group:
                    if not waiter.done():
                        waiter.set_exception(error)
                if error is not e:
                    raise
                return
            for (_, waiter), out in zip(group, outs, strict=True):
                if not waiter.done():
                    waiter.set_result(out)
                elif self._orphaned is not None:
                    self._orphaned(out)
        finally:
            self._busy.discard(key)
            self._next(key)


def _split(values: list[Y], sizes: list[int]) -> list[list[Y]]:
    """``values`` cut into consecutive pieces of ``sizes``."""
    out: list[list[Y]] = []
    at = 0
    for n in sizes:
        out.append(values[at : at + n])
        at += n
    return out


async def _as_it_is(_conn: asyncpg.Connection) -> None:
    """How a connection goes back to the pool: as it is. (asyncpg's default resets its session
    state with a query, a second round trip for every call; the store leaves no session state:
    no SET but SET LOCAL, no session locks, no LISTEN on these connections.)"""


def _failed(error: asyncpg.PostgresError) -> StoreError:
    """The database refused a call (it is shutting down, out of space, was terminated...)."""
    return StoreError(f"the database failed: {_one_line(error)}")


async def _upgrade(conn: _Conn, version: int) -> None:
    """Bring a schema of an older version up to this one (inside the caller's transaction).
    Every function is recreated."""
    if version < 2:
        await conn.execute("CREATE INDEX IF NOT EXISTS keys_until ON wq.keys (until)")
    for (name,) in await conn.fetch(_OUR_FUNCTIONS):
        await conn.execute(f"DROP FUNCTION {name}")
    await conn.execute(_FUNCTIONS)
    await conn.execute("UPDATE wq.meta SET value = $1 WHERE key = 'schema'", str(SCHEMA_VERSION))
    log.info("upgraded the wq schema from version %d to %d", version, SCHEMA_VERSION)


async def _schema_version(conn: _Conn) -> int | None:
    """The database's wq schema version; None for a database without tables. ValueError if it
    holds other tables and no wq schema."""
    if await conn.fetchval("SELECT to_regclass('wq.meta')") is not None:
        found = await conn.fetchval("SELECT value FROM wq.meta WHERE key = 'schema'")
        if found is None or not str(found).isdigit():
            raise ValueError("not a wq database: its wq.meta table has no schema version")
        return int(found)
    others = await conn.fetchval(
        "SELECT count(*) FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
        "ON n.oid = c.relnamespace WHERE c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f') "
        "AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
        "AND n.nspname NOT LIKE 'pg\\_%'"
    )
    if others:
        raise ValueError("not a wq database: it holds other tables and no wq schema version")
    return None


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


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
