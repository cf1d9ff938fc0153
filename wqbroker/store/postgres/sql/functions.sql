-- The PL/pgSQL functions of the PostgreSQL store: every operation is one call of one of these, in
-- its own transaction (one round trip). Not a migration: whenever a migration runs (a database is
-- made or upgraded), every function of the schema wq is dropped and this file makes them again,
-- whole, in the migration's transaction. A database already at the latest version keeps the
-- functions it has: a change here that existing databases must get comes with a new migration.
--
-- Conventions: p_now is the caller's time (epoch seconds), or NULL for the database's clock
-- (wq.clock); every function that changes tasks takes one number from the sequence wq.ord and
-- numbers the rows it changes ord = number * 2**20 + i (1048576), so order within a call is exact;
-- counters change in the same transaction, as deltas in the row of this connection (wq.bump).

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
             JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'wq' LOOP
        EXECUTE 'DROP FUNCTION ' || f::text;  -- (regprocedure's text quotes what needs quoting)
    END LOOP;
END $$;

-- The time of a call: the caller's, or the database's clock when the caller passes NULL.
CREATE FUNCTION wq.clock(p_now float8) RETURNS float8 LANGUAGE sql AS $$
SELECT coalesce(p_now, extract(epoch FROM clock_timestamp())::float8)
$$;

-- Counter deltas for a queue, added to this connection's row (named: wq.bump(q, acked => 1)).
CREATE FUNCTION wq.bump(p_queue text, enqueued bigint = 0, delivered bigint = 0,
    acked bigint = 0, nacked bigint = 0, reclaimed bigint = 0, retried bigint = 0,
    buried bigint = 0, requeued bigint = 0, purged bigint = 0, ready bigint = 0,
    handed_out bigint = 0, delayed bigint = 0, dead bigint = 0, cancelled bigint = 0,
    expired bigint = 0)
RETURNS void LANGUAGE sql AS $$
INSERT INTO wq.counters AS k (slot, queue, enqueued, delivered, acked, nacked, reclaimed, retried,
                              buried, requeued, purged, ready, handed_out, delayed, dead,
                              cancelled, expired)
VALUES (pg_backend_pid(), p_queue, enqueued, delivered, acked, nacked, reclaimed, retried,
        buried, requeued, purged, ready, handed_out, delayed, dead, cancelled, expired)
ON CONFLICT (slot, queue) DO UPDATE SET
    enqueued = k.enqueued + excluded.enqueued, delivered = k.delivered + excluded.delivered,
    acked = k.acked + excluded.acked, nacked = k.nacked + excluded.nacked,
    reclaimed = k.reclaimed + excluded.reclaimed, retried = k.retried + excluded.retried,
    buried = k.buried + excluded.buried, requeued = k.requeued + excluded.requeued,
    purged = k.purged + excluded.purged, ready = k.ready + excluded.ready,
    handed_out = k.handed_out + excluded.handed_out, delayed = k.delayed + excluded.delayed,
    dead = k.dead + excluded.dead, cancelled = k.cancelled + excluded.cancelled,
    expired = k.expired + excluded.expired
$$;

-- The retry delay after the p_attempts-th delivery failed: wqbroker.retry.backoff_delay, the
-- reference, in SQL (the same operations in the same order, so the same float8; the doublings stop
-- at retry.MAX_DOUBLINGS, 64). tests/test_backoff_in_sql.py checks that the two agree.
CREATE FUNCTION wq.backoff(p_attempts int, p_base float8, p_cap float8, p_u float8)
RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
SELECT h + h * p_u FROM (
    SELECT least(p_cap, p_base * power(2::float8, greatest(0, least(p_attempts - 1, 64))))
           / 2::float8 AS h) s
$$;

-- Why a guarded change failed: 2 (LeaseLost) if the task is held, else 1 (NotFound).
CREATE FUNCTION wq.miss(p_id bigint) RETURNS int LANGUAGE sql AS $$
SELECT CASE WHEN (SELECT state FROM wq.tasks WHERE id = p_id) = 1 THEN 2 ELSE 1 END
$$;

-- p_notify: an announcement to send with the commit (when the broker sends none of its own at
-- the moment, so that commits rarely contend for the notification lock), or NULL. p_expires,
-- p_timeouts, p_uniques: NULL when no task of the batch has any (docs/design/control.md).
--
-- Each queue enqueued to is held by a shared advisory lock (class 30577, the hash of its name)
-- until the commit: wq.delete_queue takes it exclusively, so that a queue is never forgotten
-- while a task is being put in it. (In the lock manager only: enqueues never wait for each
-- other on it, nor write anything for it.)
--
-- A unique task (p_uniques) keeps its key in tasks.ukey, not in wq.keys: the partial unique
-- index tasks_unique lets one task per (queue, key) be ready, delayed or handed out, whichever
-- broker enqueues it; a duplicate is answered with the id of the task that holds the key. Keys
-- of both kinds are one namespace (as the Index's): any keyed task is a duplicate of an active
-- task holding its key as a unique key, or of the task whose window key it is.
CREATE FUNCTION wq.enqueue(p_now float8, p_ids bigint[], p_queues text[], p_prios int[],
    p_payloads bytea[], p_max int[], p_delays float8[], p_keys text[], p_untils float8[],
    p_notify text, p_expires float8[], p_timeouts float8[], p_uniques boolean[])
RETURNS TABLE (o_i int, o_id bigint, o_dup boolean, o_at float8, o_available float8)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := wq.clock(p_now);
    base bigint := nextval('wq.ord') * 1048576;
    q text;
    owner bigint;
    avail float8;
    uk text;
    j int;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM unnest(p_keys) k WHERE k IS NOT NULL) THEN
        -- No idempotency keys (the common case): the batch as a set.
        INSERT INTO wq.queues (name)
            SELECT d.u FROM (SELECT DISTINCT u FROM unnest(p_queues) u) d,
                LATERAL pg_advisory_xact_lock_shared(30577, hashtext(d.u)) l
            ORDER BY d.u  -- (new queues made in one order by all: no deadlock between them)
            ON CONFLICT DO NOTHING;
        RETURN QUERY
        WITH n AS (
            SELECT * FROM unnest(p_ids, p_queues, p_prios, p_payloads, p_max, p_delays,
                                 p_expires, p_timeouts)
                WITH ORDINALITY AS n(id, queue, prio, payload, max, delay, expires, timeout, i)),
        ins AS (
            INSERT INTO wq.tasks (id, queue, state, priority, ord, payload, attempts,
                                  max_attempts, created_at, available_at, expires_at, timeout)
            SELECT n.id, n.queue, CASE WHEN n.delay > 0 THEN 2 ELSE 0 END, n.prio, base + n.i,
                n.payload, 0, n.max, now_, now_ + greatest(n.delay, 0), n.expires, n.timeout
            FROM n
            RETURNING queue, state),
        g AS (SELECT ins.queue, count(*) AS n, count(*) FILTER (WHERE ins.state = 0) AS r
              FROM ins GROUP BY ins.queue),
        bump AS (
            INSERT INTO wq.counters AS k (slot, queue, enqueued, ready, delayed)
            SELECT pg_backend_pid(), g.queue, g.n, g.r, g.n - g.r FROM g
            ON CONFLICT (slot, queue) DO UPDATE SET enqueued = k.enqueued + excluded.enqueued,
                ready = k.ready + excluded.ready, delayed = k.delayed + excluded.delayed)
        SELECT n.i::int, n.id, false, now_, now_ + greatest(n.delay, 0) FROM n ORDER BY n.i;
        IF p_notify IS NOT NULL THEN
            PERFORM pg_notify('wq_ready', p_notify);
        END IF;
        RETURN;
    END IF;
    -- One by one, in the order of (queue, key), then of the batch: concurrent enqueues wait for
    -- each other's keys (and new queues) in one order, so never in a cycle (a deadlock); the
    -- first of a batch's duplicates is still the one made. Rows come back in that order.
    FOR j IN SELECT s.j FROM generate_subscripts(p_ids, 1) AS s (j)
             ORDER BY p_queues[s.j], p_keys[s.j], s.j LOOP
        q := p_queues[j];
        uk := CASE WHEN p_uniques[j] THEN p_keys[j] END;
        IF p_keys[j] IS NOT NULL THEN
            SELECT t.id INTO owner FROM wq.tasks t
                WHERE t.queue = q AND t.ukey = p_keys[j] AND t.state IN (0, 1, 2);
            IF NOT FOUND AND uk IS NOT NULL THEN
                SELECT k.task_id INTO owner FROM wq.keys k
                    WHERE k.queue = q AND k.key = uk AND k.until > now_;
            END IF;
            IF FOUND THEN
                o_i := j; o_id := owner; o_dup := true; o_at := now_; o_available := NULL;
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;
        IF p_keys[j] IS NOT NULL AND uk IS NULL THEN
            INSERT INTO wq.keys AS k (queue, key, task_id, until)
                VALUES (q, p_keys[j], p_ids[j], p_untils[j])
                ON CONFLICT (queue, key) DO UPDATE
                SET task_id = excluded.task_id, until = excluded.until WHERE k.until <= now_
                RETURNING k.task_id INTO owner;
            IF NOT FOUND THEN
                SELECT k.task_id INTO owner FROM wq.keys k
                    WHERE k.queue = q AND k.key = p_keys[j];
                o_i := j; o_id := owner; o_dup := true; o_at := now_; o_available := NULL;
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;
        PERFORM pg_advisory_xact_lock_shared(30577, hashtext(q));
        INSERT INTO wq.queues (name) VALUES (q) ON CONFLICT DO NOTHING;
        avail := now_ + greatest(p_delays[j], 0);
        owner := NULL;
        LOOP
            INSERT INTO wq.tasks (id, queue, state, priority, ord, payload, attempts,
                                  max_attempts, created_at, available_at, expires_at, timeout,
                                  ukey)
                VALUES (p_ids[j], q, CASE WHEN p_delays[j] > 0 THEN 2 ELSE 0 END, p_prios[j],
                        base + j, p_payloads[j], 0, p_max[j], now_, avail, p_expires[j],
                        p_timeouts[j], uk)
                ON CONFLICT (queue, ukey) WHERE ukey IS NOT NULL AND state IN (0, 1, 2)
                DO NOTHING;
            EXIT WHEN FOUND;
            -- Its key is held: by which task (if that one has ended meanwhile, try again).
            SELECT t.id INTO owner FROM wq.tasks t
                WHERE t.queue = q AND t.ukey = uk AND t.state IN (0, 1, 2);
            EXIT WHEN FOUND;
        END LOOP;
        IF owner IS NOT NULL THEN
            o_i := j; o_id := owner; o_dup := true; o_at := now_; o_available := NULL;
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF p_delays[j] > 0 THEN
            PERFORM wq.bump(q, enqueued => 1, delayed => 1);
        ELSE
            PERFORM wq.bump(q, enqueued => 1, ready => 1);
        END IF;
        o_i := j; o_id := p_ids[j]; o_dup := false; o_at := now_; o_available := avail;
        RETURN NEXT;
    END LOOP;
    IF p_notify IS NOT NULL THEN
        PERFORM pg_notify('wq_ready', p_notify);
    END IF;
END $$;

-- Delayed tasks due by now, to the tail of ready (in order of due time): per queue, how many.
-- Rows another call is promoting are skipped, not waited for: that call announces them once it
-- commits. (Waiting would be worse: a row that was waited for and found promoted by the other
-- call stays locked -- PostgreSQL keeps the lock of a row that fails the recheck -- until this
-- transaction ends, hiding the task from the claims made for waiting consumers, which skip
-- locked rows, after its announcement.) A task whose expiry has come is not promoted: it is
-- the sweep's (or a claim's) to drop (wq.expire).
CREATE FUNCTION wq.promote(now_ float8) RETURNS TABLE (o_queue text, o_n bigint)
LANGUAGE plpgsql AS $$
DECLARE
    base bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM wq.tasks t WHERE t.state = 2 AND t.available_at <= now_) THEN
        RETURN;
    END IF;
    base := nextval('wq.ord') * 1048576;
    RETURN QUERY
    WITH due AS (
        SELECT s.id, row_number() OVER (ORDER BY s.available_at, s.ord) AS rn FROM (
            SELECT t.id, t.available_at, t.ord FROM wq.tasks t
            WHERE t.state = 2 AND t.available_at <= now_
            AND (t.expires_at IS NULL OR t.expires_at > now_) FOR UPDATE SKIP LOCKED) s),
    upd AS (
        UPDATE wq.tasks t SET state = 0, ord = base + d.rn FROM due d WHERE t.id = d.id
        RETURNING t.queue),
    g AS (SELECT u.queue, count(*) AS n FROM upd u GROUP BY u.queue),
    bump AS (
        INSERT INTO wq.counters AS k (slot, queue, ready, delayed)
        SELECT pg_backend_pid(), g.queue, g.n, -g.n FROM g
        ON CONFLICT (slot, queue) DO UPDATE SET ready = k.ready + excluded.ready,
            delayed = k.delayed + excluded.delayed)
    SELECT g.queue, g.n FROM g;
