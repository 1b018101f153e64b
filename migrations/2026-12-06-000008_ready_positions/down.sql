-- Back to the claim of every topic from the front of (priority, id).
CREATE OR REPLACE FUNCTION postbox.claim(p_batch integer, p_lease_secs double precision, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
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
CREATE OR REPLACE FUNCTION postbox.claim_topic(p_topic text, p_batch integer, p_lease_secs double precision, p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    RETURN QUERY
    WITH picked AS (
        SELECT m.id
        FROM postbox.messages m
        WHERE m.state = 'available' AND m.topic = p_topic
        ORDER BY m.priority, m.id
        LIMIT p_batch
        FOR NO KEY UPDATE SKIP LOCKED
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
END
$$;
DROP FUNCTION postbox.claim_ready(text, integer, double precision, bigint, text, text);
DROP FUNCTION postbox.claim_floors_setting(text);
DROP TRIGGER messages_ready ON postbox.messages;
DROP TRIGGER messages_ready_insert ON postbox.messages;
DROP FUNCTION postbox.messages_ready();
DROP INDEX postbox.messages_ready_idx;
DROP INDEX postbox.messages_ready_topic_idx;
ALTER TABLE postbox.messages DROP COLUMN ready_xid;
