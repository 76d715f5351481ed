-- The archive's daily partitions are made by outbox_published's owner, whoever asks.
--
-- Only a table's owner may attach a partition to it (PostgreSQL 15 docs, ALTER TABLE:
-- "ATTACH PARTITION ... you must own the table"). A relay that logs in as a role of its own,
-- with the grants `outbox grants relay` writes, owns no table: migration 000015's
-- outbox_published_partitions, run as that role (at the relay's start, every hour, and by
-- outbox_archive_published on a day without its partition), failed with "must be owner of
-- table outbox_published", and once the days the migrations had made were past, every archive
-- failed and the relay published its batch again and again.
--
-- outbox_published_create_partitions runs as its owner, the role that ran the migrations
-- (SECURITY DEFINER), and is written as PostgreSQL asks of such a function (CREATE FUNCTION,
-- "Writing SECURITY DEFINER Functions Safely"): a search_path of pg_catalog and pg_temp
-- only, nothing read from the caller's; the schema given by name and checked to hold an
-- outbox_published; at most 31 days ahead; and only the roles it is granted to may run it.
CREATE FUNCTION outbox_published_create_partitions(schema_name text, days_ahead integer)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s'
AS $$
DECLARE
    parent regclass;
    day date;
    name text;
    created integer := 0;
BEGIN
    IF days_ahead IS NULL OR days_ahead < 0 OR days_ahead > 31 THEN
        RAISE EXCEPTION 'outbox: days_ahead must be 0 to 31, not %', days_ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    parent := to_regclass(format('%I.outbox_published', schema_name));
    IF parent IS NULL THEN
        RAISE EXCEPTION 'outbox: schema % holds no outbox_published', quote_ident(schema_name)
            USING ERRCODE = 'undefined_table';
    END IF;
    -- The key is "outbox_p" in ASCII.
    PERFORM pg_advisory_xact_lock(8031453476610924400);
    FOR ahead IN 0 .. days_ahead LOOP
        day := (now() AT TIME ZONE 'UTC')::date + ahead;
        name := 'outbox_published_p' || to_char(day, 'YYYYMMDD');
        IF to_regclass(format('%I.%I', schema_name, name)) IS NULL THEN
            EXECUTE format('CREATE TABLE %I.%I (LIKE %s)', schema_name, name, parent);
            EXECUTE format(
                'ALTER TABLE %s ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                parent, schema_name, name, day::timestamp AT TIME ZONE 'UTC',
                (day + 1)::timestamp AT TIME ZONE 'UTC');
            created := created + 1;
        END IF;
    END LOOP;
    RETURN created;
END
$$;

REVOKE ALL ON FUNCTION outbox_published_create_partitions(text, integer) FROM PUBLIC;

COMMENT ON FUNCTION outbox_published_create_partitions(text, integer) IS
    'Makes the missing daily partitions of schema_name.outbox_published as its owner (SECURITY DEFINER)';

-- As before, for the outbox_published the search_path finds; the partitions are now made by
-- the function above, of that table's own schema.
CREATE OR REPLACE FUNCTION outbox_published_partitions(days_ahead integer) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    schema_name text;
    created integer;
BEGIN
    SELECT n.nspname INTO schema_name
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE c.oid = 'outbox_published'::regclass;
    EXECUTE format('SELECT %I.outbox_published_create_partitions($1, $2)', schema_name)
        INTO created USING schema_name, days_ahead;
    RETURN created;
END
$$;