END $$;

-- Ready and delayed tasks whose expiry has come by now_ (of the queues p_queues; NULL: of all),
-- dropped and counted expired: per queue, how many. Rows another call holds are skipped (it may
-- be dropping them too; the next sweep finds what is left). Its cost is what is due
-- (tasks_expiry holds only the tasks that expire).
CREATE FUNCTION wq.expire(now_ float8, p_queues text[]) RETURNS TABLE (o_queue text, o_n bigint)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    WITH due AS (
        SELECT t.id FROM wq.tasks t
        WHERE t.state IN (0, 2) AND t.expires_at IS NOT NULL AND t.expires_at <= now_
        AND (p_queues IS NULL OR t.queue = ANY(p_queues)) FOR UPDATE SKIP LOCKED),
    del AS (
        DELETE FROM wq.tasks t USING due d WHERE t.id = d.id RETURNING t.queue, t.state),
    g AS (SELECT del.queue, count(*) AS n, count(*) FILTER (WHERE del.state = 0) AS r
          FROM del GROUP BY del.queue),
    bump AS (
        INSERT INTO wq.counters AS k (slot, queue, expired, ready, delayed)
        SELECT pg_backend_pid(), g.queue, g.n, -g.r, g.r - g.n FROM g
        ON CONFLICT (slot, queue) DO UPDATE SET expired = k.expired + excluded.expired,
            ready = k.ready + excluded.ready, delayed = k.delayed + excluded.delayed)
    SELECT g.queue, g.n FROM g;
