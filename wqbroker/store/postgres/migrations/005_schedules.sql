-- Version 5: schedules (docs/design/schedules.md). As 003's and 004's, the new task columns are
-- NULL for a task no schedule fired, so a database of version 4 upgrades in place without
-- rewriting its rows, and each statement may run again on a database that has it already.
--
-- schedule, scheduled_for: the schedule that enqueued the task and that fire's scheduled time
-- (epoch seconds, the rule's time: never translated between clocks), for its view.
ALTER TABLE wq.tasks
    ADD COLUMN IF NOT EXISTS schedule text,
    ADD COLUMN IF NOT EXISTS scheduled_for float8;

-- A schedule: its rule (cron in timezone, or every: seconds), the task each fire enqueues (the
-- enqueue members; seconds for times; payload: the JSON text as received), whether it is paused,
-- when it fires next (next_fire_at: NULL while paused) and last fired (last_fire_at: that fire's
-- scheduled time; last_task_id: as tasks.id), how many times it fired (all brokers' fires), and
-- its revision, drawn from wq.schedule_revisions at each put, pause and resume: a fire (wq.fire)
-- is a compare-and-set on (next_fire_at, revision), so each (schedule, scheduled time) enqueues
-- one task whichever brokers try, and a fire computed from a row read before a change does
-- nothing. The due query reads schedules_due: its cost is what is due.
CREATE SEQUENCE IF NOT EXISTS wq.schedule_revisions;
CREATE TABLE IF NOT EXISTS wq.schedules (
    name text PRIMARY KEY,
    cron text,
    timezone text NOT NULL,
    every float8,
    queue text NOT NULL,
    payload bytea NOT NULL,
    priority smallint NOT NULL,
    max_attempts int NOT NULL,
    expires_in float8,
    timeout float8,
    result_ttl float8,
    paused boolean NOT NULL,
    created_at float8 NOT NULL,
    updated_at float8 NOT NULL,
    next_fire_at float8,
    last_fire_at float8,
    last_task_id bigint,
    fires bigint NOT NULL DEFAULT 0,
    revision bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS schedules_due ON wq.schedules (next_fire_at)
    WHERE NOT paused AND next_fire_at IS NOT NULL;
