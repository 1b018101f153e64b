-- After an independent review of the head pins (migration head_pins):
-- - postbox.finish_heads skips the heads still pinned before it counts to its limit (a thousand
--   heads kept for one open writer no longer hide the others, whose writers are done).
-- - The writer lock of an ordered key is the key's own (a 64-bit hash of topic and key), not one
--   of 256 slots: two writers of unrelated keys never wait for each other, so a writer that
--   pinned a head is never held (and that head kept) by a writer of another key, and no session
--   can block every ordered insert by taking 256 advisory locks.
-- - postbox.promote_due locks FOR NO KEY UPDATE: a head in backoff that a writer pins is due all
--   the same.
-- - A head kept for its writer beside the follower a held batch leased at its end is no
--   double head.
CREATE FUNCTION postbox.key_writer_lock(p_topic text, p_key text) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT hashtextextended(p_topic || E'\x1f' || p_key, 1886352244) $$;

CREATE OR REPLACE FUNCTION postbox.lock_keys(p_topics text[], p_keys text[]) RETURNS bigint
    LANGUAGE sql
    AS $$
    SELECT count(pg_advisory_xact_lock(k.h))
    FROM (SELECT DISTINCT postbox.key_writer_lock(t, k) AS h FROM unnest(p_topics, p_keys) AS u(t, k) ORDER BY 1) k
$$;

CREATE OR REPLACE FUNCTION postbox.messages_before_insert() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'postbox', 'pg_temp'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    v_head record;
BEGIN
    IF TG_RELID <> 'postbox.messages'::regclass THEN
        RAISE EXCEPTION 'permission denied: postbox''s trigger % runs on postbox.messages only', TG_NAME
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF NOT NEW.ordered THEN
        NEW.state := postbox.ready_state(NEW.run_at);
        RETURN NEW;
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'postbox: ordered messages must be enqueued in a READ COMMITTED transaction (the order of a key is decided as writers commit), not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'feature_not_supported';
    END IF;
    PERFORM pg_advisory_xact_lock(postbox.key_writer_lock(NEW.topic, NEW.key));
    -- 'keep': the trigger's WHEN found that the inserting role may insert ids (a replay).
    IF TG_ARGV[0] IS DISTINCT FROM 'keep' THEN
        NEW.id := nextval('postbox.messages_id_seq');
    END IF;
    LOOP
        -- A new statement sees every earlier writer of the key: they committed before we got the
        -- lock.
        SELECT id, state INTO v_head FROM postbox.messages
        WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting'
        ORDER BY id DESC LIMIT 1;
        EXIT WHEN NOT FOUND;
        IF v_head.id > NEW.id THEN
            -- A replay of an older message: back in front of a head that has not started (locked
            -- here, demoted by messages_after_replay once the row is in)...
            PERFORM 1 FROM postbox.messages
            WHERE id = v_head.id AND state IN ('available', 'scheduled')
            FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                NEW.state := postbox.ready_state(NEW.run_at);
                RETURN NEW;
            END IF;
            IF v_head.state NOT IN ('available', 'scheduled') THEN
                -- ...but not behind one that runs: it stays dead (the replay reports it skipped)
                -- and can be replayed once that head is settled...
                RETURN NULL;
            END IF;
            -- ...and behind one that a claim or a held batch has locked (it is starting), pinned
            -- below like any head a message goes behind.
        END IF;
        -- The pin: the head stays until this transaction ends (whoever settles it meanwhile
        -- leaves it in place, see kept_head_lease). Waits only for a settle deleting it right
        -- now; then the key has a new head, or none: look again.
        PERFORM 1 FROM postbox.messages
        WHERE id = v_head.id AND state::text <> 'waiting'
        FOR KEY SHARE;
        IF FOUND THEN
            NEW.state := 'waiting';
            RETURN NEW;
        END IF;
    END LOOP;
    IF EXISTS (SELECT 1 FROM postbox.messages
               WHERE state = 'waiting' AND topic = NEW.topic AND key = NEW.key) THEN
        -- Waiting messages and no head: a stranded key (an operator's SQL can make one). It goes
        -- behind them; the relay's repair gives the key its head.
        NEW.state := 'waiting';
    ELSE
        NEW.state := postbox.ready_state(NEW.run_at);
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION postbox.finish_heads(p_limit integer) RETURNS TABLE(finished integer, still_kept integer)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    v_topics text[];
    v_keys text[];
    v_ids bigint[];
    v_left integer;
BEGIN
    -- SKIP LOCKED before LIMIT: heads still pinned are passed over in the scan, however many,
    -- and those whose writers are done are reached.
    v_ids := ARRAY(
        SELECT id FROM postbox.messages
        WHERE state = 'running' AND locked_until = postbox.kept_head_lease() AND lease_token = 0
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED);
    IF cardinality(v_ids) < p_limit THEN
        -- (One whose lease an operator's SQL moved: rescues leave it alone.)
        v_ids := v_ids || ARRAY(
            SELECT id FROM postbox.messages
            WHERE state = 'running' AND locked_until < now() AND lease_token = 0
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
         LIMIT 10000)
        UNION ALL
        (SELECT 1 FROM postbox.messages
         WHERE state = 'running' AND locked_until < now() AND lease_token = 0
         LIMIT 10000)) k;
    RETURN QUERY SELECT coalesce(cardinality(v_ids), 0), v_left;
END
$$;

CREATE OR REPLACE FUNCTION postbox.promote_due(p_limit integer) RETURNS TABLE(promoted integer, next_due_secs double precision)
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
        WHERE state = 'scheduled' AND run_at <= now()
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
            FROM postbox.messages WHERE state = 'scheduled' AND run_at > now());
END
$$;

CREATE OR REPLACE FUNCTION postbox.check_invariants(p_limit integer DEFAULT 1000) RETURNS TABLE(kind text, topic text, key text, detail text)
    LANGUAGE sql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
    (SELECT 'stranded_key'::text, s.topic, s.key,
            (SELECT count(*) FROM postbox.messages w
             WHERE w.state = 'waiting' AND w.topic = s.topic AND w.key = s.key)::text || ' waiting'
     FROM postbox.stranded_keys(p_limit) s)
    UNION ALL
    (SELECT 'double_head'::text, h.topic, h.key,
            count(*)::text || ' heads: ' || string_agg(h.id::text || ' ' || h.state::text, ', ' ORDER BY h.id)
     FROM postbox.messages h
     -- A head kept for its writer (lease token 0) beside the next one a held batch leased is
     -- no double head: it is delivered, and nothing is promoted past the writer's message.
     WHERE h.ordered AND h.state <> 'waiting' AND h.lease_token IS DISTINCT FROM 0
     GROUP BY h.topic, h.key
     HAVING count(*) > 1
     LIMIT p_limit)
    UNION ALL
    (SELECT 'hold_over_limit'::text, NULL::text, NULL::text,
            format('held by %s for %s (limit %s), %s messages', h.held_by,
                   date_trunc('second', now() - h.held_at), coalesce(h.hold_limit, interval '60 seconds'),
                   cardinality(h.ids))
     FROM postbox.holds h
     WHERE h.held_at < now() - coalesce(h.hold_limit, interval '60 seconds') - interval '5 seconds'
       AND pg_xact_status(h.xid) = 'in progress'
     LIMIT p_limit)
$$;

