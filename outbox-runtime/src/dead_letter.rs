//! Dead letters: rows the broker rejected `max_attempts` times, and what an operator does
//! with them, on every database the relay runs on.
//!
//! A rejection (no stream for the subject, a message over the server's `max_payload`, a
//! stream limit, invalid headers in the row) counts an attempt and is retried with an
//! exponential delay; transport failures (broker down, no ack in time) never count. At
//! `max_attempts` the row becomes a dead letter: it stays in `outbox_events` with
//! `dead_lettered_at` and `last_error` set.
//!
//! By default a dead letter is *sequenced*: the later rows of its aggregate wait behind it,
//! so the aggregate's order is never broken, while other aggregates keep flowing. An operator
//! then [`retry`]s it (after fixing the stream, say) or [`skip`]s it, and the aggregate's
//! queue moves on. The alternative policy,
//! [`DeadLetterPolicy::Skip`](crate::relay::DeadLetterPolicy::Skip), skips a dead letter at
//! once: later rows flow, and the aggregate's consumers see a gap in `ce-sequence`.
//!
//! A skipped dead letter is not lost: it stays in the table, [`list`] shows it (with
//! `skipped_at`), and [`retry`] publishes it. It then arrives after the later events of its
//! aggregate: an inbox consumer that already applied those records it as a dead letter of
//! its own (out of order) rather than applying it out of order.
//!
//! Every function takes an [`OperatorConnection`]: PostgreSQL's `AsyncPgConnection`, and
//! with the features `mysql` and `sqlite` `outbox_runtime::mysql::AsyncMysqlConnection` and
//! `outbox_runtime::sqlite::AsyncSqliteConnection` (wrap a `SqliteConnection` with
//! `AsyncSqliteConnection::new`). What [`retry`] and [`skip`] release is published at once
//! by a PostgreSQL relay (they notify it) and by a MySQL or SQLite relay of the same process;
//! a MySQL or SQLite relay of another process finds it at its next poll
//! (`RelayConfig::poll_interval`, 500 ms by default).
//!
//! The same operations in SQL, for a database shell, are in each function's documentation.

use std::future::Future;

use diesel::sql_types::{BigInt, Integer, Nullable, Text};
use diesel::{QueryResult, QueryableByName};
use uuid::Uuid;

use crate::database::time_from_micros;

pub use crate::database::OperatorConnection;

/// A dead letter, as [`list`] returns it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetter {
    /// The row id (`ce-id`).
    pub id: Uuid,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id.
    pub aggregate_id: String,
    /// The row's sequence in its aggregate.
    pub aggregate_seq: i64,
    /// The event type.
    pub event_type: String,
    /// The subject it was published to.
    pub subject: String,
    /// The attempts the broker rejected.
    pub attempts: i32,
    /// The last rejection, as the relay recorded it.
    pub last_error: Option<String>,
    /// When the row became a dead letter (UTC; to the microsecond, or the millisecond on
    /// SQLite).
    pub dead_lettered_at: time::OffsetDateTime,
    /// When it was skipped (by the Skip policy or by [`skip`]); `None` while it blocks its
    /// aggregate.
    pub skipped_at: Option<time::OffsetDateTime>,
    /// How many later rows of the aggregate wait behind it (0 for a skipped one).
    pub waiting: i64,
}

/// A dead letter whole, as [`show`] returns it: the [`DeadLetter`] fields and the message it
/// would be.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetterDetail {
    /// What [`list`] shows of it.
    pub letter: DeadLetter,
    /// The event version.
    pub event_version: i32,
    /// The partition key.
    pub partition_key: String,
    /// The payload: the JSON text the producer wrote.
    pub payload: String,
    /// The row's extra headers (a JSON object).
    pub headers: String,
    /// When the event occurred (UTC).
    pub occurred_at: time::OffsetDateTime,
    /// Its correlation id, when it has one.
    pub correlation_id: Option<String>,
}

/// The dead letters not published, oldest first, at most `limit` (none when it is 0 or
/// less): those that block their aggregate and those skipped, which [`retry`] can still
/// publish.
///
/// # Errors
/// The database's error, or [`diesel::result::Error::DeserializationError`] for a row whose
/// id is not a UUID (the migrations refuse such rows).
pub async fn list<C: OperatorConnection>(conn: &mut C, limit: i64) -> QueryResult<Vec<DeadLetter>> {
    conn.list(limit.max(0))
        .await?
        .into_iter()
        .map(DeadLetter::try_from)
        .collect()
}

