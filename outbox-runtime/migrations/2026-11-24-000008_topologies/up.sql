-- Where each writer and relay of this outbox says its events go: one row per role and subject
-- prefix, refreshed by every process that uses it (at start-up, then hourly). A relay
-- publishes only the rows under its own prefix and dead-letters the rest, so a unit of work
-- writing under another prefix than the relay's is a configuration mistake: each side
-- reports the other's differing prefixes when it registers (outbox_register_topology).
CREATE TABLE outbox_topologies (
    -- 'outbox' (units of work write under the prefix) or 'relay' (publishes it).
    role TEXT NOT NULL CHECK (role IN ('outbox', 'relay')),
    subject_prefix TEXT NOT NULL,
    -- The stream the process names in its topology, as last registered.
    stream TEXT NOT NULL,
    seen_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (role, subject_prefix)
);

-- Registers (role, prefix, stream) as seen now and returns the rows of the other role, seen in
-- the last day, whose prefix differs: what the caller reports. A process that stopped more
-- than a day ago no longer counts; rows unseen for 30 days are deleted.
CREATE FUNCTION outbox_register_topology(p_role TEXT, p_prefix TEXT, p_stream TEXT)
RETURNS TABLE (role TEXT, subject_prefix TEXT, stream TEXT, seen_at TIMESTAMPTZ)
LANGUAGE sql AS $$
    WITH registered AS (
        INSERT INTO outbox_topologies (role, subject_prefix, stream, seen_at)
        VALUES (p_role, p_prefix, p_stream, now())
        ON CONFLICT ON CONSTRAINT outbox_topologies_pkey
            DO UPDATE SET stream = EXCLUDED.stream, seen_at = EXCLUDED.seen_at
    ), pruned AS (
        DELETE FROM outbox_topologies t WHERE t.seen_at < now() - interval '30 days'
    )
    SELECT t.role, t.subject_prefix, t.stream, t.seen_at
    FROM outbox_topologies t
    WHERE t.role <> p_role
      AND t.subject_prefix <> p_prefix
      AND t.seen_at > now() - interval '1 day'
    ORDER BY t.seen_at DESC
$$;
