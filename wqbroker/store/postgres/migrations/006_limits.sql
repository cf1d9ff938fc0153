-- Version 6: limits per queue (docs/design/schedules.md). A queue's row keeps its limits and its
-- rate bucket: at most rate_tasks hand-outs per rate_per seconds, from a bucket of rate_burst
-- tokens (tokens as of refilled_at, epoch seconds: brought up to date by each claim that takes
-- from the queue, under the row's lock), and at most concurrency tasks handed out at once. NULL
-- where there is none: every queue of an older database has no limits, and its row gains nothing
-- but NULL columns (added from the catalog alone, no row rewritten). As 005's, each statement may
-- run again on a database that has it already.
ALTER TABLE wq.queues
    ADD COLUMN IF NOT EXISTS rate_tasks int,
    ADD COLUMN IF NOT EXISTS rate_per float8,
    ADD COLUMN IF NOT EXISTS rate_burst int,
    ADD COLUMN IF NOT EXISTS concurrency int,
    ADD COLUMN IF NOT EXISTS tokens float8,
    ADD COLUMN IF NOT EXISTS refilled_at float8;
