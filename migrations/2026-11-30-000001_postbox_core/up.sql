-- postbox: the outbox and queue. Everything lives in the schema `postbox`.
--
-- SQL contract for writers that do not use Rust: a plain
--   INSERT INTO postbox.messages (topic, payload) VALUES ('order.created', '{"id": 1}');
-- is a valid enqueue. The columns topic, key, payload, headers, priority and run_at keep these names.
CREATE SCHEMA IF NOT EXISTS postbox;

-- The hot table: one row per message that is pending (locked_until IS NULL) or running
-- (locked_until IS NOT NULL, leased until then). Delivered messages are deleted; dead ones move to
-- postbox.dead_letters.
CREATE TABLE postbox.messages (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic        text        NOT NULL,
    key          text,
    ordered      boolean     NOT NULL DEFAULT false,
    payload      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    headers      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    priority     smallint    NOT NULL DEFAULT 0,
    run_at       timestamptz NOT NULL DEFAULT now(),
    attempts     integer     NOT NULL DEFAULT 0,
    max_attempts integer     NOT NULL DEFAULT 25,
    locked_until timestamptz,
    lease_token  bigint,
    locked_by    text,
    first_error  text,
    last_error   text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    dedup_key    text,
    CONSTRAINT messages_topic_length CHECK (octet_length(topic) BETWEEN 1 AND 255),
    -- Header values must be strings, whoever writes the row. A jsonpath test, not a SQL function:
    -- CHECKs run on every UPDATE too (each claim), and a SQL function call there costs more than
    -- the rest of the claim.
    CONSTRAINT messages_headers_strings CHECK (
        jsonb_typeof(headers) = 'object'
        AND NOT jsonb_path_exists(headers, '$.* ? (@.type() != "string")')
    ),
    CONSTRAINT messages_ordered_needs_key CHECK (NOT ordered OR key IS NOT NULL),
    CONSTRAINT messages_max_attempts_positive CHECK (max_attempts >= 1),
    CONSTRAINT messages_attempts_not_negative CHECK (attempts >= 0),
    CONSTRAINT messages_lease_complete CHECK ((locked_until IS NULL) = (lease_token IS NULL))
);

COMMENT ON TABLE postbox.messages IS
    'postbox outbox: pending (locked_until IS NULL) and running (leased) messages';

-- Serves the claim query exactly: pending rows in claim order (priority, then id).
CREATE INDEX messages_claim_idx ON postbox.messages (priority, id) WHERE locked_until IS NULL;
-- Serves rescue: running rows by lease expiry.
CREATE INDEX messages_lease_idx ON postbox.messages (locked_until) WHERE locked_until IS NOT NULL;
-- Serves per-key order: is there an earlier ordered message of this (topic, key)?
CREATE INDEX messages_ordered_idx ON postbox.messages (topic, key, id) WHERE ordered;
-- A dedup key is unique per topic among live messages (the hot table holds only live ones).
CREATE UNIQUE INDEX messages_dedup_idx ON postbox.messages (topic, dedup_key)
    WHERE dedup_key IS NOT NULL;

