//! The unit of work: business writes and their events in one database transaction.
//!
//! This is the answer to the dual-write problem. A service that writes its database and then
//! publishes to a broker loses the event when it crashes in between, and publishes a ghost
//! event when the write rolls back after the publish. Here the events are rows of the
//! outbox table, inserted by the same transaction as the business rows: both commit or
//! neither does, and the message relay publishes what committed.
//!
//! [`Outbox::transaction`] runs a closure inside one transaction. The closure receives a
//! [`UnitOfWork`]: its [`conn`](UnitOfWork::conn) for diesel queries as usual,
//! [`track`](UnitOfWork::track) to hand over an aggregate whose events should be written, and
//! [`emit`](UnitOfWork::emit) for a standalone event. The handle is borrowed for the closure
//! only, so events cannot reach the outbox outside a transaction or after its commit.

use std::collections::HashSet;
use std::future::Future;

use diesel::connection::TransactionManagerStatus;
use diesel_async::pooled_connection::PoolableConnection;
#[cfg(feature = "postgres")]
use diesel_async::{AnsiTransactionManager, AsyncPgConnection};
use diesel_async::{AsyncConnection, TransactionManager};
use uuid::Uuid;

use std::sync::{Arc, Mutex};

use crate::aggregate::{Aggregate, CommitHandle, LateEvents};
use crate::causality::{Causality, MAX_ID_BYTES, Traceparent};
use crate::event::{DomainEvent, PayloadError};
#[cfg(feature = "postgres")]
use crate::outbox::queries;
use crate::outbox::queries::NewEvent;
#[cfg(feature = "postgres")]
use crate::outbox::require_migrations;
use crate::outbox::{MissingMigrations, Outbox};
use crate::subject::{InvalidToken, MAX_SUBJECT_BYTES, event_subject, validate_token};

/// How a unit of work opens its transaction: the setting marks it as the unit of work's, so
/// that the outbox's writes can tell when a COMMIT or ROLLBACK sent inside the closure ended
/// it (the `outbox_assert_unit_of_work` function of the migrations). One round trip, as a
/// plain BEGIN.
#[cfg(feature = "postgres")]
pub(crate) const BEGIN: &str = "BEGIN; SET LOCAL outbox.unit_of_work = 'on'";

/// The start of the message `outbox_assert_unit_of_work` raises.
const TRANSACTION_ENDED: &str = "outbox: the unit of work's transaction was ended";

/// A unit of work could not commit; the transaction was rolled back and nothing was written,
/// but for one variant: [`CommitOutcomeUnknown`], a connection lost while its COMMIT was in
/// flight, where the server may have committed before the connection went.
///
/// [`CommitOutcomeUnknown`]: UnitOfWorkError::CommitOutcomeUnknown
#[derive(Debug, thiserror::Error)]
pub enum UnitOfWorkError {
    /// A value that becomes a subject token (or the `ce-subject` header) is not a valid NATS
    /// subject token.
    #[error(
        "{role} {value:?} of {aggregate_type} {aggregate_id:?} (event {event_type}) \
         is not a valid NATS subject token: {reason}"
    )]
    InvalidSubjectToken {
        /// Which value: aggregate type, aggregate id, partition key or event type.
        role: TokenRole,
        /// The rejected value.
        value: String,
        /// The aggregate type of the event.
        aggregate_type: String,
        /// The aggregate id of the event.
        aggregate_id: String,
        /// The event type of the event.
        event_type: String,
        /// What is wrong with the value.
        reason: InvalidToken,
    },
    /// An event's subject, which joins the prefix, the aggregate type, the partition key and
    /// the event type, is longer than [`MAX_SUBJECT_BYTES`].
    #[error(
        "the subject of {aggregate_type} {aggregate_id:?} (event {event_type}) would be {len} \
         bytes long, over the limit of {MAX_SUBJECT_BYTES} bytes a published subject may hold"
    )]
    SubjectTooLong {
        /// The subject's length in bytes.
        len: usize,
        /// The aggregate type of the event.
        aggregate_type: String,
        /// The aggregate id of the event.
        aggregate_id: String,
        /// The event type of the event.
        event_type: String,
    },
    /// An event's payload is longer than the outbox's bound ([`Outbox::max_payload`],
    /// by default [`DEFAULT_MAX_PAYLOAD_BYTES`]): the broker would refuse its message.
    ///
    /// [`DEFAULT_MAX_PAYLOAD_BYTES`]: crate::outbox::DEFAULT_MAX_PAYLOAD_BYTES
    #[error(
        "the payload of {aggregate_type} {aggregate_id:?} (event {event_type}) is {len} bytes \
         long, over the limit of {max} bytes this outbox writes (Outbox::max_payload: the \
         NATS server's max_payload less the relay's headers); keep large data elsewhere and \
         let the event refer to it, or raise the server's max_payload and this bound together"
    )]
    PayloadTooLarge {
        /// The payload's length in bytes (its JSON text).
        len: usize,
        /// The bound, [`Outbox::max_payload`].
        max: usize,
        /// The aggregate type of the event.
        aggregate_type: String,
        /// The aggregate id of the event.
        aggregate_id: String,
        /// The event type of the event.
        event_type: String,
    },
    /// A correlation or causation id is longer than [`MAX_ID_BYTES`].
    #[error(
        "the {what} is {len} bytes long, over the limit of {MAX_ID_BYTES} bytes an id may hold"
    )]
    IdTooLong {
        /// Which id: `correlation id` or `causation id`.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// An event's dedup key (`#[event(dedup_key)]`) was already taken by a committed event,
    /// and the unit of work's [`DuplicateEvents`] is [`Fail`](DuplicateEvents::Fail).
    #[error(
        "event {event_type} of {aggregate_type} {aggregate_id:?} has the dedup key {dedup_key:?}, \
         which an earlier event already took; nothing was written"
    )]
    DuplicateEvent {
        /// The key.
        dedup_key: String,
        /// The aggregate type of the event.
        aggregate_type: String,
        /// The aggregate id of the event.
        aggregate_id: String,
        /// The event type of the event.
        event_type: String,
    },
    /// An event's dedup key is empty, longer than [`MAX_ID_BYTES`], or holds a NUL (which a
    /// PostgreSQL `text` cannot).
    #[error(
        "event {event_type} of {aggregate_type} {aggregate_id:?}: its dedup key is not storable: \
         {reason}"
    )]
    InvalidDedupKey {
        /// The aggregate type of the event.
        aggregate_type: String,
        /// The aggregate id of the event.
        aggregate_id: String,
        /// The event type of the event.
        event_type: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The closure ended the unit of work's transaction itself (a `COMMIT` or `ROLLBACK` sent
    /// on [`UnitOfWork::conn`]): its events are not written, so none is published without the
    /// business rows it describes. What the closure wrote after ending the transaction was
    /// committed on its own, outside the unit of work.
    #[error(
        "the unit of work's transaction was ended inside its closure (a COMMIT or ROLLBACK sent \
         on uow.conn()); its events were not written. Return an error from the closure to roll \
         back instead"
    )]
    TransactionEnded,
    /// The outbox tables are missing or older than this version of the toolkit.
    #[error(transparent)]
    MissingMigrations(#[from] MissingMigrations),
    /// An event's payload did not serialize.
    #[error("event of {aggregate_type} {aggregate_id:?}: {source}")]
    Payload {
        /// The aggregate type of the event.
        aggregate_type: String,
        /// The aggregate id of the event.
        aggregate_id: String,
        /// What serialization reported.
        #[source]
        source: PayloadError,
    },
    /// The connection was already inside a transaction. A unit of work must own its
    /// transaction: it drains aggregates after COMMIT, which a savepoint is not.
    #[error(
        "Outbox::transaction was called on a connection that is already in a transaction; \
         a unit of work must own its transaction, so call it outside any other"
    )]
    NestedTransaction,
    /// The database reported an error (including one from the closure's own queries); the
    /// transaction was rolled back.
    #[error(transparent)]
    Database(#[from] diesel::result::Error),
    /// The role (on MySQL, the account) the connection logs in as lacks a privilege on the
    /// outbox's own tables or functions that the unit of work (or the inbox) needs: the
    /// database refused the statement that writes the events (PostgreSQL's "permission denied
    /// for table outbox_events", MySQL's "INSERT command denied to user ..."), and the
    /// transaction was rolled back. The message names what to run: the statements `outbox
    /// grants service <role>` prints ([`crate::privileges::grants`]), as the tables' owner;
    /// `outbox grants inbox <role>` for the inbox's tables. Told by the server's English
    /// words: on a service's own connection to a server set to word its errors in another
    /// language (`lc_messages`; PostgreSQL's or MySQL's), such a refusal is [`Self::Database`].
    #[error("{source}{hint}")]
    MissingPrivilege {
        /// The database's refusal.
        #[source]
        source: diesel::result::Error,
        /// What to run, after the refusal: `": the role the service logs in as lacks a
        /// privilege the service needs; as the tables' owner, run ..."`.
        hint: String,
    },
    /// The connection was lost while the unit of work's COMMIT was in flight: the COMMIT
    /// failed, and the ROLLBACK sent after it could not run either. The server may have
    /// committed before the connection went (business rows and events together; the relay
    /// then publishes the events) or not (neither is written); no client can tell which from
    /// the lost connection (PostgreSQL 15 documentation, 9.26 "System Information
    /// Functions", `pg_xact_status`: "disconnected while a COMMIT is in progress").
    ///
    /// Look for the unit of work's business rows on a new connection before retrying: a
    /// retry of a unit of work that did commit writes its events a second time, with new
    /// ids, which the relay publishes and JetStream and the inbox do not drop. An event with
    /// a dedup key (`#[event(dedup_key)]`) is written once however often it is retried, so
    /// a unit of work whose events all have one can be retried blindly.
    ///
    /// On PostgreSQL, with [`Outbox::report_transaction_ids`], the error carries the
    /// transaction's id, and [`transaction_status`] asks the server, on a new connection,
    /// what became of it: the answer PostgreSQL keeps for exactly this case (PostgreSQL 15
    /// documentation, 9.26 "System Information Functions and Operators", `pg_xact_status`),
    /// but for a server that crashed since, which cannot always tell.
    ///
    /// Only PostgreSQL and MySQL connections report it; an SQLite connection cannot be lost.
    #[error(
        "the connection was lost while the unit of work's COMMIT was in flight: it may have \
         committed, events included, or not; {} before retrying ({source})",
        match transaction {
            Some(id) => format!("ask `transaction_status` for transaction {id}"),
            None => "look for its business rows".to_owned(),
        }
    )]
    CommitOutcomeUnknown {
        /// The error the COMMIT's round trip failed with.
        #[source]
        source: diesel::result::Error,
        /// The transaction's id, for [`transaction_status`]: on PostgreSQL when
        /// [`Outbox::report_transaction_ids`] asks; `None` otherwise, and on MySQL, whose
        /// servers keep no such record.
        transaction: Option<TransactionId>,
    },
}

