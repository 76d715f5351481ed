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
    /// The messages each inbox consumer handled.
    outbox_inbox (consumer, message_id) {
        consumer -> Text,
        message_id -> Text,
        handled_at -> Timestamptz,
    }
}

diesel::table! {
    /// The messages inbox consumers dead-lettered.
    outbox_inbox_dead_letters (consumer, message_id) {
        consumer -> Text,
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
