-- Version 3: named queues (each with its paused flag and its totals), priorities, idempotency
-- keys still in their window. Version 2 had one queue, no priorities, no keys: every task goes to
-- the default queue, which takes the broker's totals (in a database being made from nothing, no
-- version is recorded yet, and there is no queue to make).
ALTER TABLE tasks ADD COLUMN queue TEXT NOT NULL DEFAULT 'default';
ALTER TABLE tasks ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
ALTER TABLE totals ADD COLUMN purged INTEGER NOT NULL DEFAULT 0;
CREATE TABLE queues (
    name TEXT PRIMARY KEY,
    paused INTEGER NOT NULL,
    enqueued INTEGER NOT NULL, delivered INTEGER NOT NULL, acked INTEGER NOT NULL,
    nacked INTEGER NOT NULL, reclaimed INTEGER NOT NULL, retried INTEGER NOT NULL,
    buried INTEGER NOT NULL, requeued INTEGER NOT NULL, purged INTEGER NOT NULL
);
CREATE TABLE keys (
    queue TEXT NOT NULL,
    key TEXT NOT NULL,
    task_id INTEGER NOT NULL,         -- as tasks.id (the task may be gone: acked)
    until REAL NOT NULL,              -- the key is remembered until then
    PRIMARY KEY (queue, key)
);
INSERT INTO queues
    SELECT 'default', 0, enqueued, delivered, acked, nacked, reclaimed, retried, buried,
           requeued, 0 FROM totals
    WHERE id = 1 AND EXISTS (SELECT 1 FROM meta WHERE key = 'schema');
