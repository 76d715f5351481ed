//! The outbox on SQLite 3.37+ (feature `sqlite`): the unit of work on diesel-async's
//! [`AsyncSqliteConnection`] (diesel's `SqliteConnection` behind `SyncConnectionWrapper`), and
//! a message relay that publishes its rows, for services that embed their database and for
//! tests without a server.
//!
//! [`Outbox::transaction`](crate::Outbox::transaction) takes an `AsyncSqliteConnection` as it
//! takes a PostgreSQL one: the same closure, the same [`UnitOfWork`](crate::UnitOfWork). The
//! tables are this module's [`MIGRATIONS`] (`outbox-runtime/migrations-sqlite/`); open
//! connections with [`establish`] and run them with [`run_migrations`]. [`SqliteRelay`]
//! publishes the rows with the same subjects, headers and `Nats-Msg-Id` as the PostgreSQL
//! relay.
//!
//! ```no_run
//! use outbox_runtime::sqlite::{self, AsyncSqliteConnection};
//! use outbox_runtime::{DomainEvent, Outbox, PendingEvents, UnitOfWorkError, aggregate};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Serialize, Deserialize, DomainEvent)]
//! enum OrderEvent { Placed { customer: String } }
//!
//! #[aggregate]
//! struct Order { id: String, pending_events: PendingEvents<OrderEvent> }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let mut db = sqlite::establish("orders.db")?;
//! sqlite::run_migrations(&mut db)?;
//! let mut conn = AsyncSqliteConnection::new(db);
//! let mut order = Order { id: "o-1".into(), pending_events: PendingEvents::new() };
//! order.record(OrderEvent::Placed { customer: "ada".into() });
//! Outbox::new()
//!     .transaction(&mut conn, async |uow| {
//!         uow.track(&mut order);
//!         Ok::<_, UnitOfWorkError>(())
//!     })
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Guarantees, and how they differ from PostgreSQL's
//! - Events commit with the business rows or not at all. A unit of work opens its transaction
//!   with `BEGIN IMMEDIATE`: it takes SQLite's single write lock at once, so units of work on
//!   one database file run one after another and sequences are contiguous and in commit
//!   order. A connection waits for the lock as long as its `busy_timeout` says
//!   ([`establish`] sets [`BUSY_TIMEOUT`]); with none, a unit of work that meets another
//!   writer fails at once with "database is locked". Units of work, the relay, the purges
//!   and dead-letter retries and skips try for the lock again every 50 us to 1 ms while they
//!   wait, not in SQLite's own steps of up to 100 ms, so they take it within about a
//!   millisecond of its release (the application's own statements wait in SQLite's steps).
//! - A COMMIT or ROLLBACK sent by hand inside the closure ends the unit of work's
//!   transaction: the unit of work sees that its savepoint is gone before it writes the
//!   events, writes none, and fails with [`UnitOfWorkError::TransactionEnded`].
//! - One relay publishes a database file's rows at a time: it holds a lease
//!   (`outbox_relay_lease`) that it renews at each claim, and another [`SqliteRelay`] waits
//!   as a standby and takes over once the lease has expired (a crashed relay's rows are
//!   published again by the next one; JetStream drops the copies inside the stream's
//!   duplicate window). The relay never holds the write lock while it publishes: it takes it
//!   for a moment to claim, to record a rejection and to delete what was published.
//! - No LISTEN/NOTIFY: a relay polls every [`RelayConfig::poll_interval`], and is woken at
//!   once by a unit of work that commits in the same process (the usual set-up for an
//!   embedded database).
//! - Dead letters: [`crate::dead_letter`]'s functions take an [`AsyncSqliteConnection`]
//!   (each retry or skip in one `BEGIN IMMEDIATE` transaction); a retry or skip wakes the
//!   relay of its own process at once, another process's at its next poll. So do the
//!   `outbox` command's `dead-letters`, `retry` and `skip`, beside `migrate`, `relay` and
//!   `status` (built with `--features sqlite`).
//! - The archive ([`PublishedRows::Archive`]): the relay moves each acked row, whole, into
//!   `outbox_published` in the transaction that would delete it, so `outbox_events` keeps
//!   only what is queued. One table with an index on `published_at`; PostgreSQL's is
//!   partitioned by day.
//! - Retention: [`crate::outbox::purge_published`] (for [`PublishedRows::Mark`], through a
//!   partial index of published rows), [`purge_archived`] (for [`PublishedRows::Archive`])
//!   and [`crate::outbox::purge_dedup_keys`] take an [`AsyncSqliteConnection`]; so do
//!   `outbox purge` and `outbox relay --purge-older-than`.
//! - The inbox: [`Inbox<H, AsyncSqliteConnection>`](crate::Inbox) with a
//!   [`Handler<AsyncSqliteConnection>`](crate::Handler), on the tables of migration
//!   `2026-11-27-000005_inbox`, with the same guarantees as on PostgreSQL: effects once per
//!   message, each aggregate's events in order across restarts and instances, dead letters.
//!   Each message is applied in a unit of work's `BEGIN IMMEDIATE` transaction, so the
//!   consumer's messages are applied one at a time, in turn with every other writer of the
//!   file, whatever `max_concurrency` says (keep it small: the rest wait for the lock). The
//!   inbox's own queries are bounded by `statement_timeout` on the client.
//! - Not on SQLite: the topology registry.
//! - The relay reads the outbox lag and the counts of waiting rows into the same gauges as on
//!   PostgreSQL ([`stats`] reads them on demand).
//! - Times are UTC text with milliseconds (`YYYY-MM-DD HH:MM:SS.SSS`); a row inserted by hand
//!   with another shape is refused by the table's CHECKs, since it would compare wrongly.
//!
//! [`RelayConfig::poll_interval`]: crate::RelayConfig::poll_interval
//! [`PublishedRows::Archive`]: crate::PublishedRows::Archive
//! [`PublishedRows::Mark`]: crate::PublishedRows::Mark

