ALTER TABLE outbox_events
    DROP CONSTRAINT outbox_events_id_is_a_uuid,
    DROP CONSTRAINT outbox_events_occurred_at_since_1970,
    DROP CONSTRAINT outbox_events_available_at_since_1970,
    DROP CONSTRAINT outbox_events_payload_is_json,
    DROP CONSTRAINT outbox_events_headers_are_an_object;
