//! The inbox's dead letters, for an operator: list them, read one whole, count them per
//! consumer, and discard one that has been dealt with.
//!
//! A dead letter is a message a consumer gave up on (its handler failed `max_attempts`
//! times, it could not be read, or it came after a later event of its aggregate), kept in
//! `outbox_inbox_dead_letters` with its error, headers and payload. The consumer recorded the
//! message in `outbox_inbox` in the same transaction, so a redelivery of it is dropped as a
//! duplicate, and its aggregate moved on: applying it now would break the aggregate's order.
//! What an operator does with one is a decision of the service: replay it once the handler
//! is fixed ([`Inbox::replay_dead_letter`](super::Inbox::replay_dead_letter), which applies
//! it where it stands, after the aggregate's later events), or deal with it by hand (apply
//! its effect, emit a compensating event, accept the loss) and [`discard_dead_letter`] it,
//! which removes the row and leaves the inbox's record of the message, so it is still never
//! handled again.
//!
//! The same on every database the inbox runs on (PostgreSQL, MySQL, SQLite); in SQL, each
//! function's documentation says what it runs.

use std::future::Future;

use diesel::backend::Backend;
use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, Binary, HasSqlType, Nullable, Text};
use diesel::{QueryResult, QueryableByName};

use super::store::{InboxConnection, MessageKey};
use crate::database;

/// A message an inbox consumer dead-lettered, as [`dead_letters`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// The consumer that gave up on it.
    pub consumer: String,
    /// Its `ce-source`; empty for a message without one.
    pub source: String,
    /// Its `ce-id` (or `Nats-Msg-Id`); `stream-sequence-N` for a message that could not be
    /// read.
    pub message_id: String,
    /// The subject it was delivered on.
    pub subject: String,
    /// Why: the handler's last error, what could not be read, or that it came late.
    pub error: String,
    /// JetStream's delivery count when it was dead-lettered.
    pub deliveries: i64,
    /// Its sequence in the stream it was delivered from.
    pub stream_sequence: i64,
    /// When it was dead-lettered (UTC; to the microsecond, or the millisecond on SQLite).
    pub dead_lettered_at: time::OffsetDateTime,
}

/// A dead letter whole, as [`dead_letter`] returns it: the [`DeadLetter`] fields and the
/// message as it was received.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetterDetail {
    /// What [`dead_letters`] shows of it.
    pub letter: DeadLetter,
    /// Its headers: a JSON object of each name to the array of its values.
    pub headers: serde_json::Value,
    /// Its payload, as received.
    pub payload: Vec<u8>,
}

/// The dead letters of `consumer` (of every consumer when `None`), oldest first, at most
/// `limit` (none when it is 0 or less).
///
/// In SQL: `SELECT * FROM outbox_inbox_dead_letters WHERE consumer = .. ORDER BY
/// dead_lettered_at LIMIT ..`.
///
/// # Errors
/// The database's error, or [`diesel::result::Error::DeserializationError`] for a time out
/// of range.
pub async fn dead_letters<C: InboxConnection>(
    conn: &mut C,
    consumer: Option<&str>,
    limit: i64,
) -> QueryResult<Vec<DeadLetter>> {
    conn.list(consumer, limit.max(0))
        .await?
        .into_iter()
        .map(DeadLetter::try_from)
        .collect()
}

/// The sources under which `consumer` dead-lettered a message with the id `message_id`, in
/// byte order: one, unless producers of several sources used the same id (CloudEvents makes
/// an id unique within its source only); none when there is no such dead letter.
///
/// # Errors
/// The database's error.
pub async fn dead_letter_sources<C: InboxConnection>(
    conn: &mut C,
    consumer: &str,
    message_id: &str,
) -> QueryResult<Vec<String>> {
    let rows = conn.sources(consumer, message_id).await?;
    Ok(rows.into_iter().map(|row| row.source).collect())
}

/// The dead letter of `consumer` with the message's `source` and `message_id`, whole; `None`
/// when there is none.
///
/// # Errors
/// The database's error, or [`diesel::result::Error::DeserializationError`] for headers that
/// are not JSON or a time out of range (the migrations refuse both).
pub async fn dead_letter<C: InboxConnection>(
    conn: &mut C,
    consumer: &str,
    source: &str,
    message_id: &str,
) -> QueryResult<Option<DeadLetterDetail>> {
    let key = MessageKey {
        consumer,
        source,
        message_id,
    };
    conn.show(key)
        .await?
        .map(DeadLetterDetail::try_from)
        .transpose()
}