END $$;

-- Hand out up to array_length(p_leases) ready tasks of p_queues (in order of preference). A task
-- with a time limit has its deadline cut to it (and handed_at set). A task whose expiry has come
-- is never handed out: those of these queues are dropped first (wq.expire: only when some task
-- of the database has expired, one probe of tasks_expiry), and one met anyway (held by another
-- call when they were dropped) is dropped in place of its hand-out.
CREATE FUNCTION wq.claim(p_now float8, p_leases float8[], p_lease_ids text[], p_queues text[])
RETURNS TABLE (o_rn bigint, o_id bigint, o_payload bytea, o_attempts int, o_max int,
    o_created float8, o_available float8, o_error bytea, o_queue text, o_priority smallint,
    o_expires float8, o_timeout float8, o_deadline float8)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := wq.clock(p_now);
    base bigint;
    want int := coalesce(array_length(p_leases, 1), 0);
    got bigint := 0;
    n bigint;
    q text;
BEGIN
    IF EXISTS (SELECT 1 FROM wq.tasks t
               WHERE t.state IN (0, 2) AND t.expires_at IS NOT NULL AND t.expires_at <= now_) THEN
        PERFORM wq.expire(now_, p_queues);
    END IF;
    -- First the queues in which delayed tasks were promoted (o_rn NULL): other consumers may
    -- want them.
    RETURN QUERY SELECT NULL::bigint, NULL::bigint, NULL::bytea, NULL::int, NULL::int,
        NULL::float8, NULL::float8, NULL::bytea, p.o_queue, NULL::smallint, NULL::float8,
        NULL::float8, NULL::float8
        FROM wq.promote(now_) p;
    base := nextval('wq.ord') * 1048576;
    FOREACH q IN ARRAY p_queues LOOP
        EXIT WHEN got >= want;
        CONTINUE WHEN EXISTS (SELECT 1 FROM wq.queues p WHERE p.name = q AND p.paused);
        RETURN QUERY
        WITH cand AS (
            SELECT t.id, t.priority, t.ord, t.expires_at FROM wq.tasks t
            WHERE t.state = 0 AND t.queue = q
            ORDER BY t.priority DESC, t.ord LIMIT want - got
            FOR UPDATE SKIP LOCKED),
        live AS (
            SELECT c.id, got + row_number() OVER (ORDER BY c.priority DESC, c.ord) AS rn
            FROM cand c WHERE c.expires_at IS NULL OR c.expires_at > now_),
        gone AS (
            DELETE FROM wq.tasks t USING cand c WHERE t.id = c.id AND c.expires_at <= now_
            RETURNING t.id),
        upd AS (
            UPDATE wq.tasks t SET state = 1, attempts = t.attempts + 1,
                lease_id = p_lease_ids[c.rn],
                deadline = now_ + CASE WHEN t.timeout IS NULL THEN p_leases[c.rn]
                                       ELSE least(p_leases[c.rn], t.timeout) END,
                handed_at = CASE WHEN t.timeout IS NULL THEN NULL ELSE now_ END,
                ord = base + c.rn
            FROM live c WHERE t.id = c.id
            RETURNING c.rn, t.id, t.payload, t.attempts, t.max_attempts, t.created_at,
                t.available_at, t.last_error, t.queue, t.priority, t.expires_at, t.timeout,
                t.deadline),
        bump AS (
            INSERT INTO wq.counters AS k (slot, queue, delivered, ready, handed_out, expired)
            SELECT pg_backend_pid(), q, u.n, -u.n - x.n, u.n, x.n
            FROM (SELECT count(*) AS n FROM upd) u, (SELECT count(*) AS n FROM gone) x
            WHERE u.n + x.n > 0
            ON CONFLICT (slot, queue) DO UPDATE SET delivered = k.delivered + excluded.delivered,
                ready = k.ready + excluded.ready, handed_out = k.handed_out + excluded.handed_out,
                expired = k.expired + excluded.expired)
        SELECT * FROM upd ORDER BY 1;
        GET DIAGNOSTICS n = ROW_COUNT;
        got := got + n;
    END LOOP;
