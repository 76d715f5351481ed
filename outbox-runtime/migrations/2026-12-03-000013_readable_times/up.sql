-- The times the toolkit reads back from outbox_events are refused where they are written
-- when it could not read them, rather than met by its readers: one row whose occurred_at was
-- 'infinity' (or a year past 9999) failed every relay batch's claim ("Tried to deserialize a
-- timestamp that is too large for Time"), so nothing else was published, and one whose
-- dead_lettered_at was 'infinity' failed `outbox dead-letters list` ("cannot convert infinity
-- to bigint"). timestamptz takes 'infinity', '-infinity' and the years 4713 BC to 294276;
-- these columns now take RFC 3339's years 0000 to 9999 (section 5.6, date-fullyear), those of
-- ce-time, a CloudEvents Timestamp written in RFC 3339 (CloudEvents 1.0, the "time" attribute
-- and the type system), and of the times the outbox command prints. The unit of work and the
-- relay write now(); only rows written by hand could hold another. available_at is left as
-- it is: 'infinity' there parks a row (migration 000002), and the relay only compares it.
-- MySQL's and SQLite's migrations bound their times too (since 1970).
--
-- Each constraint is added NOT VALID in a short transaction of its own (new rows are checked
-- from then on), then validated outside it: VALIDATE CONSTRAINT reads the table holding a
-- SHARE UPDATE EXCLUSIVE lock, which lets units of work insert and relays claim meanwhile,
-- where adding a valid constraint would stop them for the whole read (PostgreSQL docs, ALTER
-- TABLE, "VALIDATE CONSTRAINT"). This migration runs outside diesel's transaction
-- (metadata.toml); a run stopped by a row out of range keeps the constraints NOT VALID, and
-- the next run, once the rows are mended, validates them.
BEGIN;
DO $$
DECLARE
    col text;
BEGIN
    FOREACH col IN ARRAY ARRAY['occurred_at', 'published_at', 'dead_lettered_at', 'skipped_at'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_constraint
                       WHERE conrelid = 'outbox_events'::regclass
                         AND conname = 'outbox_events_' || col || '_rfc3339') THEN
            EXECUTE format(
                'ALTER TABLE outbox_events ADD CONSTRAINT %I CHECK (%I >= %L AND %I < %L) NOT VALID',
                'outbox_events_' || col || '_rfc3339',
                col, '0001-01-01 00:00:00+00 BC', col, '10000-01-01 00:00:00+00');
        END IF;
    END LOOP;
END
$$;
COMMIT;
DO $$
DECLARE
    col text;
    out_of_range text;
    found bigint;
    first_id uuid;
    first_at text;
BEGIN
    FOREACH col IN ARRAY ARRAY['occurred_at', 'published_at', 'dead_lettered_at', 'skipped_at'] LOOP
        BEGIN
            EXECUTE format('ALTER TABLE outbox_events VALIDATE CONSTRAINT %I',
                           'outbox_events_' || col || '_rfc3339');
        EXCEPTION WHEN check_violation THEN
            out_of_range := format('NOT (%I >= %L AND %I < %L)',
                                   col, '0001-01-01 00:00:00+00 BC', col, '10000-01-01 00:00:00+00');
            EXECUTE 'SELECT count(*) FROM outbox_events WHERE ' || out_of_range INTO found;
            EXECUTE format('SELECT id, %I::text FROM outbox_events WHERE %s ORDER BY id LIMIT 1',
                           col, out_of_range)
                INTO first_id, first_at;
            RAISE EXCEPTION 'outbox: the outbox_events row % has % %, outside the years 0000 to 9999 of RFC 3339, which the relay and the outbox command cannot read; set it to a time within them, or delete the row, then run the migrations again (rows out of range in %: %)',
                first_id, col, first_at, col, found
                USING ERRCODE = 'check_violation';
        END;
    END LOOP;
END
$$;
