-- Published rows by when they were published (PublishedRows::Mark keeps them), for the purge
-- (outbox_runtime::outbox::purge_published, `outbox purge`): it reads only the rows it
-- deletes, oldest first. Partial: a queued row is not in it, so the unit of work's insert
-- and the relay's delete (PublishedRows::Delete, the default) do not maintain it.
CREATE INDEX outbox_events_published ON outbox_events (published_at)
    WHERE published_at IS NOT NULL;
