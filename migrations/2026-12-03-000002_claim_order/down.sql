-- Back to the claim of 2026-12-01 (its body as it was): an equal share per busy topic.
CREATE OR REPLACE FUNCTION postbox.claim(p_batch integer, p_lease_secs double precision, p_all_topics boolean, p_topics text[], p_patterns text[], p_not_topics text[], p_not_patterns text[], p_token bigint, p_owner text) RETURNS SETOF postbox.messages
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_topics text[] := postbox.available_topics(p_all_topics, p_topics, p_patterns, p_not_topics, p_not_patterns);
    v_count integer := coalesce(cardinality(v_topics), 0);
    v_share integer;
    v_got integer := 0;
    v_n integer;
    v_more text[] := '{}';
    v_topic text;
BEGIN
    IF v_count = 0 OR p_batch <= 0 THEN
        RETURN;
    END IF;
    IF v_count > p_batch THEN
        -- More busy topics than room: a random p_batch of them, one message each.
        v_topics := ARRAY(SELECT t FROM unnest(v_topics) AS u(t) ORDER BY random() LIMIT p_batch);
        v_count := p_batch;
    END IF;
    v_share := p_batch / v_count;
    FOREACH v_topic IN ARRAY v_topics LOOP
        RETURN QUERY SELECT * FROM postbox.claim_topic(v_topic, v_share, p_lease_secs, p_token, p_owner);
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
        IF v_n = v_share THEN
            v_more := v_more || v_topic;
        END IF;
    END LOOP;
    FOREACH v_topic IN ARRAY v_more LOOP
        EXIT WHEN v_got >= p_batch;
        RETURN QUERY SELECT * FROM postbox.claim_topic(v_topic, p_batch - v_got, p_lease_secs, p_token, p_owner);
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_got := v_got + v_n;
    END LOOP;
END
$$;

DROP FUNCTION postbox.pick(integer, boolean, text[], text[], text[], text[], smallint, bigint);
DROP FUNCTION postbox.narrow_topics(boolean, text[], text[], text[], text[], integer);
DROP FUNCTION postbox.bytewise_topics();
