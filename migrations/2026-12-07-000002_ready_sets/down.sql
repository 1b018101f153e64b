-- postbox.pick as the migration head_pins left it, postbox.claim as ready_positions did,
-- postbox.claim_ready and postbox.take_ready as upkeep_windows did.

CREATE OR REPLACE FUNCTION postbox.pick(p_batch integer, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_after_priority smallint DEFAULT NULL::smallint, p_after_id bigint DEFAULT NULL::bigint)
 RETURNS SETOF postbox.messages
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET enable_bitmapscan TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
AS $function$
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
$function$;


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

CREATE OR REPLACE FUNCTION postbox.claim_ready(p_topic text, p_batch integer, p_lease_secs double precision, p_token bigint, p_owner text, p_floors text DEFAULT NULL::text)
 RETURNS SETOF postbox.messages
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET enable_bitmapscan TO 'off'
 SET enable_sort TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
AS $function$
DECLARE
    v_batch integer := least(p_batch, 1000000);
    v_setting text := postbox.claim_floors_setting(p_topic);
    v_state text := current_setting(postbox.claim_floors_setting(p_topic), true);
    v_snap pg_snapshot := pg_current_snapshot();
    -- Running now: this transaction too, if it has an id (a claim inside a longer transaction:
    -- what it makes available later carries that id).
    v_running xid8[] := ARRAY(SELECT pg_snapshot_xip(v_snap)
                              UNION ALL SELECT pg_current_xact_id_if_assigned() WHERE pg_current_xact_id_if_assigned() IS NOT NULL);
    -- Above this, rows of any priority; below, only rows of the pending transactions.
    v_above xid8 := '0';
    v_pending xid8[] := '{}';
    v_priorities integer[] := '{}';
    v_floors xid8[] := '{}';
    -- The least id among the pending transactions that ended since: their rows may be below.
    v_ended xid8;
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
    v_next xid8;
    v_probed xid8;
    -- The pending transactions that ended since: their rows are looked up by their ids alone (a
    -- walk from the oldest of them would visit everything since it began, and it may be any
    -- long transaction of the cluster).
    v_ended_all xid8[];
    v_out text[] := '{}';
    i integer;
