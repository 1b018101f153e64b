-- Paused topics: a relay or embedded engine claims nothing of a topic that one of these patterns
-- matches (exact names, or `*` for any run of characters, as in a route's topics). Engines read
-- this tiny table every second; deliveries already running finish. No message is touched.
CREATE TABLE postbox.pauses (
    pattern text PRIMARY KEY CHECK (pattern <> ''),
    paused_at timestamptz NOT NULL DEFAULT now()
);
