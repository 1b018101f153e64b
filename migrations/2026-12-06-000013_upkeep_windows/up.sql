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
-- Each walk also names its index's order (ORDER BY locked_until, with sorts off), and the look for
-- kept heads says `locked_until >= 'infinity'` (the same rows): with an equality the order is
-- no order, and under a pin, after an ANALYZE that saw no live running row, the planner took
-- messages_running_topic_idx (topic, key) for the finish's looks with every condition a filter,
-- reading every running entry the pin kept (120,000 a look, five looks per tick, four minutes
-- into a pin at 800/s).

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
        WHERE state = 'running' AND locked_until >= postbox.kept_head_lease() AND lease_token = 0
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
         WHERE state = 'running' AND locked_until >= postbox.kept_head_lease() AND lease_token = 0
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
    -- (By id, an index condition: a join to the CTE was planned, after an ANALYZE under a pin,
    -- as a walk of the whole primary key with the CTE inside: 820,000 buffers a pass.)
    UPDATE postbox.messages m SET state = 'available' WHERE m.id = ANY(ARRAY(SELECT id FROM due));
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

-- The claim's and the take's look-ups of the rows of pending transactions that ended: one range
-- per transaction id (ready_xid >= x AND ready_xid <= x) instead of an equality. With the
-- priority and ready_xid both equal to a value, the order those look-ups name
-- (priority::integer, ready_xid, id) is the id's alone, which messages_pkey and
-- messages_available_order_idx give too: the bench's pinned runs (xmin, 800/s) logged, after an
-- autovacuum ANALYZE of a table of mostly dead rows, plans walking messages_pkey with every
-- condition as a filter (194,000 buffers a look-up, two per claim and per take), and the relay
-- fell 19,000 messages behind for a minute, until the next ANALYZE. A range keeps ready_xid in
-- the order, which only the ready indexes give without a sort.

CREATE OR REPLACE FUNCTION postbox.take_ready(p_topic text, p_batch integer, p_floors text DEFAULT NULL)
    RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
    AS $$
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
$$;

CREATE OR REPLACE FUNCTION postbox.claim_ready(p_topic text, p_batch integer, p_lease_secs double precision, p_token bigint,
                                    p_owner text, p_floors text DEFAULT NULL)
    RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
    AS $$
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
$$;