END $$;

-- A handed-out task (locked by the caller) whose delivery failed: delayed for a retry or
-- buried (its progress and hand-out time forgotten). Its retry time, or NULL if buried. (A
-- cancelling task is not failed: wq.drop.)
CREATE FUNCTION wq.fail(p_id bigint, p_queue text, p_attempts int, p_max int, now_ float8,
    p_error bytea, p_delay float8, p_terminal boolean, p_u float8, p_reclaim boolean,
    p_base float8, p_cap float8, p_ord bigint)
RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE
    avail float8;
    nk int := CASE WHEN p_reclaim THEN 0 ELSE 1 END;
    rc int := CASE WHEN p_reclaim THEN 1 ELSE 0 END;
BEGIN
    IF NOT coalesce(p_terminal, false) AND p_attempts < p_max THEN
        avail := now_ + coalesce(p_delay, wq.backoff(p_attempts, p_base, p_cap, p_u));
        UPDATE wq.tasks SET state = 2, available_at = avail, lease_id = NULL, deadline = NULL,
            handed_at = NULL, progress = NULL, last_error = p_error, ord = p_ord
            WHERE id = p_id;
        PERFORM wq.bump(p_queue, nacked => nk, reclaimed => rc, retried => 1, handed_out => -1,
                        delayed => 1);
        RETURN avail;
    END IF;
    UPDATE wq.tasks SET state = 3, lease_id = NULL, deadline = NULL, handed_at = NULL,
        progress = NULL, last_error = p_error, ord = p_ord WHERE id = p_id;
    PERFORM wq.bump(p_queue, nacked => nk, reclaimed => rc, buried => 1, handed_out => -1,
                    dead => 1);
    RETURN NULL;
END $$;