impl UnitOfWorkError {
    /// The error of a statement of the outbox or the inbox: [`Self::TransactionEnded`] when
    /// the statement found that the closure had ended the transaction,
    /// [`Self::MissingPrivilege`] when the role lacks a privilege on the toolkit's tables, else
    /// [`Self::Database`].
    pub(crate) fn from_database(error: diesel::result::Error) -> Self {
        if let Some((kind, who)) = crate::database::lacking_privilege(&error) {
            let hint = crate::database::refusal_hint(&error, kind, who);
            return Self::MissingPrivilege {
                source: error,
                hint,
            };
        }
        match &error {
            diesel::result::Error::DatabaseError(_, info)
                if info.message().starts_with(TRANSACTION_ENDED) =>
            {
                Self::TransactionEnded
            }
            _ => Self::Database(error),
        }
    }
}

/// The id of a unit of work's PostgreSQL transaction: its `xid8`, the 32-bit transaction id
/// with the epoch that keeps it from wrapping around
/// (`pg_current_xact_id()`, PostgreSQL 13+; PostgreSQL 15 documentation, 9.26 "System
/// Information Functions and Operators", "Transaction ID and Snapshot Information
/// Functions"), with a mark of the server's life it was handed out in.
/// [`UnitOfWorkError::CommitOutcomeUnknown`] carries it, and [`transaction_status`] asks a
/// server what became of it. Displayed as the `xid8` number PostgreSQL shows.
///
/// The mark is there because an id is unique only among transactions whose work reached the
/// disk: a server that crashes loses its unflushed WAL, and after recovery hands out again
/// the ids of the transactions whose COMMIT it lost (first seen in a run of
/// `database_crash::a_postgresql_crash_loses_no_committed_event_publishes_no_ghost_and_applies_each_once`:
/// a unit of work the crash cut off, its row not written, whose id the server then called
/// committed; made certain by
/// `database_crash::a_crash_hands_a_lost_transactions_id_out_again_and_transaction_status_does_not_call_it_committed`).
/// The mark is the time the server last reset its shared statistics
/// (`pg_stat_get_bgwriter_stat_reset_time()`), which PostgreSQL does at the end of every
/// crash recovery (and on `pg_stat_reset_shared('bgwriter')`); another server, a promoted
/// standby, has its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransactionId {
    /// Read from the server as an `int8`: never negative.
    xid8: i64,
    /// The server's statistics reset time, in microseconds since the Unix epoch; `None`
    /// where the server reported none.
    server_mark: Option<i64>,
}

impl TransactionId {
    /// The id as PostgreSQL's `xid8` number.
    pub fn get(self) -> u64 {
        self.xid8.unsigned_abs()
    }
}

impl std::fmt::Display for TransactionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.xid8.fmt(f)
    }
}

/// What became of a transaction, by the server's own record (`pg_xact_status`; see
/// [`transaction_status`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransactionStatus {
    /// It committed: its business rows and its events are written, and the relay publishes
    /// the events. Retrying would do it all a second time.
    Committed,
    /// It rolled back (a COMMIT that never reached the server, a server that crashed before
    /// the COMMIT's record was flushed): nothing of it is written, and retrying is safe.
    Aborted,
    /// Still running: the server has not yet seen that its connection is gone (it ends the
    /// transaction when it does: at once for a closed connection, after its TCP keepalive
    /// for a host that vanished), or it is a prepared transaction. Ask again.
    InProgress,
    /// The server cannot tell. Either it crashed (or reset its shared statistics, or is
    /// another server: a promoted standby) since the transaction began, and its record of
    /// the id may be that of a later transaction that was given the same id after the crash
    /// lost this one's COMMIT; or it no longer keeps the transaction's commit status (vacuum
    /// discards that of transactions older than every table's frozen horizon). Look for the
    /// business rows.
    Undecidable,
}

/// What became of the transaction `id`: the answer to
/// [`UnitOfWorkError::CommitOutcomeUnknown`], asked on a new connection to the same
/// PostgreSQL server (PostgreSQL 15 documentation, 9.26, `pg_xact_status`: "Applications
/// might use this function, for example, to determine whether their transaction committed
/// or aborted after the application and database server become disconnected while a COMMIT
/// is in progress"). One round trip.
///
/// A server that crashed since the transaction began may have given its id to a later
/// transaction (see [`TransactionId`]), and so may a standby promoted since (one that had not
/// received the transaction's commit record never saw it). Across a crash, or on another
/// server, the answer is [`TransactionStatus::Aborted`] when the server's record says
/// aborted (a transaction whose COMMIT survived keeps its id, so an aborted record is this
/// one's, or that of an id whose first holder's COMMIT was lost), and
/// [`TransactionStatus::Undecidable`] otherwise: never a `Committed` that may be another
/// transaction's.
///
/// # Errors
/// A database error: the connection failed, or the server has not yet handed out `id`
/// ("transaction ID ... is in the future": another server's id, or one whose COMMIT a
/// crash lost before the server handed the id out again).
#[cfg(feature = "postgres")]
pub async fn transaction_status(
    conn: &mut AsyncPgConnection,
    id: TransactionId,
) -> diesel::QueryResult<TransactionStatus> {
    use diesel_async::RunQueryDsl;
    TransactionStatusQuery::of(id)
        .get_result::<TransactionStatusRow>(conn)
        .await?
        .status(id)
}

