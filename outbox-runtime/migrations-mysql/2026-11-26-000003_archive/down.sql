DROP TABLE outbox_published;
