-- The transactional outbox: events written in the same transaction as the business rows
-- they describe, published to NATS JetStream by the message relay.
--
-- A row needs only the columns without a default. Whoever inserts it (the unit of work,
-- another service, a hand fix) also owns its aggregate_seq: the next number after the
-- aggregate's highest, which the unit of work keeps in outbox_aggregates.

CREATE TABLE outbox_events (
    -- UUIDv7 from the unit of work (time-ordered, so inserts land at the end of the index).
    -- Also the message's Nats-Msg-Id and ce-id.
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    -- 1, 2, 3, ... per aggregate, contiguous, in commit order.
    aggregate_seq  bigint      NOT NULL CHECK (aggregate_seq > 0),
    event_type     text        NOT NULL,
    event_version  integer     NOT NULL DEFAULT 1 CHECK (event_version > 0),
    partition_key  text        NOT NULL,
    -- The resolved NATS subject, {prefix}.{aggregate_type}.{partition_key}.{event_type} by default.
    subject        text        NOT NULL,
    payload        jsonb       NOT NULL,
    -- Extra message headers: a JSON object of header name to string (or array of strings).
    headers        jsonb       NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(headers) = 'object'),
    occurred_at    timestamptz NOT NULL DEFAULT now(),
    -- Not published before this time: the relay's retry backoff moves it forward.
    available_at   timestamptz NOT NULL DEFAULT now(),
    attempts       integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error     text,
    published_at   timestamptz,
    CONSTRAINT outbox_events_aggregate_seq_key UNIQUE (aggregate_type, aggregate_id, aggregate_seq)
);

-- "Pending rows, oldest first": only pending rows are in this index, so its size, and the
-- cost of the relay's claim, does not grow with the number of published rows kept.
CREATE INDEX outbox_events_pending ON outbox_events (available_at, id)
    WHERE published_at IS NULL;

-- "The pending rows of one aggregate, in sequence": the relay publishes a row only when no
-- earlier row of its aggregate is pending, and finds the rows queued behind a claimed one.
CREATE INDEX outbox_events_pending_by_aggregate
    ON outbox_events (aggregate_type, aggregate_id, aggregate_seq)
    WHERE published_at IS NULL;

-- The last aggregate_seq handed out per aggregate. Its row lock, taken by the unit of work
-- just before COMMIT, serialises concurrent transactions on one aggregate, so sequences are
-- contiguous and in commit order; it also survives published rows being deleted.
CREATE TABLE outbox_aggregates (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

COMMENT ON TABLE outbox_events IS
    'Transactional outbox: events committed with the business rows, published to NATS JetStream by the message relay';
COMMENT ON TABLE outbox_aggregates IS
    'Last outbox_events.aggregate_seq handed out per aggregate (row lock serialises concurrent units of work)';
