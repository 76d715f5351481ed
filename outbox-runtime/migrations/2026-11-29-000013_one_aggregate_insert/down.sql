-- The set-based outbox_insert_events of 2026-11-24-000010_exact_payloads, for every unit of work.
CREATE OR REPLACE FUNCTION outbox_insert_events(
    text[], text[], int8[],
    text, text, jsonb,
    uuid[], text[], text[], int8[], text[], int4[], text[], text[], text[]
) RETURNS bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    inserted bigint;
BEGIN
    PERFORM outbox_assert_unit_of_work();
    -- An aggregate's new sequences follow its last one: the outbox_aggregates row, locked by
    -- the upsert until COMMIT, or rows inserted by hand above it. The update recovers the
    -- number of new events as excluded.last_seq minus the same max(), read in the same
    -- snapshot: an index probe, where a lookup in the aggregates CTE would scan it per row.
    WITH aggregates AS (
        SELECT * FROM unnest($1, $2, $3) AS a(aggregate_type, aggregate_id, n)
    ), sequences AS (
        INSERT INTO outbox_aggregates AS s (aggregate_type, aggregate_id, last_seq)
        SELECT a.aggregate_type, a.aggregate_id, a.n + coalesce((
            SELECT max(o.aggregate_seq) FROM outbox_events o
            WHERE o.aggregate_type = a.aggregate_type AND o.aggregate_id = a.aggregate_id), 0)
        FROM aggregates a
        ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
            SET last_seq = greatest(s.last_seq + excluded.last_seq - coalesce((
                SELECT max(o.aggregate_seq) FROM outbox_events o
                WHERE o.aggregate_type = excluded.aggregate_type
                  AND o.aggregate_id = excluded.aggregate_id), 0), excluded.last_seq)
        RETURNING s.aggregate_type, s.aggregate_id, s.last_seq, s.blocked_until
    )
    INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                               event_version, partition_key, subject, payload, available_at,
                               correlation_id, causation_id, headers)
    SELECT e.id, e.aggregate_type, e.aggregate_id, s.last_seq - a.n + e.ordinal, e.event_type,
           e.event_version, e.partition_key, e.subject, e.payload::json,
           greatest(now(), s.blocked_until), $4, $5, $6
    FROM unnest($7, $8, $9, $10, $11, $12, $13, $14, $15)
         AS e(id, aggregate_type, aggregate_id, ordinal, event_type, event_version,
              partition_key, subject, payload)
    JOIN aggregates a USING (aggregate_type, aggregate_id)
    JOIN sequences s USING (aggregate_type, aggregate_id);
    GET DIAGNOSTICS inserted = ROW_COUNT;
    RETURN inserted;
END
$$;
