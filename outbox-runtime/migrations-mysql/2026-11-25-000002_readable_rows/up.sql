-- Rows the relay cannot read are refused where they are written, not met by the relay's
-- claim (where one unreadable row would stop every batch): an id that is not a UUID in its
-- hyphenated form (the message's Nats-Msg-Id and ce-id), times before 1970 (a zero date
-- among them, which MySQL accepts unless sql_mode has NO_ZERO_DATE), a payload that is not
-- JSON and headers that are not a JSON object (PostgreSQL's json and jsonb columns refuse
-- them too).
ALTER TABLE outbox_events
    ADD CONSTRAINT outbox_events_id_is_a_uuid
        CHECK (id REGEXP '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$'),
    ADD CONSTRAINT outbox_events_occurred_at_since_1970
        CHECK (occurred_at >= '1970-01-01 00:00:00'),
    ADD CONSTRAINT outbox_events_available_at_since_1970
        CHECK (available_at >= '1970-01-01 00:00:00'),
    ADD CONSTRAINT outbox_events_payload_is_json CHECK (JSON_VALID(payload)),
    ADD CONSTRAINT outbox_events_headers_are_an_object
        CHECK (JSON_VALID(headers) AND JSON_TYPE(headers) = 'OBJECT');