use std::collections::HashSet;
use std::time::Duration;

use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::sql_types::{BigInt, Integer, Nullable, Text};
use diesel::sqlite::Sqlite;
pub use diesel::sqlite::SqliteConnection;
use diesel::{Connection, ConnectionResult, QueryableByName, RunQueryDsl};
use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use crate::causality::Causality;
use crate::outbox::queries::{DedupKeys, NewEvent, TakenKey, numbering};
use crate::outbox::{MigrationError, MissingMigrations, Outbox};
use crate::unit_of_work::{DuplicateEvents, UnitOfWorkError, drop_duplicates};

pub use crate::relay::sqlite::{SqliteRelay, stats};

/// diesel's SQLite connection for async code: each statement runs on tokio's blocking pool.
/// Build one with `AsyncSqliteConnection::new(`[`establish`]`(path)?)`.
pub type AsyncSqliteConnection = SyncConnectionWrapper<SqliteConnection>;

/// The outbox's migrations for SQLite (`outbox-runtime/migrations-sqlite/`), for
/// [`run_migrations`] or your own diesel migration harness.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations-sqlite");

/// How long a connection opened by [`establish`] waits for SQLite's write lock before a
/// statement fails with "database is locked" (SQLite's `busy_timeout`).
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// SQLite's time of day in the tables' shape (UTC, milliseconds).
pub(crate) const NOW: &str = "strftime('%Y-%m-%d %H:%M:%f', 'now')";

/// The most rows one INSERT carries: SQLite allows 32,766 bound values a statement
/// (`SQLITE_MAX_VARIABLE_NUMBER` since 3.32), and an event takes 14.
const ROWS_PER_INSERT: usize = 2_000;

/// The most dedup keys one statement takes: two bound values each, within SQLite's limit.
const KEYS_PER_STATEMENT: usize = 10_000;