/// The SQL of the server's mark ([`TransactionId`]): the time it last reset its shared
/// statistics, in microseconds since the Unix epoch, as `server_mark`. One text for the
/// statement that reads an id and the one that judges it, so that the two marks compare.
#[cfg(feature = "postgres")]
macro_rules! server_mark_sql {
    () => {
        "(extract(epoch FROM pg_stat_get_bgwriter_stat_reset_time()) * 1e6)::int8 AS server_mark"
    };
}

#[cfg(feature = "postgres")]
crate::outbox::statement::statement! {
    /// [`transaction_status`]'s question (and `sync::transaction_status`'s).
    pub(crate) struct TransactionStatusQuery {
        id: i64 => diesel::sql_types::Int8,
    }
    sql = concat!("SELECT pg_xact_status($1::text::xid8) AS status, ", server_mark_sql!());
}

#[cfg(feature = "postgres")]
impl TransactionStatusQuery {
    /// The question for `id`.
    pub(crate) fn of(id: TransactionId) -> Self {
        Self { id: id.xid8 }
    }
}

/// [`TransactionStatusQuery`]'s answer.
#[cfg(feature = "postgres")]
#[derive(diesel::QueryableByName)]
pub(crate) struct TransactionStatusRow {
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    status: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Int8>)]
    server_mark: Option<i64>,
}

#[cfg(feature = "postgres")]
impl TransactionStatusRow {
    /// What became of `id`: the status `pg_xact_status` named, unless the server's mark
    /// differs from the one `id` was handed out under (see [`transaction_status`]); an error
    /// for a name it does not give.
    pub(crate) fn status(&self, id: TransactionId) -> diesel::QueryResult<TransactionStatus> {
        let status = match self.status.as_deref() {
            Some("committed") => TransactionStatus::Committed,
            Some("aborted") => TransactionStatus::Aborted,
            Some("in progress") => TransactionStatus::InProgress,
            None => TransactionStatus::Undecidable,
            Some(other) => {
                return Err(diesel::result::Error::DeserializationError(
                    format!("pg_xact_status answered {other:?}").into(),
                ));
            }
        };
        let same_server = id.server_mark.is_some() && id.server_mark == self.server_mark;
        Ok(match status {
            TransactionStatus::Committed | TransactionStatus::InProgress if !same_server => {
                TransactionStatus::Undecidable
            }
            status => status,
        })
    }
}

#[cfg(feature = "postgres")]
crate::outbox::statement::statement! {
    /// The unit of work's transaction id, pipelined with its [`BEGIN`]: `NULL` unless the
    /// transaction that BEGIN opened and marked runs it, so that should it ever reach the
    /// server before the BEGIN, it names no transaction rather than its own autocommitted
    /// one.
    pub(crate) struct CurrentTransaction {}
    sql = concat!(
        "SELECT CASE WHEN current_setting('outbox.unit_of_work', true) = 'on' \
         THEN pg_current_xact_id()::text::int8 END AS id, ",
        server_mark_sql!()
    );
}

#[cfg(feature = "postgres")]
#[derive(diesel::QueryableByName)]
pub(crate) struct CurrentTransactionRow {
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Int8>)]
    id: Option<i64>,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Int8>)]
    server_mark: Option<i64>,
}

#[cfg(feature = "postgres")]
impl CurrentTransactionRow {
    /// The id, where the statement ran in the unit of work's transaction.
    pub(crate) fn id(&self) -> Option<TransactionId> {
        let xid8 = self.id.filter(|id| *id >= 0)?;
        Some(TransactionId {
            xid8,
            server_mark: self.server_mark,
        })
    }
}

/// Opens a unit of work's transaction with [`BEGIN`] and asks for its id in the same round
/// trip (tokio-postgres's pipelining: each request is sent when its future is first polled,
/// and `join!` polls the BEGIN first). diesel's transaction manager is told of the BEGIN, as
/// its own `begin_transaction` would, so that COMMIT and ROLLBACK go through it.
///
/// Asking for the id gives the transaction one at its start rather than at its first
/// write: a unit of work writes anyway. Only when [`Outbox::report_transaction_ids`] asks.
#[cfg(feature = "postgres")]
async fn begin_and_identify(
    conn: &mut AsyncPgConnection,
) -> diesel::QueryResult<Option<TransactionId>> {
    use diesel_async::RunQueryDsl;
    outside_transaction(conn)?;
    let (begun, identified) = {
        let shared: &AsyncPgConnection = conn;
        let (mut beginning, mut identifying) = (shared, shared);
        futures::join!(
            diesel_async::SimpleAsyncConnection::batch_execute(&mut beginning, BEGIN),
            CurrentTransaction {}.get_result::<CurrentTransactionRow>(&mut identifying),
        )
    };
    // Whatever the BEGIN's outcome, so that the ROLLBACK below ends what it may have opened
    // (outside a transaction, a ROLLBACK only warns).
    record_begin(conn)?;
    let error = match (begun, identified) {
        (Ok(()), Ok(row)) => return Ok(row.id()),
        (Err(error), _) | (Ok(()), Err(error)) => error,
    };
    // The unit of work never started, and nothing above it rolls back: end the transaction
    // here, or the connection would be left in it. A rollback that fails leaves the
    // transaction manager broken, so that a pool drops the connection.
    let _ = AnsiTransactionManager::rollback_transaction(conn).await;
    Err(error)
}

/// Fails as diesel's own `begin_transaction` would when `conn` is already in a transaction:
/// the check before a BEGIN sent past diesel's transaction manager, pipelined with another
/// request (a unit of work's with its id, a relay batch's with its claim).
#[cfg(feature = "postgres")]
pub(crate) fn outside_transaction(conn: &mut AsyncPgConnection) -> diesel::QueryResult<()> {
    match AnsiTransactionManager::transaction_manager_status_mut(conn).transaction_depth()? {
        Some(_) => Err(diesel::result::Error::AlreadyInTransaction),
        None => Ok(()),
    }
}

/// Tells diesel's transaction manager of a BEGIN sent past it (see [`outside_transaction`]),
/// as its own `begin_transaction` would record it, so that the COMMIT and ROLLBACK that end
/// the transaction go through it.
#[cfg(feature = "postgres")]
pub(crate) fn record_begin(conn: &mut AsyncPgConnection) -> diesel::QueryResult<()> {
    AnsiTransactionManager::transaction_manager_status_mut(conn)
        .transaction_state()?
        .change_transaction_depth(diesel::connection::TransactionDepthChange::IncreaseDepth)
}

/// The role of a value in an event's subject, for [`UnitOfWorkError::InvalidSubjectToken`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenRole {
    /// The aggregate type (second subject token).
    AggregateType,
    /// The aggregate id (`ce-subject`, and the default partition key).
    AggregateId,
    /// The partition key (third subject token).
    PartitionKey,
    /// The event type (fourth subject token).
    EventType,
}

impl std::fmt::Display for TokenRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::AggregateType => "aggregate type",
            Self::AggregateId => "aggregate id",
            Self::PartitionKey => "partition key",
            Self::EventType => "event type",
        })
    }
}

