//! Every statement that reads or writes the outbox, and the guarantee each one carries.
//!
//! The ordering and locking guarantees of the whole toolkit live here:
//! - [`insert_events`] hands out `aggregate_seq` under the lock of the aggregate's
//!   `outbox_aggregates` row, held until COMMIT: sequences are contiguous and in commit order.
//! - [`claim_batch`] claims only a row that heads its aggregate's queue (no queued row of the
//!   same aggregate with a lower sequence), locked with `FOR UPDATE SKIP LOCKED`, plus the
//!   rows queued behind it: however many relays race, one aggregate's rows are published by
//!   one relay at a time, in sequence order.
//! - [`record_rejection`] keeps a rejected row, and the rows behind it, from overtaking: they
//!   are parked until the row's retry, or for good behind a dead letter.
//!
//! A row is *queued* from insert until it is published or skipped (`published_at IS NULL AND
//! skipped_at IS NULL`); a queued row is *claimable* unless it is a dead letter or parked
//! (`available_at` in the future).

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use diesel::QueryableByName;
use diesel::sql_types::{Bool, Int4, Text};
use uuid::Uuid;

// PostgreSQL's statements, and its binary `json` and `jsonb`.
#[cfg(feature = "postgres")]
use {
    super::statement::{ArrayBind, statement},
    crate::causality::Causality,
    diesel::QueryResult,
    diesel::deserialize::{self, FromSql},
    diesel::pg::{Pg, PgValue},
    diesel::sql_types::{Array, Int8, Json, Jsonb, Nullable, Timestamptz, Uuid as SqlUuid},
    diesel_async::{AsyncPgConnection, RunQueryDsl},
};

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
    /// The producer's idempotency key, `#[event(dedup_key)]`.
    pub dedup_key: Option<String>,
}

/// Writes `events` in one statement, numbering each aggregate's events after its last
/// sequence, in the order given.
///
/// Guarantee: the upsert of `outbox_aggregates` locks each aggregate's row until the
/// transaction ends, so a concurrent unit of work on the same aggregate waits here and then
/// numbers its events after ours: sequences are contiguous and follow commit order. The
/// aggregates are upserted in sorted order, so two units of work touching the same aggregates
/// cannot deadlock on these rows. The `greatest(..)` continues after rows that another writer
/// inserted by hand with a higher sequence. Rows of an aggregate whose queue is blocked (see
/// [`record_rejection`]) are parked until `blocked_until`.
#[cfg(feature = "postgres")]
pub(crate) async fn insert_events(
    conn: &mut AsyncPgConnection,
    events: &[NewEvent],
    causality: &Causality,
) -> QueryResult<()> {
    let headers = causality.headers_json();
    insert_statement(events, causality, &headers)
        .execute(conn)
        .await?;
    Ok(())
}

/// [`insert_events`] and COMMIT in one round trip, for any connection: the statement's
/// [`InsertEvents::with_commit`]; `None` for no events, more than [`MAX_EVENTS_AT_COMMIT`], or
/// a value no constant can hold.
#[cfg(feature = "postgres")]
pub(crate) fn insert_and_commit(events: &[NewEvent], causality: &Causality) -> Option<String> {
    if events.is_empty() || events.len() > MAX_EVENTS_AT_COMMIT {
        return None;
    }
    let headers = causality.headers_json();
    insert_statement(events, causality, &headers).with_commit()
}

/// The statement of [`insert_events`], for any connection; `headers` is
/// `causality.headers_json()`.
#[cfg(feature = "postgres")]
pub(crate) fn insert_statement<'a>(
    events: &'a [NewEvent],
    causality: &'a Causality,
    headers: &'a str,
) -> InsertEvents<'a> {
    let (ordinals, counts) = numbering(events);
    // Lock order (see above).
    let mut aggregates: Vec<(&str, &str, i64)> =
        counts.into_iter().map(|((t, i), n)| (t, i, n)).collect();
    aggregates.sort_unstable();

    InsertEvents {
        aggregate_types: aggregates.iter().map(|a| a.0).collect(),
        aggregate_ids: aggregates.iter().map(|a| a.1).collect(),
        counts: aggregates.iter().map(|a| a.2).collect(),
        correlation_id: &causality.correlation_id,
        causation_id: &causality.causation_id,
        headers,
        ids: events.iter().map(|e| e.id).collect(),
        event_aggregate_types: column(events, |e| &e.aggregate_type),
        event_aggregate_ids: column(events, |e| &e.aggregate_id),
        ordinals: ordinals.into(),
        event_types: column(events, |e| e.event_type),
        event_versions: events.iter().map(|e| e.event_version).collect(),
        partition_keys: column(events, |e| &e.partition_key),
        subjects: column(events, |e| &e.subject),
        payloads: column(events, |e| &e.payload),
    }
}

