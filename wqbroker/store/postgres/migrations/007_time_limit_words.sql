-- Version 7: no table changes. A lease that ran out at its attempt's time limit (handed_at +
-- timeout) is reclaimed with the words a Worker that stopped it would use, "timed out after N
-- ms", instead of "lease expired" (wq.sweep in sql/functions.sql, which every migration makes
-- again, whole: this version is what makes an older database take the new function).
SELECT 1;
