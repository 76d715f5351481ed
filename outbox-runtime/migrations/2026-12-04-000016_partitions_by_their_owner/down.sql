CREATE OR REPLACE FUNCTION outbox_published_partitions(days_ahead integer) RETURNS integer
LANGUAGE plpgsql
SET lock_timeout = '5s'
AS $$
DECLARE
    parent regclass := 'outbox_published'::regclass;
    schema text := outbox_published_schema();
    day date;
    name text;
    created integer := 0;
BEGIN
    -- The key is "outbox_p" in ASCII.
    PERFORM pg_advisory_xact_lock(8031453476610924400);
    FOR ahead IN 0 .. days_ahead LOOP
        day := (now() AT TIME ZONE 'UTC')::date + ahead;
        name := 'outbox_published_p' || to_char(day, 'YYYYMMDD');
        IF to_regclass(format('%s.%I', schema, name)) IS NULL THEN
            EXECUTE format('CREATE TABLE %s.%I (LIKE %s)', schema, name, parent);
            EXECUTE format(
                'ALTER TABLE %s ATTACH PARTITION %s.%I FOR VALUES FROM (%L) TO (%L)',
                parent, schema, name, day::timestamp AT TIME ZONE 'UTC',
                (day + 1)::timestamp AT TIME ZONE 'UTC');
            created := created + 1;
        END IF;
    END LOOP;
    RETURN created;
END
$$;

DROP FUNCTION outbox_published_create_partitions(text, integer);
