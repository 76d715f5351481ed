-- The other times the toolkit reads back are refused where they are written when it could
-- not read them, as occurred_at and available_at are (migration 000002): a zero date in
-- dead_lettered_at (which MySQL and MariaDB accept unless sql_mode has NO_ZERO_DATE, not in
-- MariaDB's default) failed `outbox dead-letters list` ("Unexpected null for non-null
-- column": TIMESTAMPDIFF gives NULL for it). The relay and the operator's commands write
-- UTC_TIMESTAMP(6); only rows written by hand could hold another. A table that already holds
-- such a time fails this migration, naming the constraint, until the row is mended.
ALTER TABLE outbox_events
    ADD CONSTRAINT outbox_events_published_at_since_1970
        CHECK (published_at >= '1970-01-01 00:00:00'),
    ADD CONSTRAINT outbox_events_dead_lettered_at_since_1970
        CHECK (dead_lettered_at >= '1970-01-01 00:00:00'),
    ADD CONSTRAINT outbox_events_skipped_at_since_1970
        CHECK (skipped_at >= '1970-01-01 00:00:00');