/// The dead letter `id`, whole; `None` when `id` is not an unpublished dead letter.
///
/// # Errors
/// As [`list`].
pub async fn show<C: OperatorConnection>(
    conn: &mut C,
    id: Uuid,
) -> QueryResult<Option<DeadLetterDetail>> {
    conn.show(id)
        .await?
        .map(DeadLetterDetail::try_from)
        .transpose()
}

/// Retries every unpublished dead letter (skipped ones included), or those of one
/// aggregate type, as [`retry`] does one; returns the ids retried, oldest dead letter first.
///
/// # Errors
/// The database's error; the dead letters retried before it stay retried.
pub async fn retry_all<C: OperatorConnection>(
    conn: &mut C,
    aggregate_type: Option<&str>,
) -> QueryResult<Vec<Uuid>> {
    let ids = conn.ids(aggregate_type).await?;
    let mut retried = Vec::with_capacity(ids.len());
    for IdRow { id } in ids {
        let id = parse_id(&id)?;
        if retry(conn, id).await? {
            retried.push(id);
        }
    }
    Ok(retried)
}

/// Puts the dead letter `id` back in the queue with its attempts reset, releases the rows
/// waiting behind it, and wakes the relays. Returns whether `id` was an unpublished dead
/// letter. A skipped one is retried too: it is published after the later events of its
/// aggregate, which went out while it was skipped.
///
/// In SQL (PostgreSQL's; MySQL's and SQLite's use their own `now`): `UPDATE outbox_events
/// SET dead_lettered_at = NULL, skipped_at = NULL, attempts = 0, available_at = now() WHERE
/// id = ..`, then `available_at = now()` for the aggregate's later queued rows,
/// `blocked_until = NULL` in `outbox_aggregates`, and on PostgreSQL a notification on the
/// outbox table's channel (`SELECT pg_notify('outbox_events_' || 'outbox_events'::regclass::oid,
/// '')`: [`crate::relay::notification_channel`]).
///
/// # Errors
/// The database's error; then nothing changed.
pub async fn retry<C: OperatorConnection>(conn: &mut C, id: Uuid) -> QueryResult<bool> {
    conn.release(id, Release::Retry).await
}

/// Drops the dead letter `id` from the queue for good (it stays in the table with
/// `skipped_at` set, never published unless retried), releases the rows waiting behind it,
/// and wakes the relays. Their consumers see a gap in the aggregate's `ce-sequence`. Returns
/// whether `id` was a dead letter that blocked its aggregate.
///
/// In SQL: `UPDATE outbox_events SET skipped_at = now() WHERE id = ..`, then as [`retry`].
///
/// # Errors
/// The database's error; then nothing changed.
pub async fn skip<C: OperatorConnection>(conn: &mut C, id: Uuid) -> QueryResult<bool> {
    conn.release(id, Release::Skip).await
}

/// What an operator does with a dead letter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Release {
    /// Back in the queue: `dead_lettered_at`, `skipped_at` cleared, attempts reset, available
    /// now.
    Retry,
    /// Out of the queue: `skipped_at` set; only a dead letter not skipped yet.
    Skip,
}

// The module is crate-private, so `DeadLetters` cannot be implemented outside the crate.
#[allow(private_interfaces, private_bounds)]
pub(crate) mod sealed {
    use super::*;

    /// A database's statements for the dead-letter functions.
    pub trait DeadLetters {
        /// The rows of [`super::list`].
        fn list(&mut self, limit: i64) -> impl Future<Output = QueryResult<Vec<LetterRow>>> + Send;

        /// The row of [`super::show`].
        fn show(&mut self, id: Uuid)
        -> impl Future<Output = QueryResult<Option<DetailRow>>> + Send;

        /// The ids of the unpublished dead letters (of `aggregate_type` when given), oldest
        /// dead letter first.
        fn ids(
            &mut self,
            aggregate_type: Option<&str>,
        ) -> impl Future<Output = QueryResult<Vec<IdRow>>> + Send;

        /// Retries or skips `id` and releases the rows behind it, in one transaction; wakes
        /// the relays; whether `id` was such a dead letter.
        fn release(
            &mut self,
            id: Uuid,
            release: Release,
        ) -> impl Future<Output = QueryResult<bool>> + Send;
    }
}

