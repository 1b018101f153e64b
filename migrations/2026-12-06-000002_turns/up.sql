-- Turns that relays take, bulkheaded: a row lock, not an advisory lock.
--
-- Claims of one running limit, the retention upkeep and the metrics sample each took an advisory
-- lock (1886352246, 1886352247), which any role able to connect can take by hand and keep: a
-- writer, or anyone with CONNECT, could stop every limited claim of every relay, or the upkeep
-- (and with it the partitions a relay's archive writes into). Now each takes the row of its name
-- in postbox.turns FOR UPDATE: a row lock needs UPDATE on the table, which only the relay's role
-- (and the schema's owner) has.
--
-- And a limited claim visits the topics the claim's own filter or the limit's names, or finds in
-- a few prefix ranges (postbox.narrow_topics), as the plain claim does: a limit on `emails.*` no
-- longer walks every topic with available messages (1.2 s a claim with 100,000 other topics).
CREATE TABLE postbox.turns (
    name text PRIMARY KEY
);
COMMENT ON TABLE postbox.turns IS 'postbox: what relays take turns on (a running limit, the retention upkeep, the metrics sample), one row each, locked FOR UPDATE by the one whose turn it is';
INSERT INTO postbox.turns (name) VALUES ('retention'), ('sample');

-- Waits for the turn named p_name (the row is made the first time).
CREATE FUNCTION postbox.take_turn(p_name text) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM 1 FROM postbox.turns WHERE name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO postbox.turns (name) VALUES (p_name) ON CONFLICT DO NOTHING;
        PERFORM 1 FROM postbox.turns WHERE name = p_name FOR UPDATE;
    END IF;
END
$$;

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

CREATE OR REPLACE FUNCTION postbox.completed_partitions(p_ahead interval) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'postbox', 'pg_temp'
    AS $$
DECLARE
    v_hour timestamptz := date_trunc('hour', now(), 'UTC');
    v_name text;
    v_created integer := 0;
BEGIN
    PERFORM postbox.take_turn('retention');
    WHILE v_hour < now() + least(p_ahead, interval '7 days') LOOP
        v_name := 'completed_' || to_char(v_hour AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24');
        IF to_regclass(format('postbox.%I', v_name)) IS NULL THEN
            EXECUTE format('CREATE TABLE postbox.%I PARTITION OF postbox.completed FOR VALUES FROM (%L) TO (%L)',
                           v_name, v_hour, v_hour + interval '1 hour');
            v_created := v_created + 1;
        END IF;
        v_hour := v_hour + interval '1 hour';
    END LOOP;
    RETURN v_created;
END
$$;

CREATE OR REPLACE FUNCTION postbox.drop_expired_completed(p_before timestamp with time zone) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'postbox', 'pg_temp'
    SET lock_timeout TO '2s'
    AS $_$
DECLARE
    v record;
    v_dropped integer := 0;
BEGIN
    PERFORM postbox.take_turn('retention');
    FOR v IN SELECT * FROM postbox.completed_expired(least(p_before, now())) LOOP
        -- The name matched ^completed_[0-9]{8}_[0-9]{2}$ (completed_expired): quoted all the same.
        IF v.detach_pending THEN
            EXECUTE format('ALTER TABLE postbox.completed DETACH PARTITION postbox.%I FINALIZE', v.name);
        ELSE
            EXECUTE format('ALTER TABLE postbox.completed DETACH PARTITION postbox.%I', v.name);
        END IF;
        EXECUTE format('DROP TABLE postbox.%I', v.name);
        v_dropped := v_dropped + 1;
    END LOOP;
    RETURN v_dropped;
END
$_$;