BEGIN
    IF v_batch <= 0 THEN
        RETURN;
    END IF;
    -- Floors from another session of the same process are as good, and newer ones walk less;
    -- '' asks for a walk from the front.
    IF p_floors = '' THEN
        v_state := NULL;
    ELSIF p_floors IS NOT NULL AND (coalesce(v_state, '') = ''
            OR split_part(p_floors, ';', 1)::xid8 > split_part(v_state, ';', 1)::xid8) THEN
        v_state := p_floors;
    END IF;
    -- Floors from the future are from another server (a restore, a failover to a server whose
    -- counter is behind): worthless here.
    IF coalesce(v_state, '') <> '' AND split_part(v_state, ';', 1)::xid8 > pg_snapshot_xmax(v_snap) THEN
        v_state := NULL;
    END IF;
    IF coalesce(v_state, '') <> '' THEN
        v_above := split_part(v_state, ';', 1)::xid8;
        v_pending := string_to_array(split_part(v_state, ';', 2), ',')::xid8[];
        FOREACH v_pair IN ARRAY string_to_array(split_part(v_state, ';', 3), ',') LOOP
            v_priorities := v_priorities || split_part(v_pair, ':', 1)::integer;
            v_floors := v_floors || split_part(v_pair, ':', 2)::xid8;
        END LOOP;
    END IF;
    v_ended_all := ARRAY(SELECT x FROM unnest(v_pending) AS u(x) WHERE NOT x = ANY(v_running));
    v_ended := (SELECT min(x) FROM unnest(v_ended_all) AS u(x));
    -- Priorities not known yet: between the known ones, what is above v_above (or from a pending
    -- transaction that ended). One descent per gap when there is none.
    v_from := least(v_above, v_ended);
    v_lo := -2147483648;
    v_known := ARRAY(SELECT p FROM unnest(v_priorities) AS u(p) ORDER BY p) || 2147483647;
    FOREACH v_hi IN ARRAY v_known LOOP
        LOOP
            IF p_topic IS NULL THEN
                -- explain: a priority not known yet
                SELECT m.priority::integer
                INTO v_found
                FROM postbox.messages m
                WHERE m.state = 'available' AND m.priority::integer > v_lo AND m.priority::integer < v_hi
                  AND m.ready_xid >= v_from
                ORDER BY m.priority::integer, m.ready_xid LIMIT 1;
            ELSE
                -- explain: a priority of the topic not known yet
                SELECT m.priority::integer
                INTO v_found
                FROM postbox.messages m
                WHERE m.state = 'available' AND m.topic = p_topic
                  AND m.priority::integer > v_lo AND m.priority::integer < v_hi
                  AND m.ready_xid >= v_from
                ORDER BY m.priority::integer, m.ready_xid LIMIT 1;
            END IF;
            EXIT WHEN NOT FOUND;
            v_priorities := v_priorities || v_found;
            v_floors := v_floors || v_from;
            v_lo := v_found;
        END LOOP;
        v_lo := v_hi;
    END LOOP;
    -- Each priority, most urgent first, from its floor (or from a pending transaction that ended).
    v_order := ARRAY(SELECT o FROM generate_subscripts(v_priorities, 1) AS g(o) ORDER BY v_priorities[o]);
    FOREACH i IN ARRAY v_order LOOP
        EXIT WHEN v_got >= v_batch;
        v_priority := v_priorities[i];
        v_from := v_floors[i];
        IF cardinality(v_ended_all) > 0 THEN
            -- The rows of the pending transactions that ended, by their ids.
            -- (One range per id, so the index is entered at each: a condition "= ANY" on
            -- its second column is planned as a filter over everything below; and an equality
            -- would make the index's order that of the id alone, which the primary key gives:
            -- after an ANALYZE under a pin the plan took it and filtered every row of the table.)
            SELECT array_agg(c.id)
            INTO v_more
            FROM unnest(v_ended_all) AS e(x),
                 LATERAL (SELECT m.id FROM postbox.messages m
                          WHERE m.state = 'available' AND m.priority::integer = v_priority
                            AND m.ready_xid >= e.x AND m.ready_xid <= e.x AND m.ready_xid < v_from
                            AND (p_topic IS NULL OR m.topic = p_topic)
                          ORDER BY m.priority::integer, m.ready_xid, m.id
                          LIMIT v_batch - v_got
                          FOR NO KEY UPDATE SKIP LOCKED) c;
            v_ids := v_ids || coalesce(v_more[1:v_batch - v_got], '{}');
            v_got := cardinality(v_ids);
            EXIT WHEN v_got >= v_batch;
        END IF;
        IF p_topic IS NULL THEN
            -- explain: every topic
            SELECT array_agg(c.id), count(*)
            INTO v_more, v_n
            FROM (SELECT m.id FROM postbox.messages m
                  WHERE m.state = 'available' AND m.priority::integer = v_priority AND m.ready_xid >= v_from
                  ORDER BY m.priority::integer, m.ready_xid, m.id
                  LIMIT v_batch - v_got
                  FOR NO KEY UPDATE SKIP LOCKED) c;
        ELSE
            -- explain: one topic
            SELECT array_agg(c.id), count(*)
            INTO v_more, v_n
            FROM (SELECT m.id FROM postbox.messages m
                  WHERE m.state = 'available' AND m.topic = p_topic AND m.priority::integer = v_priority
                    AND m.ready_xid >= v_from
                  ORDER BY m.topic, m.priority::integer, m.ready_xid, m.id
                  LIMIT v_batch - v_got
                  FOR NO KEY UPDATE SKIP LOCKED) c;
        END IF;
        IF v_n > 0 THEN
            v_ids := v_ids || v_more;
            v_got := v_got + v_n;
        END IF;
    END LOOP;
    IF v_got > 0 THEN
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
    -- The new floors: the first row still available of each priority (as of now, which sees
    -- at least what v_snap saw), else the snapshot's end; what was running at v_snap is pending.
    FOREACH i IN ARRAY v_order LOOP
        v_priority := v_priorities[i];
        v_from := v_floors[i];
        v_probed := NULL;
        IF cardinality(v_ended_all) > 0 THEN
            SELECT min(c.ready_xid)
            INTO v_probed
            FROM unnest(v_ended_all) AS e(x),
                 LATERAL (SELECT m.ready_xid FROM postbox.messages m
                          WHERE m.state = 'available' AND m.priority::integer = v_priority
                            AND m.ready_xid >= e.x AND m.ready_xid <= e.x AND m.ready_xid < v_from
                            AND (p_topic IS NULL OR m.topic = p_topic)
                          ORDER BY m.priority::integer, m.ready_xid, m.id
                          LIMIT 1) c;
        END IF;
        IF p_topic IS NULL THEN
            -- explain: a floor
            SELECT m.ready_xid
            INTO v_next
            FROM postbox.messages m
            WHERE m.state = 'available' AND m.priority::integer = v_priority AND m.ready_xid >= v_from
            ORDER BY m.priority::integer, m.ready_xid LIMIT 1;
        ELSE
            -- explain: a floor of the topic
            SELECT m.ready_xid
            INTO v_next
            FROM postbox.messages m
            WHERE m.state = 'available' AND m.topic = p_topic AND m.priority::integer = v_priority
              AND m.ready_xid >= v_from
            ORDER BY m.topic, m.priority::integer, m.ready_xid LIMIT 1;
        END IF;
        IF NOT FOUND OR v_next > pg_snapshot_xmax(v_snap) THEN
            v_next := pg_snapshot_xmax(v_snap);
        END IF;
        v_next := least(v_next, v_probed);
        -- Beyond 64 priorities, those with nothing available are forgotten (a later one is found
        -- again by the look between known priorities).
        IF cardinality(v_priorities) <= 64 OR v_next < pg_snapshot_xmax(v_snap) THEN
            v_out := v_out || (v_priorities[i]::text || ':' || v_next::text);
        END IF;
    END LOOP;
    PERFORM set_config(v_setting,
                       pg_snapshot_xmax(v_snap)::text || ';' || array_to_string(v_running, ',') || ';'
                       || array_to_string(v_out, ','),
                       false);
