-- Stream mode: messages published into the WAL (`pg_logical_emit_message`, prefix 'postbox') and
-- read by a relay through a logical replication slot, with no row in postbox.messages.
--
-- postbox.stream_slots names the slots postbox streams from (written by `postbox stream setup`,
-- removed by `postbox stream drop`). A publish checks that one of them exists in this database and
-- is not lost, so a message is never written where nothing will read it.
CREATE TABLE postbox.stream_slots (
    slot_name text PRIMARY KEY,
    publication text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Publishes each element of p_contents (the postbox stream encoding, version 1: a JSON object
-- {"v":1,"topic":...}) as a transactional logical-decoding message with prefix 'postbox': it
-- reaches the stream when, and only if, the calling transaction commits. Refuses (the caller's
-- transaction fails) when the server does not decode WAL (wal_level below logical) or when this
-- database has no usable postbox stream slot. Returns how many it published.
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
    SELECT count(pg_catalog.pg_logical_emit_message(true, 'postbox', c) ORDER BY i)
    INTO v_n
    FROM unnest(p_contents) WITH ORDINALITY AS u(c, i);
    RETURN v_n;
END
$$;
