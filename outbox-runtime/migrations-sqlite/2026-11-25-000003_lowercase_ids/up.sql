-- Row ids in lower case, whoever writes them. The relay and the operator's functions find a
-- row by its id as a UUID prints (lower case); SQLite compares text byte by byte, so a row
-- inserted by hand with an upper- or mixed-case id would be published and never found again
-- to be deleted: published at every batch, its aggregate stuck behind it. (PostgreSQL stores
-- a uuid; MySQL's id column compares without case.) Rows written before this migration are
-- lowered here; triggers lower those written after it. An id that only differs in case from
-- another row's is the same UUID: its row is refused by the primary key.
UPDATE outbox_events SET id = lower(id) WHERE id <> lower(id);

CREATE TRIGGER outbox_events_id_lowered_on_insert AFTER INSERT ON outbox_events
WHEN NEW.id <> lower(NEW.id)
BEGIN
    UPDATE outbox_events SET id = lower(NEW.id) WHERE id = NEW.id;
END;

CREATE TRIGGER outbox_events_id_lowered_on_update AFTER UPDATE OF id ON outbox_events
WHEN NEW.id <> lower(NEW.id)
BEGIN
    UPDATE outbox_events SET id = lower(NEW.id) WHERE id = NEW.id;
END;
