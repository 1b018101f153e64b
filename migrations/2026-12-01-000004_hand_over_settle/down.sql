-- Nothing to undo: the up migration (re)creates the functions and triggers exactly as the landed
-- state-model and hand-over migrations define them. A database that came through their other,
-- earlier version keeps the converged definitions, which those migrations' own down migrations
-- take back as well.
SELECT 1;
