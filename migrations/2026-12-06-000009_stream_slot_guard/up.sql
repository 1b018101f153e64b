-- A slot dropped and created again under the same name (by hand, behind postbox's back) starts at
-- the server's position of that moment, and nothing in it says that what was published after the
-- old slot's last confirmed position was never streamed. A relay now records, before it confirms
-- a position past it, a position it may confirm up to (confirm_limit: the server's WAL position
-- when it was recorded, so one record covers every confirmation until the stream passes it) and
-- the position it had confirmed by then (confirmed_before). A slot confirmed past confirm_limit
-- was not confirmed by a relay of postbox's: it was created again, advanced by hand, or streamed
-- by another program, and what was published from confirmed_before to its position may never
-- have been streamed. The relay that finds it records that range (gap_from, gap_to, gap_found_at);
-- `postbox stream status` and `postbox_stream_slot_gap_bytes` report it until `postbox stream
-- setup` acknowledges it. Existing rows start without a record: nothing is reported until their
-- relay has recorded once.
ALTER TABLE postbox.stream_slots
    ADD COLUMN confirm_limit pg_lsn,
    ADD COLUMN confirmed_before pg_lsn,
    ADD COLUMN gap_from pg_lsn,
    ADD COLUMN gap_to pg_lsn,
    ADD COLUMN gap_found_at timestamptz;

COMMENT ON COLUMN postbox.stream_slots.confirm_limit IS
    'postbox: a relay confirms the slot up to here at most (recorded before it confirms past it)';
COMMENT ON COLUMN postbox.stream_slots.confirmed_before IS
    'postbox: the position a relay had confirmed when it recorded confirm_limit';
COMMENT ON COLUMN postbox.stream_slots.gap_from IS
    'postbox: a slot found past confirm_limit: what was published from here to gap_to may never have been streamed (until stream setup)';
COMMENT ON COLUMN postbox.stream_slots.gap_to IS
    'postbox: the end of the range that may never have been streamed (the slot''s position when found)';
COMMENT ON COLUMN postbox.stream_slots.gap_found_at IS
    'postbox: when a relay found the slot past confirm_limit';
