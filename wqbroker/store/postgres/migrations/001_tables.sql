-- Version 1: the tables of the PostgreSQL store, in the schema wq (see the package's docstring).
CREATE SCHEMA IF NOT EXISTS wq;

-- The schema version (the migration runner records it), the key that scatters task ids.
CREATE TABLE wq.meta (key text PRIMARY KEY, value text NOT NULL);

-- Where a task stands (see tasks.ord); blocks of task ids each broker reserves.
CREATE SEQUENCE wq.ord;
CREATE SEQUENCE wq.id_blocks;

-- One row per task not acked nor purged.
CREATE TABLE wq.tasks (
    id bigint PRIMARY KEY,              -- the task id (16 hex digits) minus 2**63
    queue text NOT NULL,
    state smallint NOT NULL,            -- 0 ready, 1 handed out, 2 delayed, 3 dead
    priority smallint NOT NULL,
    ord bigint NOT NULL,                -- where it stands (see the package's docstring)
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

-- Every queue known, and whether it is paused.
CREATE TABLE wq.queues (name text PRIMARY KEY, paused boolean NOT NULL DEFAULT false);

-- Totals (as wqbroker.models.Totals, in its order) and gauges, as deltas: one row per
-- (connection slot, queue), summed by the reads.
CREATE TABLE wq.counters (
    slot int NOT NULL,                  -- the backend pid of the connection that wrote it
    queue text NOT NULL,
    enqueued bigint NOT NULL DEFAULT 0,
    delivered bigint NOT NULL DEFAULT 0,
    acked bigint NOT NULL DEFAULT 0,
    nacked bigint NOT NULL DEFAULT 0,
    reclaimed bigint NOT NULL DEFAULT 0,
    retried bigint NOT NULL DEFAULT 0,
    buried bigint NOT NULL DEFAULT 0,
    requeued bigint NOT NULL DEFAULT 0,
    purged bigint NOT NULL DEFAULT 0,
    ready bigint NOT NULL DEFAULT 0,
    handed_out bigint NOT NULL DEFAULT 0,
    delayed bigint NOT NULL DEFAULT 0,
    dead bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (slot, queue)
) WITH (fillfactor = 50);

-- Idempotency keys in their window.
CREATE TABLE wq.keys (
    queue text NOT NULL,
    key text NOT NULL,
    task_id bigint NOT NULL,            -- as tasks.id (the task may be gone)
    until float8 NOT NULL,
    PRIMARY KEY (queue, key)
);
