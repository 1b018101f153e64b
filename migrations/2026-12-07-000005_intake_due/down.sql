-- Back to the move of the migration `intake`, which keeps every run_at as written.
DROP TRIGGER intake_no_update ON postbox.intake;
DROP FUNCTION postbox.intake_no_update();
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
    SELECT EXISTS (
               SELECT 1 FROM unnest(v_px, v_pi) AS p(x, i)
               WHERE pg_visible_in_snapshot(p.x, pg_current_snapshot())
                 AND EXISTS (SELECT 1 FROM postbox.intake t WHERE t.xid = p.x AND t.id > p.i))
           OR EXISTS (SELECT 1 FROM postbox.intake t WHERE (t.xid, t.id) > (v_pos_x, v_pos_i)),
           pg_current_snapshot()
    INTO v_any, v_snap;
    IF NOT v_any THEN
        v_picked := 0;
        v_moved := 0;
    ELSE
    -- One statement, one snapshot: what it picks, what it moves and the snapshot the next floor
    -- is made of. Its rows are deleted in (xid, id) order, by primary key (a generic plan from
    -- the first call, no hash join: a custom plan sized for p_max rows joined a scan of the whole
    -- index, every entry a pinned horizon keeps); a cancel locks them in the same order.
    WITH pick AS MATERIALIZED (
        SELECT c.xid, c.id, c.pending FROM (
            (SELECT w.xid, w.id, true AS pending
             FROM unnest(v_px, v_pi) WITH ORDINALITY AS p(x, i, n),
                  LATERAL (SELECT t.xid, t.id FROM postbox.intake t
                           WHERE t.xid = p.x AND t.id > p.i ORDER BY t.id LIMIT p_max) w
             WHERE pg_visible_in_snapshot(p.x, pg_current_snapshot()))
            UNION ALL
            (SELECT t.xid, t.id, false FROM postbox.intake t
             WHERE (t.xid, t.id) > (v_pos_x, v_pos_i)
             ORDER BY t.xid, t.id LIMIT p_max)
        ) c
        LIMIT p_max
    ), gone AS (
        DELETE FROM postbox.intake t USING pick
        WHERE t.xid = pick.xid AND t.id = pick.id
        RETURNING t.*
    ), put AS (
        INSERT INTO postbox.messages (id, topic, key, payload, headers, priority, run_at, max_attempts, created_at)
        OVERRIDING SYSTEM VALUE
        SELECT g.id, g.topic, g.key, g.payload, g.headers, g.priority, g.run_at, g.max_attempts, g.created_at
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