impl Outbox {
    /// Runs `f` inside one database transaction and writes the events it hands over to the
    /// outbox table just before COMMIT.
    ///
    /// `f` receives a [`UnitOfWork`]. All events it collected are written in one multi-row
    /// INSERT at the end of the transaction; then the transaction commits, and only then are
    /// the tracked aggregates' buffers drained. When `f` returns an error, or writing the
    /// events fails, or a value is not a valid subject token, the transaction is rolled back:
    /// no business row and no outbox row is written, and the aggregates keep their pending
    /// events.
    ///
    /// `conn` is a [`BackendConnection`] (an [`AsyncPgConnection`]; with the features
    /// `mysql` and `sqlite`, an `AsyncMysqlConnection` or an `AsyncSqliteConnection`) or a
    /// deadpool guard of one; it must not already be inside a transaction.
    ///
    /// # Errors
    /// `f`'s own error, or a [`UnitOfWorkError`] converted into `E`: after each of them the
    /// transaction was rolled back, but for [`UnitOfWorkError::CommitOutcomeUnknown`] (the
    /// connection was lost while the COMMIT was in flight, and it may have committed).
    ///
    /// # The handle stays in the closure
    /// `uow` is borrowed for the closure only, so that no event can be handed over outside
    /// the transaction or after its COMMIT. Keeping it (in a variable declared outside the
    /// closure, or by returning it) does not compile; rustc says "lifetime may not live long
    /// enough ... returning this value requires that `'1` must outlive `'2`", pointing at the
    /// closure, where `'1` is the handle's borrow. Return what the closure computed instead
    /// (an id, a row), and record later events in the next unit of work.
    ///
    /// # Cancellation
    /// Like diesel-async's `transaction`, dropping the returned future part-way (a request's
    /// timeout, a `select!`) leaves the transaction open on `conn`, holding the rows it
    /// locked, until the connection is closed. Where the future may be dropped, take `conn`
    /// from the pool with [`Pooled::get`](crate::Pooled::get): dropped inside the transaction,
    /// that guard closes the connection, and the database rolls the transaction back at once.
    /// deadpool's own guard gives the connection back to the pool with the transaction open,
    /// and diesel-async discards it only when the pool hands it out again. What the
    /// transaction did is rolled back, and its aggregates keep their pending events, unless
    /// the future was dropped while the COMMIT was in flight: then it may have committed (see
    /// [`UnitOfWorkError::CommitOutcomeUnknown`] for the same case seen, and an event's dedup
    /// key, `#[event(dedup_key)]`, for a retry that writes it once).
    pub async fn transaction<P, T, E, F>(&self, conn: &mut P, f: F) -> Result<T, E>
    where
        P: OutboxConnection + ?Sized,
        F: for<'u, 'c> AsyncFnOnce(&'u mut UnitOfWork<'c, P::Connection>) -> Result<T, E>,
        E: From<UnitOfWorkError>,
    {
        self.transaction_with(conn.connection(), Causality::root(), f)
            .await
    }

    /// [`transaction`](Self::transaction) for events of an existing conversation (the inbox's
    /// units of work).
    pub(crate) async fn transaction_with<C, T, E, F>(
        &self,
        conn: &mut C,
        causality: Causality,
        f: F,
    ) -> Result<T, E>
    where
        C: BackendConnection,
        F: for<'u, 'c> AsyncFnOnce(&'u mut UnitOfWork<'c, C>) -> Result<T, E>,
        E: From<UnitOfWorkError>,
    {
        let depth = C::TransactionManager::transaction_manager_status_mut(conn)
            .transaction_depth()
            .map_err(UnitOfWorkError::from)?;
        if depth.is_some() {
            return Err(UnitOfWorkError::NestedTransaction.into());
        }
        let transaction = conn
            .begin_unit_of_work(self)
            .await
            .map_err(UnitOfWorkError::from)?;

        let outcome = {
            let mut unit = UnitOfWork {
                conn,
                buffer: EventBuffer::new(self, causality),
                checked_commit: false,
                transaction,
            };
            match f(&mut unit).await {
                Ok(value) => {
                    let checked = unit.checked_commit;
                    match unit.flush().await {
                        Ok(commit_handles) => Ok((value, commit_handles, checked)),
                        Err(error) => Err(Failed::Flush(error)),
                    }
                }
                Err(error) => Err(Failed::Closure(error)),
            }
        };
        match outcome {
            Ok((value, flushed, checked)) => {
                let Flushed {
                    drains,
                    had_events,
                    insert_and_commit,
                } = flushed;
                if let Some(sql) = insert_and_commit {
                    if let Err(failed) = commit_checked(conn, &sql).await {
                        let refused = failed.outcome_unknown(transaction)?;
                        return flush_failed(conn, refused.error.into(), refused.rolled_back).await;
                    }
                } else {
                    // Here the flush wrote any events itself, and writing them checked the
                    // transaction already (and on MySQL released the mark the checked commit
                    // would release).
                    match C::CHECKED_COMMIT
                        .filter(|_| checked && !had_events)
                        .or(C::COMMIT)
                    {
                        Some(sql) => {
                            commit_checked(conn, sql).await.map_err(|failed| {
                                match failed.outcome_unknown(transaction) {
                                    Ok(refused) => C::checked_commit_error(refused.error),
                                    Err(unknown) => unknown,
                                }
                            })?
                        }
                        None => C::TransactionManager::commit_transaction(conn)
                            .await
                            .map_err(UnitOfWorkError::from)?,
                    }
                }
                if had_events {
                    C::events_committed();
                }
                crash_point!("unit_of_work::after_commit", |_| Err(
                    UnitOfWorkError::from(simulated_crash()).into()
                ));
                for (handle, count) in drains {
                    handle.mark_committed(count);
                }
                Ok(value)
            }
            Err(failed) => {
                let rolled_back = C::TransactionManager::rollback_transaction(conn).await;
                match failed {
                    Failed::Closure(error) => rolled_back_with(rolled_back, error),
                    Failed::Flush(error) => flush_failed(conn, error, rolled_back).await,
                }
            }
        }
    }
}

/// The error of a unit of work whose events could not be written, after its rollback
/// (`rolled_back`).
async fn flush_failed<C: BackendConnection, T, E: From<UnitOfWorkError>>(
    conn: &mut C,
    error: UnitOfWorkError,
    rolled_back: diesel::QueryResult<()>,
) -> Result<T, E> {
    // A database error from the outbox's own statement may mean that the schema is missing
    // or behind: say so, rather than "function ... does not exist".
    let error = match error {
        UnitOfWorkError::Database(error) => UnitOfWorkError::from_database(error),
        other => other,
    };
    let error =
        match error {
            UnitOfWorkError::Database(
                database_error @ diesel::result::Error::DatabaseError(..),
            ) if rolled_back.is_ok() => match conn.missing_migrations().await {
                Ok(Err(missing)) => UnitOfWorkError::MissingMigrations(missing),
                _ => UnitOfWorkError::Database(database_error),
            },
            other => other,
        };
    rolled_back_with(rolled_back, E::from(error))
}

/// What a unit of work's flush leaves for its COMMIT.
struct Flushed {
    /// The tracked aggregates' buffers to drain after COMMIT, with how many events each gave.
    drains: Vec<Drain>,
    /// Whether the unit of work had events: written by the flush, or to be written by
    /// `insert_and_commit`, or dropped as duplicates of dedup keys taken before.
    had_events: bool,
    /// The statements that write the events and COMMIT, in one round trip
    /// ([`sealed::Backend::insert_and_commit`]); `None` when the events are written already,
    /// or there were none.
    insert_and_commit: Option<String>,
}

/// Why a unit of work rolls back.
enum Failed<E> {
    /// The closure returned its error.
    Closure(E),
    /// Writing the events failed.
    Flush(UnitOfWorkError),
}

/// `error`, unless the rollback itself failed in a way that says more.
pub(crate) fn rolled_back_with<T, E: From<UnitOfWorkError>>(
    rolled_back: diesel::QueryResult<()>,
    error: E,
) -> Result<T, E> {
    match rolled_back {
        // A broken transaction manager means the rollback could not run; the original error
        // says more about why. "Not in a transaction" is diesel's sync connections saying
        // that the transaction already ended (a COMMIT or ROLLBACK sent by hand): nothing
        // was left to roll back.
        Ok(())
        | Err(
            diesel::result::Error::BrokenTransactionManager
            | diesel::result::Error::NotInTransaction,
        ) => Err(error),
        Err(rollback_error) => Err(UnitOfWorkError::from(rollback_error).into()),
    }
}

