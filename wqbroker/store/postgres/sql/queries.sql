-- The statements the PostgreSQL store runs, each under "-- name: NAME" (queries.py reads them
-- when the package loads, as the fields of queries.Queries; a name missing here, or one it does
-- not know, stops the import). Whatever a client sends is a parameter ($1, $2 ...), never part of
-- the text.
-- Columns are listed in the order the Python side reads them: gauges (ready, handed_out, delayed,
-- dead), then totals in the order of wqbroker.models.Totals, then the gauges of
-- docs/design/results.md (waiting, succeeded).

-- == the operations: one round trip each (sql/functions.sql) ==

-- name: enqueue
SELECT * FROM wq.enqueue($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
    $17, $18, $19, $20)

-- name: id_blocks
-- $1 blocks of 1024 numbers for task ids.
SELECT nextval('wq.id_blocks') FROM generate_series(1, $1)

-- name: skip_ids
-- The blocks' sequence moved 2^20 blocks ahead, before a store's first reservation after it
-- opened or the database came back: a standby promoted under asynchronous replication may not
-- have had the last reservations of the old primary, and would hand those blocks out again (the
-- ids of tasks lost with it, given to new tasks). One store at a time (a transaction-scoped
-- advisory lock, 0x777100000003), so that no two read the same value and one sets it back;
-- nextval needs no lock: setval only moves the sequence forward past whatever it handed out.
SELECT pg_advisory_xact_lock(131327215009795);
SELECT setval('wq.id_blocks', last_value + 1048576) FROM wq.id_blocks

-- name: claim
SELECT * FROM wq.claim($1, $2, $3, $4, $5)

-- name: settle
SELECT * FROM wq.settle($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)

