-- Back to the promotions of 2026-12-01-000002/000004 (their bodies as they were).

DROP FUNCTION postbox.check_invariants(integer);

DROP FUNCTION postbox.stranded_keys(integer);

ALTER TABLE postbox.holds DROP COLUMN hold_limit;

DROP TRIGGER messages_after_replay ON postbox.messages;

DROP FUNCTION postbox.messages_after_replay();

CREATE OR REPLACE FUNCTION postbox.messages_check_head() RETURNS trigger
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1886352245, postbox.key_lock_id(NEW.topic, NEW.key));
    PERFORM postbox.promote_key(NEW.topic, NEW.key);
    RETURN NULL;
END
$$;

DROP TABLE postbox.behind;

CREATE OR REPLACE FUNCTION postbox.messages_before_insert() RETURNS trigger
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
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


CREATE OR REPLACE FUNCTION postbox.hand_over(p_topics text[], p_keys text[], p_removed bigint[], p_limit integer, p_lease_secs double precision, p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    v_timeout text;
BEGIN
    IF coalesce(cardinality(p_topics), 0) = 0 THEN
        RETURN;
    END IF;
    v_timeout := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', '200ms', true);
    PERFORM pg_advisory_xact_lock_shared(1886352245, s.slot)
    FROM (SELECT DISTINCT postbox.key_lock_id(t, k) AS slot
          FROM unnest(p_topics, p_keys) AS u(t, k) ORDER BY 1) s;
    PERFORM set_config('lock_timeout', v_timeout, true);
    RETURN QUERY
    WITH nxt AS (
        SELECT w.id, w.run_at <= now() AS due
        FROM (SELECT t AS topic, k AS key, max(r) AS removed
              FROM unnest(p_topics, p_keys, p_removed) AS u(t, k, r) GROUP BY 1, 2) rk,
             LATERAL (SELECT w.id, w.run_at FROM postbox.messages w
                      WHERE w.state = 'waiting' AND w.topic = rk.topic AND w.key = rk.key
                        AND w.id > rk.removed
                      ORDER BY w.id LIMIT 1) w
        WHERE (SELECT h.id FROM postbox.messages h
               WHERE h.ordered AND h.topic = rk.topic AND h.key = rk.key AND h.id > rk.removed
                 AND h.state <> 'waiting'
               ORDER BY h.id LIMIT 1) IS NULL
    ),
    ranked AS (
        SELECT id, due AND row_number() OVER (PARTITION BY due ORDER BY id) <= p_limit AS take
        FROM nxt
    ),
    moved AS (
        UPDATE postbox.messages m
        SET state = CASE WHEN r.take THEN 'running'::postbox.message_state
                         ELSE postbox.ready_state(m.run_at) END,
            attempts = m.attempts + r.take::integer,
            locked_until = CASE WHEN r.take THEN now() + make_interval(secs => p_lease_secs) END,
            lease_token = CASE WHEN r.take THEN p_token END,
            locked_by = CASE WHEN r.take THEN p_owner END
        FROM ranked r
        WHERE m.id = r.id
        RETURNING m AS message, r.take
    )
    SELECT (moved.message).* FROM moved WHERE moved.take;
END
$$;


CREATE OR REPLACE FUNCTION postbox.promote_after(p_topics text[], p_keys text[], p_removed bigint[]) RETURNS integer
    LANGUAGE sql
    AS $$ SELECT count(*)::integer FROM postbox.hand_over(p_topics, p_keys, p_removed, 0, 1, 0, '') $$;


CREATE OR REPLACE FUNCTION postbox.promote_key(p_topic text, p_key text) RETURNS void
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
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


DROP FUNCTION postbox.promote_keys(text[], text[], bigint[], boolean, integer, double precision, bigint, text);
