-- The transactional outbox on MySQL 8 and MariaDB 10.6+ (both have FOR UPDATE SKIP LOCKED):
-- the same tables and columns as on PostgreSQL, in MySQL's types. See
-- outbox-runtime/migrations/ for what each column means.
--
-- Text columns are utf8mb4 with a binary collation: aggregate ids that differ only in case
-- or accents are different aggregates, as on PostgreSQL. Identifiers hold the toolkit's
-- limits: a subject token 256 bytes, an id or dedup key 512, a subject 1,024. Times are
-- UTC (every statement of the toolkit writes UTC_TIMESTAMP(6); so do the defaults).

CREATE TABLE outbox_events (
    -- UUIDv7 text from the unit of work (a row inserted by hand gets UUID()); also the
    -- message's Nats-Msg-Id and ce-id.
    id               CHAR(36) CHARACTER SET ascii NOT NULL DEFAULT (UUID()) PRIMARY KEY,
    aggregate_type   VARCHAR(256) NOT NULL,
    aggregate_id     VARCHAR(256) NOT NULL,
    aggregate_seq    BIGINT       NOT NULL CHECK (aggregate_seq > 0),
    event_type       VARCHAR(256) NOT NULL,
    event_version    INT          NOT NULL DEFAULT 1 CHECK (event_version > 0),
    partition_key    VARCHAR(256) NOT NULL,
    subject          VARCHAR(1024) NOT NULL,
    -- The producer's JSON bytes, kept as written (MySQL's JSON type would reorder keys).
    payload          LONGTEXT     NOT NULL,
    -- Extra message headers: a JSON object of header name to string (or array of strings).
    headers          TEXT         NOT NULL DEFAULT ('{}'),
    occurred_at      DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    available_at     DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    attempts         INT          NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error       TEXT         NULL,
    published_at     DATETIME(6)  NULL,
    dead_lettered_at DATETIME(6)  NULL,
    skipped_at       DATETIME(6)  NULL,
    correlation_id   VARCHAR(512) NULL,
    causation_id     VARCHAR(512) NULL,
    CONSTRAINT outbox_events_aggregate_seq_key UNIQUE (aggregate_type, aggregate_id, aggregate_seq),
    -- The relay's window of the oldest claimable rows.
    INDEX outbox_events_claimable (available_at, id)
) ENGINE = InnoDB CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;

-- The last aggregate_seq handed out per aggregate; its row lock, taken by the unit of work
-- before it numbers its events, serialises concurrent units of work on one aggregate.
-- blocked_until parks the new rows of an aggregate whose head the broker rejected.
CREATE TABLE outbox_aggregates (
    aggregate_type VARCHAR(256) NOT NULL,
    aggregate_id   VARCHAR(256) NOT NULL,
    last_seq       BIGINT       NOT NULL,
    blocked_until  DATETIME(6)  NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
) ENGINE = InnoDB CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;

-- Producer dedup keys (#[event(dedup_key)]): byte-exact, so "k" and "k " are two keys.
CREATE TABLE outbox_dedup_keys (
    dedup_key  VARBINARY(512) NOT NULL PRIMARY KEY,
    event_id   CHAR(36) CHARACTER SET ascii NOT NULL,
    created_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    INDEX outbox_dedup_keys_created_at (created_at)
) ENGINE = InnoDB;
