-- The stream dead letters already there get their column from their header (the header's unique
-- index kept them one per stream id), then that index goes: a table message's header is only a
-- header.
UPDATE postbox.dead_letters SET stream_id = headers ->> 'postbox-stream-id'
WHERE headers ? 'postbox-stream-id' AND stream_id IS NULL;
SET LOCAL lock_timeout = '10s';
DROP INDEX postbox.dead_letters_stream_id_idx;
