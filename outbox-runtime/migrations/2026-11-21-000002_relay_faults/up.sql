-- What a relay that holds in production needs: dead letters, operator skips, parking the
-- rows behind a blocked one, a wake-up on commit, and cheap key comparisons.

-- Aggregate keys are identifiers, not prose: byte order ("C") compares them with memcmp,
-- where the database's default collation calls strcoll for every index comparison the relay
-- and the unit of work make. (The indexes on these columns are rebuilt.)
ALTER TABLE outbox_events
    ALTER COLUMN aggregate_type TYPE text COLLATE "C",
    ALTER COLUMN aggregate_id TYPE text COLLATE "C";
ALTER TABLE outbox_aggregates
    ALTER COLUMN aggregate_type TYPE text COLLATE "C",
    ALTER COLUMN aggregate_id TYPE text COLLATE "C";

-- A row the broker rejected max_attempts times: it stays, with its error, and (a sequenced
-- dead letter) blocks the later rows of its aggregate until an operator retries or skips it.
ALTER TABLE outbox_events ADD COLUMN dead_lettered_at timestamptz;
-- A dead letter an operator chose to drop: never published, no longer blocking.
ALTER TABLE outbox_events ADD COLUMN skipped_at timestamptz;

-- Until when the aggregate's queue is blocked (a rejected row waiting for its retry, or
-- 'infinity' behind a dead letter): rows the unit of work adds meanwhile are parked until
-- then, so the relay's claim never scans them.
ALTER TABLE outbox_aggregates ADD COLUMN blocked_until timestamptz;

-- "Claimable rows, oldest first": queued, not dead-lettered. The claim scans this index
-- only up to now(), so rows parked in the future (behind a blocked row) cost it nothing.
DROP INDEX outbox_events_pending;
CREATE INDEX outbox_events_claimable ON outbox_events (available_at, id)
    WHERE published_at IS NULL AND skipped_at IS NULL AND dead_lettered_at IS NULL;

-- "The queued rows of one aggregate, in sequence" (dead letters included: they block).
DROP INDEX outbox_events_pending_by_aggregate;
CREATE INDEX outbox_events_queued
    ON outbox_events (aggregate_type, aggregate_id, aggregate_seq)
    WHERE published_at IS NULL AND skipped_at IS NULL;

CREATE INDEX outbox_events_dead_letters ON outbox_events (dead_lettered_at)
    WHERE dead_lettered_at IS NOT NULL AND skipped_at IS NULL AND published_at IS NULL;

-- Wakes the relay when rows are inserted: NOTIFY is delivered at COMMIT and dropped on
-- rollback (PostgreSQL docs, NOTIFY), so a relay is woken exactly by committed rows,
-- whoever inserted them. Once per statement: the unit of work inserts in one.
CREATE FUNCTION outbox_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_events', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_events_notify AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_events_notify();
