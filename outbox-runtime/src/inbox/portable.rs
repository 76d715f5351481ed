//! The inbox's statements that MySQL and SQLite write alike (`?` placeholders, the same SQL):
//! built here, bound to the message, and run by `super::mysql` and `super::sqlite`.

use diesel::backend::Backend;
use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, Binary, HasSqlType, Nullable, Text};

use super::store::{DeadLetter, MessageKey, Place, Recorded, unread_id};

/// A statement of `DB` with its binds so far.
pub(crate) type Statement<'a, DB> = BoxedSqlQuery<'a, DB, SqlQuery>;

/// A database whose statements here bind text, integers and bytes.
pub(crate) trait Qmark:
    Backend + HasSqlType<Text> + HasSqlType<BigInt> + HasSqlType<Binary>
{
}

#[cfg(feature = "mysql")]
impl Qmark for diesel::mysql::Mysql {}
#[cfg(feature = "sqlite")]
impl Qmark for diesel::sqlite::Sqlite {}

/// `sql`, to bind.
pub(crate) fn query<DB: Backend>(sql: &'static str) -> Statement<'static, DB> {
    diesel::sql_query(sql).into_boxed()
}

/// Binds the message's key (consumer, source, message id) to the next three `?`.
pub(crate) fn keyed<'a, DB>(query: Statement<'a, DB>, key: MessageKey<'a>) -> Statement<'a, DB>
where
    DB: Qmark,
    &'a str: ToSql<Text, DB>,
{
    query
        .bind::<Text, _>(key.consumer)
        .bind::<Text, _>(key.source)
        .bind::<Text, _>(key.message_id)
}

/// Binds the consumer, the source and the aggregate (type, id) of an event to the next four
/// `?`.
pub(crate) fn keyed_aggregate<'a, DB>(
    query: Statement<'a, DB>,
    key: MessageKey<'a>,
    place: Place<'a>,
) -> Statement<'a, DB>
where
    DB: Qmark,
    &'a str: ToSql<Text, DB>,
{
    query
        .bind::<Text, _>(key.consumer)
        .bind::<Text, _>(key.source)
        .bind::<Text, _>(place.aggregate_type)
        .bind::<Text, _>(place.aggregate_id)
}

/// The dead letter's row: `insert` is the statement with its nine `?` (key, subject,
/// headers, payload, error, deliveries, stream sequence) and the database's way of leaving
/// a row that is there already.
pub(crate) fn dead_letter<'a, DB>(
    insert: &'static str,
    letter: &'a DeadLetter<'a>,
) -> Statement<'a, DB>
where
    DB: Qmark,
    &'a str: ToSql<Text, DB>,
    String: ToSql<Text, DB>,
    &'a [u8]: ToSql<Binary, DB>,
    i64: ToSql<BigInt, DB>,
{
    keyed(query(insert), letter.key)
        .bind::<Text, _>(letter.subject)
        .bind::<Text, _>(letter.headers.to_string())
        .bind::<Binary, _>(letter.payload)
        .bind::<Text, _>(letter.error)
        .bind::<BigInt, _>(letter.deliveries)
        .bind::<BigInt, _>(letter.stream_sequence)
}

/// Records that the consumer applied the event at `place` over a gap after `after_seq`.
pub(crate) fn gap<'a, DB>(
    key: MessageKey<'a>,
    place: Place<'a>,
    after_seq: i64,
    reason: &'a str,
) -> Statement<'a, DB>
where
    DB: Qmark,
    &'a str: ToSql<Text, DB>,
    i64: ToSql<BigInt, DB>,
{
    keyed_aggregate(
        query(
            "INSERT INTO outbox_inbox_gaps (consumer, source, aggregate_type, aggregate_id, \
                 after_seq, next_seq, stream_sequence, reason) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        ),
        key,
        place,
    )
    .bind::<BigInt, _>(after_seq)
    .bind::<BigInt, _>(place.seq)
    .bind::<BigInt, _>(place.stream_sequence)
    .bind::<Text, _>(reason)
}

/// Whether the consumer settled a message, as a row `settled` of 1 or 0: by its `source` and
/// `message_id`, or, for one it could not read, by its stream sequence.
pub(crate) fn settled<'a, DB>(
    consumer: &'a str,
    source: &'a str,
    message_id: Option<&'a str>,
    stream_sequence: u64,
) -> Statement<'a, DB>
where
    DB: Qmark,
    &'a str: ToSql<Text, DB>,
    Option<&'a str>: ToSql<Nullable<Text>, DB>,
    String: ToSql<Text, DB>,
{
    query(
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM outbox_inbox WHERE consumer = ? \
             AND ((source = ? AND message_id = ?) OR (source = '' AND message_id = ?))) \
         THEN 1 ELSE 0 END AS settled",
    )
    .bind::<Text, _>(consumer)
    .bind::<Text, _>(source)
    .bind::<Nullable<Text>, _>(message_id)
    .bind::<Text, _>(unread_id(stream_sequence))
}

/// Whether `consumer` has a position in some aggregate, as a row `settled` of 1 or 0 (read
/// as [`Settled`]).
pub(crate) fn has_positions<'a, DB>(consumer: &'a str) -> Statement<'a, DB>
where
    DB: Qmark,
    &'a str: ToSql<Text, DB>,
{
    query(
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM outbox_inbox_positions WHERE consumer = ?) \
         THEN 1 ELSE 0 END AS settled",
    )
    .bind::<Text, _>(consumer)
}

/// The row of [`settled`] and [`has_positions`].
#[derive(diesel::QueryableByName)]
pub(crate) struct Settled {
    #[diesel(sql_type = BigInt)]
    settled: i64,
}

impl Settled {
    pub(crate) fn settled(&self) -> bool {
        self.settled != 0
    }
}

/// The consumer's position in an aggregate before a message moves it: the last sequence
/// applied (0 for none) and the stream sequence of its message.
#[derive(diesel::QueryableByName)]
pub(crate) struct Position {
    #[diesel(sql_type = BigInt)]
    last_seq: i64,
    #[diesel(sql_type = BigInt)]
    stream_sequence: i64,
}

impl Position {
    /// What recording the event at `place` finds from here (see [`Recorded::at`]).
    pub(crate) fn recorded(&self, place: Place<'_>, accept_gap: bool) -> Recorded {
        Recorded::at(place, accept_gap, self.last_seq, self.stream_sequence)
    }
}
