ALTER TABLE outbox_events
    DROP CONSTRAINT outbox_events_occurred_at_rfc3339,
    DROP CONSTRAINT outbox_events_published_at_rfc3339,
    DROP CONSTRAINT outbox_events_dead_lettered_at_rfc3339,
    DROP CONSTRAINT outbox_events_skipped_at_rfc3339;
