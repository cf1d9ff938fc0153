-- Version 8: when a dead task was buried (epoch seconds, the time of the call that buried it),
-- shown in its view (buried_at) and the dead-letter queue; cleared by a requeue. NULL for a task
-- that is not dead, and for one buried before this version (its view says nothing: not known).
-- Every function that buries (wq.fail, wq.bury, wq.link) sets it: they are made again.
ALTER TABLE wq.tasks ADD COLUMN IF NOT EXISTS buried_at float8;
