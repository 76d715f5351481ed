-- Guarantees at the edges: a unit of work that lost its transaction, the inbox keyed by
-- CloudEvents source and id, each aggregate's position in every consumer, handler attempts
-- counted apart from deliveries, and gaps a consumer applied over.

-- The unit of work opens its transaction with BEGIN; SET LOCAL outbox.unit_of_work = 'on'.
-- A COMMIT or ROLLBACK sent on the unit of work's connection ends that transaction and the
-- setting with it (SET LOCAL lasts until the end of the transaction: PostgreSQL docs, SET);
-- the statements after it run in autocommit, where an event would commit without the
-- business rows it describes (a ghost). Every write of the outbox and the inbox checks the
-- setting first.
CREATE FUNCTION outbox_assert_unit_of_work() RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox.unit_of_work', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'outbox: the unit of work''s transaction was ended inside its closure'
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'Do not send COMMIT or ROLLBACK on the unit of work''s connection; '
                         'return an error from the closure to roll back.';
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox_insert_events(
    text[], text[], int8[],
    text, text, jsonb,
    uuid[], text[], text[], int8[], text[], int4[], text[], text[], text[]
) RETURNS bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    inserted bigint;
BEGIN
    PERFORM outbox_assert_unit_of_work();
    -- An aggregate's new sequences follow its last one: the outbox_aggregates row, locked by
    -- the upsert until COMMIT, or rows inserted by hand above it. The update recovers the
    -- number of new events as excluded.last_seq minus the same max(), read in the same
    -- snapshot: an index probe, where a lookup in the aggregates CTE would scan it per row.
    WITH aggregates AS (
        SELECT * FROM unnest($1, $2, $3) AS a(aggregate_type, aggregate_id, n)
    ), sequences AS (
        INSERT INTO outbox_aggregates AS s (aggregate_type, aggregate_id, last_seq)
        SELECT a.aggregate_type, a.aggregate_id, a.n + coalesce((
            SELECT max(o.aggregate_seq) FROM outbox_events o
            WHERE o.aggregate_type = a.aggregate_type AND o.aggregate_id = a.aggregate_id), 0)
        FROM aggregates a
        ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
            SET last_seq = greatest(s.last_seq + excluded.last_seq - coalesce((
                SELECT max(o.aggregate_seq) FROM outbox_events o
                WHERE o.aggregate_type = excluded.aggregate_type
                  AND o.aggregate_id = excluded.aggregate_id), 0), excluded.last_seq)
        RETURNING s.aggregate_type, s.aggregate_id, s.last_seq, s.blocked_until
    )
    INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                               event_version, partition_key, subject, payload, available_at,
                               correlation_id, causation_id, headers)
    SELECT e.id, e.aggregate_type, e.aggregate_id, s.last_seq - a.n + e.ordinal, e.event_type,
           e.event_version, e.partition_key, e.subject, e.payload::jsonb,
           greatest(now(), s.blocked_until), $4, $5, $6
    FROM unnest($7, $8, $9, $10, $11, $12, $13, $14, $15)
         AS e(id, aggregate_type, aggregate_id, ordinal, event_type, event_version,
              partition_key, subject, payload)
    JOIN aggregates a USING (aggregate_type, aggregate_id)
    JOIN sequences s USING (aggregate_type, aggregate_id);
    GET DIAGNOSTICS inserted = ROW_COUNT;
    RETURN inserted;
END
$$;

-- Every unpublished dead letter, the skipped ones included: a skipped dead letter (the Skip
-- policy, or an operator) can still be retried, so it stays listed.
DROP INDEX outbox_events_dead_letters;
CREATE INDEX outbox_events_dead_letters ON outbox_events (dead_lettered_at)
    WHERE dead_lettered_at IS NOT NULL AND published_at IS NULL;

-- CloudEvents makes source + id unique, not id alone (CloudEvents 1.0, section 3.1.1 "id"):
-- the inbox records both. Messages without ce-source have the empty source.
ALTER TABLE outbox_inbox ADD COLUMN source text COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE outbox_inbox DROP CONSTRAINT outbox_inbox_pkey,
    ADD PRIMARY KEY (consumer, source, message_id);
ALTER TABLE outbox_inbox_dead_letters ADD COLUMN source text COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE outbox_inbox_dead_letters DROP CONSTRAINT outbox_inbox_dead_letters_pkey,
    ADD PRIMARY KEY (consumer, source, message_id);

-- Where each consumer stands in each aggregate: the ce-sequence of the last event it applied
-- (handled, skipped by policy, or dead-lettered in its turn), updated in the transaction that
-- applies the event. A message whose ce-sequence is not the next one waits, so a consumer
-- applies an aggregate's events in order across restarts and instances. Rows are kept for
-- as long as their aggregate may publish (one row per consumer and aggregate).
CREATE TABLE outbox_inbox_positions (
    consumer        text COLLATE "C" NOT NULL,
    source          text COLLATE "C" NOT NULL,
    aggregate_type  text COLLATE "C" NOT NULL,
    aggregate_id    text COLLATE "C" NOT NULL,
    -- 0 before the first event.
    last_seq        bigint NOT NULL CHECK (last_seq >= 0),
    -- The stream sequence of that event's message: a gap is looked up in the stream from here.
    stream_sequence bigint NOT NULL CHECK (stream_sequence >= 0),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, source, aggregate_type, aggregate_id)
);

