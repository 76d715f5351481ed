DROP TRIGGER outbox_events_notify ON outbox_events;
DROP FUNCTION outbox_events_notify();
DROP INDEX outbox_events_dead_letters;
DROP INDEX outbox_events_queued;
DROP INDEX outbox_events_claimable;
CREATE INDEX outbox_events_pending ON outbox_events (available_at, id) WHERE published_at IS NULL;
CREATE INDEX outbox_events_pending_by_aggregate
    ON outbox_events (aggregate_type, aggregate_id, aggregate_seq) WHERE published_at IS NULL;
ALTER TABLE outbox_aggregates DROP COLUMN blocked_until;
ALTER TABLE outbox_events DROP COLUMN skipped_at;
ALTER TABLE outbox_events DROP COLUMN dead_lettered_at;
ALTER TABLE outbox_aggregates
    ALTER COLUMN aggregate_type TYPE text COLLATE "default",
    ALTER COLUMN aggregate_id TYPE text COLLATE "default";
ALTER TABLE outbox_events
    ALTER COLUMN aggregate_type TYPE text COLLATE "default",
    ALTER COLUMN aggregate_id TYPE text COLLATE "default";
