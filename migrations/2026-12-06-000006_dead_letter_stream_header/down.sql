-- Back to the header's unique index. A table message that carried the header and was
-- dead-lettered since (which that index would refuse a second of) keeps it under another name.
UPDATE postbox.dead_letters
SET headers = (headers - 'postbox-stream-id')
              || jsonb_build_object('x-postbox-stream-id', headers ->> 'postbox-stream-id')
WHERE stream_id IS NULL AND headers ? 'postbox-stream-id';
CREATE UNIQUE INDEX dead_letters_stream_id_idx
    ON postbox.dead_letters ((headers ->> 'postbox-stream-id'))
    WHERE headers ? 'postbox-stream-id';