-- Handler failures per message: only these count toward dead-lettering, not deliveries (a
-- consumer that crashes does not use up a message's attempts).
CREATE TABLE outbox_inbox_attempts (
    consumer   text COLLATE "C" NOT NULL,
    source     text COLLATE "C" NOT NULL,
    message_id text COLLATE "C" NOT NULL,
    failures   integer NOT NULL CHECK (failures > 0),
    last_error text NOT NULL,
    failed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, source, message_id)
);

-- Events a consumer applied over a gap in their aggregate's sequence: the events between
-- after_seq and next_seq were never in the stream for it (skipped on the producer side,
-- removed from the stream), or did not come within the consumer's gap_timeout.
CREATE TABLE outbox_inbox_gaps (
    consumer        text COLLATE "C" NOT NULL,
    source          text COLLATE "C" NOT NULL,
    aggregate_type  text COLLATE "C" NOT NULL,
    aggregate_id    text COLLATE "C" NOT NULL,
    after_seq       bigint NOT NULL,
    next_seq        bigint NOT NULL,
    stream_sequence bigint NOT NULL,
    reason          text NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_inbox_gaps_recorded_at ON outbox_inbox_gaps (consumer, recorded_at);

-- Records that a consumer received a message, and, for an event of an aggregate, moves the
-- consumer's position in that aggregate to it when it is the next one, in the transaction
-- that applies it. Returns whether the message was new, the position before the call, and
-- whether it moved: when it did not, the message is not the next one (an earlier one is
-- missing, or a later one was applied) and the caller rolls back.
--
-- Guarantee: the position row is locked (FOR UPDATE) until the transaction ends, so two
-- instances applying one aggregate's events take turns, and the second reads the first's
-- position once it commits (in READ COMMITTED each statement of the function reads the
-- latest committed rows, and a locked row is read again when its lock is released:
-- PostgreSQL docs, section 13.2.1). The first event of an aggregate the consumer meets is
-- the next one only when its sequence is 1, or when the caller has established that nothing
-- before it will come (p_accept_gap). A position never moves back.
CREATE FUNCTION outbox_inbox_record(
    p_consumer text, p_source text, p_message_id text,
    p_aggregate_type text, p_aggregate_id text, p_seq bigint, p_stream_sequence bigint,
    p_accept_gap boolean,
    OUT recorded boolean, OUT previous_seq bigint, OUT previous_stream_sequence bigint,
    OUT moved boolean)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    INSERT INTO outbox_inbox (consumer, source, message_id)
    VALUES (p_consumer, p_source, p_message_id)
    ON CONFLICT DO NOTHING;
    recorded := FOUND;
    IF NOT recorded OR p_aggregate_type IS NULL THEN
        RETURN;
    END IF;
    -- The aggregate's row, created at "nothing applied" on first sight, then locked.
    INSERT INTO outbox_inbox_positions
        (consumer, source, aggregate_type, aggregate_id, last_seq, stream_sequence)
    VALUES (p_consumer, p_source, p_aggregate_type, p_aggregate_id, 0, 0)
    ON CONFLICT DO NOTHING;
    SELECT p.last_seq, p.stream_sequence INTO previous_seq, previous_stream_sequence
    FROM outbox_inbox_positions p
    WHERE p.consumer = p_consumer AND p.source = p_source
      AND p.aggregate_type = p_aggregate_type AND p.aggregate_id = p_aggregate_id
    FOR UPDATE;
    moved := previous_seq = p_seq - 1 OR (p_accept_gap AND previous_seq < p_seq);
    IF moved THEN
        UPDATE outbox_inbox_positions p
        SET last_seq = p_seq, stream_sequence = p_stream_sequence, updated_at = now()
        WHERE p.consumer = p_consumer AND p.source = p_source
          AND p.aggregate_type = p_aggregate_type AND p.aggregate_id = p_aggregate_id;
    END IF;
END
$$;

-- The end of a handled message's transaction: fails if the handler ended the transaction
-- (see outbox_assert_unit_of_work), and forgets the message's failed attempts.
CREATE FUNCTION outbox_inbox_finish(
    p_consumer text, p_source text, p_message_id text, p_clear_attempts boolean)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM outbox_assert_unit_of_work();
    IF p_clear_attempts THEN
        DELETE FROM outbox_inbox_attempts
        WHERE consumer = p_consumer AND source = p_source AND message_id = p_message_id;
    END IF;
END
$$;

COMMENT ON TABLE outbox_inbox_positions IS
    'Inbox: the last ce-sequence each consumer applied per aggregate (events apply in order)';
COMMENT ON TABLE outbox_inbox_attempts IS
    'Inbox: handler failures per message, which alone count toward dead-lettering';
COMMENT ON TABLE outbox_inbox_gaps IS
    'Inbox: events applied over a gap in their aggregate''s sequence';
