ALTER TABLE postbox.messages DROP COLUMN cancelled;
DROP TABLE postbox.pauses;