/// Commits the transaction with `sql`, statements that end in `COMMIT` (a unit of work's
/// [`sealed::Backend::CHECKED_COMMIT`] or [`sealed::Backend::insert_and_commit`], a relay
/// batch's `queries::finish_published_and_commit`), sent in one round trip, so that the
/// statements before the COMMIT cost no round trip of their own. Then tells diesel's
/// transaction manager that the transaction ended: it tracks only the COMMITs it sends
/// itself.
///
/// When a statement fails, the server skips the rest of the string (PostgreSQL 15
/// documentation, 55.2.2.1 "Multiple Statements in a Simple Query"; MySQL stops a
/// multi-statement string at its first error too): the COMMIT is not run, and the
/// transaction is rolled back here.
///
/// # Errors
/// The first failed statement's error (a check that found the transaction ended, the
/// insert's, or the COMMIT's), with the rollback's outcome; a failed rollback leaves the
/// transaction manager broken, so that a pool drops the connection.
pub(crate) async fn commit_checked<C: BackendConnection>(
    conn: &mut C,
    sql: &str,
) -> Result<(), CommitFailed> {
    let result = conn.batch_execute(sql).await;
    let ended = match &result {
        Ok(()) => Ok(()),
        // A failed COMMIT ends the transaction too; a ROLLBACK outside one only warns.
        Err(_) => conn.batch_execute("ROLLBACK").await,
    };
    let status = C::TransactionManager::transaction_manager_status_mut(conn);
    match &ended {
        Ok(()) => *status = TransactionManagerStatus::default(),
        Err(_) => status.set_in_error(),
    }
    result.map_err(|error| CommitFailed {
        error,
        rolled_back: ended,
    })
}

/// Why [`commit_checked`] did not commit.
pub(crate) struct CommitFailed {
    /// The first failed statement's error.
    pub(crate) error: diesel::result::Error,
    /// The rollback that followed.
    rolled_back: diesel::QueryResult<()>,
}

impl CommitFailed {
    /// [`UnitOfWorkError::CommitOutcomeUnknown`] when the rollback failed too: the
    /// connection is gone, and with it the answer to a COMMIT that may have run (a live
    /// connection runs a ROLLBACK, in a transaction or outside one). Else `self`: the
    /// server refused a statement, skipped the rest, and the transaction was rolled back.
    /// `transaction` is the transaction's id, where the database reported one.
    pub(crate) fn outcome_unknown(
        self,
        transaction: Option<TransactionId>,
    ) -> Result<Self, UnitOfWorkError> {
        match self.rolled_back {
            Ok(()) => Ok(self),
            Err(_) => Err(UnitOfWorkError::CommitOutcomeUnknown {
                source: self.error,
                transaction,
            }),
        }
    }
}

/// The error a crash point returns in tests: the process "dies" there.
pub(crate) fn simulated_crash() -> diesel::result::Error {
    diesel::result::Error::DatabaseError(
        diesel::result::DatabaseErrorKind::ClosedConnection,
        Box::new("simulated crash (a test's crash point)".to_owned()),
    )
}

/// What a unit of work does with an event whose dedup key (`#[event(dedup_key)]`) an earlier
/// committed event already took: a retried request that emits its event again.
///
/// JetStream drops a republished message inside the stream's duplicate window, and the inbox
/// drops a redelivered one after it; both dedup one message by its id. A dedup key dedups
/// two *events* that mean the same business fact, written by two units of work (a client that
/// retried after a timeout, two instances that took the same command).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DuplicateEvents {
    /// Write nothing for that event; the unit of work commits its other events and its
    /// business writes. The default.
    #[default]
    Skip,
    /// Fail the commit with [`UnitOfWorkError::DuplicateEvent`]: the transaction rolls back,
    /// its business writes included.
    Fail,
}

/// The events of one transaction, collected until COMMIT. Handed to the closure of
/// [`Outbox::transaction`], and to nothing else.
///
/// `C` is the transaction's connection: PostgreSQL's unless said otherwise, so
/// `UnitOfWork<'_>` is the unit of work on an [`AsyncPgConnection`].
#[cfg(feature = "postgres")]
pub struct UnitOfWork<'c, C: BackendConnection = AsyncPgConnection> {
    conn: &'c mut C,
    buffer: EventBuffer<'c>,
    /// Commit with [`sealed::Backend::CHECKED_COMMIT`] ([`Self::check_at_commit`]).
    checked_commit: bool,
    /// The transaction's id, where the database reported one ([`Self::transaction_id`]).
    transaction: Option<TransactionId>,
}

/// The events of one transaction, collected until COMMIT. Handed to the closure of
/// [`Outbox::transaction`], and to nothing else.
///
/// `C` is the transaction's connection (diesel-async's `AsyncMysqlConnection`, or
/// `outbox_runtime::sqlite::AsyncSqliteConnection`).
#[cfg(not(feature = "postgres"))]
pub struct UnitOfWork<'c, C: BackendConnection> {
    conn: &'c mut C,
    buffer: EventBuffer<'c>,
    /// Commit with [`sealed::Backend::CHECKED_COMMIT`] ([`Self::check_at_commit`]).
    checked_commit: bool,
    /// The transaction's id, where the database reported one ([`Self::transaction_id`]).
    transaction: Option<TransactionId>,
}

impl<'c, C: BackendConnection> UnitOfWork<'c, C> {
    /// The transaction's connection, for the business writes.
    pub fn conn(&mut self) -> &mut C {
        self.conn
    }

    /// Takes the aggregate's pending events into this unit of work, and every event recorded
    /// on it from now until the unit of work ends: they are written to the outbox at commit,
    /// in the order they were recorded, and drained from the aggregate once the commit
    /// succeeded. Tracking the same aggregate again changes nothing.
    ///
    /// An event that cannot be written (an id that is not a valid subject token, a payload
    /// that does not serialize) fails the commit with a [`UnitOfWorkError`] that names it.
    ///
    /// An aggregate value tracked by two units of work open at once (on two connections)
    /// gives the second only the events pending when it tracked it.
    pub fn track<A: Aggregate>(&mut self, aggregate: &mut A) {
        self.buffer.track(aggregate);
    }

    /// Writes a standalone event for the aggregate `aggregate_type` / `aggregate_id`, with
    /// no aggregate value behind it (an event about something this service does not model
    /// as an aggregate). Both must be valid NATS subject tokens; the commit fails otherwise.
    pub fn emit<E: DomainEvent>(&mut self, aggregate_type: &str, aggregate_id: &str, event: &E) {
        self.buffer.emit(aggregate_type, aggregate_id, event);
    }

    /// The id of this unit of work's transaction, as [`UnitOfWorkError::CommitOutcomeUnknown`]
    /// would carry it: `Some` on PostgreSQL when [`Outbox::report_transaction_ids`] asks (the
    /// transaction's `xid8`), else `None`. A service that logs it can later ask
    /// [`transaction_status`] about it.
    pub fn transaction_id(&self) -> Option<TransactionId> {
        self.transaction
    }

    /// The correlation id every event of this unit of work carries (`ce-correlationid`): a
    /// fresh one for a unit of work of [`Outbox::transaction`], the handled message's for the
    /// inbox's.
    pub fn correlation_id(&self) -> &str {
        &self.buffer.causality.correlation_id
    }

    /// The causation id every event of this unit of work carries (`ce-causationid`): the
    /// correlation id for a new conversation, the handled message's `ce-id` for the inbox's.
    pub fn causation_id(&self) -> &str {
        &self.buffer.causality.causation_id
    }

    /// Sets the conversation and cause of this unit of work's events, for a caller that
    /// carries them in already (an HTTP request's correlation id, a command's id).
    ///
    /// Each id holds at most [`MAX_ID_BYTES`]; a longer one fails the commit with
    /// [`UnitOfWorkError::IdTooLong`].
    pub fn set_correlation(
        &mut self,
        correlation_id: impl Into<String>,
        causation_id: impl Into<String>,
    ) {
        self.buffer
            .set_correlation(correlation_id.into(), causation_id.into());
    }

