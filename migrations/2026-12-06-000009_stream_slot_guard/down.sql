ALTER TABLE postbox.stream_slots
    DROP COLUMN gap_found_at,
    DROP COLUMN gap_to,
    DROP COLUMN gap_from,
    DROP COLUMN confirmed_before,
    DROP COLUMN confirm_limit;
