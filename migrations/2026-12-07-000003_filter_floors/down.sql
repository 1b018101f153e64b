-- Back to the narrowing of the migration it was last defined in (descents unbounded above).
CREATE OR REPLACE FUNCTION postbox.narrow_topics(p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_max integer) RETURNS text[]
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
    AS $$
DECLARE
    v_out text[] := '{}';
    v_pattern text;
    v_prefix text;
    v_walk text[];
    v_walked integer;
BEGIN
    IF p_all_topics OR cardinality(p_topics) + cardinality(p_patterns) = 0 THEN
        RETURN NULL;
    END IF;
    IF cardinality(p_patterns) > 0 AND NOT postbox.bytewise_topics() THEN
        RETURN NULL;
    END IF;
    v_out := ARRAY(SELECT DISTINCT t FROM unnest(p_topics) AS u(t)
                   WHERE NOT (t = ANY(p_not_topics) OR t LIKE ANY(p_not_patterns)));
    FOREACH v_pattern IN ARRAY p_patterns LOOP
        -- The literal text before the first wildcard, unescaped: the topics that can match lie
        -- in one range of the topic index, walked one descent per topic, p_max + 1 at most.
        v_prefix := regexp_replace(substring(v_pattern FROM '^((?:[^%_\\]|\\.)*)'), '\\(.)', '\1', 'g');
        IF v_prefix = '' THEN
            RETURN NULL;
        END IF;
        SELECT array_agg(d.topic), count(*) INTO v_walk, v_walked
        FROM (WITH RECURSIVE d(topic) AS (
                  SELECT (SELECT m.topic FROM postbox.messages m
                          WHERE m.state = 'available' AND m.topic >= v_prefix ORDER BY m.topic LIMIT 1)
                  UNION ALL
                  SELECT (SELECT m.topic FROM postbox.messages m
                          WHERE m.state = 'available' AND m.topic > d.topic ORDER BY m.topic LIMIT 1)
                  FROM d WHERE starts_with(d.topic, v_prefix))
              SELECT d.topic FROM d WHERE starts_with(d.topic, v_prefix) LIMIT p_max + 1) d;
        IF v_walked > p_max THEN
            RETURN NULL;
        END IF;
        v_out := v_out || ARRAY(SELECT t FROM unnest(v_walk) AS u(t)
                                WHERE t LIKE v_pattern AND NOT t = ANY(v_out)
                                  AND NOT (t = ANY(p_not_topics) OR t LIKE ANY(p_not_patterns)));
    END LOOP;
    IF cardinality(v_out) > p_max THEN
        RETURN NULL;
    END IF;
    RETURN v_out;
END
$$;

-- Back to the claim of the migration ready_sets (filters through postbox.pick).
CREATE OR REPLACE FUNCTION postbox.claim(p_batch integer, p_lease_secs double precision, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    IF p_all_topics AND cardinality(p_not_topics) = 0 AND cardinality(p_not_patterns) = 0 THEN
        RETURN QUERY SELECT * FROM postbox.claim_ready(NULL, p_batch, p_lease_secs, p_token, p_owner);
        RETURN;
    END IF;
    IF NOT p_all_topics AND cardinality(p_patterns) = 0 AND cardinality(p_topics) <= 16 THEN
        RETURN QUERY SELECT * FROM postbox.take_set(
            ARRAY(SELECT t FROM unnest(p_topics) AS u(t)
                  WHERE NOT (t = ANY(p_not_topics) OR t LIKE ANY(p_not_patterns))),
            p_batch, p_lease_secs, p_token, p_owner);
        RETURN;
    END IF;
    RETURN QUERY
    UPDATE postbox.messages m
    SET state = 'running',
        attempts = m.attempts + 1,
        locked_until = now() + make_interval(secs => p_lease_secs),
        lease_token = p_token,
        locked_by = p_owner
    WHERE m.id = ANY(ARRAY(SELECT p.id FROM postbox.pick(p_batch, p_all_topics, p_topics, p_patterns,
                                                         p_not_topics, p_not_patterns) p))
    RETURNING m.*;
END
$$;

DROP FUNCTION postbox.take_matching(boolean, text[], text[], text[], text[], integer, double precision, bigint, text, text);
DROP FUNCTION postbox.filter_floors_setting(boolean, text[], text[], text[], text[]);
