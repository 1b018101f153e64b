-- A stream message is dead-lettered once (see the previous migration): unique on the new column,
-- built concurrently (this migration runs outside a transaction, one statement) so that
-- dead-lettering goes on while it is built.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS dead_letters_stream_key
    ON postbox.dead_letters (stream_id) WHERE stream_id IS NOT NULL;