/// Opens the database at `url` (a file path, `sqlite://path`, or a `file:` URI; created when
/// missing) for the outbox: write-ahead logging (readers, the relay among them, do not wait
/// for a writer), and a [`BUSY_TIMEOUT`] for the write lock. A file this connection may not
/// write (`mode=ro`, or its permissions) is opened in the journal mode it has, for reading.
///
/// # Errors
/// [`InvalidConnectionUrl`](diesel::ConnectionError::InvalidConnectionUrl) for a URL with no
/// path (`""`, `sqlite://`, `file:?mode=rwc`), where SQLite would open a temporary database
/// that no other connection sees and that vanishes with this one;
/// [`BadConnection`](diesel::ConnectionError::BadConnection) naming the directory for a file
/// in one that does not exist (no directory is made); else the database's error, when the
/// file cannot be opened or the settings cannot be applied.
pub fn establish(url: &str) -> ConnectionResult<SqliteConnection> {
    if let Some(error) = crate::database::names_no_file(url) {
        return Err(diesel::ConnectionError::InvalidConnectionUrl(
            error.to_string(),
        ));
    }
    let path = url.strip_prefix("sqlite://").unwrap_or(url);
    let mut conn = SqliteConnection::establish(path).map_err(|error| {
        let Some(file) = crate::database::sqlite_file(url) else {
            return error;
        };
        match file.parent() {
            Some(dir) if !dir.as_os_str().is_empty() && !dir.exists() => {
                diesel::ConnectionError::BadConnection(format!(
                    "unable to open database file {}: the directory {} does not exist",
                    file.display(),
                    dir.display()
                ))
            }
            _ => error,
        }
    })?;
    conn.batch_execute(&format!(
        "PRAGMA busy_timeout = {};",
        BUSY_TIMEOUT.as_millis()
    ))
    .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
    match conn.batch_execute("PRAGMA journal_mode = WAL;") {
        // A file this connection may not write (`mode=ro`, its permissions) in SQLite's
        // rollback journal cannot be put in write-ahead logging: the connection reads it as
        // it is, and a write is refused where it is made, named as such
        // (`database::refusal_hint`, `MigrationError::ReadOnly`). Before, the connection
        // failed here, in SQLite's words alone, and nothing could read the file.
        Err(error) if crate::database::takes_no_writes(&error) => Ok(conn),
        Err(error) => Err(diesel::ConnectionError::CouldntSetupConfiguration(error)),
        Ok(()) => Ok(conn),
    }
}

/// Applies the pending [`MIGRATIONS`] on `conn` and returns the versions it applied (empty
/// when the schema is current). Each migration runs in its own transaction; an instance that
/// migrates while another does waits for the write lock (the connection's `busy_timeout`),
/// then finds the migration applied.
///
/// # Errors
/// [`MigrationError::ReadOnly`] on a file opened read-only (`mode=ro`) or one this process
/// may not write; else [`MigrationError::Migration`] naming the migration that failed.
pub fn run_migrations(conn: &mut SqliteConnection) -> Result<Vec<String>, MigrationError> {
    Ok(conn
        .run_pending_migrations(MIGRATIONS)
        .map_err(|e| MigrationError::applying(e, crate::database::Kind::Sqlite))?
        .into_iter()
        .map(|version| version.to_string())
        .collect())
}

/// Deletes the archived rows ([`PublishedRows::Archive`]: `outbox_published`) published
/// more than `older_than` ago, oldest first, `batch` rows per statement (at least 1), each in
/// a `BEGIN IMMEDIATE` transaction of its own (units of work and the relay go on between
/// batches), and returns how many; `progress` hears the running total after each batch. Each
/// batch reads only the rows it deletes (the archive's index on `published_at`). An
/// `older_than` over a thousand years (`Duration::MAX`, say) deletes nothing. The `outbox`
/// command runs it in `purge` and `relay --purge-older-than`.
///
/// # Errors
/// The database's error; the batches before it stay deleted.
///
/// [`PublishedRows::Archive`]: crate::PublishedRows::Archive
pub async fn purge_archived(
    conn: &mut AsyncSqliteConnection,
    older_than: Duration,
    batch: i64,
    mut progress: impl FnMut(usize) + Send,
) -> diesel::QueryResult<usize> {
    crate::outbox::purge::sqlite::purge_archived(conn, older_than, batch.max(1), &mut progress)
        .await
}

