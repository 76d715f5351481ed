//! The unit of work on a synchronous diesel connection, for services on sync diesel, plain or
//! behind r2d2: `diesel::PgConnection` (feature `postgres-sync`), `diesel::MysqlConnection`
//! (feature `mysql-sync`) and `diesel::SqliteConnection` (feature `sqlite`).
//!
//! [`Outbox::sync_transaction`] is [`Outbox::transaction`] in sync form: the same closure
//! shape, the same table, the same statements and the same guarantees (events written in the
//! business transaction, per-aggregate sequences contiguous under concurrency, dedup keys,
//! aggregates drained only after COMMIT). The relay, which is async, publishes its rows like
//! any other: they are the same rows.
//!
//! ```no_run
//! # #[cfg(feature = "postgres-sync")]
//! use diesel::{Connection, PgConnection};
//! use outbox_runtime::{DomainEvent, Outbox, PendingEvents, UnitOfWorkError, aggregate};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Serialize, Deserialize, DomainEvent)]
//! enum OrderEvent { Placed { customer: String } }
//!
//! #[aggregate]
//! struct Order { id: String, pending_events: PendingEvents<OrderEvent> }
//!
//! # #[cfg(feature = "postgres-sync")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut conn = PgConnection::establish("postgres://postgres@127.0.0.1:5432/test")?;
//! let mut order = Order { id: "o-1".into(), pending_events: PendingEvents::new() };
//! order.record(OrderEvent::Placed { customer: "ada".into() });
//! Outbox::new().sync_transaction(&mut conn, |uow| {
//!     // Business writes with diesel on `uow.conn()`, then hand over the aggregate:
//!     uow.track(&mut order);
//!     Ok::<_, UnitOfWorkError>(())
//! })?;
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "postgres-sync"))]
//! # fn main() {}
//! ```
//!
//! With r2d2, pass the pooled connection: `outbox.sync_transaction(&mut pool.get()?, ..)`;
//! for another pool's guard, `&mut *guard` reaches the connection inside it. On SQLite, open
//! the connection with [`sqlite::establish`](crate::sqlite::establish) (it waits for the
//! write lock).

use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::r2d2::{ConnectionManager, PooledConnection, R2D2Connection};
#[cfg(feature = "postgres-sync")]
use diesel::{
    PgConnection, QueryableByName, RunQueryDsl,
    sql_types::{Array, Bool, Text},
};

use crate::aggregate::Aggregate;
use crate::causality::{Causality, Traceparent};
use crate::event::DomainEvent;
use crate::outbox::queries::NewEvent;
use crate::outbox::{MissingMigrations, Outbox};
use crate::unit_of_work::{
    CollectEvents, Drain, DuplicateEvents, EventBuffer, TransactionId, UnitOfWorkError,
    rolled_back_with,
};
use sealed::SyncBackend as _;

/// The events of one transaction on a sync connection, collected until COMMIT: the sync
/// form of [`UnitOfWork`](crate::UnitOfWork), handed to the closure of
/// [`Outbox::sync_transaction`] and to nothing else. `C` is the connection
/// (`diesel::PgConnection` unless said otherwise, `diesel::MysqlConnection` or
/// `diesel::SqliteConnection`).
#[cfg(feature = "postgres-sync")]
pub struct SyncUnitOfWork<'c, C: SyncBackendConnection = PgConnection> {
    conn: &'c mut C,
    buffer: EventBuffer<'c>,
    /// The transaction's id, where the database reported one ([`Self::transaction_id`]).
    transaction: Option<TransactionId>,
}

/// The events of one transaction on a sync connection, collected until COMMIT: the sync
/// form of [`UnitOfWork`](crate::UnitOfWork), handed to the closure of
/// [`Outbox::sync_transaction`] and to nothing else. `C` is the connection
/// (`diesel::MysqlConnection` or `diesel::SqliteConnection`).
#[cfg(not(feature = "postgres-sync"))]
pub struct SyncUnitOfWork<'c, C: SyncBackendConnection> {
    conn: &'c mut C,
    buffer: EventBuffer<'c>,
    /// The transaction's id, where the database reported one ([`Self::transaction_id`]).
    transaction: Option<TransactionId>,
}

