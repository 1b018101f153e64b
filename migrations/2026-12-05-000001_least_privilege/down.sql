DROP TABLE IF EXISTS postbox.grants;
DROP FUNCTION IF EXISTS postbox.drop_expired_completed(timestamptz);
CREATE OR REPLACE FUNCTION postbox.completed_partitions(p_ahead interval) RETURNS integer
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_hour timestamptz := date_trunc('hour', now(), 'UTC');
    v_name text;
    v_created integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(1886352247, 0);
    WHILE v_hour < now() + p_ahead LOOP
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

CREATE OR REPLACE FUNCTION postbox.messages_after_replay() RETURNS trigger
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    UPDATE postbox.messages SET state = 'waiting'
    WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting' AND state <> 'running'
      AND id > NEW.id;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION postbox.messages_check_head() RETURNS trigger
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
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

GRANT EXECUTE ON FUNCTION postbox.completed_partitions(interval) TO PUBLIC;
GRANT EXECUTE ON FUNCTION postbox.messages_after_replay() TO PUBLIC;
GRANT EXECUTE ON FUNCTION postbox.messages_check_head() TO PUBLIC;
GRANT EXECUTE ON FUNCTION postbox.messages_before_insert() TO PUBLIC;
DROP FUNCTION IF EXISTS postbox.keeps_ids();
