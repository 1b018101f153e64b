-- The check as it was: the slot only.
CREATE OR REPLACE FUNCTION postbox.publish(p_contents text[]) RETURNS integer
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