/// Per aggregate, how many of `events` it has; and each event's 1-based position among its
/// aggregate's events.
pub(crate) fn numbering(events: &[NewEvent]) -> (Vec<i64>, HashMap<(&str, &str), i64>) {
    let mut counts: HashMap<(&str, &str), i64> = HashMap::new();
    let ordinals = events
        .iter()
        .map(|event| {
            let n = counts
                .entry((&event.aggregate_type, &event.aggregate_id))
                .or_default();
            *n += 1;
            *n
        })
        .collect();
    (ordinals, counts)
}

/// Takes the dedup keys of `events` (those that carry one) for this transaction, and
/// returns the positions of the events whose key was already taken: by a committed event, or
/// by an earlier event of `events`. Those are not to be written.
///
/// Guarantee: the keys' primary key. A key another open transaction has just taken makes
/// this statement wait for that transaction; if it commits, the key is taken, and if it
/// rolls back, the key is ours (PostgreSQL docs, INSERT, "ON CONFLICT Clause"). So of any
/// number of units of work racing with one key, exactly one writes its event.
#[cfg(feature = "postgres")]
pub(crate) async fn take_dedup_keys(
    conn: &mut AsyncPgConnection,
    events: &[NewEvent],
) -> QueryResult<Vec<usize>> {
    let mut plan = DedupKeys::plan(events);
    if let Some(statement) = plan.statement() {
        let taken: Vec<TakenKey> = statement.load(conn).await?;
        plan.taken(&taken);
    }
    Ok(plan.duplicates(events))
}

/// The work of [`take_dedup_keys`] around its one statement, for any connection.
pub(crate) struct DedupKeys<'a> {
    /// Positions of events whose key an earlier event of the same unit of work has.
    duplicates: Vec<usize>,
    /// Each key's first event, until the statement says the key is ours.
    first: HashMap<&'a str, Uuid>,
}

impl<'a> DedupKeys<'a> {
    pub(crate) fn plan(events: &'a [NewEvent]) -> Self {
        let mut duplicates = Vec::new();
        let mut first: HashMap<&str, Uuid> = HashMap::new();
        for (position, event) in events.iter().enumerate() {
            if let Some(key) = event.dedup_key.as_deref() {
                match first.entry(key) {
                    Entry::Occupied(_) => duplicates.push(position),
                    Entry::Vacant(entry) => {
                        entry.insert(event.id);
                    }
                }
            }
        }
        Self { duplicates, first }
    }

    /// The keys to take with the id of each one's first event, sorted by key (empty when
    /// no event has one): two units of work taking the same keys wait on each other in one
    /// order and cannot deadlock.
    pub(crate) fn keys(&self) -> Vec<(&'a str, Uuid)> {
        let mut keys: Vec<(&str, Uuid)> = self.first.iter().map(|(k, id)| (*k, *id)).collect();
        keys.sort_unstable();
        keys
    }

    /// PostgreSQL's statement that takes the [`keys`](Self::keys), or `None` when no event
    /// has one.
    #[cfg(feature = "postgres")]
    pub(crate) fn statement(&self) -> Option<TakeDedupKeys<'a>> {
        let keys = self.keys();
        if keys.is_empty() {
            return None;
        }
        Some(TakeDedupKeys {
            keys: keys.iter().map(|k| k.0).collect(),
            ids: keys.iter().map(|k| k.1).collect(),
        })
    }

    /// The keys the statement took: ours.
    pub(crate) fn taken(&mut self, taken: &[TakenKey]) {
        for TakenKey { dedup_key } in taken {
            self.first.remove(dedup_key.as_str());
        }
    }

    /// The positions of the events not to write, sorted: duplicates within `events`, and the
    /// first events of keys taken before.
    pub(crate) fn duplicates(mut self, events: &[NewEvent]) -> Vec<usize> {
        let first = &self.first;
        self.duplicates
            .extend(events.iter().enumerate().filter_map(|(position, event)| {
                let key = event.dedup_key.as_deref()?;
                (first.get(key) == Some(&event.id)).then_some(position)
            }));
        self.duplicates.sort_unstable();
        self.duplicates
    }
}

/// A dedup key a unit of work took (the column `dedup_key`).
#[derive(QueryableByName)]
pub(crate) struct TakenKey {
    #[diesel(sql_type = Text)]
    dedup_key: String,
}

#[cfg(feature = "postgres")]
statement! {
    /// Takes dedup keys (see [`take_dedup_keys`]), after `outbox_assert_unit_of_work()`
    /// (migration 000005): a key taken outside the unit of work's transaction (ended by a
    /// COMMIT sent inside the closure) would commit on its own, and the event it guards,
    /// never written, would be dropped as a duplicate when the unit of work is retried.
    pub(crate) struct TakeDedupKeys<'a> {
        keys: ArrayBind<'a, &'a str> => Array<Text>,
        ids: ArrayBind<'a, Uuid> => Array<SqlUuid>,
    }
    sql = "INSERT INTO outbox_dedup_keys (dedup_key, event_id) \
           SELECT k.dedup_key, k.event_id FROM outbox_assert_unit_of_work(), \
               unnest($1::text[], $2::uuid[]) AS k(dedup_key, event_id) \
           ON CONFLICT (dedup_key) DO NOTHING RETURNING dedup_key";
}

