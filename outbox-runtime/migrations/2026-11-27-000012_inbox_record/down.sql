-- The three-statement outbox_inbox_record of 2026-11-23-000005_hardening.
CREATE OR REPLACE FUNCTION outbox_inbox_record(
    p_consumer text, p_source text, p_message_id text,
    p_aggregate_type text, p_aggregate_id text, p_seq bigint, p_stream_sequence bigint,
    p_accept_gap boolean,
    OUT recorded boolean, OUT previous_seq bigint, OUT previous_stream_sequence bigint,
    OUT moved boolean)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    INSERT INTO outbox_inbox (consumer, source, message_id)
    VALUES (p_consumer, p_source, p_message_id)
    ON CONFLICT DO NOTHING;
    recorded := FOUND;
    IF NOT recorded OR p_aggregate_type IS NULL THEN
        RETURN;
    END IF;
    -- The aggregate's row, created at "nothing applied" on first sight, then locked.
    INSERT INTO outbox_inbox_positions
        (consumer, source, aggregate_type, aggregate_id, last_seq, stream_sequence)
    VALUES (p_consumer, p_source, p_aggregate_type, p_aggregate_id, 0, 0)
    ON CONFLICT DO NOTHING;
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
