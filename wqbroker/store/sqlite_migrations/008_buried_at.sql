-- Version 8: when a dead task was buried (epoch seconds), shown in its view (buried_at) and the
-- dead-letter queue. NULL for a task that is not dead, and for one buried before this version
-- (its view says nothing of it: not known).
ALTER TABLE tasks ADD COLUMN buried_at REAL;
