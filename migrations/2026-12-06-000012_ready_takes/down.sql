DROP FUNCTION postbox.take_ready(text, integer, text, integer, xid8, bigint);
