-- The postbox schema as the migrations leave it (pg_dump --schema-only --no-owner -n postbox).
-- Generated: do not edit; tests/structure.rs checks it, POSTBOX_BLESS=1 rewrites it.
--
-- PostgreSQL database dump
--

--
-- Name: postbox; Type: SCHEMA; Schema: -; Owner: -
--

CREATE SCHEMA postbox;

--
-- Name: message_state; Type: TYPE; Schema: postbox; Owner: -
--

CREATE TYPE postbox.message_state AS ENUM (
    'available',
    'scheduled',
    'running',
    'waiting'
);

--
-- Name: available_topics(boolean, text[], text[], text[], text[]); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.available_topics(p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[]) RETURNS text[]
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    IF NOT p_all_topics AND cardinality(p_patterns) = 0 THEN
        -- Exact names are not probed: the claim itself finds an empty topic at the same cost.
        RETURN ARRAY(
            SELECT t FROM unnest(p_topics) AS u(t)
            WHERE NOT (t = ANY(p_not_topics) OR t LIKE ANY(p_not_patterns)));
    END IF;
    RETURN ARRAY(
        WITH RECURSIVE d(topic) AS (
            SELECT (SELECT m.topic FROM postbox.messages m WHERE m.state = 'available'
                    ORDER BY m.topic LIMIT 1)
            UNION ALL
            SELECT (SELECT m.topic FROM postbox.messages m WHERE m.state = 'available' AND m.topic > d.topic
                    ORDER BY m.topic LIMIT 1)
            FROM d WHERE d.topic IS NOT NULL
        )
        SELECT topic FROM d
        WHERE topic IS NOT NULL
          AND (p_all_topics OR topic = ANY(p_topics) OR topic LIKE ANY(p_patterns))
          AND NOT (topic = ANY(p_not_topics) OR topic LIKE ANY(p_not_patterns)));
END
$$;