/// The versions of [`MIGRATIONS`] the database at the other end of `conn` has not applied,
/// oldest first: empty when the outbox schema is current.
///
/// # Errors
/// The database's error.
pub fn pending_migrations(conn: &mut SqliteConnection) -> diesel::QueryResult<Vec<String>> {
    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    #[derive(QueryableByName)]
    struct Version {
        #[diesel(sql_type = Text)]
        version: String,
    }
    let embedded: Vec<String> =
        diesel::migration::MigrationSource::<Sqlite>::migrations(&MIGRATIONS)
            .map_err(diesel::result::Error::QueryBuilderError)?
            .iter()
            .map(|migration| migration.name().version().to_string())
            .collect();
    let table: Count = diesel::sql_query(
        "SELECT COUNT(*) AS n FROM sqlite_master \
         WHERE type = 'table' AND name = '__diesel_schema_migrations'",
    )
    .get_result(conn)?;
    if table.n == 0 {
        return Ok(embedded);
    }
    let applied: HashSet<String> =
        diesel::sql_query("SELECT version FROM __diesel_schema_migrations")
            .load::<Version>(conn)?
            .into_iter()
            .map(|v| v.version)
            .collect();
    Ok(embedded
        .into_iter()
        .filter(|version| !applied.contains(version))
        .collect())
}

/// Opens the unit of work's transaction: `BEGIN IMMEDIATE` takes the write lock now, so the
/// numbering below reads counters no other writer can move before COMMIT. The savepoint
/// marks the transaction as the unit of work's (see [`require_unit_of_work`]).
pub(crate) fn begin(conn: &mut SqliteConnection) -> diesel::QueryResult<()> {
    begin_immediate(conn, "BEGIN IMMEDIATE; SAVEPOINT outbox_unit_of_work")
}

/// The longest pause between two tries for the write lock in [`begin_immediate`].
const LOCK_RETRY_MAX: Duration = Duration::from_millis(1);

/// Opens a write transaction with `sql` (starting with `BEGIN IMMEDIATE`), waiting for
/// SQLite's write lock as long as the connection's `busy_timeout`, but trying again every
/// 50 us to 1 ms (doubling) rather than in SQLite's own steps.
///
/// SQLite's default busy handler sleeps 1, 2, 5, 10, 15, 20, 25, 25, 25, 50, 50 and then
/// 100 ms between its tries (`sqliteDefaultBusyCallback` in `main.c`): a writer that meets
/// the lock twice sleeps through many commits of the others, so under a steady load the
/// writers' commit latency has a long tail and their throughput falls behind the rate one
/// writer at a time allows. diesel 2.3 has no way to set another busy handler, so the
/// connection's `busy_timeout` is set to 0 for the tries (each fails at once with
/// `SQLITE_BUSY`) and put back after them.
///
/// # Errors
/// The last try's error ("database is locked" once `busy_timeout` has passed), or the
/// error of reading or setting `busy_timeout`.
pub(crate) fn begin_immediate(conn: &mut SqliteConnection, sql: &str) -> diesel::QueryResult<()> {
    #[derive(QueryableByName)]
    struct BusyTimeout {
        #[diesel(sql_type = Integer)]
        timeout: i32,
    }
    let timeout: BusyTimeout = diesel::sql_query("PRAGMA busy_timeout").get_result(conn)?;
    let timeout = Duration::from_millis(u64::try_from(timeout.timeout).unwrap_or(0));
    if timeout.is_zero() {
        return AnsiTransactionManager::begin_transaction_sql(conn, sql);
    }
    conn.batch_execute("PRAGMA busy_timeout = 0")?;
    let deadline = std::time::Instant::now() + timeout;
    let mut pause = Duration::from_micros(50);
    let begun = loop {
        let now = std::time::Instant::now();
        match AnsiTransactionManager::begin_transaction_sql(conn, sql) {
            Err(diesel::result::Error::DatabaseError(_, info))
                if info.message().starts_with("database is locked") && now < deadline =>
            {
                // The last try comes at the deadline.
                std::thread::sleep(pause.min(deadline - now));
                pause = (pause * 2).min(LOCK_RETRY_MAX);
            }
            result => break result,
        }
    };
    let restored = conn.batch_execute(&format!("PRAGMA busy_timeout = {}", timeout.as_millis()));
    match (begun, restored) {
        (Ok(()), Err(error)) => {
            let _ = AnsiTransactionManager::rollback_transaction(conn);
            Err(error)
        }
        (begun, _) => begun,
    }
}