/// A dead letter as each database's query returns it: the id as text, times in
/// microseconds since the epoch (UTC).
#[derive(QueryableByName)]
struct LetterRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    aggregate_type: String,
    #[diesel(sql_type = Text)]
    aggregate_id: String,
    #[diesel(sql_type = BigInt)]
    aggregate_seq: i64,
    #[diesel(sql_type = Text)]
    event_type: String,
    #[diesel(sql_type = Text)]
    subject: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
    #[diesel(sql_type = BigInt)]
    dead_lettered_us: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    skipped_us: Option<i64>,
    #[diesel(sql_type = BigInt)]
    waiting: i64,
}

/// A dead letter's id, as each database's query returns it.
#[derive(QueryableByName)]
struct IdRow {
    #[diesel(sql_type = Text)]
    id: String,
}

/// A dead letter whole, as each database's query returns it.
#[derive(QueryableByName)]
struct DetailRow {
    #[diesel(embed)]
    letter: LetterRow,
    #[diesel(sql_type = Integer)]
    event_version: i32,
    #[diesel(sql_type = Text)]
    partition_key: String,
    #[diesel(sql_type = Text)]
    payload: String,
    #[diesel(sql_type = Text)]
    headers: String,
    #[diesel(sql_type = BigInt)]
    occurred_us: i64,
    #[diesel(sql_type = Nullable<Text>)]
    correlation_id: Option<String>,
}

/// The row id as a UUID; an error that names it otherwise.
fn parse_id(id: &str) -> QueryResult<Uuid> {
    Uuid::parse_str(id).map_err(|e| {
        diesel::result::Error::DeserializationError(
            format!("outbox_events.id {id:?} is not a UUID: {e}").into(),
        )
    })
}

impl TryFrom<LetterRow> for DeadLetter {
    type Error = diesel::result::Error;

    fn try_from(row: LetterRow) -> QueryResult<Self> {
        Ok(Self {
            id: parse_id(&row.id)?,
            aggregate_type: row.aggregate_type,
            aggregate_id: row.aggregate_id,
            aggregate_seq: row.aggregate_seq,
            event_type: row.event_type,
            subject: row.subject,
            attempts: row.attempts,
            last_error: row.last_error,
            dead_lettered_at: time_from_micros(
                row.dead_lettered_us,
                "outbox_events.dead_lettered_at",
            )?,
            skipped_at: row
                .skipped_us
                .map(|us| time_from_micros(us, "outbox_events.skipped_at"))
                .transpose()?,
            waiting: row.waiting,
        })
    }
}

impl TryFrom<DetailRow> for DeadLetterDetail {
    type Error = diesel::result::Error;

    fn try_from(row: DetailRow) -> QueryResult<Self> {
        Ok(Self {
            letter: row.letter.try_into()?,
            event_version: row.event_version,
            partition_key: row.partition_key,
            payload: row.payload,
            headers: row.headers,
            occurred_at: time_from_micros(row.occurred_us, "outbox_events.occurred_at")?,
            correlation_id: row.correlation_id,
        })
    }
}

/// How a database's SQL reads the dead-letter columns: `text(column)` as text (the id, the
/// payload, the headers), `us(column)` a time as microseconds since the epoch.
struct Dialect {
    text: fn(&str) -> String,
    us: fn(&str) -> String,
    /// The current time, in the tables' shape.
    now: &'static str,
}

impl Dialect {
    /// The columns of a [`LetterRow`], of the dead letter `d`.
    fn letter_columns(&self) -> String {
        format!(
            "{} AS id, d.aggregate_type, d.aggregate_id, d.aggregate_seq, d.event_type, \
             d.subject, d.attempts, d.last_error, {} AS dead_lettered_us, {} AS skipped_us, \
             CASE WHEN d.skipped_at IS NOT NULL THEN 0 ELSE (SELECT count(*) \
              FROM outbox_events w \
              WHERE w.aggregate_type = d.aggregate_type AND w.aggregate_id = d.aggregate_id \
                AND w.aggregate_seq > d.aggregate_seq \
                AND w.published_at IS NULL AND w.skipped_at IS NULL) END AS waiting",
            (self.text)("d.id"),
            (self.us)("d.dead_lettered_at"),
            (self.us)("d.skipped_at"),
        )
    }

    /// The columns of a [`DetailRow`].
    fn detail_columns(&self) -> String {
        format!(
            "{}, d.event_version, d.partition_key, {} AS payload, {} AS headers, \
             {} AS occurred_us, d.correlation_id",
            self.letter_columns(),
            (self.text)("d.payload"),
            (self.text)("d.headers"),
            (self.us)("d.occurred_at"),
        )
    }