#[cfg(feature = "postgres")]
statement! {
    /// The unit of work's INSERT (see [`insert_events`]): the function of migration 000004,
    /// whose plan PostgreSQL caches for the session.
    pub(crate) struct InsertEvents<'a> {
        aggregate_types: ArrayBind<'a, &'a str> => Array<Text>,
        aggregate_ids: ArrayBind<'a, &'a str> => Array<Text>,
        counts: ArrayBind<'a, i64> => Array<Int8>,
        correlation_id: &'a str => Text,
        causation_id: &'a str => Text,
        headers: &'a str => Text,
        ids: ArrayBind<'a, Uuid> => Array<SqlUuid>,
        event_aggregate_types: ArrayBind<'a, &'a str> => Array<Text>,
        event_aggregate_ids: ArrayBind<'a, &'a str> => Array<Text>,
        ordinals: ArrayBind<'a, i64> => Array<Int8>,
        event_types: ArrayBind<'a, &'a str> => Array<Text>,
        event_versions: ArrayBind<'a, i32> => Array<Int4>,
        partition_keys: ArrayBind<'a, &'a str> => Array<Text>,
        subjects: ArrayBind<'a, &'a str> => Array<Text>,
        payloads: ArrayBind<'a, &'a str> => Array<Text>,
    }
    sql = "SELECT outbox_insert_events($1, $2, $3, $4, $5, $6::jsonb, $7, $8, $9, $10, $11, \
           $12, $13, $14, $15)";
}

/// The most events a unit of work writes with its COMMIT ([`InsertEvents::with_commit`]);
/// a larger one sends its statement with binds, in a round trip of its own, and spares the
/// server parsing its values. Measured on loopback (a unit of work of n events on one
/// aggregate and on n, both paths interleaved, 2026-11-27): the text is faster up to about
/// 30 events (1 event 1.46-1.53 ms against 1.62-1.93 ms with binds), even at 60, and 0-6%
/// slower at 100; a database a network away saves the round trip besides. `relay_bench
/// --phases 6` prints this limit's units of work against one more event, per event.
#[cfg(feature = "postgres")]
pub(crate) const MAX_EVENTS_AT_COMMIT: usize = 64;

#[cfg(feature = "postgres")]
impl InsertEvents<'_> {
    /// This statement with its values written as constants, then `COMMIT`: one simple query,
    /// so that the unit of work's INSERT costs no round trip of its own. The server runs the
    /// COMMIT only if the INSERT succeeded (PostgreSQL 15 documentation, 55.2.2.1 "Multiple
    /// Statements in a Simple Query"), and the function checks the transaction first, as the
    /// statement does. `None` when a value holds a NUL, which no constant can: the statement
    /// with binds reports it.
    pub(crate) fn with_commit(&self) -> Option<String> {
        let size = self.payloads.0.iter().map(|p| p.len() + 16).sum::<usize>()
            + self.ids.0.len() * 200
            + 256;
        let mut sql = super::statement::Literals::with_capacity(size);
        sql.sql("SELECT outbox_insert_events(")
            .array(&self.aggregate_types)
            .sql(", ")
            .array(&self.aggregate_ids)
            .sql(", ")
            .array(&self.counts)
            .sql(", ")
            .text(self.correlation_id)
            .sql("::text, ")
            .text(self.causation_id)
            .sql("::text, ")
            .text(self.headers)
            .sql("::jsonb, ")
            .array(&self.ids)
            .sql(", ")
            .array(&self.event_aggregate_types)
            .sql(", ")
            .array(&self.event_aggregate_ids)
            .sql(", ")
            .array(&self.ordinals)
            .sql(", ")
            .array(&self.event_types)
            .sql(", ")
            .array(&self.event_versions)
            .sql(", ")
            .array(&self.partition_keys)
            .sql(", ")
            .array(&self.subjects)
            .sql(", ")
            .array(&self.payloads)
            .sql("); COMMIT");
        sql.finish()
    }
}

#[cfg(feature = "postgres")]
fn column<'a>(
    events: &'a [NewEvent],
    field: impl Fn(&'a NewEvent) -> &'a str,
) -> ArrayBind<'a, &'a str> {
    events.iter().map(field).collect()
}

