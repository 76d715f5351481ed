DROP TABLE outbox_inbox_gaps;
DROP TABLE outbox_inbox_attempts;
DROP TABLE outbox_inbox_positions;
DROP TABLE outbox_inbox_dead_letters;
DROP TABLE outbox_inbox;
