DROP TRIGGER IF EXISTS messages_wake ON postbox.messages;
DROP FUNCTION IF EXISTS postbox.messages_inserted();
DROP FUNCTION IF EXISTS postbox.wake();
DROP TABLE IF EXISTS postbox.listeners;
DROP TABLE IF EXISTS postbox.dead_letters;
DROP FUNCTION IF EXISTS postbox.claim(integer, double precision, boolean, text[], text[], text[], text[], bigint, text);
DROP TABLE IF EXISTS postbox.messages;
DROP SCHEMA IF EXISTS postbox;
