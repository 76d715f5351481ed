CREATE OR REPLACE FUNCTION outbox_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(1869968482, 1) THEN
        PERFORM pg_notify('outbox_events', '');
    END IF;
    RETURN NULL;
END
$$;
