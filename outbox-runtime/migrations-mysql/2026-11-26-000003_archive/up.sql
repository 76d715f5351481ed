-- The archive (PublishedRows::Archive): the relay moves each acked row, whole, out of
-- outbox_events into outbox_published in its batch's transaction, stamped with the time it
-- was published (UTC). outbox_events keeps only what is queued, so the claim's indexes stay
-- as small as with PublishedRows::Delete (MySQL has no partial index to leave published rows
-- out of them, as PostgreSQL's do), and the history is kept for replays and audits.
--
-- Clustered by (published_at, id): archiving appends at the index's end, and retention
-- (outbox_runtime::mysql::purge_archived, `outbox purge`) deletes the oldest rows from its
-- start, in batches, reading only what it deletes. PostgreSQL keeps one partition per day
-- and drops days whole instead; here rows are deleted one by one, and InnoDB reuses their
-- pages.
CREATE TABLE outbox_published (
    id             CHAR(36) CHARACTER SET ascii NOT NULL,
    aggregate_type VARCHAR(256)  NOT NULL,
    aggregate_id   VARCHAR(256)  NOT NULL,
    aggregate_seq  BIGINT        NOT NULL,
    event_type     VARCHAR(256)  NOT NULL,
    event_version  INT           NOT NULL,
    partition_key  VARCHAR(256)  NOT NULL,
    subject        VARCHAR(1024) NOT NULL,
    payload        LONGTEXT      NOT NULL,
    headers        TEXT          NOT NULL,
    occurred_at    DATETIME(6)   NOT NULL,
    correlation_id VARCHAR(512)  NULL,
    causation_id   VARCHAR(512)  NULL,
    attempts       INT           NOT NULL,
    published_at   DATETIME(6)   NOT NULL,
    PRIMARY KEY (published_at, id),
    -- An aggregate's history, in sequence (replays, audits).
    INDEX outbox_published_aggregate (aggregate_type, aggregate_id, aggregate_seq)
) ENGINE = InnoDB CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