END
$function$

;

CREATE OR REPLACE FUNCTION postbox.take_ready(p_topic text, p_batch integer, p_floors text DEFAULT NULL::text)
 RETURNS SETOF postbox.messages
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET enable_bitmapscan TO 'off'
 SET enable_sort TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
AS $function$
DECLARE
    v_batch integer := least(p_batch, 1000000);
    -- A take inside a transaction that already wrote (a caller's own SQL; the relay's take is the
    -- first statement of its transaction) sees its own changes: its floors are not kept.
    v_keep boolean := pg_current_xact_id_if_assigned() IS NULL;
    v_setting text := postbox.claim_floors_setting(p_topic);
    v_state text := current_setting(postbox.claim_floors_setting(p_topic), true);
    v_snap pg_snapshot := pg_current_snapshot();
    -- Running now: this transaction too, if it has an id (a claim inside a longer transaction:
    -- what it makes available later carries that id).
    v_running xid8[] := ARRAY(SELECT pg_snapshot_xip(v_snap)
                              UNION ALL SELECT pg_current_xact_id_if_assigned() WHERE pg_current_xact_id_if_assigned() IS NOT NULL);
    -- Above this, rows of any priority; below, only rows of the pending transactions.
    v_above xid8 := '0';
    v_pending xid8[] := '{}';
    v_priorities integer[] := '{}';
    v_floors xid8[] := '{}';
    -- The least id among the pending transactions that ended since: their rows may be below.
    v_ended xid8;
    v_from xid8;
    v_lo integer;
    v_hi integer;
    v_found integer;
    v_pair text;
    v_more bigint[];
    v_got integer := 0;
    v_n integer;
    v_priority integer;
    v_order integer[];
    v_known integer[];
    v_next xid8;
    v_probed xid8;
    -- The pending transactions that ended since: their rows are looked up by their ids alone (a
    -- walk from the oldest of them would visit everything since it began, and it may be any
    -- long transaction of the cluster).
    v_ended_all xid8[];
    v_out text[] := '{}';
    i integer;
