-- postbox: the backlog-proof state model.
--
-- Every message now carries its state, and each state has an index of its own, so that every
-- query walks (almost) only the rows it acts on:
--
--   available  claimable now              messages_available_idx (topic, priority, id)   ← claim
--   scheduled  run_at in the future       messages_scheduled_idx (run_at)                ← scheduler
--   running    leased by a relay          messages_running_idx   (locked_until)          ← rescue
--   waiting    ordered, behind its key's  messages_waiting_idx   (topic, key, id)        ← promotion
--              head                       (and the heads alone:  messages_heads_idx)
--
-- A claim for some topics descends into messages_available_idx once per topic: scheduled rows,
-- ordered rows blocked behind their key's head and rows of other topics are not in its path.
-- The scheduler moves due rows from scheduled to available in batches; the head of an ordered
-- key settling (deleted: delivered or dead) promotes the next waiting message of that key.
--
-- The SQL contract is unchanged: a plain INSERT INTO postbox.messages (topic, payload) is a valid
-- enqueue. The state is derived by the insert trigger below when it is not plainly 'available'.
--
-- Upgrade in place: running rows (leased) become running, pending rows with a future run_at
-- become scheduled, ordered rows behind an earlier row of their key become waiting, the rest is
-- available. Relays of the previous version must be stopped: their retries and releases do not set
-- the state and are refused by messages_state_lease (their leases expire and are rescued).

CREATE TYPE postbox.message_state AS ENUM ('available', 'scheduled', 'running', 'waiting');

ALTER TABLE postbox.messages ADD COLUMN state postbox.message_state NOT NULL DEFAULT 'available';

UPDATE postbox.messages SET state = 'running' WHERE locked_until IS NOT NULL;
UPDATE postbox.messages SET state = 'scheduled' WHERE locked_until IS NULL AND run_at > now();
UPDATE postbox.messages m SET state = 'waiting'
WHERE m.ordered AND m.state <> 'running'
  AND EXISTS (SELECT 1 FROM postbox.messages e
              WHERE e.ordered AND e.topic = m.topic AND e.key = m.key AND e.id < m.id);

ALTER TABLE postbox.messages
    ADD CONSTRAINT messages_state_lease CHECK ((state = 'running') = (lease_token IS NOT NULL)),
    ADD CONSTRAINT messages_waiting_ordered CHECK (state <> 'waiting' OR ordered);

