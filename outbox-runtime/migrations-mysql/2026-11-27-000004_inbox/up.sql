-- The inbox of idempotent consumers on MySQL 8 and MariaDB 10.6+: the same tables and
-- columns as on PostgreSQL (see outbox-runtime/migrations/, 2026-11-21-000003_inbox and
-- 2026-11-23-000005_hardening, for what each means), in MySQL's types. PostgreSQL's two
-- functions (outbox_inbox_record, outbox_inbox_finish) are the inbox's own statements here
-- (outbox-runtime/src/inbox/mysql.rs), in the transaction that applies a message.
--
-- The keys are byte strings compared byte by byte, as PostgreSQL's COLLATE "C" (utf8mb4_bin
-- ignores trailing spaces in MySQL 8: "k" and "k " would be one message). Their limits are
-- the inbox's: a consumer name 255 bytes (nats-server's), an id, source, aggregate type or
-- aggregate id 512 (outbox_runtime::MAX_ID_BYTES), so each primary key stays under InnoDB's
-- 3,072 bytes. Times are UTC, DATETIME(6), as in the outbox's tables.

CREATE TABLE outbox_inbox (
    consumer   VARBINARY(255) NOT NULL,
    -- ce-source, or empty.
    source     VARBINARY(512) NOT NULL DEFAULT '',
    -- The message's ce-id (or Nats-Msg-Id).
    message_id VARBINARY(512) NOT NULL,
    handled_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, source, message_id),
    -- Retention deletes the oldest rows first.
    INDEX outbox_inbox_handled_at (consumer, handled_at)
) ENGINE = InnoDB;

CREATE TABLE outbox_inbox_dead_letters (
    consumer         VARBINARY(255) NOT NULL,
    source           VARBINARY(512) NOT NULL DEFAULT '',
    message_id       VARBINARY(512) NOT NULL,
    subject          LONGTEXT       NOT NULL,
    -- The message's headers: a JSON object of name to array of values.
    headers          LONGTEXT       NOT NULL CHECK (JSON_VALID(headers)),
    payload          LONGBLOB       NOT NULL,
    error            LONGTEXT       NOT NULL,
    deliveries       BIGINT         NOT NULL,
    stream_sequence  BIGINT         NOT NULL,
    dead_lettered_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, source, message_id)
) ENGINE = InnoDB CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;

CREATE TABLE outbox_inbox_positions (
    consumer        VARBINARY(255) NOT NULL,
    source          VARBINARY(512) NOT NULL,
    aggregate_type  VARBINARY(512) NOT NULL,
    aggregate_id    VARBINARY(512) NOT NULL,
    -- 0 before the first event.
    last_seq        BIGINT         NOT NULL CHECK (last_seq >= 0),
    stream_sequence BIGINT         NOT NULL CHECK (stream_sequence >= 0),
    updated_at      DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, source, aggregate_type, aggregate_id)
) ENGINE = InnoDB;

CREATE TABLE outbox_inbox_attempts (
    consumer   VARBINARY(255) NOT NULL,
    source     VARBINARY(512) NOT NULL,
    message_id VARBINARY(512) NOT NULL,
    failures   INT            NOT NULL CHECK (failures > 0),
    last_error LONGTEXT       NOT NULL,
    failed_at  DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, source, message_id)
) ENGINE = InnoDB CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;

CREATE TABLE outbox_inbox_gaps (
    id              BIGINT         NOT NULL AUTO_INCREMENT PRIMARY KEY,
    consumer        VARBINARY(255) NOT NULL,
    source          VARBINARY(512) NOT NULL,
    aggregate_type  VARBINARY(512) NOT NULL,
    aggregate_id    VARBINARY(512) NOT NULL,
    after_seq       BIGINT         NOT NULL,
    next_seq        BIGINT         NOT NULL,
    stream_sequence BIGINT         NOT NULL,
    reason          LONGTEXT       NOT NULL,
    recorded_at     DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    INDEX outbox_inbox_gaps_recorded_at (consumer, recorded_at)
) ENGINE = InnoDB CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
