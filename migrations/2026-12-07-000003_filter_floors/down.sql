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
