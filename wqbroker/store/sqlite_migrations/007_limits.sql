-- Version 7: limits per queue (docs/design/schedules.md). A queue's row keeps its limits: at most
-- rate_tasks hand-outs per rate_per seconds from a bucket of rate_burst tokens, and at most
-- concurrency tasks handed out at once; NULL where there is none (every queue of an older file:
-- no limits). The rate bucket itself is not kept: it starts full when the broker starts.
ALTER TABLE queues ADD COLUMN rate_tasks INTEGER;
ALTER TABLE queues ADD COLUMN rate_per REAL;
ALTER TABLE queues ADD COLUMN rate_burst INTEGER;
ALTER TABLE queues ADD COLUMN concurrency INTEGER;
