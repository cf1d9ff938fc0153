-- Version 6: schedules (docs/design/schedules.md). A schedule's row: its rule (cron in timezone,
-- or every: seconds), the task each fire enqueues (the enqueue members; seconds for times;
-- payload: the JSON text as received), whether it is paused, when it fires next (next_fire_at,
-- NULL while paused) and last fired (last_fire_at: that fire's scheduled time, last_task_id: the
-- task it enqueued, 16 hex digits), how many times it fired, and its revision (drawn at each put,
-- pause and resume from one increasing sequence: a fire's compare-and-set checks it). The store
-- loads every row at open and finds the due ones in memory (so no index on next_fire_at); a fire
-- writes the row in the commit that inserts its task.
--
-- A task a schedule enqueued names it (schedule) and that fire's scheduled time (scheduled_for),
-- for its view; NULL for every other task.
ALTER TABLE tasks ADD COLUMN schedule TEXT;
ALTER TABLE tasks ADD COLUMN scheduled_for REAL;
CREATE TABLE schedules (
    name TEXT PRIMARY KEY,
    cron TEXT,
    timezone TEXT NOT NULL,
    every REAL,
    queue TEXT NOT NULL,
    payload BLOB NOT NULL,
    priority INTEGER NOT NULL,
    max_attempts INTEGER NOT NULL,
    expires_in REAL,
    timeout REAL,
    result_ttl REAL,
    paused INTEGER NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    next_fire_at REAL,
    last_fire_at REAL,
    last_task_id TEXT,
    fires INTEGER NOT NULL,
    revision INTEGER NOT NULL
);
