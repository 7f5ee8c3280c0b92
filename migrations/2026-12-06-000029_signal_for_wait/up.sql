-- A signal sent for one wait (`"until"`) belongs to that wait alone: no
-- other wait of its name takes it, and a second decision for the wait is
-- refused. `NULL`: sent for whichever wait of its name comes first.
ALTER TABLE signals ADD COLUMN for_wait TEXT;
