DROP TABLE outbox_relay_lease;
DROP TABLE outbox_dedup_keys;
DROP TABLE outbox_aggregates;
DROP TABLE outbox_events;
