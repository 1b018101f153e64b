-- Cron schedules: one row per schedule name, shared by every relay and embedded engine that runs
-- the schedule. A tick is fired by locking the row, enqueueing the tick's message and moving
-- next_tick on, all in one transaction: each tick gives exactly one message however many relays
-- run it, and a relay that dies half-way leaves the tick to the next one. A row whose next_tick
-- is long past (every relay was down) fires once, for the latest tick missed, then moves on.
-- Nothing here touches postbox.messages: a new, empty table.
CREATE TABLE postbox.schedules (
    name text PRIMARY KEY CHECK (name <> ''),
    -- The definition the row's ticks were computed with; a relay that brings another one
    -- (a changed expression or timezone) starts the row again from its next tick.
    cron text NOT NULL,
    timezone text NOT NULL,
    topic text NOT NULL,
    last_tick timestamptz,
    last_message_id bigint,
    next_tick timestamptz NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
