ALTER TABLE postbox.dead_letters DROP COLUMN stream_id;
