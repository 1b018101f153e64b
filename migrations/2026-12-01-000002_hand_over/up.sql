-- Per-key hand-over, and the settle path reshaped around it. The state model (previous
-- migration) is upgraded in place: only functions and triggers change, no row is touched.

-- Hand-over: when a relay delivers the head of an ordered key, the next message of the key goes
-- straight to that relay (waiting → running, one update) instead of becoming available for the
-- next claim (waiting → available → running, two updates and a claim round trip per message).
-- A key stays with the relay that is draining it while that relay has room; the rest are promoted
-- as before and any relay may claim them.
--
-- The next waiting message of each (topic, key) whose head (id p_removed) was removed moves out of
-- `waiting` (locks, look-up after the removed id, "no head yet" check, as described below);
-- the first p_limit of the next messages that are due are leased to the caller (p_token, p_owner,
-- p_lease_secs; the attempt counts, as a claim's does) and returned. p_limit = 0 is
-- exactly promote_after.
CREATE FUNCTION postbox.hand_over(
    p_topics text[],
    p_keys text[],
    p_removed bigint[],
    p_limit integer,
    p_lease_secs double precision,
    p_token bigint,
    p_owner text
) RETURNS SETOF postbox.messages
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    v_timeout text;
BEGIN
    IF coalesce(cardinality(p_topics), 0) = 0 THEN
        RETURN;
    END IF;
    v_timeout := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', '200ms', true);
    PERFORM pg_advisory_xact_lock_shared(1886352245, s.slot)
    FROM (SELECT DISTINCT postbox.key_lock_id(t, k) AS slot
          FROM unnest(p_topics, p_keys) AS u(t, k) ORDER BY 1) s;
    PERFORM set_config('lock_timeout', v_timeout, true);
    RETURN QUERY
    WITH nxt AS (
        SELECT w.id, w.run_at <= now() AS due
        FROM (SELECT t AS topic, k AS key, max(r) AS removed
              FROM unnest(p_topics, p_keys, p_removed) AS u(t, k, r) GROUP BY 1, 2) rk,
             LATERAL (SELECT w.id, w.run_at FROM postbox.messages w
                      WHERE w.state = 'waiting' AND w.topic = rk.topic AND w.key = rk.key
                        AND w.id > rk.removed
                      ORDER BY w.id LIMIT 1) w
        WHERE (SELECT h.id FROM postbox.messages h
               WHERE h.ordered AND h.topic = rk.topic AND h.key = rk.key AND h.id > rk.removed
                 AND h.state <> 'waiting'
               ORDER BY h.id LIMIT 1) IS NULL
    ),
    ranked AS (
        SELECT id, due AND row_number() OVER (PARTITION BY due ORDER BY id) <= p_limit AS take
        FROM nxt
    ),
    moved AS (
        UPDATE postbox.messages m
        SET state = CASE WHEN r.take THEN 'running'::postbox.message_state
                         ELSE postbox.ready_state(m.run_at) END,
            attempts = m.attempts + r.take::integer,
            locked_until = CASE WHEN r.take THEN now() + make_interval(secs => p_lease_secs) END,
            lease_token = CASE WHEN r.take THEN p_token END,
            locked_by = CASE WHEN r.take THEN p_owner END
        FROM ranked r
        WHERE m.id = r.id
        RETURNING m AS message, r.take
    )
    SELECT (moved.message).* FROM moved WHERE moved.take;
END
$$;

-- Promotion without hand-over: what every other remover of heads calls (the relay's retry,
-- dead-letter and rescue statements; the triggers below for any other DELETE). Returns how many
-- messages it handed over: none.
CREATE FUNCTION postbox.promote_after(p_topics text[], p_keys text[], p_removed bigint[])
RETURNS integer
LANGUAGE sql
AS $$ SELECT count(*)::integer FROM postbox.hand_over(p_topics, p_keys, p_removed, 0, 1, 0, '') $$;

-- Any other DELETE of heads: a row trigger notes their keys (no query) and a statement trigger
-- promotes them all at once when the DELETE ends. Sessions that promote themselves (the relay's
-- store sets postbox.promotes_heads = 'caller') skip both.
CREATE OR REPLACE FUNCTION postbox.promote_removed_heads() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    v_noted text := current_setting('postbox.removed_heads', true);
    v_keys jsonb;
BEGIN
    IF v_noted IS NULL OR v_noted = '' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('postbox.removed_heads', '', true);
    v_keys := ('[' || rtrim(v_noted, ',') || ']')::jsonb;
    PERFORM postbox.promote_after(
        ARRAY(SELECT k->>0 FROM jsonb_array_elements(v_keys) AS e(k)),
        ARRAY(SELECT k->>1 FROM jsonb_array_elements(v_keys) AS e(k)),
        ARRAY(SELECT (k->>2)::bigint FROM jsonb_array_elements(v_keys) AS e(k)));
    RETURN NULL;
END
$$;

DROP TRIGGER messages_head_removed ON postbox.messages;
CREATE TRIGGER messages_head_removed AFTER DELETE ON postbox.messages
    FOR EACH ROW WHEN (OLD.ordered AND OLD.state <> 'waiting'
                       AND current_setting('postbox.promotes_heads', true) IS DISTINCT FROM 'caller')
    EXECUTE FUNCTION postbox.note_removed_head();

DROP TRIGGER messages_heads_promoted ON postbox.messages;
CREATE TRIGGER messages_heads_promoted AFTER DELETE ON postbox.messages
    FOR EACH STATEMENT
    WHEN (current_setting('postbox.promotes_heads', true) IS DISTINCT FROM 'caller')
    EXECUTE FUNCTION postbox.promote_removed_heads();

-- Exact topic names are no longer probed before the claim (the claim finds an empty topic at the
-- same cost).
CREATE OR REPLACE FUNCTION postbox.available_topics(
    p_all_topics boolean,
    p_topics text[],
    p_patterns text[],
    p_not_topics text[],
    p_not_patterns text[]
) RETURNS text[]
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    IF NOT p_all_topics AND cardinality(p_patterns) = 0 THEN
        -- Exact names are not probed: the claim itself finds an empty topic at the same cost.
        RETURN ARRAY(
            SELECT t FROM unnest(p_topics) AS u(t)
            WHERE NOT (t = ANY(p_not_topics) OR t LIKE ANY(p_not_patterns)));
    END IF;
    RETURN ARRAY(
        WITH RECURSIVE d(topic) AS (
            SELECT (SELECT m.topic FROM postbox.messages m WHERE m.state = 'available'
                    ORDER BY m.topic LIMIT 1)
            UNION ALL
            SELECT (SELECT m.topic FROM postbox.messages m WHERE m.state = 'available' AND m.topic > d.topic
                    ORDER BY m.topic LIMIT 1)
            FROM d WHERE d.topic IS NOT NULL
        )
        SELECT topic FROM d
        WHERE topic IS NOT NULL
          AND (p_all_topics OR topic = ANY(p_topics) OR topic LIKE ANY(p_patterns))
          AND NOT (topic = ANY(p_not_topics) OR topic LIKE ANY(p_not_patterns)));
END
$$;

-- The next due time is NULL when nothing is scheduled (greatest(…, 0) made it 0: a busy loop).
CREATE OR REPLACE FUNCTION postbox.promote_due(p_limit integer)
RETURNS TABLE (promoted integer, next_due_secs double precision)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
DECLARE
    v_n integer;
BEGIN
    WITH due AS (
        SELECT id FROM postbox.messages
        WHERE state = 'scheduled' AND run_at <= now()
        ORDER BY run_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE postbox.messages m SET state = 'available' FROM due WHERE m.id = due.id;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n > 0 THEN
        PERFORM postbox.wake();
    END IF;
    RETURN QUERY
    SELECT v_n,
           -- NULL when nothing is scheduled (greatest() would turn it into 0: a busy loop).
           (SELECT extract(epoch FROM min(run_at) - now())::float8
            FROM postbox.messages WHERE state = 'scheduled' AND run_at > now());
END
$$;
