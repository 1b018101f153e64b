-- Limited claims walk only what they can take.
--
-- Before, a total limit counted the running messages of its topics by walking every running row
-- of every topic (messages_running_idx is by locked_until): 50,000 running rows of other topics
-- made each claim walk them. A per-key limit walked the available rows of its topic in (priority,
-- id) order, skipping those of keys at their limit one by one: 100,000 available rows of one key
-- at its limit ahead of the others made each claim walk them all.
--
-- Now:
--   * running rows are also indexed by (topic, key): a limit counts the running rows of its own
--     topics, per key when per key;
--   * a per-key claim first reads the front of the topic (4 rows per message wanted, without
--     locking them) and takes what is under the limit there; when that does not fill the batch,
--     it goes key by key (messages_available_key_idx, one descent per key, a key at its limit
--     passed in one step) and takes the first messages of each key, as many as the key has room
--     for, until the batch is full: one statement. Within a key, (priority, id) order holds; across keys, the front of the topic goes
--     first, then keys in key order.
-- Both indexes are partial: running rows, and available rows that have a key.

CREATE INDEX messages_running_topic_idx ON postbox.messages (topic, key) WHERE state = 'running';
CREATE INDEX messages_available_key_idx ON postbox.messages (topic, key, priority, id)
    WHERE state = 'available' AND key IS NOT NULL;

-- The topics of a limit that have running messages: its exact names as given; with patterns or
-- all topics, a loose scan of the running topics (one descent per running topic).
CREATE FUNCTION postbox.limit_topics(p_all boolean, p_topics text[], p_patterns text[])
RETURNS text[]
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    SELECT CASE
        WHEN NOT p_all AND coalesce(cardinality(p_patterns), 0) = 0 THEN coalesce(p_topics, '{}')
        ELSE ARRAY(
            WITH RECURSIVE t(topic) AS (
                (SELECT m.topic FROM postbox.messages m WHERE m.state = 'running' ORDER BY m.topic LIMIT 1)
                UNION ALL
                SELECT (SELECT m.topic FROM postbox.messages m
                        WHERE m.state = 'running' AND m.topic > t.topic ORDER BY m.topic LIMIT 1)
                FROM t WHERE t.topic IS NOT NULL
            )
            SELECT topic FROM t
            WHERE topic IS NOT NULL
              AND (p_all OR topic = ANY(p_topics) OR topic LIKE ANY(p_patterns)))
    END
$$;

CREATE OR REPLACE FUNCTION postbox.claim_limited(p_limit text, p_max integer, p_per_key boolean,
    p_limit_all boolean, p_limit_topics text[], p_limit_patterns text[], p_batch integer,
    p_lease_secs double precision, p_all_topics boolean, p_topics text[], p_patterns text[],
    p_not_topics text[], p_not_patterns text[], p_token bigint, p_owner text)
RETURNS SETOF postbox.messages
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
-- The counts group by (topic[, key]): without sorts or hashes to choose from, the planner reads
-- them in order from messages_running_topic_idx instead of walking messages_running_idx whole.
SET enable_sort = off
SET enable_hashagg = off
-- Planned once per session: the key-by-key statement alone takes 2 ms to plan.
SET plan_cache_mode = force_generic_plan
SET jit = off
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
              WHERE m.state = 'running' AND m.topic = ANY(v_limited)
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
                WHERE m.state = 'running' AND m.topic = ANY(v_limited)
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
            FOR UPDATE SKIP LOCKED
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
                    WHERE m.state = 'running' AND m.topic = ANY(v_limited) AND m.key IS NOT NULL
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
                          FOR UPDATE SKIP LOCKED) p
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
