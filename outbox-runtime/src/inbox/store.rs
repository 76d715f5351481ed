//! The inbox's statements on each database, behind one trait: what each one guarantees.
//!
//! - [`sealed::InboxStore::record`] runs first in the transaction that applies a message: it
//!   records the message for the consumer (unique on consumer, `ce-source` and `ce-id`: a
//!   second delivery finds the row and changes nothing) and, for an event of an aggregate,
//!   moves the consumer's position in that aggregate to the event only when it is the next
//!   one. The position row stays locked until the transaction ends (on SQLite the whole
//!   database does: `BEGIN IMMEDIATE`), so the instances of a consumer apply one aggregate's
//!   events one at a time and in `ce-sequence` order.
//! - [`sealed::InboxStore::finish`] runs last, after the handler: it fails when the handler
//!   ended the transaction itself, so no effect is acked without its inbox row. On
//!   PostgreSQL and MySQL a message delivered once, whose handler emitted no events, needs
//!   no other work from it: the COMMIT makes the same check in its own round trip
//!   (`crate::unit_of_work::UnitOfWork::check_at_commit`), and the statement is not sent.
//! - [`sealed::InboxStore::count_failure`] runs after a handler failure rolled back: handler
//!   failures, not deliveries, decide when a message is dead-lettered.
//!
//! PostgreSQL runs them as the functions of its migrations (`super::queries`); MySQL and
//! SQLite as the statements of `super::mysql` and `super::sqlite` (those they share in
//! `super::portable`).

use std::future::Future;
use std::ops::DerefMut;
use std::time::Duration;

use diesel::sql_types::{BigInt, Integer, Text};
use diesel::{QueryResult, QueryableByName};
use diesel_async::pooled_connection::PoolableConnection;

use super::InboxConfig;
use super::letters::sealed::DeadLetterStore;
use crate::database::{ConnectError, Kind, Limits};
use crate::unit_of_work::{BackendConnection, UnitOfWorkError};

/// The message a statement is about: the consumer and the message's identity.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MessageKey<'a> {
    pub consumer: &'a str,
    /// `ce-source`, or empty.
    pub source: &'a str,
    /// `ce-id` (or `Nats-Msg-Id`), or a stand-in for a message without one.
    pub message_id: &'a str,
}

/// An event's place in its aggregate, for [`record`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Place<'a> {
    pub aggregate_type: &'a str,
    pub aggregate_id: &'a str,
    /// `ce-sequence`.
    pub seq: i64,
    /// The message's sequence in the stream.
    pub stream_sequence: i64,
}

/// What [`record`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// The message was recorded already: a duplicate.
    Duplicate,
    /// Recorded, and (for an event of an aggregate) it is the next one, or the caller
    /// accepted a gap: the consumer's position moved to it from `previous_seq` (`None` for
    /// a message without an aggregate).
    Next { previous_seq: Option<i64> },
    /// Recorded, but an earlier event of the aggregate has not been applied: `last_seq` is
    /// the last applied (0 for none), at stream sequence `stream_sequence`.
    Gap { last_seq: i64, stream_sequence: i64 },
    /// Recorded, but a later event of the aggregate was applied already (`last_seq`).
    Late { last_seq: i64 },
}

/// A message to dead-letter, whole.
pub(crate) struct DeadLetter<'a> {
    pub key: MessageKey<'a>,
    pub subject: &'a str,
    pub headers: &'a serde_json::Value,
    pub payload: &'a [u8],
    pub error: &'a str,
    pub deliveries: i64,
    pub stream_sequence: i64,
}

/// An aggregate whose position a parked event waits on (see `dispatch`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Aggregate {
    /// `ce-source`, or empty.
    pub source: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
}

/// A consumer's position in an aggregate, as each database's lookup returns it.
#[derive(QueryableByName)]
pub(crate) struct PositionRow {
    #[diesel(sql_type = Text)]
    source: String,
    #[diesel(sql_type = Text)]
    aggregate_type: String,
    #[diesel(sql_type = Text)]
    aggregate_id: String,
    #[diesel(sql_type = BigInt)]
    last_seq: i64,
}

impl PositionRow {
    /// The aggregate and the last sequence applied in it.
    pub(crate) fn into_position(self) -> (Aggregate, i64) {
        let aggregate = Aggregate {
            source: self.source,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
        };
        (aggregate, self.last_seq)
    }
}

/// A consumer's name, as [`sealed::InboxStore::consumers`] reads it.
#[derive(QueryableByName)]
pub(crate) struct ConsumerRow {
    #[diesel(sql_type = Text)]
    pub consumer: String,
}

/// A message's handler failures, as [`sealed::InboxStore::count_failure`] reads them.
#[derive(QueryableByName)]
pub(crate) struct FailuresRow {
    #[diesel(sql_type = Integer)]
    failures: i32,
}

impl FailuresRow {
    pub(crate) fn count(&self) -> u32 {
        u32::try_from(self.failures).unwrap_or(1)
    }
}

