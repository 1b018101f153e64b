DROP FUNCTION postbox.claim_limited(text, integer, boolean, boolean, text[], text[], integer,
    double precision, boolean, text[], text[], text[], text[], bigint, text);
