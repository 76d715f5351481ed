-- The relay's doorbell, per outbox table: its advisory lock and its channel are keyed by the
-- table's oid (TG_RELID in the trigger; 'outbox_events'::regclass in the relay).
--
-- Advisory locks and notification channels are one name space per database, so with the
-- doorbell of migration 000009 (the lock (1869968482, 1), the channel outbox_events) the
-- outboxes of two schemas in one database shared them: while one schema's relay held the
-- doorbell or was busy, the other schema's relay could not take it, and that schema's units
-- of work notified the first relay, or no one, so the second relay's rows waited for its
-- poll (500 ms by default); and the first was woken by the second's commits.
--
-- During a rolling upgrade, relays of before this migration are not notified (they hold the
-- old lock and listen on the old channel): they find the rows at their poll until replaced.
CREATE OR REPLACE FUNCTION outbox_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(1869968482, TG_RELID::int4) THEN
        PERFORM pg_notify('outbox_events_' || TG_RELID, '');
    END IF;
    RETURN NULL;
END
$$;
