-- Back to writing every message into postbox.messages: what the intake holds is moved there
-- first (its writers finish before the lock is granted, and their rows are moved too), then the
-- intake is dropped.
LOCK TABLE postbox.intake IN ACCESS EXCLUSIVE MODE;
INSERT INTO postbox.messages (id, topic, key, payload, headers, priority, run_at, max_attempts, created_at)
OVERRIDING SYSTEM VALUE
SELECT id, topic, key, payload, headers, priority, run_at, max_attempts, created_at
FROM postbox.intake ORDER BY xid, id;
DROP FUNCTION postbox.move_intake(integer, text);
DROP TABLE postbox.intake;