/// Deletes the dead letter of `consumer` with the message's `source` and `message_id`, once
/// an operator has dealt with it. The consumer's record of the message in `outbox_inbox`
/// stays, so a redelivery is still dropped as a duplicate (until retention deletes that
/// record). Returns whether there was such a dead letter.
///
/// In SQL: `DELETE FROM outbox_inbox_dead_letters WHERE consumer = .. AND source = .. AND
/// message_id = ..`.
///
/// # Errors
/// The database's error; then nothing changed.
pub async fn discard_dead_letter<C: InboxConnection>(
    conn: &mut C,
    consumer: &str,
    source: &str,
    message_id: &str,
) -> QueryResult<bool> {
    let key = MessageKey {
        consumer,
        source,
        message_id,
    };
    conn.discard(key).await
}

/// Deletes every dead letter of `consumer` (of every consumer when `None`), as
/// [`discard_dead_letter`] does one; returns how many.
///
/// In SQL: `DELETE FROM outbox_inbox_dead_letters WHERE consumer = ..`.
///
/// # Errors
/// The database's error; then nothing changed.
pub async fn discard_dead_letters<C: InboxConnection>(
    conn: &mut C,
    consumer: Option<&str>,
) -> QueryResult<usize> {
    conn.discard_all(consumer).await
}

/// How many dead letters each consumer has, for the consumers that have any, in byte order.
///
/// In SQL: `SELECT consumer, count(*) FROM outbox_inbox_dead_letters GROUP BY consumer`.
///
/// # Errors
/// The database's error.
pub async fn dead_letter_counts<C: InboxConnection>(
    conn: &mut C,
) -> QueryResult<Vec<(String, i64)>> {
    let rows = conn.counts().await?;
    Ok(rows
        .into_iter()
        .map(|row| (row.consumer, row.dead_letters))
        .collect())
}

// The module is private, so `DeadLetterStore` cannot be named or implemented outside the
// crate, and the crate-private types in its signatures stay out of reach.
#[allow(private_interfaces, private_bounds)]
pub(crate) mod sealed {
    use super::*;

    /// A database's statements for the inbox's dead-letter functions.
    pub trait DeadLetterStore {
        /// The rows of [`super::dead_letters`].
        fn list(
            &mut self,
            consumer: Option<&str>,
            limit: i64,
        ) -> impl Future<Output = QueryResult<Vec<LetterRow>>> + Send;

        /// The rows of [`super::dead_letter_sources`].
        fn sources(
            &mut self,
            consumer: &str,
            message_id: &str,
        ) -> impl Future<Output = QueryResult<Vec<SourceRow>>> + Send;

        /// The row of [`super::dead_letter`].
        fn show(
            &mut self,
            key: MessageKey<'_>,
        ) -> impl Future<Output = QueryResult<Option<DetailRow>>> + Send;

        /// The deletion of [`super::discard_dead_letter`].
        fn discard(
            &mut self,
            key: MessageKey<'_>,
        ) -> impl Future<Output = QueryResult<bool>> + Send;

        /// The deletion of [`super::discard_dead_letters`].
        fn discard_all(
            &mut self,
            consumer: Option<&str>,
        ) -> impl Future<Output = QueryResult<usize>> + Send;

        /// The rows of [`super::dead_letter_counts`].
        fn counts(&mut self) -> impl Future<Output = QueryResult<Vec<CountRow>>> + Send;
    }
}

/// A dead letter as each database's query returns it: the time in microseconds since the
/// epoch (UTC).
#[derive(QueryableByName)]
struct LetterRow {
    #[diesel(sql_type = Text)]
    consumer: String,
    #[diesel(sql_type = Text)]
    source: String,
    #[diesel(sql_type = Text)]
    message_id: String,
    #[diesel(sql_type = Text)]
    subject: String,
    #[diesel(sql_type = Text)]
    error: String,
    #[diesel(sql_type = BigInt)]
    deliveries: i64,
    #[diesel(sql_type = BigInt)]
    stream_sequence: i64,
    #[diesel(sql_type = BigInt)]
    dead_lettered_us: i64,
}

/// A dead letter whole, as each database's query returns it.
#[derive(QueryableByName)]
struct DetailRow {
    #[diesel(embed)]
    letter: LetterRow,
    #[diesel(sql_type = Text)]
    headers: String,
    #[diesel(sql_type = Binary)]
    payload: Vec<u8>,
}

/// A dead letter's source.
#[derive(QueryableByName)]
struct SourceRow {
    #[diesel(sql_type = Text)]
    source: String,
}

/// A consumer's count of dead letters.
#[derive(QueryableByName)]
struct CountRow {
    #[diesel(sql_type = Text)]
    consumer: String,
    #[diesel(sql_type = BigInt)]
    dead_letters: i64,
}

/// A value read from `outbox_inbox_dead_letters.{column}` that the type cannot hold.
fn unreadable(column: &str, error: impl std::fmt::Display) -> diesel::result::Error {
    diesel::result::Error::DeserializationError(
        format!("outbox_inbox_dead_letters.{column} cannot be read: {error}").into(),
    )
}