-- A cancelling task (handed out, locked by the caller) nacked, reclaimed, released or whose
-- lease ran out: gone, counted cancelled only (neither nacked/reclaimed nor retried/buried).
CREATE FUNCTION wq.drop(p_id bigint, p_queue text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM wq.tasks WHERE id = p_id;
    PERFORM wq.bump(p_queue, cancelled => 1, handed_out => -1);
END $$;

-- Acks, then nacks (or reclaims), in order. o_kind 0: an ack, 1: a nack; o_outcome 0: done,
-- 1: NotFound, 2: LeaseLost, 3: done, and the task is gone (it was cancelling: wq.drop);
-- o_retry_at: when a nacked task is retried (NULL: buried, or gone).
CREATE FUNCTION wq.settle(p_now float8, p_ack_ids bigint[], p_ack_leases text[],
    p_ids bigint[], p_leases text[], p_errors bytea[], p_delays float8[], p_terminal boolean[],
    p_us float8[], p_reclaim boolean, p_base float8, p_cap float8)
RETURNS TABLE (o_kind int, o_i int, o_outcome int, o_retry_at float8)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := wq.clock(p_now);
    base bigint := nextval('wq.ord') * 1048576;
    q text;
    a int;
    m int;
    c boolean;
    done int[];
BEGIN
    IF (SELECT count(DISTINCT x) FROM unnest(p_ack_ids) x) = array_length(p_ack_ids, 1) THEN
        -- Acks of distinct tasks (the usual batch): deleted as a set, counted once per queue.
        WITH a AS (
            SELECT * FROM unnest(p_ack_ids, p_ack_leases) WITH ORDINALITY AS a(id, lease, i)),
        d AS (
            DELETE FROM wq.tasks t USING a
            WHERE t.id = a.id AND t.state = 1 AND t.lease_id = a.lease RETURNING a.i, t.queue),
        g AS (SELECT d.queue, count(*) AS n FROM d GROUP BY d.queue),
        bump AS (
            INSERT INTO wq.counters AS k (slot, queue, acked, handed_out)
            SELECT pg_backend_pid(), g.queue, g.n, -g.n FROM g
            ON CONFLICT (slot, queue) DO UPDATE SET acked = k.acked + excluded.acked,
                handed_out = k.handed_out + excluded.handed_out)
        SELECT array_agg(d.i) INTO done FROM d;
        RETURN QUERY SELECT 0, a.i::int,
            CASE WHEN a.i = ANY(done) THEN 0 ELSE wq.miss(a.id) END, NULL::float8
            FROM unnest(p_ack_ids) WITH ORDINALITY AS a(id, i) ORDER BY a.i;
        p_ack_ids := '{}';
    END IF;
    FOR j IN 1..coalesce(array_length(p_ack_ids, 1), 0) LOOP
        DELETE FROM wq.tasks t
            WHERE t.id = p_ack_ids[j] AND t.state = 1 AND t.lease_id = p_ack_leases[j]
            RETURNING t.queue INTO q;
        o_kind := 0; o_i := j; o_retry_at := NULL;
        IF FOUND THEN
            PERFORM wq.bump(q, acked => 1, handed_out => -1);
            o_outcome := 0;
        ELSE
            o_outcome := wq.miss(p_ack_ids[j]);
        END IF;
        RETURN NEXT;
    END LOOP;
    FOR j IN 1..coalesce(array_length(p_ids, 1), 0) LOOP
        SELECT t.attempts, t.max_attempts, t.queue, t.cancelling INTO a, m, q, c FROM wq.tasks t
            WHERE t.id = p_ids[j] AND t.state = 1 AND t.lease_id = p_leases[j] FOR UPDATE;
        o_kind := 1; o_i := j; o_retry_at := NULL;
        IF FOUND AND c THEN
            PERFORM wq.drop(p_ids[j], q);
            o_outcome := 3;
        ELSIF FOUND THEN
            o_outcome := 0;
            o_retry_at := wq.fail(p_ids[j], q, a, m, now_, p_errors[j], p_delays[j],
                p_terminal[j], p_us[j], p_reclaim, p_base, p_cap, base + j);
        ELSE
            o_outcome := wq.miss(p_ids[j]);
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;

-- A new deadline, now + p_lease, cut to the task's time limit (handed_at + timeout), and its
-- progress recorded (p_progress; NULL: as it was). o_outcome 0: done; 1: NotFound; 2: LeaseLost;
-- 3: Cancelled (it is cancelling); 4: TimeLimitReached (its deadline is at the limit already);
-- o_timeout: its time limit (seconds).
CREATE FUNCTION wq.extend(p_now float8, p_id bigint, p_lease_id text, p_lease float8,
    p_progress bytea)
RETURNS TABLE (o_outcome int, o_deadline float8, o_timeout float8) LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := wq.clock(p_now);
    st int;
    lid text;
    c boolean;
BEGIN
    UPDATE wq.tasks t SET
        deadline = CASE WHEN t.timeout IS NULL THEN now_ + p_lease
                        ELSE least(now_ + p_lease, t.handed_at + t.timeout) END,
        ord = nextval('wq.ord') * 1048576, progress = coalesce(p_progress, t.progress)
        WHERE t.id = p_id AND t.state = 1 AND t.lease_id = p_lease_id AND NOT t.cancelling
        AND (t.timeout IS NULL OR t.deadline < t.handed_at + t.timeout)
        RETURNING t.deadline, t.timeout INTO o_deadline, o_timeout;
    IF FOUND THEN
        o_outcome := 0;
    ELSE
        SELECT t.state, t.lease_id, t.cancelling, t.timeout INTO st, lid, c, o_timeout
            FROM wq.tasks t WHERE t.id = p_id;
        o_outcome := CASE WHEN NOT FOUND OR st <> 1 THEN 1 WHEN lid <> p_lease_id THEN 2
                          WHEN c THEN 3 ELSE 4 END;
    END IF;
    RETURN NEXT;
END $$;

-- Its queue, or NULL if the lease is not current. A cancelling task is not put back: gone,
-- counted cancelled (as the Index does, its delivery stays counted).
CREATE FUNCTION wq.release(p_id bigint, p_lease_id text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    UPDATE wq.tasks t SET state = 0, attempts = t.attempts - 1, lease_id = NULL,
        deadline = NULL, handed_at = NULL, progress = NULL, ord = -nextval('wq.ord') * 1048576
        WHERE t.id = p_id AND t.state = 1 AND t.lease_id = p_lease_id AND NOT t.cancelling
        RETURNING t.queue INTO q;
    IF FOUND THEN
        PERFORM wq.bump(q, delivered => -1, handed_out => -1, ready => 1);
        RETURN q;
    END IF;
    SELECT t.queue INTO q FROM wq.tasks t
        WHERE t.id = p_id AND t.state = 1 AND t.lease_id = p_lease_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM wq.drop(p_id, q);
    RETURN q;
END $$;

-- Reclaim up to array_length(p_us) expired leases (oldest deadline first: a cancelling task's is
-- not retried but gone, wq.drop), drop the ready and delayed tasks whose expiry has come,
-- promote what is due, forget expired keys. o_kind 0: a reclaimed task (o_id, o_lease);
-- 1: promoted (o_queue, o_n); 8: expired (o_queue, o_n); 2: when the next thing is due (o_due,
-- NULL if nothing is scheduled); then, for the broker's hints: 3: each queue known (o_queue;
-- only if p_names); 4: how many tasks are held (o_n); 5: the database's clock (o_due).
CREATE FUNCTION wq.sweep(p_now float8, p_us float8[], p_base float8, p_cap float8,
    p_names boolean)
RETURNS TABLE (o_kind int, o_id bigint, o_lease text, o_queue text, o_n bigint, o_due float8)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := wq.clock(p_now);
    base bigint := nextval('wq.ord') * 1048576;
    j int := 0;
    r record;
BEGIN
    FOR r IN SELECT t.id, t.lease_id, t.queue, t.attempts, t.max_attempts, t.cancelling
             FROM wq.tasks t
             WHERE t.state = 1 AND t.deadline <= now_ ORDER BY t.deadline, t.ord
             LIMIT coalesce(array_length(p_us, 1), 0) FOR UPDATE SKIP LOCKED LOOP
        j := j + 1;
        IF r.cancelling THEN
            PERFORM wq.drop(r.id, r.queue);
        ELSE
            PERFORM wq.fail(r.id, r.queue, r.attempts, r.max_attempts, now_,
                convert_to('lease expired', 'UTF8'), NULL, false, p_us[j], true, p_base, p_cap,
                base + j);
        END IF;
        o_kind := 0; o_id := r.id; o_lease := r.lease_id; o_queue := r.queue; o_n := NULL;
        o_due := NULL;
        RETURN NEXT;
    END LOOP;
    IF EXISTS (SELECT 1 FROM wq.tasks t
               WHERE t.state IN (0, 2) AND t.expires_at IS NOT NULL AND t.expires_at <= now_) THEN
        RETURN QUERY SELECT 8, NULL::bigint, NULL::text, e.o_queue, e.o_n, NULL::float8
            FROM wq.expire(now_, NULL) e;
    END IF;
    RETURN QUERY SELECT 1, NULL::bigint, NULL::text, p.o_queue, p.o_n, NULL::float8
        FROM wq.promote(now_) p;
    DELETE FROM wq.keys k WHERE k.until <= now_;
    RETURN QUERY SELECT 2, NULL::bigint, NULL::text, NULL::text, NULL::bigint, least(
        (SELECT min(t.available_at) FROM wq.tasks t WHERE t.state = 2),
        (SELECT min(t.deadline) FROM wq.tasks t WHERE t.state = 1),
        (SELECT min(t.expires_at) FROM wq.tasks t
         WHERE t.state IN (0, 2) AND t.expires_at IS NOT NULL));
    IF p_names THEN
        RETURN QUERY SELECT 3, NULL::bigint, NULL::text, q.name, NULL::bigint, NULL::float8
            FROM wq.queues q;
    END IF;
    RETURN QUERY SELECT 4, NULL::bigint, NULL::text, NULL::text,
        coalesce(sum(k.ready + k.handed_out + k.delayed), 0)::bigint, NULL::float8
        FROM wq.counters k;
    RETURN QUERY SELECT 5, NULL::bigint, NULL::text, NULL::text, NULL::bigint,
        extract(epoch FROM clock_timestamp())::float8;
    -- 6: the brokers listening for announcements (o_n: connections named as the listener names
    -- its own, listener.LISTENER_NAME); 7: per table, its dead rows (o_n) and live rows (o_due),
    -- for the vacuum.
    RETURN QUERY SELECT 6, NULL::bigint, NULL::text, NULL::text, count(*), NULL::float8
        FROM pg_stat_activity a
        WHERE a.datname = current_database() AND a.application_name = 'wq listener';
    RETURN QUERY SELECT 7, NULL::bigint, NULL::text, c.relname::text,
        pg_stat_get_dead_tuples(c.oid), pg_stat_get_live_tuples(c.oid)::float8
        FROM pg_class c WHERE c.oid IN ('wq.tasks'::regclass, 'wq.counters'::regclass,
                                        'wq.keys'::regclass);
END $$;

-- Counter rows of connections that are gone, added into slot 0 (so the rows to sum stay about
-- as many as live connections times queues). One statement: a sum never sees a row twice. One
-- fold at a time, and none while a queue is deleted (wq.delete_queue takes the same lock): a
-- fold that comes while another is under way skips its turn.
CREATE FUNCTION wq.fold() RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock(30577, 0) THEN
        RETURN;
    END IF;
    WITH gone AS (
        DELETE FROM wq.counters k WHERE k.slot <> 0
            AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = k.slot)
        RETURNING k.*)
    INSERT INTO wq.counters AS k (slot, queue, enqueued, delivered, acked, nacked, reclaimed,
                                  retried, buried, requeued, purged, ready, handed_out, delayed,
                                  dead, cancelled, expired)
    SELECT 0, g.queue, sum(g.enqueued), sum(g.delivered), sum(g.acked), sum(g.nacked),
           sum(g.reclaimed), sum(g.retried), sum(g.buried), sum(g.requeued), sum(g.purged),
           sum(g.ready), sum(g.handed_out), sum(g.delayed), sum(g.dead), sum(g.cancelled),
           sum(g.expired)
    FROM gone g GROUP BY g.queue
    ON CONFLICT (slot, queue) DO UPDATE SET
        enqueued = k.enqueued + excluded.enqueued, delivered = k.delivered + excluded.delivered,
        acked = k.acked + excluded.acked, nacked = k.nacked + excluded.nacked,
        reclaimed = k.reclaimed + excluded.reclaimed, retried = k.retried + excluded.retried,
        buried = k.buried + excluded.buried, requeued = k.requeued + excluded.requeued,
        purged = k.purged + excluded.purged, ready = k.ready + excluded.ready,
        handed_out = k.handed_out + excluded.handed_out, delayed = k.delayed + excluded.delayed,
        dead = k.dead + excluded.dead, cancelled = k.cancelled + excluded.cancelled,
        expired = k.expired + excluded.expired;