    /// `SELECT` of [`LetterRow`]s (or [`DetailRow`]s when `detail`) of the unpublished
    /// dead letters `d` that also match `and`, oldest dead letter first.
    fn select(&self, detail: bool, and: &str) -> String {
        let columns = if detail {
            self.detail_columns()
        } else {
            self.letter_columns()
        };
        format!(
            "SELECT {columns} FROM outbox_events d \
             WHERE d.dead_lettered_at IS NOT NULL AND d.published_at IS NULL {and} \
             ORDER BY d.dead_lettered_at, d.id"
        )
    }

    /// `SELECT` of the [`IdRow`]s of the unpublished dead letters `d` that also match `and`,
    /// oldest dead letter first.
    fn ids(&self, and: &str) -> String {
        format!(
            "SELECT {} AS id FROM outbox_events d \
             WHERE d.dead_lettered_at IS NOT NULL AND d.published_at IS NULL {and} \
             ORDER BY d.dead_lettered_at, d.id",
            (self.text)("d.id")
        )
    }

    /// What [`Release`] sets on the dead letter, and the condition it adds to its `WHERE`.
    fn release(&self, release: Release) -> (String, &'static str) {
        let now = self.now;
        match release {
            Release::Retry => (
                format!(
                    "dead_lettered_at = NULL, skipped_at = NULL, attempts = 0, available_at = {now}"
                ),
                "",
            ),
            Release::Skip => (format!("skipped_at = {now}"), "AND skipped_at IS NULL"),
        }
    }
}

/// An aggregate's place, of a dead letter released.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
#[derive(QueryableByName)]
struct Place {
    #[diesel(sql_type = Text)]
    aggregate_type: String,
    #[diesel(sql_type = Text)]
    aggregate_id: String,
    #[diesel(sql_type = BigInt)]
    aggregate_seq: i64,
}

#[cfg(feature = "postgres")]
mod postgres {
    use diesel::sql_types::{Int8, Nullable, Text, Uuid as SqlUuid};
    use diesel::{OptionalExtension, QueryResult, QueryableByName};
    use diesel_async::{AsyncPgConnection, RunQueryDsl};
    use uuid::Uuid;

    use super::{DetailRow, Dialect, IdRow, LetterRow, Release};

    const POSTGRES: Dialect = Dialect {
        text: |column| format!("{column}::text"),
        us: |column| format!("(extract(epoch FROM {column}) * 1000000)::int8"),
        now: "now()",
    };

    // The trait is crate-private in effect (see `sealed`).
    #[allow(private_interfaces)]
    impl super::sealed::DeadLetters for AsyncPgConnection {
        async fn list(&mut self, limit: i64) -> QueryResult<Vec<LetterRow>> {
            diesel::sql_query(format!("{} LIMIT $1", POSTGRES.select(false, "")))
                .bind::<Int8, _>(limit)
                .load(self)
                .await
        }

        async fn show(&mut self, id: Uuid) -> QueryResult<Option<DetailRow>> {
            diesel::sql_query(POSTGRES.select(true, "AND d.id = $1"))
                .bind::<SqlUuid, _>(id)
                .get_result(self)
                .await
                .optional()
        }

        async fn ids(&mut self, aggregate_type: Option<&str>) -> QueryResult<Vec<IdRow>> {
            diesel::sql_query(POSTGRES.ids("AND ($1::text IS NULL OR d.aggregate_type = $1)"))
                .bind::<Nullable<Text>, _>(aggregate_type)
                .load(self)
                .await
        }

