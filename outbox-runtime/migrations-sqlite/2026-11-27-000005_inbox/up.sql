-- The inbox of idempotent consumers on SQLite: the same tables and columns as on PostgreSQL
-- (see outbox-runtime/migrations/, 2026-11-21-000003_inbox and 2026-11-23-000005_hardening,
-- for what each means), in SQLite's types. PostgreSQL's two functions (outbox_inbox_record,
-- outbox_inbox_finish) are the inbox's own statements here (outbox-runtime/src/inbox/sqlite.rs),
-- in the BEGIN IMMEDIATE transaction that applies a message: SQLite's single write lock
-- serialises those transactions, which PostgreSQL's row locks do for one aggregate.
--
-- Times are UTC text as in the outbox's tables; text compares byte by byte (BINARY).

CREATE TABLE outbox_inbox (
    consumer   TEXT NOT NULL,
    -- ce-source, or empty.
    source     TEXT NOT NULL DEFAULT '',
    -- The message's ce-id (or Nats-Msg-Id).
    message_id TEXT NOT NULL,
    handled_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (consumer, source, message_id)
) STRICT, WITHOUT ROWID;

-- Retention deletes the oldest rows first.
CREATE INDEX outbox_inbox_handled_at ON outbox_inbox (consumer, handled_at);

CREATE TABLE outbox_inbox_dead_letters (
    consumer         TEXT    NOT NULL,
    source           TEXT    NOT NULL DEFAULT '',
    message_id       TEXT    NOT NULL,
    subject          TEXT    NOT NULL,
    -- The message's headers: a JSON object of name to array of values.
    headers          TEXT    NOT NULL CHECK (json_type(headers) = 'object'),
    payload          BLOB    NOT NULL,
    error            TEXT    NOT NULL,
    deliveries       INTEGER NOT NULL,
    stream_sequence  INTEGER NOT NULL,
    dead_lettered_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (consumer, source, message_id)
) STRICT;

CREATE TABLE outbox_inbox_positions (
    consumer        TEXT    NOT NULL,
    source          TEXT    NOT NULL,
    aggregate_type  TEXT    NOT NULL,
    aggregate_id    TEXT    NOT NULL,
    -- 0 before the first event.
    last_seq        INTEGER NOT NULL CHECK (last_seq >= 0),
    stream_sequence INTEGER NOT NULL CHECK (stream_sequence >= 0),
    updated_at      TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (consumer, source, aggregate_type, aggregate_id)
) STRICT, WITHOUT ROWID;

CREATE TABLE outbox_inbox_attempts (
    consumer   TEXT    NOT NULL,
    source     TEXT    NOT NULL,
    message_id TEXT    NOT NULL,
    failures   INTEGER NOT NULL CHECK (failures > 0),
    last_error TEXT    NOT NULL,
    failed_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (consumer, source, message_id)
) STRICT;

CREATE TABLE outbox_inbox_gaps (
    consumer        TEXT    NOT NULL,
    source          TEXT    NOT NULL,
    aggregate_type  TEXT    NOT NULL,
    aggregate_id    TEXT    NOT NULL,
    after_seq       INTEGER NOT NULL,
    next_seq        INTEGER NOT NULL,
    stream_sequence INTEGER NOT NULL,
    reason          TEXT    NOT NULL,
    recorded_at     TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
) STRICT;
CREATE INDEX outbox_inbox_gaps_recorded_at ON outbox_inbox_gaps (consumer, recorded_at);
