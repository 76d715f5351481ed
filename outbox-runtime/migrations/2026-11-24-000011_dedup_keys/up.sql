-- Producer dedup keys: an event may carry a business idempotency key ("user-created:42").
-- The first unit of work that commits an event with a key takes it here; a later one that
-- emits the same key writes nothing for that event (or fails, by its DuplicateEvents).
--
-- A table of its own, not a column of outbox_events: the key must outlive the outbox row,
-- which the relay deletes or archives once it is published. The primary key is what makes
-- two units of work racing for one key safe: the second waits on the first's uncommitted
-- key, and finds it taken if the first commits (PostgreSQL docs, INSERT, "ON CONFLICT
-- Clause"). Keys are kept until purged, oldest first through the created_at index
-- (outbox_runtime::outbox::purge_dedup_keys, or `outbox purge --dedup-keys-older-than`).
CREATE TABLE outbox_dedup_keys (
    dedup_key text PRIMARY KEY,
    event_id uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_dedup_keys_created_at ON outbox_dedup_keys (created_at);
