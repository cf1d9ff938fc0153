-- Version 3: control over every task (docs/design/control.md). New columns are NULL (or false)
-- for a task that uses none of it, so a database of version 2 upgrades in place without
-- rewriting its rows (PostgreSQL adds a column with a constant default from the catalog alone).
-- Each statement may run again on a database that has it already (as 002's).
-- expires_at: epoch seconds, never handed out at or after it; timeout: the seconds one attempt
-- may run (NULL: no limit); handed_at: when its attempt began (only with a timeout); progress:
-- JSON text, while handed out; cancelling: handed out, and a cancel came; ukey: its unique key
-- (held while it is ready, delayed or handed out).
ALTER TABLE wq.tasks
    ADD COLUMN IF NOT EXISTS expires_at float8,
    ADD COLUMN IF NOT EXISTS timeout float8,
    ADD COLUMN IF NOT EXISTS handed_at float8,
    ADD COLUMN IF NOT EXISTS progress bytea,
    ADD COLUMN IF NOT EXISTS cancelling boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS ukey text;

-- The totals cancelled and expired (after purged, as wqbroker.models.Totals).
ALTER TABLE wq.counters
    ADD COLUMN IF NOT EXISTS cancelled bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS expired bigint NOT NULL DEFAULT 0;

-- A queue's tasks listed in each state's order, a page at a time (keyset: O(limit + log n)).
-- Ready: tasks_ready (queue, priority DESC, ord); dead: tasks_dead (queue, ord); and these two
-- (the state-wide tasks_delayed and tasks_leased stay: promotions and sweeps look across queues).
CREATE INDEX IF NOT EXISTS tasks_delayed_queue ON wq.tasks (queue, available_at, ord) WHERE state = 2;
CREATE INDEX IF NOT EXISTS tasks_leased_queue ON wq.tasks (queue, deadline, ord) WHERE state = 1;

-- Ready and delayed tasks that expire, by expiry: the sweep's cost is what is due (and a task
-- that never expires is not in it).
CREATE INDEX IF NOT EXISTS tasks_expiry ON wq.tasks (expires_at)
    WHERE state IN (0, 2) AND expires_at IS NOT NULL;

-- Unique while active: at most one ready, delayed or handed-out task per (queue, unique key),
-- enforced by the database, so brokers racing to enqueue the same key make one task.
CREATE UNIQUE INDEX IF NOT EXISTS tasks_unique ON wq.tasks (queue, ukey)
    WHERE ukey IS NOT NULL AND state IN (0, 1, 2);
