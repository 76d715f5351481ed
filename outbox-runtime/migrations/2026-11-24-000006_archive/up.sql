-- Retention at scale: published rows kept in daily partitions that are dropped whole
-- (PublishedRows::Archive), instead of marked in place and deleted row by row.
--
-- A relay in Archive mode moves each acked row out of outbox_events into outbox_published,
-- in the batch's transaction: outbox_events keeps only what is queued (the claim's indexes
-- stay small, as in Delete mode), and the history lives in one partition per day of
-- publication (UTC). Retention detaches a day's partition CONCURRENTLY and drops it, which
-- takes no lock that blocks the relay's inserts (PostgreSQL docs, ALTER TABLE, "DETACH
-- PARTITION"), where deleting the same rows one by one writes, and then vacuums, each row.
-- There is no DEFAULT partition: it would forbid the concurrent detach. A day's partition
-- is created ahead by the relay, or at the latest by the first row archived that day.
CREATE TABLE outbox_published (
    id             uuid        NOT NULL,
    aggregate_type text        COLLATE "C" NOT NULL,
    aggregate_id   text        COLLATE "C" NOT NULL,
    aggregate_seq  bigint      NOT NULL,
    event_type     text        NOT NULL,
    event_version  integer     NOT NULL,
    partition_key  text        NOT NULL,
    subject        text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL,
    occurred_at    timestamptz NOT NULL,
    correlation_id text,
    causation_id   text,
    attempts       integer     NOT NULL,
    published_at   timestamptz NOT NULL
) PARTITION BY RANGE (published_at);

-- An aggregate's history, in sequence (replays, audits).
CREATE INDEX outbox_published_aggregate
    ON outbox_published (aggregate_type, aggregate_id, aggregate_seq);
-- What was published when (the recent rate, time ranges): rows arrive in published_at
-- order, so a BRIN index answers that for a few pages, at almost no cost to the archive.
CREATE INDEX outbox_published_at ON outbox_published USING brin (published_at);

-- Creates the daily partitions from today (UTC) to `days_ahead` days after, when missing;
-- returns how many it created. A partition is named outbox_published_pYYYYMMDD and holds
-- the rows published that day. Safe from several relays at once (an advisory lock).
--
-- Each is created apart and then attached: ATTACH PARTITION takes SHARE UPDATE EXCLUSIVE on
-- outbox_published, which lets the relays' inserts and readers through, where CREATE TABLE
-- ... PARTITION OF would take ACCESS EXCLUSIVE and queue every archive behind the longest
-- reader (PostgreSQL docs, ALTER TABLE, "ATTACH PARTITION"; 5.11.2.2, "Partition
-- Maintenance"). The new table is empty and there is no default partition, so nothing is
-- scanned. lock_timeout bounds the wait behind other DDL; a caller tries again later.
CREATE FUNCTION outbox_published_partitions(days_ahead integer) RETURNS integer
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

-- The relay's Archive mode: moves the acked rows `ids` from outbox_events to
-- outbox_published, stamped now(), creating today's partition first if it is missing.
CREATE FUNCTION outbox_archive_published(ids uuid[]) RETURNS bigint
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

SELECT outbox_published_partitions(2);

COMMENT ON TABLE outbox_published IS
    'Published outbox rows kept by PublishedRows::Archive, in daily partitions dropped whole';
