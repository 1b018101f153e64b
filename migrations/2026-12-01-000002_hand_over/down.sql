-- Messages handed over are ordinary running messages (leased, attempt counted): nothing to convert.
DROP FUNCTION postbox.hand_over(text[], text[], bigint[], integer, double precision, bigint, text);

-- Settlers exclude each other again.
CREATE OR REPLACE FUNCTION postbox.promote_after(p_topics text[], p_keys text[], p_removed bigint[])
RETURNS integer
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    v_timeout text;
    v_n integer;
BEGIN
    IF coalesce(cardinality(p_topics), 0) = 0 THEN
        RETURN 0;
    END IF;
    v_timeout := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', '200ms', true);
    PERFORM pg_advisory_xact_lock(1886352245, s.slot)
    FROM (SELECT DISTINCT postbox.key_lock_id(t, k) AS slot
          FROM unnest(p_topics, p_keys) AS u(t, k) ORDER BY 1) s;
    PERFORM set_config('lock_timeout', v_timeout, true);
    -- A new statement after the locks: it sees every writer of these keys that committed before.
    -- The next message of a key has a larger id than the head that was removed (writers draw ids
    -- after the key's lock, and a replay never goes behind a running head), so the look-up starts
    -- there: the index entries of the key's delivered history are not in its path.
    UPDATE postbox.messages m SET state = postbox.ready_state(m.run_at)
    FROM (SELECT t AS topic, k AS key, max(r) AS removed
          FROM unnest(p_topics, p_keys, p_removed) AS u(t, k, r) GROUP BY 1, 2) rk,
         LATERAL (SELECT w.id FROM postbox.messages w
                  WHERE w.state = 'waiting' AND w.topic = rk.topic AND w.key = rk.key
                    AND w.id > rk.removed
                  ORDER BY w.id LIMIT 1) nxt
    WHERE m.id = nxt.id
      AND (SELECT h.id FROM postbox.messages h
           WHERE h.ordered AND h.topic = rk.topic AND h.key = rk.key AND h.id > rk.removed
             AND h.state <> 'waiting'
           ORDER BY h.id LIMIT 1) IS NULL;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