        /// One statement: the dead letter's update, the release of the rows behind it and
        /// of its aggregate, and the notification that wakes the relays.
        async fn release(&mut self, id: Uuid, release: Release) -> QueryResult<bool> {
            #[derive(QueryableByName)]
            struct Released {
                #[diesel(sql_type = Int8)]
                count: i64,
            }
            let (set, only) = POSTGRES.release(release);
            let released: Released = diesel::sql_query(format!(
                "WITH released AS ( \
                    UPDATE outbox_events SET {set} \
                    WHERE id = $1 AND dead_lettered_at IS NOT NULL AND published_at IS NULL {only} \
                    RETURNING aggregate_type, aggregate_id, aggregate_seq \
                ), unparked AS ( \
                    UPDATE outbox_events f SET available_at = now() FROM released r \
                    WHERE f.aggregate_type = r.aggregate_type AND f.aggregate_id = r.aggregate_id \
                      AND f.aggregate_seq > r.aggregate_seq \
                      AND f.published_at IS NULL AND f.skipped_at IS NULL AND f.available_at > now() \
                ), unblocked AS ( \
                    UPDATE outbox_aggregates a SET blocked_until = NULL FROM released r \
                    WHERE a.aggregate_type = r.aggregate_type AND a.aggregate_id = r.aggregate_id \
                ) \
                SELECT (SELECT count(*) FROM released) AS count \
                FROM (SELECT pg_notify('outbox_events_' || 'outbox_events'::regclass::oid, '')) \
                    AS woken"
            ))
            .bind::<SqlUuid, _>(id)
            .get_result(self)
            .await?;
            Ok(released.count == 1)
        }
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use diesel::sql_types::{BigInt, Nullable, Text};
    use diesel::{OptionalExtension, QueryResult};
    use diesel_async::{
        AnsiTransactionManager, AsyncMysqlConnection, RunQueryDsl, TransactionManager,
    };
    use uuid::Uuid;

    use super::{DetailRow, Dialect, IdRow, LetterRow, Place, Release};

    const MYSQL: Dialect = Dialect {
        text: |column| column.to_owned(),
        us: |column| format!("TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {column})"),
        now: "UTC_TIMESTAMP(6)",
    };

    // The trait is crate-private in effect (see `sealed`).
    #[allow(private_interfaces)]
    impl super::sealed::DeadLetters for AsyncMysqlConnection {
        async fn list(&mut self, limit: i64) -> QueryResult<Vec<LetterRow>> {
            diesel::sql_query(format!("{} LIMIT ?", MYSQL.select(false, "")))
                .bind::<BigInt, _>(limit)
                .load(self)
                .await
        }

        async fn show(&mut self, id: Uuid) -> QueryResult<Option<DetailRow>> {
            diesel::sql_query(MYSQL.select(true, "AND d.id = ?"))
                .bind::<Text, _>(id.to_string())
                .get_result(self)
                .await
                .optional()
        }

        async fn ids(&mut self, aggregate_type: Option<&str>) -> QueryResult<Vec<IdRow>> {
            diesel::sql_query(MYSQL.ids("AND (? IS NULL OR d.aggregate_type = ?)"))
                .bind::<Nullable<Text>, _>(aggregate_type)
                .bind::<Nullable<Text>, _>(aggregate_type)
                .load(self)
                .await
        }

        /// In one transaction: the dead letter's update (its row lock held until COMMIT, as a
        /// relay's rejection takes it), then the release of the rows behind it and of its
        /// aggregate. Wakes the relays of this process after COMMIT.
        async fn release(&mut self, id: Uuid, release: Release) -> QueryResult<bool> {
            AnsiTransactionManager::begin_transaction(self).await?;
            match released(self, &id.to_string(), release).await {
                Ok(found) => {
                    AnsiTransactionManager::commit_transaction(self).await?;
                    if found {
                        crate::commits::COMMITS.committed();
                    }
                    Ok(found)
                }
                Err(error) => {
                    // The error that ended the transaction is the one to report.
                    let _ = AnsiTransactionManager::rollback_transaction(self).await;
                    Err(error)
                }
            }
        }
    }

