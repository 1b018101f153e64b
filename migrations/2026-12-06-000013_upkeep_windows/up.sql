-- The upkeep's walks start where the caller's previous pass ended.
--
-- postbox.finish_heads' look for kept heads whose lease an operator moved and postbox.promote_due
-- walk an index from its front: `messages_running_idx (locked_until)` up to now, and
-- `messages_scheduled_idx (run_at)` up to now. While something pins the xmin horizon (a long
-- report, a session left idle in a transaction, a slot), every message that passed through those
-- states since the pin leaves an index entry there that each walk steps over: the walks grow with
-- the pin, and the scheduler walks ten times a second. These versions take the low end of the walk
-- (`NULL`: the whole index, which the caller still does from time to time for rows committed late
-- or skipped while locked) and return the `now()` they walked up to, for the caller's next pass.
-- The one-argument versions stay for relays of the previous release.
--
-- Each walk also names its index's order (ORDER BY locked_until, with sorts off): under a pin,
-- after an ANALYZE that saw no live running row, the planner took messages_running_topic_idx
-- (topic, key) for the finish's looks and filtered on locked_until, reading every running entry
-- the pin kept (120,000 a look, five looks per tick, four minutes into a pin at 800/s).

CREATE FUNCTION postbox.finish_heads(p_limit integer, p_expired_from timestamptz)
    RETURNS TABLE(finished integer, still_kept integer, walked_to double precision)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    v_topics text[];
    v_keys text[];
    v_ids bigint[];
    v_left integer;
    v_from timestamptz := coalesce(p_expired_from, '-infinity'::timestamptz);
BEGIN
    -- SKIP LOCKED before LIMIT: heads still pinned are passed over in the scan, however many,
    -- and those whose writers are done are reached.
    v_ids := ARRAY(
        SELECT id FROM postbox.messages
        WHERE state = 'running' AND locked_until = postbox.kept_head_lease() AND lease_token = 0
        ORDER BY locked_until
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED);
    IF cardinality(v_ids) < p_limit THEN
        -- (One whose lease an operator's SQL moved: rescues leave it alone.)
        v_ids := v_ids || ARRAY(
            SELECT id FROM postbox.messages
            WHERE state = 'running' AND locked_until >= v_from AND locked_until < now()
              AND lease_token = 0
            ORDER BY locked_until
            LIMIT p_limit - cardinality(v_ids)
            FOR UPDATE SKIP LOCKED);
    END IF;
    WITH gone AS (
        DELETE FROM postbox.messages m WHERE m.id = ANY(v_ids)
        RETURNING m.topic, m.key, m.id
    )
    SELECT array_agg(topic), array_agg(key), array_agg(id) INTO v_topics, v_keys, v_ids FROM gone;
    IF current_setting('postbox.promotes_heads', true) IS NOT DISTINCT FROM 'caller' THEN
        -- (Otherwise the delete's own trigger has promoted.)
        PERFORM postbox.promote_after(v_topics, v_keys, v_ids);
    END IF;
    IF coalesce(cardinality(v_ids), 0) > 0 THEN
        PERFORM postbox.wake();
    END IF;
    SELECT count(*) INTO v_left FROM (
        (SELECT 1 FROM postbox.messages
         WHERE state = 'running' AND locked_until = postbox.kept_head_lease() AND lease_token = 0
         ORDER BY locked_until
         LIMIT 10000)
        UNION ALL
        (SELECT 1 FROM postbox.messages
         WHERE state = 'running' AND locked_until >= v_from AND locked_until < now()
           AND lease_token = 0
         ORDER BY locked_until
         LIMIT 10000)) k;
    RETURN QUERY SELECT coalesce(cardinality(v_ids), 0), v_left, extract(epoch FROM now())::float8;
END
$$;

CREATE FUNCTION postbox.promote_due(p_limit integer, p_due_from timestamptz)
    RETURNS TABLE(promoted integer, next_due_secs double precision, walked_to double precision)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    v_n integer;
BEGIN
    WITH due AS (
        SELECT id FROM postbox.messages
        WHERE state = 'scheduled' AND run_at >= coalesce(p_due_from, '-infinity'::timestamptz)
          AND run_at <= now()
        ORDER BY run_at
        LIMIT p_limit
        FOR NO KEY UPDATE SKIP LOCKED
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
            FROM postbox.messages WHERE state = 'scheduled' AND run_at > now()),
           extract(epoch FROM now())::float8;
END
$$;
