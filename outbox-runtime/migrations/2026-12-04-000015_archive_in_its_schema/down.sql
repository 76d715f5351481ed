CREATE OR REPLACE FUNCTION outbox_published_partitions(days_ahead integer) RETURNS integer
LANGUAGE plpgsql
SET lock_timeout = '5s'
AS $$
DECLARE
    day date;
    name text;
    created integer := 0;
BEGIN
    -- The key is "outbox_p" in ASCII.
    PERFORM pg_advisory_xact_lock(8031453476610924400);
    FOR ahead IN 0 .. days_ahead LOOP
        day := (now() AT TIME ZONE 'UTC')::date + ahead;
        name := 'outbox_published_p' || to_char(day, 'YYYYMMDD');
        IF to_regclass(name) IS NULL THEN
            EXECUTE format('CREATE TABLE %I (LIKE outbox_published)', name);
            EXECUTE format(
                'ALTER TABLE outbox_published ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                name, day::timestamp AT TIME ZONE 'UTC', (day + 1)::timestamp AT TIME ZONE 'UTC');
            created := created + 1;
        END IF;
    END LOOP;
    RETURN created;
END
$$;

CREATE OR REPLACE FUNCTION outbox_archive_published(ids uuid[]) RETURNS bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    moved bigint;
BEGIN
    IF to_regclass('outbox_published_p' || to_char((now() AT TIME ZONE 'UTC')::date, 'YYYYMMDD'))
       IS NULL THEN
        PERFORM outbox_published_partitions(1);
    END IF;
    WITH gone AS (
        DELETE FROM outbox_events WHERE id = ANY(ids)
        RETURNING id, aggregate_type, aggregate_id, aggregate_seq, event_type, event_version,
                  partition_key, subject, payload, headers, occurred_at, correlation_id,
                  causation_id, attempts
    )
    INSERT INTO outbox_published (id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                                  event_version, partition_key, subject, payload, headers,
                                  occurred_at, correlation_id, causation_id, attempts,
                                  published_at)
    SELECT id, aggregate_type, aggregate_id, aggregate_seq, event_type, event_version,
           partition_key, subject, payload, headers, occurred_at, correlation_id, causation_id,
           attempts, now()
    FROM gone;
    GET DIAGNOSTICS moved = ROW_COUNT;
    RETURN moved;
END
$$;

DROP FUNCTION outbox_published_schema();