/// Runs `task` in one `BEGIN IMMEDIATE` transaction ([`begin_immediate`]'s wait for the
/// write lock): committed when it returns `Ok`, rolled back otherwise.
///
/// # Errors
/// The error of the BEGIN, of `task` (after the rollback) or of the COMMIT.
pub(crate) fn immediate_transaction<R>(
    conn: &mut SqliteConnection,
    task: impl FnOnce(&mut SqliteConnection) -> diesel::QueryResult<R>,
) -> diesel::QueryResult<R> {
    begin_immediate(conn, "BEGIN IMMEDIATE")?;
    match task(conn) {
        Ok(value) => {
            AnsiTransactionManager::commit_transaction(conn)?;
            Ok(value)
        }
        Err(error) => {
            let _ = AnsiTransactionManager::rollback_transaction(conn);
            Err(error)
        }
    }
}

/// Fails with [`UnitOfWorkError::TransactionEnded`] when the unit of work's transaction is
/// no longer open (a COMMIT or ROLLBACK sent by hand on `uow.conn()`): it ended its
/// savepoints too, so releasing the mark fails with "no such savepoint" (SQLite docs,
/// "SAVEPOINT": RELEASE of a name not on the stack is an error). The events must then not be
/// written: outside a transaction each statement would commit on its own. (diesel has
/// noticed the transaction's end too: the unit of work's rollback finds nothing to roll
/// back.)
fn require_unit_of_work(conn: &mut SqliteConnection) -> Result<(), UnitOfWorkError> {
    match conn.batch_execute("RELEASE outbox_unit_of_work") {
        Ok(()) => Ok(()),
        Err(diesel::result::Error::DatabaseError(_, info))
            if info.message().starts_with("no such savepoint") =>
        {
            Err(UnitOfWorkError::TransactionEnded)
        }
        Err(error) => Err(UnitOfWorkError::Database(error)),
    }
}

/// Takes the events' dedup keys and writes the events that are not duplicates, numbered after
/// each aggregate's last sequence, inside the transaction [`begin`] opened; first checks
/// that the transaction is still the unit of work's.
pub(crate) fn write_events(
    conn: &mut SqliteConnection,
    mut events: Vec<NewEvent>,
    causality: &Causality,
    duplicates: DuplicateEvents,
) -> Result<(), UnitOfWorkError> {
    require_unit_of_work(conn)?;
    if events.iter().any(|e| e.dedup_key.is_some()) {
        let taken = take_dedup_keys(conn, &events).map_err(UnitOfWorkError::Database)?;
        drop_duplicates(&mut events, &taken, duplicates)?;
    }
    if !events.is_empty() {
        insert_events(conn, &events, causality).map_err(UnitOfWorkError::Database)?;
    }
    Ok(())
}

/// The [`MIGRATIONS`] the database file at the other end of `conn` lacks, as the relay, the
/// inbox and a unit of work report them ([`pending_migrations`]; a file has no
/// [`MissingMigrations::elsewhere`]). `None` when the outbox schema is current.
///
/// # Errors
/// The database's error.
pub fn missing_migrations(
    conn: &mut SqliteConnection,
) -> diesel::QueryResult<Option<MissingMigrations>> {
    let pending = pending_migrations(conn)?;
    Ok((!pending.is_empty()).then_some(MissingMigrations {
        pending,
        elsewhere: None,
    }))
}

// The trait is crate-private in effect (see `unit_of_work::sealed`).
#[allow(private_interfaces)]
impl crate::unit_of_work::sealed::Backend for AsyncSqliteConnection {
    /// No id: an SQLite connection, in the process, cannot be lost mid-COMMIT.
    async fn begin_unit_of_work(
        &mut self,
        _outbox: &Outbox,
    ) -> diesel::QueryResult<Option<crate::unit_of_work::TransactionId>> {
        self.spawn_blocking(begin).await?;
        Ok(None)
    }

    async fn write_events(
        &mut self,
        events: Vec<NewEvent>,
        causality: &Causality,
        duplicates: DuplicateEvents,
    ) -> Result<(), UnitOfWorkError> {
        let causality = causality.clone();
        self.spawn_blocking(move |conn| Ok(write_events(conn, events, &causality, duplicates)))
            .await
            .map_err(UnitOfWorkError::Database)?
    }