/// A pending row claimed by the relay, with what its message needs.
#[derive(Debug)]
pub(crate) struct ClaimedEvent {
    pub id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_seq: i64,
    pub event_type: String,
    pub event_version: i32,
    pub partition_key: String,
    pub subject: String,
    pub payload: JsonBytes,
    pub headers: JsonText,
    pub occurred_at: time::OffsetDateTime,
    /// `None` for a row inserted without one: its own id stands in.
    pub correlation_id: Option<String>,
    pub causation_id: Option<String>,
    /// Whether `available_at` has passed. A row queued behind a claimed one may still be
    /// waiting (a delayed row); it then stops its aggregate's chain for this batch.
    pub available: bool,
}

/// The columns of [`ClaimBatch`]'s rows, in the order it selects them: [`ClaimedEvent`]'s
/// fields.
#[cfg(feature = "postgres")]
const CLAIMED_COLUMNS: [&str; 14] = [
    "id",
    "aggregate_type",
    "aggregate_id",
    "aggregate_seq",
    "event_type",
    "event_version",
    "partition_key",
    "subject",
    "payload",
    "headers",
    "occurred_at",
    "correlation_id",
    "causation_id",
    "available",
];

/// Read by position, in [`CLAIMED_COLUMNS`]' order, which is the claim's own: looking each
/// column up by name, as `#[derive(QueryableByName)]` does (a scan of the row's column names
/// per field), made reading a claimed row cost 4.3 k instructions instead of 1.7 k, of the
/// relay's 47 k per event (callgrind, `relay_bench --phases 3`). A row with another number of
/// columns is an error; debug builds (the tests) also check each column's name, so the order
/// cannot drift from the SQL's unnoticed.
#[cfg(feature = "postgres")]
impl QueryableByName<Pg> for ClaimedEvent {
    fn build<'a>(row: &impl diesel::row::NamedRow<'a, Pg>) -> deserialize::Result<Self> {
        use diesel::row::Field as _;
        if row.field_count() != CLAIMED_COLUMNS.len() {
            return Err(format!(
                "a claimed row has {} columns, not the claim's {}",
                row.field_count(),
                CLAIMED_COLUMNS.len()
            )
            .into());
        }
        if cfg!(debug_assertions) {
            for (k, name) in CLAIMED_COLUMNS.iter().enumerate() {
                let found = diesel::row::Row::get(row, k)
                    .and_then(|field| field.field_name().map(str::to_owned));
                if found.as_deref() != Some(*name) {
                    return Err(format!("claimed column {k} is {found:?}, not {name:?}").into());
                }
            }
        }
        Ok(Self {
            id: row.get_value::<SqlUuid, _, _>(0)?,
            aggregate_type: row.get_value::<Text, _, _>(1)?,
            aggregate_id: row.get_value::<Text, _, _>(2)?,
            aggregate_seq: row.get_value::<Int8, _, _>(3)?,
            event_type: row.get_value::<Text, _, _>(4)?,
            event_version: row.get_value::<Int4, _, _>(5)?,
            partition_key: row.get_value::<Text, _, _>(6)?,
            subject: row.get_value::<Text, _, _>(7)?,
            payload: row.get_value::<Json, _, _>(8)?,
            headers: row.get_value::<Jsonb, _, _>(9)?,
            occurred_at: row.get_value::<Timestamptz, _, _>(10)?,
            correlation_id: row.get_value::<Nullable<Text>, _, _>(11)?,
            causation_id: row.get_value::<Nullable<Text>, _, _>(12)?,
            available: row.get_value::<Bool, _, _>(13)?,
        })
    }
}

/// A `jsonb` value as its JSON text, without parsing it.
#[derive(Debug)]
pub(crate) struct JsonText(pub Vec<u8>);

/// A `json` value's text, exactly as it was written, as shared bytes: the relay sends a
/// payload as it is.
#[derive(Debug)]
pub(crate) struct JsonBytes(pub bytes::Bytes);

/// The JSON text of a `jsonb` in binary format: a version byte (1) and the text (PostgreSQL
/// source, `jsonb_send` in src/backend/utils/adt/jsonb.c).
#[cfg(feature = "postgres")]
fn jsonb_text(value: PgValue<'_>) -> deserialize::Result<&[u8]> {
    match value.as_bytes().split_first() {
        Some((1, json)) => Ok(json),
        Some((version, _)) => Err(format!("unsupported jsonb format version {version}").into()),
        None => Err("empty jsonb value".into()),
    }
}

#[cfg(feature = "postgres")]
impl FromSql<Jsonb, Pg> for JsonText {
    fn from_sql(value: PgValue<'_>) -> deserialize::Result<Self> {
        jsonb_text(value).map(|json| Self(json.to_vec()))
    }
}

/// `json` in binary format is its text (PostgreSQL source, `json_send` in
/// src/backend/utils/adt/json.c).
#[cfg(feature = "postgres")]
impl FromSql<Json, Pg> for JsonBytes {
    fn from_sql(value: PgValue<'_>) -> deserialize::Result<Self> {
        Ok(Self(bytes::Bytes::copy_from_slice(value.as_bytes())))
    }
}

