DROP FUNCTION postbox.complete_in_tx(bigint, bigint);
ALTER TABLE postbox.holds DROP COLUMN token;
DROP TABLE postbox.completed_in_tx;
