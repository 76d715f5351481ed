-- The transactional outbox on SQLite 3.37+ (RETURNING, STRICT tables): the same tables and
-- columns as on PostgreSQL, in SQLite's types, which STRICT enforces (a text in an INTEGER
-- column is refused, not stored). See outbox-runtime/migrations/ for what each column means.
--
-- Times are UTC text, 'YYYY-MM-DD HH:MM:SS.SSS' (SQLite's strftime('%Y-%m-%d %H:%M:%f')),
-- so that they compare as text; the CHECKs refuse any other shape, which would compare
-- wrongly. Text compares byte by byte (SQLite's BINARY collation): aggregate ids that differ
-- only in case are different aggregates, as on PostgreSQL.

CREATE TABLE outbox_events (
    -- UUIDv7 text from the unit of work; a row inserted by hand gets a random (v4) one.
    -- Also the message's Nats-Msg-Id and ce-id.
    id               TEXT    NOT NULL PRIMARY KEY DEFAULT (lower(
                         hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-4' ||
                         substr(hex(randomblob(2)), 2) || '-' ||
                         substr('89ab', 1 + (abs(random()) % 4), 1) ||
                         substr(hex(randomblob(2)), 2) || '-' || hex(randomblob(6))))
                     -- A UUID in its hyphenated form: the relay could not read another.
                     CONSTRAINT outbox_events_id_is_a_uuid CHECK (
                         length(id) = 36 AND id NOT GLOB '*[^0-9a-fA-F-]*'
                         AND substr(id, 9, 1) = '-' AND substr(id, 14, 1) = '-'
                         AND substr(id, 19, 1) = '-' AND substr(id, 24, 1) = '-'),
    aggregate_type   TEXT    NOT NULL,
    aggregate_id     TEXT    NOT NULL,
    aggregate_seq    INTEGER NOT NULL CHECK (aggregate_seq > 0),
    event_type       TEXT    NOT NULL,
    event_version    INTEGER NOT NULL DEFAULT 1 CHECK (event_version > 0),
    partition_key    TEXT    NOT NULL,
    subject          TEXT    NOT NULL,
    -- The producer's JSON bytes, kept as written.
    payload          TEXT    NOT NULL CHECK (json_valid(payload)),
    -- Extra message headers: a JSON object of header name to string (or array of strings).
    headers          TEXT    NOT NULL DEFAULT '{}' CHECK (json_type(headers) = 'object'),
    occurred_at      TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
                             CONSTRAINT outbox_events_occurred_at_is_a_time CHECK (
                                 occurred_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
                                 AND julianday(occurred_at) IS NOT NULL
                                 AND occurred_at >= '1970-01-01'),
    available_at     TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
                             CONSTRAINT outbox_events_available_at_is_a_time CHECK (
                                 available_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
                                 AND julianday(available_at) IS NOT NULL),
    attempts         INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error       TEXT,
    published_at     TEXT,
    dead_lettered_at TEXT,
    skipped_at       TEXT,
    correlation_id   TEXT,
    causation_id     TEXT,
    CONSTRAINT outbox_events_aggregate_seq_key UNIQUE (aggregate_type, aggregate_id, aggregate_seq)
) STRICT;

-- The relay's window of the oldest claimable rows (partial: its size does not grow with the
-- published rows kept by PublishedRows::Mark).
CREATE INDEX outbox_events_claimable ON outbox_events (available_at, id)
    WHERE published_at IS NULL AND skipped_at IS NULL AND dead_lettered_at IS NULL;

-- Each aggregate's queued rows in sequence: the relay's heads and the rows behind them.
CREATE INDEX outbox_events_queued ON outbox_events (aggregate_type, aggregate_id, aggregate_seq)
    WHERE published_at IS NULL AND skipped_at IS NULL;

-- The last aggregate_seq handed out per aggregate (it survives published rows being
-- deleted). blocked_until parks the new rows of an aggregate whose head the broker rejected.
CREATE TABLE outbox_aggregates (
    aggregate_type TEXT    NOT NULL,
    aggregate_id   TEXT    NOT NULL,
    last_seq       INTEGER NOT NULL,
    blocked_until  TEXT,
    PRIMARY KEY (aggregate_type, aggregate_id)
) STRICT;

-- Producer dedup keys (#[event(dedup_key)]), byte-exact.
CREATE TABLE outbox_dedup_keys (
    dedup_key  TEXT NOT NULL PRIMARY KEY,
    event_id   TEXT NOT NULL,
    created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
) STRICT;
CREATE INDEX outbox_dedup_keys_created_at ON outbox_dedup_keys (created_at);

-- The relay's lease: one relay publishes a database file's rows at a time. It renews the
-- lease at each claim; another relay takes over once it has expired.
CREATE TABLE outbox_relay_lease (
    name       TEXT NOT NULL PRIMARY KEY,
    owner      TEXT NOT NULL,
    expires_at TEXT NOT NULL
) STRICT;