impl<C: SyncBackendConnection> SyncUnitOfWork<'_, C> {
    /// The transaction's connection, for the business writes.
    pub fn conn(&mut self) -> &mut C {
        self.conn
    }

    /// As [`UnitOfWork::track`](crate::UnitOfWork::track).
    pub fn track<A: Aggregate>(&mut self, aggregate: &mut A) {
        self.buffer.track(aggregate);
    }

    /// As [`UnitOfWork::emit`](crate::UnitOfWork::emit).
    pub fn emit<E: DomainEvent>(&mut self, aggregate_type: &str, aggregate_id: &str, event: &E) {
        self.buffer.emit(aggregate_type, aggregate_id, event);
    }

    /// As [`UnitOfWork::transaction_id`](crate::UnitOfWork::transaction_id): `Some` on
    /// `PgConnection` when [`Outbox::report_transaction_ids`] asks (at the cost of a round
    /// trip when the transaction begins), else `None`.
    pub fn transaction_id(&self) -> Option<TransactionId> {
        self.transaction
    }

    /// As [`UnitOfWork::correlation_id`](crate::UnitOfWork::correlation_id).
    pub fn correlation_id(&self) -> &str {
        &self.buffer.causality.correlation_id
    }

    /// As [`UnitOfWork::causation_id`](crate::UnitOfWork::causation_id).
    pub fn causation_id(&self) -> &str {
        &self.buffer.causality.causation_id
    }

    /// As [`UnitOfWork::set_correlation`](crate::UnitOfWork::set_correlation).
    pub fn set_correlation(
        &mut self,
        correlation_id: impl Into<String>,
        causation_id: impl Into<String>,
    ) {
        self.buffer
            .set_correlation(correlation_id.into(), causation_id.into());
    }

    /// As [`UnitOfWork::set_traceparent`](crate::UnitOfWork::set_traceparent).
    pub fn set_traceparent(&mut self, traceparent: Traceparent) {
        self.buffer.causality.traceparent = Some(traceparent);
        self.buffer.causality.tracestate = None;
    }

    /// As [`UnitOfWork::set_duplicate_events`](crate::UnitOfWork::set_duplicate_events).
    pub fn set_duplicate_events(&mut self, duplicates: DuplicateEvents) {
        self.buffer.duplicates = duplicates;
    }

    /// As [`UnitOfWork::event_count`](crate::UnitOfWork::event_count).
    pub fn event_count(&self) -> usize {
        self.buffer.event_count()
    }

    /// Writes the collected events, or returns the statements that write them with the
    /// COMMIT ([`sealed::SyncBackend::insert_and_commit`]); returns what to drain after
    /// COMMIT, and whether any event was handed over.
    fn flush(self) -> Result<(Vec<Drain>, bool, Option<String>), UnitOfWorkError> {
        let Self { conn, buffer, .. } = self;
        let duplicates = buffer.duplicates;
        let causality = buffer.causality.clone();
        let (events, drains) = buffer.take()?;
        let any = !events.is_empty();
        // Dedup keys are taken first, by a statement whose answer decides what is written.
        let insert_and_commit = if events.iter().all(|e| e.dedup_key.is_none()) {
            C::insert_and_commit(&events, &causality)
        } else {
            None
        };
        if insert_and_commit.is_none() {
            conn.write_events(events, &causality, duplicates)?;
        }
        Ok((drains, any, insert_and_commit))
    }
}

impl<C: SyncBackendConnection> CollectEvents for SyncUnitOfWork<'_, C> {
    fn track<A: Aggregate>(&mut self, aggregate: &mut A) {
        SyncUnitOfWork::track(self, aggregate);
    }

    fn emit<E: DomainEvent>(&mut self, aggregate_type: &str, aggregate_id: &str, event: &E) {
        SyncUnitOfWork::emit(self, aggregate_type, aggregate_id, event);
    }
}