END $$;

-- Dead tasks (one, or all, or all of a queue) to the tail of ready, in burial order: per
-- queue, how many and the place of its first (so the caller can list queues in order). A clean
-- start: no attempts, no error, no expiry, and no unique key (it no longer holds it).
CREATE FUNCTION wq.requeue(p_now float8, p_id bigint, p_queue text)
RETURNS TABLE (o_queue text, o_first bigint, o_n bigint) LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := wq.clock(p_now);
    base bigint := nextval('wq.ord') * 1048576;
BEGIN
    RETURN QUERY
    WITH d AS (
        SELECT s.id, row_number() OVER (ORDER BY s.ord) AS rn FROM (
            SELECT t.id, t.ord FROM wq.tasks t WHERE t.state = 3
            AND (p_id IS NULL OR t.id = p_id) AND (p_queue IS NULL OR t.queue = p_queue)
            FOR UPDATE) s),
    upd AS (
        UPDATE wq.tasks t SET state = 0, attempts = 0, last_error = NULL, available_at = now_,
            expires_at = NULL, ukey = NULL, ord = base + d.rn
            FROM d WHERE t.id = d.id RETURNING t.queue, d.rn),
    g AS (SELECT u.queue, min(u.rn) AS first, count(*) AS n FROM upd u GROUP BY u.queue),
    bump AS (
        INSERT INTO wq.counters AS k (slot, queue, requeued, dead, ready)
        SELECT pg_backend_pid(), g.queue, g.n, -g.n, g.n FROM g
        ON CONFLICT (slot, queue) DO UPDATE SET requeued = k.requeued + excluded.requeued,
            dead = k.dead + excluded.dead, ready = k.ready + excluded.ready)
    SELECT g.queue, g.first, g.n FROM g ORDER BY g.first;