impl TryFrom<LetterRow> for DeadLetter {
    type Error = diesel::result::Error;

    fn try_from(row: LetterRow) -> QueryResult<Self> {
        let dead_lettered_at = database::time_from_micros(
            row.dead_lettered_us,
            "outbox_inbox_dead_letters.dead_lettered_at",
        )?;
        Ok(Self {
            consumer: row.consumer,
            source: row.source,
            message_id: row.message_id,
            subject: row.subject,
            error: row.error,
            deliveries: row.deliveries,
            stream_sequence: row.stream_sequence,
            dead_lettered_at,
        })
    }
}

impl TryFrom<DetailRow> for DeadLetterDetail {
    type Error = diesel::result::Error;

    fn try_from(row: DetailRow) -> QueryResult<Self> {
        Ok(Self {
            letter: row.letter.try_into()?,
            headers: serde_json::from_str(&row.headers).map_err(|e| unreadable("headers", e))?,
            payload: row.payload,
        })
    }
}

/// How a database's SQL reads the table and names its parameters.
struct Dialect {
    /// A key column (consumer, source, message id) as text.
    key: fn(&str) -> String,
    /// A time column as microseconds since the epoch.
    us: fn(&str) -> String,
    /// The headers of the dead letter `d` as JSON text.
    headers: &'static str,
    /// The `n`th parameter, from 1.
    parameter: fn(usize) -> String,
}

impl Dialect {
    /// The columns of a [`LetterRow`].
    fn letter_columns(&self) -> String {
        format!(
            "{} AS consumer, {} AS source, {} AS message_id, d.subject, d.error, d.deliveries, \
             d.stream_sequence, {} AS dead_lettered_us",
            (self.key)("d.consumer"),
            (self.key)("d.source"),
            (self.key)("d.message_id"),
            (self.us)("d.dead_lettered_at"),
        )
    }

    /// `WHERE` of one dead letter by its key, the first three parameters; its columns
    /// qualified by `table` (`d.`, or empty).
    fn by_key(&self, table: &str) -> String {
        let p = self.parameter;
        format!(
            "WHERE {table}consumer = {} AND {table}source = {} AND {table}message_id = {}",
            p(1),
            p(2),
            p(3)
        )
    }

    /// [`dead_letters`]'s query: the consumer (or NULL) twice, then the limit.
    fn list(&self) -> String {
        let p = self.parameter;
        format!(
            "SELECT {} FROM outbox_inbox_dead_letters d \
             WHERE {} IS NULL OR d.consumer = {} \
             ORDER BY d.dead_lettered_at, d.consumer, d.source, d.message_id LIMIT {}",
            self.letter_columns(),
            p(1),
            p(2),
            p(3)
        )
    }

    /// [`dead_letter_sources`]'s query: the consumer, then the message id.
    fn sources(&self) -> String {
        let p = self.parameter;
        format!(
            "SELECT {} AS source FROM outbox_inbox_dead_letters d \
             WHERE d.consumer = {} AND d.message_id = {} ORDER BY d.source",
            (self.key)("d.source"),
            p(1),
            p(2)
        )
    }

    /// [`dead_letter`]'s query.
    fn show(&self) -> String {
        format!(
            "SELECT {}, {} AS headers, d.payload FROM outbox_inbox_dead_letters d {}",
            self.letter_columns(),
            self.headers,
            self.by_key("d.")
        )
    }

    /// [`discard_dead_letter`]'s statement.
    fn discard(&self) -> String {
        format!("DELETE FROM outbox_inbox_dead_letters {}", self.by_key(""))
    }

    /// [`discard_dead_letters`]' statement: the consumer (or NULL) twice.
    fn discard_all(&self) -> String {
        let p = self.parameter;
        format!(
            "DELETE FROM outbox_inbox_dead_letters WHERE {} IS NULL OR consumer = {}",
            p(1),
            p(2)
        )
    }

    /// [`dead_letter_counts`]'s query.
    fn counts(&self) -> String {
        format!(
            "SELECT {} AS consumer, count(*) AS dead_letters FROM outbox_inbox_dead_letters d \
             GROUP BY d.consumer ORDER BY d.consumer",
            (self.key)("d.consumer")
        )
    }
}

/// `sql` of the database `DB`, to bind.
fn query<'a, DB: Backend>(sql: String) -> BoxedSqlQuery<'a, DB, SqlQuery> {
    diesel::sql_query(sql).into_boxed()
}

/// A database whose statements here bind text and integers.
trait Binds: Backend + HasSqlType<Text> + HasSqlType<BigInt> + HasSqlType<Nullable<Text>> {}

impl<DB> Binds for DB where
    DB: Backend + HasSqlType<Text> + HasSqlType<BigInt> + HasSqlType<Nullable<Text>>
{
}

