-- The consumer side: correlation on every event, and the inbox of idempotent consumers.

-- Which conversation an event belongs to (the id its first event or request carried), and
-- which message caused it. Text, so ids from other producers are kept as they are. A row
-- inserted without them is its own cause: the relay sends its id for both.
ALTER TABLE outbox_events ADD COLUMN correlation_id text;
ALTER TABLE outbox_events ADD COLUMN causation_id text;

-- The messages each consumer has handled: a message is handled in the same transaction
-- that inserts its row here, so a second delivery finds the row and is skipped.
CREATE TABLE outbox_inbox (
    consumer   text COLLATE "C" NOT NULL,
    -- The message's ce-id (or Nats-Msg-Id).
    message_id text COLLATE "C" NOT NULL,
    handled_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Retention deletes the oldest rows first.
CREATE INDEX outbox_inbox_handled_at ON outbox_inbox (consumer, handled_at);

-- Messages a consumer gave up on: the handler failed max_deliver times, or the message could
-- not be decoded. Kept whole, with the error, for an operator.
CREATE TABLE outbox_inbox_dead_letters (
    consumer         text COLLATE "C" NOT NULL,
    message_id       text COLLATE "C" NOT NULL,
    subject          text NOT NULL,
    -- The message's headers: a JSON object of name to array of values.
    headers          jsonb NOT NULL,
    payload          bytea NOT NULL,
    error            text NOT NULL,
    deliveries       bigint NOT NULL,
    stream_sequence  bigint NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

COMMENT ON TABLE outbox_inbox IS
    'Inbox: messages each idempotent consumer handled, recorded in the transaction that handled them';
COMMENT ON TABLE outbox_inbox_dead_letters IS
    'Messages a consumer dead-lettered, with their error, headers and payload';
