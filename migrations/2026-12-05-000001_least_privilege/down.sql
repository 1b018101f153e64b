DROP TABLE IF EXISTS postbox.grants;
DROP FUNCTION IF EXISTS postbox.drop_expired_completed(timestamptz);
GRANT EXECUTE ON FUNCTION postbox.completed_partitions(interval) TO PUBLIC;
ALTER FUNCTION postbox.completed_partitions(interval) SECURITY INVOKER RESET search_path;
ALTER FUNCTION postbox.messages_after_replay() SECURITY INVOKER RESET search_path;
ALTER FUNCTION postbox.messages_check_head() SECURITY INVOKER RESET search_path;
ALTER FUNCTION postbox.messages_before_insert() SECURITY INVOKER RESET search_path;
