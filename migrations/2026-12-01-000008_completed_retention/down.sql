DROP FUNCTION postbox.completed_expired(timestamptz);
DROP FUNCTION postbox.completed_partitions(interval);
-- Its partitions go with it.
DROP TABLE postbox.completed;
