-- Holds in progress keep their rows locked until they end; a hold lost before this runs is not
-- counted (its messages are simply available again).
DROP FUNCTION postbox.lost_holds();
DROP FUNCTION postbox.take(integer, boolean, text[], text[], text[], text[], text[], smallint[], bigint[]);
DROP FUNCTION postbox.take_topic(text, integer, smallint, bigint);
DROP TABLE postbox.holds;