/// The id under which the inbox records a message it could not read: its stream sequence.
pub(crate) fn unread_id(stream_sequence: u64) -> String {
    format!("stream-sequence-{stream_sequence}")
}

// PostgreSQL's `outbox_inbox_record` decides the same in SQL.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
impl Recorded {
    /// What [`sealed::InboxStore::record`] found for an event at `place`, from the consumer's
    /// position in its aggregate before the call (`last_seq` at `stream_sequence`), and
    /// whether the position moves: to the next event, or over a gap the caller accepted
    /// (never back).
    pub(crate) fn at(
        place: Place<'_>,
        accept_gap: bool,
        last_seq: i64,
        stream_sequence: i64,
    ) -> Self {
        if last_seq == place.seq - 1 || (accept_gap && last_seq < place.seq) {
            Self::Next {
                previous_seq: Some(last_seq),
            }
        } else if last_seq >= place.seq {
            Self::Late { last_seq }
        } else {
            Self::Gap {
                last_seq,
                stream_sequence,
            }
        }
    }
}

/// What opens the inbox's connections: the configuration's, cloned into its pool.
#[derive(Clone)]
pub(crate) struct Session {
    pub limits: Limits,
    /// The longest a message's transaction waits for the inbox: its handler's
    /// `handler_timeout`, plus a `statement_timeout` for the statements around it. PostgreSQL
    /// sessions set it as their `idle_in_transaction_session_timeout`, whatever the
    /// database's, so a handler that works that long without the database can still commit;
    /// before, under a shorter database setting, such a message failed at its commit (a
    /// database failure, counting no attempt) at every redelivery. MySQL's sessions keep at
    /// least it as their `wait_timeout` (and at least 60 s).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub idle_in_transaction: Duration,
    #[cfg(feature = "postgres")]
    pub connector: Option<crate::database::Connector>,
}

impl Session {
    pub(crate) fn of(config: &InboxConfig) -> Self {
        Self {
            limits: Limits {
                connect_timeout: config.connect_timeout,
                statement_timeout: config.statement_timeout,
            },
            idle_in_transaction: config
                .handler_timeout
                .saturating_add(config.statement_timeout),
            #[cfg(feature = "postgres")]
            connector: config.connector.clone(),
        }
    }
}

/// A connection an [`Inbox`](super::Inbox) runs on: `AsyncPgConnection` (feature
/// `postgres`), `AsyncMysqlConnection` (feature `mysql`) or
/// [`AsyncSqliteConnection`](crate::sqlite::AsyncSqliteConnection) (feature `sqlite`).
/// Sealed: the inbox's statements are written for these three.
pub trait InboxConnection:
    BackendConnection + PoolableConnection + sealed::InboxStore + DeadLetterStore
{
}

impl<C> InboxConnection for C where
    C: BackendConnection + PoolableConnection + sealed::InboxStore + DeadLetterStore
{
}

// The module is private, so `InboxStore` cannot be named or implemented outside the crate,
// and the crate-private types in its signatures stay out of reach.
#[allow(private_interfaces, private_bounds)]
pub(crate) mod sealed {
    use super::*;

