-- Snooze: a handler asks to run again later without using an attempt (River's JobSnooze, Oban's
-- {:snooze, s}). The message counts its snoozes, so an engine can cap them: past the cap a snooze
-- uses an attempt like a retry, and a message that only ever snoozes still reaches the dead
-- letters. A constant default: no row is rewritten.
ALTER TABLE postbox.messages ADD COLUMN snoozes integer NOT NULL DEFAULT 0;
COMMENT ON COLUMN postbox.messages.snoozes IS
    'Times a handler snoozed the message (ran it again later without using an attempt); engines cap it (max_snoozes)';
