DROP INDEX outbox_events_published;