END $$;

-- Tell the other brokers which queues have tasks ready (on the channel the listener LISTENs on,
-- listener.CHANNEL). Its transaction commits without waiting for the disk (a NOTIFY takes a
-- transaction id, so its commit would otherwise wait for a flush of the log: a lost announcement
-- costs at most a poll, and this one is sent after the durable commit of what it announces).
CREATE FUNCTION wq.announce(p_payload text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_notify('wq_ready', p_payload);
END $$;

CREATE FUNCTION wq.purge(p_id bigint) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    DELETE FROM wq.tasks t WHERE t.id = p_id AND t.state = 3 RETURNING t.queue INTO q;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM wq.bump(q, purged => 1, dead => -1);
    RETURN true;
END $$;

-- Cancel a task (docs/design/control.md): o_outcome 0: no such task; 1: it was ready or delayed,
-- and is gone (cancelled); 2: it is handed out, and cancelling now (or was already): o_lease is
-- its holder's lease, announced to the other brokers with the commit (p_notify, the payload's
-- head, when any listens: listener.py); 3: it was dead, and is purged. o_queue: its queue.
CREATE FUNCTION wq.cancel(p_id bigint, p_notify text)
RETURNS TABLE (o_outcome int, o_queue text, o_lease text) LANGUAGE plpgsql AS $$
DECLARE
    st int;
