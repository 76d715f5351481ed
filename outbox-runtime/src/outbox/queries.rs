//! Every statement that reads or writes the outbox, and the guarantee each one carries.
//!
//! The ordering and locking guarantees of the whole toolkit live here:
//! - [`insert_events`] hands out `aggregate_seq` under the lock of the aggregate's
//!   `outbox_aggregates` row, held until COMMIT: sequences are contiguous and in commit order.
//! - [`claim_batch`] claims only a row that heads its aggregate's queue (no pending row of the
//!   same aggregate with a lower sequence), locked with `FOR UPDATE SKIP LOCKED`, plus the
//!   rows queued behind it: however many relays race, one aggregate's rows are published by
//!   one relay at a time, in sequence order.

use diesel::deserialize::{self, FromSql};
use diesel::pg::{Pg, PgValue};
use diesel::sql_types::{Array, Bool, Int4, Int8, Jsonb, Text, Timestamptz, Uuid as SqlUuid};
use diesel::{QueryResult, QueryableByName};
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

/// A pending row claimed by the relay, with what its message needs.
#[derive(Debug, QueryableByName)]
pub(crate) struct ClaimedEvent {
    #[diesel(sql_type = SqlUuid)]
    pub id: Uuid,
    #[diesel(sql_type = Text)]
    pub aggregate_type: String,
    #[diesel(sql_type = Text)]
    pub aggregate_id: String,
    #[diesel(sql_type = Int8)]
    pub aggregate_seq: i64,
    #[diesel(sql_type = Text)]
    pub event_type: String,
    #[diesel(sql_type = Int4)]
    pub event_version: i32,
    #[diesel(sql_type = Text)]
    pub partition_key: String,
    #[diesel(sql_type = Text)]
    pub subject: String,
    #[diesel(sql_type = Jsonb)]
    pub payload: JsonText,
    #[diesel(sql_type = Jsonb)]
    pub headers: serde_json::Value,
    #[diesel(sql_type = Timestamptz)]
    pub occurred_at: time::OffsetDateTime,
    /// Whether `available_at` has passed. A row queued behind a claimed one may still be
    /// waiting (a delayed row); it then stops its aggregate's chain for this batch.
    #[diesel(sql_type = Bool)]
    pub available: bool,
}

/// A `jsonb` value as its JSON text, without parsing it: the relay sends it as it is.
#[derive(Debug)]
pub(crate) struct JsonText(pub Vec<u8>);

impl FromSql<Jsonb, Pg> for JsonText {
    fn from_sql(value: PgValue<'_>) -> deserialize::Result<Self> {
        // jsonb's binary format is a version byte (1) and the JSON text (PostgreSQL docs,
        // "jsonb_send" in src/backend/utils/adt/jsonb.c).
        match value.as_bytes().split_first() {
            Some((1, json)) => Ok(Self(json.to_vec())),
            Some((version, _)) => Err(format!("unsupported jsonb format version {version}").into()),
            None => Err("empty jsonb value".into()),
        }
    }
}

/// Claims up to `heads` pending rows that head their aggregate's queue, each with up to
/// `per_aggregate - 1` rows queued behind it, oldest head first; the rows of one aggregate are
/// returned together and in sequence order.
///
/// Guarantee: a row is claimed only when no row of its aggregate with a lower sequence is
/// pending, and the claimed head is locked (`FOR UPDATE SKIP LOCKED`) until the caller's
/// transaction ends. Another relay skips the locked head, and cannot claim the rows behind
/// it because the head is still pending to it; so one aggregate's rows are published by one
/// relay at a time and in order. The rows behind a head are not locked: nothing else claims
/// them while their head is held.
///
/// Cost: the heads come from `outbox_events_pending`, the lookups from
/// `outbox_events_pending_by_aggregate`; both hold pending rows only, so the cost does not
/// grow with the number of published rows kept.
pub(crate) async fn claim_batch(
    conn: &mut AsyncPgConnection,
    heads: i64,
    per_aggregate: i64,
) -> QueryResult<Vec<ClaimedEvent>> {
    const SQL: &str = "\
        WITH heads AS ( \
            SELECT o.aggregate_type, o.aggregate_id, o.aggregate_seq, o.available_at, o.id \
            FROM outbox_events o \
            WHERE o.published_at IS NULL AND o.available_at <= now() \
              AND NOT EXISTS ( \
                  SELECT 1 FROM outbox_events p \
                  WHERE p.published_at IS NULL \
                    AND p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id \
                    AND p.aggregate_seq < o.aggregate_seq) \
            ORDER BY o.available_at, o.id \
            LIMIT $1 \
            FOR UPDATE SKIP LOCKED \
        ) \
        SELECT e.id, e.aggregate_type, e.aggregate_id, e.aggregate_seq, e.event_type, \
               e.event_version, e.partition_key, e.subject, e.payload, e.headers, e.occurred_at, \
               e.available_at <= now() AS available \
        FROM heads h \
        CROSS JOIN LATERAL ( \
            SELECT * FROM outbox_events e \
            WHERE e.published_at IS NULL \
              AND e.aggregate_type = h.aggregate_type AND e.aggregate_id = h.aggregate_id \
              AND e.aggregate_seq >= h.aggregate_seq \
            ORDER BY e.aggregate_seq \
            LIMIT $2 \
        ) e \
        ORDER BY h.available_at, h.id, e.aggregate_seq";

    diesel::sql_query(SQL)
        .bind::<Int8, _>(heads)
        .bind::<Int8, _>(per_aggregate)
        .load(conn)
        .await
}

/// Marks the rows `ids` published, in one statement.
pub(crate) async fn mark_published(conn: &mut AsyncPgConnection, ids: &[Uuid]) -> QueryResult<()> {
    diesel::sql_query("UPDATE outbox_events SET published_at = now() WHERE id = ANY($1)")
        .bind::<Array<SqlUuid>, _>(ids)
        .execute(conn)
        .await?;
    Ok(())
}

/// Records a publish the broker rejected: one more attempt, the error, and the time before
/// which the row is not claimed again.
pub(crate) async fn record_rejection(
    conn: &mut AsyncPgConnection,
    id: Uuid,
    error: &str,
    retry_after_ms: i64,
) -> QueryResult<()> {
    diesel::sql_query(
        "UPDATE outbox_events \
         SET attempts = attempts + 1, last_error = $2, \
             available_at = now() + $3 * interval '1 millisecond' \
         WHERE id = $1",
    )
    .bind::<SqlUuid, _>(id)
    .bind::<Text, _>(error)
    .bind::<Int8, _>(retry_after_ms)
    .execute(conn)
    .await?;
    Ok(())
}