/// Aggregates whose heads other workers of this relay hold: the claim's window skips them
/// instead of looking up heads it could not lock.
#[derive(Debug, Default)]
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) struct Held<'a> {
    pub types: Vec<&'a str>,
    pub ids: Vec<&'a str>,
}

/// The claim's window, as a percentage of the batch size: the oldest claimable rows it reads
/// to find heads. More finds more heads when other relays hold some (or the oldest rows
/// share aggregates); each row read costs a head lookup. Chosen by `examples/relay_bench`.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
const CLAIM_WINDOW_PERCENT: i64 = 25;

/// The claim's window for a batch: [`CLAIM_WINDOW_PERCENT`] of it, but never less than the
/// batch itself up to [`MIN_CLAIM_WINDOW`] rows (a window of 0 would claim nothing).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn claim_window(batch: i64) -> i64 {
    (batch.saturating_mul(CLAIM_WINDOW_PERCENT) / 100).max(batch.min(MIN_CLAIM_WINDOW))
}

/// Below this, the window is the whole batch: looking up a few hundred heads is cheap.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
const MIN_CLAIM_WINDOW: i64 = 256;

/// Claims a batch: up to `batch` rows that head their aggregate's queue, oldest first, each
/// with the rows queued behind it (about `batch` rows in all); the rows of one aggregate are
/// returned together and in sequence order.
///
/// How: take a window of the oldest claimable rows (`outbox_events_claimable`, scanned only
/// up to `now()`; [`CLAIM_WINDOW_PERCENT`] of the batch), leaving out the aggregates `held`
/// by this relay's other workers, reduce them to their aggregates, look up each aggregate's
/// head (its lowest queued row, through `outbox_events_queued`), lock the heads that are
/// claimable with `FOR UPDATE SKIP LOCKED` (by `ctid`: a row updated since the lookup is
/// followed to its newest version and rechecked), then, when the batch has room, fetch the
/// rows behind each locked head. The cost follows the
/// batch, not the queue: it does not grow with the rows queued behind the heads, with the
/// published rows kept, or with rows parked behind a blocked one.
///
/// Guarantee: a row is claimed only when no row of its aggregate with a lower sequence is
/// queued (a dead letter included), and the claimed head stays locked until the caller's
/// transaction ends. Another relay skips the locked head, and cannot claim the rows behind it
/// because the head is still queued to it; so one aggregate's rows are published by one
/// relay at a time and in order. A head found in this statement's snapshot that another
/// relay publishes meanwhile is rechecked when locked and dropped. The rows behind a head are
/// not locked: nothing else claims them while their head is held.
///
/// The claim runs only in a transaction marked by [`BEGIN_RELAY_BATCH`] (or by its
/// `SET LOCAL`): elsewhere, where its locks would end with the statement, it fails with
/// "unrecognized configuration parameter \"outbox.claim_outside_its_relay_batch\"" and
/// returns no row.
#[cfg(feature = "postgres")]
pub(crate) async fn claim_batch(
    mut conn: &AsyncPgConnection,
    batch: i64,
    held: &Held<'_>,
) -> QueryResult<Vec<ClaimedEvent>> {
    ClaimBatch {
        window: claim_window(batch),
        heads: batch,
        rows: batch,
        held_types: held.types.as_slice().into(),
        held_ids: held.ids.as_slice().into(),
    }
    .load(&mut conn)
    .await
}

/// Opens a relay batch's transaction and marks it for [`claim_batch`]: `SET LOCAL` lasts
/// until the transaction ends, and outside a transaction block it has no effect (PostgreSQL
/// 15 documentation, SET). Sent as one simple query, pipelined with the claim.
///
/// The batch commits asynchronously (`synchronous_commit = off` for this transaction only):
/// its COMMIT returns before its WAL is flushed, so the relay does not wait for the disk
/// between a batch and the next, nor queue its flushes behind the writers' (PostgreSQL 15
/// documentation, 30.4 "Asynchronous Commit"). What a crash of the server can then lose is
/// the record of the last batches published, at most three `wal_writer_delay`s of them
/// (600 ms by default; a writer's durable COMMIT flushes every record before its own), or on
/// a failover those not yet replicated to the standby: their rows are queued again and
/// published again, as after a relay killed between its publish and its COMMIT. JetStream
/// drops the copies inside the stream's duplicate window; an inbox drops those after it.
/// Units of work, the inbox and the dead-letter tools keep the server's setting (durable by
/// default).
#[cfg(feature = "postgres")]
pub(crate) const BEGIN_RELAY_BATCH: &str =
    "BEGIN; SET LOCAL outbox.relay_batch = 'on'; SET LOCAL synchronous_commit = off";

