-- The claim order across topics: (priority, id) of the available messages. A claim that serves
-- many topics walks it (postbox.pick, next migration) instead of visiting every topic. Built
-- CONCURRENTLY (this migration runs outside a transaction): enqueues go on while it builds. On
-- `priority::integer`, not `priority`: only statements that order by that expression can use it,
-- so a claim of one topic never takes it for its own index (which a table of one topic's
-- statistics would make look as cheap).
CREATE INDEX CONCURRENTLY IF NOT EXISTS messages_available_order_idx
    ON postbox.messages ((priority::integer), id) WHERE state = 'available';