BEGIN
    SELECT t.state, t.queue, t.lease_id INTO st, o_queue, o_lease FROM wq.tasks t
        WHERE t.id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        o_outcome := 0;
    ELSIF st = 1 THEN
        UPDATE wq.tasks t SET cancelling = true WHERE t.id = p_id AND NOT t.cancelling;
        IF p_notify IS NOT NULL THEN
            PERFORM pg_notify('wq_ready', p_notify || o_lease);
        END IF;
        o_outcome := 2;
    ELSE
        DELETE FROM wq.tasks t WHERE t.id = p_id;
        IF st = 3 THEN
            PERFORM wq.bump(o_queue, purged => 1, dead => -1);
            o_outcome := 3;
        ELSIF st = 0 THEN
            PERFORM wq.bump(o_queue, cancelled => 1, ready => -1);
            o_outcome := 1;
        ELSE
            PERFORM wq.bump(o_queue, cancelled => 1, delayed => -1);
            o_outcome := 1;
        END IF;
        o_lease := NULL;
    END IF;
    RETURN NEXT;
END $$;

-- Every ready and delayed task of a queue dropped, counted cancelled: how many (NULL if the
-- queue is unknown). Tasks a claim is handing out meanwhile are waited for, and left to it.
CREATE FUNCTION wq.empty(p_queue text) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    r bigint;
    d bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM wq.queues q WHERE q.name = p_queue) THEN
        RETURN NULL;
    END IF;
    WITH r0 AS (DELETE FROM wq.tasks t WHERE t.queue = p_queue AND t.state = 0 RETURNING 1),
    d2 AS (DELETE FROM wq.tasks t WHERE t.queue = p_queue AND t.state = 2 RETURNING 1)
    SELECT (SELECT count(*) FROM r0), (SELECT count(*) FROM d2) INTO r, d;
    IF r + d > 0 THEN
        PERFORM wq.bump(p_queue, cancelled => r + d, ready => -r, delayed => -d);
    END IF;
    RETURN r + d;
END $$;

-- Forget a queue that holds nothing: its row in wq.queues (its paused flag) and its counter
-- rows, whose totals go to the row of no queue ('': no queue has that name), so the broker's
-- totals keep them. o_found false: no such queue; else o_ready .. o_dead are its gauges, and it
-- was forgotten only if they are all 0. Enqueues to it in flight are waited for (the lock each
-- holds on its queue: wq.enqueue), and so is a fold of counter rows (wq.fold).
CREATE FUNCTION wq.delete_queue(p_queue text)
RETURNS TABLE (o_found boolean, o_ready bigint, o_handed_out bigint, o_delayed bigint,
    o_dead bigint) LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(30577, hashtext(p_queue));
    PERFORM pg_advisory_xact_lock(30577, 0);
    PERFORM 1 FROM wq.queues q WHERE q.name = p_queue FOR UPDATE;
    o_found := FOUND;
    IF NOT o_found THEN
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT coalesce(sum(k.ready), 0), coalesce(sum(k.handed_out), 0),
           coalesce(sum(k.delayed), 0), coalesce(sum(k.dead), 0)
        INTO o_ready, o_handed_out, o_delayed, o_dead
        FROM wq.counters k WHERE k.queue = p_queue;
    IF o_ready <> 0 OR o_handed_out <> 0 OR o_delayed <> 0 OR o_dead <> 0 THEN
        RETURN NEXT;
        RETURN;
    END IF;
    WITH gone AS (DELETE FROM wq.counters k WHERE k.queue = p_queue RETURNING k.*)
    INSERT INTO wq.counters AS k (slot, queue, enqueued, delivered, acked, nacked, reclaimed,
                                  retried, buried, requeued, purged, cancelled, expired)
    SELECT 0, '', sum(g.enqueued), sum(g.delivered), sum(g.acked), sum(g.nacked),
           sum(g.reclaimed), sum(g.retried), sum(g.buried), sum(g.requeued), sum(g.purged),
           sum(g.cancelled), sum(g.expired)
    FROM gone g HAVING count(*) > 0
    ON CONFLICT (slot, queue) DO UPDATE SET
        enqueued = k.enqueued + excluded.enqueued, delivered = k.delivered + excluded.delivered,
        acked = k.acked + excluded.acked, nacked = k.nacked + excluded.nacked,
        reclaimed = k.reclaimed + excluded.reclaimed, retried = k.retried + excluded.retried,
        buried = k.buried + excluded.buried, requeued = k.requeued + excluded.requeued,
        purged = k.purged + excluded.purged, cancelled = k.cancelled + excluded.cancelled,
        expired = k.expired + excluded.expired;
    DELETE FROM wq.queues q WHERE q.name = p_queue;
    RETURN NEXT;
END $$;