    async fn missing_migrations(&mut self) -> diesel::QueryResult<Result<(), MissingMigrations>> {
        self.spawn_blocking(|conn| Ok(missing_migrations(conn)?.map_or(Ok(()), Err)))
            .await
    }

    fn events_committed() {
        crate::commits::COMMITS.committed();
    }
}

/// `(?, ?, ...)` groups of `width` placeholders, `n` of them, joined by commas.
fn placeholders(n: usize, width: usize) -> String {
    let group = format!("({})", vec!["?"; width].join(", "));
    vec![group; n].join(", ")
}

/// Takes the dedup keys of `events` and returns the positions of the events not to write
/// (as the PostgreSQL unit of work does; see `outbox::queries::take_dedup_keys`). The write
/// lock of `BEGIN IMMEDIATE` makes the insert and the read that follows it atomic.
fn take_dedup_keys(
    conn: &mut SqliteConnection,
    events: &[NewEvent],
) -> diesel::QueryResult<Vec<usize>> {
    let mut plan = DedupKeys::plan(events);
    let keys: Vec<(&str, String)> = plan
        .keys()
        .into_iter()
        .map(|(key, id)| (key, id.to_string()))
        .collect();
    if keys.is_empty() {
        return Ok(plan.duplicates(events));
    }
    for chunk in keys.chunks(KEYS_PER_STATEMENT) {
        let mut insert = diesel::sql_query(format!(
            "INSERT INTO outbox_dedup_keys (dedup_key, event_id) VALUES {} ON CONFLICT DO NOTHING",
            placeholders(chunk.len(), 2)
        ))
        .into_boxed::<Sqlite>();
        for (key, id) in chunk {
            insert = insert.bind::<Text, _>(*key).bind::<Text, _>(id.as_str());
        }
        insert.execute(conn)?;
        let mut ours = diesel::sql_query(format!(
            "SELECT dedup_key FROM outbox_dedup_keys WHERE (dedup_key, event_id) IN (VALUES {})",
            placeholders(chunk.len(), 2)
        ))
        .into_boxed::<Sqlite>();
        for (key, id) in chunk {
            ours = ours.bind::<Text, _>(*key).bind::<Text, _>(id.as_str());
        }
        let taken: Vec<TakenKey> = ours.load(conn)?;
        plan.taken(&taken);
    }
    Ok(plan.duplicates(events))
}

/// An aggregate's counter after the unit of work advanced it.
#[derive(QueryableByName)]
struct Counter {
    #[diesel(sql_type = BigInt)]
    last_seq: i64,
    /// When the aggregate is parked behind a rejected row: its new rows wait until then.
    #[diesel(sql_type = Nullable<Text>)]
    blocked_until: Option<String>,
}

