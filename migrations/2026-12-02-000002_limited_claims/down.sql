-- Back to the limited claim of 2026-12-01-000007 (its body as it was).
CREATE OR REPLACE FUNCTION postbox.claim_limited(p_limit text, p_max integer, p_per_key boolean, p_limit_all boolean, p_limit_topics text[], p_limit_patterns text[], p_batch integer, p_lease_secs double precision, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    v_topics text[];
    v_topic text;
    v_room integer;
    v_got integer := 0;
    v_n integer;
BEGIN
    IF p_batch <= 0 OR p_max <= 0 THEN
        RETURN;
    END IF;
    v_topics := ARRAY(
        SELECT t FROM unnest(postbox.available_topics(p_limit_all, p_limit_topics, p_limit_patterns,
                                                      p_not_topics, p_not_patterns)) AS u(t)
        WHERE p_all_topics OR t = ANY(p_topics) OR t LIKE ANY(p_patterns));
    IF coalesce(cardinality(v_topics), 0) = 0 THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(1886352246, hashtext(p_limit));
    IF NOT p_per_key THEN
        SELECT p_max - count(*) INTO v_room
        FROM postbox.messages m
        WHERE m.state = 'running'
          AND (p_limit_all OR m.topic = ANY(p_limit_topics) OR m.topic LIKE ANY(p_limit_patterns));
        v_room := least(v_room, p_batch);
        IF v_room <= 0 THEN
            RETURN;
        END IF;
        RETURN QUERY SELECT * FROM postbox.claim(v_room, p_lease_secs, false, v_topics, '{}', '{}', '{}',
                                                 p_token, p_owner);
        RETURN;
    END IF;
    -- Per key: topic by topic, the available messages of keys below the limit, in (priority, id)
    -- order, as many of each key as its room. Messages without a key count as one key. Each
    -- topic's statement sees what the ones before claimed.
    FOREACH v_topic IN ARRAY v_topics LOOP
        EXIT WHEN v_got >= p_batch;
        RETURN QUERY
        WITH running AS (
            SELECT m.key, count(*) AS n
            FROM postbox.messages m
            WHERE m.state = 'running'
              AND (p_limit_all OR m.topic = ANY(p_limit_topics) OR m.topic LIKE ANY(p_limit_patterns))
            GROUP BY m.key
        ),
        candidates AS (
            SELECT m.id, m.key, m.priority
            FROM postbox.messages m
            WHERE m.state = 'available' AND m.topic = v_topic
              AND NOT EXISTS (SELECT 1 FROM running r
                              WHERE r.key IS NOT DISTINCT FROM m.key AND r.n >= p_max)
            ORDER BY m.priority, m.id
            LIMIT (p_batch - v_got) * 4
            FOR UPDATE SKIP LOCKED
        ),
        picked AS (
            SELECT c.id
            FROM (SELECT c.id, c.key, c.priority,
                         row_number() OVER (PARTITION BY c.key ORDER BY c.priority, c.id) AS rn
                  FROM candidates c) c
            LEFT JOIN running r ON r.key IS NOT DISTINCT FROM c.key
            WHERE coalesce(r.n, 0) + c.rn <= p_max
            ORDER BY c.priority, c.id
            LIMIT p_batch - v_got
        )
        UPDATE postbox.messages m
        SET state = 'running',
            attempts = m.attempts + 1,
            locked_until = now() + make_interval(secs => p_lease_secs),
            lease_token = p_token,
            locked_by = p_owner
        FROM picked
        WHERE m.id = picked.id
        RETURNING m.*;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
    END LOOP;
END
$$;

DROP FUNCTION postbox.limit_topics(boolean, text[], text[]);
DROP INDEX postbox.messages_available_key_idx;
DROP INDEX postbox.messages_running_topic_idx;
