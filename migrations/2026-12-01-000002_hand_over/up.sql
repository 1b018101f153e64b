-- Settlers take the key slots' commit lock (namespace 2) shared: they only need to exclude the
-- commit check of writers (which takes it exclusive), not each other, so settle statements of
-- different batches run side by side instead of queueing on the slots their keys share.
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
    PERFORM pg_advisory_xact_lock_shared(1886352245, s.slot)
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

-- Hand-over: when a relay delivers the head of an ordered key, the next message of the key goes
-- straight to that relay (waiting → running, one update) instead of becoming available for the
-- next claim (waiting → available → running, two updates and a claim round trip per message).
-- A key stays with the relay that is draining it while that relay has room; the rest are promoted
-- as before and any relay may claim them.
--
-- Same steps as postbox.promote_after (locks, look-up after the removed id, "no head yet" check);
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
