-- Version 2: what the index is rebuilt from at start is kept apart from what only views need
-- (payloads and creation times, read back by key when a task is handed out or listed), so a
-- restart reads no payloads.
ALTER TABLE tasks RENAME TO tasks_v1;
CREATE TABLE tasks (
    id INTEGER PRIMARY KEY,           -- the task id (16 hex digits) as a signed 64-bit integer
    attempts INTEGER NOT NULL,
    max_attempts INTEGER NOT NULL,
    available_at REAL NOT NULL,       -- delayed: when it becomes ready
    state INTEGER NOT NULL,           -- 0 ready, 1 handed out, 2 delayed, 3 dead
    lease_id TEXT,
    deadline REAL,                    -- handed out: when the lease runs out
    ord INTEGER NOT NULL,             -- where it stands: place in line (ready), tie-break among
                                      -- equal due times (delayed, handed out), burial (dead)
    last_error TEXT
);
CREATE TABLE bodies (
    id INTEGER PRIMARY KEY,           -- as tasks.id
    payload BLOB NOT NULL,            -- the JSON text as received
    created_at REAL NOT NULL
);
INSERT INTO bodies (id, payload, created_at) SELECT id, payload, created_at FROM tasks_v1;
INSERT INTO tasks (id, attempts, max_attempts, available_at, state, lease_id, deadline, ord,
                   last_error)
    SELECT id, attempts, max_attempts, available_at, state, lease_id, deadline, COALESCE(ord, 0),
           last_error FROM tasks_v1;
DROP TABLE tasks_v1;
