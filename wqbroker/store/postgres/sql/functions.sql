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
--
-- States: 0 ready, 1 handed out, 2 delayed, 3 dead, 4 waiting (for parents), 5 succeeded (its
-- result kept). Workflows (docs/design/results.md): wq.edges holds each child's parents; a task's
-- flags say what its end must look at (parents > 0: its parents' results, which it pins; kids:
-- tasks waiting for it; watched: a waiter for its end), so that a task with none of them costs
-- nothing more. Tasks that end watched are returned to the caller as (id, how: 1 succeeded,
-- 2 acked, 3 dead, 4 cancelled, 5 expired) and announced to the other brokers in the same
-- transaction (wq.tell, when p_head is given: listener.py). Rows of waiting tasks are locked in
-- id order (wq.descendants, wq.release_children), so that two transactions changing overlapping
-- children never wait for each other in a cycle through them.

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
    expired bigint = 0, waiting bigint = 0, succeeded bigint = 0)
RETURNS void LANGUAGE sql AS $$
INSERT INTO wq.counters AS k (slot, queue, enqueued, delivered, acked, nacked, reclaimed, retried,
                              buried, requeued, purged, ready, handed_out, delayed, dead,
                              cancelled, expired, waiting, succeeded)
VALUES (pg_backend_pid(), p_queue, enqueued, delivered, acked, nacked, reclaimed, retried,
        buried, requeued, purged, ready, handed_out, delayed, dead, cancelled, expired, waiting,
        succeeded)
ON CONFLICT (slot, queue) DO UPDATE SET
    enqueued = k.enqueued + excluded.enqueued, delivered = k.delivered + excluded.delivered,
    acked = k.acked + excluded.acked, nacked = k.nacked + excluded.nacked,
    reclaimed = k.reclaimed + excluded.reclaimed, retried = k.retried + excluded.retried,
    buried = k.buried + excluded.buried, requeued = k.requeued + excluded.requeued,
    purged = k.purged + excluded.purged, ready = k.ready + excluded.ready,
    handed_out = k.handed_out + excluded.handed_out, delayed = k.delayed + excluded.delayed,
    dead = k.dead + excluded.dead, cancelled = k.cancelled + excluded.cancelled,
    expired = k.expired + excluded.expired, waiting = k.waiting + excluded.waiting,
    succeeded = k.succeeded + excluded.succeeded
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

-- == workflows: what the end of a task does to the tasks that wait for it ==

