-- One promotion routine for every path that removes or demotes the head of an ordered key.
--
-- Before this, "one head per ordered key" was kept by five routines layered over four migrations,
-- and three races left a key with waiting messages and no head (no claim ever took them again):
--   * a promotion updated only "the first waiting row" it saw; when another transaction was
--     deleting that row (cancel, an operator's DELETE) the update skipped it and promoted nothing;
--   * a hand-over looked for the next message only among ids after the removed head, missing a
--     replayed message (an older id) whose writer committed while the head was being settled;
--   * a replay's BEFORE INSERT trigger demoted the key's head before ON CONFLICT DO NOTHING could
--     skip the replayed row (a dedup key taken again meanwhile): the head was left waiting.
--
-- postbox.promote_keys is now the one place. For each (topic, key) it is given, if the key has
-- no head, it promotes the key's first waiting message (the lowest id, whatever the removed head
-- was). When that message is changed or deleted by a transaction that commits while the promotion
-- waits for its row lock, the key is looked at again with a new statement (a new snapshot), until
-- it has a head or no waiting message. hand_over, promote_after and promote_key keep their
-- signatures (relays of the previous release call them) and call it.
--
-- Where the next message is looked for: a settler passes the id of the head it removed
-- (p_removed; a held batch, the first message of the key it delivered). A waiting message with a
-- smaller id can only be a replayed dead letter that committed while a later message of its key
-- had already started (or was being delivered by a held batch): the replay's commit check marks
-- every replayed message left waiting in postbox.behind, and the promotion looks there too. So the search starts after the removed id, and never walks the index entries
-- of the messages promoted before it (dead until vacuum, and not even marked dead while an older
-- transaction is open: a drain of one key would otherwise cost O(n) per message).
--
-- The head check: a settler passes the id of the head it removed (p_removed). While it holds the
-- key's promotion lock shared, no other head can appear below that id: the key had one head (the
-- removed one); writers only add ids above every committed one, and their commit check takes the
-- lock exclusively; a replay goes in front of an unstarted head only. So the check reads the
-- index from the removed id on, and never walks the key's delivered history (dead index entries
-- until vacuum). Without a removed id (a writer's commit check, the repair), it reads the newest
-- entry of the key: a head, when there is one, is the most recent entry.
--
-- Ordered messages are promoted in READ COMMITTED only: under REPEATABLE READ a transaction's
-- snapshot would miss the commits it waited for, and a key could strand.

CREATE FUNCTION postbox.promote_keys(
    p_topics text[], p_keys text[], p_removed bigint[], p_exclusive boolean,
    p_limit integer, p_lease_secs double precision, p_token bigint, p_owner text)
RETURNS SETOF postbox.messages
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    v_timeout text;
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
    v_timeout := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', '200ms', true);
    IF p_exclusive THEN
        PERFORM pg_advisory_xact_lock(1886352245, s.slot)
        FROM (SELECT DISTINCT postbox.key_lock_id(t, k) AS slot
              FROM unnest(p_topics, p_keys) AS u(t, k) ORDER BY 1) s;
    ELSE
        PERFORM pg_advisory_xact_lock_shared(1886352245, s.slot)
        FROM (SELECT DISTINCT postbox.key_lock_id(t, k) AS slot
              FROM unnest(p_topics, p_keys) AS u(t, k) ORDER BY 1) s;
    END IF;
    PERFORM set_config('lock_timeout', v_timeout, true);

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
                WHERE m.id = r.id AND m.state::text = 'waiting'
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

COMMENT ON FUNCTION postbox.promote_keys(text[], text[], bigint[], boolean, integer, double precision, bigint, text) IS
'The one promotion of ordered keys: each key without a head gets its first waiting message as head; up to p_limit due ones are leased to the caller (token, owner) instead. p_removed: the head the caller removed (NULL: none; then p_exclusive)';

CREATE OR REPLACE FUNCTION postbox.hand_over(p_topics text[], p_keys text[], p_removed bigint[], p_limit integer,
    p_lease_secs double precision, p_token bigint, p_owner text)
RETURNS SETOF postbox.messages
LANGUAGE sql
AS $$ SELECT * FROM postbox.promote_keys(p_topics, p_keys, p_removed, false, p_limit, p_lease_secs, p_token, p_owner) $$;

CREATE OR REPLACE FUNCTION postbox.promote_after(p_topics text[], p_keys text[], p_removed bigint[])
RETURNS integer
LANGUAGE sql
AS $$ SELECT count(*)::integer FROM postbox.promote_keys(p_topics, p_keys, p_removed, false, 0, 1, 0, '') $$;

-- By hand (the README's runbook) and for callers of the previous release: promotes the key if it
-- has no head. Nearly always it has one: one index probe.
CREATE OR REPLACE FUNCTION postbox.promote_key(p_topic text, p_key text)
RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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

-- A replay goes in front of an unstarted head. The BEFORE trigger only decides, and locks that
-- head (claims skip it meanwhile); the AFTER trigger demotes it, and fires only for a row that
-- was inserted: a replay that ON CONFLICT DO NOTHING skips changes nothing.
CREATE OR REPLACE FUNCTION postbox.messages_before_insert() RETURNS trigger
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
    SELECT id, state INTO v_head FROM postbox.messages
    WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting'
    ORDER BY id DESC LIMIT 1;
    IF FOUND THEN
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
            IF v_head.state IN ('available', 'scheduled') THEN
                -- ...behind one that a claim or a held batch has locked (it is starting: not
                -- waited for, with the key's writer lock held), marked at commit...
                NEW.state := 'waiting';
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

CREATE FUNCTION postbox.messages_after_replay() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    UPDATE postbox.messages SET state = 'waiting'
    WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting' AND state <> 'running'
      AND id > NEW.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER messages_after_replay AFTER INSERT ON postbox.messages
FOR EACH ROW
WHEN (NEW.ordered AND NEW.state <> 'waiting' AND current_setting('postbox.keep_ids', true) = 'on')
EXECUTE FUNCTION postbox.messages_after_replay();

-- Replayed dead letters waiting behind a later message of their key that had already started
-- when they committed (see postbox.promote_keys).
CREATE TABLE postbox.behind (
    topic text NOT NULL,
    key text NOT NULL,
    id bigint NOT NULL,
    PRIMARY KEY (topic, key, id)
);

-- The writer's commit check, per waiting message it wrote, under the key's promotion lock held
-- exclusively (no promotion of the key runs meanwhile; every one before has committed):
--   * no head: promote (the head was removed while the writer was open);
--   * a head with a larger id (only a replayed dead letter is older than a head) that has not
--     started and is not locked (a claim or a held batch taking it): it goes back to waiting and
--     the replayed message is the head, as if the replay had committed first (no row lock is
--     waited for while the promotion lock is held exclusively);
--   * a replayed message still waiting is marked in postbox.behind: it may be older than a head
--     that has started, or than messages a held batch is delivering behind its head, and the
--     promotion must find it whatever id it searches from.
CREATE OR REPLACE FUNCTION postbox.messages_check_head() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
DECLARE
    v_head record;
BEGIN
    PERFORM pg_advisory_xact_lock(1886352245, postbox.key_lock_id(NEW.topic, NEW.key));
    SELECT id, state INTO v_head FROM postbox.messages
    WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting'
    ORDER BY id DESC LIMIT 1;
    IF NOT FOUND THEN
        PERFORM count(*) FROM postbox.promote_keys(ARRAY[NEW.topic], ARRAY[NEW.key], ARRAY[NULL::bigint],
                                                   true, 0, 1, 0, '');
    ELSIF v_head.id > NEW.id AND v_head.state IN ('available', 'scheduled')
          AND EXISTS (SELECT 1 FROM postbox.messages WHERE id = NEW.id AND state::text = 'waiting') THEN
        -- Not waited for while the key's promotion lock is held exclusively: a head that a claim
        -- or a held batch has locked is starting, and the replayed message goes behind it.
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
    IF current_setting('postbox.keep_ids', true) = 'on'
       AND EXISTS (SELECT 1 FROM postbox.messages WHERE id = NEW.id AND state::text = 'waiting') THEN
        INSERT INTO postbox.behind (topic, key, id) VALUES (NEW.topic, NEW.key, NEW.id)
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN NULL;
END
$$;

-- A held batch's own limit, so the invariant check can name holds kept past it.
ALTER TABLE postbox.holds ADD COLUMN hold_limit interval;

-- Keys with waiting messages and no head (stranded: nothing would ever take them), found by a
-- loose scan of messages_waiting_idx: one probe per key with waiting messages, not one per message.
-- One statement, one snapshot: every path moves a key from head to head within one transaction,
-- so a key seen here without a head is stranded, not between two heads.
CREATE FUNCTION postbox.stranded_keys(p_limit integer)
RETURNS TABLE (topic text, key text)
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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

-- What the model forbids, by kind: stranded keys, keys with more than one head, holds kept open
-- past their limit (5 s of grace; a hold registered without a limit counts 60 s, the most a relay
-- accepts).
CREATE FUNCTION postbox.check_invariants(p_limit integer DEFAULT 1000)
RETURNS TABLE (kind text, topic text, key text, detail text)
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    (SELECT 'stranded_key'::text, s.topic, s.key,
            (SELECT count(*) FROM postbox.messages w
             WHERE w.state = 'waiting' AND w.topic = s.topic AND w.key = s.key)::text || ' waiting'
     FROM postbox.stranded_keys(p_limit) s)
    UNION ALL
    (SELECT 'double_head'::text, h.topic, h.key,
            count(*)::text || ' heads: ' || string_agg(h.id::text || ' ' || h.state::text, ', ' ORDER BY h.id)
     FROM postbox.messages h
     WHERE h.ordered AND h.state <> 'waiting'
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
