-- Back to the state model as its migration left it. Handed-over messages are ordinary running
-- messages (leased, attempt counted): no row needs converting.
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
           (SELECT greatest(extract(epoch FROM min(run_at) - now()), 0)::float8
            FROM postbox.messages WHERE state = 'scheduled' AND run_at > now());
END
$$;

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
        RETURN ARRAY(
            SELECT t FROM unnest(p_topics) AS u(t)
            WHERE NOT (t = ANY(p_not_topics) OR t LIKE ANY(p_not_patterns))
              AND EXISTS (SELECT 1 FROM postbox.messages m WHERE m.state = 'available' AND m.topic = u.t));
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

DROP TRIGGER messages_heads_promoted ON postbox.messages;
CREATE TRIGGER messages_heads_promoted AFTER DELETE ON postbox.messages
    FOR EACH STATEMENT EXECUTE FUNCTION postbox.promote_removed_heads();

DROP TRIGGER messages_head_removed ON postbox.messages;
CREATE TRIGGER messages_head_removed AFTER DELETE ON postbox.messages
    FOR EACH ROW WHEN (OLD.ordered AND OLD.state <> 'waiting')
    EXECUTE FUNCTION postbox.note_removed_head();

CREATE OR REPLACE FUNCTION postbox.promote_removed_heads() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    v_noted text := current_setting('postbox.removed_heads', true);
    v_timeout text;
    v_keys jsonb;
BEGIN
    IF v_noted IS NULL OR v_noted = '' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('postbox.removed_heads', '', true);
    v_keys := ('[' || rtrim(v_noted, ',') || ']')::jsonb;
    v_timeout := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', '200ms', true);
    PERFORM pg_advisory_xact_lock(1886352245, s.slot)
    FROM (SELECT DISTINCT postbox.key_lock_id(k->>0, k->>1) AS slot
          FROM jsonb_array_elements(v_keys) AS e(k) ORDER BY 1) s;
    PERFORM set_config('lock_timeout', v_timeout, true);
    -- A new statement after the locks: it sees every writer of these keys that committed before.
    -- The next message of a key has a larger id than the head that was removed (writers draw ids
    -- after the key's lock, and a replay never goes behind a running head), so the look-up starts
    -- there: the index entries of the key's delivered history are not in its path.
    UPDATE postbox.messages m SET state = postbox.ready_state(m.run_at)
    FROM (SELECT k->>0 AS topic, k->>1 AS key, max((k->>2)::bigint) AS removed
          FROM jsonb_array_elements(v_keys) AS e(k) GROUP BY 1, 2) rk,
         LATERAL (SELECT w.id FROM postbox.messages w
                  WHERE w.state = 'waiting' AND w.topic = rk.topic AND w.key = rk.key
                    AND w.id > rk.removed
                  ORDER BY w.id LIMIT 1) nxt
    WHERE m.id = nxt.id
      AND (SELECT h.id FROM postbox.messages h
           WHERE h.ordered AND h.topic = rk.topic AND h.key = rk.key AND h.id > rk.removed
             AND h.state <> 'waiting'
           ORDER BY h.id LIMIT 1) IS NULL;
    RETURN NULL;
END
$$;

DROP FUNCTION postbox.promote_after(text[], text[], bigint[]);
DROP FUNCTION postbox.hand_over(text[], text[], bigint[], integer, double precision, bigint, text);
