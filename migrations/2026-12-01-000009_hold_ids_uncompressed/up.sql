-- A held batch's registration carries the ids of its batch (~5.6 KB for 700 ids). Stored as
-- before (EXTENDED) they were compressed with pglz on every registration: 0.6 ms of an insert
-- that otherwise takes 0.05 ms (psql, 300 inserts of 700 ids: 186 ms against 27 ms uncompressed),
-- about 7 % of the database's time in a drain. Kept out of line uncompressed instead; the row
-- lives for one batch. Its TOAST table is written and emptied per batch as the table is, so it
-- is vacuumed as eagerly. Only settings change: rows already there keep their form, and no row of
-- postbox.messages is touched.
ALTER TABLE postbox.holds ALTER COLUMN ids SET STORAGE EXTERNAL;
ALTER TABLE postbox.holds SET (
    toast.autovacuum_vacuum_threshold = 100,
    toast.autovacuum_vacuum_scale_factor = 0
);