--
-- Name: boot_start(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.boot_start() RETURNS text
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog'
    AS $$
BEGIN
    INSERT INTO postbox.boot (token) VALUES (md5(random()::text || clock_timestamp()::text))
    ON CONFLICT (one) DO NOTHING;
    RETURN (SELECT token FROM postbox.boot);
END
$$;

--
-- Name: FUNCTION boot_start(); Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON FUNCTION postbox.boot_start() IS 'Makes the token of this server''s run if there is none (see postbox.boot)';

--
-- Name: boot; Type: TABLE; Schema: postbox; Owner: -
--

CREATE UNLOGGED TABLE postbox.boot (
    one boolean DEFAULT true NOT NULL,
    token text NOT NULL,
    CONSTRAINT boot_one_check CHECK (one)
);

--
-- Name: TABLE boot; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON TABLE postbox.boot IS 'One row, emptied by a crash or a promotion (unlogged): the token the floors a store keeps are stamped with; see the migration ready_takes';

--
-- Name: boot_token(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.boot_token() RETURNS text
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path TO 'pg_catalog'
    RETURN (SELECT boot.token FROM postbox.boot);

--
-- Name: FUNCTION boot_token(); Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON FUNCTION postbox.boot_token() IS 'The token of this server''s run (see postbox.boot); NULL until postbox.boot_start() made one: the claims only read it (a write there would make every other claim wait for the claim''s commit)';

--
-- Name: bytewise_topics(); Type: FUNCTION; Schema: postbox; Owner: -
--

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

--
-- Name: check_invariants(integer); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.check_invariants(p_limit integer DEFAULT 1000) RETURNS TABLE(kind text, topic text, key text, detail text)
    LANGUAGE sql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
    (SELECT 'stranded_key'::text, s.topic, s.key,
            (SELECT count(*) FROM postbox.messages w
             WHERE w.state = 'waiting' AND w.topic = s.topic AND w.key = s.key)::text || ' waiting'
     FROM postbox.stranded_keys(p_limit) s)
    UNION ALL
    (SELECT 'double_head'::text, h.topic, h.key,
            count(*)::text || ' heads: ' || string_agg(h.id::text || ' ' || h.state::text, ', ' ORDER BY h.id)
     FROM postbox.messages h
     -- A head kept for its writer (lease token 0) beside the next one a held batch leased is
     -- no double head: it is delivered, and nothing is promoted past the writer's message.
     WHERE h.ordered AND h.state <> 'waiting' AND h.lease_token IS DISTINCT FROM 0
     GROUP BY h.topic, h.key
     HAVING count(*) > 1
     LIMIT p_limit)
    UNION ALL
    (SELECT 'hold_over_limit'::text, NULL::text, NULL::text,
            format('held by %s for %s (limit %s), %s messages', h.held_by,
                   date_trunc('second', now() - h.held_at), coalesce(h.hold_limit, interval '60 seconds'),
                   cardinality(h.ids))
     FROM postbox.holds h
     WHERE h.held_at < now() - coalesce(h.hold_limit, interval '60 seconds') - interval '5 seconds'
       AND pg_xact_status(h.xid) = 'in progress'
     LIMIT p_limit)
$$;

--
-- Name: messages; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.messages (
    id bigint NOT NULL,
    topic text NOT NULL,
    key text,
    ordered boolean DEFAULT false NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 25 NOT NULL,
    locked_until timestamp with time zone,
    lease_token bigint,
    locked_by text,
    first_error text,
    last_error text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    dedup_key text,
    state postbox.message_state DEFAULT 'available'::postbox.message_state NOT NULL,
    cancelled boolean DEFAULT false NOT NULL,
    ready_xid xid8 DEFAULT pg_current_xact_id() NOT NULL,
    snoozes integer DEFAULT 0 NOT NULL,
    CONSTRAINT messages_attempts_not_negative CHECK ((attempts >= 0)),
    CONSTRAINT messages_headers_strings CHECK (((jsonb_typeof(headers) = 'object'::text) AND (NOT jsonb_path_exists(headers, '$.*?(@.type() != "string")'::jsonpath)))),
    CONSTRAINT messages_lease_complete CHECK (((locked_until IS NULL) = (lease_token IS NULL))),
    CONSTRAINT messages_max_attempts_positive CHECK ((max_attempts >= 1)),
    CONSTRAINT messages_ordered_needs_key CHECK (((NOT ordered) OR (key IS NOT NULL))),
    CONSTRAINT messages_state_lease CHECK (((state = 'running'::postbox.message_state) = (lease_token IS NOT NULL))),
    CONSTRAINT messages_topic_length CHECK (((octet_length(topic) >= 1) AND (octet_length(topic) <= 255))),
    CONSTRAINT messages_waiting_ordered CHECK (((state <> 'waiting'::postbox.message_state) OR ordered))
)
WITH (autovacuum_vacuum_scale_factor='0.01', autovacuum_vacuum_threshold='1000', autovacuum_vacuum_insert_scale_factor='0.01', autovacuum_analyze_scale_factor='0.02', autovacuum_vacuum_cost_delay='0');

--
-- Name: TABLE messages; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON TABLE postbox.messages IS 'postbox outbox: pending (locked_until IS NULL) and running (leased) messages';

--
-- Name: COLUMN messages.ready_xid; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON COLUMN postbox.messages.ready_xid IS 'The transaction that made the message available (insert, promotion, retry, rescue, release): the claim of every topic walks (priority, ready_xid, id) from floors kept per session';

--
-- Name: COLUMN messages.snoozes; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON COLUMN postbox.messages.snoozes IS 'Times a handler snoozed the message (ran it again later without using an attempt); engines cap it (max_snoozes)';

--
-- Name: claim(integer, double precision, boolean, text[], text[], text[], text[], bigint, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.claim(p_batch integer, p_lease_secs double precision, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_token bigint, p_owner text) RETURNS SETOF postbox.messages
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

--
-- Name: claim_floors_setting(text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.claim_floors_setting(p_topic text) RETURNS text
    LANGUAGE sql IMMUTABLE
    RETURN CASE WHEN (p_topic IS NULL) THEN 'postbox.claim_floors'::text ELSE ('postbox.claim_floors_'::text || md5(p_topic)) END;

--
-- Name: claim_limited(text, integer, boolean, boolean, text[], text[], integer, double precision, boolean, text[], text[], text[], text[], bigint, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.claim_limited(p_limit text, p_max integer, p_per_key boolean, p_limit_all boolean, p_limit_topics text[], p_limit_patterns text[], p_batch integer, p_lease_secs double precision, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET enable_hashagg TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    SET jit TO 'off'
    SET enable_incremental_sort TO 'off'
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
$$;

--
-- Name: claim_ready(text, integer, double precision, bigint, text, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.claim_ready(p_topic text, p_batch integer, p_lease_secs double precision, p_token bigint, p_owner text, p_floors text DEFAULT NULL::text) RETURNS SETOF postbox.messages
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
                WHERE m.state = 'available' AND m.topic = ANY(ARRAY[p_topic])
                  AND m.priority::integer > v_lo AND m.priority::integer < v_hi
                  AND m.ready_xid >= v_from
                ORDER BY m.topic, m.priority::integer, m.ready_xid LIMIT 1;
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
            -- (Read, then locked by id: locked in the look-up, the rows of each transaction up
            -- to the batch were locked and those beyond it not returned, held until the
            -- caller's transaction ended.)
            SELECT array_agg(l.id)
            INTO v_more
            FROM (SELECT m.id FROM postbox.messages m
                  WHERE m.id = ANY(ARRAY(
                            SELECT c.id
                            FROM unnest(v_ended_all) AS e(x),
                                 LATERAL (SELECT w.id FROM postbox.messages w
                                          WHERE w.state = 'available' AND w.priority::integer = v_priority
                                            AND w.ready_xid >= e.x AND w.ready_xid <= e.x AND w.ready_xid < v_from
                                            AND (p_topic IS NULL OR w.topic = p_topic)
                                          ORDER BY w.priority::integer, w.ready_xid, w.id
                                          LIMIT v_batch - v_got) c
                            LIMIT v_batch - v_got))
                    AND m.state::text = 'available' AND m.priority::integer = v_priority
                    AND m.ready_xid < v_from AND (p_topic IS NULL OR m.topic = p_topic)
                  FOR NO KEY UPDATE SKIP LOCKED) l;
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
                  WHERE m.state = 'available' AND m.topic = ANY(ARRAY[p_topic]) AND m.priority::integer = v_priority
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
            WHERE m.state = 'available' AND m.topic = ANY(ARRAY[p_topic]) AND m.priority::integer = v_priority
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

--
-- Name: FUNCTION claim_ready(p_topic text, p_batch integer, p_lease_secs double precision, p_token bigint, p_owner text, p_floors text); Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON FUNCTION postbox.claim_ready(p_topic text, p_batch integer, p_lease_secs double precision, p_token bigint, p_owner text, p_floors text) IS 'The claim of every topic (p_topic NULL, no exclusions) or of one topic named exactly, walking the claim order from the floors this session kept: see the migration ready_positions';

--
-- Name: claim_topic(text, integer, double precision, bigint, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.claim_topic(p_topic text, p_batch integer, p_lease_secs double precision, p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    AS $$
BEGIN
    RETURN QUERY SELECT * FROM postbox.claim_ready(p_topic, p_batch, p_lease_secs, p_token, p_owner);
END
$$;

--
-- Name: complete_in_tx(bigint, bigint); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.complete_in_tx(p_id bigint, p_token bigint) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    IF p_token IS NULL OR p_token = 0 OR NOT EXISTS (
        SELECT FROM postbox.messages m
        WHERE m.id = p_id
          AND ((m.state = 'running' AND m.lease_token = p_token)
               OR (m.state = 'available'
                   AND EXISTS (SELECT FROM postbox.holds h
                               WHERE h.token = p_token AND p_id = ANY (h.ids)
                                 AND pg_xact_status(h.xid) = 'in progress')))
    ) THEN
        RAISE EXCEPTION 'postbox: message % is no longer delivered under this lease (it expired, or the message was settled): its work is not recorded', p_id;
    END IF;
    INSERT INTO postbox.completed_in_tx (id) VALUES (p_id) ON CONFLICT (id) DO NOTHING;
    RETURN FOUND;
END
$$;

--
-- Name: completed_expired(timestamp with time zone); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.completed_expired(p_before timestamp with time zone) RETURNS TABLE(name text, detach_pending boolean)
    LANGUAGE sql STABLE
    AS $_$
    SELECT c.relname::text, i.inhdetachpending
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'postbox.completed'::regclass
      AND c.relname ~ '^completed_[0-9]{8}_[0-9]{2}$'
      AND (i.inhdetachpending
           OR make_timestamptz(substr(c.relname, 11, 4)::int, substr(c.relname, 15, 2)::int,
                               substr(c.relname, 17, 2)::int, substr(c.relname, 20, 2)::int, 0, 0, 'UTC')
              + interval '1 hour' <= p_before)
    ORDER BY 1
$_$;

--
-- Name: completed_partitions(interval); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.completed_partitions(p_ahead interval) RETURNS integer
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

--
-- Name: drop_expired_completed(timestamp with time zone); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.drop_expired_completed(p_before timestamp with time zone) RETURNS integer
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

--
-- Name: filter_floors_setting(boolean, text[], text[], text[], text[]); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.filter_floors_setting(p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[]) RETURNS text
    LANGUAGE sql IMMUTABLE
    RETURN ('postbox.filter_floors_'::text || md5(format('%s|%s|%s|%s|%s'::text, p_all_topics, p_topics, p_patterns, p_not_topics, p_not_patterns)));

--
-- Name: FUNCTION filter_floors_setting(p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[]); Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON FUNCTION postbox.filter_floors_setting(p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[]) IS 'The session setting in which postbox.take_matching keeps the floors of a filter';

--
-- Name: finish_heads(integer); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.finish_heads(p_limit integer) RETURNS TABLE(finished integer, still_kept integer)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    v_topics text[];
    v_keys text[];
    v_ids bigint[];
    v_left integer;
BEGIN
    -- SKIP LOCKED before LIMIT: heads still pinned are passed over in the scan, however many,
    -- and those whose writers are done are reached.
    v_ids := ARRAY(
        SELECT id FROM postbox.messages
        WHERE state = 'running' AND locked_until = postbox.kept_head_lease() AND lease_token = 0
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED);
    IF cardinality(v_ids) < p_limit THEN
        -- (One whose lease an operator's SQL moved: rescues leave it alone.)
        v_ids := v_ids || ARRAY(
            SELECT id FROM postbox.messages
            WHERE state = 'running' AND locked_until < now() AND lease_token = 0
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
         WHERE state = 'running' AND locked_until = postbox.kept_head_lease() AND lease_token = 0
         LIMIT 10000)
        UNION ALL
        (SELECT 1 FROM postbox.messages
         WHERE state = 'running' AND locked_until < now() AND lease_token = 0
         LIMIT 10000)) k;
    RETURN QUERY SELECT coalesce(cardinality(v_ids), 0), v_left;
END
$$;

--
-- Name: finish_heads(integer, timestamp with time zone); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.finish_heads(p_limit integer, p_expired_from timestamp with time zone) RETURNS TABLE(finished integer, still_kept integer, walked_to double precision)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    SET enable_incremental_sort TO 'off'
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

--
-- Name: hand_over(text[], text[], bigint[], integer, double precision, bigint, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.hand_over(p_topics text[], p_keys text[], p_removed bigint[], p_limit integer, p_lease_secs double precision, p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE sql
    AS $$ SELECT * FROM postbox.promote_keys(p_topics, p_keys, p_removed, false, p_limit, p_lease_secs, p_token, p_owner) $$;

--
-- Name: intake_no_update(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.intake_no_update() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION 'postbox.intake rows are not updated (a relay moves them as they were written): delete the row and insert another'
        USING ERRCODE = 'feature_not_supported';
END
$$;

--
-- Name: kept_head_lease(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.kept_head_lease() RETURNS timestamp with time zone
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT 'infinity'::timestamptz $$;

--
-- Name: key_lock_id(text, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.key_lock_id(p_topic text, p_key text) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT hashtext(p_topic || E'\x1f' || p_key) & 255 $$;

--
-- Name: key_writer_lock(text, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.key_writer_lock(p_topic text, p_key text) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT hashtextextended(p_topic || E'\x1f' || p_key, 1886352244) $$;

--
-- Name: limit_topics(boolean, text[], text[]); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.limit_topics(p_all boolean, p_topics text[], p_patterns text[]) RETURNS text[]
    LANGUAGE sql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
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

--
-- Name: lock_keys(text[], text[]); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.lock_keys(p_topics text[], p_keys text[]) RETURNS bigint
    LANGUAGE sql
    AS $$
    SELECT count(pg_advisory_xact_lock(k.h))
    FROM (SELECT DISTINCT postbox.key_writer_lock(t, k) AS h FROM unnest(p_topics, p_keys) AS u(t, k) ORDER BY 1) k
$$;

--
-- Name: lost_holds(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.lost_holds() RETURNS integer
    LANGUAGE plpgsql
    SET lock_timeout TO '5s'
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

--
-- Name: messages_after_replay(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.messages_after_replay() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'postbox', 'pg_temp'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    IF TG_RELID <> 'postbox.messages'::regclass THEN
        RAISE EXCEPTION 'permission denied: postbox''s trigger % runs on postbox.messages only', TG_NAME
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    -- The trigger's WHEN found that the inserting role may insert ids (a replay).
    UPDATE postbox.messages SET state = 'waiting'
    WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting' AND state <> 'running'
      AND id > NEW.id;
    RETURN NULL;
END
$$;

--
-- Name: messages_before_insert(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.messages_before_insert() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'postbox', 'pg_temp'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    SET enable_incremental_sort TO 'off'
    AS $$
DECLARE
    v_head record;
BEGIN
    IF TG_RELID <> 'postbox.messages'::regclass THEN
        RAISE EXCEPTION 'permission denied: postbox''s trigger % runs on postbox.messages only', TG_NAME
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF NOT NEW.ordered THEN
        NEW.state := postbox.ready_state(NEW.run_at);
        RETURN NEW;
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'postbox: ordered messages must be enqueued in a READ COMMITTED transaction (the order of a key is decided as writers commit), not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'feature_not_supported';
    END IF;
    PERFORM pg_advisory_xact_lock(postbox.key_writer_lock(NEW.topic, NEW.key));
    -- 'keep': the trigger's WHEN found that the inserting role may insert ids (a replay).
    IF TG_ARGV[0] IS DISTINCT FROM 'keep' THEN
        NEW.id := nextval('postbox.messages_id_seq');
    END IF;
    LOOP
        -- A new statement sees every earlier writer of the key: they committed before we got the
        -- lock.
        SELECT id, state INTO v_head FROM postbox.messages
        WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting'
        ORDER BY id DESC LIMIT 1;
        EXIT WHEN NOT FOUND;
        IF v_head.id > NEW.id THEN
            -- A replay of an older message: back in front of a head that has not started (locked
            -- here, demoted by messages_after_replay once the row is in)...
            PERFORM 1 FROM postbox.messages
            WHERE id = v_head.id AND state IN ('available', 'scheduled')
            FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                NEW.state := postbox.ready_state(NEW.run_at);
                RETURN NEW;
            END IF;
            IF v_head.state NOT IN ('available', 'scheduled') THEN
                -- ...but not behind one that runs: it stays dead (the replay reports it skipped)
                -- and can be replayed once that head is settled...
                RETURN NULL;
            END IF;
            -- ...and behind one that a claim or a held batch has locked (it is starting), pinned
            -- below like any head a message goes behind.
        END IF;
        -- The pin: the head stays until this transaction ends (whoever settles it meanwhile
        -- leaves it in place, see kept_head_lease). Waits only for a settle deleting it right
        -- now; then the key has a new head, or none: look again.
        PERFORM 1 FROM postbox.messages
        WHERE id = v_head.id AND state::text <> 'waiting'
        FOR KEY SHARE;
        IF FOUND THEN
            NEW.state := 'waiting';
            RETURN NEW;
        END IF;
    END LOOP;
    IF EXISTS (SELECT 1 FROM postbox.messages
               WHERE state = 'waiting' AND topic = NEW.topic AND key = NEW.key) THEN
        -- Waiting messages and no head: a stranded key (an operator's SQL can make one). It goes
        -- behind them; the relay's repair gives the key its head.
        NEW.state := 'waiting';
    ELSE
        NEW.state := postbox.ready_state(NEW.run_at);
    END IF;
    RETURN NEW;
END
$$;

--
-- Name: messages_check_head(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.messages_check_head() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'postbox', 'pg_temp'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    SET enable_incremental_sort TO 'off'
    AS $$
DECLARE
    v_head record;
BEGIN
    IF TG_RELID <> 'postbox.messages'::regclass THEN
        RAISE EXCEPTION 'permission denied: postbox''s trigger % runs on postbox.messages only', TG_NAME
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    SELECT id, state INTO v_head FROM postbox.messages
    WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting'
    ORDER BY id DESC LIMIT 1;
    IF NOT FOUND THEN
        PERFORM count(*) FROM postbox.promote_keys(ARRAY[NEW.topic], ARRAY[NEW.key], ARRAY[NULL::bigint],
                                                   true, 0, 1, 0, '');
    ELSIF v_head.id > NEW.id AND v_head.state IN ('available', 'scheduled')
          AND EXISTS (SELECT 1 FROM postbox.messages WHERE id = NEW.id AND state::text = 'waiting') THEN
        -- Not waited for: a head that a claim or a held batch has locked is starting, and the
        -- replayed message stays behind it.
        PERFORM 1 FROM postbox.messages
        WHERE id = v_head.id AND state IN ('available', 'scheduled')
        FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            UPDATE postbox.messages SET state = 'waiting' WHERE id = v_head.id;
            UPDATE postbox.messages
            SET state = CASE WHEN run_at > statement_timestamp() THEN 'scheduled'::postbox.message_state
                             ELSE 'available'::postbox.message_state END
            WHERE id = NEW.id;
            RETURN NULL;
        END IF;
    END IF;
    IF EXISTS (SELECT 1 FROM postbox.messages WHERE id = NEW.id AND state::text = 'waiting') THEN
        INSERT INTO postbox.behind (topic, key, id) VALUES (NEW.topic, NEW.key, NEW.id)
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN NULL;
END
$$;

--
-- Name: messages_inserted(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.messages_inserted() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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
$$;

--
-- Name: messages_ready(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.messages_ready() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    NEW.ready_xid := pg_current_xact_id();
    RETURN NEW;
END
$$;

--
-- Name: move_intake(integer, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.move_intake(p_max integer, p_floor text DEFAULT NULL::text) RETURNS TABLE(moved integer, floor text)
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

--
-- Name: FUNCTION move_intake(p_max integer, p_floor text); Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON FUNCTION postbox.move_intake(p_max integer, p_floor text) IS 'Moves up to p_max rows of postbox.intake into postbox.messages from the floor p_floor (NULL: from the front); returns how many and the next floor. Call it in a transaction of its own.';

--
-- Name: narrow_topics(boolean, text[], text[], text[], text[], integer); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.narrow_topics(p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_max integer) RETURNS text[]
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

--
-- Name: note_removed_head(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.note_removed_head() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM set_config('postbox.removed_heads',
        coalesce(current_setting('postbox.removed_heads', true), '') || jsonb_build_array(OLD.topic, OLD.key, OLD.id)::text || ',',
        true);
    RETURN NULL;
END
$$;

--
-- Name: pick(integer, boolean, text[], text[], text[], text[], smallint, bigint); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.pick(p_batch integer, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_after_priority smallint DEFAULT NULL::smallint, p_after_id bigint DEFAULT NULL::bigint) RETURNS SETOF postbox.messages
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
                -- (The filter again: a row whose topic changed since it was read is not served.)
                RETURN QUERY SELECT m.* FROM postbox.messages m
                    WHERE m.id = ANY(v_ids) AND m.state = 'available'
                      AND (p_all_topics OR m.topic = ANY(p_topics) OR m.topic LIKE ANY(p_patterns))
                      AND NOT (m.topic = ANY(p_not_topics) OR m.topic LIKE ANY(p_not_patterns))
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
    IF p_after_priority IS NULL AND v_got = 0 AND NOT p_all_topics AND cardinality(p_patterns) = 0 THEN
        -- From the floors each of them keeps in the session (see the migration ready_sets).
        RETURN QUERY SELECT * FROM postbox.take_set(v_topics, v_batch);
        RETURN;
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
            WHERE m.id = ANY(v_ids) AND m.state = 'available' AND m.topic = ANY(v_topics)
            ORDER BY m.priority, m.id FOR NO KEY UPDATE SKIP LOCKED;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
        EXIT WHEN v_got >= v_batch OR cardinality(v_ids) < v_batch - v_got + v_n;
        v_priority := v_end[1];
        v_id := v_end[2];
    END LOOP;
END
$$;

--
-- Name: promote_after(text[], text[], bigint[]); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.promote_after(p_topics text[], p_keys text[], p_removed bigint[]) RETURNS integer
    LANGUAGE sql
    AS $$ SELECT count(*)::integer FROM postbox.promote_keys(p_topics, p_keys, p_removed, false, 0, 1, 0, '') $$;

--
-- Name: promote_due(integer); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.promote_due(p_limit integer) RETURNS TABLE(promoted integer, next_due_secs double precision)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    SET enable_incremental_sort TO 'off'
    AS $$
DECLARE
    v_n integer;
BEGIN
    WITH due AS (
        SELECT id FROM postbox.messages
        WHERE state = 'scheduled' AND run_at <= now()
        ORDER BY run_at
        LIMIT p_limit
        FOR NO KEY UPDATE SKIP LOCKED
    )
    UPDATE postbox.messages m SET state = 'available' FROM due WHERE m.id = due.id;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n > 0 THEN
        PERFORM postbox.wake();
    END IF;
    RETURN QUERY
    SELECT v_n,
           -- NULL when nothing is scheduled (greatest() would turn it into 0: a busy loop).
           (SELECT extract(epoch FROM min(run_at) - now())::float8
            FROM postbox.messages WHERE state = 'scheduled' AND run_at > now());
END
$$;

--
-- Name: promote_due(integer, timestamp with time zone); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.promote_due(p_limit integer, p_due_from timestamp with time zone) RETURNS TABLE(promoted integer, next_due_secs double precision, walked_to double precision)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    SET enable_incremental_sort TO 'off'
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

--
-- Name: promote_key(text, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.promote_key(p_topic text, p_key text) RETURNS void
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    IF (SELECT id FROM postbox.messages
        WHERE ordered AND topic = p_topic AND key = p_key AND state <> 'waiting'
        ORDER BY id DESC LIMIT 1) IS NULL THEN
        PERFORM count(*) FROM postbox.promote_keys(ARRAY[p_topic], ARRAY[p_key], ARRAY[NULL::bigint],
                                                   true, 0, 1, 0, '');
    END IF;
END
$$;

--
-- Name: promote_keys(text[], text[], bigint[], boolean, integer, double precision, bigint, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.promote_keys(p_topics text[], p_keys text[], p_removed bigint[], p_exclusive boolean, p_limit integer, p_lease_secs double precision, p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
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
$$;

--
-- Name: FUNCTION promote_keys(p_topics text[], p_keys text[], p_removed bigint[], p_exclusive boolean, p_limit integer, p_lease_secs double precision, p_token bigint, p_owner text); Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON FUNCTION postbox.promote_keys(p_topics text[], p_keys text[], p_removed bigint[], p_exclusive boolean, p_limit integer, p_lease_secs double precision, p_token bigint, p_owner text) IS 'The one promotion of ordered keys: each key without a head gets its first waiting message as head; up to p_limit due ones are leased to the caller (token, owner) instead. p_removed: the head the caller removed (NULL: none; then p_exclusive)';

--
-- Name: promote_removed_heads(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.promote_removed_heads() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_noted text := current_setting('postbox.removed_heads', true);
    v_keys jsonb;
BEGIN
    IF v_noted IS NULL OR v_noted = '' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('postbox.removed_heads', '', true);
    v_keys := ('[' || rtrim(v_noted, ',') || ']')::jsonb;
    PERFORM postbox.promote_after(
        ARRAY(SELECT k->>0 FROM jsonb_array_elements(v_keys) AS e(k)),
        ARRAY(SELECT k->>1 FROM jsonb_array_elements(v_keys) AS e(k)),
        ARRAY(SELECT (k->>2)::bigint FROM jsonb_array_elements(v_keys) AS e(k)));
    RETURN NULL;
END
$$;

--
-- Name: publish(text[]); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.publish(p_contents text[]) RETURNS integer
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_n integer := 0;
BEGIN
    IF current_setting('wal_level') <> 'logical' THEN
        RAISE EXCEPTION 'postbox stream: wal_level is %, not logical: nothing would read a published message', current_setting('wal_level')
            USING ERRCODE = '55000',
                  HINT = 'Set wal_level = logical, restart the server, then run `postbox stream setup`; or enqueue the message instead.';
    END IF;
    IF NOT EXISTS (
        SELECT 1
        FROM postbox.stream_slots r
        JOIN pg_catalog.pg_replication_slots s ON s.slot_name = r.slot_name
        WHERE s.database = current_database()
          AND s.slot_type = 'logical'
          AND s.plugin = 'pgoutput'
          -- Set once the slot is ready: from then on every commit is decoded (a slot still being
          -- created, waiting for older transactions, would not stream what commits meanwhile).
          AND s.confirmed_flush_lsn IS NOT NULL
          AND s.wal_status IS DISTINCT FROM 'lost'
    ) THEN
        RAISE EXCEPTION 'postbox stream: database % has no postbox stream slot (or its slot was lost): nothing would read a published message', current_database()
            USING ERRCODE = '55000',
                  HINT = 'Run `postbox stream setup` (an operator with the REPLICATION attribute); or enqueue the message instead.';
    END IF;
    IF NOT EXISTS (
        SELECT 1
        FROM postbox.stream_slots r
        JOIN pg_catalog.pg_replication_slots s ON s.slot_name = r.slot_name
        JOIN pg_catalog.pg_publication p ON p.pubname = r.publication
        WHERE s.database = current_database()
    ) THEN
        RAISE EXCEPTION 'postbox stream: the publication of the stream slot is missing in database %: relays cannot stream, nothing would be delivered', current_database()
            USING ERRCODE = '55000',
                  HINT = 'Run `postbox stream setup` (it creates the publication); or enqueue the message instead.';
    END IF;
    SELECT count(pg_catalog.pg_logical_emit_message(true, 'postbox', c) ORDER BY i)
    INTO v_n
    FROM unnest(p_contents) WITH ORDINALITY AS u(c, i);
    RETURN v_n;
END
$$;

--
-- Name: ready_state(timestamp with time zone); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.ready_state(p_run_at timestamp with time zone) RETURNS postbox.message_state
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT CASE WHEN p_run_at > now() THEN 'scheduled'::postbox.message_state ELSE 'available'::postbox.message_state END $$;

--
-- Name: stranded_keys(integer); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.stranded_keys(p_limit integer) RETURNS TABLE(topic text, key text)
    LANGUAGE sql STABLE
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
    WITH RECURSIVE waiting_keys(topic, key) AS (
        (SELECT w.topic, w.key FROM postbox.messages w WHERE w.state = 'waiting'
         ORDER BY w.topic, w.key LIMIT 1)
        UNION ALL
        SELECT n.topic, n.key FROM waiting_keys wk,
            LATERAL (SELECT w.topic, w.key FROM postbox.messages w
                     WHERE w.state = 'waiting' AND (w.topic, w.key) > (wk.topic, wk.key)
                     ORDER BY w.topic, w.key LIMIT 1) n
    )
    SELECT wk.topic, wk.key
    FROM waiting_keys wk
    WHERE (SELECT h.id FROM postbox.messages h
           WHERE h.ordered AND h.topic = wk.topic AND h.key = wk.key AND h.state <> 'waiting'
           ORDER BY h.id DESC LIMIT 1) IS NULL
    LIMIT p_limit
$$;

--
-- Name: take(integer, boolean, text[], text[], text[], text[], text[], smallint[], bigint[]); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.take(p_batch integer, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_after_topics text[] DEFAULT '{}'::text[], p_after_priorities smallint[] DEFAULT '{}'::smallint[], p_after_ids bigint[] DEFAULT '{}'::bigint[]) RETURNS SETOF postbox.messages
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

--
-- Name: take_matching(boolean, text[], text[], text[], text[], integer, double precision, bigint, text, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.take_matching(p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_batch integer, p_lease_secs double precision DEFAULT NULL::double precision, p_token bigint DEFAULT NULL::bigint, p_owner text DEFAULT NULL::text, p_floors text DEFAULT NULL::text) RETURNS SETOF postbox.messages
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

--
-- Name: FUNCTION take_matching(p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_batch integer, p_lease_secs double precision, p_token bigint, p_owner text, p_floors text); Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON FUNCTION postbox.take_matching(p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_batch integer, p_lease_secs double precision, p_token bigint, p_owner text, p_floors text) IS 'The claim (p_lease_secs given) or take of a filter with patterns or exclusions, walking the claim order from the floors this session keeps of the filter: see the migration filter_floors';

--
-- Name: take_ready(text, integer, text); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.take_ready(p_topic text, p_batch integer, p_floors text DEFAULT NULL::text) RETURNS SETOF postbox.messages
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
                WHERE m.state = 'available' AND m.topic = ANY(ARRAY[p_topic])
                  AND m.priority::integer > v_lo AND m.priority::integer < v_hi
                  AND m.ready_xid >= v_from
                ORDER BY m.topic, m.priority::integer, m.ready_xid LIMIT 1;
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
            -- (Read, then locked by id: locked in the look-up, the rows of each transaction up
            -- to the batch were locked and those beyond it not returned, held until the
            -- caller's transaction ended.)
            SELECT array_agg(l.id)
            INTO v_more
            FROM (SELECT m.id FROM postbox.messages m
                  WHERE m.id = ANY(ARRAY(
                            SELECT c.id
                            FROM unnest(v_ended_all) AS e(x),
                                 LATERAL (SELECT w.id FROM postbox.messages w
                                          WHERE w.state = 'available' AND w.priority::integer = v_priority
                                            AND w.ready_xid >= e.x AND w.ready_xid <= e.x AND w.ready_xid < v_from
                                            AND (p_topic IS NULL OR w.topic = p_topic)
                                          ORDER BY w.priority::integer, w.ready_xid, w.id
                                          LIMIT v_batch - v_got) c
                            LIMIT v_batch - v_got))
                    AND m.state::text = 'available' AND m.priority::integer = v_priority
                    AND m.ready_xid < v_from AND (p_topic IS NULL OR m.topic = p_topic)
                  FOR NO KEY UPDATE SKIP LOCKED) l;
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
            WHERE m.state = 'available' AND m.topic = ANY(ARRAY[p_topic]) AND m.priority::integer = v_priority
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
            WHERE m.state = 'available' AND m.topic = ANY(ARRAY[p_topic]) AND m.priority::integer = v_priority
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

--
-- Name: FUNCTION take_ready(p_topic text, p_batch integer, p_floors text); Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON FUNCTION postbox.take_ready(p_topic text, p_batch integer, p_floors text) IS 'The take of a held batch of every topic (p_topic NULL) or of one topic named exactly: postbox.claim_ready''s walk from the floors, locking the rows instead of leasing them; see the migration ready_takes';

--
-- Name: take_set(text[], integer, double precision, bigint, text, text[]); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.take_set(p_topics text[], p_batch integer, p_lease_secs double precision DEFAULT NULL::double precision, p_token bigint DEFAULT NULL::bigint, p_owner text DEFAULT NULL::text, p_floors text[] DEFAULT NULL::text[]) RETURNS SETOF postbox.messages
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
    v_snap pg_snapshot := pg_current_snapshot();
    v_running xid8[] := ARRAY(SELECT pg_snapshot_xip(v_snap)
                              UNION ALL SELECT pg_current_xact_id_if_assigned() WHERE pg_current_xact_id_if_assigned() IS NOT NULL);
    v_topics text[] := ARRAY(SELECT DISTINCT u.t FROM unnest(p_topics) AS u(t) WHERE u.t IS NOT NULL);
    -- One entry per (topic, priority): the topic's place in v_topics, the priority, the floor.
    e_topic integer[] := '{}';
    e_priority integer[] := '{}';
    e_floor xid8[] := '{}';
    -- Per topic: its pending transactions that ended since its floors were set (their rows may
    -- be below the floors; looked up by their ids alone), and how many priorities it knows.
    v_ended_of text[] := '{}';
    v_known_of integer[] := '{}';
    -- The statements name the topic as `m.topic = ANY(ARRAY[v_topic])`, not `m.topic = v_topic`:
    -- an equality makes the topic a constant of the order, which messages_ready_idx then gives
    -- as well (priority, ready_xid, id), and the generic plan of a table analyzed while it held
    -- one topic (1/n_distinct = 1: every row is of any topic) took that smaller index and
    -- filtered on the topic: 1,777 buffers for a claim of 100 beside 20,000 rows of another
    -- topic, against 7. An array keeps the topic in the order, which only
    -- messages_ready_topic_idx gives without a sort.
    v_topic text;
    v_floor xid8;
    v_ended xid8[];
    v_state text;
    v_given text;
    v_above xid8;
    v_pending xid8[];
    v_from xid8;
    v_pair text;
    v_tp integer[];
    v_tf xid8[];
    v_known integer[];
    v_lo integer;
    v_hi integer;
    v_found integer;
    v_levels integer[];
    v_level integer;
    v_entries integer[];
    v_ids bigint[] := '{}';
    -- What the topics of a priority have first: (ready_xid, id) of each.
    v_cand_xids xid8[];
    v_cand_ids bigint[];
    v_xids xid8[];
    v_read bigint[];
    v_more bigint[];
    v_got integer := 0;
    v_n integer;
    v_next xid8;
    v_probed xid8;
    v_out text[];
    t integer;
    k integer;
BEGIN
    IF v_batch <= 0 OR cardinality(v_topics) = 0 THEN
        RETURN;
    END IF;
    -- Each topic's floors, and the priorities not known yet (as postbox.take_ready finds them).
    FOR t IN 1 .. cardinality(v_topics) LOOP
        v_topic := v_topics[t];
        v_state := current_setting(postbox.claim_floors_setting(v_topic), true);
        -- The floors given for the topic (p_floors, in the order of p_topics: another session of
        -- the same process kept them), when they are newer; '' asks for a walk from the front.
        v_given := (SELECT u.f FROM unnest(p_topics, p_floors) AS u(t, f)
                    WHERE u.t = v_topic AND u.f IS NOT NULL LIMIT 1);
        IF v_given = '' THEN
            v_state := NULL;
        ELSIF v_given IS NOT NULL AND (coalesce(v_state, '') = ''
                OR split_part(v_given, ';', 1)::xid8 > split_part(v_state, ';', 1)::xid8) THEN
            v_state := v_given;
        END IF;
        -- Floors from the future are from another server: worthless here.
        IF coalesce(v_state, '') <> '' AND split_part(v_state, ';', 1)::xid8 > pg_snapshot_xmax(v_snap) THEN
            v_state := NULL;
        END IF;
        v_above := '0';
        v_pending := '{}';
        v_tp := '{}';
        v_tf := '{}';
        IF coalesce(v_state, '') <> '' THEN
            v_above := split_part(v_state, ';', 1)::xid8;
            v_pending := string_to_array(split_part(v_state, ';', 2), ',')::xid8[];
            FOREACH v_pair IN ARRAY string_to_array(split_part(v_state, ';', 3), ',') LOOP
                v_tp := v_tp || split_part(v_pair, ':', 1)::integer;
                v_tf := v_tf || split_part(v_pair, ':', 2)::xid8;
            END LOOP;
        END IF;
        v_ended := ARRAY(SELECT x FROM unnest(v_pending) AS u(x) WHERE NOT x = ANY(v_running));
        v_from := least(v_above, (SELECT min(x) FROM unnest(v_ended) AS u(x)));
        v_lo := -2147483648;
        v_known := ARRAY(SELECT p FROM unnest(v_tp) AS u(p) ORDER BY p) || 2147483647;
        FOREACH v_hi IN ARRAY v_known LOOP
            LOOP
                -- explain: a priority of a topic of the set not known yet
                SELECT m.priority::integer
                INTO v_found
                FROM postbox.messages m
                WHERE m.state = 'available' AND m.topic = ANY(ARRAY[v_topic])
                  AND m.priority::integer > v_lo AND m.priority::integer < v_hi
                  AND m.ready_xid >= v_from
                ORDER BY m.topic, m.priority::integer, m.ready_xid LIMIT 1;
                EXIT WHEN NOT FOUND;
                v_tp := v_tp || v_found;
                v_tf := v_tf || v_from;
                v_lo := v_found;
            END LOOP;
            v_lo := v_hi;
        END LOOP;
        FOR k IN 1 .. coalesce(cardinality(v_tp), 0) LOOP
            e_topic := e_topic || t;
            e_priority := e_priority || v_tp[k];
            e_floor := e_floor || v_tf[k];
        END LOOP;
        v_ended_of := v_ended_of || array_to_string(v_ended, ',');
        v_known_of := v_known_of || coalesce(cardinality(v_tp), 0);
    END LOOP;
    -- One priority at a time, most urgent first.
    v_levels := ARRAY(SELECT DISTINCT p FROM unnest(e_priority) AS u(p) ORDER BY p);
    FOREACH v_level IN ARRAY v_levels LOOP
        EXIT WHEN v_got >= v_batch;
        -- Its topics, in an order of their own each time (the turns below are taken in it).
        v_entries := ARRAY(SELECT g.k FROM generate_subscripts(e_priority, 1) AS g(k)
                           WHERE e_priority[g.k] = v_level ORDER BY random());
        -- The rows of the pending transactions that ended, below the floors, by their ids.
        FOREACH k IN ARRAY v_entries LOOP
            EXIT WHEN v_got >= v_batch;
            CONTINUE WHEN v_ended_of[e_topic[k]] = '';
            v_topic := v_topics[e_topic[k]];
            v_floor := e_floor[k];
            v_ended := string_to_array(v_ended_of[e_topic[k]], ',')::xid8[];
            -- (Read, then locked by id: see postbox.take_ready.)
            SELECT array_agg(l.id)
            INTO v_more
            FROM (SELECT m.id FROM postbox.messages m
                  WHERE m.id = ANY(ARRAY(
                            SELECT c.id
                            FROM unnest(v_ended) AS e(x),
                                 LATERAL (SELECT w.id FROM postbox.messages w
                                          WHERE w.state = 'available' AND w.topic = ANY(ARRAY[v_topic])
                                            AND w.priority::integer = v_level
                                            AND w.ready_xid >= e.x AND w.ready_xid <= e.x AND w.ready_xid < v_floor
                                          ORDER BY w.topic, w.priority::integer, w.ready_xid, w.id
                                          LIMIT v_batch - v_got) c
                            LIMIT v_batch - v_got))
                    AND m.state::text = 'available' AND m.topic = v_topic
                    AND m.priority::integer = v_level AND m.ready_xid < v_floor
                  FOR NO KEY UPDATE SKIP LOCKED) l;
            v_more := coalesce(v_more, '{}');
            v_ids := v_ids || v_more;
            v_got := cardinality(v_ids);
        END LOOP;
        EXIT WHEN v_got >= v_batch;
        -- The first rows of the priority of each topic, from its floor (read, not locked); the
        -- first of them all in (ready_xid, id) order; those of them no one else has locked.
        v_cand_xids := '{}';
        v_cand_ids := '{}';
        FOREACH k IN ARRAY v_entries LOOP
            v_topic := v_topics[e_topic[k]];
            v_floor := e_floor[k];
            -- explain: the first rows of a priority of a topic of the set
            SELECT array_agg(c.ready_xid), array_agg(c.id)
            INTO v_xids, v_read
            FROM (SELECT m.ready_xid, m.id FROM postbox.messages m
                  WHERE m.state = 'available' AND m.topic = ANY(ARRAY[v_topic])
                    AND m.priority::integer = v_level AND m.ready_xid >= v_floor
                  ORDER BY m.topic, m.priority::integer, m.ready_xid, m.id
                  LIMIT v_batch - v_got) c;
            IF v_read IS NOT NULL THEN
                v_cand_xids := v_cand_xids || v_xids;
                v_cand_ids := v_cand_ids || v_read;
            END IF;
        END LOOP;
        CONTINUE WHEN cardinality(v_cand_ids) = 0;
        v_read := ARRAY(SELECT c.id FROM unnest(v_cand_xids, v_cand_ids) AS c(x, id)
                        ORDER BY c.x, c.id LIMIT v_batch - v_got);
        -- (Their topic and priority again: a row changed and committed since it was read is
        -- another topic's, or another priority's.)
        SELECT array_agg(c.id)
        INTO v_more
        FROM (SELECT m.id FROM postbox.messages m
              WHERE m.id = ANY(v_read) AND m.state::text = 'available'
                AND m.topic = ANY(v_topics) AND m.priority::integer = v_level
              FOR NO KEY UPDATE SKIP LOCKED) c;
        v_more := coalesce(v_more, '{}');
        v_ids := v_ids || v_more;
        v_got := cardinality(v_ids);
        -- All of them taken: the priority gave what it had, or the batch is full.
        CONTINUE WHEN cardinality(v_more) = cardinality(v_read);
        -- Some were locked (another relay's holds, a claim in flight): the rest from each topic
        -- in turn, past what this take locked.
        FOREACH k IN ARRAY v_entries LOOP
            EXIT WHEN v_got >= v_batch;
            v_topic := v_topics[e_topic[k]];
            v_floor := e_floor[k];
            SELECT array_agg(c.id), count(*)
            INTO v_more, v_n
            FROM (SELECT m.id FROM postbox.messages m
                  WHERE m.state = 'available' AND m.topic = ANY(ARRAY[v_topic])
                    AND m.priority::integer = v_level AND m.ready_xid >= v_floor
                    AND NOT m.id = ANY(v_ids)
                  ORDER BY m.topic, m.priority::integer, m.ready_xid, m.id
                  LIMIT v_batch - v_got
                  FOR NO KEY UPDATE SKIP LOCKED) c;
            IF v_n > 0 THEN
                v_ids := v_ids || v_more;
                v_got := v_got + v_n;
            END IF;
        END LOOP;
    END LOOP;
    IF p_lease_secs IS NULL THEN
        RETURN QUERY SELECT m.* FROM postbox.messages m WHERE m.id = ANY(v_ids);
    ELSIF v_got > 0 THEN
        -- A claim: leased, so that the floors pass them.
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
    -- The new floors of each topic: the first row still available of each priority (a take's
    -- rows are among them), else the snapshot's end; what was running at v_snap is pending.
    IF NOT v_keep THEN
        RETURN;
    END IF;
    FOR t IN 1 .. cardinality(v_topics) LOOP
        v_topic := v_topics[t];
        v_ended := string_to_array(v_ended_of[t], ',')::xid8[];
        v_out := '{}';
        FOR k IN 1 .. coalesce(cardinality(e_topic), 0) LOOP
            CONTINUE WHEN e_topic[k] <> t;
            v_level := e_priority[k];
            v_floor := e_floor[k];
            v_probed := NULL;
            IF cardinality(v_ended) > 0 THEN
                SELECT min(c.ready_xid)
                INTO v_probed
                FROM unnest(v_ended) AS e(x),
                     LATERAL (SELECT m.ready_xid FROM postbox.messages m
                              WHERE m.state = 'available' AND m.topic = ANY(ARRAY[v_topic])
                                AND m.priority::integer = v_level
                                AND m.ready_xid >= e.x AND m.ready_xid <= e.x AND m.ready_xid < v_floor
                              ORDER BY m.topic, m.priority::integer, m.ready_xid, m.id
                              LIMIT 1) c;
            END IF;
            -- explain: a floor of a topic of the set
            SELECT m.ready_xid
            INTO v_next
            FROM postbox.messages m
            WHERE m.state = 'available' AND m.topic = ANY(ARRAY[v_topic]) AND m.priority::integer = v_level
              AND m.ready_xid >= v_floor
            ORDER BY m.topic, m.priority::integer, m.ready_xid LIMIT 1;
            IF NOT FOUND OR v_next > pg_snapshot_xmax(v_snap) THEN
                v_next := pg_snapshot_xmax(v_snap);
            END IF;
            v_next := least(v_next, v_probed);
            -- Beyond 64 priorities, those with nothing available are forgotten.
            IF v_known_of[t] <= 64 OR v_next < pg_snapshot_xmax(v_snap) THEN
                v_out := v_out || (v_level::text || ':' || v_next::text);
            END IF;
        END LOOP;
        PERFORM set_config(postbox.claim_floors_setting(v_topic),
                           pg_snapshot_xmax(v_snap)::text || ';' || array_to_string(v_running, ',') || ';'
                           || array_to_string(v_out, ','),
                           false);
    END LOOP;
END
$$;

--
-- Name: take_topic(text, integer, smallint, bigint); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.take_topic(p_topic text, p_batch integer, p_after_priority smallint DEFAULT NULL::smallint, p_after_id bigint DEFAULT NULL::bigint) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    SET enable_incremental_sort TO 'off'
    AS $$
BEGIN
    IF p_after_id IS NULL THEN
        RETURN QUERY
        SELECT m.* FROM postbox.messages m
        WHERE m.state = 'available' AND m.topic = p_topic
        ORDER BY m.priority, m.id
        LIMIT p_batch
        FOR NO KEY UPDATE SKIP LOCKED;
    ELSE
        RETURN QUERY
        SELECT m.* FROM postbox.messages m
        WHERE m.state = 'available' AND m.topic = p_topic
          AND (m.priority, m.id) > (p_after_priority, p_after_id)
        ORDER BY m.priority, m.id
        LIMIT p_batch
        FOR NO KEY UPDATE SKIP LOCKED;
    END IF;
END
$$;

--
-- Name: take_turn(text); Type: FUNCTION; Schema: postbox; Owner: -
--

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

--
-- Name: wake(); Type: FUNCTION; Schema: postbox; Owner: -
--

CREATE FUNCTION postbox.wake() RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM postbox.listeners) THEN
        PERFORM pg_notify('postbox', '');
    END IF;
END
$$;

--
-- Name: behind; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.behind (
    topic text NOT NULL,
    key text NOT NULL,
    id bigint NOT NULL
);

--
-- Name: completed; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.completed (
    id bigint NOT NULL,
    topic text NOT NULL,
    key text,
    payload jsonb NOT NULL,
    headers jsonb NOT NULL,
    attempts integer NOT NULL,
    created_at timestamp with time zone NOT NULL,
    delivered_at timestamp with time zone NOT NULL,
    sink text NOT NULL,
    relay text
)
PARTITION BY RANGE (delivered_at);

--
-- Name: completed_in_tx; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.completed_in_tx (
    id bigint NOT NULL,
    at timestamp with time zone DEFAULT now() NOT NULL
);

--
-- Name: TABLE completed_in_tx; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON TABLE postbox.completed_in_tx IS 'Messages whose handler committed their work in its own transaction (Job::complete_in): a redelivery skips the work; dropped once the message is gone';

--
-- Name: dead_letters; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.dead_letters (
    id bigint NOT NULL,
    topic text NOT NULL,
    key text,
    ordered boolean NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb NOT NULL,
    priority smallint NOT NULL,
    attempts integer NOT NULL,
    max_attempts integer NOT NULL,
    created_at timestamp with time zone NOT NULL,
    dedup_key text,
    first_error text,
    last_error text,
    reason text NOT NULL,
    dead_at timestamp with time zone DEFAULT now() NOT NULL,
    stream_id text
);

--
-- Name: COLUMN dead_letters.stream_id; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON COLUMN postbox.dead_letters.stream_id IS 'postbox: the stream id of a message dead-lettered from stream mode (unique); NULL for a table message';

--
-- Name: grants; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.grants (
    role text NOT NULL,
    kind text NOT NULL,
    granted_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT grants_kind_check CHECK ((kind = ANY (ARRAY['writer'::text, 'relay'::text, 'operator'::text])))
);

--
-- Name: holds; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.holds (
    xid xid8 NOT NULL,
    ids bigint[] NOT NULL,
    held_by text NOT NULL,
    held_at timestamp with time zone DEFAULT now() NOT NULL,
    hold_limit interval,
    token bigint
)
WITH (autovacuum_vacuum_threshold='100', autovacuum_vacuum_scale_factor='0', autovacuum_analyze_threshold='100', autovacuum_analyze_scale_factor='0', toast.autovacuum_vacuum_threshold='100', toast.autovacuum_vacuum_scale_factor='0');
ALTER TABLE ONLY postbox.holds ALTER COLUMN ids SET STORAGE EXTERNAL;

--
-- Name: messages_id_seq; Type: SEQUENCE; Schema: postbox; Owner: -
--

ALTER TABLE postbox.messages ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME postbox.messages_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

--
-- Name: intake; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.intake (
    id bigint DEFAULT nextval('postbox.messages_id_seq'::regclass) NOT NULL,
    xid xid8 DEFAULT pg_current_xact_id() NOT NULL,
    topic text NOT NULL,
    key text,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    max_attempts integer DEFAULT 25 NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT intake_headers_strings CHECK (((jsonb_typeof(headers) = 'object'::text) AND (NOT jsonb_path_exists(headers, '$.*?(@.type() != "string")'::jsonpath)))),
    CONSTRAINT intake_max_attempts_positive CHECK ((max_attempts >= 1)),
    CONSTRAINT intake_topic_length CHECK (((octet_length(topic) >= 1) AND (octet_length(topic) <= 255)))
);

--
-- Name: TABLE intake; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON TABLE postbox.intake IS 'Unordered messages without a dedup key, as their writers committed them; a relay moves them into postbox.messages (postbox.move_intake). Write with enqueue or INSERT (topic, key, payload, headers, priority, run_at, max_attempts).';

--
-- Name: listeners; Type: TABLE; Schema: postbox; Owner: -
--

CREATE UNLOGGED TABLE postbox.listeners (
    pid integer NOT NULL,
    since timestamp with time zone DEFAULT now() NOT NULL
)
WITH (autovacuum_vacuum_threshold='50', autovacuum_vacuum_scale_factor='0', autovacuum_vacuum_cost_delay='0');

--
-- Name: pauses; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.pauses (
    pattern text NOT NULL,
    paused_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT pauses_pattern_check CHECK ((pattern <> ''::text))
);

--
-- Name: samples; Type: TABLE; Schema: postbox; Owner: -
--

CREATE UNLOGGED TABLE postbox.samples (
    singleton boolean DEFAULT true NOT NULL,
    taken_at timestamp with time zone NOT NULL,
    body jsonb NOT NULL,
    CONSTRAINT samples_singleton_check CHECK (singleton)
);

--
-- Name: schedules; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.schedules (
    name text NOT NULL,
    cron text NOT NULL,
    timezone text NOT NULL,
    topic text NOT NULL,
    last_tick timestamp with time zone,
    last_message_id bigint,
    next_tick timestamp with time zone NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT schedules_name_check CHECK ((name <> ''::text))
);

--
-- Name: schema_migrations; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.schema_migrations (
    version text NOT NULL,
    run_on timestamp with time zone DEFAULT now() NOT NULL
);

--
-- Name: TABLE schema_migrations; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON TABLE postbox.schema_migrations IS 'The postbox migrations applied (postbox::migrate, postbox migrate): postbox keeps them apart from the app''s __diesel_schema_migrations';

--
-- Name: stream_slots; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.stream_slots (
    slot_name text NOT NULL,
    publication text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    confirm_limit pg_lsn,
    confirmed_before pg_lsn,
    gap_from pg_lsn,
    gap_to pg_lsn,
    gap_found_at timestamp with time zone
);

--
-- Name: COLUMN stream_slots.confirm_limit; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON COLUMN postbox.stream_slots.confirm_limit IS 'postbox: a relay confirms the slot up to here at most (recorded before it confirms past it)';

--
-- Name: COLUMN stream_slots.confirmed_before; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON COLUMN postbox.stream_slots.confirmed_before IS 'postbox: the position a relay had confirmed when it recorded confirm_limit';

--
-- Name: COLUMN stream_slots.gap_from; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON COLUMN postbox.stream_slots.gap_from IS 'postbox: a slot found past confirm_limit: what was published from here to gap_to may never have been streamed (until stream setup)';

--
-- Name: COLUMN stream_slots.gap_to; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON COLUMN postbox.stream_slots.gap_to IS 'postbox: the end of the range that may never have been streamed (the slot''s position when found)';

--
-- Name: COLUMN stream_slots.gap_found_at; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON COLUMN postbox.stream_slots.gap_found_at IS 'postbox: when a relay found the slot past confirm_limit';

--
-- Name: turns; Type: TABLE; Schema: postbox; Owner: -
--

CREATE TABLE postbox.turns (
    name text NOT NULL
);

--
-- Name: TABLE turns; Type: COMMENT; Schema: postbox; Owner: -
--

COMMENT ON TABLE postbox.turns IS 'postbox: what relays take turns on (a running limit, the retention upkeep, the metrics sample), one row each, locked FOR UPDATE by the one whose turn it is';

--
-- Name: behind behind_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.behind
    ADD CONSTRAINT behind_pkey PRIMARY KEY (topic, key, id);

--
-- Name: boot boot_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.boot
    ADD CONSTRAINT boot_pkey PRIMARY KEY (one);

--
-- Name: completed_in_tx completed_in_tx_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.completed_in_tx
    ADD CONSTRAINT completed_in_tx_pkey PRIMARY KEY (id);

--
-- Name: dead_letters dead_letters_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.dead_letters
    ADD CONSTRAINT dead_letters_pkey PRIMARY KEY (id);

--
-- Name: grants grants_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.grants
    ADD CONSTRAINT grants_pkey PRIMARY KEY (role, kind);

--
-- Name: holds holds_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.holds
    ADD CONSTRAINT holds_pkey PRIMARY KEY (xid);

--
-- Name: intake intake_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.intake
    ADD CONSTRAINT intake_pkey PRIMARY KEY (xid, id);

--
-- Name: listeners listeners_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.listeners
    ADD CONSTRAINT listeners_pkey PRIMARY KEY (pid);

--
-- Name: messages messages_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.messages
    ADD CONSTRAINT messages_pkey PRIMARY KEY (id);

--
-- Name: pauses pauses_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.pauses
    ADD CONSTRAINT pauses_pkey PRIMARY KEY (pattern);

--
-- Name: samples samples_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.samples
    ADD CONSTRAINT samples_pkey PRIMARY KEY (singleton);

--
-- Name: schedules schedules_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.schedules
    ADD CONSTRAINT schedules_pkey PRIMARY KEY (name);

--
-- Name: schema_migrations schema_migrations_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.schema_migrations
    ADD CONSTRAINT schema_migrations_pkey PRIMARY KEY (version);

--
-- Name: stream_slots stream_slots_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.stream_slots
    ADD CONSTRAINT stream_slots_pkey PRIMARY KEY (slot_name);

--
-- Name: turns turns_pkey; Type: CONSTRAINT; Schema: postbox; Owner: -
--

ALTER TABLE ONLY postbox.turns
    ADD CONSTRAINT turns_pkey PRIMARY KEY (name);

--
-- Name: completed_id_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX completed_id_idx ON ONLY postbox.completed USING brin (id);

--
-- Name: dead_letters_dead_at_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX dead_letters_dead_at_idx ON postbox.dead_letters USING btree (dead_at);

--
-- Name: dead_letters_stream_key; Type: INDEX; Schema: postbox; Owner: -
--

CREATE UNIQUE INDEX dead_letters_stream_key ON postbox.dead_letters USING btree (stream_id) WHERE (stream_id IS NOT NULL);

--
-- Name: dead_letters_topic_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX dead_letters_topic_idx ON postbox.dead_letters USING btree (topic, id);

--
-- Name: messages_available_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX messages_available_idx ON postbox.messages USING btree (topic, priority, id) WHERE (state = 'available'::postbox.message_state);

--
-- Name: messages_available_key_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX messages_available_key_idx ON postbox.messages USING btree (topic, key, priority, id) WHERE ((state = 'available'::postbox.message_state) AND (key IS NOT NULL));

--
-- Name: messages_available_order_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX messages_available_order_idx ON postbox.messages USING btree (((priority)::integer), id) WHERE (state = 'available'::postbox.message_state);

--
-- Name: messages_dedup_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE UNIQUE INDEX messages_dedup_idx ON postbox.messages USING btree (topic, dedup_key) WHERE (dedup_key IS NOT NULL);

--
-- Name: messages_heads_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX messages_heads_idx ON postbox.messages USING btree (topic, key, id) WHERE (ordered AND (state <> 'waiting'::postbox.message_state));

--
-- Name: messages_ready_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX messages_ready_idx ON postbox.messages USING btree (((priority)::integer), ready_xid, id) WHERE (state = 'available'::postbox.message_state);

--
-- Name: messages_ready_topic_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX messages_ready_topic_idx ON postbox.messages USING btree (topic, ((priority)::integer), ready_xid, id) WHERE (state = 'available'::postbox.message_state);

--
-- Name: messages_running_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX messages_running_idx ON postbox.messages USING btree (locked_until) WHERE (state = 'running'::postbox.message_state);

--
-- Name: messages_running_topic_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX messages_running_topic_idx ON postbox.messages USING btree (topic, key) WHERE (state = 'running'::postbox.message_state);

--
-- Name: messages_scheduled_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX messages_scheduled_idx ON postbox.messages USING btree (run_at) WHERE (state = 'scheduled'::postbox.message_state);

--
-- Name: messages_stalled_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX messages_stalled_idx ON postbox.messages USING btree (created_at) WHERE (ordered AND (state <> 'waiting'::postbox.message_state) AND (last_error IS NOT NULL));

--
-- Name: messages_waiting_idx; Type: INDEX; Schema: postbox; Owner: -
--

CREATE INDEX messages_waiting_idx ON postbox.messages USING btree (topic, key, id) WHERE (state = 'waiting'::postbox.message_state);

--
-- Name: intake intake_no_update; Type: TRIGGER; Schema: postbox; Owner: -
--

CREATE TRIGGER intake_no_update BEFORE UPDATE ON postbox.intake FOR EACH ROW EXECUTE FUNCTION postbox.intake_no_update();

--
-- Name: intake intake_wake; Type: TRIGGER; Schema: postbox; Owner: -
--

CREATE TRIGGER intake_wake BEFORE INSERT ON postbox.intake FOR EACH STATEMENT EXECUTE FUNCTION postbox.messages_inserted();

--
-- Name: messages messages_after_replay; Type: TRIGGER; Schema: postbox; Owner: -
--

CREATE TRIGGER messages_after_replay AFTER INSERT ON postbox.messages FOR EACH ROW WHEN ((new.ordered AND (new.state <> 'waiting'::postbox.message_state) AND (current_setting('postbox.keep_ids'::text, true) = 'on'::text) AND has_column_privilege('postbox.messages'::text, 'id'::text, 'INSERT'::text))) EXECUTE FUNCTION postbox.messages_after_replay();

--
-- Name: messages messages_check_head; Type: TRIGGER; Schema: postbox; Owner: -
--

CREATE CONSTRAINT TRIGGER messages_check_head AFTER INSERT ON postbox.messages DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN ((new.ordered AND (new.state = 'waiting'::postbox.message_state) AND (current_setting('postbox.keep_ids'::text, true) = 'on'::text) AND has_column_privilege('postbox.messages'::text, 'id'::text, 'INSERT'::text))) EXECUTE FUNCTION postbox.messages_check_head();

--
-- Name: messages messages_head_removed; Type: TRIGGER; Schema: postbox; Owner: -
--

CREATE TRIGGER messages_head_removed AFTER DELETE ON postbox.messages FOR EACH ROW WHEN ((old.ordered AND (old.state <> 'waiting'::postbox.message_state) AND (current_setting('postbox.promotes_heads'::text, true) IS DISTINCT FROM 'caller'::text))) EXECUTE FUNCTION postbox.note_removed_head();

--
-- Name: messages messages_heads_promoted; Type: TRIGGER; Schema: postbox; Owner: -
--

CREATE TRIGGER messages_heads_promoted AFTER DELETE ON postbox.messages FOR EACH STATEMENT WHEN ((current_setting('postbox.promotes_heads'::text, true) IS DISTINCT FROM 'caller'::text)) EXECUTE FUNCTION postbox.promote_removed_heads();

--
-- Name: messages messages_ready; Type: TRIGGER; Schema: postbox; Owner: -
--

CREATE TRIGGER messages_ready BEFORE UPDATE ON postbox.messages FOR EACH ROW WHEN ((new.state = 'available'::postbox.message_state)) EXECUTE FUNCTION postbox.messages_ready();

--
-- Name: messages messages_ready_insert; Type: TRIGGER; Schema: postbox; Owner: -
--

CREATE TRIGGER messages_ready_insert BEFORE INSERT ON postbox.messages FOR EACH ROW WHEN ((new.ready_xid IS DISTINCT FROM pg_current_xact_id())) EXECUTE FUNCTION postbox.messages_ready();

--
-- Name: messages messages_state; Type: TRIGGER; Schema: postbox; Owner: -
--

CREATE TRIGGER messages_state BEFORE INSERT ON postbox.messages FOR EACH ROW WHEN (((new.ordered OR (new.run_at > now())) AND ((current_setting('postbox.keep_ids'::text, true) IS DISTINCT FROM 'on'::text) OR (NOT has_column_privilege('postbox.messages'::text, 'id'::text, 'INSERT'::text))))) EXECUTE FUNCTION postbox.messages_before_insert();

--
-- Name: messages messages_state_keep; Type: TRIGGER; Schema: postbox; Owner: -
--

CREATE TRIGGER messages_state_keep BEFORE INSERT ON postbox.messages FOR EACH ROW WHEN (((new.ordered OR (new.run_at > now())) AND (current_setting('postbox.keep_ids'::text, true) = 'on'::text) AND has_column_privilege('postbox.messages'::text, 'id'::text, 'INSERT'::text))) EXECUTE FUNCTION postbox.messages_before_insert('keep');

--
-- Name: messages messages_wake; Type: TRIGGER; Schema: postbox; Owner: -
--

CREATE TRIGGER messages_wake BEFORE INSERT ON postbox.messages FOR EACH STATEMENT EXECUTE FUNCTION postbox.messages_inserted();

--
-- PostgreSQL database dump complete
--