impl Outbox {
    /// [`transaction`](Self::transaction) on a synchronous diesel connection (a
    /// [`SyncBackendConnection`]: `diesel::PgConnection`, `diesel::MysqlConnection` or
    /// `diesel::SqliteConnection`, plain or r2d2-pooled): runs `f`
    /// inside one database transaction and writes the events it hands over to the outbox
    /// table just before COMMIT; the tracked aggregates are drained only after the COMMIT.
    /// When `f` returns an error, or writing the events fails, the transaction is rolled
    /// back: no business row and no outbox row is written, and the aggregates keep their
    /// pending events.
    ///
    /// `conn` must not already be inside a transaction.
    ///
    /// # Errors
    /// `f`'s own error, or a [`UnitOfWorkError`] converted into `E`, as
    /// [`transaction`](Self::transaction).
    pub fn sync_transaction<P, T, E, F>(&self, conn: &mut P, f: F) -> Result<T, E>
    where
        P: SyncOutboxConnection + ?Sized,
        F: for<'u, 'c> FnOnce(&'u mut SyncUnitOfWork<'c, P::Connection>) -> Result<T, E>,
        E: From<UnitOfWorkError>,
    {
        let conn = conn.connection();
        let depth = AnsiTransactionManager::transaction_manager_status_mut(conn)
            .transaction_depth()
            .map_err(UnitOfWorkError::from)?;
        if depth.is_some() {
            return Err(UnitOfWorkError::NestedTransaction.into());
        }
        let transaction = conn
            .begin_unit_of_work(self)
            .map_err(UnitOfWorkError::from)?;

        let outcome = {
            let mut unit = SyncUnitOfWork {
                conn,
                buffer: EventBuffer::new(self, Causality::root()),
                transaction,
            };
            match f(&mut unit) {
                Ok(value) => unit.flush().map(|drains| (value, drains)).map_err(Err),
                Err(error) => Err(Ok(error)),
            }
        };
        match outcome {
            Ok((value, (drains, had_events, insert_and_commit))) => {
                match insert_and_commit {
                    Some(sql) => {
                        if let Err((error, rolled_back)) = commit_with(conn, &sql) {
                            if rolled_back.is_err() {
                                return Err(outcome_unknown(error, transaction).into());
                            }
                            return flush_failed(conn, error.into(), rolled_back);
                        }
                    }
                    None => match P::Connection::COMMIT {
                        Some(sql) => {
                            if let Err((error, rolled_back)) = commit_with(conn, sql) {
                                let error = if rolled_back.is_err() {
                                    outcome_unknown(error, transaction)
                                } else {
                                    UnitOfWorkError::Database(error)
                                };
                                return Err(error.into());
                            }
                        }
                        None => AnsiTransactionManager::commit_transaction(conn)
                            .map_err(UnitOfWorkError::from)?,
                    },
                }
                if had_events {
                    P::Connection::events_committed();
                }
                for (handle, count) in drains {
                    handle.mark_committed(count);
                }
                Ok(value)
            }
            Err(failed) => {
                let rolled_back = AnsiTransactionManager::rollback_transaction(conn);
                match failed {
                    Ok(closure_error) => rolled_back_with(rolled_back, closure_error),
                    Err(flush_error) => flush_failed(conn, flush_error, rolled_back),
                }
            }
        }
    }
}

/// The error of a unit of work whose events could not be written, after its rollback
/// (`rolled_back`): as the async unit of work's.
fn flush_failed<C: SyncBackendConnection, T, E: From<UnitOfWorkError>>(
    conn: &mut C,
    error: UnitOfWorkError,
    rolled_back: diesel::QueryResult<()>,
) -> Result<T, E> {
    let error = match error {
        UnitOfWorkError::Database(error) => UnitOfWorkError::from_database(error),
        other => other,
    };
    let error =
        match error {
            UnitOfWorkError::Database(
                database_error @ diesel::result::Error::DatabaseError(..),
            ) if rolled_back.is_ok() => match conn.missing_migrations() {
                Ok(Some(missing)) => UnitOfWorkError::MissingMigrations(missing),
                _ => UnitOfWorkError::Database(database_error),
            },
            other => other,
        };
    rolled_back_with(rolled_back, E::from(error))
}

