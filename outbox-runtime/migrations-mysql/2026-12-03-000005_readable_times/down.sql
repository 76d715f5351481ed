ALTER TABLE outbox_events
    DROP CONSTRAINT outbox_events_published_at_since_1970,
    DROP CONSTRAINT outbox_events_dead_lettered_at_since_1970,
    DROP CONSTRAINT outbox_events_skipped_at_since_1970;
