-- Version 1: the first SQLite store: tasks with their payloads, the broker's totals.
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE tasks (
    id INTEGER PRIMARY KEY,           -- the task id (16 hex digits) as a signed 64-bit integer
    payload BLOB NOT NULL,            -- the JSON text as received
    attempts INTEGER NOT NULL,
    max_attempts INTEGER NOT NULL,
    created_at REAL NOT NULL,
    available_at REAL NOT NULL,       -- delayed: when it becomes ready
    last_error TEXT,
    state INTEGER NOT NULL,           -- 0 ready, 1 handed out, 2 delayed, 3 dead
    lease_id TEXT,
    deadline REAL,                    -- handed out: when the lease runs out
    ord INTEGER                       -- ready: place in line; delayed, handed out: tie-break
                                      -- among equal due times; dead: order of burial
);
CREATE TABLE totals (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    enqueued INTEGER NOT NULL, delivered INTEGER NOT NULL, acked INTEGER NOT NULL,
    nacked INTEGER NOT NULL, reclaimed INTEGER NOT NULL, retried INTEGER NOT NULL,
    buried INTEGER NOT NULL, requeued INTEGER NOT NULL
);
INSERT INTO totals VALUES (1, 0, 0, 0, 0, 0, 0, 0, 0);
