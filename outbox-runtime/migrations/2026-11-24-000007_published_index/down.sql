DROP INDEX IF EXISTS outbox_events_published
