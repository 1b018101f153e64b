-- A message due when its writer wrote it must be available once it is moved, not scheduled.
--
-- The insert trigger of postbox.messages decides a row's state by comparing its run_at with
-- now(), the start of the inserting transaction. A move's transaction starts before it takes
-- its snapshot, so a writer that began after the move began and committed before the move's
-- snapshot was moved with a run_at (its own now()) later than the mover's now(): the row went in
-- as scheduled and waited for the scheduler's next promotion. Measured (bench --only xmin with
-- enqueue routed to the intake, 800 messages a second, autocommit writers): 2.8 % of the
-- messages took 40-110 ms more, e2e p99 74-80 ms against 5.9 ms on the direct path.
--
-- So a row that is due by the clock when the move inserts it goes in with its run_at brought
-- back to the mover's now() (at most the move's own duration earlier), which the trigger reads
-- as due; a row scheduled for later keeps its run_at and is scheduled.
--
-- And the move's first look (is there anything to move?) at the rows of the pending transactions
-- that ended: after an ANALYZE that saw the intake nearly empty (its rows moved, dead but kept by
-- a pinned xmin horizon), its generic plan joined them to a scan of the whole primary key with
-- the transaction id as a filter, 62,600-78,000 buffers a move under a 3-minute pin at 800
-- messages a second, until the next ANALYZE. Each transaction's rows are now looked up by its id
-- in a LATERAL with a LIMIT, as the move's statement itself does. The same ANALYZE made the
-- move's delete of the rows it picked scan the whole primary key outside and join the picked
-- rows inside (20,201 index entries read for a move of 100 behind 20,000 dead): they are now
-- deleted by tuple id, in the order they were picked. So an intake row is never updated (an
-- update would move it to another tuple id, past the move's floor): a trigger refuses it.

CREATE OR REPLACE FUNCTION postbox.move_intake(p_max integer, p_floor text DEFAULT NULL)
RETURNS TABLE (moved integer, floor text)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'postbox', 'pg_temp'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET enable_incremental_sort TO 'off'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
    SET max_parallel_workers_per_gather TO '0'
AS $$
DECLARE
    v_pos_x xid8 := '0';
    v_pos_i bigint := 0;
    v_px xid8[] := '{}';
    v_pi bigint[] := '{}';
    v_pair text;
    v_picked integer;
    v_moved integer;
    v_last_x xid8;
    v_last_i bigint;
    v_last_pending boolean;
    v_snap pg_snapshot;
    v_any boolean;
    v_out_x xid8[] := '{}';
    v_out_i bigint[] := '{}';
    v_k integer;
BEGIN
    IF p_max IS NULL OR p_max < 1 THEN
        RAISE EXCEPTION 'postbox.move_intake: p_max must be at least 1, not %', p_max
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- In a writer's transaction, the writer's own rows would be moved and its id left below the
    -- floor, where what it writes next would never be found.
    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION 'postbox.move_intake runs in a transaction of its own, not in one that has written'
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    IF NOT pg_try_advisory_xact_lock(1886352244, 1) THEN
        RETURN QUERY SELECT 0, p_floor;
        RETURN;
    END IF;
    IF coalesce(p_floor, '') <> '' THEN
        v_pos_x := split_part(split_part(p_floor, ';', 1), ':', 1)::xid8;
        v_pos_i := split_part(split_part(p_floor, ';', 1), ':', 2)::bigint;
        IF split_part(p_floor, ';', 2) <> '' THEN
            FOREACH v_pair IN ARRAY string_to_array(split_part(p_floor, ';', 2), ',') LOOP
                v_px := v_px || split_part(v_pair, ':', 1)::xid8;
                v_pi := v_pi || split_part(v_pair, ':', 2)::bigint;
            END LOOP;
        END IF;
    END IF;

    -- Anything to move? An empty move must write nothing: the insert into postbox.messages
    -- fires its wake-up statement trigger even for no row (a transaction id taken, a NOTIFY to
    -- every listening relay, which would claim and move again).
    -- (Each pending transaction's rows looked up by its id in a LATERAL with a LIMIT, which no
    -- plan can turn into a scan of the whole index joined afterwards; see the migration's head.)
    SELECT EXISTS (
               SELECT 1 FROM unnest(v_px, v_pi) AS p(x, i),
                    LATERAL (SELECT 1 FROM postbox.intake t
                             WHERE t.xid = p.x AND t.id > p.i ORDER BY t.id LIMIT 1) w
               WHERE pg_visible_in_snapshot(p.x, pg_current_snapshot()))
           OR EXISTS (SELECT 1 FROM postbox.intake t WHERE (t.xid, t.id) > (v_pos_x, v_pos_i)),
           pg_current_snapshot()
    INTO v_any, v_snap;
    IF NOT v_any THEN
        v_picked := 0;
        v_moved := 0;
    ELSE
    -- One statement, one snapshot: what it picks, what it moves and the snapshot the next floor
    -- is made of. Its rows are deleted in (xid, id) order, each by its tuple id (a generic plan
    -- from the first call, no hash join: a custom plan sized for p_max rows joined a scan of the
    -- whole index, every entry a pinned horizon keeps; and by primary key, after an ANALYZE that
    -- saw the intake nearly empty, the plan put that scan outside); a cancel locks them in the
    -- same order. (A tuple id cannot be reused within the statement: its snapshot keeps the row.)
    WITH pick AS MATERIALIZED (
        SELECT c.xid, c.id, c.pending, c.tid FROM (
            (SELECT w.xid, w.id, true AS pending, w.tid
             FROM unnest(v_px, v_pi) WITH ORDINALITY AS p(x, i, n),
                  LATERAL (SELECT t.xid, t.id, t.ctid AS tid FROM postbox.intake t
                           WHERE t.xid = p.x AND t.id > p.i ORDER BY t.id LIMIT p_max) w
             WHERE pg_visible_in_snapshot(p.x, pg_current_snapshot()))
            UNION ALL
            (SELECT t.xid, t.id, false, t.ctid FROM postbox.intake t
             WHERE (t.xid, t.id) > (v_pos_x, v_pos_i)
             ORDER BY t.xid, t.id LIMIT p_max)
        ) c
        LIMIT p_max
    ), gone AS (
        DELETE FROM postbox.intake t USING pick
        WHERE t.ctid = pick.tid AND t.xid = pick.xid AND t.id = pick.id
        RETURNING t.*
    ), put AS (
        INSERT INTO postbox.messages (id, topic, key, payload, headers, priority, run_at, max_attempts, created_at)
        OVERRIDING SYSTEM VALUE
        SELECT g.id, g.topic, g.key, g.payload, g.headers, g.priority,
               -- Due by the clock: due in the queue (see the migration's head).
               CASE WHEN g.run_at <= clock_timestamp() THEN least(g.run_at, now()) ELSE g.run_at END,
               g.max_attempts, g.created_at
        FROM gone g
        RETURNING 1
    ), last AS (
        SELECT pick.xid, pick.id, pick.pending FROM pick
        ORDER BY pick.pending, pick.xid DESC, pick.id DESC LIMIT 1
    )
    SELECT (SELECT count(*) FROM pick), (SELECT count(*) FROM put),
           last.xid, last.id, last.pending, pg_current_snapshot()
    INTO v_picked, v_moved, v_last_x, v_last_i, v_last_pending, v_snap
    FROM (SELECT 1) one LEFT JOIN last ON true;
    END IF;

    IF v_picked < p_max THEN
        -- Everything visible from the floor was picked: the walk goes on from the snapshot's
        -- end, and the transactions still in progress are the ones to look up when they end.
        v_pos_x := pg_snapshot_xmax(v_snap);
        v_pos_i := 0;
        SELECT coalesce(array_agg(x ORDER BY x), '{}') INTO v_out_x FROM pg_snapshot_xip(v_snap) x;
        v_out_i := array_fill(0::bigint, ARRAY[cardinality(v_out_x)]);
    ELSIF v_last_pending THEN
        -- Cut among the rows of ended pending transactions: those before it are done, it goes on
        -- after its last row moved, the rest and the walk's position stay.
        FOR v_k IN 1 .. coalesce(cardinality(v_px), 0) LOOP
            IF v_px[v_k] = v_last_x THEN
                v_out_x := v_out_x || v_px[v_k];
                v_out_i := v_out_i || v_last_i;
            ELSIF v_px[v_k] > v_last_x OR NOT pg_visible_in_snapshot(v_px[v_k], v_snap) THEN
                v_out_x := v_out_x || v_px[v_k];
                v_out_i := v_out_i || v_pi[v_k];
            END IF;
        END LOOP;
    ELSE
        -- Cut in the walk: ended pending transactions are done; those still in progress stay,
        -- with the ones the walk passed between its old position and where it stopped.
        SELECT coalesce(array_agg(x ORDER BY x), '{}') INTO v_out_x
        FROM (SELECT p.x FROM unnest(v_px) p(x) WHERE NOT pg_visible_in_snapshot(p.x, v_snap)
              UNION
              SELECT s.x FROM pg_snapshot_xip(v_snap) s(x) WHERE s.x >= v_pos_x AND s.x < v_last_x) a;
        v_out_i := array_fill(0::bigint, ARRAY[cardinality(v_out_x)]);
        v_pos_x := v_last_x;
        v_pos_i := v_last_i;
    END IF;

    RETURN QUERY SELECT v_moved,
        v_pos_x::text || ':' || v_pos_i::text || ';'
        || coalesce((SELECT string_agg(o.x::text || ':' || o.i::text, ',' ORDER BY o.n)
                     FROM unnest(v_out_x, v_out_i) WITH ORDINALITY AS o(x, i, n)), '');
END
$$;

CREATE FUNCTION postbox.intake_no_update() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION 'postbox.intake rows are not updated (a relay moves them as they were written): delete the row and insert another'
        USING ERRCODE = 'feature_not_supported';
END
$$;

CREATE TRIGGER intake_no_update BEFORE UPDATE ON postbox.intake
    FOR EACH ROW EXECUTE FUNCTION postbox.intake_no_update();