    async fn released(
        conn: &mut AsyncMysqlConnection,
        id: &str,
        release: Release,
    ) -> QueryResult<bool> {
        let (set, only) = MYSQL.release(release);
        let updated = diesel::sql_query(format!(
            "UPDATE outbox_events SET {set} \
             WHERE id = ? AND dead_lettered_at IS NOT NULL AND published_at IS NULL {only}"
        ))
        .bind::<Text, _>(id)
        .execute(conn)
        .await?;
        if updated == 0 {
            return Ok(false);
        }
        let place: Place = diesel::sql_query(
            "SELECT aggregate_type, aggregate_id, aggregate_seq FROM outbox_events WHERE id = ?",
        )
        .bind::<Text, _>(id)
        .get_result(conn)
        .await?;
        diesel::sql_query(
            "UPDATE outbox_events SET available_at = UTC_TIMESTAMP(6) \
             WHERE aggregate_type = ? AND aggregate_id = ? AND aggregate_seq > ? \
               AND published_at IS NULL AND skipped_at IS NULL \
               AND available_at > UTC_TIMESTAMP(6)",
        )
        .bind::<Text, _>(&place.aggregate_type)
        .bind::<Text, _>(&place.aggregate_id)
        .bind::<BigInt, _>(place.aggregate_seq)
        .execute(conn)
        .await?;
        diesel::sql_query(
            "UPDATE outbox_aggregates SET blocked_until = NULL \
             WHERE aggregate_type = ? AND aggregate_id = ?",
        )
        .bind::<Text, _>(&place.aggregate_type)
        .bind::<Text, _>(&place.aggregate_id)
        .execute(conn)
        .await?;
        Ok(true)
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use diesel::sql_types::{BigInt, Nullable, Text};
    use diesel::{OptionalExtension, QueryResult, RunQueryDsl};
    use uuid::Uuid;

    use super::{DetailRow, Dialect, IdRow, LetterRow, Place, Release};
    use crate::sqlite::{AsyncSqliteConnection, NOW, SqliteConnection};

    const SQLITE: Dialect = Dialect {
        text: |column| column.to_owned(),
        // The tables' times are UTC text to the millisecond (see the SQLite migrations).
        us: |column| {
            format!("CAST(ROUND((julianday({column}) - 2440587.5) * 86400000.0) AS INTEGER) * 1000")
        },
        now: NOW,
    };

    // The trait is crate-private in effect (see `sealed`).
    #[allow(private_interfaces)]
    impl super::sealed::DeadLetters for AsyncSqliteConnection {
        async fn list(&mut self, limit: i64) -> QueryResult<Vec<LetterRow>> {
            self.spawn_blocking(move |conn| {
                diesel::sql_query(format!("{} LIMIT ?", SQLITE.select(false, "")))
                    .bind::<BigInt, _>(limit)
                    .load(conn)
            })
            .await
        }

        async fn show(&mut self, id: Uuid) -> QueryResult<Option<DetailRow>> {
            self.spawn_blocking(move |conn| {
                diesel::sql_query(SQLITE.select(true, "AND d.id = ?"))
                    .bind::<Text, _>(id.to_string())
                    .get_result(conn)
                    .optional()
            })
            .await
        }

        async fn ids(&mut self, aggregate_type: Option<&str>) -> QueryResult<Vec<IdRow>> {
            let aggregate_type = aggregate_type.map(str::to_owned);
            self.spawn_blocking(move |conn| {
                diesel::sql_query(SQLITE.ids("AND (?1 IS NULL OR d.aggregate_type = ?1)"))
                    .bind::<Nullable<Text>, _>(aggregate_type)
                    .load(conn)
            })
            .await
        }

        /// In one `BEGIN IMMEDIATE` transaction (SQLite's write lock from its first
        /// statement): the dead letter's update, then the release of the rows behind it and
        /// of its aggregate. Wakes the relays of this process after COMMIT.
        async fn release(&mut self, id: Uuid, release: Release) -> QueryResult<bool> {
            let found = self
                .spawn_blocking(move |conn| {
                    crate::sqlite::immediate_transaction(conn, |conn| {
                        released(conn, &id.to_string(), release)
                    })
                })
                .await?;
            if found {
                crate::commits::COMMITS.committed();
            }
            Ok(found)
        }
    }

    fn released(conn: &mut SqliteConnection, id: &str, release: Release) -> QueryResult<bool> {
        let (set, only) = SQLITE.release(release);
        let place: Option<Place> = diesel::sql_query(format!(
            "UPDATE outbox_events SET {set} \
             WHERE id = ? AND dead_lettered_at IS NOT NULL AND published_at IS NULL {only} \
             RETURNING aggregate_type, aggregate_id, aggregate_seq"
        ))
        .bind::<Text, _>(id)
        .get_result(conn)
        .optional()?;
        let Some(place) = place else {
            return Ok(false);
        };
        diesel::sql_query(format!(
            "UPDATE outbox_events SET available_at = {NOW} \
             WHERE aggregate_type = ? AND aggregate_id = ? AND aggregate_seq > ? \
               AND published_at IS NULL AND skipped_at IS NULL AND available_at > {NOW}"
        ))
        .bind::<Text, _>(&place.aggregate_type)
        .bind::<Text, _>(&place.aggregate_id)
        .bind::<BigInt, _>(place.aggregate_seq)
        .execute(conn)?;
        diesel::sql_query(
            "UPDATE outbox_aggregates SET blocked_until = NULL \
             WHERE aggregate_type = ? AND aggregate_id = ?",
        )
        .bind::<Text, _>(&place.aggregate_type)
        .bind::<Text, _>(&place.aggregate_id)
        .execute(conn)?;
        Ok(true)
    }
}
