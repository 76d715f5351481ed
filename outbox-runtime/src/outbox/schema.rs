//! Diesel's view of the outbox tables, for queries of your own (lag, admin, tests).
//!
//! The tables are created by [`crate::outbox::run_migrations`]; the SQL in
//! `outbox-runtime/migrations/` is their definition and documents each column.

diesel::table! {
    /// The transactional outbox: one row per event, pending until `published_at` is set.
    outbox_events (id) {
        /// UUIDv7; the message's `Nats-Msg-Id` and `ce-id`.
        id -> Uuid,
        aggregate_type -> Text,
        aggregate_id -> Text,
        /// 1, 2, 3, ... per aggregate, in commit order.
        aggregate_seq -> Int8,
        event_type -> Text,
        event_version -> Int4,
        partition_key -> Text,
        /// The resolved NATS subject.
        subject -> Text,
        payload -> Jsonb,
        /// Extra message headers: a JSON object of name to string or array of strings.
        headers -> Jsonb,
        occurred_at -> Timestamptz,
        available_at -> Timestamptz,
        attempts -> Int4,
        last_error -> Nullable<Text>,
        published_at -> Nullable<Timestamptz>,
        dead_lettered_at -> Nullable<Timestamptz>,
        skipped_at -> Nullable<Timestamptz>,
        /// The conversation; `None` for a row inserted without one (its id stands in).
        correlation_id -> Nullable<Text>,
        /// The message that caused it; `None` as above.
        causation_id -> Nullable<Text>,
    }
}

diesel::table! {
    /// The last `aggregate_seq` handed out per aggregate.
    outbox_aggregates (aggregate_type, aggregate_id) {
        aggregate_type -> Text,
        aggregate_id -> Text,
        last_seq -> Int8,
        blocked_until -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    /// The messages each inbox consumer handled (applied, skipped or dead-lettered).
    outbox_inbox (consumer, source, message_id) {
        consumer -> Text,
        /// `ce-source`; empty for a message without one.
        source -> Text,
        /// `ce-id` (or `Nats-Msg-Id`); `stream-sequence-N` for a message that could not be read.
        message_id -> Text,
        handled_at -> Timestamptz,
    }
}

diesel::table! {
    /// The messages inbox consumers dead-lettered.
    outbox_inbox_dead_letters (consumer, source, message_id) {
        consumer -> Text,
        source -> Text,
        message_id -> Text,
        subject -> Text,
        headers -> Jsonb,
        payload -> Bytea,
        error -> Text,
        deliveries -> Int8,
        stream_sequence -> Int8,
        dead_lettered_at -> Timestamptz,
    }
}

diesel::table! {
    /// Each consumer's position in each aggregate: the last `ce-sequence` it applied.
    outbox_inbox_positions (consumer, source, aggregate_type, aggregate_id) {
        consumer -> Text,
        source -> Text,
        aggregate_type -> Text,
        aggregate_id -> Text,
        /// 0 before the first event.
        last_seq -> Int8,
        /// The stream sequence of that event's message.
        stream_sequence -> Int8,
        updated_at -> Timestamptz,
    }
}

diesel::table! {
    /// Handler failures per message: these alone count toward dead-lettering.
    outbox_inbox_attempts (consumer, source, message_id) {
        consumer -> Text,
        source -> Text,
        message_id -> Text,
        failures -> Int4,
        last_error -> Text,
        failed_at -> Timestamptz,
    }
}

diesel::table! {
    /// Events a consumer applied over a gap in their aggregate's sequence.
    outbox_inbox_gaps (consumer, source, aggregate_type, aggregate_id, recorded_at) {
        consumer -> Text,
        source -> Text,
        aggregate_type -> Text,
        aggregate_id -> Text,
        /// The last sequence applied before the gap.
        after_seq -> Int8,
        /// The sequence applied over it.
        next_seq -> Int8,
        stream_sequence -> Int8,
        reason -> Text,
        recorded_at -> Timestamptz,
    }
}
