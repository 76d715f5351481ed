DROP TABLE outbox_inbox_dead_letters;
DROP TABLE outbox_inbox;
ALTER TABLE outbox_events DROP COLUMN causation_id;
ALTER TABLE outbox_events DROP COLUMN correlation_id;