/// `sql` with the message's key bound to its first three parameters.
fn keyed<'a, DB>(sql: String, key: MessageKey<'a>) -> BoxedSqlQuery<'a, DB, SqlQuery>
where
    DB: Binds,
    &'a str: ToSql<Text, DB>,
{
    query(sql)
        .bind::<Text, _>(key.consumer)
        .bind::<Text, _>(key.source)
        .bind::<Text, _>(key.message_id)
}

/// `sql` with `consumer` (or NULL) bound to its first two parameters.
fn of_consumer<'a, DB>(sql: String, consumer: Option<&'a str>) -> BoxedSqlQuery<'a, DB, SqlQuery>
where
    DB: Binds,
    Option<&'a str>: ToSql<Nullable<Text>, DB>,
{
    query(sql)
        .bind::<Nullable<Text>, _>(consumer)
        .bind::<Nullable<Text>, _>(consumer)
}

/// [`Dialect::sources`] bound.
fn sourced<'a, DB>(
    dialect: &Dialect,
    consumer: &'a str,
    message_id: &'a str,
) -> BoxedSqlQuery<'a, DB, SqlQuery>
where
    DB: Binds,
    &'a str: ToSql<Text, DB>,
{
    query(dialect.sources())
        .bind::<Text, _>(consumer)
        .bind::<Text, _>(message_id)
}

/// Implements [`sealed::DeadLetterStore`] for the connection `$conn` of the backend
/// `$backend`, with the SQL of `$dialect`.
macro_rules! dead_letter_store {
    ($conn:ty, $backend:ty, $dialect:expr) => {
        // The trait is crate-private in effect (see `sealed`).
        #[allow(private_interfaces)]
        impl sealed::DeadLetterStore for $conn {
            async fn list(
                &mut self,
                consumer: Option<&str>,
                limit: i64,
            ) -> QueryResult<Vec<LetterRow>> {
                use diesel_async::RunQueryDsl;
                of_consumer::<$backend>($dialect.list(), consumer)
                    .bind::<BigInt, _>(limit)
                    .load(self)
                    .await
            }

            async fn sources(
                &mut self,
                consumer: &str,
                message_id: &str,
            ) -> QueryResult<Vec<SourceRow>> {
                use diesel_async::RunQueryDsl;
                sourced::<$backend>(&$dialect, consumer, message_id)
                    .load(self)
                    .await
            }

            async fn show(&mut self, key: MessageKey<'_>) -> QueryResult<Option<DetailRow>> {
                use diesel::OptionalExtension;
                use diesel_async::RunQueryDsl;
                keyed::<$backend>($dialect.show(), key)
                    .get_result(self)
                    .await
                    .optional()
            }

            async fn discard(&mut self, key: MessageKey<'_>) -> QueryResult<bool> {
                use diesel_async::RunQueryDsl;
                let deleted = keyed::<$backend>($dialect.discard(), key)
                    .execute(self)
                    .await?;
                Ok(deleted == 1)
            }

            async fn discard_all(&mut self, consumer: Option<&str>) -> QueryResult<usize> {
                use diesel_async::RunQueryDsl;
                of_consumer::<$backend>($dialect.discard_all(), consumer)
                    .execute(self)
                    .await
            }

            async fn counts(&mut self) -> QueryResult<Vec<CountRow>> {
                use diesel_async::RunQueryDsl;
                query::<$backend>($dialect.counts()).load(self).await
            }
        }
    };
}

#[cfg(feature = "postgres")]
dead_letter_store!(
    diesel_async::AsyncPgConnection,
    diesel::pg::Pg,
    Dialect {
        key: |column| column.to_owned(),
        us: |column| format!("(extract(epoch FROM {column}) * 1000000)::int8"),
        headers: "d.headers::text",
        parameter: |n| format!("${n}"),
    }
);

// The key columns are VARBINARY (compared byte for byte), read back as text.
#[cfg(feature = "mysql")]
dead_letter_store!(
    diesel_async::AsyncMysqlConnection,
    diesel::mysql::Mysql,
    Dialect {
        key: |column| format!("CAST({column} AS CHAR)"),
        us: |column| format!("TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {column})"),
        headers: "d.headers",
        parameter: |_| "?".to_owned(),
    }
);

// The times are UTC text to the millisecond (see the SQLite migrations).
#[cfg(feature = "sqlite")]
dead_letter_store!(
    crate::sqlite::AsyncSqliteConnection,
    diesel::sqlite::Sqlite,
    Dialect {
        key: |column| column.to_owned(),
        us: |column| {
            format!("CAST(ROUND((julianday({column}) - 2440587.5) * 86400000.0) AS INTEGER) * 1000")
        },
        headers: "d.headers",
        parameter: |_| "?".to_owned(),
    }
);
