-- Back to the previous model: pending = locked_until IS NULL (scheduled and waiting messages are
-- pending again; per-key order is derived from ids by the previous claim).
ALTER TABLE postbox.listeners RESET (
    autovacuum_vacuum_threshold, autovacuum_vacuum_scale_factor, autovacuum_vacuum_cost_delay
);
DROP TABLE postbox.samples;
DROP FUNCTION postbox.promote_due(integer);
DROP FUNCTION postbox.claim_topic(text, integer, double precision, bigint, text);
DROP FUNCTION postbox.available_topics(boolean, text[], text[], text[], text[]);
DROP TRIGGER messages_heads_promoted ON postbox.messages;
DROP FUNCTION postbox.promote_removed_heads();
DROP TRIGGER messages_head_removed ON postbox.messages;
DROP FUNCTION postbox.note_removed_head();
DROP TRIGGER messages_check_head ON postbox.messages;
DROP FUNCTION postbox.messages_check_head();
DROP TRIGGER messages_state ON postbox.messages;
DROP FUNCTION postbox.messages_before_insert();
DROP FUNCTION postbox.promote_key(text, text);
DROP FUNCTION postbox.lock_keys(text[], text[]);

CREATE OR REPLACE FUNCTION postbox.claim(
    p_batch integer,
    p_lease_secs double precision,
    p_all_topics boolean,
    p_topics text[],
    p_patterns text[],
    p_not_topics text[],
    p_not_patterns text[],
    p_token bigint,
    p_owner text
) RETURNS SETOF postbox.messages
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
AS $$
BEGIN
    RETURN QUERY
    WITH picked AS (
        SELECT m.id
        FROM postbox.messages m
        WHERE m.locked_until IS NULL
          AND m.run_at <= now()
          AND (p_all_topics OR m.topic = ANY(p_topics) OR m.topic LIKE ANY(p_patterns))
          AND NOT (m.topic = ANY(p_not_topics) OR m.topic LIKE ANY(p_not_patterns))
          AND (NOT m.ordered OR NOT EXISTS (
                SELECT 1 FROM postbox.messages e
                WHERE e.ordered AND e.topic = m.topic AND e.key = m.key AND e.id < m.id))
        ORDER BY m.priority, m.id
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    )
    UPDATE postbox.messages m
    SET attempts = m.attempts + 1,
        locked_until = now() + make_interval(secs => p_lease_secs),
        lease_token = p_token,
        locked_by = p_owner
    FROM picked
    WHERE m.id = picked.id
    RETURNING m.*;
END
$$;

DROP INDEX postbox.messages_stalled_idx;
DROP INDEX postbox.messages_heads_idx;
DROP INDEX postbox.messages_waiting_idx;
CREATE INDEX messages_ordered_idx ON postbox.messages (topic, key, id) WHERE ordered;
DROP INDEX postbox.messages_running_idx;
DROP INDEX postbox.messages_scheduled_idx;
DROP INDEX postbox.messages_available_idx;
CREATE INDEX messages_claim_idx ON postbox.messages (priority, id) WHERE locked_until IS NULL;
CREATE INDEX messages_lease_idx ON postbox.messages (locked_until) WHERE locked_until IS NOT NULL;

ALTER TABLE postbox.messages
    DROP CONSTRAINT messages_waiting_ordered,
    DROP CONSTRAINT messages_state_lease;
ALTER TABLE postbox.messages DROP COLUMN state;
DROP FUNCTION postbox.ready_state(timestamptz);
DROP FUNCTION postbox.key_lock_id(text, text);
DROP TYPE postbox.message_state;
