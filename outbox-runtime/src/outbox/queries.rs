//! Every statement that reads or writes the outbox, and the guarantee each one carries.
//!
//! The ordering and locking guarantees of the whole toolkit live here:
//! - [`insert_events`] hands out `aggregate_seq` under the lock of the aggregate's
//!   `outbox_aggregates` row, held until COMMIT: sequences are contiguous and in commit order.

use diesel::QueryResult;
use diesel::sql_types::{Array, Int4, Int8, Text, Uuid as SqlUuid};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use uuid::Uuid;

/// An event ready to be inserted, its subject resolved and every token checked.
#[derive(Debug)]
pub(crate) struct NewEvent {
    pub id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: &'static str,
    pub event_version: i32,
    pub partition_key: String,
    pub subject: String,
    pub payload: String,
}

/// Writes `events` in one statement, numbering each aggregate's events after its last
/// sequence, in the order given.
///
/// Guarantee: the upsert of `outbox_aggregates` locks each aggregate's row until the
/// transaction ends, so a concurrent unit of work on the same aggregate waits here and then
/// numbers its events after ours: sequences are contiguous and follow commit order. The
/// aggregates are upserted in sorted order, so two units of work touching the same aggregates
/// cannot deadlock on these rows. The `greatest(..)` continues after rows that another writer
/// inserted by hand with a higher sequence.
pub(crate) async fn insert_events(
    conn: &mut AsyncPgConnection,
    events: &[NewEvent],
) -> QueryResult<()> {
    const SQL: &str = "\
        WITH aggregates AS ( \
            SELECT * FROM unnest($1::text[], $2::text[], $3::int8[]) AS a(aggregate_type, aggregate_id, n) \
        ), sequences AS ( \
            INSERT INTO outbox_aggregates AS s (aggregate_type, aggregate_id, last_seq) \
            SELECT a.aggregate_type, a.aggregate_id, a.n + coalesce(( \
                SELECT max(o.aggregate_seq) FROM outbox_events o \
                WHERE o.aggregate_type = a.aggregate_type AND o.aggregate_id = a.aggregate_id), 0) \
            FROM aggregates a \
            ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE \
                SET last_seq = greatest(s.last_seq + (SELECT a.n FROM aggregates a \
                    WHERE a.aggregate_type = excluded.aggregate_type \
                      AND a.aggregate_id = excluded.aggregate_id), excluded.last_seq) \
            RETURNING s.aggregate_type, s.aggregate_id, s.last_seq \
        ) \
        INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                   event_version, partition_key, subject, payload) \
        SELECT e.id, e.aggregate_type, e.aggregate_id, s.last_seq - a.n + e.ordinal, e.event_type, \
               e.event_version, e.partition_key, e.subject, e.payload::jsonb \
        FROM unnest($4::uuid[], $5::text[], $6::text[], $7::int8[], $8::text[], $9::int4[], \
                    $10::text[], $11::text[], $12::text[]) \
             AS e(id, aggregate_type, aggregate_id, ordinal, event_type, event_version, \
                  partition_key, subject, payload) \
        JOIN aggregates a USING (aggregate_type, aggregate_id) \
        JOIN sequences s USING (aggregate_type, aggregate_id)";

    // Per aggregate: how many events, and each event's 1-based position among them.
    let mut aggregates: Vec<(&str, &str, i64)> = Vec::new();
    let mut ordinals = Vec::with_capacity(events.len());
    for event in events {
        let key = (event.aggregate_type.as_str(), event.aggregate_id.as_str());
        let ordinal = match aggregates.iter_mut().find(|(t, i, _)| (*t, *i) == key) {
            Some((_, _, n)) => {
                *n += 1;
                *n
            }
            None => {
                aggregates.push((key.0, key.1, 1));
                1
            }
        };
        ordinals.push(ordinal);
    }
    // Lock order (see above).
    aggregates.sort_unstable();

    diesel::sql_query(SQL)
        .bind::<Array<Text>, _>(aggregates.iter().map(|a| a.0).collect::<Vec<_>>())
        .bind::<Array<Text>, _>(aggregates.iter().map(|a| a.1).collect::<Vec<_>>())
        .bind::<Array<Int8>, _>(aggregates.iter().map(|a| a.2).collect::<Vec<_>>())
        .bind::<Array<SqlUuid>, _>(events.iter().map(|e| e.id).collect::<Vec<_>>())
        .bind::<Array<Text>, _>(column(events, |e| &e.aggregate_type))
        .bind::<Array<Text>, _>(column(events, |e| &e.aggregate_id))
        .bind::<Array<Int8>, _>(ordinals)
        .bind::<Array<Text>, _>(column(events, |e| e.event_type))
        .bind::<Array<Int4>, _>(events.iter().map(|e| e.event_version).collect::<Vec<_>>())
        .bind::<Array<Text>, _>(column(events, |e| &e.partition_key))
        .bind::<Array<Text>, _>(column(events, |e| &e.subject))
        .bind::<Array<Text>, _>(column(events, |e| &e.payload))
        .execute(conn)
        .await?;
    Ok(())
}

fn column<'a>(events: &'a [NewEvent], field: impl Fn(&'a NewEvent) -> &'a str) -> Vec<&'a str> {
    events.iter().map(field).collect()
}