-- A task id as clients see it (16 hex digits) from its key (the id minus 2**63).
CREATE FUNCTION wq.hex(p_id bigint) RETURNS text LANGUAGE sql IMMUTABLE AS $$
SELECT lpad(to_hex(p_id # (-9223372036854775808)::bigint), 16, '0')
$$;

-- An error text cut to 8 KiB as limits.error_value cuts one (UTF-8, at a character's start, and
-- a note of how long it was).
CREATE FUNCTION wq.cut(p bytea) RETURNS bytea LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    note bytea;
    keep int;
BEGIN
    IF length(p) <= 8192 THEN
        RETURN p;
    END IF;
    note := '\xe280a6'::bytea  -- (an ellipsis)
        || convert_to(' [truncated: the error was ' || length(p) || ' bytes]', 'UTF8');
    keep := 8192 - length(note);
    WHILE keep > 0 AND (get_byte(p, keep) & 192) = 128 LOOP  -- (within a character)
        keep := keep - 1;
    END LOOP;
    RETURN substring(p FROM 1 FOR keep) || note;
END $$;

-- Why a child of a dead task is buried: "is dead: <its error>", or "is dead" if it has none
-- (follows "parent <id> ").
CREATE FUNCTION wq.dead_why(p_error bytea) RETURNS bytea LANGUAGE sql IMMUTABLE AS $$
SELECT CASE WHEN p_error IS NULL OR p_error = '' THEN convert_to('is dead', 'UTF8')
            ELSE convert_to('is dead: ', 'UTF8') || p_error END
$$;

-- Announce watched tasks that ended (p_ids, with how: p_sts) to the other brokers with this
-- transaction's commit, on the channel of listener.py: p_head (the sender, "!"), then a line per
-- task, at most 250 a notification (a payload holds 8000 bytes). Nothing when p_head is NULL (no
-- other broker listens) or nothing ended watched.
CREATE FUNCTION wq.tell(p_head text, p_ids bigint[], p_sts int[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF p_head IS NULL OR coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    PERFORM pg_notify('wq_ready', p_head || string_agg(wq.hex(u.id) || ' ' || u.st, E'\n'))
        FROM unnest(p_ids, p_sts) WITH ORDINALITY AS u (id, st, n)
        GROUP BY (u.n - 1) / 250;
END $$;

-- The waiting tasks that wait for any of p_roots, directly or through other waiting tasks,
-- locked in id order; their ids. (After the locks, the children of what was locked are looked
-- for again: an enqueue that named one of them committed after the first look, and before the
-- lock; any later one waits for the lock, and then finds its parent ended.)
CREATE FUNCTION wq.descendants(p_roots bigint[]) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
    found bigint[] := '{}';
    more bigint[];
    frontier bigint[] := p_roots;
BEGIN
    LOOP
        WITH RECURSIVE d (id) AS (
            SELECT e.child FROM wq.edges e JOIN wq.tasks c ON c.id = e.child
            WHERE e.parent = ANY(frontier) AND c.state = 4
            AND e.child NOT IN (SELECT unnest(found))
            UNION
            SELECT e.child FROM d JOIN wq.edges e ON e.parent = d.id
            JOIN wq.tasks c ON c.id = e.child
            WHERE c.state = 4 AND e.child NOT IN (SELECT unnest(found)))
        SELECT coalesce(array_agg(l.id), '{}') INTO more FROM (
            SELECT t.id FROM wq.tasks t WHERE t.id IN (SELECT d.id FROM d) AND t.state = 4
            ORDER BY t.id FOR UPDATE) l;
        EXIT WHEN cardinality(more) = 0;
        found := found || more;
        frontier := more;
    END LOOP;
    RETURN found;
END $$;

-- Bury the waiting tasks that wait for p_roots (which ended: p_whys, "is dead: ...", "was
-- cancelled", "expired"), and theirs, transitively: dead, last_error "parent <id> <why>" naming
-- the first of its parents (in its `after`) that ended, a grandchild naming its own parent
-- ("parent <child> is dead: parent <root> was cancelled"). Not counted buried (nothing was
-- nacked or reclaimed): waiting -1, dead +1. Returns those that were watched (3: dead).
CREATE FUNCTION wq.bury(p_roots bigint[], p_whys bytea[], p_now float8)
RETURNS TABLE (o_id bigint, o_st int) LANGUAGE plpgsql AS $$
DECLARE
    at float8 := wq.clock(p_now);  -- when they are buried
    ids bigint[] := p_roots;
    whys bytea[] := p_whys;
    seen bigint[];
    base bigint;
BEGIN
    IF cardinality(wq.descendants(p_roots)) = 0 THEN  -- (all locked, in id order, first)
        RETURN;
    END IF;
    LOOP  -- a level at a time, each child once (its first parent by position among the level)
        base := nextval('wq.ord') * 1048576;
        WITH lv AS (SELECT * FROM unnest(ids, whys) AS l (id, why)),
        x AS (
            SELECT DISTINCT ON (e.child) e.child,
                wq.cut(convert_to('parent ' || wq.hex(e.parent) || ' ', 'UTF8') || lv.why) AS msg
            FROM wq.edges e JOIN lv ON lv.id = e.parent JOIN wq.tasks c ON c.id = e.child
            WHERE c.state = 4 ORDER BY e.child, e.pos),
        r AS (SELECT x.child, x.msg, row_number() OVER (ORDER BY x.child) AS rn FROM x),
        upd AS (
            UPDATE wq.tasks t SET state = 3, last_error = r.msg, waiting_for = 0, delay = NULL,
                ord = base + r.rn, buried_at = at
            FROM r WHERE t.id = r.child AND t.state = 4
            RETURNING t.id, t.queue, t.last_error, t.watched),
        g AS (SELECT u.queue, count(*) AS n FROM upd u GROUP BY u.queue),
        bump AS (
            INSERT INTO wq.counters AS k (slot, queue, waiting, dead)
            SELECT pg_backend_pid(), g.queue, -g.n, g.n FROM g
            ON CONFLICT (slot, queue) DO UPDATE SET waiting = k.waiting + excluded.waiting,
                dead = k.dead + excluded.dead)
        SELECT array_agg(u.id), array_agg(wq.dead_why(u.last_error)),
               array_agg(u.id) FILTER (WHERE u.watched)
            INTO ids, whys, seen FROM upd u;
        EXIT WHEN ids IS NULL;
        RETURN QUERY SELECT s.id, 3 FROM unnest(seen) AS s (id);
    END LOOP;
END $$;

-- Cancel the waiting tasks that wait for p_roots (waiting tasks cancelled), and theirs,
-- transitively: gone, each counted cancelled. Returns those that were watched (4: cancelled).
CREATE FUNCTION wq.cancel_tree(p_roots bigint[]) RETURNS TABLE (o_id bigint, o_st int)
LANGUAGE plpgsql AS $$
DECLARE
    ids bigint[] := wq.descendants(p_roots);  -- (locked, in id order)
    gone bigint[];
    seen bigint[];
BEGIN
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;
    WITH del AS (
        DELETE FROM wq.tasks t WHERE t.id = ANY(ids) AND t.state = 4
        RETURNING t.id, t.queue, t.watched),
    g AS (SELECT d.queue, count(*) AS n FROM del d GROUP BY d.queue),
    bump AS (
        INSERT INTO wq.counters AS k (slot, queue, cancelled, waiting)
        SELECT pg_backend_pid(), g.queue, g.n, -g.n FROM g
        ON CONFLICT (slot, queue) DO UPDATE SET cancelled = k.cancelled + excluded.cancelled,
            waiting = k.waiting + excluded.waiting)
    SELECT array_agg(d.id), array_agg(d.id) FILTER (WHERE d.watched) INTO gone, seen FROM del d;
    PERFORM wq.depart(gone, true);
    RETURN QUERY SELECT s.id, 4 FROM unnest(seen) AS s (id);
END $$;

-- Children (tasks with parents) that left the live states (gone, or succeeded): the results of
-- their parents that the sweep found pinned are due again (at their own time: the sweep looks
-- whether another child still pins them); the edges of those gone are dropped (p_gone). A parent
-- another transaction holds is skipped, not waited for: the sweep looks at it again later.
CREATE FUNCTION wq.depart(p_ids bigint[], p_gone boolean) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    UPDATE wq.tasks t SET deadline = t.finished_at + coalesce(t.result_ttl, 3600)
    FROM (SELECT p.id FROM wq.tasks p
          WHERE p.id IN (SELECT e.parent FROM wq.edges e WHERE e.child = ANY(p_ids))
          AND p.state = 5 AND p.deadline > p.finished_at + coalesce(p.result_ttl, 3600)
          ORDER BY p.id FOR UPDATE SKIP LOCKED) s
    WHERE t.id = s.id;
    IF p_gone THEN
        DELETE FROM wq.edges e WHERE e.child = ANY(p_ids);
    END IF;
END $$;

-- What follows the end of tasks (p_st: 3 dead, buried and kept; 4 cancelled or 5 expired, gone)
-- that have children, parents or a waiter (p_kids, p_parents, p_watched): their waiting children
-- buried (wq.bury: why from p_st, and the dead ones' p_errors), the results of their parents no
-- longer pinned by those gone (wq.depart). Returns the watched among them and their children.
-- p_now: the time of the call (NULL: the database's clock), their children's burial time.
CREATE FUNCTION wq.ended(p_st int, p_ids bigint[], p_kids boolean[], p_parents int[],
    p_watched boolean[], p_errors bytea[], p_now float8 = NULL)
RETURNS TABLE (o_id bigint, o_st int) LANGUAGE plpgsql AS $$
DECLARE
    roots bigint[];
    whys bytea[];
BEGIN
    SELECT array_agg(u.id), array_agg(CASE p_st WHEN 3 THEN wq.dead_why(u.err)
                                                WHEN 4 THEN convert_to('was cancelled', 'UTF8')
                                                ELSE convert_to('expired', 'UTF8') END)
        INTO roots, whys FROM unnest(p_ids, p_kids, p_errors) AS u (id, k, err) WHERE u.k;
    IF roots IS NOT NULL THEN
        RETURN QUERY SELECT * FROM wq.bury(roots, whys, p_now);
    END IF;
    IF p_st <> 3 THEN
        PERFORM wq.depart(
            ARRAY(SELECT u.id FROM unnest(p_ids, p_parents) AS u (id, n) WHERE u.n > 0), true);
    END IF;
    RETURN QUERY SELECT u.id, p_st FROM unnest(p_ids, p_watched) AS u (id, w) WHERE u.w;
END $$;

-- The waiting children of tasks just acked (p_parents): each updated once (its parents pending
-- less those of p_parents it names), locked in id order; one whose count reaches 0 is released,
-- ready at the back of its line (in the order they were enqueued) or delayed by its delay from
-- now. Per queue: how many became ready, and the earliest due time of those delayed.
CREATE FUNCTION wq.release_children(now_ float8, p_parents bigint[])
RETURNS TABLE (o_queue text, o_ready bigint, o_due float8) LANGUAGE plpgsql AS $$
DECLARE
    base bigint;
BEGIN
    IF coalesce(cardinality(p_parents), 0) = 0 THEN
        RETURN;
    END IF;
    base := nextval('wq.ord') * 1048576;
    RETURN QUERY
    WITH n AS (
        SELECT e.child, count(*) AS n FROM wq.edges e WHERE e.parent = ANY(p_parents)
        GROUP BY e.child),
    lk AS (
        SELECT t.id, t.ord, n.n FROM wq.tasks t JOIN n ON n.child = t.id
        WHERE t.state = 4 ORDER BY t.id FOR UPDATE OF t),
    rk AS (SELECT lk.id, lk.n, row_number() OVER (ORDER BY lk.ord) AS rn FROM lk),
    upd AS (
        UPDATE wq.tasks t SET
            waiting_for = greatest(t.waiting_for - rk.n, 0)::int,
            state = CASE WHEN t.waiting_for > rk.n THEN 4 WHEN t.delay > 0 THEN 2 ELSE 0 END,
            available_at = CASE WHEN t.waiting_for > rk.n THEN t.available_at
                                ELSE now_ + greatest(coalesce(t.delay, 0), 0) END,
            delay = CASE WHEN t.waiting_for > rk.n THEN t.delay END,
            ord = CASE WHEN t.waiting_for > rk.n THEN t.ord ELSE base + rk.rn END
        FROM rk WHERE t.id = rk.id
        RETURNING t.queue, t.state, t.available_at),
    g AS (
        SELECT u.queue, count(*) FILTER (WHERE u.state = 0) AS r,
               count(*) FILTER (WHERE u.state = 2) AS d,
               min(u.available_at) FILTER (WHERE u.state = 2) AS due
        FROM upd u WHERE u.state <> 4 GROUP BY u.queue),
    bump AS (
        INSERT INTO wq.counters AS k (slot, queue, waiting, ready, delayed)
        SELECT pg_backend_pid(), g.queue, -g.r - g.d, g.r, g.d FROM g
        ON CONFLICT (slot, queue) DO UPDATE SET waiting = k.waiting + excluded.waiting,
            ready = k.ready + excluded.ready, delayed = k.delayed + excluded.delayed)
    SELECT g.queue, g.r, g.due FROM g;
END $$;

-- The `after` of the tasks an enqueue just made (as ready or delayed; p_new: the items that made
-- one, p_ids: each item's task, or the task its key named), given as edges in the order of
-- (item, position): p_c the child item, p_pos the position, p_parent the parent's id (NULL: an
-- earlier item of the call, p_item; or an id that cannot be one), p_item that item. Parents that
-- are not new are locked in id order, and each must be a task (else WQ404, item and position:
-- the call is undone). A child is then dead at once if a parent is dead (wq.dead_why, the first
-- such by position; through the call's own items too), else waiting for the parents not yet
-- succeeded, else left as it was; new parents have kids. Returns the items it changed: their
-- state, parents waited for, error and available time (as enqueued: now + its delay; a waiting
-- task's is set again when it is released).
CREATE FUNCTION wq.link(now_ float8, p_ids bigint[], p_new boolean[], p_delays float8[],
    p_base bigint, p_c int[], p_pos int[], p_parent bigint[], p_item int[])
RETURNS TABLE (o_i int, o_state int, o_waiting int, o_error bytea, o_available float8)
LANGUAGE plpgsql AS $$
DECLARE
    n int := cardinality(p_ids);
    pid bigint[];       -- per edge: its parent
    inner_ boolean[];   -- per edge: the parent is a task this call made
    st int[];           -- per edge: the state of a parent not made by this call (-1: none)
    err bytea[];        -- per edge: its error
    bad int;
    dead bytea[];       -- per item: why it is dead at once
    k int;
    j int;
BEGIN
    SELECT array_agg(CASE WHEN u.it IS NULL THEN u.p ELSE p_ids[u.it] END ORDER BY u.k),
           array_agg(u.it IS NOT NULL AND coalesce(p_new[u.it], false) ORDER BY u.k)
        INTO pid, inner_ FROM unnest(p_parent, p_item) WITH ORDINALITY AS u (p, it, k);
    PERFORM 1 FROM wq.tasks t
        WHERE t.id IN (SELECT u.x FROM unnest(pid, inner_) AS u (x, i) WHERE NOT u.i)
        ORDER BY t.id FOR UPDATE;
    SELECT array_agg(CASE WHEN u.i THEN NULL ELSE coalesce(t.state::int, -1) END ORDER BY u.k),
           array_agg(t.last_error ORDER BY u.k)
        INTO st, err
        FROM unnest(pid, inner_) WITH ORDINALITY AS u (x, i, k)
        LEFT JOIN wq.tasks t ON t.id = u.x AND NOT u.i;
    bad := array_position(st, -1);
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'unknown parent' USING ERRCODE = 'WQ404',
            DETAIL = p_c[bad] || ' ' || p_pos[bad] || ' ' || coalesce(wq.hex(pid[bad]), '');
    END IF;
    IF 3 = ANY(st) THEN
        dead := array_fill(NULL::bytea, ARRAY[n]);
        FOR k IN 1..cardinality(st) LOOP
            j := p_c[k];
            CONTINUE WHEN dead[j] IS NOT NULL OR NOT p_new[j];
            IF st[k] = 3 THEN
                dead[j] := wq.cut(convert_to('parent ' || wq.hex(pid[k]) || ' ', 'UTF8')
                                  || wq.dead_why(err[k]));
            ELSIF inner_[k] AND dead[p_item[k]] IS NOT NULL THEN
                dead[j] := wq.cut(convert_to('parent ' || wq.hex(pid[k]) || ' ', 'UTF8')
                                  || wq.dead_why(dead[p_item[k]]));
            END IF;
        END LOOP;
    END IF;
    UPDATE wq.tasks t SET kids = true
        WHERE t.id IN (SELECT u.x FROM unnest(pid, inner_, p_c) AS u (x, i, c)
                       WHERE NOT u.i AND p_new[u.c])
        AND NOT t.kids;
    INSERT INTO wq.edges (child, pos, parent, ord)
        SELECT p_ids[u.c], u.pos, u.x, p_base + u.c
        FROM unnest(p_c, p_pos, pid) AS u (c, pos, x) WHERE p_new[u.c];
    RETURN QUERY
    WITH e AS (
        SELECT u.c, u.it, u.s, u.i FROM unnest(p_c, p_item, st, inner_) AS u (c, it, s, i)
        WHERE p_new[u.c]),
    per AS (
        SELECT e.c, count(*) AS np, count(*) FILTER (WHERE e.i OR e.s IN (0, 1, 2, 4)) AS w
        FROM e GROUP BY e.c),
    pk AS (SELECT DISTINCT e.it FROM e WHERE e.i),
    ch AS (
        SELECT g.i, p_ids[g.i] AS id, coalesce(per.np, 0) AS np, coalesce(per.w, 0) AS w,
               dead[g.i] AS msg, pk.it IS NOT NULL AS kid,
               CASE WHEN p_delays[g.i] > 0 THEN 2 ELSE 0 END AS was
        FROM generate_series(1, n) AS g (i)
        LEFT JOIN per ON per.c = g.i LEFT JOIN pk ON pk.it = g.i
        WHERE p_new[g.i] AND (per.c IS NOT NULL OR pk.it IS NOT NULL)),
    upd AS (
        UPDATE wq.tasks t SET
            state = CASE WHEN ch.msg IS NOT NULL THEN 3 WHEN ch.w > 0 THEN 4 ELSE t.state END,
            waiting_for = CASE WHEN ch.msg IS NULL THEN ch.w ELSE 0 END,
            delay = CASE WHEN ch.msg IS NULL AND ch.w > 0 AND p_delays[ch.i] > 0
                         THEN p_delays[ch.i] END,
            last_error = ch.msg, parents = ch.np, kids = t.kids OR ch.kid,
            buried_at = CASE WHEN ch.msg IS NOT NULL THEN now_ END
        FROM ch WHERE t.id = ch.id
        RETURNING ch.i, ch.was, t.queue, t.state, t.waiting_for, t.last_error, t.available_at),
    g AS (
        SELECT u.queue, count(*) FILTER (WHERE u.was = 0) AS r,
               count(*) FILTER (WHERE u.was = 2) AS d, count(*) FILTER (WHERE u.state = 4) AS w,
               count(*) FILTER (WHERE u.state = 3) AS x
        FROM upd u WHERE u.state <> u.was GROUP BY u.queue),
    bump AS (
        INSERT INTO wq.counters AS k (slot, queue, ready, delayed, waiting, dead)
        SELECT pg_backend_pid(), g.queue, -g.r, -g.d, g.w, g.x FROM g
        ON CONFLICT (slot, queue) DO UPDATE SET ready = k.ready + excluded.ready,
            delayed = k.delayed + excluded.delayed, waiting = k.waiting + excluded.waiting,
            dead = k.dead + excluded.dead)
    SELECT u.i::int, u.state::int, u.waiting_for, u.last_error, u.available_at
    FROM upd u ORDER BY u.i;
END $$;

-- p_notify: an announcement to send with the commit (when the broker sends none of its own at
-- the moment, so that commits rarely contend for the notification lock), or NULL. p_expires,
-- p_timeouts, p_uniques: NULL when no task of the batch has any (docs/design/control.md).
-- p_ttl: every task's result TTL (seconds); or, when some differ or were given, p_ttls and
-- p_given. p_c, p_pos, p_parent, p_item: the tasks' `after`, as wq.link takes it (NULL: none).
--
-- Each queue enqueued to is held by a shared advisory lock (class 30577, the hash of its name)
-- until the commit: wq.delete_queue takes it exclusively, so that a queue is never forgotten
-- while a task is being put in it. (In the lock manager only: enqueues never wait for each
-- other on it, nor write anything for it.)
--
-- A unique task (p_uniques) keeps its key in tasks.ukey, not in wq.keys: the partial unique
-- index tasks_unique lets one task per (queue, key) be ready, delayed, handed out or waiting,
-- whichever broker enqueues it; a duplicate is answered with the id of the task that holds the
-- key. Keys of both kinds are one namespace (as the Index's): any keyed task is a duplicate of an
-- active task holding its key as a unique key, or of the task whose window key it is.
--
-- Rows: each item's (o_i, its task or the duplicate's, o_dup, ...), then, with an `after`, a row
-- per item wq.link changed (o_dup NULL: its state, parents waited for, error, available time).
CREATE FUNCTION wq.enqueue(p_now float8, p_ids bigint[], p_queues text[], p_prios int[],
    p_payloads bytea[], p_max int[], p_delays float8[], p_keys text[], p_untils float8[],
    p_notify text, p_expires float8[], p_timeouts float8[], p_uniques boolean[],
    p_ttl float8, p_ttls float8[], p_given boolean[], p_c int[], p_pos int[],
    p_parent bigint[], p_item int[])
RETURNS TABLE (o_i int, o_id bigint, o_dup boolean, o_at float8, o_available float8,
    o_state int, o_waiting int, o_error bytea)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := wq.clock(p_now);
    base bigint := nextval('wq.ord') * 1048576;
    q text;
    owner bigint;
    avail float8;
    uk text;
    j int;
    made bigint[];
    fresh boolean[];
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
                                 p_expires, p_timeouts, p_ttls, p_given)
                WITH ORDINALITY AS n(id, queue, prio, payload, max, delay, expires, timeout,
                                     ttl, given, i)),
        ins AS (
            INSERT INTO wq.tasks (id, queue, state, priority, ord, payload, attempts,
                                  max_attempts, created_at, available_at, expires_at, timeout,
                                  result_ttl, ttl_given)
            SELECT n.id, n.queue, CASE WHEN n.delay > 0 THEN 2 ELSE 0 END, n.prio, base + n.i,
                n.payload, 0, n.max, now_, now_ + greatest(n.delay, 0), n.expires, n.timeout,
                coalesce(n.ttl, p_ttl), coalesce(n.given, false)
            FROM n
            RETURNING queue, state),
        g AS (SELECT ins.queue, count(*) AS n, count(*) FILTER (WHERE ins.state = 0) AS r
              FROM ins GROUP BY ins.queue),
        bump AS (
            INSERT INTO wq.counters AS k (slot, queue, enqueued, ready, delayed)
            SELECT pg_backend_pid(), g.queue, g.n, g.r, g.n - g.r FROM g
            ON CONFLICT (slot, queue) DO UPDATE SET enqueued = k.enqueued + excluded.enqueued,
                ready = k.ready + excluded.ready, delayed = k.delayed + excluded.delayed)
        SELECT n.i::int, n.id, false, now_, now_ + greatest(n.delay, 0),
            CASE WHEN n.delay > 0 THEN 2 ELSE 0 END, 0, NULL::bytea
        FROM n ORDER BY n.i;
        IF p_c IS NOT NULL THEN
            RETURN QUERY SELECT l.o_i, NULL::bigint, NULL::boolean, NULL::float8, l.o_available,
                l.o_state, l.o_waiting, l.o_error
                FROM wq.link(now_, p_ids, array_fill(true, ARRAY[cardinality(p_ids)]),
                             p_delays, base, p_c, p_pos, p_parent, p_item) l;
        END IF;
        IF p_notify IS NOT NULL THEN
            PERFORM pg_notify('wq_ready', p_notify);
        END IF;
        RETURN;
    END IF;
    -- One by one, in the order of (queue, key), then of the batch: concurrent enqueues wait for
    -- each other's keys (and new queues) in one order, so never in a cycle (a deadlock); the
    -- first of a batch's duplicates is still the one made. Rows come back in that order.
    made := array_fill(NULL::bigint, ARRAY[cardinality(p_ids)]);
    fresh := array_fill(false, ARRAY[cardinality(p_ids)]);
    FOR j IN SELECT s.j FROM generate_subscripts(p_ids, 1) AS s (j)
             ORDER BY p_queues[s.j], p_keys[s.j], s.j LOOP
        q := p_queues[j];
        o_state := NULL; o_waiting := NULL; o_error := NULL;
        uk := CASE WHEN p_uniques[j] THEN p_keys[j] END;
        IF p_keys[j] IS NOT NULL THEN
            SELECT t.id INTO owner FROM wq.tasks t
                WHERE t.queue = q AND t.ukey = p_keys[j] AND t.state IN (0, 1, 2, 4);
            IF NOT FOUND AND uk IS NOT NULL THEN
                SELECT k.task_id INTO owner FROM wq.keys k
                    WHERE k.queue = q AND k.key = uk AND k.until > now_;
            END IF;
            IF FOUND THEN
                o_i := j; o_id := owner; o_dup := true; o_at := now_; o_available := NULL;
                made[j] := owner;
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
                made[j] := owner;
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
                                  ukey, result_ttl, ttl_given)
                VALUES (p_ids[j], q, CASE WHEN p_delays[j] > 0 THEN 2 ELSE 0 END, p_prios[j],
                        base + j, p_payloads[j], 0, p_max[j], now_, avail, p_expires[j],
                        p_timeouts[j], uk, coalesce(p_ttls[j], p_ttl),
                        coalesce(p_given[j], false))
                ON CONFLICT (queue, ukey) WHERE ukey IS NOT NULL AND state IN (0, 1, 2, 4)
                DO NOTHING;
            EXIT WHEN FOUND;
            -- Its key is held: by which task (if that one has ended meanwhile, try again).
            SELECT t.id INTO owner FROM wq.tasks t
                WHERE t.queue = q AND t.ukey = uk AND t.state IN (0, 1, 2, 4);
            EXIT WHEN FOUND;
        END LOOP;
        IF owner IS NOT NULL THEN
            o_i := j; o_id := owner; o_dup := true; o_at := now_; o_available := NULL;
            made[j] := owner;
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF p_delays[j] > 0 THEN
            PERFORM wq.bump(q, enqueued => 1, delayed => 1);
        ELSE
            PERFORM wq.bump(q, enqueued => 1, ready => 1);
        END IF;
        made[j] := p_ids[j];
        fresh[j] := true;
        o_i := j; o_id := p_ids[j]; o_dup := false; o_at := now_; o_available := avail;
        o_state := CASE WHEN p_delays[j] > 0 THEN 2 ELSE 0 END; o_waiting := 0; o_error := NULL;
        RETURN NEXT;
    END LOOP;
    IF p_c IS NOT NULL THEN
        RETURN QUERY SELECT l.o_i, NULL::bigint, NULL::boolean, NULL::float8, l.o_available,
            l.o_state, l.o_waiting, l.o_error
            FROM wq.link(now_, made, fresh, p_delays, base, p_c, p_pos, p_parent, p_item) l;
    END IF;
    IF p_notify IS NOT NULL THEN
        PERFORM pg_notify('wq_ready', p_notify);
    END IF;
END $$;

-- A schedule's fire (docs/design/schedules.md), a compare-and-set: if schedule p_name is not
-- paused and its next_fire_at and revision are p_expected and p_revision (the row as the broker
-- read it), its task is enqueued as any (wq.enqueue, with the rest of the arguments: one task, no
-- key, no parents), marked with the schedule and p_scheduled (its scheduled time), and the row
-- moved on: next_fire_at p_next, last_fire_at p_scheduled, last_task_id, fires + 1; wq.enqueue's
-- row comes back. Else nothing (no row). A schedule row another transaction holds (another broker
-- firing it, a put) is skipped, not waited for: that one fires it, or changes it.
CREATE FUNCTION wq.fire(p_name text, p_expected float8, p_revision bigint, p_scheduled float8,
    p_next float8, p_now float8, p_ids bigint[], p_queues text[], p_prios int[],
    p_payloads bytea[], p_max int[], p_delays float8[], p_keys text[], p_untils float8[],
    p_notify text, p_expires float8[], p_timeouts float8[], p_uniques boolean[],
    p_ttl float8, p_ttls float8[], p_given boolean[])
RETURNS TABLE (o_i int, o_id bigint, o_dup boolean, o_at float8, o_available float8,
    o_state int, o_waiting int, o_error bytea)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM wq.schedules s
        WHERE s.name = p_name AND s.next_fire_at = p_expected AND s.revision = p_revision
        AND NOT s.paused
        FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM wq.enqueue(p_now, p_ids, p_queues, p_prios, p_payloads, p_max,
        p_delays, p_keys, p_untils, p_notify, p_expires, p_timeouts, p_uniques, p_ttl, p_ttls,
        p_given, NULL, NULL, NULL, NULL);
    UPDATE wq.tasks SET schedule = p_name, scheduled_for = p_scheduled WHERE id = p_ids[1];
    UPDATE wq.schedules SET next_fire_at = p_next, last_fire_at = p_scheduled,
        last_task_id = p_ids[1], fires = fires + 1
        WHERE name = p_name;
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

-- Ready, delayed and waiting tasks whose expiry has come by now_ (of the queues p_queues; NULL:
-- of all), dropped and counted expired: per queue, how many (o_queue, o_n); then what their ends
-- did (wq.ended: their waiting children buried), and the watched among them (o_id, o_st).
-- Rows another call holds are skipped (it may be dropping them too; the next sweep finds what is
-- left). Its cost is what is due (tasks_expiry holds only the tasks that expire).
CREATE FUNCTION wq.expire(now_ float8, p_queues text[])
RETURNS TABLE (o_queue text, o_n bigint, o_id bigint, o_st int)
LANGUAGE plpgsql AS $$
DECLARE
    qs text[];
    ns bigint[];
    ids bigint[];
    ks boolean[];
    ps int[];
    ws boolean[];
BEGIN
    WITH due AS (
        SELECT t.id FROM wq.tasks t
        WHERE t.state IN (0, 2, 4) AND t.expires_at IS NOT NULL AND t.expires_at <= now_
        AND (p_queues IS NULL OR t.queue = ANY(p_queues)) FOR UPDATE SKIP LOCKED),
    del AS (
        DELETE FROM wq.tasks t USING due d WHERE t.id = d.id
        RETURNING t.id, t.queue, t.state, t.kids, t.parents, t.watched),
    g AS (SELECT del.queue, count(*) AS n, count(*) FILTER (WHERE del.state = 0) AS r,
                 count(*) FILTER (WHERE del.state = 4) AS w
          FROM del GROUP BY del.queue),
    bump AS (
        INSERT INTO wq.counters AS k (slot, queue, expired, ready, delayed, waiting)
        SELECT pg_backend_pid(), g.queue, g.n, -g.r, g.r + g.w - g.n, -g.w FROM g
        ON CONFLICT (slot, queue) DO UPDATE SET expired = k.expired + excluded.expired,
            ready = k.ready + excluded.ready, delayed = k.delayed + excluded.delayed,
            waiting = k.waiting + excluded.waiting)
    SELECT (SELECT array_agg(g.queue) FROM g), (SELECT array_agg(g.n) FROM g),
           array_agg(d.id) FILTER (WHERE d.kids OR d.parents > 0 OR d.watched),
           array_agg(d.kids) FILTER (WHERE d.kids OR d.parents > 0 OR d.watched),
           array_agg(d.parents) FILTER (WHERE d.kids OR d.parents > 0 OR d.watched),
           array_agg(d.watched) FILTER (WHERE d.kids OR d.parents > 0 OR d.watched)
        INTO qs, ns, ids, ks, ps, ws FROM del d;
    RETURN QUERY SELECT u.q, u.n, NULL::bigint, NULL::int FROM unnest(qs, ns) AS u (q, n);
    IF ids IS NOT NULL THEN
        RETURN QUERY SELECT NULL::text, NULL::bigint, e.o_id, e.o_st
            FROM wq.ended(5, ids, ks, ps, ws, NULL, now_) e;
    END IF;
END $$;

-- Hand out up to array_length(p_leases) ready tasks of p_queues (in order of preference). A task
-- with a time limit has its deadline cut to it (and handed_at set). A task whose expiry has come
-- is never handed out: those of these queues are dropped first (wq.expire: only when some task
-- of the database has expired, one probe of tasks_expiry), and one met anyway (held by another
-- call when they were dropped) is dropped in place of its hand-out (one with children, parents
-- or a waiter is left to the next wq.expire, which sees to them). A task with parents comes with
-- them (o_after, in order) and the results they hold (o_results). Rows: first the queues in which
-- delayed tasks were promoted (o_rn NULL, o_queue), and the watched tasks that expired (o_rn
-- NULL, o_id, o_fin: 5; announced with p_head), then the tasks handed out (a task a schedule
-- fired with its schedule and scheduled time: o_schedule, o_scheduled).
--
-- Limits per queue (docs/design/schedules.md): the listed queues' rows are read once (a paused
-- one is passed over); those with limits are locked (FOR UPDATE, in name order, so that claims
-- over several of them never wait for each other in a cycle) until the transaction ends, and a
-- claim takes from such a queue at most what its bucket holds (brought up to date at now_, the
-- tokens taken written back) and what leaves it at most concurrency tasks handed out, then moves
-- on to the next queue. So the limits hold over every broker; a queue without limits is never
-- locked. For each limited queue it looked at, a row (o_rn NULL, o_fin -1, o_queue): o_attempts
-- 1 if its limits cut the claim short (ready tasks may be left), and o_deadline when its next
-- token comes, if the rate is what cut it (the broker's limit_hint).
CREATE FUNCTION wq.claim(p_now float8, p_leases float8[], p_lease_ids text[], p_queues text[],
    p_head text)
RETURNS TABLE (o_rn bigint, o_id bigint, o_payload bytea, o_attempts int, o_max int,
    o_created float8, o_available float8, o_error bytea, o_queue text, o_priority smallint,
    o_expires float8, o_timeout float8, o_deadline float8, o_ttl float8, o_after bigint[],
    o_results bytea[], o_fin int, o_schedule text, o_scheduled float8)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := wq.clock(p_now);
    base bigint;
    want int := coalesce(array_length(p_leases, 1), 0);
    got bigint := 0;
    n bigint;
    q text;
    fin_ids bigint[];
    fin_sts int[];
    paused text[];
    limited text[];
    ask int;
    lim int;
    r_tasks int;
    r_per float8;
    r_burst int;
    conc int;
    toks float8;
    at_ float8;
    held bigint;
    cut boolean;
    slack float8;
BEGIN
    IF EXISTS (SELECT 1 FROM wq.tasks t
               WHERE t.state IN (0, 2) AND t.expires_at IS NOT NULL AND t.expires_at <= now_) THEN
        SELECT array_agg(e.o_id), array_agg(e.o_st) INTO fin_ids, fin_sts
            FROM wq.expire(now_, p_queues) e WHERE e.o_id IS NOT NULL;
        IF fin_ids IS NOT NULL THEN
            PERFORM wq.tell(p_head, fin_ids, fin_sts);
            RETURN QUERY SELECT NULL::bigint, u.id, NULL::bytea, NULL::int, NULL::int,
                NULL::float8, NULL::float8, NULL::bytea, NULL::text, NULL::smallint,
                NULL::float8, NULL::float8, NULL::float8, NULL::float8, NULL::bigint[],
                NULL::bytea[], u.st, NULL::text, NULL::float8
                FROM unnest(fin_ids, fin_sts) AS u (id, st);
        END IF;
    END IF;
    -- First the queues in which delayed tasks were promoted (o_rn NULL): other consumers may
    -- want them.
    RETURN QUERY SELECT NULL::bigint, NULL::bigint, NULL::bytea, NULL::int, NULL::int,
        NULL::float8, NULL::float8, NULL::bytea, p.o_queue, NULL::smallint, NULL::float8,
        NULL::float8, NULL::float8, NULL::float8, NULL::bigint[], NULL::bytea[], NULL::int,
        NULL::text, NULL::float8
        FROM wq.promote(now_) p;
    base := nextval('wq.ord') * 1048576;
    SELECT array_agg(p.name) FILTER (WHERE p.paused),
           array_agg(p.name) FILTER (WHERE NOT p.paused
                                     AND (p.rate_tasks IS NOT NULL OR p.concurrency IS NOT NULL))
        INTO paused, limited FROM wq.queues p WHERE p.name = ANY(p_queues);
    IF limited IS NOT NULL THEN
        PERFORM 1 FROM wq.queues p WHERE p.name = ANY(limited) ORDER BY p.name FOR UPDATE;
        -- (The database's clock read again once the rows are this claim's: the claims of a
        -- limited queue then take its tokens in the order of their times.)
        now_ := wq.clock(p_now);
    END IF;
    FOREACH q IN ARRAY p_queues LOOP
        EXIT WHEN got >= want;
        CONTINUE WHEN q = ANY(paused);
        ask := want - got;
        lim := ask;
        IF q = ANY(limited) THEN
            -- (read again: locked now, as the last claim from it left it)
            SELECT p.rate_tasks, p.rate_per, p.rate_burst, p.concurrency, p.tokens, p.refilled_at
                INTO r_tasks, r_per, r_burst, conc, toks, at_ FROM wq.queues p WHERE p.name = q;
            IF r_tasks IS NOT NULL THEN
                at_ := coalesce(at_, now_);
                toks := least(r_burst::float8,
                              coalesce(toks, r_burst) + greatest(now_ - at_, 0) * r_tasks / r_per);
                at_ := greatest(at_, now_);
                -- (a token less what refills in a microsecond counts as one: times are floats)
                slack := least(1e-3, greatest(1e-9, r_tasks / r_per * 1e-6));
                lim := least(lim, floor(toks + slack)::int);
            END IF;
            IF conc IS NOT NULL THEN
                SELECT count(*) INTO held FROM (
                    SELECT 1 FROM wq.tasks t WHERE t.state = 1 AND t.queue = q LIMIT conc) s;
                lim := least(lim, greatest(conc - held, 0));
            END IF;
        END IF;
        -- (LIMIT 0, for a limited queue that allows nothing now: no row is looked at)
        RETURN QUERY
        WITH cand AS (
            SELECT t.id, t.priority, t.ord, t.expires_at,
                t.kids OR t.parents > 0 OR t.watched AS special
            FROM wq.tasks t
            WHERE t.state = 0 AND t.queue = q
            ORDER BY t.priority DESC, t.ord LIMIT lim
            FOR UPDATE SKIP LOCKED),
        live AS (
            SELECT c.id, got + row_number() OVER (ORDER BY c.priority DESC, c.ord) AS rn
            FROM cand c WHERE c.expires_at IS NULL OR c.expires_at > now_),
        gone AS (
            DELETE FROM wq.tasks t USING cand c
            WHERE t.id = c.id AND c.expires_at <= now_ AND NOT c.special
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
                t.deadline, CASE WHEN t.ttl_given THEN t.result_ttl END,
                CASE WHEN t.parents > 0 THEN (
                    SELECT array_agg(e.parent ORDER BY e.pos) FROM wq.edges e
                    WHERE e.child = t.id) END,
                CASE WHEN t.parents > 0 THEN (
                    SELECT array_agg(p.result ORDER BY e.pos) FROM wq.edges e
                    LEFT JOIN wq.tasks p ON p.id = e.parent AND p.state = 5
                    WHERE e.child = t.id) END,
                NULL::int, t.schedule, t.scheduled_for),
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
        IF q = ANY(limited) THEN
            IF r_tasks IS NOT NULL THEN
                toks := toks - n;
                UPDATE wq.queues p SET tokens = toks, refilled_at = at_ WHERE p.name = q;
            END IF;
            cut := lim < ask AND n >= lim AND (lim > 0 OR EXISTS (
                SELECT 1 FROM wq.tasks t WHERE t.state = 0 AND t.queue = q));
            RETURN QUERY SELECT NULL::bigint, NULL::bigint, NULL::bytea, cut::int, NULL::int,
                NULL::float8, NULL::float8, NULL::bytea, q, NULL::smallint, NULL::float8,
                NULL::float8,
                CASE WHEN cut AND r_tasks IS NOT NULL AND toks < 1 - slack
                          AND (conc IS NULL OR held + n < conc)
                     THEN at_ + (1 - toks) * r_per / r_tasks END,
                NULL::float8, NULL::bigint[], NULL::bytea[], -1, NULL::text, NULL::float8;
        END IF;
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
        progress = NULL, last_error = p_error, ord = p_ord, buried_at = now_ WHERE id = p_id;
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
--
-- p_results (NULL: no ack carries one, and the acks are what they were before results): an
-- ack's result (NULL: none). A task acked with one, and a result TTL above 0, is kept,
-- succeeded (5), until finished_at + its TTL; else it is gone, as any acked task. An acked task
-- with children releases them (wq.release_children): o_kind 2, per queue (o_queue), how many
-- became ready (o_outcome) and the earliest due time of those delayed (o_retry_at). A nacked one
-- buried, or dropped (it was cancelling), buries its waiting children (wq.ended). o_kind 3: a
-- watched task that ended (o_id; o_outcome: 1 succeeded, 2 acked, 3 dead, 4 cancelled),
-- announced with p_head. o_kind 4: a queue with a concurrency limit some of whose tasks were
-- settled (o_queue): slots are free again (docs/design/schedules.md; one probe of its row per
-- queue settled, in the statement that counts them).
CREATE FUNCTION wq.settle(p_now float8, p_ack_ids bigint[], p_ack_leases text[],
    p_ids bigint[], p_leases text[], p_errors bytea[], p_delays float8[], p_terminal boolean[],
    p_us float8[], p_reclaim boolean, p_base float8, p_cap float8, p_results bytea[],
    p_head text)
RETURNS TABLE (o_kind int, o_i int, o_outcome int, o_retry_at float8, o_id bigint,
    o_queue text)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := wq.clock(p_now);
    base bigint := nextval('wq.ord') * 1048576;
    q text;
    a int;
    m int;
    c boolean;
    kd boolean;
    np int;
    wt boolean;
    kept boolean;
    res bytea;
    done int[];
    -- Acked tasks whose end does more than their own change (they have children or parents, or
    -- are watched): their ids, those flags, and whether they are gone (else kept, succeeded).
    x_ids bigint[];
    x_kids boolean[];
    x_parents int[];
    x_watched boolean[];
    x_gone boolean[];
    fin_ids bigint[] := '{}';
    fin_sts int[] := '{}';
    -- Queues of tasks settled one by one, and those of them (or of the batch) that have a
    -- concurrency limit.
    touched text[];
    freed text[];
BEGIN
    IF (SELECT count(DISTINCT x) FROM unnest(p_ack_ids) x) = array_length(p_ack_ids, 1) THEN
        -- Acks of distinct tasks (the usual batch): as a set, counted once per queue.
        IF p_results IS NULL THEN
            WITH a AS (
                SELECT * FROM unnest(p_ack_ids, p_ack_leases) WITH ORDINALITY AS a(id, lease, i)),
            d AS (
                DELETE FROM wq.tasks t USING a
                WHERE t.id = a.id AND t.state = 1 AND t.lease_id = a.lease
                RETURNING a.i, t.id, t.queue, t.kids, t.parents, t.watched),
            g AS (SELECT d.queue, count(*) AS n FROM d GROUP BY d.queue),
            bump AS (
                INSERT INTO wq.counters AS k (slot, queue, acked, handed_out)
                SELECT pg_backend_pid(), g.queue, g.n, -g.n FROM g
                ON CONFLICT (slot, queue) DO UPDATE SET acked = k.acked + excluded.acked,
                    handed_out = k.handed_out + excluded.handed_out)
            SELECT array_agg(d.i),
                   array_agg(d.id) FILTER (WHERE d.kids OR d.parents > 0 OR d.watched),
                   array_agg(d.kids) FILTER (WHERE d.kids OR d.parents > 0 OR d.watched),
                   array_agg(d.parents) FILTER (WHERE d.kids OR d.parents > 0 OR d.watched),
                   array_agg(d.watched) FILTER (WHERE d.kids OR d.parents > 0 OR d.watched),
                   array_agg(true) FILTER (WHERE d.kids OR d.parents > 0 OR d.watched),
                   (SELECT array_agg(g.queue) FROM g WHERE EXISTS (
                        SELECT 1 FROM wq.queues p WHERE p.name = g.queue
                        AND p.concurrency IS NOT NULL))
                INTO done, x_ids, x_kids, x_parents, x_watched, x_gone, freed FROM d;
        ELSE
            WITH a AS (
                SELECT * FROM unnest(p_ack_ids, p_ack_leases, p_results)
                    WITH ORDINALITY AS a(id, lease, res, i)),
            s AS (
                UPDATE wq.tasks t SET state = 5, result = a.res, finished_at = now_,
                    deadline = now_ + coalesce(t.result_ttl, 3600), lease_id = NULL,
                    handed_at = NULL, progress = NULL, cancelling = false
                FROM a
                WHERE t.id = a.id AND t.state = 1 AND t.lease_id = a.lease
                AND a.res IS NOT NULL AND coalesce(t.result_ttl, 3600) > 0
                RETURNING a.i, t.id, t.queue, t.kids, t.parents, t.watched, false AS gone),
            d AS (
                DELETE FROM wq.tasks t USING a
                WHERE t.id = a.id AND t.state = 1 AND t.lease_id = a.lease
                AND (a.res IS NULL OR coalesce(t.result_ttl, 3600) <= 0)
                RETURNING a.i, t.id, t.queue, t.kids, t.parents, t.watched, true AS gone),
            b AS (SELECT * FROM s UNION ALL SELECT * FROM d),
            g AS (SELECT b.queue, count(*) AS n, count(*) FILTER (WHERE NOT b.gone) AS kept
                  FROM b GROUP BY b.queue),
            bump AS (
                INSERT INTO wq.counters AS k (slot, queue, acked, handed_out, succeeded)
                SELECT pg_backend_pid(), g.queue, g.n, -g.n, g.kept FROM g
                ON CONFLICT (slot, queue) DO UPDATE SET acked = k.acked + excluded.acked,
                    handed_out = k.handed_out + excluded.handed_out,
                    succeeded = k.succeeded + excluded.succeeded)
            SELECT array_agg(b.i),
                   array_agg(b.id) FILTER (WHERE b.kids OR b.parents > 0 OR b.watched),
                   array_agg(b.kids) FILTER (WHERE b.kids OR b.parents > 0 OR b.watched),
                   array_agg(b.parents) FILTER (WHERE b.kids OR b.parents > 0 OR b.watched),
                   array_agg(b.watched) FILTER (WHERE b.kids OR b.parents > 0 OR b.watched),
                   array_agg(b.gone) FILTER (WHERE b.kids OR b.parents > 0 OR b.watched),
                   (SELECT array_agg(g.queue) FROM g WHERE EXISTS (
                        SELECT 1 FROM wq.queues p WHERE p.name = g.queue
                        AND p.concurrency IS NOT NULL))
                INTO done, x_ids, x_kids, x_parents, x_watched, x_gone, freed FROM b;
        END IF;
        RETURN QUERY SELECT 0, a.i::int,
            CASE WHEN a.i = ANY(done) THEN 0 ELSE wq.miss(a.id) END, NULL::float8,
            NULL::bigint, NULL::text
            FROM unnest(p_ack_ids) WITH ORDINALITY AS a(id, i) ORDER BY a.i;
        p_ack_ids := '{}';
    END IF;
    FOR j IN 1..coalesce(array_length(p_ack_ids, 1), 0) LOOP
        o_kind := 0; o_i := j; o_retry_at := NULL; o_id := NULL; o_queue := NULL;
        res := CASE WHEN p_results IS NULL THEN NULL ELSE p_results[j] END;
        kept := false;
        IF res IS NOT NULL THEN
            UPDATE wq.tasks t SET state = 5, result = res, finished_at = now_,
                deadline = now_ + coalesce(t.result_ttl, 3600), lease_id = NULL,
                handed_at = NULL, progress = NULL, cancelling = false
                WHERE t.id = p_ack_ids[j] AND t.state = 1 AND t.lease_id = p_ack_leases[j]
                AND coalesce(t.result_ttl, 3600) > 0
                RETURNING t.queue, t.kids, t.parents, t.watched INTO q, kd, np, wt;
            kept := FOUND;
        END IF;
        IF kept THEN
            PERFORM wq.bump(q, acked => 1, handed_out => -1, succeeded => 1);
            o_outcome := 0;
        ELSE
            DELETE FROM wq.tasks t
                WHERE t.id = p_ack_ids[j] AND t.state = 1 AND t.lease_id = p_ack_leases[j]
                RETURNING t.queue, t.kids, t.parents, t.watched INTO q, kd, np, wt;
            IF FOUND THEN
                PERFORM wq.bump(q, acked => 1, handed_out => -1);
                o_outcome := 0;
            ELSE
                o_outcome := wq.miss(p_ack_ids[j]);
            END IF;
        END IF;
        IF o_outcome = 0 AND (kd OR np > 0 OR wt) THEN
            x_ids := x_ids || p_ack_ids[j]; x_kids := x_kids || kd; x_parents := x_parents || np;
            x_watched := x_watched || wt; x_gone := x_gone || NOT kept;
        END IF;
        IF o_outcome = 0 THEN
            touched := touched || q;
        END IF;
        RETURN NEXT;
    END LOOP;
    IF x_ids IS NOT NULL THEN
        -- Their children released (each waits for one parent fewer); their parents' results no
        -- longer pinned by them; the watched among them told.
        RETURN QUERY SELECT 2, NULL::int, r.o_ready::int, r.o_due, NULL::bigint, r.o_queue
            FROM wq.release_children(now_,
                ARRAY(SELECT u.id FROM unnest(x_ids, x_kids) AS u (id, k) WHERE u.k)) r;
        PERFORM wq.depart(ARRAY(SELECT u.id FROM unnest(x_ids, x_parents, x_gone) AS u (id, n, g)
                                WHERE u.n > 0 AND u.g), true);
        PERFORM wq.depart(ARRAY(SELECT u.id FROM unnest(x_ids, x_parents, x_gone) AS u (id, n, g)
                                WHERE u.n > 0 AND NOT u.g), false);
        SELECT fin_ids || array_agg(u.id), fin_sts || array_agg(CASE WHEN u.g THEN 2 ELSE 1 END)
            INTO fin_ids, fin_sts
            FROM unnest(x_ids, x_watched, x_gone) AS u (id, w, g) WHERE u.w;
    END IF;
    FOR j IN 1..coalesce(array_length(p_ids, 1), 0) LOOP
        SELECT t.attempts, t.max_attempts, t.queue, t.cancelling, t.kids, t.parents, t.watched
            INTO a, m, q, c, kd, np, wt FROM wq.tasks t
            WHERE t.id = p_ids[j] AND t.state = 1 AND t.lease_id = p_leases[j] FOR UPDATE;
        o_kind := 1; o_i := j; o_retry_at := NULL; o_id := NULL; o_queue := NULL;
        IF FOUND AND c THEN
            PERFORM wq.drop(p_ids[j], q);
            o_outcome := 3;
            touched := touched || q;
            IF kd OR np > 0 OR wt THEN
                SELECT fin_ids || array_agg(e.o_id), fin_sts || array_agg(e.o_st)
                    INTO fin_ids, fin_sts
                    FROM wq.ended(4, ARRAY[p_ids[j]], ARRAY[kd], ARRAY[np], ARRAY[wt], NULL,
                                  now_) e;
            END IF;
        ELSIF FOUND THEN
            o_outcome := 0;
            touched := touched || q;
            o_retry_at := wq.fail(p_ids[j], q, a, m, now_, p_errors[j], p_delays[j],
                p_terminal[j], p_us[j], p_reclaim, p_base, p_cap, base + j);
            IF o_retry_at IS NULL AND (kd OR wt) THEN
                SELECT fin_ids || array_agg(e.o_id), fin_sts || array_agg(e.o_st)
                    INTO fin_ids, fin_sts
                    FROM wq.ended(3, ARRAY[p_ids[j]], ARRAY[kd], ARRAY[np], ARRAY[wt],
                                  ARRAY[p_errors[j]], now_) e;
            END IF;
        ELSE
            o_outcome := wq.miss(p_ids[j]);
        END IF;
        RETURN NEXT;
    END LOOP;
    IF touched IS NOT NULL THEN
        freed := freed || ARRAY(SELECT p.name FROM wq.queues p
                                WHERE p.name = ANY(touched) AND p.concurrency IS NOT NULL);
    END IF;
    IF cardinality(freed) > 0 THEN
        RETURN QUERY SELECT DISTINCT 4, NULL::int, NULL::int, NULL::float8, NULL::bigint, u.q
            FROM unnest(freed) AS u (q);
    END IF;
    IF cardinality(fin_ids) > 0 THEN
        PERFORM wq.tell(p_head, fin_ids, fin_sts);
        RETURN QUERY SELECT 3, NULL::int, u.st, NULL::float8, u.id, NULL::text
            FROM unnest(fin_ids, fin_sts) AS u (id, st);
    END IF;
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

-- Its queue (no row if the lease is not current). A cancelling task is not put back: gone,
-- counted cancelled (as the Index does, its delivery stays counted), and what its end does
-- follows (wq.ended: rows o_queue NULL for the watched, announced with p_head).
CREATE FUNCTION wq.release(p_id bigint, p_lease_id text, p_head text, p_now float8)
RETURNS TABLE (o_queue text, o_id bigint, o_st int) LANGUAGE plpgsql AS $$
DECLARE
    q text;
    kd boolean;
    np int;
    wt boolean;
    fin_ids bigint[];
    fin_sts int[];
BEGIN
    UPDATE wq.tasks t SET state = 0, attempts = t.attempts - 1, lease_id = NULL,
        deadline = NULL, handed_at = NULL, progress = NULL, ord = -nextval('wq.ord') * 1048576
        WHERE t.id = p_id AND t.state = 1 AND t.lease_id = p_lease_id AND NOT t.cancelling
        RETURNING t.queue INTO q;
    IF FOUND THEN
        PERFORM wq.bump(q, delivered => -1, handed_out => -1, ready => 1);
        o_queue := q;
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT t.queue, t.kids, t.parents, t.watched INTO q, kd, np, wt FROM wq.tasks t
        WHERE t.id = p_id AND t.state = 1 AND t.lease_id = p_lease_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    PERFORM wq.drop(p_id, q);
    o_queue := q;
    RETURN NEXT;
    IF kd OR np > 0 OR wt THEN
        SELECT array_agg(e.o_id), array_agg(e.o_st) INTO fin_ids, fin_sts
            FROM wq.ended(4, ARRAY[p_id], ARRAY[kd], ARRAY[np], ARRAY[wt], NULL, p_now) e;
        PERFORM wq.tell(p_head, fin_ids, fin_sts);
        RETURN QUERY SELECT NULL::text, u.id, u.st FROM unnest(fin_ids, fin_sts) AS u (id, st);
    END IF;
END $$;

-- Reclaim up to array_length(p_us) expired leases (oldest deadline first: a cancelling task's is
-- not retried but gone, wq.drop), drop the ready, delayed and waiting tasks whose expiry has
-- come, promote what is due, prune the results whose time is up (at most 10000 a sweep; one a
-- live child still pins is looked at again a minute later, or as soon as that child leaves:
-- wq.depart), forget expired keys. o_kind 0: a reclaimed task (o_id, o_lease); 1: promoted
-- (o_queue, o_n); 8: expired (o_queue, o_n); 9: results pruned (o_n); 10: a watched task that
-- ended (o_id; o_n: 3 dead, 4 cancelled, 5 expired; announced with p_head); 11: a queue with a
-- concurrency limit one of whose leases ran out (o_queue: docs/design/schedules.md); 2: when the
-- next thing is due (o_due, NULL if nothing is scheduled); then, for the broker's hints: 3: each
-- queue known (o_queue; only if p_names); 4: how many tasks are held (o_n); 5: the database's
-- clock (o_due).
CREATE FUNCTION wq.sweep(p_now float8, p_us float8[], p_base float8, p_cap float8,
    p_names boolean, p_head text)
RETURNS TABLE (o_kind int, o_id bigint, o_lease text, o_queue text, o_n bigint, o_due float8)
LANGUAGE plpgsql AS $$
DECLARE
    now_ float8 := wq.clock(p_now);
    base bigint := nextval('wq.ord') * 1048576;
    j int := 0;
    r record;
    e record;
    fin_ids bigint[] := '{}';
    fin_sts int[] := '{}';
    pruned bigint;
    unlink bigint[];
    touched text[];
BEGIN
    FOR r IN SELECT t.id, t.lease_id, t.queue, t.attempts, t.max_attempts, t.cancelling,
                    t.kids, t.parents, t.watched,
                    -- its attempt's time limit, if that is where the lease ended (the words of
                    -- a Worker that stopped it), else 'lease expired'
                    convert_to(CASE WHEN t.timeout IS NOT NULL
                                         AND t.deadline >= t.handed_at + t.timeout
                                    THEN format('timed out after %s ms',
                                                round(t.timeout * 1000)::bigint)
                                    ELSE 'lease expired' END, 'UTF8') AS why
             FROM wq.tasks t
             WHERE t.state = 1 AND t.deadline <= now_ ORDER BY t.deadline, t.ord
             LIMIT coalesce(array_length(p_us, 1), 0) FOR UPDATE SKIP LOCKED LOOP
        j := j + 1;
        IF r.cancelling THEN
            PERFORM wq.drop(r.id, r.queue);
            IF r.kids OR r.parents > 0 OR r.watched THEN
                SELECT fin_ids || array_agg(x.o_id), fin_sts || array_agg(x.o_st)
                    INTO fin_ids, fin_sts
                    FROM wq.ended(4, ARRAY[r.id], ARRAY[r.kids], ARRAY[r.parents],
                                  ARRAY[r.watched], NULL, now_) x;
            END IF;
        ELSIF wq.fail(r.id, r.queue, r.attempts, r.max_attempts, now_,
                r.why, NULL, false, p_us[j], true, p_base, p_cap,
                base + j) IS NULL AND (r.kids OR r.watched) THEN
            SELECT fin_ids || array_agg(x.o_id), fin_sts || array_agg(x.o_st)
                INTO fin_ids, fin_sts
                FROM wq.ended(3, ARRAY[r.id], ARRAY[r.kids], ARRAY[r.parents], ARRAY[r.watched],
                              ARRAY[r.why], now_) x;
        END IF;
        o_kind := 0; o_id := r.id; o_lease := r.lease_id; o_queue := r.queue; o_n := NULL;
        o_due := NULL;
        RETURN NEXT;
        touched := touched || r.queue;
    END LOOP;
    IF touched IS NOT NULL THEN
        -- 11: a queue with a concurrency limit whose leases ran out: slots free again.
        RETURN QUERY SELECT 11, NULL::bigint, NULL::text, p.name, NULL::bigint, NULL::float8
            FROM wq.queues p WHERE p.name = ANY(touched) AND p.concurrency IS NOT NULL;
    END IF;
    IF EXISTS (SELECT 1 FROM wq.tasks t
               WHERE t.state IN (0, 2, 4) AND t.expires_at IS NOT NULL
               AND t.expires_at <= now_) THEN
        FOR e IN SELECT * FROM wq.expire(now_, NULL) LOOP
            IF e.o_id IS NULL THEN
                o_kind := 8; o_id := NULL; o_lease := NULL; o_queue := e.o_queue; o_n := e.o_n;
                o_due := NULL;
                RETURN NEXT;
            ELSE
                fin_ids := fin_ids || e.o_id;
                fin_sts := fin_sts || e.o_st;
            END IF;
        END LOOP;
    END IF;
    RETURN QUERY SELECT 1, NULL::bigint, NULL::text, p.o_queue, p.o_n, NULL::float8
        FROM wq.promote(now_) p;
    IF EXISTS (SELECT 1 FROM wq.tasks t WHERE t.state = 5 AND t.deadline <= now_) THEN
        WITH due AS (
            SELECT t.id FROM wq.tasks t WHERE t.state = 5 AND t.deadline <= now_
            ORDER BY t.deadline LIMIT 10000 FOR UPDATE SKIP LOCKED),
        pin AS (
            SELECT d.id FROM due d WHERE EXISTS (
                SELECT 1 FROM wq.edges x JOIN wq.tasks c ON c.id = x.child
                WHERE x.parent = d.id AND c.state <> 5)),
        later AS (
            UPDATE wq.tasks t SET deadline = now_ + 60 FROM pin WHERE t.id = pin.id),
        del AS (
            DELETE FROM wq.tasks t USING due d
            WHERE t.id = d.id AND d.id NOT IN (SELECT pin.id FROM pin)
            RETURNING t.id, t.queue, t.parents),
        g AS (SELECT del.queue, count(*) AS n FROM del GROUP BY del.queue),
        bump AS (
            INSERT INTO wq.counters AS k (slot, queue, succeeded)
            SELECT pg_backend_pid(), g.queue, -g.n FROM g
            ON CONFLICT (slot, queue) DO UPDATE SET succeeded = k.succeeded + excluded.succeeded)
        SELECT count(*), array_agg(del.id) FILTER (WHERE del.parents > 0) INTO pruned, unlink
            FROM del;
        IF unlink IS NOT NULL THEN
            DELETE FROM wq.edges x WHERE x.child = ANY(unlink);
        END IF;
        IF pruned > 0 THEN
            o_kind := 9; o_id := NULL; o_lease := NULL; o_queue := NULL; o_n := pruned;
            o_due := NULL;
            RETURN NEXT;
        END IF;
    END IF;
    DELETE FROM wq.keys k WHERE k.until <= now_;
    IF cardinality(fin_ids) > 0 THEN
        PERFORM wq.tell(p_head, fin_ids, fin_sts);
        RETURN QUERY SELECT 10, u.id, NULL::text, NULL::text, u.st::bigint, NULL::float8
            FROM unnest(fin_ids, fin_sts) AS u (id, st);
    END IF;
    RETURN QUERY SELECT 2, NULL::bigint, NULL::text, NULL::text, NULL::bigint, least(
        (SELECT min(t.available_at) FROM wq.tasks t WHERE t.state = 2),
        (SELECT min(t.deadline) FROM wq.tasks t WHERE t.state = 1),
        (SELECT min(t.expires_at) FROM wq.tasks t
         WHERE t.state IN (0, 2, 4) AND t.expires_at IS NOT NULL),
        (SELECT min(t.deadline) FROM wq.tasks t WHERE t.state = 5));
    IF p_names THEN
        RETURN QUERY SELECT 3, NULL::bigint, NULL::text, q.name, NULL::bigint, NULL::float8
            FROM wq.queues q;
    END IF;
    RETURN QUERY SELECT 4, NULL::bigint, NULL::text, NULL::text,
        coalesce(sum(k.ready + k.handed_out + k.delayed + k.waiting + k.succeeded), 0)::bigint,
        NULL::float8
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
                                        'wq.keys'::regclass, 'wq.edges'::regclass);
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
                                  dead, cancelled, expired, waiting, succeeded)
    SELECT 0, g.queue, sum(g.enqueued), sum(g.delivered), sum(g.acked), sum(g.nacked),
           sum(g.reclaimed), sum(g.retried), sum(g.buried), sum(g.requeued), sum(g.purged),
           sum(g.ready), sum(g.handed_out), sum(g.delayed), sum(g.dead), sum(g.cancelled),
           sum(g.expired), sum(g.waiting), sum(g.succeeded)
    FROM gone g GROUP BY g.queue
    ON CONFLICT (slot, queue) DO UPDATE SET
        enqueued = k.enqueued + excluded.enqueued, delivered = k.delivered + excluded.delivered,
        acked = k.acked + excluded.acked, nacked = k.nacked + excluded.nacked,
        reclaimed = k.reclaimed + excluded.reclaimed, retried = k.retried + excluded.retried,
        buried = k.buried + excluded.buried, requeued = k.requeued + excluded.requeued,
        purged = k.purged + excluded.purged, ready = k.ready + excluded.ready,
        handed_out = k.handed_out + excluded.handed_out, delayed = k.delayed + excluded.delayed,
        dead = k.dead + excluded.dead, cancelled = k.cancelled + excluded.cancelled,
        expired = k.expired + excluded.expired, waiting = k.waiting + excluded.waiting,
        succeeded = k.succeeded + excluded.succeeded;
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
            expires_at = NULL, ukey = NULL, ord = base + d.rn, buried_at = NULL
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

-- A dead task dropped for good (false: there is none); the results of its parents are no
-- longer pinned by it.
CREATE FUNCTION wq.purge(p_id bigint) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    q text;
    np int;
BEGIN
    DELETE FROM wq.tasks t WHERE t.id = p_id AND t.state = 3 RETURNING t.queue, t.parents
        INTO q, np;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM wq.bump(q, purged => 1, dead => -1);
    IF np > 0 THEN
        PERFORM wq.depart(ARRAY[p_id], true);
    END IF;
    RETURN true;
END $$;

-- Cancel a task (docs/design/control.md): o_outcome 0: no such task (or one succeeded: its
-- result is not a task to cancel); 1: it was ready, delayed or waiting, and is gone (cancelled);
-- 2: it is handed out, and cancelling now (or was already): o_lease is its holder's lease,
-- announced to the other brokers with the commit (p_notify, the payload's head, when any
-- listens: listener.py); 3: it was dead, and is purged. o_queue: its queue. What its end does
-- follows (docs/design/results.md): a waiting task's waiting children are cancelled too,
-- transitively (wq.cancel_tree); a ready or delayed one's are buried (wq.ended). Then a row per
-- watched task that ended (o_outcome NULL, o_id, o_st; announced with p_head).
CREATE FUNCTION wq.cancel(p_id bigint, p_notify text, p_head text, p_now float8)
RETURNS TABLE (o_outcome int, o_queue text, o_lease text, o_id bigint, o_st int)
LANGUAGE plpgsql AS $$
DECLARE
    st int;
    kd boolean;
    np int;
    wt boolean;
    fin_ids bigint[] := '{}';
    fin_sts int[] := '{}';
BEGIN
    SELECT t.state, t.queue, t.lease_id, t.kids, t.parents, t.watched
        INTO st, o_queue, o_lease, kd, np, wt FROM wq.tasks t
        WHERE t.id = p_id FOR UPDATE;
    IF NOT FOUND OR st = 5 THEN
        o_outcome := 0; o_queue := NULL; o_lease := NULL;
        RETURN NEXT;
        RETURN;
    ELSIF st = 1 THEN
        UPDATE wq.tasks t SET cancelling = true WHERE t.id = p_id AND NOT t.cancelling;
        IF p_notify IS NOT NULL THEN
            PERFORM pg_notify('wq_ready', p_notify || o_lease);
        END IF;
        o_outcome := 2;
        RETURN NEXT;
        RETURN;
    END IF;
    DELETE FROM wq.tasks t WHERE t.id = p_id;
    o_lease := NULL;
    IF st = 3 THEN
        PERFORM wq.bump(o_queue, purged => 1, dead => -1);
        IF np > 0 THEN
            PERFORM wq.depart(ARRAY[p_id], true);
        END IF;
        o_outcome := 3;
        RETURN NEXT;
        RETURN;
    ELSIF st = 0 THEN
        PERFORM wq.bump(o_queue, cancelled => 1, ready => -1);
    ELSIF st = 2 THEN
        PERFORM wq.bump(o_queue, cancelled => 1, delayed => -1);
    ELSE
        PERFORM wq.bump(o_queue, cancelled => 1, waiting => -1);
    END IF;
    o_outcome := 1;
    RETURN NEXT;
    IF st = 4 THEN
        IF kd THEN
            SELECT fin_ids || array_agg(x.o_id), fin_sts || array_agg(x.o_st)
                INTO fin_ids, fin_sts FROM wq.cancel_tree(ARRAY[p_id]) x;
        END IF;
        PERFORM wq.depart(ARRAY[p_id], true);
        IF wt THEN
            fin_ids := fin_ids || p_id;
            fin_sts := fin_sts || 4;
        END IF;
    ELSIF kd OR np > 0 OR wt THEN
        SELECT fin_ids || array_agg(x.o_id), fin_sts || array_agg(x.o_st)
            INTO fin_ids, fin_sts
            FROM wq.ended(4, ARRAY[p_id], ARRAY[kd], ARRAY[np], ARRAY[wt], NULL, p_now) x;
    END IF;
    IF cardinality(fin_ids) > 0 THEN
        PERFORM wq.tell(p_head, fin_ids, fin_sts);
        RETURN QUERY SELECT NULL::int, NULL::text, NULL::text, u.id, u.st
            FROM unnest(fin_ids, fin_sts) AS u (id, st);
    END IF;
END $$;

-- Every ready, delayed and waiting task of a queue dropped, counted cancelled, each as a cancel
-- would (the waiting ones first, with the tasks waiting for them, transitively, in any queue;
-- the children of the ready and delayed ones buried): how many were cancelled (o_n; no row if
-- the queue is unknown), then a row per watched task that ended (o_id, o_st; announced with p_head). Tasks a
-- claim is handing out meanwhile are waited for, and left to it.
CREATE FUNCTION wq.empty(p_queue text, p_head text, p_now float8)
RETURNS TABLE (o_n bigint, o_id bigint, o_st int) LANGUAGE plpgsql AS $$
DECLARE
    r bigint;
    d bigint;
    w bigint := 0;
    roots bigint[];
    gone bigint[];
    seen bigint[];
    ids bigint[];
    ks boolean[];
    ps int[];
    ws boolean[];
    fin_ids bigint[] := '{}';
    fin_sts int[] := '{}';
BEGIN
    IF NOT EXISTS (SELECT 1 FROM wq.queues q WHERE q.name = p_queue) THEN
        RETURN;
    END IF;
    SELECT array_agg(l.id) INTO roots FROM (
        SELECT t.id FROM wq.tasks t WHERE t.queue = p_queue AND t.state = 4
        ORDER BY t.id FOR UPDATE) l;
    IF roots IS NOT NULL THEN
        roots := roots || wq.descendants(roots);
        WITH del AS (
            DELETE FROM wq.tasks t WHERE t.id = ANY(roots) AND t.state = 4
            RETURNING t.id, t.queue, t.watched),
        g AS (SELECT x.queue, count(*) AS n FROM del x GROUP BY x.queue),
        bump AS (
            INSERT INTO wq.counters AS k (slot, queue, cancelled, waiting)
            SELECT pg_backend_pid(), g.queue, g.n, -g.n FROM g
            ON CONFLICT (slot, queue) DO UPDATE SET cancelled = k.cancelled + excluded.cancelled,
                waiting = k.waiting + excluded.waiting)
        SELECT count(*), array_agg(x.id),
               array_agg(x.id) FILTER (WHERE x.watched)
            INTO w, gone, seen FROM del x;
        PERFORM wq.depart(gone, true);
        IF seen IS NOT NULL THEN
            fin_ids := fin_ids || seen;
            fin_sts := fin_sts || array_fill(4, ARRAY[cardinality(seen)]);
        END IF;
    END IF;
    WITH r0 AS (
        DELETE FROM wq.tasks t WHERE t.queue = p_queue AND t.state = 0
        RETURNING t.id, t.kids, t.parents, t.watched),
    d2 AS (
        DELETE FROM wq.tasks t WHERE t.queue = p_queue AND t.state = 2
        RETURNING t.id, t.kids, t.parents, t.watched),
    b AS (SELECT * FROM r0 UNION ALL SELECT * FROM d2)
    SELECT (SELECT count(*) FROM r0), (SELECT count(*) FROM d2),
           array_agg(b.id) FILTER (WHERE b.kids OR b.parents > 0 OR b.watched),
           array_agg(b.kids) FILTER (WHERE b.kids OR b.parents > 0 OR b.watched),
           array_agg(b.parents) FILTER (WHERE b.kids OR b.parents > 0 OR b.watched),
           array_agg(b.watched) FILTER (WHERE b.kids OR b.parents > 0 OR b.watched)
        INTO r, d, ids, ks, ps, ws FROM b;
    IF r + d > 0 THEN
        PERFORM wq.bump(p_queue, cancelled => r + d, ready => -r, delayed => -d);
    END IF;
    IF ids IS NOT NULL THEN
        SELECT fin_ids || array_agg(x.o_id), fin_sts || array_agg(x.o_st)
            INTO fin_ids, fin_sts FROM wq.ended(4, ids, ks, ps, ws, NULL, p_now) x;
    END IF;
    o_n := r + d + w;
    RETURN NEXT;
    IF cardinality(fin_ids) > 0 THEN
        PERFORM wq.tell(p_head, fin_ids, fin_sts);
        RETURN QUERY SELECT NULL::bigint, u.id, u.st FROM unnest(fin_ids, fin_sts) AS u (id, st);
    END IF;
END $$;

-- Forget a queue that holds nothing (results aside): its row in wq.queues (its paused flag), its
-- results (succeeded tasks), and its counter rows, whose totals go to the row of no queue ('':
-- no queue has that name), so the broker's totals keep them. o_found false: no such queue; else
-- o_ready .. o_dead, o_waiting are its gauges, and it was forgotten only if they are all 0.
-- Enqueues to it in flight are waited for (the lock each holds on its queue: wq.enqueue), and so
-- is a fold of counter rows (wq.fold).
CREATE FUNCTION wq.delete_queue(p_queue text)
RETURNS TABLE (o_found boolean, o_ready bigint, o_handed_out bigint, o_delayed bigint,
    o_dead bigint, o_waiting bigint) LANGUAGE plpgsql AS $$
DECLARE
    unlink bigint[];
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
           coalesce(sum(k.delayed), 0), coalesce(sum(k.dead), 0), coalesce(sum(k.waiting), 0)
        INTO o_ready, o_handed_out, o_delayed, o_dead, o_waiting
        FROM wq.counters k WHERE k.queue = p_queue;
    IF o_ready <> 0 OR o_handed_out <> 0 OR o_delayed <> 0 OR o_dead <> 0 OR o_waiting <> 0 THEN
        RETURN NEXT;
        RETURN;
    END IF;
    WITH s AS (
        DELETE FROM wq.tasks t WHERE t.queue = p_queue AND t.state = 5
        RETURNING t.id, t.parents)
    SELECT array_agg(s.id) FILTER (WHERE s.parents > 0) INTO unlink FROM s;
    IF unlink IS NOT NULL THEN
        DELETE FROM wq.edges e WHERE e.child = ANY(unlink);
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

-- A task marked watched if it is still pending (ready, handed out, delayed, waiting), so that its
-- end is told (by whichever broker ends it: it reads the flag in the same change), then the task
-- as it is now (read after the mark: an end committed meanwhile is seen here, a later one sees
-- the mark). No row if there is no such task.
CREATE FUNCTION wq.watch(p_id bigint) RETURNS SETOF wq.tasks LANGUAGE plpgsql AS $$
BEGIN
    UPDATE wq.tasks t SET watched = true
        WHERE t.id = p_id AND t.state IN (0, 1, 2, 4) AND NOT t.watched;
    RETURN QUERY SELECT * FROM wq.tasks t WHERE t.id = p_id;
END $$;
