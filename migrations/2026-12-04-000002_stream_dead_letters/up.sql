-- A stream message is dead-lettered once, whatever the number of times it is streamed (a relay
-- that stops before confirming streams it again): its stream id is unique among dead letters.
-- Built concurrently (this migration runs outside a transaction) so that dead-lettering goes on
-- while it is built; only rows a relay dead-lettered from the stream are in it.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS dead_letters_stream_id_idx
    ON postbox.dead_letters ((headers ->> 'postbox-stream-id'))
    WHERE headers ? 'postbox-stream-id';