BEGIN
    IF v_batch <= 0 THEN
        RETURN;
    END IF;
    -- Floors from another session of the same process are as good, and newer ones walk less;
    -- '' asks for a walk from the front.
    IF p_floors = '' THEN
        v_state := NULL;
    ELSIF p_floors IS NOT NULL AND (coalesce(v_state, '') = ''
            OR split_part(p_floors, ';', 1)::xid8 > split_part(v_state, ';', 1)::xid8) THEN
        v_state := p_floors;
    END IF;
    -- Floors from the future are from another server (a restore, a failover to a server whose
    -- counter is behind): worthless here.
    IF coalesce(v_state, '') <> '' AND split_part(v_state, ';', 1)::xid8 > pg_snapshot_xmax(v_snap) THEN
        v_state := NULL;
    END IF;
    IF coalesce(v_state, '') <> '' THEN
        v_above := split_part(v_state, ';', 1)::xid8;
        v_pending := string_to_array(split_part(v_state, ';', 2), ',')::xid8[];
        FOREACH v_pair IN ARRAY string_to_array(split_part(v_state, ';', 3), ',') LOOP
            v_priorities := v_priorities || split_part(v_pair, ':', 1)::integer;
            v_floors := v_floors || split_part(v_pair, ':', 2)::xid8;
        END LOOP;
    END IF;
    v_ended_all := ARRAY(SELECT x FROM unnest(v_pending) AS u(x) WHERE NOT x = ANY(v_running));
    v_ended := (SELECT min(x) FROM unnest(v_ended_all) AS u(x));
    -- Priorities not known yet: between the known ones, what is above v_above (or from a pending
    -- transaction that ended). One descent per gap when there is none.
    v_from := least(v_above, v_ended);
    v_lo := -2147483648;
    v_known := ARRAY(SELECT p FROM unnest(v_priorities) AS u(p) ORDER BY p) || 2147483647;
    FOREACH v_hi IN ARRAY v_known LOOP
        LOOP
            IF p_topic IS NULL THEN
                -- explain: a priority not known yet
                SELECT m.priority::integer
                INTO v_found
                FROM postbox.messages m
                WHERE m.state = 'available' AND m.priority::integer > v_lo AND m.priority::integer < v_hi
                  AND m.ready_xid >= v_from
                ORDER BY m.priority::integer, m.ready_xid LIMIT 1;
            ELSE
                -- explain: a priority of the topic not known yet
                SELECT m.priority::integer
                INTO v_found
                FROM postbox.messages m
                WHERE m.state = 'available' AND m.topic = p_topic
                  AND m.priority::integer > v_lo AND m.priority::integer < v_hi
                  AND m.ready_xid >= v_from
                ORDER BY m.priority::integer, m.ready_xid LIMIT 1;
            END IF;
            EXIT WHEN NOT FOUND;
            v_priorities := v_priorities || v_found;
            v_floors := v_floors || v_from;
            v_lo := v_found;
        END LOOP;
        v_lo := v_hi;
    END LOOP;
    -- Each priority, most urgent first, from its floor (or from a pending transaction that ended).
    v_order := ARRAY(SELECT o FROM generate_subscripts(v_priorities, 1) AS g(o) ORDER BY v_priorities[o]);
    FOREACH i IN ARRAY v_order LOOP
        EXIT WHEN v_got >= v_batch;
        v_priority := v_priorities[i];
        v_from := v_floors[i];
        IF cardinality(v_ended_all) > 0 THEN
            -- The rows of the pending transactions that ended, by their ids.
            -- (One range per id, so the index is entered at each: a condition "= ANY" on
            -- its second column is planned as a filter over everything below; and an equality
            -- would make the index's order that of the id alone, which the primary key gives:
            -- after an ANALYZE under a pin the plan took it and filtered every row of the table.)
            SELECT array_agg(c.id)
            INTO v_more
            FROM unnest(v_ended_all) AS e(x),
                 LATERAL (SELECT m.id FROM postbox.messages m
                          WHERE m.state = 'available' AND m.priority::integer = v_priority
                            AND m.ready_xid >= e.x AND m.ready_xid <= e.x AND m.ready_xid < v_from
                            AND (p_topic IS NULL OR m.topic = p_topic)
                          ORDER BY m.priority::integer, m.ready_xid, m.id
                          LIMIT v_batch - v_got
                          FOR NO KEY UPDATE SKIP LOCKED) c;
            v_more := coalesce(v_more[1:v_batch - v_got], '{}');
            RETURN QUERY SELECT m.* FROM postbox.messages m WHERE m.id = ANY(v_more);
            v_got := v_got + cardinality(v_more);
            EXIT WHEN v_got >= v_batch;
        END IF;
        IF p_topic IS NULL THEN
            -- Locked, and left available: the hold deletes what it delivers and leases the rest
            -- when it ends. (Returned as they are locked: no second look-up by id.)
            RETURN QUERY
            SELECT m.* FROM postbox.messages m
            WHERE m.state = 'available' AND m.priority::integer = v_priority AND m.ready_xid >= v_from
            ORDER BY m.priority::integer, m.ready_xid, m.id
            LIMIT v_batch - v_got
            FOR NO KEY UPDATE SKIP LOCKED;
        ELSE
            RETURN QUERY
            SELECT m.* FROM postbox.messages m
            WHERE m.state = 'available' AND m.topic = p_topic AND m.priority::integer = v_priority
              AND m.ready_xid >= v_from
            ORDER BY m.topic, m.priority::integer, m.ready_xid, m.id
            LIMIT v_batch - v_got
            FOR NO KEY UPDATE SKIP LOCKED;
        END IF;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
    END LOOP;
    -- The new floors: the first row still available of each priority (as of now, which sees
    -- at least what v_snap saw; the rows just locked are among them), else the snapshot's end;
    -- what was running at v_snap is pending.
    IF NOT v_keep THEN
        RETURN;
    END IF;
    FOREACH i IN ARRAY v_order LOOP
        v_priority := v_priorities[i];
        v_from := v_floors[i];
        v_probed := NULL;
        IF cardinality(v_ended_all) > 0 THEN
            SELECT min(c.ready_xid)
            INTO v_probed
            FROM unnest(v_ended_all) AS e(x),
                 LATERAL (SELECT m.ready_xid FROM postbox.messages m
                          WHERE m.state = 'available' AND m.priority::integer = v_priority
                            AND m.ready_xid >= e.x AND m.ready_xid <= e.x AND m.ready_xid < v_from
                            AND (p_topic IS NULL OR m.topic = p_topic)
                          ORDER BY m.priority::integer, m.ready_xid, m.id
                          LIMIT 1) c;
        END IF;
        IF p_topic IS NULL THEN
            -- explain: a floor
            SELECT m.ready_xid
            INTO v_next
            FROM postbox.messages m
            WHERE m.state = 'available' AND m.priority::integer = v_priority AND m.ready_xid >= v_from
            ORDER BY m.priority::integer, m.ready_xid LIMIT 1;
        ELSE
            -- explain: a floor of the topic
            SELECT m.ready_xid
            INTO v_next
            FROM postbox.messages m
            WHERE m.state = 'available' AND m.topic = p_topic AND m.priority::integer = v_priority
              AND m.ready_xid >= v_from
            ORDER BY m.topic, m.priority::integer, m.ready_xid LIMIT 1;
        END IF;
        -- (NULL: nothing available from the floor.)
        IF v_next IS NULL OR v_next > pg_snapshot_xmax(v_snap) THEN
            v_next := pg_snapshot_xmax(v_snap);
        END IF;
        v_next := least(v_next, v_probed);
        -- Beyond 64 priorities, those with nothing available are forgotten (a later one is found
        -- again by the look between known priorities).
        IF cardinality(v_priorities) <= 64 OR v_next < pg_snapshot_xmax(v_snap) THEN
            v_out := v_out || (v_priorities[i]::text || ':' || v_next::text);
        END IF;
    END LOOP;
    PERFORM set_config(v_setting,
                       pg_snapshot_xmax(v_snap)::text || ';' || array_to_string(v_running, ',') || ';'
                       || array_to_string(v_out, ','),
                       false);
END
$function$

;


DROP FUNCTION postbox.take_set(text[], integer, double precision, bigint, text, text[]);

ALTER FUNCTION postbox.messages_before_insert() RESET enable_incremental_sort;
ALTER FUNCTION postbox.promote_due(integer) RESET enable_incremental_sort;
ALTER FUNCTION postbox.messages_check_head() RESET enable_incremental_sort;
ALTER FUNCTION postbox.take_topic(text,integer,smallint,bigint) RESET enable_incremental_sort;
ALTER FUNCTION postbox.claim_limited(text,integer,boolean,boolean,text[],text[],integer,double precision,boolean,text[],text[],text[],text[],bigint,text) RESET enable_incremental_sort;
ALTER FUNCTION postbox.finish_heads(integer,timestamp with time zone) RESET enable_incremental_sort;
ALTER FUNCTION postbox.promote_due(integer,timestamp with time zone) RESET enable_incremental_sort;