/// Commits with `sql`, statements that end in `COMMIT`, sent in one round trip (see the
/// async unit of work's `commit_checked`), and tells diesel's transaction manager that the
/// transaction ended. On a failed statement the server skipped the rest (the COMMIT); the
/// transaction is rolled back, and the error comes back with the rollback's outcome.
fn commit_with<C: SyncBackendConnection>(
    conn: &mut C,
    sql: &str,
) -> Result<(), (diesel::result::Error, diesel::QueryResult<()>)> {
    let result = conn.batch_execute(sql);
    let ended = match &result {
        Ok(()) => Ok(()),
        // A failed COMMIT ends the transaction too; a ROLLBACK outside one only warns.
        Err(_) => conn.batch_execute("ROLLBACK"),
    };
    let status = AnsiTransactionManager::transaction_manager_status_mut(conn);
    match &ended {
        Ok(()) => *status = diesel::connection::TransactionManagerStatus::default(),
        Err(_) => status.set_in_error(),
    }
    result.map_err(|error| (error, ended))
}

/// [`transaction_status`](crate::transaction_status) on sync diesel's `PgConnection`: what
/// became of the transaction `id`, asked on a new connection after
/// [`UnitOfWorkError::CommitOutcomeUnknown`] (`pg_xact_status`). One round trip.
///
/// # Errors
/// As the async one's: a database error, or an id the server has not handed out.
#[cfg(feature = "postgres-sync")]
pub fn transaction_status(
    conn: &mut PgConnection,
    id: TransactionId,
) -> diesel::QueryResult<crate::TransactionStatus> {
    use crate::unit_of_work::{TransactionStatusQuery, TransactionStatusRow};
    TransactionStatusQuery::of(id)
        .get_result::<TransactionStatusRow>(conn)?
        .status(id)
}

/// The error of a commit whose rollback failed too: the connection is gone, and with it the
/// answer to a COMMIT that may have run (as the async unit of work's), with the transaction's
/// id where the database reported one.
fn outcome_unknown(
    error: diesel::result::Error,
    transaction: Option<TransactionId>,
) -> UnitOfWorkError {
    UnitOfWorkError::CommitOutcomeUnknown {
        source: error,
        transaction,
    }
}

/// A sync diesel connection a unit of work runs on: `diesel::PgConnection` (feature
/// `postgres-sync`), `diesel::MysqlConnection` (feature `mysql-sync`) or
/// `diesel::SqliteConnection` (feature `sqlite`). Each writes the events
/// with statements of its own database.
///
/// Sealed: implemented by the toolkit for the connections it has statements for.
pub trait SyncBackendConnection: R2D2Connection + 'static + sealed::SyncBackend {}

impl<C> SyncBackendConnection for C where C: R2D2Connection + 'static + sealed::SyncBackend {}

/// What [`Outbox::sync_transaction`] takes: a [`SyncBackendConnection`], or r2d2's guard
/// around one (`&mut pool.get()?`). The closure's [`SyncUnitOfWork`] is on the connection
/// itself either way.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a connection a sync unit of work can run on",
    label = "a sync unit of work runs on a PgConnection, MysqlConnection or SqliteConnection, or an r2d2 guard of one",
    note = "for another pool's guard, pass `&mut *conn`: it derefs to the connection"
)]
pub trait SyncOutboxConnection {
    /// The database connection: `Self`, or the one inside the guard.
    type Connection: SyncBackendConnection;

    /// The database connection.
    fn connection(&mut self) -> &mut Self::Connection;
}

impl<C: SyncBackendConnection> SyncOutboxConnection for C {
    type Connection = C;

    fn connection(&mut self) -> &mut C {
        self
    }
}

