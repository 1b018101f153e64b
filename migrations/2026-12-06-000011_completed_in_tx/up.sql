-- Transactional completion (River's JobCompleteTx): a handler records, in its own transaction
-- with its own writes (and the follow-up messages it enqueues), that this message's work is done.
-- The row is the message's claim on its effect: a later delivery of the same message (the engine
-- died between the handler's commit and the settle, a lease expired, a held batch rolled back)
-- finds it and does not do the work again; a delivery running at the same time waits on its key
-- and then finds it. If the handler's transaction rolls back, so does the row. The relay's upkeep
-- drops rows whose message is gone from the table and from the dead letters (a replayed message
-- whose work was recorded is completed without doing it again).
CREATE TABLE postbox.completed_in_tx (
    id bigint PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE postbox.completed_in_tx IS
    'Messages whose handler committed their work in its own transaction (Job::complete_in): a redelivery skips the work; dropped once the message is gone';

-- A hold's token (the lease its messages get if still unsettled when it ends): what a handler of
-- a held message proves its delivery with. Nullable, no default: no row is rewritten.
ALTER TABLE postbox.holds ADD COLUMN token bigint;

-- Records the completion for the delivery that holds the message now, named by its lease token
-- (a writer cannot read tokens): a leased message running under this token, or an available one
-- in a hold of this token whose transaction is still running (token 0, a head kept for a writer
-- after its delivery, names no delivery). True if this transaction is the first to record it; false if another
-- delivery's transaction committed it (one still open is waited for, on the key). A delivery that
-- lost its message (lease expired, settled) is refused: its transaction rolls back, its work with
-- it. Runs as the schema's owner, so a writer needs EXECUTE on it alone, and cannot mark another
-- delivery's message done.
CREATE FUNCTION postbox.complete_in_tx(p_id bigint, p_token bigint) RETURNS boolean
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    IF p_token IS NULL OR p_token = 0 OR NOT EXISTS (
        SELECT FROM postbox.messages m
        WHERE m.id = p_id
          AND ((m.state = 'running' AND m.lease_token = p_token)
               OR (m.state = 'available'
                   AND EXISTS (SELECT FROM postbox.holds h
                               WHERE h.token = p_token AND p_id = ANY (h.ids)
                                 AND pg_xact_status(h.xid) = 'in progress')))
    ) THEN
        RAISE EXCEPTION 'postbox: message % is no longer delivered under this lease (it expired, or the message was settled): its work is not recorded', p_id;
    END IF;
    INSERT INTO postbox.completed_in_tx (id) VALUES (p_id) ON CONFLICT (id) DO NOTHING;
    RETURN FOUND;
END
$$;
REVOKE EXECUTE ON FUNCTION postbox.complete_in_tx(bigint, bigint) FROM PUBLIC;