#[cfg(feature = "postgres")]
statement! {
    /// The relay's claim (see [`claim_batch`]).
    struct ClaimBatch<'a> {
        held_types: ArrayBind<'a, &'a str> => Array<Text>,
        held_ids: ArrayBind<'a, &'a str> => Array<Text>,
        window: i64 => Int8,
        heads: i64 => Int8,
        rows: i64 => Int8,
    }
    sql = "\
        WITH oldest AS ( \
            SELECT o.aggregate_type, o.aggregate_id, o.available_at, o.id \
            FROM outbox_events o \
            WHERE CASE WHEN current_setting('outbox.relay_batch', true) = 'on' THEN true \
                       ELSE current_setting('outbox.claim_outside_its_relay_batch')::bool END \
              AND o.published_at IS NULL AND o.skipped_at IS NULL AND o.dead_lettered_at IS NULL \
              AND o.available_at <= now() \
              AND (o.aggregate_type, o.aggregate_id) NOT IN ( \
                  SELECT t, i FROM unnest($1::text[], $2::text[]) AS held(t, i)) \
            ORDER BY o.available_at, o.id \
            LIMIT $3 \
        ), aggregates AS ( \
            SELECT DISTINCT ON (aggregate_type, aggregate_id) \
                   aggregate_type, aggregate_id, available_at, id AS first_id \
            FROM oldest \
            ORDER BY aggregate_type, aggregate_id, available_at, id \
        ), heads AS ( \
            SELECT h.ctid, a.available_at, a.first_id \
            FROM aggregates a \
            CROSS JOIN LATERAL ( \
                SELECT q.ctid, q.dead_lettered_at, q.available_at FROM outbox_events q \
                WHERE q.published_at IS NULL AND q.skipped_at IS NULL \
                  AND q.aggregate_type = a.aggregate_type AND q.aggregate_id = a.aggregate_id \
                ORDER BY q.aggregate_seq \
                LIMIT 1 \
            ) h \
            WHERE h.dead_lettered_at IS NULL AND h.available_at <= now() \
        ), claimed AS ( \
            SELECT o.id, o.aggregate_type, o.aggregate_id, o.aggregate_seq, o.event_type, \
                   o.event_version, o.partition_key, o.subject, o.payload, o.headers, o.occurred_at, \
                   o.correlation_id, o.causation_id, \
                   h.available_at AS rank_at, h.first_id AS rank_id \
            FROM outbox_events o JOIN heads h ON o.ctid = h.ctid \
            WHERE o.published_at IS NULL AND o.skipped_at IS NULL AND o.dead_lettered_at IS NULL \
            ORDER BY h.available_at, h.first_id \
            LIMIT $4 \
            FOR UPDATE OF o SKIP LOCKED \
        ) \
        SELECT id, aggregate_type, aggregate_id, aggregate_seq, event_type, event_version, \
               partition_key, subject, payload, headers, occurred_at, correlation_id, \
               causation_id, available \
        FROM ( \
            SELECT id, aggregate_type, aggregate_id, aggregate_seq, event_type, event_version, \
                   partition_key, subject, payload, headers, occurred_at, correlation_id, \
                   causation_id, true AS available, rank_at, rank_id \
            FROM claimed \
            UNION ALL \
            SELECT e.id, e.aggregate_type, e.aggregate_id, e.aggregate_seq, e.event_type, \
                   e.event_version, e.partition_key, e.subject, e.payload, e.headers, \
                   e.occurred_at, e.correlation_id, e.causation_id, \
                   e.available_at <= now() AND e.dead_lettered_at IS NULL, c.rank_at, c.rank_id \
            FROM claimed c \
            CROSS JOIN LATERAL ( \
                SELECT * FROM outbox_events e \
                WHERE e.published_at IS NULL AND e.skipped_at IS NULL \
                  AND e.aggregate_type = c.aggregate_type AND e.aggregate_id = c.aggregate_id \
                  AND e.aggregate_seq > c.aggregate_seq \
                ORDER BY e.aggregate_seq \
                LIMIT (SELECT ($5 - count(*)) / greatest(count(*), 1) FROM claimed) \
            ) e \
        ) claim \
        ORDER BY rank_at, rank_id, aggregate_seq";
}

/// What becomes of a row once its message is acked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PublishedRows {
    /// Delete the row: the table holds only what is still queued. The default: a DELETE of
    /// rows the claim already locked costs about a tenth of the UPDATE that marks them (which
    /// writes a new row version and two index entries).
    #[default]
    Delete,
    /// Set `published_at` and keep the row, for history and replay; purge old rows with
    /// [`purge_published`](crate::outbox::purge_published).
    Mark,
    /// Move the row, whole, to `outbox_published`, stamped with the time it was published
    /// (`published_at`, UTC), for history and replay at scale: `outbox_events` keeps only
    /// what is queued. On PostgreSQL the archive is partitioned by that day, and retention
    /// drops whole days ([`drop_archived`](crate::outbox::drop_archived)) instead of
    /// deleting rows one by one; on MySQL and SQLite it is one table, and retention deletes
    /// its oldest rows in batches (`mysql::purge_archived`, `sqlite::purge_archived`).
    Archive,
}