DROP INDEX postbox.messages_claim_idx;
DROP INDEX postbox.messages_lease_idx;
CREATE INDEX messages_available_idx ON postbox.messages (topic, priority, id) WHERE state = 'available';
CREATE INDEX messages_scheduled_idx ON postbox.messages (run_at) WHERE state = 'scheduled';
CREATE INDEX messages_running_idx ON postbox.messages (locked_until) WHERE state = 'running';
-- Waiting messages only, per key in order: the next one to promote is one descent away. (It
-- replaces messages_ordered_idx: an index of every ordered row took a new entry on each of a
-- message's state changes.)
CREATE INDEX messages_waiting_idx ON postbox.messages (topic, key, id) WHERE state = 'waiting';
DROP INDEX postbox.messages_ordered_idx;
-- The head of each ordered key (at most one row per key): "does this key have a head?" is one
-- descent, whatever the number of messages waiting behind it.
CREATE INDEX messages_heads_idx ON postbox.messages (topic, key, id) WHERE ordered AND state <> 'waiting';
-- Heads of ordered keys that have failed at least once: `status` lists them as stalled.
CREATE INDEX messages_stalled_idx ON postbox.messages (created_at)
    WHERE ordered AND state <> 'waiting' AND last_error IS NOT NULL;

-- The functions below that look at an ordered key pin their plans to its indexes, like
-- the claim: with statistics taken on an empty table the planner would otherwise sort every
-- message of the key on each insert (measured: 300 µs a row at 5,000 rows, growing with the key).
--
-- The lock slot of an ordered (topic, key): one of 256. Namespace 1 serialises writers of a slot
-- from their insert to their commit, so that id order is commit order within a key. Namespace 2
-- is held only for an instant, at a writer's commit and while a head is removed: it makes "is
-- there a head?" and "promote the next" one decision. Slots, not keys: a transaction that writes
-- 10,000 keys takes at most 512 locks (one per key would exhaust the server's lock table, sized
-- by max_locks_per_transaction); the price is that writers of two keys that share a slot wait for
-- each other's commit, and that such a transaction holds up every other ordered writer until it
-- commits. Both namespaces use the same slot, so two writers that could meet in namespace 2 are
-- already serialised by namespace 1 and never wait for each other in a cycle.
CREATE FUNCTION postbox.key_lock_id(p_topic text, p_key text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtext(p_topic || E'\x1f' || p_key) & 255 $$;

-- Writers of ordered keys (Rust's enqueue_many calls this first with every key of a batch, in
-- one sorted order, so that two batches never wait for each other in a cycle). Returns how many
-- distinct locks it took.
CREATE FUNCTION postbox.lock_keys(p_topics text[], p_keys text[]) RETURNS bigint
LANGUAGE sql
AS $$
    SELECT count(pg_advisory_xact_lock(1886352244, k.h))
    FROM (SELECT DISTINCT postbox.key_lock_id(t, k) AS h FROM unnest(p_topics, p_keys) AS u(t, k) ORDER BY 1) k
$$;

-- The state of a message that is (again) at the front: by its run_at.
CREATE FUNCTION postbox.ready_state(p_run_at timestamptz) RETURNS postbox.message_state
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN p_run_at > now() THEN 'scheduled'::postbox.message_state ELSE 'available'::postbox.message_state END $$;

-- Makes the first waiting message of an ordered key its head, unless the key has a head.
-- Callers hold the key's namespace-2 lock and run in READ COMMITTED, so this statement sees every
-- writer and settler of the key that went before.
CREATE FUNCTION postbox.promote_key(p_topic text, p_key text) RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
BEGIN
    -- The head, if any, is the newest entry of the key in messages_heads_idx: looking from the
    -- end keeps the dead entries of the key's delivered history out of the path.
    IF (SELECT id FROM postbox.messages
        WHERE ordered AND topic = p_topic AND key = p_key AND state <> 'waiting'
        ORDER BY id DESC LIMIT 1) IS NULL THEN
        UPDATE postbox.messages SET state = postbox.ready_state(run_at)
        WHERE id = (SELECT id FROM postbox.messages
                    WHERE state = 'waiting' AND topic = p_topic AND key = p_key
                    ORDER BY id LIMIT 1);
    END IF;
END
$$;

-- Insert: a scheduled message is `scheduled`; an ordered message takes its key's writer lock, then
-- its id (so id order is commit order), and is the head of its key (available or scheduled) or
-- waits behind it. A replayed message (postbox.keep_ids = on) keeps its id and, if it is older
-- than a head that has not started, goes back in front of it; older than a head that is running,
-- it is not inserted (the replay reports it skipped).
CREATE FUNCTION postbox.messages_before_insert() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
DECLARE
    v_head record;
BEGIN
    IF NOT NEW.ordered THEN
        NEW.state := postbox.ready_state(NEW.run_at);
        RETURN NEW;
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'postbox: ordered messages must be enqueued in a READ COMMITTED transaction (the order of a key is decided as writers commit), not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'feature_not_supported';
    END IF;
    PERFORM pg_advisory_xact_lock(1886352244, postbox.key_lock_id(NEW.topic, NEW.key));
    IF current_setting('postbox.keep_ids', true) IS DISTINCT FROM 'on' THEN
        NEW.id := nextval('postbox.messages_id_seq');
    END IF;
    -- A new statement sees every earlier writer of the key: they committed before we got the lock.
    -- The head is the newest head entry of the key (see promote_key).
    SELECT id, state INTO v_head FROM postbox.messages
    WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting'
    ORDER BY id DESC LIMIT 1;
    IF FOUND THEN
        IF v_head.id > NEW.id THEN
            -- A replay of an older message: back in front of a head that has not started...
            UPDATE postbox.messages SET state = 'waiting'
            WHERE id = v_head.id AND state IN ('available', 'scheduled');
            IF FOUND THEN
                NEW.state := postbox.ready_state(NEW.run_at);
                RETURN NEW;
            END IF;
            -- ...but not behind one that runs: it stays dead (the replay reports it skipped) and
            -- can be replayed once that head is settled.
            RETURN NULL;
        END IF;
        NEW.state := 'waiting';
    ELSIF EXISTS (SELECT 1 FROM postbox.messages
                  WHERE state = 'waiting' AND topic = NEW.topic AND key = NEW.key) THEN
        -- Only waiting messages: a head is being removed right now; the commit check decides.
        NEW.state := 'waiting';
    ELSE
        NEW.state := postbox.ready_state(NEW.run_at);
    END IF;
    RETURN NEW;
END
$$;

-- Fires only for rows that need it: plain immediate messages pay nothing.
CREATE TRIGGER messages_state BEFORE INSERT ON postbox.messages
    FOR EACH ROW WHEN (NEW.ordered OR NEW.run_at > now())
    EXECUTE FUNCTION postbox.messages_before_insert();

-- At the commit of a writer whose message waits: if the head it waited for was removed before
-- the writer committed (the remover could not see the uncommitted message to promote it), the
-- writer promotes the first waiting message of the key itself.
CREATE FUNCTION postbox.messages_check_head() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1886352245, postbox.key_lock_id(NEW.topic, NEW.key));
    PERFORM postbox.promote_key(NEW.topic, NEW.key);
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER messages_check_head AFTER INSERT ON postbox.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.ordered AND NEW.state = 'waiting')
    EXECUTE FUNCTION postbox.messages_check_head();

