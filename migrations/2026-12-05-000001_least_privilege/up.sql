-- Least privilege (`postbox grant`). What a writer's insert runs besides writing its own row —
-- the order of its key (the key's writer lock, a look at the key's head, a replay's demotion),
-- the commit check of a waiting message — runs with the rights of the schema's owner, so a writer
-- needs INSERT on the message columns and nothing else: it never reads another message's
-- payload, nor updates or deletes a message. Each function has a fixed search_path (pg_catalog
-- first), as every SECURITY DEFINER function must. The wake-up (messages_inserted, on every
-- insert statement) stays as it is, at no extra cost per statement: a writer may read
-- postbox.listeners, which holds no message.

-- Whether this insert keeps the ids it is given (a replay of dead letters, which names them with
-- OVERRIDING SYSTEM VALUE): only for a caller that may insert ids, so a writer that sets
-- postbox.keep_ids cannot keep an id drawn early to jump ahead of a key's later writers.
CREATE FUNCTION postbox.keeps_ids() RETURNS boolean
    LANGUAGE sql STABLE
    AS $$ SELECT coalesce(current_setting('postbox.keep_ids', true) = 'on', false)
             AND pg_catalog.has_column_privilege(session_user, 'postbox.messages'::regclass, 'id', 'INSERT') $$;

-- Each refuses to run as a trigger of any other table (a role could attach it to a table of its
-- own, whose column types it chose, and run code of its own as the owner), and none is for PUBLIC
-- to attach: a trigger runs its function without checking EXECUTE, so inserts are unaffected.
CREATE OR REPLACE FUNCTION postbox.messages_before_insert() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, postbox, pg_temp
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
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
    PERFORM pg_advisory_xact_lock(1886352244, postbox.key_lock_id(NEW.topic, NEW.key));
    IF NOT postbox.keeps_ids() THEN
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

CREATE OR REPLACE FUNCTION postbox.messages_check_head() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, postbox, pg_temp
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET enable_sort TO 'off'
    SET jit TO 'off'
    AS $$
DECLARE
    v_head record;
BEGIN
    IF TG_RELID <> 'postbox.messages'::regclass THEN
        RAISE EXCEPTION 'permission denied: postbox''s trigger % runs on postbox.messages only', TG_NAME
            USING ERRCODE = 'insufficient_privilege';
    END IF;
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
    IF postbox.keeps_ids()
       AND EXISTS (SELECT 1 FROM postbox.messages WHERE id = NEW.id AND state::text = 'waiting') THEN
        INSERT INTO postbox.behind (topic, key, id) VALUES (NEW.topic, NEW.key, NEW.id)
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION postbox.messages_after_replay() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, postbox, pg_temp
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    IF TG_RELID <> 'postbox.messages'::regclass THEN
        RAISE EXCEPTION 'permission denied: postbox''s trigger % runs on postbox.messages only', TG_NAME
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF NOT postbox.keeps_ids() THEN
        RETURN NULL;
    END IF;
    UPDATE postbox.messages SET state = 'waiting'
    WHERE ordered AND topic = NEW.topic AND key = NEW.key AND state <> 'waiting' AND state <> 'running'
      AND id > NEW.id;
    RETURN NULL;
END
$$;

REVOKE EXECUTE ON FUNCTION postbox.messages_before_insert() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION postbox.messages_check_head() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION postbox.messages_after_replay() FROM PUBLIC;

-- Retention upkeep by a relay that does not own the schema: creating the hourly partitions of
-- postbox.completed needs its owner, and so does dropping the expired ones. Both run as the
-- owner, for the roles granted them (the relay role), not for PUBLIC; neither reaches further
-- than a week ahead, nor drops the partition of the hour now running.
CREATE OR REPLACE FUNCTION postbox.completed_partitions(p_ahead interval) RETURNS integer
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, postbox, pg_temp
    AS $$
DECLARE
    v_hour timestamptz := date_trunc('hour', now(), 'UTC');
    v_name text;
    v_created integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(1886352247, 0);
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
REVOKE EXECUTE ON FUNCTION postbox.completed_partitions(interval) FROM PUBLIC;

-- Detaches and drops the partitions of postbox.completed whose hour ended before p_before; returns
-- how many it dropped. A relay that owns the table detaches CONCURRENTLY instead (which cannot run
-- in a function); this one detaches at once, under a short lock_timeout so that a busy table
-- makes it fail and try again at the next upkeep rather than hold up deliveries.
CREATE FUNCTION postbox.drop_expired_completed(p_before timestamptz) RETURNS integer
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, postbox, pg_temp
    SET lock_timeout = '2s'
    AS $$
DECLARE
    v record;
    v_dropped integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(1886352247, 0);
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
$$;
REVOKE EXECUTE ON FUNCTION postbox.drop_expired_completed(timestamptz) FROM PUBLIC;

-- Which roles `postbox grant` gave which rights, so that `postbox migrate` gives them again on
-- the objects a later migration creates (and `postbox grant --revoke` knows what to take back).
CREATE TABLE postbox.grants (
    role text NOT NULL,
    kind text NOT NULL CHECK (kind IN ('writer', 'relay', 'operator')),
    granted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (role, kind)
);
