-- Version 4: results and workflows (docs/design/results.md). As 003's, every new column is NULL,
-- false or 0 for a task that uses none of it, so a database of version 3 upgrades in place without
-- rewriting its rows (a column with a constant default is added from the catalog alone), and each
-- statement may run again on a database that has it already.
--
-- Two states beside 0 ready, 1 handed out, 2 delayed, 3 dead: 4 waiting (enqueued with `after`,
-- some parent not yet succeeded) and 5 succeeded (acked with a result that is kept).
--
-- result: the JSON text an ack carried (state 5); finished_at: when (epoch seconds); deadline, for
-- a succeeded task: when the sweep looks at it next (its finished_at + result_ttl, or later while
-- a live child still needs it: pinned); result_ttl: seconds a result is kept (NULL on a row of an
-- older version: an hour, the broker's default), ttl_given: it was given (the view shows it);
-- waiting_for: parents not yet succeeded (state 4); delay: seconds it waits once released, if it
-- was enqueued with one (state 4); parents: how many it names in its `after` (0: none, and no
-- edge is looked at); kids: some task names it (its end may release, bury or cancel others);
-- watched: a waiter on some broker waits for its end (announced to every broker when it comes).
ALTER TABLE wq.tasks
    ADD COLUMN IF NOT EXISTS result bytea,
    ADD COLUMN IF NOT EXISTS finished_at float8,
    ADD COLUMN IF NOT EXISTS result_ttl float8,
    ADD COLUMN IF NOT EXISTS ttl_given boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS waiting_for int NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS delay float8,
    ADD COLUMN IF NOT EXISTS parents int NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS kids boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS watched boolean NOT NULL DEFAULT false;

-- The gauges waiting (in the invariant) and succeeded (results held), as deltas like the others.
ALTER TABLE wq.counters
    ADD COLUMN IF NOT EXISTS waiting bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS succeeded bigint NOT NULL DEFAULT 0;

-- A task's parents, in the order of its `after` (pos), kept while the child is (ord: the child's
-- place when it was enqueued, so children list oldest first). Both ways: a child's parents (the
-- key: a delivery's results, its view), a parent's children (their release, burial, cancel).
CREATE TABLE IF NOT EXISTS wq.edges (
    child bigint NOT NULL,
    pos int NOT NULL,
    parent bigint NOT NULL,
    ord bigint NOT NULL,
    PRIMARY KEY (child, pos)
);
CREATE INDEX IF NOT EXISTS edges_parent ON wq.edges (parent, ord, child);

-- Results by the time the sweep looks at them (pruning costs what is due), and a queue's
-- succeeded and waiting tasks listed in their orders (by finish, by enqueue).
CREATE INDEX IF NOT EXISTS tasks_results ON wq.tasks (deadline) WHERE state = 5;
CREATE INDEX IF NOT EXISTS tasks_succeeded_queue ON wq.tasks (queue, finished_at, ord)
    WHERE state = 5;
CREATE INDEX IF NOT EXISTS tasks_waiting_queue ON wq.tasks (queue, ord) WHERE state = 4;

-- Waiting tasks expire too, and hold their unique key (it is theirs until they run): both
-- indexes of 003 made again over state 4 as well (no row of a version-3 database is waiting).
DROP INDEX IF EXISTS wq.tasks_expiry;
CREATE INDEX tasks_expiry ON wq.tasks (expires_at)
    WHERE state IN (0, 2, 4) AND expires_at IS NOT NULL;
DROP INDEX IF EXISTS wq.tasks_unique;
CREATE UNIQUE INDEX tasks_unique ON wq.tasks (queue, ukey)
    WHERE ukey IS NOT NULL AND state IN (0, 1, 2, 4);