-- Every message is inserted, updated at least once (claim) and deleted: the table churns through
-- its whole content continuously while staying small. The defaults (vacuum at 20% dead rows, with
-- cost-based throttling) let a busy queue pile up dead tuples that every claim has to step over.
-- Vacuum it after 1% (plus 1000 rows) has changed, without throttling, and analyze often so the
-- planner keeps choosing the partial indexes.
ALTER TABLE postbox.messages SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- Claim: pending → running, one statement per batch. Picks up to p_batch claimable messages of the
-- given topics (and none of the excluded ones: a relay's earlier routes) in (priority, id) order, skipping rows other claimers hold, and leases them. An ordered message is
-- claimable only when no earlier ordered message of its (topic, key) is still in the table.
--
-- A function, for one reason: its SET clauses. A queue's statistics are often wrong (a bulk insert
-- into a table last analyzed empty), and then the planner sorts the whole backlog on every claim
-- (measured: 38 ms instead of 1.5 ms for 100 of 100,000 rows). Here it can only walk
-- messages_claim_idx, whatever the statistics say. Writers in other languages may call it too.
CREATE FUNCTION postbox.claim(
    p_batch integer,
    p_lease_secs double precision,
    p_all_topics boolean,
    p_topics text[],
    p_patterns text[],
    p_not_topics text[],
    p_not_patterns text[],
    p_token bigint,
    p_owner text
) RETURNS SETOF postbox.messages
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
AS $$
BEGIN
    RETURN QUERY
    WITH picked AS (
        SELECT m.id
        FROM postbox.messages m
        WHERE m.locked_until IS NULL
          AND m.run_at <= now()
          AND (p_all_topics OR m.topic = ANY(p_topics) OR m.topic LIKE ANY(p_patterns))
          AND NOT (m.topic = ANY(p_not_topics) OR m.topic LIKE ANY(p_not_patterns))
          AND (NOT m.ordered OR NOT EXISTS (
                SELECT 1 FROM postbox.messages e
                WHERE e.ordered AND e.topic = m.topic AND e.key = m.key AND e.id < m.id))
        ORDER BY m.priority, m.id
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    )
    UPDATE postbox.messages m
    SET attempts = m.attempts + 1,
        locked_until = now() + make_interval(secs => p_lease_secs),
        lease_token = p_token,
        locked_by = p_owner
    FROM picked
    WHERE m.id = picked.id
    RETURNING m.*;
END
$$;

-- Messages that failed for good: out of attempts, or a permanent error. They keep everything needed
-- to debug and to replay them (with their original id) into postbox.messages.
CREATE TABLE postbox.dead_letters (
    id           bigint      PRIMARY KEY,
    topic        text        NOT NULL,
    key          text,
    ordered      boolean     NOT NULL,
    payload      jsonb       NOT NULL,
    headers      jsonb       NOT NULL,
    priority     smallint    NOT NULL,
    attempts     integer     NOT NULL,
    max_attempts integer     NOT NULL,
    created_at   timestamptz NOT NULL,
    dedup_key    text,
    first_error  text,
    last_error   text,
    reason       text        NOT NULL,
    dead_at      timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX dead_letters_topic_idx ON postbox.dead_letters (topic, id);
CREATE INDEX dead_letters_dead_at_idx ON postbox.dead_letters (dead_at);

-- Wake-up without taxing writers.
--
-- A transaction that runs NOTIFY takes a database-wide lock from its pre-commit until its commit
-- record is flushed, so notifying transactions commit one at a time: at a few thousand commits a
-- second, notifying on every insert costs writers most of their throughput. So writers notify only
-- while some relay is actually waiting. A relay that goes idle registers its backend pid here, then
-- claims once more (so a message committed before registration is not missed), then waits for a
-- notification or its poll interval. A relay that is woken, or finds work, unregisters, so a busy
-- relay costs writers one lookup in this tiny table per insert statement and nothing else.
-- UNLOGGED: it is rebuilt by the relays themselves after a crash or failover.
CREATE UNLOGGED TABLE postbox.listeners (
    pid   integer     PRIMARY KEY,
    since timestamptz NOT NULL DEFAULT now()
);

-- Notify channel `postbox` if, and only if, a relay is waiting.
CREATE FUNCTION postbox.wake() RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM postbox.listeners) THEN
        PERFORM pg_notify('postbox', '');
    END IF;
END
$$;

CREATE FUNCTION postbox.messages_inserted() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM postbox.listeners) THEN
        PERFORM pg_notify('postbox', '');
    END IF;
    RETURN NULL;
END
$$;

-- Once per INSERT statement, not per row: enqueue_many of 1,000 messages checks once. BEFORE, so
-- it skips the after-trigger queue; the notification is delivered at commit either way (and not
-- at all if the transaction rolls back).
CREATE TRIGGER messages_wake BEFORE INSERT ON postbox.messages
    FOR EACH STATEMENT EXECUTE FUNCTION postbox.messages_inserted();
