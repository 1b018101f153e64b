-- The slots themselves are the server's: `postbox stream drop` removes them before this runs.
DROP FUNCTION postbox.publish(text[]);
DROP TABLE postbox.stream_slots;