/// Marks, deletes or archives the rows `ids`, in one statement.
#[cfg(feature = "postgres")]
pub(crate) async fn finish_published(
    conn: &mut AsyncPgConnection,
    ids: &[Uuid],
    mode: PublishedRows,
) -> QueryResult<()> {
    match mode {
        PublishedRows::Mark => MarkPublished { ids: ids.into() }.execute(conn).await?,
        PublishedRows::Delete => DeletePublished { ids: ids.into() }.execute(conn).await?,
        PublishedRows::Archive => ArchivePublished { ids: ids.into() }.execute(conn).await?,
    };
    Ok(())
}

/// The statement of [`finish_published`] with its ids written as one array constant, then
/// `COMMIT`: one simple query, so that the end of a relay batch costs one round trip instead
/// of two. The server runs the COMMIT only if the statement succeeded (PostgreSQL 15
/// documentation, 55.2.2.1 "Multiple Statements in a Simple Query"). `None` for no ids (a
/// plain COMMIT ends that batch) and for more than [`MAX_EVENTS_AT_COMMIT`]: a large batch
/// saves little by the round trip, and the server's parsing of thousands of ids as text cost
/// the drain of figure 3 about 4% (two pairs of runs, 2026-11-27), so it binds them.
#[cfg(feature = "postgres")]
pub(crate) fn finish_published_and_commit(ids: &[Uuid], mode: PublishedRows) -> Option<String> {
    if ids.is_empty() || ids.len() > MAX_EVENTS_AT_COMMIT {
        return None;
    }
    let statement = match mode {
        PublishedRows::Mark => "UPDATE outbox_events SET published_at = now() WHERE id = ANY(",
        PublishedRows::Delete => "DELETE FROM outbox_events WHERE id = ANY(",
        PublishedRows::Archive => "SELECT outbox_archive_published(",
    };
    // 36 characters and a comma per id.
    let mut sql = super::statement::Literals::with_capacity(ids.len() * 37 + 96);
    sql.sql(statement).array(&ids.into()).sql("); COMMIT");
    // Uuids are written as hex digits and hyphens: every one can be.
    sql.finish()
}

#[cfg(feature = "postgres")]
statement! {
    struct MarkPublished<'a> {
        ids: ArrayBind<'a, Uuid> => Array<SqlUuid>,
    }
    sql = "UPDATE outbox_events SET published_at = now() WHERE id = ANY($1)";
}

#[cfg(feature = "postgres")]
statement! {
    /// The function of migration 000006: moves the rows to `outbox_published`.
    struct ArchivePublished<'a> {
        ids: ArrayBind<'a, Uuid> => Array<SqlUuid>,
    }
    sql = "SELECT outbox_archive_published($1)";
}

#[cfg(feature = "postgres")]
statement! {
    struct DeletePublished<'a> {
        ids: ArrayBind<'a, Uuid> => Array<SqlUuid>,
    }
    sql = "DELETE FROM outbox_events WHERE id = ANY($1)";
}

/// How a rejected row is retried, and when it becomes a dead letter.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RetryPolicy {
    /// Attempts before the row is dead-lettered.
    pub max_attempts: i32,
    /// The delay after the first rejection, in milliseconds; it doubles with each attempt.
    pub base_delay_ms: i64,
    /// The longest delay, in milliseconds.
    pub max_delay_ms: i64,
    /// Whether a dead letter blocks the later rows of its aggregate (sequenced) or is
    /// skipped at once so they flow.
    pub dead_letters_block: bool,
}

/// What [`record_rejection`] did to the row.
#[derive(Debug, QueryableByName)]
pub(crate) struct Rejection {
    /// The row is now a dead letter.
    #[diesel(sql_type = Bool)]
    pub dead_lettered: bool,
    /// The attempts counted so far.
    #[diesel(sql_type = Int4)]
    pub attempts: i32,
}

