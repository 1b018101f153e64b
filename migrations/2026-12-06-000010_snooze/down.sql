ALTER TABLE postbox.messages DROP COLUMN snoozes;