    /// The trace context this unit of work's events carry in their `traceparent` header.
    pub fn traceparent(&self) -> Option<&Traceparent> {
        self.buffer.causality.traceparent.as_ref()
    }

    /// Sets the trace context of this unit of work's events: the caller's current span, as a
    /// W3C `traceparent` (parse one with `str::parse`). The inbox sets it for a handled
    /// message that has one.
    pub fn set_traceparent(&mut self, traceparent: Traceparent) {
        self.buffer.causality.traceparent = Some(traceparent);
        // The vendor data of the trace this replaces does not go with the new one.
        self.buffer.causality.tracestate = None;
    }

    /// Sets what this unit of work does with an event whose dedup key an earlier committed
    /// event already took: write nothing for it ([`DuplicateEvents::Skip`], the default) or
    /// fail the commit ([`DuplicateEvents::Fail`]).
    pub fn set_duplicate_events(&mut self, duplicates: DuplicateEvents) {
        self.buffer.duplicates = duplicates;
    }

    /// How many events this unit of work will write at commit, so far (those recorded on
    /// tracked aggregates after `track` included).
    pub fn event_count(&self) -> usize {
        self.buffer.event_count()
    }

    /// Asks for the commit to check, in the COMMIT's round trip, that the transaction is
    /// still the unit of work's own, as the outbox's flush does before it writes events.
    /// `false`, and nothing asked, where the database has no such commit
    /// ([`sealed::Backend::CHECKED_COMMIT`]): the caller checks with a statement of its own.
    pub(crate) fn check_at_commit(&mut self) -> bool {
        self.checked_commit = C::CHECKED_COMMIT.is_some();
        self.checked_commit
    }

    /// Writes the collected events, those recorded on tracked aggregates after `track`
    /// included, or returns the statements that write them with the COMMIT; returns what to
    /// drain after COMMIT.
    async fn flush(self) -> Result<Flushed, UnitOfWorkError> {
        let Self { conn, buffer, .. } = self;
        let duplicates = buffer.duplicates;
        let causality = buffer.causality.clone();
        let (events, drains) = buffer.take()?;
        // Dedup keys are taken first, by a statement whose answer decides what is written.
        let insert_and_commit = if events.iter().all(|e| e.dedup_key.is_none()) {
            C::insert_and_commit(&events, &causality)
        } else {
            None
        };
        let had_events = !events.is_empty();
        if insert_and_commit.is_none() {
            conn.write_events(events, &causality, duplicates).await?;
        }
        Ok(Flushed {
            drains,
            had_events,
            insert_and_commit,
        })
    }
}

/// A database connection a unit of work runs on: diesel-async's [`AsyncPgConnection`]
/// (PostgreSQL); with the feature `mysql` its `AsyncMysqlConnection` (MySQL 8, MariaDB
/// 10.6+; see `outbox_runtime::mysql`); with the feature `sqlite` its
/// `SyncConnectionWrapper<SqliteConnection>` (SQLite 3.37+; see `outbox_runtime::sqlite`).
/// Each writes the events with statements of its own database.
///
/// Sealed: implemented by the toolkit for the connections it has statements for.
pub trait BackendConnection: AsyncConnection + Send + 'static + sealed::Backend {}

impl<C> BackendConnection for C where C: AsyncConnection + Send + 'static + sealed::Backend {}

/// What [`Outbox::transaction`] takes: a [`BackendConnection`], or a pool's guard around one
/// (deadpool's `Object`, as diesel-async's `pooled_connection::deadpool` hands it out, or the
/// toolkit's [`Pooled`](crate::Pooled), which closes a connection dropped inside a
/// transaction). The closure's [`UnitOfWork`] is on the connection itself either way.
///
/// For another pool's guard (bb8, mobc), pass `&mut *conn`: it derefs to the connection.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a connection a unit of work can run on",
    label = "a unit of work runs on an AsyncPgConnection (or AsyncMysqlConnection, AsyncSqliteConnection), or a deadpool guard of one",
    note = "for a pool's guard, pass `&mut *conn`: it derefs to the connection"
)]
pub trait OutboxConnection: Send {
    /// The database connection: `Self`, or the one inside the guard.
    type Connection: BackendConnection;

    /// The database connection.
    fn connection(&mut self) -> &mut Self::Connection;
}

impl<C: BackendConnection> OutboxConnection for C {
    type Connection = C;

    fn connection(&mut self) -> &mut C {
        self
    }
}

/// `OutboxConnection` for deadpool's guard of `$conn`.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
macro_rules! pooled_outbox_connection {
    ($conn:ty) => {
        impl OutboxConnection for diesel_async::pooled_connection::deadpool::Object<$conn> {
            type Connection = $conn;

            fn connection(&mut self) -> &mut $conn {
                self
            }
        }
    };
}

/// The toolkit's own guard, which closes a connection dropped inside a transaction rather
/// than give it back to its pool.
impl<O> OutboxConnection for crate::database::Pooled<O>
where
    O: std::ops::DerefMut<Target: BackendConnection + PoolableConnection> + Send,
{
    type Connection = O::Target;

    fn connection(&mut self) -> &mut O::Target {
        self
    }
}

#[cfg(feature = "postgres")]
pooled_outbox_connection!(AsyncPgConnection);
#[cfg(feature = "mysql")]
pooled_outbox_connection!(diesel_async::AsyncMysqlConnection);
#[cfg(feature = "sqlite")]
pooled_outbox_connection!(crate::sqlite::AsyncSqliteConnection);

// The module is private, so `Backend` cannot be named or implemented outside the crate, and
// the crate-private types in its signatures stay out of reach.
#[allow(private_interfaces)]
pub(crate) mod sealed {
    use super::*;

