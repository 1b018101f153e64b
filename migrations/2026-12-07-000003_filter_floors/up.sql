-- Claims and takes of a filter with patterns or exclusions walk the claim order from floors, as
-- those of every topic, of one topic and of a few topics named exactly do (the migrations
-- ready_positions, ready_takes, ready_sets).
--
-- They went through postbox.pick, which walks messages_available_order_idx (priority, id) from
-- the front in windows. Under a pinned xmin horizon (a long report, a forgotten session, a slot)
-- every row claimed and settled since the pin leaves an entry there that no vacuum can remove,
-- and each claim stepped over all of them: a glob's claim of 100 read ~60,000 index entries after
-- 20,000 claims under a pin, and more with every claim.
--
-- postbox.take_matching walks messages_ready_idx (priority, ready_xid, id), one priority at a
-- time, from floors kept in a session setting named after the filter
-- (postbox.filter_floors_setting): the same state as the claim of every topic (the snapshot's
-- end, the transactions pending then, a floor per priority, here with the id of the row the walk
-- stopped at when it stopped among one transaction's rows), and the same look-ups of the rows of
-- pending transactions that ended. The walk reads windows of rows (read, not locked), keeps those
-- the filter serves and locks them by id (the filter checked again: a row whose topic changed
-- since is not taken). Each priority's new floor is the least of: the first row it served and
-- did not take (locked by another relay, or past the batch), the first row a take holds (a held
-- batch may be rolled back), and where the walk stopped (the snapshot's end when it reached the
-- end). Rows of other topics in the way are read once: the floors move past them.
--
-- What pick did for filters that serve little of what is available stays: when the first window
-- is mostly rows of other topics and the filter's busy topics are at most 16, they are taken from
-- their own floors (postbox.take_set), and the filter's floor passes the other topics' rows that
-- window read (the next claim's window starts at the first it served); when a claim has read 64 rows of other topics per row of
-- its batch (10,000 at least) and found nothing, the rest comes from postbox.pick (its turns by
-- topic), and the floors keep where the walk stopped.

CREATE FUNCTION postbox.filter_floors_setting(p_all_topics boolean, p_topics text[], p_patterns text[],
                                              p_not_topics text[], p_not_patterns text[]) RETURNS text
    LANGUAGE sql IMMUTABLE
    RETURN 'postbox.filter_floors_' || md5(format('%s|%s|%s|%s|%s', p_all_topics, p_topics, p_patterns,
                                                  p_not_topics, p_not_patterns));

COMMENT ON FUNCTION postbox.filter_floors_setting(boolean, text[], text[], text[], text[]) IS
    'The session setting in which postbox.take_matching keeps the floors of a filter';

CREATE FUNCTION postbox.take_matching(p_all_topics boolean, p_topics text[], p_patterns text[],
                                      p_not_topics text[], p_not_patterns text[], p_batch integer,
                                      p_lease_secs double precision DEFAULT NULL, p_token bigint DEFAULT NULL,
                                      p_owner text DEFAULT NULL, p_floors text DEFAULT NULL)
    RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET enable_incremental_sort TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
    AS $$
DECLARE
    v_batch integer := least(p_batch, 1000000);
    -- A take inside a transaction that already wrote sees its own changes: its floors are not
    -- kept (see postbox.take_ready). A claim (p_lease_secs given) keeps them.
    v_keep boolean := p_lease_secs IS NOT NULL OR pg_current_xact_id_if_assigned() IS NULL;
    v_setting text := postbox.filter_floors_setting(p_all_topics, p_topics, p_patterns, p_not_topics, p_not_patterns);
    v_state text := current_setting(postbox.filter_floors_setting(p_all_topics, p_topics, p_patterns,
                                                                  p_not_topics, p_not_patterns), true);
    v_snap pg_snapshot := pg_current_snapshot();
    v_running xid8[] := ARRAY(SELECT pg_snapshot_xip(v_snap)
                              UNION ALL SELECT pg_current_xact_id_if_assigned() WHERE pg_current_xact_id_if_assigned() IS NOT NULL);
    v_above xid8 := '0';
    v_pending xid8[] := '{}';
    v_priorities integer[] := '{}';
    v_floors xid8[] := '{}';
    -- With the floor, the id of the row it stopped at (0: before every row of that transaction):
    -- a walk that stops among the rows of one transaction (a bulk insert of other topics) goes
    -- on from there, not from that transaction's first row.
    v_floor_ids bigint[] := '{}';
    -- The floor each priority walked leaves (NULL: not walked, its floor stays).
    v_walked_to xid8[];
    v_walked_ids bigint[];
    v_next_id bigint;
    v_at xid8;
    v_ended_all xid8[];
    v_from xid8;
    v_lo integer;
    v_hi integer;
    v_found integer;
    v_pair text;
    v_ids bigint[] := '{}';
    v_more bigint[];
    v_got integer := 0;
    v_n integer;
    v_priority integer;
    v_order integer[];
    v_known integer[];
    v_window integer := least(p_batch, 1000000) + greatest(least(p_batch, 1000000) / 4, 16);
    v_misses bigint := 0;
    v_budget bigint := greatest(64 * least(p_batch, 1000000)::bigint, 10000);
    v_first boolean := true;
    v_walked integer;
    v_end bigint[];
    v_pos_xid xid8;
    v_pos_id bigint;
    v_read bigint[];
    v_read_x xid8[];
    v_try bigint[];
    v_try_x xid8[];
    -- Per priority: the first row served and not taken, the first row this take holds.
    v_left xid8;
    v_mine xid8;
    v_done boolean;
    v_topics text[];
    v_next xid8;
    v_probed xid8;
    v_out text[] := '{}';
    i integer;
    j integer;
BEGIN
    IF v_batch <= 0 THEN
        RETURN;
    END IF;
    -- Floors from another session of the same process are as good, and newer ones walk less;
    -- '' asks for a walk from the front. Floors from the future are from another server.
    IF p_floors = '' THEN
        v_state := NULL;
    ELSIF p_floors IS NOT NULL AND (coalesce(v_state, '') = ''
            OR split_part(p_floors, ';', 1)::xid8 > split_part(v_state, ';', 1)::xid8) THEN
        v_state := p_floors;
    END IF;
    IF coalesce(v_state, '') <> '' AND split_part(v_state, ';', 1)::xid8 > pg_snapshot_xmax(v_snap) THEN
        v_state := NULL;
    END IF;
    IF coalesce(v_state, '') <> '' THEN
        v_above := split_part(v_state, ';', 1)::xid8;
        v_pending := string_to_array(split_part(v_state, ';', 2), ',')::xid8[];
        FOREACH v_pair IN ARRAY string_to_array(split_part(v_state, ';', 3), ',') LOOP
            v_priorities := v_priorities || split_part(v_pair, ':', 1)::integer;
            v_floors := v_floors || split_part(v_pair, ':', 2)::xid8;
            v_floor_ids := v_floor_ids || coalesce(nullif(split_part(v_pair, ':', 3), ''), '0')::bigint;
        END LOOP;
    END IF;
    -- (In their order: their rows are looked up in it.)
    v_ended_all := ARRAY(SELECT x FROM unnest(v_pending) AS u(x) WHERE NOT x = ANY(v_running) ORDER BY x);
    -- Priorities not known yet (of any topic: a priority with nothing this filter serves is
    -- walked once, then its floor is past it).
    v_from := least(v_above, (SELECT min(x) FROM unnest(v_ended_all) AS u(x)));
    v_lo := -2147483648;
    v_known := ARRAY(SELECT p FROM unnest(v_priorities) AS u(p) ORDER BY p) || 2147483647;
    FOREACH v_hi IN ARRAY v_known LOOP
        LOOP
            -- explain: a priority of the filter not known yet
            SELECT m.priority::integer
            INTO v_found
            FROM postbox.messages m
            WHERE m.state = 'available' AND m.priority::integer > v_lo AND m.priority::integer < v_hi
              AND m.ready_xid >= v_from
            ORDER BY m.priority::integer, m.ready_xid LIMIT 1;
            EXIT WHEN NOT FOUND;
            v_priorities := v_priorities || v_found;
            v_floors := v_floors || v_from;
            v_floor_ids := v_floor_ids || 0::bigint;
            v_lo := v_found;
        END LOOP;
        v_lo := v_hi;
    END LOOP;
    v_walked_to := array_fill(NULL::xid8, ARRAY[cardinality(v_priorities)]);
    v_walked_ids := array_fill(0::bigint, ARRAY[cardinality(v_priorities)]);
    v_order := ARRAY(SELECT o FROM generate_subscripts(v_priorities, 1) AS g(o) ORDER BY v_priorities[o]);
    FOREACH i IN ARRAY v_order LOOP
        EXIT WHEN v_got >= v_batch OR v_misses >= v_budget;
        v_priority := v_priorities[i];
        v_from := v_floors[i];
        v_left := NULL;
        v_mine := NULL;
        IF cardinality(v_ended_all) > 0 THEN
            -- The rows of the pending transactions that ended, below the floor, by their ids
            -- (one range per id; read, then locked by id: see postbox.claim_ready).
            SELECT array_agg(l.id), min(l.ready_xid)
            INTO v_more, v_mine
            FROM (SELECT m.id, m.ready_xid FROM postbox.messages m
                  WHERE m.id = ANY(ARRAY(
                            SELECT c.id
                            FROM unnest(v_ended_all) AS e(x),
                                 LATERAL (SELECT w.id FROM postbox.messages w
                                          WHERE w.state = 'available' AND w.priority::integer = v_priority
                                            AND w.ready_xid >= e.x AND w.ready_xid <= e.x AND w.ready_xid < v_from
                                            AND (p_all_topics OR w.topic = ANY(p_topics) OR w.topic LIKE ANY(p_patterns))
                                            AND NOT (w.topic = ANY(p_not_topics) OR w.topic LIKE ANY(p_not_patterns))
                                          ORDER BY w.priority::integer, w.ready_xid, w.id
                                          LIMIT v_batch - v_got) c
                            LIMIT v_batch - v_got))
                    AND m.state::text = 'available' AND m.priority::integer = v_priority AND m.ready_xid < v_from
                    AND (p_all_topics OR m.topic = ANY(p_topics) OR m.topic LIKE ANY(p_patterns))
                    AND NOT (m.topic = ANY(p_not_topics) OR m.topic LIKE ANY(p_not_patterns))
                  FOR NO KEY UPDATE SKIP LOCKED) l;
            v_ids := v_ids || coalesce(v_more, '{}');
            v_got := cardinality(v_ids);
            EXIT WHEN v_got >= v_batch;
        END IF;
        -- Windows of the priority's rows from its floor (read, not locked).
        v_pos_xid := v_from;
        v_pos_id := v_floor_ids[i];
        v_done := false;
        v_first := true;
        LOOP
            -- explain: a window of the filter
            SELECT count(*), count(*) FILTER (WHERE NOT w.served),
                   max(ARRAY[w.ready_xid::text::bigint, w.id]),
                   array_agg(w.id ORDER BY w.ready_xid, w.id) FILTER (WHERE w.served),
                   array_agg(w.ready_xid ORDER BY w.ready_xid, w.id) FILTER (WHERE w.served)
            INTO v_walked, v_n, v_end, v_read, v_read_x
            FROM (SELECT m.ready_xid, m.id,
                         (p_all_topics OR m.topic = ANY(p_topics) OR m.topic LIKE ANY(p_patterns))
                         AND NOT (m.topic = ANY(p_not_topics) OR m.topic LIKE ANY(p_not_patterns)) AS served
                  FROM postbox.messages m
                  WHERE m.state = 'available' AND m.priority::integer = v_priority
                    AND m.ready_xid >= v_pos_xid AND (m.ready_xid, m.id) > (v_pos_xid, v_pos_id)
                  ORDER BY m.priority::integer, m.ready_xid, m.id LIMIT v_window) w;
            IF v_walked = 0 THEN
                v_done := true;
                EXIT;
            END IF;
            IF v_first AND v_n * 2 > v_walked THEN
                -- Mostly other topics: if this filter's busy topics are a few, from their floors.
                v_topics := postbox.narrow_topics(p_all_topics, p_topics, p_patterns, p_not_topics,
                                                  p_not_patterns, 16);
                -- (The filter's floor then passes the rows of other topics this window read: the
                -- next claim's window starts at what it served.)
                IF v_topics IS NOT NULL THEN
                    IF v_walked < v_window THEN
                        v_walked_to[i] := pg_snapshot_xmax(v_snap);
                    ELSE
                        v_walked_to[i] := v_end[1]::text::xid8;
                        v_walked_ids[i] := v_end[2];
                    END IF;
                    IF v_read_x[1] <= v_walked_to[i] THEN
                        v_walked_to[i] := v_read_x[1];
                        v_walked_ids[i] := 0;
                    END IF;
                    EXIT;
                END IF;
            END IF;
            v_first := false;
            v_misses := v_misses + v_n;
            -- The rows served, first ones first, as many as the batch still takes; those no one
            -- else has locked, by primary key (the filter again: a row whose topic changed since
            -- it was read is not served).
            j := 1;
            WHILE j <= coalesce(cardinality(v_read), 0) AND v_got < v_batch LOOP
                v_try := v_read[j : j + (v_batch - v_got) - 1];
                v_try_x := v_read_x[j : j + (v_batch - v_got) - 1];
                j := j + cardinality(v_try);
                -- explain: the window's rows of the filter
                SELECT array_agg(c.id)
                INTO v_more
                FROM (SELECT m.id FROM postbox.messages m
                      WHERE m.id = ANY(v_try) AND m.state::text = 'available' AND m.priority::integer = v_priority
                        AND (p_all_topics OR m.topic = ANY(p_topics) OR m.topic LIKE ANY(p_patterns))
                        AND NOT (m.topic = ANY(p_not_topics) OR m.topic LIKE ANY(p_not_patterns))
                      FOR NO KEY UPDATE SKIP LOCKED) c;
                v_more := coalesce(v_more, '{}');
                IF cardinality(v_more) > 0 THEN
                    v_mine := least(v_mine, (SELECT min(u.x) FROM unnest(v_try, v_try_x) AS u(id, x)
                                             WHERE u.id = ANY(v_more)));
                END IF;
                IF cardinality(v_more) < cardinality(v_try) THEN
                    v_left := least(v_left, (SELECT min(u.x) FROM unnest(v_try, v_try_x) AS u(id, x)
                                             WHERE NOT u.id = ANY(v_more)));
                END IF;
                v_ids := v_ids || v_more;
                v_got := cardinality(v_ids);
            END LOOP;
            IF j <= coalesce(cardinality(v_read), 0) THEN
                -- Served and past the batch.
                v_left := least(v_left, v_read_x[j]);
            END IF;
            v_pos_xid := v_end[1]::text::xid8;
            v_pos_id := v_end[2];
            IF v_walked < v_window THEN
                v_done := true;
                EXIT;
            END IF;
            EXIT WHEN v_got >= v_batch OR v_misses >= v_budget;
        END LOOP;
        EXIT WHEN v_topics IS NOT NULL;
        -- Where the walk stopped: the snapshot's end when it reached the end (what commits later
        -- below it is of a transaction pending at v_snap), else the last row it read.
        IF v_done THEN
            v_walked_to[i] := pg_snapshot_xmax(v_snap);
        ELSE
            v_walked_to[i] := v_pos_xid;
            v_walked_ids[i] := v_pos_id;
        END IF;
        v_at := least(v_left, CASE WHEN p_lease_secs IS NULL THEN v_mine END);
        IF v_at <= v_walked_to[i] THEN
            v_walked_to[i] := v_at;
            v_walked_ids[i] := 0;
        END IF;
    END LOOP;
    -- What was taken: leased by a claim (which the rest below then does not see as available).
    IF p_lease_secs IS NULL THEN
        RETURN QUERY SELECT m.* FROM postbox.messages m WHERE m.id = ANY(v_ids);
    ELSIF v_got > 0 THEN
        RETURN QUERY
        UPDATE postbox.messages m
        SET state = 'running',
            attempts = m.attempts + 1,
            locked_until = now() + make_interval(secs => p_lease_secs),
            lease_token = p_token,
            locked_by = p_owner
        WHERE m.id = ANY(v_ids)
        RETURNING m.*;
    END IF;
    -- The rest, when the filter's busy topics are a few, from their floors; or, when rows of
    -- other topics filled the walk, by postbox.pick's turns by topic. (A take's rows are still
    -- available and locked by this transaction: given again, they are not returned twice.)
    IF v_topics IS NOT NULL THEN
        RETURN QUERY SELECT * FROM postbox.take_set(v_topics, v_batch - v_got, p_lease_secs, p_token, p_owner) t
                     WHERE NOT t.id = ANY(v_ids);
    ELSIF v_got < v_batch AND v_misses >= v_budget THEN
        IF p_lease_secs IS NULL THEN
            RETURN QUERY SELECT p.* FROM postbox.pick(v_batch - v_got, p_all_topics, p_topics, p_patterns,
                                                     p_not_topics, p_not_patterns) p
                         WHERE NOT p.id = ANY(v_ids);
        ELSE
            RETURN QUERY
            UPDATE postbox.messages m
            SET state = 'running',
                attempts = m.attempts + 1,
                locked_until = now() + make_interval(secs => p_lease_secs),
                lease_token = p_token,
                locked_by = p_owner
            WHERE m.id = ANY(ARRAY(SELECT p.id FROM postbox.pick(v_batch - v_got, p_all_topics, p_topics,
                                                                p_patterns, p_not_topics, p_not_patterns) p))
            RETURNING m.*;
        END IF;
    END IF;
    IF NOT v_keep THEN
        RETURN;
    END IF;
    -- The new floors: where each priority's walk stopped (a priority not walked keeps its own),
    -- lowered to the rows of pending transactions that ended still available below it.
    FOREACH i IN ARRAY v_order LOOP
        v_priority := v_priorities[i];
        v_from := v_floors[i];
        v_next := coalesce(v_walked_to[i], v_from);
        v_next_id := CASE WHEN v_walked_to[i] IS NULL THEN v_floor_ids[i] ELSE v_walked_ids[i] END;
        v_probed := NULL;
        IF cardinality(v_ended_all) > 0 THEN
            SELECT min(c.ready_xid)
            INTO v_probed
            FROM unnest(v_ended_all) AS e(x),
                 LATERAL (SELECT m.ready_xid FROM postbox.messages m
                          WHERE m.state = 'available' AND m.priority::integer = v_priority
                            AND m.ready_xid >= e.x AND m.ready_xid <= e.x AND m.ready_xid < v_from
                            AND (p_all_topics OR m.topic = ANY(p_topics) OR m.topic LIKE ANY(p_patterns))
                            AND NOT (m.topic = ANY(p_not_topics) OR m.topic LIKE ANY(p_not_patterns))
                          ORDER BY m.priority::integer, m.ready_xid, m.id
                          LIMIT 1) c;
        END IF;
        IF v_probed <= v_next THEN
            v_next := v_probed;
            v_next_id := 0;
        END IF;
        IF v_next >= pg_snapshot_xmax(v_snap) THEN
            v_next := pg_snapshot_xmax(v_snap);
            v_next_id := 0;
        END IF;
        -- A row position only within a transaction that ended: the rows a claim inside a longer
        -- transaction read of its own may be followed by more of it, with lower ids (a message
        -- it gives back, an update), which the look-up of ended transactions does not see at
        -- the floor's own transaction.
        IF v_next = ANY(v_running) THEN
            v_next_id := 0;
        END IF;
        -- Beyond 64 priorities, those with nothing left are forgotten (found again by the look
        -- between known priorities).
        IF cardinality(v_priorities) <= 64 OR v_next < pg_snapshot_xmax(v_snap) THEN
            v_out := v_out || (v_priority::text || ':' || v_next::text
                               || CASE WHEN v_next_id > 0 THEN ':' || v_next_id::text ELSE '' END);
        END IF;
    END LOOP;
    PERFORM set_config(v_setting,
                       pg_snapshot_xmax(v_snap)::text || ';' || array_to_string(v_running, ',') || ';'
                       || array_to_string(v_out, ','),
                       false);
END
$$;

COMMENT ON FUNCTION postbox.take_matching(boolean, text[], text[], text[], text[], integer, double precision, bigint, text, text) IS
    'The claim (p_lease_secs given) or take of a filter with patterns or exclusions, walking the claim order from the floors this session keeps of the filter: see the migration filter_floors';

-- The claim of such a filter (more than 16 topics named exactly too) takes that walk.
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
    RETURN QUERY SELECT * FROM postbox.take_matching(p_all_topics, p_topics, p_patterns, p_not_topics,
                                                     p_not_patterns, p_batch, p_lease_secs, p_token, p_owner);
END
$$;

-- The narrowing of a pattern to its busy topics bounds each descent of the topic index by the end
-- of the prefix's range: its last descent, past the range, read the entries of whatever topic
-- sorts next (under a pin, every entry the pin keeps of it: a review measured 100,600 index
-- entries for a claim of 100 of `t%` whose own topic had none, the next topic `u` having been
-- drained under the pin).
CREATE OR REPLACE FUNCTION postbox.narrow_topics(p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_max integer) RETURNS text[]
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
    v_upper text;
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
        -- The end of that range: the prefix with its last character the next one (bytewise, the
        -- order of code points). Each descent is bounded by it: the last one, past the range,
        -- read the entries of the topic that sorts next, every one a pin keeps.
        IF ascii(right(v_prefix, 1)) IN (55295, 1114111) THEN
            RETURN NULL;
        END IF;
        v_upper := left(v_prefix, -1) || chr(ascii(right(v_prefix, 1)) + 1);
        SELECT array_agg(d.topic), count(*) INTO v_walk, v_walked
        FROM (WITH RECURSIVE d(topic) AS (
                  SELECT (SELECT m.topic FROM postbox.messages m
                          WHERE m.state = 'available' AND m.topic >= v_prefix AND m.topic < v_upper
                          ORDER BY m.topic LIMIT 1)
                  UNION ALL
                  SELECT (SELECT m.topic FROM postbox.messages m
                          WHERE m.state = 'available' AND m.topic > d.topic AND m.topic < v_upper
                          ORDER BY m.topic LIMIT 1)
                  FROM d WHERE d.topic IS NOT NULL)
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
