-- The relay's doorbell: a unit of work notifies only while a relay waits for rows.
--
-- NOTIFY serialises commits: a transaction that notified takes a database-wide lock at
-- COMMIT and holds it until its commit record is flushed, so that notifications reach
-- listeners in commit order (PostgreSQL's src/backend/commands/async.c, PreCommit_Notify).
-- Notifying from every unit of work capped 32 concurrent writers at the rate of one WAL
-- flush after another.
--
-- A relay that found nothing to claim holds the advisory lock (1869968482, 1) exclusively
-- (pg_advisory_lock on its LISTEN connection) before it looks one last time and sleeps.
-- Each inserting transaction tries the same lock in shared mode and keeps it until COMMIT:
--   * the try fails while a relay holds the lock or waits for it: the relay sleeps, or is
--     about to, so the transaction notifies, as every insert did before;
--   * the try succeeds while every relay is busy: no notification, and the relay's
--     exclusive lock waits for this transaction to end, so the look the relay takes once it
--     holds the lock sees this transaction's rows.
-- So no committed row is left without either a notification or a claim that sees it. A
-- busy relay releases the lock; its workers claim again at once after each batch.
CREATE OR REPLACE FUNCTION outbox_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(1869968482, 1) THEN
        PERFORM pg_notify('outbox_events', '');
    END IF;
    RETURN NULL;
END
$$;