    /// The inbox's statements on one database (see the module documentation).
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is not a connection an inbox can run on",
        label = "an inbox runs on an AsyncPgConnection, AsyncMysqlConnection or AsyncSqliteConnection"
    )]
    pub trait InboxStore: Sized + Send + 'static {
        /// The database it connects to.
        const KIND: Kind;
        /// The inbox's pool of connections (diesel-async's deadpool).
        type Pool: Send + Sync + 'static;
        /// A connection the pool hands out.
        type Pooled: DerefMut<Target = Self> + Send + 'static;

        /// A pool of up to `max_size` connections to `database_url`, each opened by
        /// [`connect`](Self::connect); none is opened yet.
        fn pool(
            database_url: String,
            session: Session,
            max_size: usize,
        ) -> Result<Self::Pool, String>;

        /// A connection from `pool`: an idle one (checked first), or a new one.
        fn pooled(pool: &Self::Pool) -> impl Future<Output = Result<Self::Pooled, String>> + Send;

        /// Opens a connection of the inbox's pool to `database_url`, within the connect
        /// timeout; refuses a URL of another database.
        fn connect(
            database_url: &str,
            session: &Session,
        ) -> impl Future<Output = Result<Self, ConnectError>> + Send;

        /// Records the message and, when `place` is given, moves the consumer's position in
        /// the aggregate to it if it is the next one (or if `accept_gap`, when the caller has
        /// found that the events in between will not come). In the open transaction.
        fn record(
            &mut self,
            key: MessageKey<'_>,
            place: Option<Place<'_>>,
            accept_gap: bool,
        ) -> impl Future<Output = QueryResult<Recorded>> + Send;

        /// Checks that the transaction is still the inbox's own (the handler did not end
        /// it), and forgets the message's failed attempts when `clear_attempts`.
        fn finish(
            &mut self,
            key: MessageKey<'_>,
            clear_attempts: bool,
        ) -> impl Future<Output = Result<(), UnitOfWorkError>> + Send;

        /// Counts a handler failure of the message, outside any transaction of it; returns
        /// the failures so far.
        fn count_failure(
            &mut self,
            key: MessageKey<'_>,
            error: &str,
        ) -> impl Future<Output = QueryResult<u32>> + Send;

        /// Writes a dead letter in the open transaction (which also records the message, so
        /// a later delivery of it is skipped).
        fn insert_dead_letter(
            &mut self,
            letter: &DeadLetter<'_>,
        ) -> impl Future<Output = QueryResult<()>> + Send;

        /// Records the message and writes its dead letter, in a transaction of their own
        /// (a message dead-lettered outside its aggregate's order).
        fn dead_letter_alone(
            &mut self,
            letter: &DeadLetter<'_>,
        ) -> impl Future<Output = QueryResult<()>> + Send;

        /// Records that the consumer applied an event over a gap in its aggregate's sequence.
        fn insert_gap(
            &mut self,
            key: MessageKey<'_>,
            place: Place<'_>,
            after_seq: i64,
            reason: &str,
        ) -> impl Future<Output = QueryResult<()>> + Send;

        /// Whether the consumer settled a message (applied, skipped or dead-lettered it): by
        /// its `source` and `message_id`, or, for one it could not read, by its stream
        /// sequence.
        fn settled(
            &mut self,
            consumer: &str,
            source: &str,
            message_id: Option<&str>,
            stream_sequence: u64,
        ) -> impl Future<Output = QueryResult<bool>> + Send;

        /// The consumer's position (last applied sequence) in each of `aggregates` that has
        /// one.
        fn positions(
            &mut self,
            consumer: &str,
            aggregates: &[Aggregate],
        ) -> impl Future<Output = QueryResult<Vec<(Aggregate, i64)>>> + Send;

        /// Deletes up to `limit` of `consumer`'s inbox rows handled more than `older_than`
        /// ago, oldest first, and failed attempts as old; returns how many inbox rows.
        fn purge(
            &mut self,
            consumer: &str,
            older_than: Duration,
            limit: i64,
        ) -> impl Future<Output = QueryResult<usize>> + Send;

        /// The consumers with rows in `outbox_inbox`, in byte order.
        fn consumers(&mut self) -> impl Future<Output = QueryResult<Vec<String>>> + Send;

        /// What the connection's role or account lacks of the privileges the inbox needs, as
        /// a sentence naming each (the `privileges` module); `None` where it lacks none, and
        /// on SQLite, which has no privileges.
        fn lacking_privileges(
            &mut self,
        ) -> impl Future<Output = QueryResult<Option<String>>> + Send {
            async { Ok(None) }
        }

        /// Whether `consumer` has a position in some aggregate: it applied events before.
        fn has_positions(
            &mut self,
            consumer: &str,
        ) -> impl Future<Output = QueryResult<bool>> + Send;
    }
}

/// The pool items of [`sealed::InboxStore`] for a connection of diesel-async's deadpool.
macro_rules! deadpool_store {
    ($conn:ty) => {
        type Pool = diesel_async::pooled_connection::deadpool::Pool<$conn>;
        type Pooled =
            $crate::database::Pooled<diesel_async::pooled_connection::deadpool::Object<$conn>>;

        fn pool(
            database_url: String,
            session: $crate::inbox::store::Session,
            max_size: usize,
        ) -> Result<Self::Pool, String> {
            use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
            let mut manager = ManagerConfig::default();
            manager.custom_setup = Box::new(move |url| {
                let (url, session) = (url.to_owned(), session.clone());
                Box::pin(async move {
                    <$conn as $crate::inbox::store::sealed::InboxStore>::connect(&url, &session)
                        .await
                        .map_err(|e| diesel::ConnectionError::BadConnection(e.to_string()))
                })
            });
            Self::Pool::builder(AsyncDieselConnectionManager::new_with_config(
                database_url,
                manager,
            ))
            .max_size(max_size)
            .build()
            .map_err(|e| e.to_string())
        }

        async fn pooled(pool: &Self::Pool) -> Result<Self::Pooled, String> {
            // Closed rather than given back to the pool inside a transaction: a message's
            // future dropped with `run`'s, a panic unwinding out of a message's transaction,
            // a `replay_dead_letter` future dropped by its caller would otherwise leave the
            // consumer's position in an aggregate locked against every instance.
            $crate::database::Pooled::get(pool)
                .await
                .map_err(|error| match error {
                    // The connection's own error, without deadpool's "Error occurred while
                    // creating a new object: " before it.
                    diesel_async::pooled_connection::deadpool::PoolError::Backend(error) => {
                        error.to_string()
                    }
                    other => other.to_string(),
                })
        }
    };
}
pub(crate) use deadpool_store;
