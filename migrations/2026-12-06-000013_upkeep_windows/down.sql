DROP FUNCTION postbox.promote_due(integer, timestamptz);
DROP FUNCTION postbox.finish_heads(integer, timestamptz);
