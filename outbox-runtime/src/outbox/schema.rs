//! Diesel's view of the outbox tables, for queries of your own (lag, admin, tests).
//!
//! The tables are created by [`crate::outbox::run_migrations`]; the SQL in
//! `outbox-runtime/migrations/` is their definition and documents each column.

diesel::table! {
    /// The transactional outbox: one row per event, pending until `published_at` is set.
    outbox_events (id) {
        /// UUIDv7; the message's `Nats-Msg-Id` and `ce-id`.
        id -> Uuid,
        /// The aggregate type: the subject's second token and `ce-aggregatetype`.
        aggregate_type -> Text,
        /// The aggregate id: `ce-subject`, and the partition key by default.
        aggregate_id -> Text,
        /// 1, 2, 3, ... per aggregate, in commit order.
        aggregate_seq -> Int8,
        /// The event type name: the subject's last token and `ce-type`.
        event_type -> Text,
        /// The payload schema version, 1 or more: `ce-eventversion`.
        event_version -> Int4,
        /// The subject's third token: the aggregate id, or the `#[event(partition_key)]` field.
        partition_key -> Text,
        /// The resolved NATS subject.
        subject -> Text,
        /// The event's JSON, as the producer wrote it: `json`, so what is published is the
        /// same bytes.
        payload -> Json,
        /// Extra message headers: a JSON object of name to string or array of strings.
        headers -> Jsonb,
        /// When the unit of work recorded it: `ce-time`. Like every time of this table but
        /// `available_at`, checked to lie in RFC 3339's years 0000 to 9999
        /// (`outbox_events_occurred_at_rfc3339`, migration 000013).
        occurred_at -> Timestamptz,
        /// Not published before this time: the relay's retry backoff moves it forward.
        available_at -> Timestamptz,
        /// Rejections by the broker so far.
        attempts -> Int4,
        /// The last rejection's reason; `None` before any.
        last_error -> Nullable<Text>,
        /// When JetStream acked it (rows kept with `PublishedRows::Mark`); `None` while queued.
        published_at -> Nullable<Timestamptz>,
        /// When it became a dead letter; `None` otherwise.
        dead_lettered_at -> Nullable<Timestamptz>,
        /// When a dead letter was skipped (by policy or an operator); `None` otherwise.
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
        /// The aggregate type.
        aggregate_type -> Text,
        /// The aggregate id.
        aggregate_id -> Text,
        /// The last `aggregate_seq` handed out.
        last_seq -> Int8,
        /// Until when the aggregate's queue is blocked (a rejected row waiting for its retry, or `infinity` behind a dead letter); `None` when it flows.
        blocked_until -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    /// The messages each inbox consumer handled (applied, skipped or dead-lettered).
    outbox_inbox (consumer, source, message_id) {
        /// The consumer's name.
        consumer -> Text,
        /// `ce-source`; empty for a message without one.
        source -> Text,
        /// `ce-id` (or `Nats-Msg-Id`); `stream-sequence-N` for a message that could not be read.
        message_id -> Text,
        /// When it was handled: retention deletes by it.
        handled_at -> Timestamptz,
    }
}

diesel::table! {
    /// The messages inbox consumers dead-lettered.
    outbox_inbox_dead_letters (consumer, source, message_id) {
        /// The consumer's name.
        consumer -> Text,
        /// `ce-source`; empty for a message without one.
        source -> Text,
        /// `ce-id` (or `Nats-Msg-Id`); `stream-sequence-N` for a message that could not be read.
        message_id -> Text,
        /// The message's subject.
        subject -> Text,
        /// The message's headers, as a JSON object of name to array of values.
        headers -> Jsonb,
        /// The message's payload, as received.
        payload -> Bytea,
        /// Why it was dead-lettered: the handler's last error, or what could not be read.
        error -> Text,
        /// JetStream's delivery count at the end.
        deliveries -> Int8,
        /// The message's stream sequence.
        stream_sequence -> Int8,
        /// When it was dead-lettered.
        dead_lettered_at -> Timestamptz,
    }
}

diesel::table! {
    /// Each consumer's position in each aggregate: the last `ce-sequence` it applied.
    outbox_inbox_positions (consumer, source, aggregate_type, aggregate_id) {
        /// The consumer's name.
        consumer -> Text,
        /// `ce-source` of the producer.
        source -> Text,
        /// The aggregate type.
        aggregate_type -> Text,
        /// The aggregate id.
        aggregate_id -> Text,
        /// 0 before the first event.
        last_seq -> Int8,
        /// The stream sequence of that event's message.
        stream_sequence -> Int8,
        /// When the position last moved.
        updated_at -> Timestamptz,
    }
}

diesel::table! {
    /// Handler failures per message: these alone count toward dead-lettering.
    outbox_inbox_attempts (consumer, source, message_id) {
        /// The consumer's name.
        consumer -> Text,
        /// `ce-source`; empty for a message without one.
        source -> Text,
        /// `ce-id` (or `Nats-Msg-Id`).
        message_id -> Text,
        /// Handler failures (errors or panics) so far.
        failures -> Int4,
        /// The last failure's text.
        last_error -> Text,
        /// When it last failed.
        failed_at -> Timestamptz,
    }
}

diesel::table! {
    /// Events a consumer applied over a gap in their aggregate's sequence.
    outbox_inbox_gaps (consumer, source, aggregate_type, aggregate_id, recorded_at) {
        /// The consumer's name.
        consumer -> Text,
        /// `ce-source` of the producer.
        source -> Text,
        /// The aggregate type.
        aggregate_type -> Text,
        /// The aggregate id.
        aggregate_id -> Text,
        /// The last sequence applied before the gap.
        after_seq -> Int8,
        /// The sequence applied over it.
        next_seq -> Int8,
        /// The stream sequence of the event applied over the gap.
        stream_sequence -> Int8,
        /// Why the missing events were given up (not in the stream, or waited past `gap_timeout`).
        reason -> Text,
        /// When the gap was recorded.
        recorded_at -> Timestamptz,
    }
}

diesel::table! {
    /// The producers' dedup keys taken by committed events (`#[event(dedup_key)]`).
    outbox_dedup_keys (dedup_key) {
        /// The key, as the event gave it.
        dedup_key -> Text,
        /// The id of the event that took it.
        event_id -> Uuid,
        /// When it was taken.
        created_at -> Timestamptz,
    }
}
