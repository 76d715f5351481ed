DROP TABLE outbox_dedup_keys;
