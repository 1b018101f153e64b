DROP INDEX CONCURRENTLY IF EXISTS postbox.messages_available_order_idx;
