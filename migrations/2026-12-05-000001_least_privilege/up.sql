-- Least privilege (`postbox grant`). What a writer's insert runs besides writing its own row —
-- the order of its key (the key's writer lock, a look at the key's head, a replay's demotion),
-- the commit check of a waiting message — runs with the rights of the schema's owner, so a writer
-- needs INSERT on the message columns and nothing else: it never reads another message's
-- payload, nor updates or deletes a message. Each function has a fixed search_path (pg_catalog
-- first), as every SECURITY DEFINER function must. Trigger functions cannot be called directly,
-- so they need no EXECUTE revoked. The wake-up (messages_inserted, on every insert statement)
-- stays as it is, at no extra cost per statement: a writer may read postbox.listeners, which
-- holds no message.
ALTER FUNCTION postbox.messages_before_insert() SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
ALTER FUNCTION postbox.messages_check_head() SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
ALTER FUNCTION postbox.messages_after_replay() SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;

-- Retention upkeep by a relay that does not own the schema: creating the hourly partitions of
-- postbox.completed needs its owner, and so does dropping the expired ones. Both run as the
-- owner, for the roles granted them (the relay role), not for PUBLIC.
ALTER FUNCTION postbox.completed_partitions(interval) SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
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
    FOR v IN SELECT * FROM postbox.completed_expired(p_before) LOOP
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