/// Records a publish the broker rejected: one more attempt and the error; then either a
/// retry after an exponential delay with jitter, or, at `max_attempts`, a dead letter.
///
/// Guarantee: the later rows of the aggregate cannot overtake the rejected one. They are
/// parked (their `available_at` moved) until its retry, or, behind a sequenced dead letter,
/// until an operator retries or skips it; rows the unit of work adds meanwhile are parked
/// through `outbox_aggregates.blocked_until`. Parking keeps them out of the claim's index
/// scan, so a long blocked queue costs the other aggregates nothing.
///
/// The delay is `base * 2^(attempts - 1)`, capped, with "equal jitter" (half fixed, half
/// random) so that rows rejected together do not retry together.
#[cfg(feature = "postgres")]
pub(crate) async fn record_rejection(
    conn: &mut AsyncPgConnection,
    id: Uuid,
    error: &str,
    policy: RetryPolicy,
) -> QueryResult<Rejection> {
    const SQL: &str = "\
        WITH rejected AS ( \
            UPDATE outbox_events SET \
                attempts = attempts + 1, \
                last_error = $2, \
                dead_lettered_at = CASE WHEN attempts + 1 >= $3 THEN now() END, \
                skipped_at = CASE WHEN attempts + 1 >= $3 AND NOT $6 THEN now() END, \
                available_at = CASE WHEN attempts + 1 >= $3 THEN available_at ELSE now() \
                    + least($5::float8, $4::float8 * 2 ^ attempts) * (0.5 + random() / 2) \
                      * interval '1 millisecond' END \
            WHERE id = $1 \
            RETURNING aggregate_type, aggregate_id, aggregate_seq, attempts, \
                dead_lettered_at IS NOT NULL AS dead_lettered, \
                CASE WHEN skipped_at IS NOT NULL THEN NULL \
                     WHEN dead_lettered_at IS NOT NULL THEN 'infinity'::timestamptz \
                     ELSE available_at END AS blocked_until \
        ), parked AS ( \
            UPDATE outbox_events f SET available_at = r.blocked_until \
            FROM rejected r \
            WHERE f.aggregate_type = r.aggregate_type AND f.aggregate_id = r.aggregate_id \
              AND f.aggregate_seq > r.aggregate_seq \
              AND f.published_at IS NULL AND f.skipped_at IS NULL \
              AND f.available_at < r.blocked_until \
        ), blocked AS ( \
            UPDATE outbox_aggregates a SET blocked_until = r.blocked_until \
            FROM rejected r \
            WHERE a.aggregate_type = r.aggregate_type AND a.aggregate_id = r.aggregate_id \
        ) \
        SELECT dead_lettered, attempts FROM rejected";

    diesel::sql_query(SQL)
        .bind::<SqlUuid, _>(id)
        .bind::<Text, _>(error)
        .bind::<Int4, _>(policy.max_attempts)
        .bind::<Int8, _>(policy.base_delay_ms)
        .bind::<Int8, _>(policy.max_delay_ms)
        .bind::<Bool, _>(policy.dead_letters_block)
        .get_result(conn)
        .await
}

#[cfg(all(test, any(feature = "postgres", feature = "sqlite")))]
mod tests {
    use super::*;
    #[cfg(feature = "postgres")]
    use diesel::query_builder::QueryFragment;

    /// Renders a statement's SQL as diesel sends it to PostgreSQL.
    #[cfg(feature = "postgres")]
    fn rendered(statement: &impl QueryFragment<diesel::pg::Pg>) -> String {
        let mut builder = diesel::pg::PgQueryBuilder::default();
        statement.to_sql(&mut builder, &diesel::pg::Pg).unwrap();
        diesel::query_builder::QueryBuilder::finish(builder)
    }

    #[test]
    fn the_claim_window_is_a_quarter_of_a_large_batch_and_all_of_a_small_one() {
        assert_eq!(claim_window(2000), 500);
        assert_eq!(claim_window(3), 3);
        assert_eq!(claim_window(300), 256);
        assert_eq!(claim_window(1), 1);
    }

    #[test]
    #[cfg(feature = "postgres")]
    fn every_statement_renders_its_sql_with_the_binds_in_place() {
        let ids = [Uuid::nil()];
        let insert = InsertEvents {
            aggregate_types: Vec::new().into(),
            aggregate_ids: Vec::new().into(),
            counts: Vec::new().into(),
            correlation_id: "c",
            causation_id: "c",
            headers: "{}",
            ids: Vec::new().into(),
            event_aggregate_types: Vec::new().into(),
            event_aggregate_ids: Vec::new().into(),
            ordinals: Vec::new().into(),
            event_types: Vec::new().into(),
            event_versions: Vec::new().into(),
            partition_keys: Vec::new().into(),
            subjects: Vec::new().into(),
            payloads: Vec::new().into(),
        };
        assert_eq!(rendered(&insert), InsertEvents::SQL);
        let claim = ClaimBatch {
            window: 2,
            heads: 1,
            rows: 1,
            held_types: ["Order"].as_slice().into(),
            held_ids: ["o-1"].as_slice().into(),
        };
        assert_eq!(rendered(&claim), ClaimBatch::SQL);
        let keys = TakeDedupKeys {
            keys: vec!["k"].into(),
            ids: ids.to_vec().into(),
        };
        assert_eq!(rendered(&keys), TakeDedupKeys::SQL);
        assert_eq!(
            rendered(&MarkPublished {
                ids: ids.as_slice().into()
            }),
            MarkPublished::SQL
        );
        assert_eq!(
            rendered(&DeletePublished {
                ids: ids.as_slice().into()
            }),
            DeletePublished::SQL
        );
    }
}
