DROP FUNCTION outbox_insert_events;