impl<C: SyncBackendConnection> SyncOutboxConnection for PooledConnection<ConnectionManager<C>> {
    type Connection = C;

    fn connection(&mut self) -> &mut C {
        self
    }
}

// The module is private, so `SyncBackend` cannot be named or implemented outside the crate,
// and the crate-private types in its signatures stay out of reach.
#[allow(private_interfaces)]
pub(crate) mod sealed {
    use super::*;

    /// What a sync unit of work needs from its database, beside diesel's transaction
    /// manager.
    pub trait SyncBackend: diesel::Connection<TransactionManager = AnsiTransactionManager> {
        /// Opens the unit of work's transaction; returns its id where the database reports
        /// one ([`TransactionId`]).
        fn begin_unit_of_work(
            &mut self,
            outbox: &Outbox,
        ) -> diesel::QueryResult<Option<TransactionId>>;

        /// Takes the events' dedup keys and writes the events that are not duplicates, with
        /// their sequences, inside the open transaction.
        fn write_events(
            &mut self,
            events: Vec<NewEvent>,
            causality: &Causality,
            duplicates: DuplicateEvents,
        ) -> Result<(), UnitOfWorkError>;

        /// Statements that write `events` (none with a dedup key) and then COMMIT, sent in
        /// one round trip instead of [`Self::write_events`] and a COMMIT of its own; `None`
        /// where the database has none for these events, or there are no events.
        fn insert_and_commit(_events: &[NewEvent], _causality: &Causality) -> Option<String> {
            None
        }

        /// The unit of work's COMMIT, sent through [`commit_with`] so that a lost connection
        /// is told from a refused COMMIT ([`UnitOfWorkError::CommitOutcomeUnknown`]); `None`
        /// where diesel's transaction manager commits, on a connection that cannot be lost
        /// (SQLite's, in the process).
        const COMMIT: Option<&'static str> = None;

        /// The outbox migrations the database lacks, if any, asked after a database error.
        fn missing_migrations(&mut self) -> diesel::QueryResult<Option<MissingMigrations>>;

        /// Called after a unit of work that wrote events committed (wakes the relays of this
        /// process on a database without notifications).
        fn events_committed() {}
    }

    #[cfg(feature = "postgres-sync")]
    impl SyncBackend for PgConnection {
        const COMMIT: Option<&'static str> = Some("COMMIT");

        fn begin_unit_of_work(
            &mut self,
            outbox: &Outbox,
        ) -> diesel::QueryResult<Option<TransactionId>> {
            use crate::topology::{self, Registered, Role};
            if outbox.registration_due() {
                let others: Result<Vec<Registered>, _> =
                    topology::register_statement(Role::Outbox, outbox.topology()).load(self);
                match others {
                    Ok(others) => {
                        topology::report_mismatches(Role::Outbox, outbox.topology(), &others)
                    }
                    Err(error) => outbox.registration_failed(&error),
                }
            }
            AnsiTransactionManager::begin_transaction_sql(self, crate::unit_of_work::BEGIN)?;
            if !outbox.reports_transaction_ids() {
                return Ok(None);
            }
            // A round trip of its own: a sync connection does not pipeline.
            let identified: diesel::QueryResult<crate::unit_of_work::CurrentTransactionRow> =
                crate::unit_of_work::CurrentTransaction {}.get_result(self);
            identified.map(|row| row.id()).inspect_err(|_| {
                // The unit of work never started: end its transaction here (as the async
                // one does).
                let _ = AnsiTransactionManager::rollback_transaction(self);
            })
        }

        fn write_events(
            &mut self,
            mut events: Vec<NewEvent>,
            causality: &Causality,
            duplicates: DuplicateEvents,
        ) -> Result<(), UnitOfWorkError> {
            use crate::outbox::queries::{self, DedupKeys, TakenKey};
            let mut plan = DedupKeys::plan(&events);
            if let Some(statement) = plan.statement() {
                let taken: Vec<TakenKey> = statement
                    .load(self)
                    .map_err(UnitOfWorkError::from_database)?;
                plan.taken(&taken);
                let taken = plan.duplicates(&events);
                crate::unit_of_work::drop_duplicates(&mut events, &taken, duplicates)?;
            }
            if !events.is_empty() {
                let headers = causality.headers_json();
                queries::insert_statement(&events, causality, &headers).execute(self)?;
            }
            Ok(())
        }

