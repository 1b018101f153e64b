DROP INDEX CONCURRENTLY IF EXISTS postbox.dead_letters_stream_key;
