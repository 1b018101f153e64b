-- True if the topics that start with a prefix lie together in the order of the topic indexes (a
-- bytewise collation), so that a pattern's literal prefix bounds a range of them. Asked of the
-- catalog once per session (the collation of a database never changes).
CREATE FUNCTION postbox.bytewise_topics() RETURNS boolean
    LANGUAGE plpgsql STABLE
    AS $$
DECLARE
    v_known text := current_setting('postbox.bytewise_topics', true);
BEGIN
    IF v_known IS NULL OR v_known = '' THEN
        v_known := coalesce((
            SELECT CASE WHEN c.collname = 'default' THEN
                        (SELECT d.datlocprovider IN ('c', 'b')
                                AND d.datcollate IN ('C', 'POSIX', 'C.UTF-8', 'C.utf8')
                         FROM pg_database d WHERE d.datname = current_database())
                   ELSE c.collname IN ('C', 'POSIX', 'ucs_basic') END
            FROM pg_attribute a JOIN pg_collation c ON c.oid = a.attcollation
            WHERE a.attrelid = 'postbox.messages'::regclass AND a.attname = 'topic'), false)::text;
        PERFORM set_config('postbox.bytewise_topics', v_known, false);
    END IF;
    RETURN v_known::boolean;
END
$$;

-- The busy topics of a narrow filter: exact names and patterns with a literal prefix, at most
-- p_max of them with available messages; NULL when the filter is not narrow or has more.
CREATE FUNCTION postbox.narrow_topics(p_all_topics boolean, p_topics text[], p_patterns text[],
    p_not_topics text[], p_not_patterns text[], p_max integer) RETURNS text[]
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

-- Locks and returns up to p_batch available messages of the topics of a filter, in claim order:
-- (priority, id) across the topics served, after (p_after_priority, p_after_id) when given (a
-- relay whose holds are in flight takes after where its last take ended). Rows another
-- transaction has locked are skipped. What it walks does not grow with the number of topics:
--  - every topic: the claim order index itself, one statement;
--  - any other filter: the claim order index in windows a little larger than the batch, the rows
--    of topics not served skipped;
--  - but a filter whose first window is mostly other topics' rows and that names exact topics or
--    patterns with a literal prefix matching at most 16 busy topics (`narrow_topics`), or that
--    names at most 16 exact topics and no pattern: each topic's first messages from the topic
--    index, merged;
--  - past 64 × p_batch rows (10,000 at least) of topics not served (a paused or excluded
--    topic's backlog in the way of a broad filter) the rest of the batch is taken topic by
--    topic, an equal share each: O(busy topics), as every claim was before this migration.
-- The lines `-- explain: NAME` mark the statements `Store::explain_claim` shows.
CREATE FUNCTION postbox.pick(p_batch integer, p_all_topics boolean, p_topics text[], p_patterns text[],
    p_not_topics text[], p_not_patterns text[], p_after_priority smallint DEFAULT NULL,
    p_after_id bigint DEFAULT NULL) RETURNS SETOF postbox.messages
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
            ORDER BY m.priority::integer, m.id LIMIT v_batch FOR UPDATE SKIP LOCKED;
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
                    ORDER BY m.priority, m.id LIMIT v_batch - v_got FOR UPDATE SKIP LOCKED;
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
            ORDER BY m.priority, m.id FOR UPDATE SKIP LOCKED;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
        EXIT WHEN v_got >= v_batch OR cardinality(v_ids) < v_batch - v_got + v_n;
        v_priority := v_end[1];
        v_id := v_end[2];
    END LOOP;
END
$$;

-- The claim (lease) of 2026-12-01 over postbox.pick: same signature, same result, the claim order
-- across topics instead of an equal share per busy topic.
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

