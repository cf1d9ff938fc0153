-- Version 2: an index of idempotency keys by expiry (every sweep forgets the expired ones). With
-- it came set-based enqueues and acks, promotions reported by claims and the folding of counter
-- rows: functions, made again whole after every migration (sql/functions.sql).
CREATE INDEX IF NOT EXISTS keys_until ON wq.keys (until);