    /// What a unit of work needs from its database, beside diesel's transaction manager.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is not a connection a unit of work can run on",
        label = "a unit of work runs on an AsyncPgConnection (or AsyncMysqlConnection, AsyncSqliteConnection), or a deadpool guard of one",
        note = "for a pool's guard, pass `&mut *conn`: it derefs to the connection"
    )]
    pub trait Backend {
        /// Statements that check that the transaction is still the unit of work's own (not
        /// ended inside the closure), then COMMIT it, sent in one round trip
        /// ([`UnitOfWork::check_at_commit`]; used when the flush wrote no events, else the
        /// flush checked); `None` where the check takes a round trip of its own.
        const CHECKED_COMMIT: Option<&'static str> = None;

        /// The unit of work's plain COMMIT, sent through [`commit_checked`] so that a lost
        /// connection is told from a refused COMMIT
        /// ([`UnitOfWorkError::CommitOutcomeUnknown`]); `None` where diesel's transaction
        /// manager commits, on a connection that cannot be lost (SQLite's, in the process).
        const COMMIT: Option<&'static str> = None;

        /// The error of a failed [`Self::CHECKED_COMMIT`] or [`Self::COMMIT`]:
        /// [`UnitOfWorkError::TransactionEnded`] when its check found the transaction ended.
        fn checked_commit_error(error: diesel::result::Error) -> UnitOfWorkError {
            UnitOfWorkError::from_database(error)
        }

        /// Opens the unit of work's transaction; returns its id where the database reports
        /// one in the same round trip ([`TransactionId`]).
        fn begin_unit_of_work(
            &mut self,
            outbox: &Outbox,
        ) -> impl Future<Output = diesel::QueryResult<Option<TransactionId>>> + Send;

        /// Takes the events' dedup keys and writes the events that are not duplicates, with
        /// their sequences, inside the open transaction.
        fn write_events(
            &mut self,
            events: Vec<NewEvent>,
            causality: &Causality,
            duplicates: DuplicateEvents,
        ) -> impl Future<Output = Result<(), UnitOfWorkError>> + Send;

        /// Statements that write `events` (none with a dedup key) and then COMMIT, sent in
        /// one round trip instead of [`Self::write_events`] and a COMMIT of its own; `None`
        /// where the database has none for these events, or there are no events.
        fn insert_and_commit(_events: &[NewEvent], _causality: &Causality) -> Option<String> {
            None
        }

        /// Whether the outbox's migrations are applied, asked after a database error.
        fn missing_migrations(
            &mut self,
        ) -> impl Future<Output = diesel::QueryResult<Result<(), MissingMigrations>>> + Send;

        /// Called after a unit of work that wrote events committed (wakes the relays of this
        /// process on a database without notifications).
        fn events_committed() {}
    }

    #[cfg(feature = "postgres")]
    impl Backend for AsyncPgConnection {
        const CHECKED_COMMIT: Option<&'static str> =
            Some("SELECT outbox_assert_unit_of_work(); COMMIT");
        const COMMIT: Option<&'static str> = Some("COMMIT");

        async fn begin_unit_of_work(
            &mut self,
            outbox: &Outbox,
        ) -> diesel::QueryResult<Option<TransactionId>> {
            outbox.register_if_due(self).await;
            if outbox.reports_transaction_ids() {
                begin_and_identify(self).await
            } else {
                AnsiTransactionManager::begin_transaction_sql(self, BEGIN).await?;
                Ok(None)
            }
        }

        async fn write_events(
            &mut self,
            mut events: Vec<NewEvent>,
            causality: &Causality,
            duplicates: DuplicateEvents,
        ) -> Result<(), UnitOfWorkError> {
            if events.iter().any(|e| e.dedup_key.is_some()) {
                let taken = queries::take_dedup_keys(self, &events)
                    .await
                    .map_err(UnitOfWorkError::from_database)?;
                drop_duplicates(&mut events, &taken, duplicates)?;
            }
            if !events.is_empty() {
                queries::insert_events(self, &events, causality).await?;
            }
            Ok(())
        }

        fn insert_and_commit(events: &[NewEvent], causality: &Causality) -> Option<String> {
            queries::insert_and_commit(events, causality)
        }

        async fn missing_migrations(
            &mut self,
        ) -> diesel::QueryResult<Result<(), MissingMigrations>> {
            require_migrations(self).await
        }
    }
}

/// What collects a unit of work's events: the real [`UnitOfWork`], or the test kit's
/// in-memory one (`testing::InMemoryUnitOfWork`, feature `testing`). Service code that only
/// tracks aggregates and emits events can take `&mut impl CollectEvents` and be tested
/// without a database.
pub trait CollectEvents {
    /// As [`UnitOfWork::track`].
    fn track<A: Aggregate>(&mut self, aggregate: &mut A);

    /// As [`UnitOfWork::emit`].
    fn emit<E: DomainEvent>(&mut self, aggregate_type: &str, aggregate_id: &str, event: &E);
}

impl<C: BackendConnection> CollectEvents for UnitOfWork<'_, C> {
    fn track<A: Aggregate>(&mut self, aggregate: &mut A) {
        UnitOfWork::track(self, aggregate);
    }

    fn emit<E: DomainEvent>(&mut self, aggregate_type: &str, aggregate_id: &str, event: &E) {
        UnitOfWork::emit(self, aggregate_type, aggregate_id, event);
    }
}

/// Drops from `events` those at the positions in `taken` (sorted), whose dedup key an earlier
/// event took, or fails with the first of them, by `duplicates`. Before the INSERT, so that
/// the events written number their aggregates' sequences without a hole.
pub(crate) fn drop_duplicates(
    events: &mut Vec<NewEvent>,
    taken: &[usize],
    duplicates: DuplicateEvents,
) -> Result<(), UnitOfWorkError> {
    let Some(&first) = taken.first() else {
        return Ok(());
    };
    if duplicates == DuplicateEvents::Fail {
        let event = &events[first];
        return Err(UnitOfWorkError::DuplicateEvent {
            dedup_key: event.dedup_key.clone().unwrap_or_default(),
            aggregate_type: event.aggregate_type.clone(),
            aggregate_id: event.aggregate_id.clone(),
            event_type: event.event_type.to_owned(),
        });
    }
    let mut position = 0;
    events.retain(|event| {
        let duplicate = taken.binary_search(&position).is_ok();
        position += 1;
        if duplicate {
            tracing::info!(
                dedup_key = event.dedup_key.as_deref().unwrap_or_default(),
                aggregate_type = %event.aggregate_type,
                aggregate_id = %event.aggregate_id,
                event_type = event.event_type,
                "an earlier event took this dedup key: not written"
            );
            metrics::counter!(
                "outbox_duplicate_events_total",
                "aggregate_type" => event.aggregate_type.clone(),
            )
            .increment(1);
        }
        !duplicate
    });
    Ok(())
}

/// A tracked aggregate's buffer, and how many of its events to drain after COMMIT.
pub(crate) type Drain = (CommitHandle, usize);

/// What a unit of work collects until COMMIT, whatever writes it: the events, checked and
/// serialized, the aggregates to drain, and the first invalid event.
pub(crate) struct EventBuffer<'o> {
    outbox: &'o Outbox,
    /// The conversation, cause and trace of every event of this unit of work.
    pub(crate) causality: Causality,
    events: Vec<NewEvent>,
    /// Aggregates whose events were taken: drained after COMMIT, detached at the end.
    tracked: Vec<Tracked>,
    /// The addresses of their buffers ([`CommitHandle::buffer_address`]): an aggregate
    /// tracked again is found in constant time (a search of `tracked` made a unit of work of
    /// n aggregates quadratic: 1.3 G instructions for two of 10,000, callgrind).
    tracked_buffers: HashSet<usize>,
    /// The first invalid event; reported, and the transaction rolled back, at commit.
    error: Option<UnitOfWorkError>,
    /// What to do with an event whose dedup key is taken.
    pub(crate) duplicates: DuplicateEvents,
}

impl<'o> EventBuffer<'o> {
    pub(crate) fn new(outbox: &'o Outbox, causality: Causality) -> Self {
        Self {
            outbox,
            causality,
            events: Vec::new(),
            tracked: Vec::new(),
            tracked_buffers: HashSet::new(),
            error: None,
            duplicates: DuplicateEvents::default(),
        }
    }

    /// [`UnitOfWork::track`].
    pub(crate) fn track<A: Aggregate>(&mut self, aggregate: &mut A) {
        let handle = aggregate.pending().commit_handle();
        if !self.tracked_buffers.insert(handle.buffer_address()) {
            return;
        }
        let aggregate_id = aggregate.aggregate_id();
        let late = Arc::new(Late {
            outbox: self.outbox.clone(),
            aggregate_type: A::AGGREGATE_TYPE,
            aggregate_id: aggregate_id.clone(),
            events: Mutex::new(Vec::new()),
        });
        let attached = aggregate
            .pending()
            .attach(Arc::clone(&late) as Arc<dyn LateEvents<A::Event>>);
        let taken = aggregate.pending_events().len();
        for event in aggregate.pending_events() {
            let new_event = prepare(self.outbox, A::AGGREGATE_TYPE, &aggregate_id, event);
            self.push(new_event);
        }
        self.tracked.push(Tracked {
            handle,
            taken,
            late: attached.then_some(late as Arc<dyn TakeLate>),
        });
    }

    /// [`UnitOfWork::emit`].
    pub(crate) fn emit<E: DomainEvent>(
        &mut self,
        aggregate_type: &str,
        aggregate_id: &str,
        event: &E,
    ) {
        let new_event = prepare(self.outbox, aggregate_type, aggregate_id, event);
        self.push(new_event);
    }

    /// [`UnitOfWork::set_correlation`].
    pub(crate) fn set_correlation(&mut self, correlation_id: String, causation_id: String) {
        for (what, id) in [
            ("correlation id", &correlation_id),
            ("causation id", &causation_id),
        ] {
            if id.len() > MAX_ID_BYTES {
                self.error.get_or_insert(UnitOfWorkError::IdTooLong {
                    what,
                    len: id.len(),
                });
            }
        }
        self.causality.correlation_id = correlation_id;
        self.causality.causation_id = causation_id;
    }

