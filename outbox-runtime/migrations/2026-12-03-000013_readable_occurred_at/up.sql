-- An occurred_at the relay cannot write as ce-time is refused where it is written, not met
-- by the relay's claim, where one such row failed every batch ("Tried to deserialize a
-- timestamp that is too large for Time") and nothing else was published. The column took
-- 'infinity', '-infinity' and the years 4713 BC to 294276; ce-time is a CloudEvents Timestamp,
-- written in RFC 3339 (CloudEvents 1.0, the "time" attribute and the type system), whose years
-- are 0000 to 9999 (RFC 3339, section 5.6, date-fullyear). The unit of work writes now(); only rows inserted by hand could hold one.
-- MySQL's and SQLite's migrations bound the column as well (since 1970).
--
-- The constraint is added NOT VALID in a short transaction of its own (new rows are checked
-- from then on), then validated outside it: VALIDATE CONSTRAINT reads the table holding a
-- SHARE UPDATE EXCLUSIVE lock, which lets units of work insert and relays claim meanwhile,
-- where adding a valid constraint would stop them for the whole read (PostgreSQL docs, ALTER
-- TABLE, "VALIDATE CONSTRAINT"). This migration runs outside diesel's transaction
-- (metadata.toml); a run stopped by a row out of range keeps the constraint NOT VALID, and
-- the next run, once the rows are mended, validates it.
BEGIN;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                   WHERE conrelid = 'outbox_events'::regclass
                     AND conname = 'outbox_events_occurred_at_rfc3339') THEN
        ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_occurred_at_rfc3339
            CHECK (occurred_at >= '0001-01-01 00:00:00+00 BC'
                   AND occurred_at < '10000-01-01 00:00:00+00') NOT VALID;
    END IF;
END
$$;
COMMIT;
DO $$
DECLARE
    found bigint;
    first_id uuid;
    first_at text;
BEGIN
    ALTER TABLE outbox_events VALIDATE CONSTRAINT outbox_events_occurred_at_rfc3339;
EXCEPTION WHEN check_violation THEN
    SELECT count(*) INTO found FROM outbox_events
    WHERE NOT (occurred_at >= '0001-01-01 00:00:00+00 BC'
               AND occurred_at < '10000-01-01 00:00:00+00');
    SELECT id, occurred_at::text INTO first_id, first_at FROM outbox_events
    WHERE NOT (occurred_at >= '0001-01-01 00:00:00+00 BC'
               AND occurred_at < '10000-01-01 00:00:00+00')
    ORDER BY id LIMIT 1;
    RAISE EXCEPTION 'outbox: the outbox_events row % has occurred_at %, outside the years 0000 to 9999 that ce-time is written in (RFC 3339), which the relay cannot publish; set its occurred_at to when the event happened, or delete it, then run the migrations again (rows out of range: %)',
        first_id, first_at, found
        USING ERRCODE = 'check_violation';
END
$$;
