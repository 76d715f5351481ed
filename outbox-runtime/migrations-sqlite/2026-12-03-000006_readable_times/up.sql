-- The other times the toolkit reads back are refused where they are written when it could
-- not read them, as occurred_at and available_at are (migration 000001): a dead_lettered_at
-- that is not a time failed `outbox dead-letters list` (julianday gives NULL for it). The
-- relay and the operator's commands write strftime('%Y-%m-%d %H:%M:%f', 'now'); only rows
-- written by hand could hold another. SQLite adds no CHECK to an existing table, so triggers
-- refuse such a write (RAISE(ABORT), which rolls back the statement: SQLite docs, "CREATE
-- TRIGGER", "The RAISE() function").
--
-- A table that already holds such a time fails this migration: the check table below
-- refuses a count above zero, and its error names the constraint, which says what to mend.
CREATE TEMP TABLE outbox_migration_000006 (
    unreadable INTEGER
        CONSTRAINT "outbox_events holds a published_at, dead_lettered_at or skipped_at that is not a UTC time from 1970 (YYYY-MM-DD HH:MM:SS); set it to one, or delete the row, then run the migrations again"
        CHECK (unreadable = 0)
);
INSERT INTO outbox_migration_000006
SELECT count(*) FROM outbox_events
WHERE NOT ((published_at IS NULL OR (published_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
            AND julianday(published_at) IS NOT NULL AND published_at >= '1970-01-01'))
        AND (dead_lettered_at IS NULL OR (dead_lettered_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
            AND julianday(dead_lettered_at) IS NOT NULL AND dead_lettered_at >= '1970-01-01'))
        AND (skipped_at IS NULL OR (skipped_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
            AND julianday(skipped_at) IS NOT NULL AND skipped_at >= '1970-01-01')));
DROP TABLE outbox_migration_000006;

CREATE TRIGGER outbox_events_states_are_times_on_insert BEFORE INSERT ON outbox_events
WHEN NOT ((NEW.published_at IS NULL OR (NEW.published_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
            AND julianday(NEW.published_at) IS NOT NULL AND NEW.published_at >= '1970-01-01'))
        AND (NEW.dead_lettered_at IS NULL OR (NEW.dead_lettered_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
            AND julianday(NEW.dead_lettered_at) IS NOT NULL AND NEW.dead_lettered_at >= '1970-01-01'))
        AND (NEW.skipped_at IS NULL OR (NEW.skipped_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
            AND julianday(NEW.skipped_at) IS NOT NULL AND NEW.skipped_at >= '1970-01-01')))
BEGIN
    SELECT RAISE(ABORT, 'outbox_events_states_are_times: published_at, dead_lettered_at and skipped_at are UTC times from 1970, YYYY-MM-DD HH:MM:SS[.SSS], as strftime(''%Y-%m-%d %H:%M:%f'') writes them');
END;

CREATE TRIGGER outbox_events_states_are_times_on_update
BEFORE UPDATE OF published_at, dead_lettered_at, skipped_at ON outbox_events
WHEN NOT ((NEW.published_at IS NULL OR (NEW.published_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
            AND julianday(NEW.published_at) IS NOT NULL AND NEW.published_at >= '1970-01-01'))
        AND (NEW.dead_lettered_at IS NULL OR (NEW.dead_lettered_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
            AND julianday(NEW.dead_lettered_at) IS NOT NULL AND NEW.dead_lettered_at >= '1970-01-01'))
        AND (NEW.skipped_at IS NULL OR (NEW.skipped_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
            AND julianday(NEW.skipped_at) IS NOT NULL AND NEW.skipped_at >= '1970-01-01')))
BEGIN
    SELECT RAISE(ABORT, 'outbox_events_states_are_times: published_at, dead_lettered_at and skipped_at are UTC times from 1970, YYYY-MM-DD HH:MM:SS[.SSS], as strftime(''%Y-%m-%d %H:%M:%f'') writes them');
END;
