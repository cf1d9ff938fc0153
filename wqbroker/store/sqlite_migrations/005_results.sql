-- Version 5: results and workflows (docs/design/results.md). Two states more: 5, waiting for its
-- parents; 6, succeeded (acked with a result, kept until finished_at + result_ttl, and while a
-- child still needs it). A task's result TTL (seconds; ttl_given: it was given at enqueue, so its
-- view shows it), when it succeeded, and (waiting) its delay from its release; its result (the
-- JSON text as received) beside its payload, read back by key as payloads are; and its parents,
-- one edge each, in the order of its after (n), kept while the task exists: a task's children are
-- the edges naming it, in the order they were made. How many parents a waiting task still waits
-- for is not stored: a restart counts its parents that are still pending.
ALTER TABLE tasks ADD COLUMN result_ttl REAL;
ALTER TABLE tasks ADD COLUMN ttl_given INTEGER NOT NULL DEFAULT 0;
ALTER TABLE tasks ADD COLUMN finished_at REAL;
ALTER TABLE tasks ADD COLUMN delay REAL;
ALTER TABLE bodies ADD COLUMN result BLOB;
CREATE TABLE edges (
    n INTEGER PRIMARY KEY,            -- the order edges were made in
    child INTEGER NOT NULL,           -- as tasks.id
    parent INTEGER NOT NULL           -- as tasks.id (the parent may be gone)
);
CREATE INDEX edges_by_child ON edges (child);