-- name: settle_claim
-- wq.settle, then wq.claim, in one statement (one round trip, one transaction): a stream's acks
-- and the tasks that take their places. The first column says which rows are which (0: settle's,
-- 1: claim's); UNION ALL runs its parts in order. $14: the head of the announcement of watched
-- tasks that end (both functions' own).
SELECT 0 AS part, s.o_kind, s.o_i, s.o_outcome, s.o_retry_at, s.o_id, s.o_queue,
    NULL::bigint, NULL::bigint, NULL::bytea, NULL::int, NULL::int, NULL::float8, NULL::float8,
    NULL::bytea, NULL::text, NULL::smallint, NULL::float8, NULL::float8, NULL::float8,
    NULL::float8, NULL::bigint[], NULL::bytea[], NULL::int, NULL::text, NULL::float8
FROM wq.settle($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) s
UNION ALL
SELECT 1, NULL, NULL, NULL, NULL, NULL, NULL, c.*
FROM wq.claim($1, $15, $16, $17, $14) c

-- name: extend
SELECT * FROM wq.extend($1, $2, $3, $4, $5)

-- name: release
SELECT * FROM wq.release($1, $2, $3, $4)

-- name: expired
-- How many leases have run out by $1 (NULL: by the database's clock): the sweep draws as many
-- random parts of backoff delays. (As wq.clock, spelt out: this runs on any database of this
-- schema version, whichever build made its functions.)
SELECT count(*) FROM wq.tasks WHERE state = 1
AND deadline <= coalesce($1, extract(epoch FROM clock_timestamp())::float8)

-- name: sweep
SELECT * FROM wq.sweep($1, $2, $3, $4, $5, $6)

-- name: fold
SELECT wq.fold()

-- name: requeue
-- One dead task ($2), or every dead task (of queue $3, or of all).
SELECT * FROM wq.requeue($1, $2, $3)

-- name: purge
SELECT wq.purge($1)

-- name: cancel
-- Task $1; $2: the head of the announcement of its lease, if it is handed out (NULL: none); $3:
-- of the watched tasks that end; $4: the time of the call (NULL: the database's clock).
SELECT * FROM wq.cancel($1, $2, $3, $4)

-- name: empty
SELECT * FROM wq.empty($1, $2, $3)

-- name: delete_queue
SELECT * FROM wq.delete_queue($1)

-- name: pause
INSERT INTO wq.queues AS q (name, paused) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE
SET paused = excluded.paused WHERE q.paused <> excluded.paused

-- name: set_limits
-- Queue $1's limits (docs/design/schedules.md; the queue made if new): $2 hand-outs per $3
-- seconds from a bucket of $4 tokens, at most $5 handed out at once (NULL: no such limit). The
-- bucket starts full at $6 (NULL: the database's clock) when the rate is set or changed, and goes
-- on as it stood when only the concurrency changes. (Waits for the claims that hold the row.)
INSERT INTO wq.queues AS q (name, rate_tasks, rate_per, rate_burst, concurrency, tokens,
    refilled_at)
VALUES ($1, $2::int, $3::float8, $4::int, $5::int, $4::int, wq.clock($6::float8))
ON CONFLICT (name) DO UPDATE SET rate_tasks = excluded.rate_tasks,
    rate_per = excluded.rate_per, rate_burst = excluded.rate_burst,
    concurrency = excluded.concurrency,
    tokens = CASE WHEN (q.rate_tasks, q.rate_per, q.rate_burst) IS NOT DISTINCT FROM
                       (excluded.rate_tasks, excluded.rate_per, excluded.rate_burst)
                  THEN q.tokens ELSE excluded.tokens END,
    refilled_at = CASE WHEN (q.rate_tasks, q.rate_per, q.rate_burst) IS NOT DISTINCT FROM
                            (excluded.rate_tasks, excluded.rate_per, excluded.rate_burst)
                       THEN q.refilled_at ELSE excluded.refilled_at END
WHERE (q.rate_tasks, q.rate_per, q.rate_burst, q.concurrency) IS DISTINCT FROM
      (excluded.rate_tasks, excluded.rate_per, excluded.rate_burst, excluded.concurrency)

-- == schedules (docs/design/schedules.md) ==
-- A schedule's columns, in the order store.py's _schedule reads them: name, the rule (cron,
-- timezone, every), the task (queue, payload, priority, max_attempts, expires_in, timeout,
-- result_ttl), paused, created_at, updated_at, next_fire_at, last_fire_at, last_task_id, fires,
-- revision.

-- name: put_schedule
-- Schedule $1 inserted, or replaced: a replace keeps created_at, fires, last_fire_at and
-- last_task_id, and next_fire_at when both are not paused and the rule is the same ($14 is for a
-- new rule; NULL for a paused one); one the same as stored (rule, task, paused) is left as it
-- stands (the conflict's WHERE). Every write draws a revision. The row as it then stands.
WITH put AS (
    INSERT INTO wq.schedules AS s (name, cron, timezone, every, queue, payload, priority,
        max_attempts, expires_in, timeout, result_ttl, paused, created_at, updated_at,
        next_fire_at, last_fire_at, last_task_id, fires, revision)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $13, $14, NULL, NULL, 0,
        nextval('wq.schedule_revisions'))
    ON CONFLICT (name) DO UPDATE SET cron = excluded.cron, timezone = excluded.timezone,
        every = excluded.every, queue = excluded.queue, payload = excluded.payload,
        priority = excluded.priority, max_attempts = excluded.max_attempts,
        expires_in = excluded.expires_in, timeout = excluded.timeout,
        result_ttl = excluded.result_ttl, paused = excluded.paused,
        updated_at = excluded.updated_at, revision = excluded.revision,
        next_fire_at = CASE
            WHEN NOT s.paused AND NOT excluded.paused AND s.cron IS NOT DISTINCT FROM excluded.cron
                 AND s.timezone = excluded.timezone AND s.every IS NOT DISTINCT FROM excluded.every
            THEN s.next_fire_at ELSE excluded.next_fire_at END
    WHERE (s.cron, s.timezone, s.every, s.queue, s.payload, s.priority, s.max_attempts,
           s.expires_in, s.timeout, s.result_ttl, s.paused)
        IS DISTINCT FROM (excluded.cron, excluded.timezone, excluded.every, excluded.queue,
           excluded.payload, excluded.priority, excluded.max_attempts, excluded.expires_in,
           excluded.timeout, excluded.result_ttl, excluded.paused)
    RETURNING name, cron, timezone, every, queue, payload, priority, max_attempts, expires_in,
        timeout, result_ttl, paused, created_at, updated_at, next_fire_at, last_fire_at,
        last_task_id, fires, revision)
SELECT name, cron, timezone, every, queue, payload, priority, max_attempts, expires_in, timeout,
       result_ttl, paused, created_at, updated_at, next_fire_at, last_fire_at, last_task_id, fires,
       revision
FROM put
UNION ALL
SELECT name, cron, timezone, every, queue, payload, priority, max_attempts, expires_in, timeout,
       result_ttl, paused, created_at, updated_at, next_fire_at, last_fire_at, last_task_id, fires,
       revision
FROM wq.schedules WHERE name = $1 AND NOT EXISTS (SELECT 1 FROM put)

-- name: get_schedule
SELECT name, cron, timezone, every, queue, payload, priority, max_attempts, expires_in, timeout,
       result_ttl, paused, created_at, updated_at, next_fire_at, last_fire_at, last_task_id, fires,
       revision
FROM wq.schedules WHERE name = $1

-- name: schedule_count
SELECT count(*) FROM wq.schedules

-- name: list_schedules
SELECT name, cron, timezone, every, queue, payload, priority, max_attempts, expires_in, timeout,
       result_ttl, paused, created_at, updated_at, next_fire_at, last_fire_at, last_task_id, fires,
       revision
FROM wq.schedules ORDER BY name

-- name: delete_schedule
DELETE FROM wq.schedules WHERE name = $1

-- name: pause_schedule
-- Schedule $1 paused ($2 true: next_fire_at $3 NULL) or resumed (next_fire_at $3), at $4; one
-- already so is left as it stands. The row as it then stands (none: no such schedule).
WITH up AS (
    UPDATE wq.schedules SET paused = $2, next_fire_at = $3, updated_at = $4,
        revision = nextval('wq.schedule_revisions')
    WHERE name = $1 AND paused <> $2
    RETURNING name, cron, timezone, every, queue, payload, priority, max_attempts, expires_in,
        timeout, result_ttl, paused, created_at, updated_at, next_fire_at, last_fire_at,
        last_task_id, fires, revision)
SELECT name, cron, timezone, every, queue, payload, priority, max_attempts, expires_in, timeout,
       result_ttl, paused, created_at, updated_at, next_fire_at, last_fire_at, last_task_id, fires,
       revision
FROM up
UNION ALL
SELECT name, cron, timezone, every, queue, payload, priority, max_attempts, expires_in, timeout,
       result_ttl, paused, created_at, updated_at, next_fire_at, last_fire_at, last_task_id, fires,
       revision
FROM wq.schedules WHERE name = $1 AND NOT EXISTS (SELECT 1 FROM up)

-- name: due_schedules
-- The time: $1, or (NULL) the database's clock (as wq.clock, spelt out); the earliest next fire
-- of the schedules not yet due (NULL: none); then the columns of each due schedule (not paused,
-- next_fire_at at or before the time), earliest first (none due: one row, its columns NULL).
-- Two probes of schedules_due: its cost is what is due.
WITH c AS (SELECT coalesce($1, extract(epoch FROM clock_timestamp())::float8) AS t)
SELECT c.t,
       (SELECT min(x.next_fire_at) FROM wq.schedules x
        WHERE NOT x.paused AND x.next_fire_at IS NOT NULL AND x.next_fire_at > c.t),
       s.name, s.cron, s.timezone, s.every, s.queue, s.payload, s.priority, s.max_attempts,
       s.expires_in, s.timeout, s.result_ttl, s.paused, s.created_at, s.updated_at,
       s.next_fire_at, s.last_fire_at, s.last_task_id, s.fires, s.revision
FROM c LEFT JOIN wq.schedules s
ON NOT s.paused AND s.next_fire_at IS NOT NULL AND s.next_fire_at <= c.t
ORDER BY s.next_fire_at

-- name: fire
-- A schedule's fire (wq.fire): $1 name, $2 the next_fire_at and $3 the revision expected, $4 its
-- scheduled time, $5 the next one, then wq.enqueue's first sixteen arguments (one task).
SELECT * FROM wq.fire($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
    $17, $18, $19, $20, $21)

-- name: skip_schedule
-- A fire the broker refused: schedule $1 moved to $4 only if its next_fire_at is $2 and its
-- revision $3, and it is not paused.
UPDATE wq.schedules SET next_fire_at = $4
WHERE name = $1 AND next_fire_at = $2 AND revision = $3 AND NOT paused

-- == reads ==

-- name: stats
SELECT coalesce(sum(ready), 0)::bigint, coalesce(sum(handed_out), 0)::bigint,
       coalesce(sum(delayed), 0)::bigint, coalesce(sum(dead), 0)::bigint,
       coalesce(sum(enqueued), 0)::bigint, coalesce(sum(delivered), 0)::bigint,
       coalesce(sum(acked), 0)::bigint, coalesce(sum(nacked), 0)::bigint,
       coalesce(sum(reclaimed), 0)::bigint, coalesce(sum(retried), 0)::bigint,
       coalesce(sum(buried), 0)::bigint, coalesce(sum(requeued), 0)::bigint,
       coalesce(sum(purged), 0)::bigint, coalesce(sum(cancelled), 0)::bigint,
       coalesce(sum(expired), 0)::bigint, coalesce(sum(waiting), 0)::bigint,
       coalesce(sum(succeeded), 0)::bigint
FROM wq.counters

-- name: queue_stats
SELECT coalesce(sum(ready), 0)::bigint, coalesce(sum(handed_out), 0)::bigint,
       coalesce(sum(delayed), 0)::bigint, coalesce(sum(dead), 0)::bigint,
       coalesce(sum(enqueued), 0)::bigint, coalesce(sum(delivered), 0)::bigint,
       coalesce(sum(acked), 0)::bigint, coalesce(sum(nacked), 0)::bigint,
       coalesce(sum(reclaimed), 0)::bigint, coalesce(sum(retried), 0)::bigint,
       coalesce(sum(buried), 0)::bigint, coalesce(sum(requeued), 0)::bigint,
       coalesce(sum(purged), 0)::bigint, coalesce(sum(cancelled), 0)::bigint,
       coalesce(sum(expired), 0)::bigint, coalesce(sum(waiting), 0)::bigint,
       coalesce(sum(succeeded), 0)::bigint
FROM wq.counters WHERE queue = $1

-- name: queues
-- Then the limits (docs/design/schedules.md): rate_tasks, rate_per, rate_burst, concurrency, and
-- the tokens available at $1 ($2: at the database's clock; neither: as the last claim left them).
SELECT q.name, q.paused, coalesce(sum(c.ready), 0)::bigint, coalesce(sum(c.handed_out), 0)::bigint,
       coalesce(sum(c.delayed), 0)::bigint, coalesce(sum(c.dead), 0)::bigint,
       coalesce(sum(c.waiting), 0)::bigint, coalesce(sum(c.succeeded), 0)::bigint,
       q.rate_tasks, q.rate_per, q.rate_burst, q.concurrency,
       CASE WHEN q.rate_tasks IS NOT NULL THEN least(q.rate_burst::float8, q.tokens + greatest(
           coalesce($1, CASE WHEN $2 THEN extract(epoch FROM clock_timestamp())::float8 END,
                    q.refilled_at) - q.refilled_at, 0) * q.rate_tasks / q.rate_per) END
FROM wq.queues q LEFT JOIN wq.counters c ON c.queue = q.name GROUP BY q.name, q.paused

-- name: report
-- Every queue with its gauges and totals, and the earliest available_at among the heads of its
-- priority lanes (0 .. $1 - 1; one probe of tasks_ready per priority, only for a queue with
-- ready tasks); then the limits and tokens, as the statement queues gives them (at $2, or $3).
SELECT q.name, q.paused,
       coalesce(sum(ready), 0)::bigint, coalesce(sum(handed_out), 0)::bigint,
       coalesce(sum(delayed), 0)::bigint, coalesce(sum(dead), 0)::bigint,
       coalesce(sum(enqueued), 0)::bigint, coalesce(sum(delivered), 0)::bigint,
       coalesce(sum(acked), 0)::bigint, coalesce(sum(nacked), 0)::bigint,
       coalesce(sum(reclaimed), 0)::bigint, coalesce(sum(retried), 0)::bigint,
       coalesce(sum(buried), 0)::bigint, coalesce(sum(requeued), 0)::bigint,
       coalesce(sum(purged), 0)::bigint, coalesce(sum(cancelled), 0)::bigint,
       coalesce(sum(expired), 0)::bigint, coalesce(sum(waiting), 0)::bigint,
       coalesce(sum(succeeded), 0)::bigint,
       CASE WHEN coalesce(sum(c.ready), 0) > 0 THEN (
           SELECT min(h.available_at) FROM generate_series(0, $1 - 1) AS p (n),
           LATERAL (SELECT t.available_at FROM wq.tasks t
                    WHERE t.state = 0 AND t.queue = q.name AND t.priority = p.n
                    ORDER BY t.ord LIMIT 1) h
       ) END,
       q.rate_tasks, q.rate_per, q.rate_burst, q.concurrency,
       CASE WHEN q.rate_tasks IS NOT NULL THEN least(q.rate_burst::float8, q.tokens + greatest(
           coalesce($2, CASE WHEN $3 THEN extract(epoch FROM clock_timestamp())::float8 END,
                    q.refilled_at) - q.refilled_at, 0) * q.rate_tasks / q.rate_per) END
FROM wq.queues q LEFT JOIN wq.counters c ON c.queue = q.name GROUP BY q.name, q.paused

-- name: lookup
-- A task as store.py's _task reads it (its progress only while handed out; its result, finish
-- time and parents waited for only in those states; its result TTL only if it was given; its
-- parents only if it has some; the schedule that fired it, if one did), then its state.
SELECT id, payload, attempts, max_attempts, created_at, available_at, last_error, queue, priority,
       expires_at, timeout, CASE WHEN state = 1 THEN progress END, cancelling,
       CASE WHEN state = 5 THEN result END, CASE WHEN state = 5 THEN finished_at END,
       CASE WHEN ttl_given THEN result_ttl END,
       CASE WHEN parents > 0 THEN (SELECT array_agg(e.parent ORDER BY e.pos) FROM wq.edges e
                                   WHERE e.child = t.id) END,
       CASE WHEN state = 4 THEN waiting_for ELSE 0 END, schedule, scheduled_for, state,
       CASE WHEN state = 3 THEN buried_at END
FROM wq.tasks t WHERE id = $1

-- name: watch
-- As lookup, once the task is marked watched if it is pending (wq.watch).
SELECT id, payload, attempts, max_attempts, created_at, available_at, last_error, queue, priority,
       expires_at, timeout, CASE WHEN state = 1 THEN progress END, cancelling,
       CASE WHEN state = 5 THEN result END, CASE WHEN state = 5 THEN finished_at END,
       CASE WHEN ttl_given THEN result_ttl END,
       CASE WHEN parents > 0 THEN (SELECT array_agg(e.parent ORDER BY e.pos) FROM wq.edges e
                                   WHERE e.child = t.id) END,
       CASE WHEN state = 4 THEN waiting_for ELSE 0 END, schedule, scheduled_for, state,
       CASE WHEN state = 3 THEN buried_at END
FROM wq.watch($1) t

-- name: children
-- The first $2 children of task $1 (the tasks that name it and are still kept, in any state:
-- a child's edges go with it), oldest first, and how many there are.
SELECT ARRAY(SELECT e.child FROM wq.edges e WHERE e.parent = $1 ORDER BY e.ord, e.child
             LIMIT $2),
       (SELECT count(*) FROM wq.edges e WHERE e.parent = $1)

-- name: dead
-- Dead tasks (of queue $1, or of all) in burial order, at most $2 (NULL: all).
SELECT id, payload, attempts, max_attempts, created_at, available_at, last_error, queue, priority,
       expires_at, timeout, NULL::bytea, false, NULL::bytea, NULL::float8,
       CASE WHEN ttl_given THEN result_ttl END,
       CASE WHEN parents > 0 THEN (SELECT array_agg(e.parent ORDER BY e.pos) FROM wq.edges e
                                   WHERE e.child = t.id) END, 0, schedule, scheduled_for,
       buried_at
FROM wq.tasks t WHERE state = 3 AND ($1::text IS NULL OR queue = $1) ORDER BY ord LIMIT $2

-- == listings: a page of queue $1's tasks in one state, in its order, after the key given ==
-- The columns of lookup (but the state), then the key (two numbers; dead and waiting: the second
-- only); at most $2 rows (the store asks for one more than the page, to tell whether another
-- follows). Each is one or two scans of a partial index from the key on, stopped at the limit:
-- O(limit + log n) (and a task's parents, only for one that has some).

-- name: list_ready
-- In claim order: priority high to low, then ord. After (priority $3, ord $4): the rest of that
-- priority, then the lower ones (two index ranges; a first page gives $3 above every priority).
SELECT id, payload, attempts, max_attempts, created_at, available_at, last_error, queue, priority,
       expires_at, timeout, NULL::bytea, false, NULL::bytea, NULL::float8,
       CASE WHEN ttl_given THEN result_ttl END,
       CASE WHEN parents > 0 THEN (SELECT array_agg(e.parent ORDER BY e.pos) FROM wq.edges e
                                   WHERE e.child = page.id) END, 0, schedule, scheduled_for, k1, k2
FROM (
    (SELECT id, payload, attempts, max_attempts, created_at, available_at, last_error, queue,
            priority, expires_at, timeout, ttl_given, result_ttl, parents, schedule,
            scheduled_for, priority AS k1, ord AS k2
     FROM wq.tasks WHERE state = 0 AND queue = $1 AND priority = $3 AND ord > $4
     ORDER BY ord LIMIT $2)
    UNION ALL
    (SELECT id, payload, attempts, max_attempts, created_at, available_at, last_error, queue,
            priority, expires_at, timeout, ttl_given, result_ttl, parents, schedule,
            scheduled_for, priority, ord
     FROM wq.tasks WHERE state = 0 AND queue = $1 AND priority < $3
     ORDER BY priority DESC, ord LIMIT $2)
) page ORDER BY k1 DESC, k2 LIMIT $2

-- name: list_delayed
-- By due time, then ord: after (available_at $3, ord $4).
SELECT id, payload, attempts, max_attempts, created_at, available_at, last_error, queue, priority,
       expires_at, timeout, NULL::bytea, false, NULL::bytea, NULL::float8,
       CASE WHEN ttl_given THEN result_ttl END,
       CASE WHEN parents > 0 THEN (SELECT array_agg(e.parent ORDER BY e.pos) FROM wq.edges e
                                   WHERE e.child = t.id) END, 0, schedule, scheduled_for,
       available_at, ord
FROM wq.tasks t WHERE state = 2 AND queue = $1 AND (available_at, ord) > ($3, $4)
ORDER BY available_at, ord LIMIT $2

-- name: list_handed_out
-- By lease deadline, then ord: after (deadline $3, ord $4).
SELECT id, payload, attempts, max_attempts, created_at, available_at, last_error, queue, priority,
       expires_at, timeout, progress, cancelling, NULL::bytea, NULL::float8,
       CASE WHEN ttl_given THEN result_ttl END,
       CASE WHEN parents > 0 THEN (SELECT array_agg(e.parent ORDER BY e.pos) FROM wq.edges e
                                   WHERE e.child = t.id) END, 0, schedule, scheduled_for,
       deadline, ord
FROM wq.tasks t WHERE state = 1 AND queue = $1 AND (deadline, ord) > ($3, $4)
ORDER BY deadline, ord LIMIT $2

-- name: list_dead
-- By burial: after ord $3. (The first key column, unused, holds when it was buried.)
SELECT id, payload, attempts, max_attempts, created_at, available_at, last_error, queue, priority,
       expires_at, timeout, NULL::bytea, false, NULL::bytea, NULL::float8,
       CASE WHEN ttl_given THEN result_ttl END,
       CASE WHEN parents > 0 THEN (SELECT array_agg(e.parent ORDER BY e.pos) FROM wq.edges e
                                   WHERE e.child = t.id) END, 0, schedule, scheduled_for,
       buried_at, ord
FROM wq.tasks t WHERE state = 3 AND queue = $1 AND ord > $3
ORDER BY ord LIMIT $2

-- name: list_waiting
-- By enqueue: after ord $3.
SELECT id, payload, attempts, max_attempts, created_at, available_at, last_error, queue, priority,
       expires_at, timeout, NULL::bytea, false, NULL::bytea, NULL::float8,
       CASE WHEN ttl_given THEN result_ttl END,
       (SELECT array_agg(e.parent ORDER BY e.pos) FROM wq.edges e WHERE e.child = t.id),
       waiting_for, schedule, scheduled_for, NULL::float8, ord
FROM wq.tasks t WHERE state = 4 AND queue = $1 AND ord > $3
ORDER BY ord LIMIT $2

-- name: list_succeeded
-- By finish time, then ord: after (finished_at $3, ord $4).
SELECT id, payload, attempts, max_attempts, created_at, available_at, last_error, queue, priority,
       expires_at, timeout, NULL::bytea, false, result, finished_at,
       CASE WHEN ttl_given THEN result_ttl END,
       CASE WHEN parents > 0 THEN (SELECT array_agg(e.parent ORDER BY e.pos) FROM wq.edges e
                                   WHERE e.child = t.id) END, 0, schedule, scheduled_for,
       finished_at, ord
FROM wq.tasks t WHERE state = 5 AND queue = $1 AND (finished_at, ord) > ($3, $4)
ORDER BY finished_at, ord LIMIT $2

-- name: held
SELECT coalesce(sum(ready + handed_out + delayed + waiting + succeeded), 0)::bigint
FROM wq.counters

-- name: queue_names
SELECT name FROM wq.queues

-- name: db_now
SELECT extract(epoch FROM clock_timestamp())::float8

-- name: ready_left
-- Whether ready tasks are left in queues $1 (not paused) after a claim came back short: rows it
-- skipped because another transaction held them locked.
SELECT EXISTS (SELECT 1 FROM wq.tasks t WHERE t.state = 0 AND t.queue = ANY($1)
AND NOT EXISTS (SELECT 1 FROM wq.queues p WHERE p.name = t.queue AND p.paused))

-- == between brokers, the database away ==

-- name: announce
SELECT wq.announce($1)

-- name: ping
-- Whether the server is read-only: a standby (in recovery), or default_transaction_read_only
-- (a primary being demoted). Answered from memory, no table read.
SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::boolean

-- == upkeep: one broker at a time vacuums (a session advisory lock it tries) ==

-- name: try_lock
SELECT pg_try_advisory_lock($1)

-- name: unlock
SELECT pg_advisory_unlock($1)

-- name: vacuum_tasks
VACUUM wq.tasks

-- name: vacuum_counters
VACUUM wq.counters

-- name: vacuum_keys
VACUUM wq.keys

-- name: vacuum_edges
VACUUM wq.edges

-- == the schema (schema.py), inside the migration's transaction ==

-- name: lock
-- Brokers starting together wait here for each other.
SELECT pg_advisory_xact_lock($1)

-- name: no_deadline
-- The schema's transaction may wait for another broker's, and a migration may take long on a
-- large database: no statement deadline for it (the connections' own: -db-timeout-ms).
SET LOCAL statement_timeout = 0

-- name: has_meta
SELECT to_regclass('wq.meta') IS NOT NULL

-- name: version
SELECT value FROM wq.meta WHERE key = 'schema'

-- name: other_tables
-- Tables (and the like) of a database without wq.meta: if there are any, it is not wq's.
SELECT count(*) FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n
ON n.oid = c.relnamespace WHERE c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
AND n.nspname NOT IN ('pg_catalog', 'information_schema')
AND n.nspname NOT LIKE 'pg\_%'

-- name: record_version
INSERT INTO wq.meta VALUES ('schema', $1) ON CONFLICT (key) DO UPDATE SET value = excluded.value

-- name: new_id_key
INSERT INTO wq.meta VALUES ('id_key', $1)

-- name: id_key
SELECT value FROM wq.meta WHERE key = 'id_key'

-- == for the tests ==

-- name: wipe
DELETE FROM wq.tasks; DELETE FROM wq.counters; DELETE FROM wq.queues; DELETE FROM wq.keys;
DELETE FROM wq.edges; DELETE FROM wq.schedules;
ALTER SEQUENCE wq.ord RESTART; ALTER SEQUENCE wq.id_blocks RESTART

-- name: check
-- Gauges against the tasks: one row per queue (queue, the six kept: ready, handed out, delayed,
-- dead, waiting, succeeded; the six counted; then what the totals say is held, enqueued - acked -
-- purged - cancelled - expired, and the two sides of nacked + reclaimed == retried + buried).
SELECT c.queue, c.ready, c.handed_out, c.delayed, c.dead, c.waiting, c.succeeded,
       coalesce(t.ready, 0), coalesce(t.handed_out, 0), coalesce(t.delayed, 0), coalesce(t.dead, 0),
       coalesce(t.waiting, 0), coalesce(t.succeeded, 0),
       c.enqueued - c.acked - c.purged - c.cancelled - c.expired, c.nacked + c.reclaimed,
       c.retried + c.buried
FROM (SELECT queue, sum(ready) ready, sum(handed_out) handed_out, sum(delayed) delayed,
             sum(dead) dead, sum(waiting) waiting, sum(succeeded) succeeded,
             sum(enqueued) enqueued, sum(acked) acked, sum(purged) purged,
             sum(cancelled) cancelled, sum(expired) expired, sum(nacked) nacked,
             sum(reclaimed) reclaimed, sum(retried) retried, sum(buried) buried
      FROM wq.counters GROUP BY queue) c
FULL JOIN (SELECT queue, count(*) FILTER (WHERE state = 0) ready,
                  count(*) FILTER (WHERE state = 1) handed_out,
                  count(*) FILTER (WHERE state = 2) delayed,
                  count(*) FILTER (WHERE state = 3) dead,
                  count(*) FILTER (WHERE state = 4) waiting,
                  count(*) FILTER (WHERE state = 5) succeeded FROM wq.tasks GROUP BY queue) t
USING (queue)

-- name: edges_check
-- Edges whose child is no task (each is dropped with its child), and tasks whose count of
-- parents is not their edges'.
SELECT (SELECT count(*) FROM wq.edges e WHERE NOT EXISTS (
            SELECT 1 FROM wq.tasks t WHERE t.id = e.child)),
       (SELECT count(*) FROM wq.tasks t WHERE t.parents <> (
            SELECT count(*) FROM wq.edges e WHERE e.child = t.id))
