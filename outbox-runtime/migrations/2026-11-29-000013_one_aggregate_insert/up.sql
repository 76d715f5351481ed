-- The unit of work's INSERT for one aggregate, the common case (a unit of work that tracks
-- one aggregate): scalar steps instead of the set-based statement, which unnests the
-- aggregates' arrays, joins the events to them and to the upsert's result, and probes an
-- aggregate's highest stored sequence twice (once for the insert, once for the update).
-- pgbench on this outbox (BEGIN with the unit of work's mark, one business insert, then this
-- function for one event of a random aggregate of 1,000 and COMMIT in one query; the two
-- functions interleaved, 6 s each, 2026-11-29): one client 1,942 and 1,961 transactions/s
-- with the set-based statement against 2,080 and 2,093 (two series of four and six rounds;
-- faster in each of the ten pairs, by 0-21%); 32 clients 6,491 and 6,051 against 7,000 and
-- 6,161 (pairs 0.83-1.19x: within the noise of a saturated host). Several aggregates keep
-- the set-based statement. The arguments, the rows written and the guarantees are the same.
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
    stored bigint;
    before bigint;
    blocked timestamptz;
BEGIN
    PERFORM outbox_assert_unit_of_work();
    IF cardinality($1) = 1 THEN
        -- The aggregate's new sequences follow the highest of its last one (its
        -- outbox_aggregates row, locked by the upsert until COMMIT; an upsert that waits for
        -- another unit of work's lock reads the row that one committed) and the rows inserted
        -- by hand above it, read here.
        SELECT coalesce(max(o.aggregate_seq), 0) INTO stored FROM outbox_events o
        WHERE o.aggregate_type = $1[1] AND o.aggregate_id = $2[1];
        INSERT INTO outbox_aggregates AS s (aggregate_type, aggregate_id, last_seq)
        VALUES ($1[1], $2[1], stored + $3[1])
        ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
            SET last_seq = greatest(s.last_seq, stored) + $3[1]
        RETURNING s.last_seq - $3[1], s.blocked_until INTO before, blocked;
        INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                                   event_version, partition_key, subject, payload,
                                   available_at, correlation_id, causation_id, headers)
        SELECT e.id, e.aggregate_type, e.aggregate_id, before + e.ordinal, e.event_type,
               e.event_version, e.partition_key, e.subject, e.payload::json,
               greatest(now(), blocked), $4, $5, $6
        FROM unnest($7, $8, $9, $10, $11, $12, $13, $14, $15)
             AS e(id, aggregate_type, aggregate_id, ordinal, event_type, event_version,
                  partition_key, subject, payload)
        WHERE e.aggregate_type = $1[1] AND e.aggregate_id = $2[1];
        GET DIAGNOSTICS inserted = ROW_COUNT;
        RETURN inserted;
    END IF;
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
