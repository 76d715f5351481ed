-- The archive (PublishedRows::Archive): the relay moves each acked row, whole, out of
-- outbox_events into outbox_published in its batch's transaction, stamped with the time it
-- was published (UTC text, as every time here). outbox_events keeps only what is queued, and
-- the history is kept for replays and audits.
--
-- Retention (outbox_runtime::sqlite::purge_archived, `outbox purge`) deletes the oldest rows
-- in batches through the index on published_at, reading only what it deletes. PostgreSQL
-- keeps one partition per day and drops days whole instead; SQLite has no partitions.
CREATE TABLE outbox_published (
    id             TEXT    NOT NULL,
    aggregate_type TEXT    NOT NULL,
    aggregate_id   TEXT    NOT NULL,
    aggregate_seq  INTEGER NOT NULL,
    event_type     TEXT    NOT NULL,
    event_version  INTEGER NOT NULL,
    partition_key  TEXT    NOT NULL,
    subject        TEXT    NOT NULL,
    payload        TEXT    NOT NULL,
    headers        TEXT    NOT NULL,
    occurred_at    TEXT    NOT NULL,
    correlation_id TEXT,
    causation_id   TEXT,
    attempts       INTEGER NOT NULL,
    published_at   TEXT    NOT NULL
) STRICT;

-- What was published when: retention's order, and the recent rate (`outbox status`).
CREATE INDEX outbox_published_at ON outbox_published (published_at);
-- An aggregate's history, in sequence (replays, audits).
CREATE INDEX outbox_published_aggregate
    ON outbox_published (aggregate_type, aggregate_id, aggregate_seq);