-- A head removed (delivered, dead-lettered, cancelled, or deleted by hand): the next waiting
-- message of its key becomes the head. One statement for every head a DELETE removed, not one per
-- row: each removed head's key is noted (a row trigger that only appends to a transaction-local
-- setting, no query), and a statement trigger promotes all of them at once when the DELETE ends.
-- (A transition table would do the same but copy every deleted row, ordered or not.)
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

CREATE TRIGGER messages_head_removed AFTER DELETE ON postbox.messages
    FOR EACH ROW WHEN (OLD.ordered AND OLD.state <> 'waiting')
    EXECUTE FUNCTION postbox.note_removed_head();

-- The remover waits at most 200 ms for a committing writer of a key's slot (it never waits for a
-- writer's whole transaction: writers take namespace 2 only at commit); past that its statement
-- fails and is retried, so a writer is never the victim of a deadlock with a relay.
CREATE FUNCTION postbox.promote_removed_heads() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    v_noted text := current_setting('postbox.removed_heads', true);
    v_timeout text;
    v_keys jsonb;
BEGIN
    IF v_noted IS NULL OR v_noted = '' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('postbox.removed_heads', '', true);
    v_keys := ('[' || rtrim(v_noted, ',') || ']')::jsonb;
    v_timeout := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', '200ms', true);
    PERFORM pg_advisory_xact_lock(1886352245, s.slot)
    FROM (SELECT DISTINCT postbox.key_lock_id(k->>0, k->>1) AS slot
          FROM jsonb_array_elements(v_keys) AS e(k) ORDER BY 1) s;
    PERFORM set_config('lock_timeout', v_timeout, true);
    -- A new statement after the locks: it sees every writer of these keys that committed before.
    -- The next message of a key has a larger id than the head that was removed (writers draw ids
    -- after the key's lock, and a replay never goes behind a running head), so the look-up starts
    -- there: the index entries of the key's delivered history are not in its path.
    UPDATE postbox.messages m SET state = postbox.ready_state(m.run_at)
    FROM (SELECT k->>0 AS topic, k->>1 AS key, max((k->>2)::bigint) AS removed
          FROM jsonb_array_elements(v_keys) AS e(k) GROUP BY 1, 2) rk,
         LATERAL (SELECT w.id FROM postbox.messages w
                  WHERE w.state = 'waiting' AND w.topic = rk.topic AND w.key = rk.key
                    AND w.id > rk.removed
                  ORDER BY w.id LIMIT 1) nxt
    WHERE m.id = nxt.id
      AND (SELECT h.id FROM postbox.messages h
           WHERE h.ordered AND h.topic = rk.topic AND h.key = rk.key AND h.id > rk.removed
             AND h.state <> 'waiting'
           ORDER BY h.id LIMIT 1) IS NULL;
    RETURN NULL;
END
$$;

CREATE TRIGGER messages_heads_promoted AFTER DELETE ON postbox.messages
    FOR EACH STATEMENT EXECUTE FUNCTION postbox.promote_removed_heads();

-- Topics that the filter lets through and that have available messages now. Exact names are
-- probed one index descent each; with patterns (or all topics) the distinct topics of
-- messages_available_idx are walked one descent per topic (a loose index scan): the cost is the
-- number of topics, never the number of rows.
CREATE FUNCTION postbox.available_topics(
    p_all_topics boolean,
    p_topics text[],
    p_patterns text[],
    p_not_topics text[],
    p_not_patterns text[]
) RETURNS text[]
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    IF NOT p_all_topics AND cardinality(p_patterns) = 0 THEN
        RETURN ARRAY(
            SELECT t FROM unnest(p_topics) AS u(t)
            WHERE NOT (t = ANY(p_not_topics) OR t LIKE ANY(p_not_patterns))
              AND EXISTS (SELECT 1 FROM postbox.messages m WHERE m.state = 'available' AND m.topic = u.t));
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

-- Claim from one topic: its available messages in (priority, id) order, skipping rows other
-- claimers hold. The plan is pinned to messages_available_idx (see the first migration: stale
-- statistics must not make a claim sort the backlog).
CREATE FUNCTION postbox.claim_topic(
    p_topic text,
    p_batch integer,
    p_lease_secs double precision,
    p_token bigint,
    p_owner text
) RETURNS SETOF postbox.messages
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
BEGIN
    RETURN QUERY
    WITH picked AS (
        SELECT m.id
        FROM postbox.messages m
        WHERE m.state = 'available' AND m.topic = p_topic
        ORDER BY m.priority, m.id
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
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
END
$$;

-- Claim: available → running, up to p_batch messages of the topics the filter lets through (and
-- none of the excluded ones: a relay's earlier routes). Several topics share the batch fairly: each
-- gets an equal share first (a backlog in one topic does not hold back the others), then what is
-- left goes to the topics that had more. Within a topic, lower priority first, then oldest first.
-- Same signature as before, so writers and tools that call it keep working.
CREATE OR REPLACE FUNCTION postbox.claim(
    p_batch integer,
    p_lease_secs double precision,
    p_all_topics boolean,
    p_topics text[],
    p_patterns text[],
    p_not_topics text[],
    p_not_patterns text[],
    p_token bigint,
    p_owner text
) RETURNS SETOF postbox.messages
LANGUAGE plpgsql
AS $$
DECLARE
    v_topics text[] := postbox.available_topics(p_all_topics, p_topics, p_patterns, p_not_topics, p_not_patterns);
    v_count integer := coalesce(cardinality(v_topics), 0);
    v_share integer;
    v_got integer := 0;
    v_n integer;
    v_more text[] := '{}';
    v_topic text;
BEGIN
    IF v_count = 0 OR p_batch <= 0 THEN
        RETURN;
    END IF;
    IF v_count > p_batch THEN
        -- More busy topics than room: a random p_batch of them, one message each.
        v_topics := ARRAY(SELECT t FROM unnest(v_topics) AS u(t) ORDER BY random() LIMIT p_batch);
        v_count := p_batch;
    END IF;
    v_share := p_batch / v_count;
    FOREACH v_topic IN ARRAY v_topics LOOP
        RETURN QUERY SELECT * FROM postbox.claim_topic(v_topic, v_share, p_lease_secs, p_token, p_owner);
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
        IF v_n = v_share THEN
            v_more := v_more || v_topic;
        END IF;
    END LOOP;
    FOREACH v_topic IN ARRAY v_more LOOP
        EXIT WHEN v_got >= p_batch;
        RETURN QUERY SELECT * FROM postbox.claim_topic(v_topic, p_batch - v_got, p_lease_secs, p_token, p_owner);
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
    END LOOP;
END
$$;

-- The scheduler: scheduled messages whose run_at has come become available, up to p_limit per
-- call (SKIP LOCKED: every relay may run it at once). Returns how many, and in how many seconds
-- the next scheduled message is due (NULL: none), so the caller can sleep exactly that long.
-- Wakes waiting relays when it promoted anything.
CREATE FUNCTION postbox.promote_due(p_limit integer)
RETURNS TABLE (promoted integer, next_due_secs double precision)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
DECLARE
    v_n integer;
BEGIN
    WITH due AS (
        SELECT id FROM postbox.messages
        WHERE state = 'scheduled' AND run_at <= now()
        ORDER BY run_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE postbox.messages m SET state = 'available' FROM due WHERE m.id = due.id;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n > 0 THEN
        PERFORM postbox.wake();
    END IF;
    RETURN QUERY
    SELECT v_n,
           (SELECT greatest(extract(epoch FROM min(run_at) - now()), 0)::float8
            FROM postbox.messages WHERE state = 'scheduled' AND run_at > now());
END
$$;

-- A tiny table that every waiting relay inserts into and deletes from: vacuum it often.
ALTER TABLE postbox.listeners SET (
    autovacuum_vacuum_threshold = 50,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_cost_delay = 0
);

-- The last metrics sample, computed by one relay at a time (an advisory lock elects it) and read
-- by the others, so the cost of the gauges does not grow with the number of replicas. UNLOGGED:
-- it is only a cache.
CREATE UNLOGGED TABLE postbox.samples (
    singleton boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    taken_at  timestamptz NOT NULL,
    body      jsonb       NOT NULL
);
