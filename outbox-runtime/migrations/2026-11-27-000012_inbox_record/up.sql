-- The inbox records the next event of an aggregate in one statement instead of three.
--
-- Before, outbox_inbox_record created the aggregate's position row (INSERT ... ON CONFLICT
-- DO NOTHING), locked and read it (SELECT ... FOR UPDATE), then moved it (UPDATE): three
-- statements for every message, most of the inbox's cost in PostgreSQL beside the handler's
-- own write. Now one upsert creates the row at the event when it is the aggregate's first,
-- or moves it to the event when it is the next one. ON CONFLICT DO UPDATE locks the
-- conflicting row whether or not its WHERE holds, and in READ COMMITTED evaluates the WHERE
-- on the row's latest committed version after waiting for a concurrent holder (PostgreSQL
-- 15 documentation, INSERT, "ON CONFLICT Clause"; 13.2.1 "Read Committed Isolation
-- Level"): the same lock and the same check as the SELECT ... FOR UPDATE. An event that is
-- not the next one (late, or after a gap) and a caller that accepts a gap take the old path,
-- which reads the locked row to say where the aggregate stands.
CREATE OR REPLACE FUNCTION outbox_inbox_record(
    p_consumer text, p_source text, p_message_id text,
    p_aggregate_type text, p_aggregate_id text, p_seq bigint, p_stream_sequence bigint,
    p_accept_gap boolean,
    OUT recorded boolean, OUT previous_seq bigint, OUT previous_stream_sequence bigint,
    OUT moved boolean)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    now_seq bigint;
BEGIN
    INSERT INTO outbox_inbox (consumer, source, message_id)
    VALUES (p_consumer, p_source, p_message_id)
    ON CONFLICT DO NOTHING;
    recorded := FOUND;
    IF NOT recorded OR p_aggregate_type IS NULL THEN
        RETURN;
    END IF;
    IF NOT p_accept_gap AND p_seq >= 1 THEN
        -- The aggregate's row: created at the event if it is the first (else at "nothing
        -- applied"), or moved to the event if it is the next one; locked either way.
        INSERT INTO outbox_inbox_positions AS p
            (consumer, source, aggregate_type, aggregate_id, last_seq, stream_sequence)
        VALUES (p_consumer, p_source, p_aggregate_type, p_aggregate_id,
                CASE WHEN p_seq = 1 THEN p_seq ELSE 0 END,
                CASE WHEN p_seq = 1 THEN p_stream_sequence ELSE 0 END)
        ON CONFLICT (consumer, source, aggregate_type, aggregate_id) DO UPDATE
            SET last_seq = p_seq, stream_sequence = p_stream_sequence, updated_at = now()
            WHERE p.last_seq = p_seq - 1
        RETURNING p.last_seq INTO now_seq;
        IF FOUND AND now_seq = p_seq THEN
            -- Its previous event is the one before it; its stream sequence is not read.
            previous_seq := p_seq - 1;
            moved := true;
            RETURN;
        END IF;
    ELSE
        -- The aggregate's row, created at "nothing applied" on first sight.
        INSERT INTO outbox_inbox_positions
            (consumer, source, aggregate_type, aggregate_id, last_seq, stream_sequence)
        VALUES (p_consumer, p_source, p_aggregate_type, p_aggregate_id, 0, 0)
        ON CONFLICT DO NOTHING;
    END IF;
    -- Where the aggregate stands (the row is locked until COMMIT).
    SELECT p.last_seq, p.stream_sequence INTO previous_seq, previous_stream_sequence
    FROM outbox_inbox_positions p
    WHERE p.consumer = p_consumer AND p.source = p_source
      AND p.aggregate_type = p_aggregate_type AND p.aggregate_id = p_aggregate_id
    FOR UPDATE;
    moved := previous_seq = p_seq - 1 OR (p_accept_gap AND previous_seq < p_seq);
    IF moved THEN
        UPDATE outbox_inbox_positions p
        SET last_seq = p_seq, stream_sequence = p_stream_sequence, updated_at = now()
        WHERE p.consumer = p_consumer AND p.source = p_source
          AND p.aggregate_type = p_aggregate_type AND p.aggregate_id = p_aggregate_id;
    END IF;
END
$$;
