DROP TABLE outbox_aggregates;
DROP TABLE outbox_events;