/// Writes `events`, numbering each aggregate's after its last sequence, in the order given.
///
/// Per aggregate, one upsert of `outbox_aggregates` advances the counter by the aggregate's
/// number of events, past the highest sequence of its rows first (rows another writer
/// inserted by hand), and returns it; then the events are inserted with their numbers.
/// Guarantee: `BEGIN IMMEDIATE` holds SQLite's write lock from the start of the transaction,
/// so no other writer runs between the counter's read and the COMMIT.
fn insert_events(
    conn: &mut SqliteConnection,
    events: &[NewEvent],
    causality: &Causality,
) -> diesel::QueryResult<()> {
    let (ordinals, counts) = numbering(events);
    let mut last: std::collections::HashMap<(&str, &str), Counter> =
        std::collections::HashMap::with_capacity(counts.len());
    for (&(aggregate_type, aggregate_id), &n) in &counts {
        let counter: Counter = diesel::sql_query(
            "INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, last_seq) \
             VALUES (?1, ?2, ?3 + COALESCE((SELECT MAX(aggregate_seq) FROM outbox_events \
                 WHERE aggregate_type = ?1 AND aggregate_id = ?2), 0)) \
             ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = ?3 + MAX( \
                 outbox_aggregates.last_seq, \
                 COALESCE((SELECT MAX(aggregate_seq) FROM outbox_events \
                     WHERE aggregate_type = ?1 AND aggregate_id = ?2), 0)) \
             RETURNING last_seq, blocked_until",
        )
        .bind::<Text, _>(aggregate_type)
        .bind::<Text, _>(aggregate_id)
        .bind::<BigInt, _>(n)
        .get_result(conn)?;
        last.insert((aggregate_type, aggregate_id), counter);
    }

    let headers = causality.headers_json();
    let ids: Vec<String> = events.iter().map(|e| e.id.to_string()).collect();
    let rows: Vec<(usize, &NewEvent)> = events.iter().enumerate().collect();
    for chunk in rows.chunks(ROWS_PER_INSERT) {
        let mut insert = diesel::sql_query(format!(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, \
             event_type, event_version, partition_key, subject, payload, available_at, \
             correlation_id, causation_id, headers) VALUES {}",
            vec![
                format!("(?, ?, ?, ?, ?, ?, ?, ?, ?, MAX({NOW}, COALESCE(?, {NOW})), ?, ?, ?)");
                chunk.len()
            ]
            .join(", ")
        ))
        .into_boxed::<Sqlite>();
        for &(position, event) in chunk {
            let aggregate = (event.aggregate_type.as_str(), event.aggregate_id.as_str());
            let counter = &last[&aggregate];
            let seq = counter.last_seq - counts[&aggregate] + ordinals[position];
            insert = insert
                .bind::<Text, _>(ids[position].as_str())
                .bind::<Text, _>(aggregate.0)
                .bind::<Text, _>(aggregate.1)
                .bind::<BigInt, _>(seq)
                .bind::<Text, _>(event.event_type)
                .bind::<Integer, _>(event.event_version)
                .bind::<Text, _>(event.partition_key.as_str())
                .bind::<Text, _>(event.subject.as_str())
                .bind::<Text, _>(event.payload.as_str())
                .bind::<Nullable<Text>, _>(counter.blocked_until.as_deref())
                .bind::<Text, _>(causality.correlation_id.as_str())
                .bind::<Text, _>(causality.causation_id.as_str())
                .bind::<Text, _>(headers.as_str());
        }
        insert.execute(conn)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::establish;

    /// A URL with no path is refused, naming it: SQLite would open a temporary database of
    /// its own, so `outbox migrate` would report migrations applied to a database that
    /// vanishes, and a unit of work would commit its events there.
    #[test]
    fn a_url_without_a_path_is_refused_rather_than_opened_as_a_temporary_database() {
        for (url, says) in [
            ("", "the database URL is empty"),
            ("  ", "the database URL is empty"),
            ("sqlite://", "the SQLite URL \"sqlite://\" names no file"),
            ("sqlite://  ", "the SQLite URL \"sqlite://\" names no file"),
            (
                "file:?mode=rwc",
                "the SQLite URL \"file:?mode=rwc\" names no file",
            ),
        ] {
            let Err(diesel::ConnectionError::InvalidConnectionUrl(error)) = establish(url) else {
                panic!("{url:?} was opened");
            };
            assert!(error.contains(says), "{url:?}: {error}");
        }
        let dir = std::env::temp_dir().join(format!("outbox-establish-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("o.db");
        let path = path.to_str().unwrap();
        for url in [path.to_owned(), format!("sqlite://{path}")] {
            establish(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
        }
        assert!(std::path::Path::new(path).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file in a directory that does not exist (a volume not mounted, a typo in the
    /// directory) is named with the directory, where SQLite says only "unable to open database
    /// file"; no directory is made.
    #[test]
    fn a_file_in_a_directory_that_does_not_exist_names_the_directory() {
        let dir = std::env::temp_dir().join(format!("outbox-no-dir-{}", std::process::id()));
        let path = dir.join("orders.db");
        let path = path.to_str().unwrap();
        for url in [
            path.to_owned(),
            format!("sqlite://{path}"),
            format!("file:{path}?mode=rwc"),
        ] {
            let Err(diesel::ConnectionError::BadConnection(error)) = establish(&url) else {
                panic!("{url:?} was opened");
            };
            assert_eq!(
                error,
                format!(
                    "unable to open database file {path}: the directory {} does not exist",
                    dir.display()
                ),
                "{url}"
            );
        }
        assert!(!dir.exists());
    }
}