        fn insert_and_commit(events: &[NewEvent], causality: &Causality) -> Option<String> {
            crate::outbox::queries::insert_and_commit(events, causality)
        }

        fn missing_migrations(&mut self) -> diesel::QueryResult<Option<MissingMigrations>> {
            #[derive(QueryableByName)]
            struct Exists {
                #[diesel(sql_type = Bool)]
                exists: bool,
            }
            #[derive(QueryableByName)]
            struct Version {
                #[diesel(sql_type = Text)]
                version: String,
            }
            use crate::outbox as outbox_mod;
            let embedded = outbox_mod::embedded_versions()?;
            let table: Exists =
                diesel::sql_query(outbox_mod::MIGRATIONS_TABLE_EXISTS).get_result(self)?;
            let pending = if table.exists {
                let pending: Vec<Version> = diesel::sql_query(outbox_mod::PENDING_VERSIONS)
                    .bind::<Array<Text>, _>(&embedded)
                    .load(self)?;
                pending.into_iter().map(|v| v.version).collect()
            } else {
                embedded
            };
            if pending.is_empty() {
                return Ok(None);
            }
            let elsewhere: outbox_mod::SchemasElsewhere =
                diesel::sql_query(outbox_mod::TABLES_ELSEWHERE).get_result(self)?;
            Ok(Some(MissingMigrations {
                pending,
                elsewhere: elsewhere.into(),
            }))
        }
    }

    /// The result of a future made of a sync connection's statements: ready at its first
    /// poll, since nothing in it waits.
    #[cfg(feature = "mysql-sync")]
    fn ready<T>(future: impl Future<Output = T>) -> T {
        use futures::FutureExt as _;
        std::pin::pin!(future)
            .now_or_never()
            .expect("a sync connection's statements complete when polled")
    }

    #[cfg(feature = "mysql-sync")]
    impl SyncBackend for diesel::MysqlConnection {
        const COMMIT: Option<&'static str> = Some("COMMIT");

        fn begin_unit_of_work(
            &mut self,
            _outbox: &Outbox,
        ) -> diesel::QueryResult<Option<TransactionId>> {
            AnsiTransactionManager::begin_transaction_sql(self, crate::mysql::BEGIN)?;
            Ok(None)
        }

        fn write_events(
            &mut self,
            events: Vec<NewEvent>,
            causality: &Causality,
            duplicates: DuplicateEvents,
        ) -> Result<(), UnitOfWorkError> {
            ready(crate::mysql::write_events(
                self, events, causality, duplicates,
            ))
        }

        fn missing_migrations(&mut self) -> diesel::QueryResult<Option<MissingMigrations>> {
            ready(crate::mysql::missing(self))
        }

        fn events_committed() {
            crate::commits::COMMITS.committed();
        }
    }

    #[cfg(feature = "sqlite")]
    impl SyncBackend for diesel::SqliteConnection {
        fn begin_unit_of_work(
            &mut self,
            _outbox: &Outbox,
        ) -> diesel::QueryResult<Option<TransactionId>> {
            crate::sqlite::begin(self)?;
            Ok(None)
        }

        fn write_events(
            &mut self,
            events: Vec<NewEvent>,
            causality: &Causality,
            duplicates: DuplicateEvents,
        ) -> Result<(), UnitOfWorkError> {
            crate::sqlite::write_events(self, events, causality, duplicates)
        }

        fn missing_migrations(&mut self) -> diesel::QueryResult<Option<MissingMigrations>> {
            crate::sqlite::missing_migrations(self)
        }

        fn events_committed() {
            crate::commits::COMMITS.committed();
        }
    }
}
