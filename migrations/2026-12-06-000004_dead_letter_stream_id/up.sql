-- A stream dead letter's stream id in a column of its own, which only the relay's stream path
-- writes. It was known by a header (`postbox-stream-id`) under a unique index: a writer could put
-- that header on its own messages, and the second such message that ran out of attempts failed
-- its dead-lettering — and every rescue batch it fell into — for good. The next migration indexes
-- the column (concurrently) and drops the header's index.
ALTER TABLE postbox.dead_letters ADD COLUMN stream_id text;
COMMENT ON COLUMN postbox.dead_letters.stream_id IS 'postbox: the stream id of a message dead-lettered from stream mode (unique); NULL for a table message';
