-- Version 4: control over tasks (docs/design/control.md). A task may expire (expires_at, epoch
-- seconds), have a time limit (timeout, seconds; handed_at: when it was last handed out), hold a
-- unique key while active (ukey), carry its holder's progress (JSON text) and be cancelling (a
-- cancel came while it was handed out); the broker and each queue count cancelled and expired
-- tasks.
ALTER TABLE tasks ADD COLUMN expires_at REAL;
ALTER TABLE tasks ADD COLUMN timeout REAL;
ALTER TABLE tasks ADD COLUMN handed_at REAL;
ALTER TABLE tasks ADD COLUMN progress BLOB;
ALTER TABLE tasks ADD COLUMN cancelling INTEGER NOT NULL DEFAULT 0;
ALTER TABLE tasks ADD COLUMN ukey TEXT;
ALTER TABLE totals ADD COLUMN cancelled INTEGER NOT NULL DEFAULT 0;
ALTER TABLE totals ADD COLUMN expired INTEGER NOT NULL DEFAULT 0;
ALTER TABLE queues ADD COLUMN cancelled INTEGER NOT NULL DEFAULT 0;
ALTER TABLE queues ADD COLUMN expired INTEGER NOT NULL DEFAULT 0;
