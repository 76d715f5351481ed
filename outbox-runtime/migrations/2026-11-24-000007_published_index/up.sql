-- The rows PublishedRows::Mark keeps, by the time they were published: retention
-- (outbox::purge_published) reads only the rows it deletes, oldest first, instead of the
-- primary key from its oldest end, and "published in the last minute" reads only those.
-- Empty under PublishedRows::Delete and Archive, so it costs them nothing.
--
-- Built CONCURRENTLY, so that an upgrade does not stop the units of work while it reads a
-- table of millions of kept rows: this migration runs outside a transaction
-- (metadata.toml), as one statement. A build that was interrupted leaves an invalid index,
-- which PostgreSQL does not use: drop it and run the migrations again (PostgreSQL docs,
-- CREATE INDEX, "Building Indexes Concurrently").
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_published
    ON outbox_events (published_at) WHERE published_at IS NOT NULL
