ALTER TABLE postbox.holds ALTER COLUMN ids SET STORAGE EXTENDED;
ALTER TABLE postbox.holds RESET (toast.autovacuum_vacuum_threshold, toast.autovacuum_vacuum_scale_factor);
