DROP FUNCTION postbox.take_ready(text, integer, text);
