-- Fixes found by a review of the settle and claim functions under a pinned xmin horizon.
--
-- 1. Updates that join postbox.messages to a CTE of ids name the ids as an array too, so the plan
--    looks them up in the primary key. Joined to the CTE alone, the promotion of ordered keys
--    (every settle of an ordered head calls it) was planned, on statistics an ANALYZE took while a
--    pinned horizon kept every settled row, as a walk of the whole primary key: 39,633 buffers
--    for a promotion of nothing after 20,000 settled heads. The limited claim's two updates had
--    the same shape.
-- 2. A per-key limited claim counts what it took before its next pick: with an every-topic or
--    glob limit and nothing of the topic running yet, its key walk (and the next topic's front)
--    counted nothing it had just taken, and took a key past its limit in one claim.
-- 3. The insert trigger that wakes waiting relays gives the writer's transaction its id first
--    (see postbox.messages_inserted).

CREATE OR REPLACE FUNCTION postbox.promote_keys(p_topics text[], p_keys text[], p_removed bigint[], p_exclusive boolean, p_limit integer, p_lease_secs double precision, p_token bigint, p_owner text)
 RETURNS SETOF postbox.messages
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET enable_bitmapscan TO 'off'
 SET jit TO 'off'
AS $function$
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
                -- And by the ids' array: joined to the CTE alone, the update was planned (on
                -- statistics taken under a pinned horizon) as a walk of the whole primary key
                -- for its rows, 39,633 buffers for none (tests/backlog.rs).
                WHERE m.id = ANY(ARRAY(SELECT id FROM ranked)) AND m.id = r.id AND m.state::text = 'waiting'
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
$function$
;

CREATE OR REPLACE FUNCTION postbox.claim_limited(p_limit text, p_max integer, p_per_key boolean, p_limit_all boolean, p_limit_topics text[], p_limit_patterns text[], p_batch integer, p_lease_secs double precision, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_token bigint, p_owner text)
 RETURNS SETOF postbox.messages
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET enable_bitmapscan TO 'off'
 SET enable_sort TO 'off'
 SET enable_hashagg TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
AS $function$
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
    -- The topics both the claim and the limit let through: from whichever of the two names them
    -- or a few prefix ranges (one index descent per topic found there), else by walking every
    -- topic with available messages.
    v_topics := postbox.narrow_topics(p_all_topics, p_topics, p_patterns, p_not_topics, p_not_patterns,
                                      10000);
    IF v_topics IS NOT NULL THEN
        v_topics := ARRAY(SELECT t FROM unnest(v_topics) AS u(t)
                          WHERE p_limit_all OR t = ANY(p_limit_topics) OR t LIKE ANY(p_limit_patterns));
    ELSE
        v_topics := postbox.narrow_topics(p_limit_all, p_limit_topics, p_limit_patterns, p_not_topics,
                                          p_not_patterns, 10000);
        IF v_topics IS NOT NULL THEN
            v_topics := ARRAY(SELECT t FROM unnest(v_topics) AS u(t)
                              WHERE p_all_topics OR t = ANY(p_topics) OR t LIKE ANY(p_patterns));
        ELSE
            v_topics := ARRAY(
                SELECT t FROM unnest(postbox.available_topics(p_limit_all, p_limit_topics, p_limit_patterns,
                                                              p_not_topics, p_not_patterns)) AS u(t)
                WHERE p_all_topics OR t = ANY(p_topics) OR t LIKE ANY(p_patterns));
        END IF;
    END IF;
    IF coalesce(cardinality(v_topics), 0) = 0 THEN
        RETURN;
    END IF;
    PERFORM postbox.take_turn('limit:' || p_limit);
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
        -- By the ids' array too (see postbox.promote_keys).
        WHERE m.id = ANY(ARRAY(SELECT id FROM locked)) AND m.id = locked.id
        RETURNING m.*;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
        IF v_n > 0 AND v_got < p_batch THEN
            -- What it took now runs: counted before the next pick (this topic's key walk, or the
            -- next topic's front). Its topic is limited even if nothing of it ran before.
            IF NOT v_topic = ANY(v_limited) THEN
                v_limited := v_limited || v_topic;
            END IF;
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
        END IF;
        -- The front was all there is: nothing else of the topic is claimable.
        CONTINUE WHEN v_got >= p_batch OR v_walked < v_wanted * 4;
        -- Short of the batch: the front is held by keys at their limit. Key by key, in key order
        -- (one descent per key: a key at its limit is passed in one step), the first messages of
        -- each key as many as its room, until the batch is full (the counts include what the
        -- front took).
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
        -- By the ids' array too (see postbox.promote_keys).
        WHERE m.id = ANY(ARRAY(SELECT id FROM picked)) AND m.id = picked.id
        RETURNING m.*;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
        IF v_n > 0 AND v_got < p_batch THEN
            -- What it took now runs: counted before the next pick (this topic's key walk, or the
            -- next topic's front). Its topic is limited even if nothing of it ran before.
            IF NOT v_topic = ANY(v_limited) THEN
                v_limited := v_limited || v_topic;
            END IF;
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
        END IF;
    END LOOP;
END
$function$
;

CREATE OR REPLACE FUNCTION postbox.messages_inserted()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    -- The transaction takes its id before it looks for listeners: a relay that registers after
    -- this look (and so gets no NOTIFY) finds it among the transactions in progress, watches it,
    -- and claims again when it ends. Without the id yet (an INSERT … SELECT whose first row comes
    -- later), it was in neither, and its messages waited for the poll interval.
    PERFORM pg_current_xact_id();
    IF EXISTS (SELECT 1 FROM postbox.listeners) THEN
        PERFORM pg_notify('postbox', '');
    END IF;
    RETURN NULL;
END
$function$
;
