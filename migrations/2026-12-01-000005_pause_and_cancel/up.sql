-- Paused topics: a relay or embedded engine claims nothing of a topic that one of these patterns
-- matches (exact names, or `*` for any run of characters, as in a route's topics). Engines read
-- this tiny table every second; deliveries already running finish. No message is touched.
CREATE TABLE postbox.pauses (
    pattern text PRIMARY KEY CHECK (pattern <> ''),
    paused_at timestamptz NOT NULL DEFAULT now()
);

-- Cancelled while running: the delivery in progress finishes; if it fails (or its lease expires)
-- the message goes to the dead letters with reason `cancelled` instead of being retried. Messages
-- that are not running are moved to the dead letters at once by the cancel itself. Adding a column
-- with a constant default rewrites no row.
ALTER TABLE postbox.messages ADD COLUMN cancelled boolean NOT NULL DEFAULT false;
