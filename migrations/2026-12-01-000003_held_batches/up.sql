-- Held batches: the relay's fast path. A relay whose deliveries end quickly takes a batch by
-- locking its rows (SELECT … FOR UPDATE SKIP LOCKED) in a transaction that it keeps open while it
-- delivers them, then deletes the delivered ones and commits: no lease is written, and the rows
-- stay `available` (other claims skip them while they are locked). Whatever is not delivered when
-- the hold ends (a retry, a dead letter, a delivery still running at the hold's time limit) is
-- leased in that same transaction and settled as a claimed message is. Per message this writes a
-- row lock and a delete, where a lease writes a new row version with new index entries, then a
-- delete. Nothing else changes: no row is touched by this migration.
--
-- The attempt of a held delivery cannot be counted in a transaction that may roll back. Before it
-- delivers, the relay registers the batch in postbox.holds from another connection (committed at
-- once); the hold's own commit deletes the registration. A registration whose transaction did not
-- commit (the relay crashed, lost its connection or was cut off) names messages that may have been
-- delivered and not settled: postbox.lost_holds() gives each of them an expired lease with the
-- attempt counted, and the rescue of expired leases then retries or dead-letters them. A message
-- that crashes its relay every time thus reaches the dead letters after max_attempts.

CREATE TABLE postbox.holds (
    -- The holding transaction.
    xid xid8 PRIMARY KEY,
    ids bigint[] NOT NULL,
    held_by text NOT NULL,
    held_at timestamptz NOT NULL DEFAULT now()
) WITH (
    -- A row per batch in flight, inserted and deleted per batch: vacuumed often, as the listeners.
    autovacuum_vacuum_threshold = 100,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_analyze_threshold = 100,
    autovacuum_analyze_scale_factor = 0
);

-- One topic's batch for a hold: claim_topic without the lease. A relay's holds in flight keep
-- their rows locked, and skipping a locked row costs a lock check (measured: ~1.7 µs a row here,
-- 3.5 ms for 2,000 rows behind a take of 500 that itself takes 0.5 ms), so a relay that has holds
-- in flight takes after the last row it took (p_after_priority, p_after_id), and from the front
-- again every few tens of milliseconds (rows that became available behind it meanwhile).
CREATE FUNCTION postbox.take_topic(
    p_topic text,
    p_batch integer,
    p_after_priority smallint DEFAULT NULL,
    p_after_id bigint DEFAULT NULL
) RETURNS SETOF postbox.messages
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
BEGIN
    IF p_after_id IS NULL THEN
        RETURN QUERY
        SELECT m.* FROM postbox.messages m
        WHERE m.state = 'available' AND m.topic = p_topic
        ORDER BY m.priority, m.id
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED;
    ELSE
        RETURN QUERY
        SELECT m.* FROM postbox.messages m
        WHERE m.state = 'available' AND m.topic = p_topic
          AND (m.priority, m.id) > (p_after_priority, p_after_id)
        ORDER BY m.priority, m.id
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED;
    END IF;
END
$$;

-- A batch for a hold from the topics the filter lets through, shared between them as
-- postbox.claim shares a claim; a topic named in p_after_topics is taken after its position
-- there (see take_topic).
CREATE FUNCTION postbox.take(
    p_batch integer,
    p_all_topics boolean,
    p_topics text[],
    p_patterns text[],
    p_not_topics text[],
    p_not_patterns text[],
    p_after_topics text[] DEFAULT '{}',
    p_after_priorities smallint[] DEFAULT '{}',
    p_after_ids bigint[] DEFAULT '{}'
) RETURNS SETOF postbox.messages
LANGUAGE plpgsql
AS $$
DECLARE
    v_topics text[] := postbox.available_topics(p_all_topics, p_topics, p_patterns, p_not_topics, p_not_patterns);
    v_count integer := coalesce(cardinality(v_topics), 0);
    v_share integer;
    v_got integer := 0;
    v_n integer;
    v_topic text;
    v_at integer;
    v_priority smallint;
    v_id bigint;
    v_row postbox.messages;
    -- Topics that filled their share, and where their first take ended.
    v_more text[] := '{}';
    v_more_priorities smallint[] := '{}';
    v_more_ids bigint[] := '{}';
BEGIN
    IF v_count = 0 OR p_batch <= 0 THEN
        RETURN;
    END IF;
    IF v_count = 1 THEN
        -- One busy topic (the usual case): its take alone, without the row-by-row loop below.
        v_at := array_position(p_after_topics, v_topics[1]);
        RETURN QUERY SELECT * FROM postbox.take_topic(v_topics[1], p_batch, p_after_priorities[v_at], p_after_ids[v_at]);
        RETURN;
    END IF;
    IF v_count > p_batch THEN
        v_topics := ARRAY(SELECT t FROM unnest(v_topics) AS u(t) ORDER BY random() LIMIT p_batch);
        v_count := p_batch;
    END IF;
    v_share := p_batch / v_count;
    FOREACH v_topic IN ARRAY v_topics LOOP
        v_at := array_position(p_after_topics, v_topic);
        v_priority := p_after_priorities[v_at];
        v_id := p_after_ids[v_at];
        v_n := 0;
        FOR v_row IN SELECT * FROM postbox.take_topic(v_topic, v_share, v_priority, v_id) LOOP
            RETURN NEXT v_row;
            v_n := v_n + 1;
            v_priority := v_row.priority;
            v_id := v_row.id;
        END LOOP;
        v_got := v_got + v_n;
        IF v_n = v_share THEN
            v_more := v_more || v_topic;
            v_more_priorities := v_more_priorities || v_priority;
            v_more_ids := v_more_ids || v_id;
        END IF;
    END LOOP;
    -- The rest of the batch to the topics that had more, each after what it gave already (a row
    -- this transaction locked would be returned again).
    FOR i IN 1 .. cardinality(v_more) LOOP
        EXIT WHEN v_got >= p_batch;
        RETURN QUERY SELECT * FROM postbox.take_topic(v_more[i], p_batch - v_got, v_more_priorities[i], v_more_ids[i]);
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
    END LOOP;
END
$$;

-- Holds whose transaction ended without committing: their messages that are still available get
-- an expired lease (attempt counted, held_by noted), for the rescue of expired leases that runs
-- next. Waits at most 5 s for a message that another hold has taken meanwhile (holds are short);
-- past that it fails and is called again on the next tick. Returns how many messages it leased.
CREATE FUNCTION postbox.lost_holds() RETURNS integer
LANGUAGE plpgsql
SET lock_timeout = '5s'
AS $$
DECLARE
    v_hold record;
    v_n integer;
    v_total integer := 0;
BEGIN
    FOR v_hold IN
        SELECT xid, ids, held_by, pg_xact_status(xid) AS status FROM postbox.holds
        WHERE pg_xact_status(xid) IS DISTINCT FROM 'in progress'
        FOR UPDATE SKIP LOCKED
    LOOP
        IF v_hold.status IS DISTINCT FROM 'committed' THEN
            UPDATE postbox.messages m
            SET state = 'running',
                attempts = m.attempts + 1,
                locked_until = now() - interval '1 millisecond',
                lease_token = (random() * 9.2e18)::bigint,
                locked_by = v_hold.held_by || ' (its transaction ended without a commit)'
            WHERE m.id = ANY(v_hold.ids) AND m.state = 'available';
            GET DIAGNOSTICS v_n = ROW_COUNT;
            v_total := v_total + v_n;
        END IF;
        DELETE FROM postbox.holds WHERE xid = v_hold.xid;
    END LOOP;
    RETURN v_total;
END
$$;
