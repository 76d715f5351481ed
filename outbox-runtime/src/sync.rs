//! The unit of work on a synchronous `diesel::PgConnection` (feature `postgres-sync`), for
//! services on sync diesel, plain or behind r2d2.
//!
//! [`Outbox::sync_transaction`] is [`Outbox::transaction`] in sync form: the same closure
//! shape, the same table, the same statements and the same guarantees (events written in the
//! business transaction, per-aggregate sequences contiguous under concurrency, dedup keys,
//! aggregates drained only after COMMIT). The relay, which is async, publishes its rows like
//! any other: they are the same rows.
//!
//! ```no_run
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
//! ```
//!
//! With r2d2, pass the pooled connection: `outbox.sync_transaction(&mut pool.get()?, ..)`
//! (`&mut PooledConnection` derefs to `&mut PgConnection`).

use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::sql_types::{Array, Bool, Text};
use diesel::{PgConnection, QueryableByName, RunQueryDsl};

use crate::aggregate::Aggregate;
use crate::causality::{Causality, Traceparent};
use crate::event::DomainEvent;
use crate::outbox::queries::{self, DedupKeys, TakenKey};
use crate::outbox::{self as outbox_mod, MissingMigrations, Outbox};
use crate::topology::{self, Registered, Role};
use crate::unit_of_work::{
    BEGIN, CollectEvents, Drain, DuplicateEvents, EventBuffer, UnitOfWorkError, drop_duplicates,
    rolled_back_with,
};

/// The events of one transaction on a sync connection, collected until COMMIT: the sync
/// form of [`UnitOfWork`](crate::UnitOfWork), handed to the closure of
/// [`Outbox::sync_transaction`] and to nothing else.
pub struct SyncUnitOfWork<'c> {
    conn: &'c mut PgConnection,
    buffer: EventBuffer<'c>,
}

impl SyncUnitOfWork<'_> {
    /// The transaction's connection, for the business writes.
    pub fn conn(&mut self) -> &mut PgConnection {
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

    /// Writes the collected events; returns what to drain after COMMIT.
    fn flush(self) -> Result<Vec<Drain>, UnitOfWorkError> {
        let Self { conn, buffer } = self;
        let duplicates = buffer.duplicates;
        let causality = buffer.causality.clone();
        let (mut events, drains) = buffer.take()?;
        let mut plan = DedupKeys::plan(&events);
        if let Some(statement) = plan.statement() {
            let taken: Vec<TakenKey> = statement
                .load(conn)
                .map_err(UnitOfWorkError::from_database)?;
            plan.taken(&taken);
            let taken = plan.duplicates(&events);
            drop_duplicates(&mut events, &taken, duplicates)?;
        }
        if !events.is_empty() {
            let headers = causality.headers_json();
            queries::insert_statement(&events, &causality, &headers).execute(conn)?;
        }
        Ok(drains)
    }
}

impl CollectEvents for SyncUnitOfWork<'_> {
    fn track<A: Aggregate>(&mut self, aggregate: &mut A) {
        SyncUnitOfWork::track(self, aggregate);
    }

    fn emit<E: DomainEvent>(&mut self, aggregate_type: &str, aggregate_id: &str, event: &E) {
        SyncUnitOfWork::emit(self, aggregate_type, aggregate_id, event);
    }
}

impl Outbox {
    /// [`transaction`](Self::transaction) on a synchronous `diesel::PgConnection`: runs `f`
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
    pub fn sync_transaction<T, E, F>(&self, conn: &mut PgConnection, f: F) -> Result<T, E>
    where
        F: for<'u, 'c> FnOnce(&'u mut SyncUnitOfWork<'c>) -> Result<T, E>,
        E: From<UnitOfWorkError>,
    {
        let depth = AnsiTransactionManager::transaction_manager_status_mut(conn)
            .transaction_depth()
            .map_err(UnitOfWorkError::from)?;
        if depth.is_some() {
            return Err(UnitOfWorkError::NestedTransaction.into());
        }
        if self.registration_due() {
            let others: Result<Vec<Registered>, _> =
                topology::register_statement(Role::Outbox, self.topology()).load(conn);
            match others {
                Ok(others) => topology::report_mismatches(Role::Outbox, self.topology(), &others),
                Err(error) => tracing::warn!(
                    %error,
                    "cannot register the outbox's topology in outbox_topologies"
                ),
            }
        }
        AnsiTransactionManager::begin_transaction_sql(conn, BEGIN)
            .map_err(UnitOfWorkError::from)?;

        let outcome = {
            let mut unit = SyncUnitOfWork {
                conn,
                buffer: EventBuffer::new(self, Causality::root()),
            };
            match f(&mut unit) {
                Ok(value) => unit.flush().map(|drains| (value, drains)).map_err(Err),
                Err(error) => Err(Ok(error)),
            }
        };
        match outcome {
            Ok((value, drains)) => {
                AnsiTransactionManager::commit_transaction(conn).map_err(UnitOfWorkError::from)?;
                for (handle, count) in drains {
                    handle.mark_committed(count);
                }
                Ok(value)
            }
            Err(failed) => {
                let rolled_back = AnsiTransactionManager::rollback_transaction(conn);
                let error = match failed {
                    Ok(closure_error) => return rolled_back_with(rolled_back, closure_error),
                    Err(flush_error) => flush_error,
                };
                let error = match error {
                    UnitOfWorkError::Database(error) => UnitOfWorkError::from_database(error),
                    other => other,
                };
                let error = match error {
                    UnitOfWorkError::Database(
                        database_error @ diesel::result::Error::DatabaseError(..),
                    ) if rolled_back.is_ok() => match missing_migrations(conn) {
                        Ok(Some(missing)) => UnitOfWorkError::MissingMigrations(missing),
                        _ => UnitOfWorkError::Database(database_error),
                    },
                    other => other,
                };
                rolled_back_with(rolled_back, E::from(error))
            }
        }
    }
}

/// The outbox migrations the database lacks, if any.
fn missing_migrations(conn: &mut PgConnection) -> diesel::QueryResult<Option<MissingMigrations>> {
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
    let embedded = outbox_mod::embedded_versions()?;
    let table: Exists = diesel::sql_query(outbox_mod::MIGRATIONS_TABLE_EXISTS).get_result(conn)?;
    let pending = if table.exists {
        let pending: Vec<Version> = diesel::sql_query(outbox_mod::PENDING_VERSIONS)
            .bind::<Array<Text>, _>(&embedded)
            .load(conn)?;
        pending.into_iter().map(|v| v.version).collect()
    } else {
        embedded
    };
    Ok((!pending.is_empty()).then_some(MissingMigrations { pending }))
}
