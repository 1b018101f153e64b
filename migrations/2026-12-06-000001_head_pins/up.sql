-- Head pins: a settle never waits on a writer, and no role below relay can hold up another key.
--
-- Until now the hand-over of an ordered key between a writer and a settle was serialised by the
-- key's promotion slot (advisory lock 1886352245, 256 slots): a waiting message's commit check
-- held its slot exclusively from the check to the end of its commit, and a settle that removed a
-- head waited for the slot shared, 200 ms at most, then failed — rolling back a whole held batch.
-- One bulk commit of 5,000 keys held every slot for seconds; a writer that ran SET CONSTRAINTS ALL
-- IMMEDIATE held one for as long as it liked; any role could take one by hand.
--
-- Now the writer pins the head its message goes behind: its insert takes the head's row FOR KEY
-- SHARE (messages_before_insert, as the schema's owner), held until the writer's transaction
-- ends. A pinned head cannot be deleted before the writer is done, so whoever removes a head it
-- could lock FOR UPDATE sees every message behind it, committed; and a head it cannot lock (a
-- writer of its key is still open) is not waited for: the settle (the store's statements, which
-- try each head FOR UPDATE SKIP LOCKED) leaves it in place as a delivered head — running, lease
-- token 0, locked until 'infinity' — and the key keeps it as its head until postbox.finish_heads
-- deletes it and promotes the next message, once the writer is done (a relay runs it before its
-- next claim and on every maintenance tick). Only the writer's own
-- keys wait for its commit. FOR KEY SHARE conflicts with nothing a claim or a hold takes: claims
-- and holds now lock their rows FOR NO KEY UPDATE, so a writer never waits for a delivery either,
-- only for a settle's own short transaction deleting the head it found. Row locks on
-- postbox.messages are for roles with UPDATE on it (the relay, the operator): no writer and no
-- role that can merely connect can take them.
--
-- The commit check of a waiting message is gone, but for a replay of dead letters (the ids it
-- keeps need it); promote_keys takes no lock. A replay keeps its ids only when the role that
-- runs it — the current one, SET ROLE included — may insert ids: the trigger's WHEN decides,
-- evaluated as that role (the trigger functions themselves run as the owner).

-- The lease of a head whose removal waits for a writer of its key: delivered (its dead letter or
-- archive written), kept in place — running, lease token 0 — until postbox.finish_heads takes it
-- out. Rescues leave it alone; no claim can take it; its key promotes nothing past it.
CREATE FUNCTION postbox.kept_head_lease() RETURNS timestamptz
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT 'infinity'::timestamptz $$;

CREATE OR REPLACE FUNCTION postbox.messages_before_insert() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, postbox, pg_temp
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
    PERFORM pg_advisory_xact_lock(1886352244, postbox.key_lock_id(NEW.topic, NEW.key));
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

-- The replays' check at commit (a replay keeps its ids): a replayed message that went behind a
-- head which has not started after all goes back in front of it; one that still waits is
-- marked for the promotion after that head (it is older than the head: not found after it).
CREATE OR REPLACE FUNCTION postbox.messages_check_head() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, postbox, pg_temp
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
    SELECT id, state INTO v_head FROM postbox.messages
    WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting'
    ORDER BY id DESC LIMIT 1;
    IF NOT FOUND THEN
        PERFORM count(*) FROM postbox.promote_keys(ARRAY[NEW.topic], ARRAY[NEW.key], ARRAY[NULL::bigint],
                                                   true, 0, 1, 0, '');
    ELSIF v_head.id > NEW.id AND v_head.state IN ('available', 'scheduled')
          AND EXISTS (SELECT 1 FROM postbox.messages WHERE id = NEW.id AND state::text = 'waiting') THEN
        -- Not waited for: a head that a claim or a held batch has locked is starting, and the
        -- replayed message stays behind it.
        PERFORM 1 FROM postbox.messages
        WHERE id = v_head.id AND state IN ('available', 'scheduled')
        FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            UPDATE postbox.messages SET state = 'waiting' WHERE id = v_head.id;
            UPDATE postbox.messages
            SET state = CASE WHEN run_at > statement_timestamp() THEN 'scheduled'::postbox.message_state
                             ELSE 'available'::postbox.message_state END
            WHERE id = NEW.id;
            RETURN NULL;
        END IF;
    END IF;
    IF EXISTS (SELECT 1 FROM postbox.messages WHERE id = NEW.id AND state::text = 'waiting') THEN
        INSERT INTO postbox.behind (topic, key, id) VALUES (NEW.topic, NEW.key, NEW.id)
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION postbox.messages_after_replay() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, postbox, pg_temp
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    IF TG_RELID <> 'postbox.messages'::regclass THEN
        RAISE EXCEPTION 'permission denied: postbox''s trigger % runs on postbox.messages only', TG_NAME
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    -- The trigger's WHEN found that the inserting role may insert ids (a replay).
    UPDATE postbox.messages SET state = 'waiting'
    WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting' AND state <> 'running'
      AND id > NEW.id;
    RETURN NULL;
END
$$;

-- Whether an insert keeps its ids, decided in each trigger's WHEN, which runs as the inserting
-- role (current_user: the role a replay SET ROLE to, or logged in as): postbox.keep_ids set, and
-- the right to insert ids. A writer has neither that right nor a way around it.
DROP TRIGGER messages_state ON postbox.messages;
DROP TRIGGER messages_after_replay ON postbox.messages;
DROP TRIGGER messages_check_head ON postbox.messages;
DROP FUNCTION postbox.keeps_ids();

CREATE TRIGGER messages_state BEFORE INSERT ON postbox.messages FOR EACH ROW
    WHEN ((new.ordered OR new.run_at > now())
          AND (current_setting('postbox.keep_ids', true) IS DISTINCT FROM 'on'
               OR NOT pg_catalog.has_column_privilege('postbox.messages', 'id', 'INSERT')))
    EXECUTE FUNCTION postbox.messages_before_insert();
CREATE TRIGGER messages_state_keep BEFORE INSERT ON postbox.messages FOR EACH ROW
    WHEN ((new.ordered OR new.run_at > now())
          AND current_setting('postbox.keep_ids', true) = 'on'
          AND pg_catalog.has_column_privilege('postbox.messages', 'id', 'INSERT'))
    EXECUTE FUNCTION postbox.messages_before_insert('keep');
CREATE TRIGGER messages_after_replay AFTER INSERT ON postbox.messages FOR EACH ROW
    WHEN (new.ordered AND new.state <> 'waiting'
          AND current_setting('postbox.keep_ids', true) = 'on'
          AND pg_catalog.has_column_privilege('postbox.messages', 'id', 'INSERT'))
    EXECUTE FUNCTION postbox.messages_after_replay();
CREATE CONSTRAINT TRIGGER messages_check_head AFTER INSERT ON postbox.messages
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (new.ordered AND new.state = 'waiting'
          AND current_setting('postbox.keep_ids', true) = 'on'
          AND pg_catalog.has_column_privilege('postbox.messages', 'id', 'INSERT'))
    EXECUTE FUNCTION postbox.messages_check_head();

-- Kept heads (see kept_head_lease) whose writers are done: deleted, and the next message of
-- each key promoted (a relay calls this after a wake-up and on every maintenance tick; safe on
-- every relay at once). Returns how many it finished, and how many are still kept (pinned).
CREATE FUNCTION postbox.finish_heads(p_limit integer)
    RETURNS TABLE (finished integer, still_kept integer)
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
    WITH done AS (
        SELECT id FROM postbox.messages
        WHERE id = ANY(ARRAY(
            (SELECT id FROM postbox.messages
             WHERE state = 'running' AND locked_until = postbox.kept_head_lease() AND lease_token = 0
             LIMIT p_limit)
            UNION ALL
            -- (One whose lease an operator's SQL moved: rescues leave it alone.)
            (SELECT id FROM postbox.messages
             WHERE state = 'running' AND locked_until < now() AND lease_token = 0
             LIMIT p_limit)))
          AND state = 'running' AND lease_token = 0
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ),
    gone AS (
        DELETE FROM postbox.messages m USING done WHERE m.id = done.id
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

-- The one promotion, without the promotion slots: a head removed here was locked FOR UPDATE by its
-- remover, so no writer is still open behind it (see kept_head_lease). p_exclusive is not used.
CREATE OR REPLACE FUNCTION postbox.promote_keys(p_topics text[], p_keys text[], p_removed bigint[], p_exclusive boolean, p_limit integer, p_lease_secs double precision, p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    v_topics text[];
    v_keys text[];
    v_bounds bigint[];
    v_left_topics text[];
    v_left_keys text[];
    v_left_bounds bigint[];
    v_taken integer := 0;
    v_round integer := 0;
    v_row record;
BEGIN
    IF coalesce(cardinality(p_topics), 0) = 0 THEN
        RETURN;
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'postbox: ordered keys are settled in READ COMMITTED transactions only, not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'feature_not_supported';
    END IF;

    SELECT array_agg(t ORDER BY t, k), array_agg(k ORDER BY t, k), array_agg(r ORDER BY t, k)
    INTO v_topics, v_keys, v_bounds
    FROM (SELECT t, k, max(r) AS r FROM unnest(p_topics, p_keys, p_removed) AS u(t, k, r)
          WHERE k IS NOT NULL GROUP BY 1, 2) s;

    WHILE coalesce(cardinality(v_topics), 0) > 0 LOOP
        v_round := v_round + 1;
        IF v_round > 1000 THEN
            -- Every round that leaves a key means another transaction changed its first waiting
            -- message and committed: this is not reached in practice. The repair finds the key.
            RAISE WARNING 'postbox: gave up promoting % keys after 1000 rounds', cardinality(v_topics);
            RETURN;
        END IF;
        v_left_topics := '{}';
        v_left_keys := '{}';
        v_left_bounds := '{}';
        FOR v_row IN
            WITH nxt AS (
                SELECT rk.topic, rk.key, rk.removed, w.id, w.run_at <= statement_timestamp() AS due
                FROM unnest(v_topics, v_keys, v_bounds) AS rk(topic, key, removed),
                     LATERAL (SELECT c.id, c.run_at
                              FROM ((SELECT w.id, w.run_at FROM postbox.messages w
                                     WHERE w.state = 'waiting' AND w.topic = rk.topic AND w.key = rk.key
                                       AND w.id > coalesce(rk.removed, 0)
                                     ORDER BY w.id LIMIT 1)
                                    UNION ALL
                                    (SELECT w.id, w.run_at FROM postbox.behind b
                                     JOIN postbox.messages w ON w.id = b.id AND w.state::text = 'waiting'
                                     WHERE b.topic = rk.topic AND b.key = rk.key AND rk.removed IS NOT NULL
                                     ORDER BY b.id LIMIT 1)) c
                              ORDER BY c.id LIMIT 1) w
                WHERE CASE WHEN rk.removed IS NULL THEN
                          (SELECT h.id FROM postbox.messages h
                           WHERE h.ordered AND h.topic = rk.topic AND h.key = rk.key
                             AND h.state <> 'waiting'
                           ORDER BY h.id DESC LIMIT 1) IS NULL
                      ELSE
                          (SELECT h.id FROM postbox.messages h
                           WHERE h.ordered AND h.topic = rk.topic AND h.key = rk.key
                             AND h.state <> 'waiting' AND h.id > rk.removed
                           ORDER BY h.id LIMIT 1) IS NULL
                      END
            ),
            ranked AS (
                SELECT id,
                       due AND row_number() OVER (PARTITION BY due ORDER BY id) <= p_limit - v_taken AS take
                FROM nxt
            ),
            moved AS (
                UPDATE postbox.messages m
                -- Due as of this statement, not of the transaction's start (a hold's transaction
                -- began before the messages written while it was open).
                SET state = CASE WHEN r.take THEN 'running'::postbox.message_state
                                 WHEN m.run_at > statement_timestamp() THEN 'scheduled'::postbox.message_state
                                 ELSE 'available'::postbox.message_state END,
                    attempts = m.attempts + r.take::integer,
                    locked_until = CASE WHEN r.take THEN now() + make_interval(secs => p_lease_secs) END,
                    lease_token = CASE WHEN r.take THEN p_token END,
                    locked_by = CASE WHEN r.take THEN p_owner END
                FROM ranked r
                -- By primary key: with `state = 'waiting'` the planner may read all of
                -- messages_waiting_idx instead, on a table it has no statistics for yet.
                WHERE m.id = r.id AND m.state::text = 'waiting'
                RETURNING m AS message, r.id, r.take
            )
            SELECT n.topic, n.key, n.removed, mv.message, mv.take, mv.id IS NOT NULL AS moved
            FROM nxt n LEFT JOIN moved mv ON mv.id = n.id
        LOOP
            IF NOT v_row.moved THEN
                v_left_topics := v_left_topics || v_row.topic;
                v_left_keys := v_left_keys || v_row.key;
                v_left_bounds := v_left_bounds || v_row.removed;
            ELSIF v_row.take THEN
                v_taken := v_taken + 1;
                RETURN NEXT v_row.message;
            END IF;
        END LOOP;
        v_topics := v_left_topics;
        v_keys := v_left_keys;
        v_bounds := v_left_bounds;
    END LOOP;
    -- Marks of messages no longer waiting (promoted, deleted) go.
    IF EXISTS (SELECT 1 FROM postbox.behind) THEN
        DELETE FROM postbox.behind b
        USING unnest(p_topics, p_keys) AS u(t, k)
        WHERE b.topic = u.t AND b.key = u.k
          AND NOT EXISTS (SELECT 1 FROM postbox.messages m WHERE m.id = b.id AND m.state::text = 'waiting');
    END IF;
END
$$;

-- Claims and holds lock their rows FOR NO KEY UPDATE: a writer's pin (FOR KEY SHARE) on the head
-- it goes behind neither waits for them nor keeps them from starting that head.
CREATE OR REPLACE FUNCTION postbox.pick(p_batch integer, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_after_priority smallint DEFAULT NULL::smallint, p_after_id bigint DEFAULT NULL::bigint) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
    AS $$
DECLARE
    v_batch integer := least(p_batch, 1000000);
    -- The position: before every row when none is given (ids start at 1).
    v_priority smallint := coalesce(p_after_priority, -32768);
    v_id bigint := CASE WHEN p_after_priority IS NULL THEN 0 ELSE coalesce(p_after_id, 0) END;
    v_got integer := 0;
    v_n integer;
    v_topics text[];
    v_ids bigint[];
    v_end bigint[];
    v_window integer := least(p_batch, 1000000) + greatest(least(p_batch, 1000000) / 4, 16);
    v_walked integer;
    v_misses bigint := 0;
    v_first boolean := true;
    v_share integer;
    v_topic text;
    v_row postbox.messages;
    v_last_priority smallint;
    v_last_id bigint;
    -- Topics that filled their share, and their last row given.
    v_more text[];
    v_more_priorities smallint[] := '{}';
    v_more_ids bigint[] := '{}';
BEGIN
    IF v_batch <= 0 THEN
        RETURN;
    END IF;
    IF p_all_topics AND cardinality(p_not_topics) = 0 AND cardinality(p_not_patterns) = 0 THEN
        -- explain: every topic
        RETURN QUERY SELECT m.* FROM postbox.messages m
            WHERE m.state = 'available' AND (m.priority::integer, m.id) > (v_priority::integer, v_id)
            ORDER BY m.priority::integer, m.id LIMIT v_batch FOR NO KEY UPDATE SKIP LOCKED;
        RETURN;
    END IF;
    IF NOT p_all_topics AND cardinality(p_patterns) = 0 AND cardinality(p_topics) <= 16 THEN
        v_topics := ARRAY(SELECT DISTINCT t FROM unnest(p_topics) AS u(t)
                          WHERE NOT (t = ANY(p_not_topics) OR t LIKE ANY(p_not_patterns)));
    ELSE
        LOOP
            -- The next window of the claim order: the rows of the topics served (read, not
            -- locked), how many rows of other topics, and the window's last row.
            -- explain: window
            SELECT count(*),
                   count(*) FILTER (WHERE NOT w.served),
                   max(ARRAY[w.priority::bigint, w.id]),
                   array_agg(w.id ORDER BY w.priority, w.id) FILTER (WHERE w.served)
            INTO v_walked, v_n, v_end, v_ids
            FROM (SELECT m.priority, m.id,
                         (p_all_topics OR m.topic = ANY(p_topics) OR m.topic LIKE ANY(p_patterns))
                         AND NOT (m.topic = ANY(p_not_topics) OR m.topic LIKE ANY(p_not_patterns)) AS served
                  FROM postbox.messages m
                  WHERE m.state = 'available' AND (m.priority::integer, m.id) > (v_priority::integer, v_id)
                  ORDER BY m.priority::integer, m.id LIMIT v_window) w;
            IF v_walked = 0 THEN
                RETURN;
            END IF;
            IF v_first AND v_n * 2 > v_walked THEN
                -- Mostly other topics: if this filter's busy topics are a few, merge them.
                v_topics := postbox.narrow_topics(p_all_topics, p_topics, p_patterns, p_not_topics,
                                                  p_not_patterns, 16);
                EXIT WHEN v_topics IS NOT NULL;
            END IF;
            v_first := false;
            v_misses := v_misses + v_n;
            IF v_ids IS NOT NULL THEN
                -- Those of them no one else has locked, by primary key.
                -- explain: the window's rows
                RETURN QUERY SELECT m.* FROM postbox.messages m
                    WHERE m.id = ANY(v_ids) AND m.state = 'available'
                    ORDER BY m.priority, m.id LIMIT v_batch - v_got FOR NO KEY UPDATE SKIP LOCKED;
                GET DIAGNOSTICS v_n = ROW_COUNT;
                v_got := v_got + v_n;
            END IF;
            -- Full, or the last window (what comes after it came after it was read).
            IF v_got >= v_batch OR v_walked < v_window THEN
                RETURN;
            END IF;
            v_priority := v_end[1];
            v_id := v_end[2];
            IF v_misses >= greatest(64 * v_batch::bigint, 10000) THEN
                -- Mostly rows of topics not served in the way: the busy topics with rows after
                -- the position reached (the rows before it were walked), merged if they are a
                -- few, else an equal share each.
                v_topics := ARRAY(
                    SELECT u.t FROM unnest(postbox.available_topics(p_all_topics, p_topics, p_patterns,
                                                                    p_not_topics, p_not_patterns)) AS u(t)
                    WHERE EXISTS (SELECT FROM postbox.messages m
                                  WHERE m.state = 'available' AND m.topic = u.t
                                    AND (m.priority, m.id) > (v_priority, v_id)));
                EXIT WHEN cardinality(v_topics) <= 16;
                IF cardinality(v_topics) > v_batch - v_got THEN
                    v_topics := ARRAY(SELECT t FROM unnest(v_topics) AS u(t) ORDER BY random() LIMIT v_batch - v_got);
                END IF;
                v_share := (v_batch - v_got) / cardinality(v_topics);
                v_more := '{}';
                FOREACH v_topic IN ARRAY v_topics LOOP
                    v_n := 0;
                    FOR v_row IN SELECT * FROM postbox.take_topic(v_topic, v_share, v_priority, v_id) LOOP
                        RETURN NEXT v_row;
                        v_n := v_n + 1;
                        v_last_priority := v_row.priority;
                        v_last_id := v_row.id;
                    END LOOP;
                    v_got := v_got + v_n;
                    IF v_n = v_share THEN
                        v_more := v_more || v_topic;
                        v_more_priorities := v_more_priorities || v_last_priority;
                        v_more_ids := v_more_ids || v_last_id;
                    END IF;
                END LOOP;
                -- The rest to the topics that had more, each after what it gave (a row this
                -- transaction locked would come again).
                FOR i IN 1 .. cardinality(v_more) LOOP
                    EXIT WHEN v_got >= v_batch;
                    RETURN QUERY SELECT * FROM postbox.take_topic(v_more[i], v_batch - v_got,
                        v_more_priorities[i], v_more_ids[i]);
                    GET DIAGNOSTICS v_n = ROW_COUNT;
                    v_got := v_got + v_n;
                END LOOP;
                RETURN;
            END IF;
        END LOOP;
        IF coalesce(cardinality(v_topics), 0) = 0 THEN
            RETURN;
        END IF;
    END IF;
    -- A few topics: the first rows after the position among them (read, not locked), then those
    -- of them no one else has locked; past the last of them for the rest, until none is left.
    LOOP
        -- explain: a few topics
        SELECT array_agg(c.id ORDER BY c.priority, c.id), max(ARRAY[c.priority::bigint, c.id])
        INTO v_ids, v_end
        FROM (SELECT c.id, c.priority
              FROM unnest(v_topics) AS t(topic),
              LATERAL (SELECT m.id, m.priority FROM postbox.messages m
                       WHERE m.state = 'available' AND m.topic = t.topic
                         AND (m.priority, m.id) > (v_priority, v_id)
                       ORDER BY m.priority, m.id LIMIT v_batch - v_got) c
              ORDER BY c.priority, c.id LIMIT v_batch - v_got) c;
        EXIT WHEN v_ids IS NULL;
        RETURN QUERY SELECT m.* FROM postbox.messages m
            WHERE m.id = ANY(v_ids) AND m.state = 'available'
            ORDER BY m.priority, m.id FOR NO KEY UPDATE SKIP LOCKED;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
        EXIT WHEN v_got >= v_batch OR cardinality(v_ids) < v_batch - v_got + v_n;
        v_priority := v_end[1];
        v_id := v_end[2];
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION postbox.take_topic(p_topic text, p_batch integer, p_after_priority smallint DEFAULT NULL::smallint, p_after_id bigint DEFAULT NULL::bigint) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    IF p_after_id IS NULL THEN
        RETURN QUERY
        SELECT m.* FROM postbox.messages m
        WHERE m.state = 'available' AND m.topic = p_topic
        ORDER BY m.priority, m.id
        LIMIT p_batch
        FOR NO KEY UPDATE SKIP LOCKED;
    ELSE
        RETURN QUERY
        SELECT m.* FROM postbox.messages m
        WHERE m.state = 'available' AND m.topic = p_topic
          AND (m.priority, m.id) > (p_after_priority, p_after_id)
        ORDER BY m.priority, m.id
        LIMIT p_batch
        FOR NO KEY UPDATE SKIP LOCKED;
    END IF;
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

-- (A kept head is delivered: it takes no room of a running limit.)
CREATE OR REPLACE FUNCTION postbox.claim_limited(p_limit text, p_max integer, p_per_key boolean, p_limit_all boolean, p_limit_topics text[], p_limit_patterns text[], p_batch integer, p_lease_secs double precision, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET enable_hashagg TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
    AS $$
DECLARE
    v_topics text[];
    v_topic text;
    v_limited text[];
    v_room integer;
    v_got integer := 0;
    v_n integer;
    v_keys text[];
    v_counts integer[];
    v_null_count integer;
    v_ids bigint[];
    v_walk_keys text[];
    v_walked integer;
    v_wanted integer;
BEGIN
    IF p_batch <= 0 OR p_max <= 0 THEN
        RETURN;
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'postbox: limited claims run in READ COMMITTED transactions only, not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'feature_not_supported';
    END IF;
    v_topics := ARRAY(
        SELECT t FROM unnest(postbox.available_topics(p_limit_all, p_limit_topics, p_limit_patterns,
                                                      p_not_topics, p_not_patterns)) AS u(t)
        WHERE p_all_topics OR t = ANY(p_topics) OR t LIKE ANY(p_patterns));
    IF coalesce(cardinality(v_topics), 0) = 0 THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(1886352246, hashtext(p_limit));
    -- After the lock: a new snapshot sees what the limit's last claimer took.
    v_limited := postbox.limit_topics(p_limit_all, p_limit_topics, p_limit_patterns);
    IF NOT p_per_key THEN
        SELECT p_max - coalesce(sum(r.n), 0) INTO v_room
        FROM (SELECT m.topic, count(*) AS n FROM postbox.messages m
              WHERE m.state = 'running' AND m.topic = ANY(v_limited) AND m.lease_token <> 0
              GROUP BY m.topic) r;
        v_room := least(v_room, p_batch);
        IF v_room <= 0 THEN
            RETURN;
        END IF;
        -- The claim plans as it does on its own (this function's settings would pass to it).
        PERFORM set_config('plan_cache_mode', 'auto', true), set_config('enable_sort', 'on', true),
                set_config('enable_hashagg', 'on', true);
        RETURN QUERY SELECT * FROM postbox.claim(v_room, p_lease_secs, false, v_topics, '{}', '{}', '{}',
                                                 p_token, p_owner);
        RETURN;
    END IF;
    -- Per key: what runs now, by key (messages without a key count as one key).
    SELECT array_agg(r.key) FILTER (WHERE r.key IS NOT NULL),
           array_agg(r.n) FILTER (WHERE r.key IS NOT NULL),
           coalesce(max(r.n) FILTER (WHERE r.key IS NULL), 0)
    INTO v_keys, v_counts, v_null_count
    FROM (SELECT t.key, sum(t.n)::integer AS n
          FROM (SELECT m.topic, m.key, count(*) AS n FROM postbox.messages m
                WHERE m.state = 'running' AND m.topic = ANY(v_limited) AND m.lease_token <> 0
                GROUP BY m.topic, m.key) t
          GROUP BY t.key) r;
    v_keys := coalesce(v_keys, '{}');
    v_counts := coalesce(v_counts, '{}');
    FOREACH v_topic IN ARRAY v_topics LOOP
        EXIT WHEN v_got >= p_batch;
        -- The front of the topic (read, not locked): as many of each key as its room.
        SELECT array_agg(w.id ORDER BY w.priority, w.id), array_agg(w.key ORDER BY w.priority, w.id)
        INTO v_ids, v_walk_keys
        FROM (SELECT m.id, m.key, m.priority
              FROM postbox.messages m
              WHERE m.state = 'available' AND m.topic = v_topic
              ORDER BY m.priority, m.id
              LIMIT (p_batch - v_got) * 4) w;
        v_walked := coalesce(cardinality(v_ids), 0);
        CONTINUE WHEN v_walked = 0;
        v_wanted := p_batch - v_got;
        RETURN QUERY
        WITH picked AS (
            SELECT c.id
            FROM (SELECT c.id, c.key, c.n,
                         row_number() OVER (PARTITION BY c.key ORDER BY c.n) AS rn
                  FROM unnest(v_ids, v_walk_keys) WITH ORDINALITY AS c(id, key, n)) c
            WHERE CASE WHEN c.key IS NULL THEN v_null_count
                       ELSE coalesce(v_counts[array_position(v_keys, c.key)], 0) END + c.rn <= p_max
            ORDER BY c.n
            LIMIT v_wanted
        ),
        locked AS (
            -- By primary key (`state::text`: see postbox.promote_keys); taken meanwhile: skipped.
            SELECT m.id FROM postbox.messages m
            WHERE m.id = ANY(ARRAY(SELECT id FROM picked)) AND m.state::text = 'available'
            FOR NO KEY UPDATE SKIP LOCKED
        )
        UPDATE postbox.messages m
        SET state = 'running',
            attempts = m.attempts + 1,
            locked_until = now() + make_interval(secs => p_lease_secs),
            lease_token = p_token,
            locked_by = p_owner
        FROM locked
        WHERE m.id = locked.id
        RETURNING m.*;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
        -- The front was all there is: nothing else of the topic is claimable.
        CONTINUE WHEN v_got >= p_batch OR v_walked < v_wanted * 4;
        -- Short of the batch: the front is held by keys at their limit. Key by key, in key order
        -- (one descent per key: a key at its limit is passed in one step), the first messages of
        -- each key as many as its room, until the batch is full. What the front took now runs.
        SELECT array_agg(r.key), array_agg(r.n) INTO v_keys, v_counts
        FROM (SELECT t.key, sum(t.n)::integer AS n
              FROM (SELECT m.topic, m.key, count(*) AS n FROM postbox.messages m
                    WHERE m.state = 'running' AND m.topic = ANY(v_limited) AND m.lease_token <> 0 AND m.key IS NOT NULL
                    GROUP BY m.topic, m.key) t
              GROUP BY t.key) r;
        v_keys := coalesce(v_keys, '{}');
        v_counts := coalesce(v_counts, '{}');
        v_wanted := p_batch - v_got;
        RETURN QUERY
        WITH RECURSIVE ks(key, room, before) AS (
            (SELECT m.key,
                    greatest(p_max - coalesce(v_counts[array_position(v_keys, m.key)], 0), 0),
                    0
             FROM postbox.messages m
             WHERE m.state = 'available' AND m.topic = v_topic AND m.key IS NOT NULL
             ORDER BY m.key LIMIT 1)
            UNION ALL
            SELECT n.key,
                   greatest(p_max - coalesce(v_counts[array_position(v_keys, n.key)], 0), 0),
                   ks.before + ks.room
            FROM ks,
                 LATERAL (SELECT m.key FROM postbox.messages m
                          WHERE m.state = 'available' AND m.topic = v_topic AND m.key IS NOT NULL
                            AND m.key > ks.key
                          ORDER BY m.key LIMIT 1) n
            WHERE ks.before + ks.room < v_wanted
        ),
        picked AS (
            SELECT p.id
            FROM ks,
                 LATERAL (SELECT k.id FROM postbox.messages k
                          WHERE k.state = 'available' AND k.topic = v_topic AND k.key = ks.key
                          ORDER BY k.priority, k.id
                          LIMIT least(ks.room, v_wanted - ks.before)
                          FOR NO KEY UPDATE SKIP LOCKED) p
            WHERE ks.room > 0 AND ks.before < v_wanted
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