    /// [`UnitOfWork::event_count`].
    pub(crate) fn event_count(&self) -> usize {
        let late: usize = self
            .tracked
            .iter()
            .filter_map(|t| t.late.as_ref())
            .map(|late| late.len())
            .sum();
        self.events.len() + late
    }

    fn push(&mut self, new_event: Result<NewEvent, UnitOfWorkError>) {
        match new_event {
            Ok(new_event) => self.events.push(new_event),
            Err(error) => {
                self.error.get_or_insert(error);
            }
        }
    }

    /// The events to write, those recorded on tracked aggregates after `track` included, and
    /// what to drain after COMMIT; or the first invalid event's error.
    pub(crate) fn take(mut self) -> Result<(Vec<NewEvent>, Vec<Drain>), UnitOfWorkError> {
        let mut drains = Vec::with_capacity(self.tracked.len());
        for tracked in std::mem::take(&mut self.tracked) {
            tracked.detach();
            let late = tracked
                .late
                .as_ref()
                .map(|late| late.take())
                .unwrap_or_default();
            drains.push((tracked.handle, tracked.taken + late.len()));
            for new_event in late {
                self.push(new_event);
            }
        }
        if let Some(error) = self.error.take() {
            return Err(error);
        }
        Ok((std::mem::take(&mut self.events), drains))
    }
}

impl Drop for EventBuffer<'_> {
    /// A unit of work that ends without a flush (its closure failed) stops taking the events
    /// recorded on its aggregates, which keep them.
    fn drop(&mut self) {
        for tracked in &self.tracked {
            tracked.detach();
        }
    }
}

/// An aggregate a unit of work tracks.
struct Tracked {
    handle: CommitHandle,
    /// How many events were pending when it was tracked.
    taken: usize,
    /// The events recorded on it since, when this unit of work is attached to its buffer.
    late: Option<Arc<dyn TakeLate>>,
}

impl Tracked {
    /// Stops the aggregate's buffer from sending recorded events to this unit of work, when
    /// this unit of work is the one attached to it (never another's).
    fn detach(&self) {
        if self.late.is_some() {
            self.handle.detach();
        }
    }
}

/// The events recorded on a tracked aggregate after [`UnitOfWork::track`], checked and
/// serialized as they are recorded.
struct Late {
    outbox: Outbox,
    aggregate_type: &'static str,
    aggregate_id: String,
    events: Mutex<Vec<Result<NewEvent, UnitOfWorkError>>>,
}

impl<E: DomainEvent> LateEvents<E> for Late {
    fn recorded(&self, event: &E) {
        let new_event = prepare(&self.outbox, self.aggregate_type, &self.aggregate_id, event);
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(new_event);
    }
}

/// [`Late`] seen by the unit of work, whatever the event type.
trait TakeLate: Send + Sync {
    fn take(&self) -> Vec<Result<NewEvent, UnitOfWorkError>>;
    fn len(&self) -> usize;
}

impl TakeLate for Late {
    fn len(&self) -> usize {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    fn take(&self) -> Vec<Result<NewEvent, UnitOfWorkError>> {
        std::mem::take(
            &mut *self
                .events
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

/// Checks an event's subject tokens, serializes its payload and resolves its subject.
fn prepare<E: DomainEvent>(
    outbox: &Outbox,
    aggregate_type: &str,
    aggregate_id: &str,
    event: &E,
) -> Result<NewEvent, UnitOfWorkError> {
    let event_type = event.event_type();
    let partition_key = event.partition_key();
    let invalid = |role, value: &str, reason| UnitOfWorkError::InvalidSubjectToken {
        role,
        value: value.to_owned(),
        aggregate_type: aggregate_type.to_owned(),
        aggregate_id: aggregate_id.to_owned(),
        event_type: event_type.to_owned(),
        reason,
    };
    let checks = [
        (TokenRole::AggregateType, aggregate_type),
        (TokenRole::AggregateId, aggregate_id),
        (TokenRole::EventType, event_type),
    ];
    for (role, value) in checks {
        validate_token(value).map_err(|reason| invalid(role, value, reason))?;
    }
    if let Some(key) = &partition_key {
        validate_token(key).map_err(|reason| invalid(TokenRole::PartitionKey, key, reason))?;
    }
    let dedup_key = event.dedup_key();
    if let Some(key) = &dedup_key {
        let reason = if key.is_empty() {
            Some("it is empty".to_owned())
        } else if key.len() > MAX_ID_BYTES {
            Some(format!(
                "it is {} bytes long, over the limit of {MAX_ID_BYTES} bytes",
                key.len()
            ))
        } else if key.contains('\0') {
            Some("it contains a NUL character".to_owned())
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(UnitOfWorkError::InvalidDedupKey {
                aggregate_type: aggregate_type.to_owned(),
                aggregate_id: aggregate_id.to_owned(),
                event_type: event_type.to_owned(),
                reason,
            });
        }
    }
    let payload = event
        .to_payload()
        .map_err(|source| UnitOfWorkError::Payload {
            aggregate_type: aggregate_type.to_owned(),
            aggregate_id: aggregate_id.to_owned(),
            source,
        })?;
    if payload.len() > outbox.max_payload() {
        return Err(UnitOfWorkError::PayloadTooLarge {
            len: payload.len(),
            max: outbox.max_payload(),
            aggregate_type: aggregate_type.to_owned(),
            aggregate_id: aggregate_id.to_owned(),
            event_type: event_type.to_owned(),
        });
    }
    let partition_key = partition_key.unwrap_or_else(|| aggregate_id.to_owned());
    let subject = event_subject(
        outbox.subject_prefix(),
        aggregate_type,
        &partition_key,
        event_type,
    );
    if subject.len() > MAX_SUBJECT_BYTES {
        return Err(UnitOfWorkError::SubjectTooLong {
            len: subject.len(),
            aggregate_type: aggregate_type.to_owned(),
            aggregate_id: aggregate_id.to_owned(),
            event_type: event_type.to_owned(),
        });
    }
    Ok(NewEvent {
        id: Uuid::now_v7(),
        subject,
        aggregate_type: aggregate_type.to_owned(),
        aggregate_id: aggregate_id.to_owned(),
        event_type,
        event_version: event.event_version(),
        partition_key,
        payload,
        dedup_key,
    })
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::*;

    fn row(status: Option<&str>, server_mark: Option<i64>) -> TransactionStatusRow {
        TransactionStatusRow {
            status: status.map(str::to_owned),
            server_mark,
        }
    }

    /// The server's record is taken as it is only under the mark the id was handed out
    /// under; across another mark (a crash, another server) or without one, only "aborted"
    /// stands, and the rest cannot be told.
    #[test]
    fn a_status_is_believed_only_under_the_mark_its_id_was_handed_out_under() {
        use TransactionStatus::{Aborted, Committed, InProgress, Undecidable};
        let id = |server_mark| TransactionId {
            xid8: 7,
            server_mark,
        };
        for (record, same, other) in [
            (Some("committed"), Committed, Undecidable),
            (Some("in progress"), InProgress, Undecidable),
            (Some("aborted"), Aborted, Aborted),
            (None, Undecidable, Undecidable),
        ] {
            let status = |id_mark, server| row(record, server).status(id(id_mark)).unwrap();
            assert_eq!(status(Some(1), Some(1)), same, "{record:?}, same mark");
            assert_eq!(status(Some(1), Some(2)), other, "{record:?}, another mark");
            assert_eq!(status(None, None), other, "{record:?}, no mark");
            assert_eq!(
                status(Some(1), None),
                other,
                "{record:?}, a server without one"
            );
        }
        let error = row(Some("gone"), Some(1)).status(id(Some(1))).unwrap_err();
        assert!(error.to_string().contains("\"gone\""), "{error}");
    }
}
