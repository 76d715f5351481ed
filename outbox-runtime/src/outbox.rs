//! The outbox table: its schema, its migrations, the statements that read and write it, and
//! [`Outbox`], the handle through which a service writes to it.
//!
//! # The tables (a public contract)
//!
//! `outbox_events` holds one row per event. A row is *queued* until the message relay
//! publishes it to its `subject` (and deletes it, or sets `published_at`) or an operator
//! skips it. Any writer may insert rows: a row inserted by plain SQL with the columns that
//! have no default (`aggregate_type`, `aggregate_id`, `aggregate_seq`, `event_type`,
//! `partition_key`, `subject`, `payload`) is relayed like the unit of work's own.
//! `outbox_aggregates` keeps the last sequence number handed out per aggregate, and whether
//! its queue is blocked; the function `outbox_insert_events` is the unit of work's INSERT.
//! `outbox_inbox` and `outbox_inbox_dead_letters` belong to the [inbox](crate::inbox). The
//! SQL in `outbox-runtime/migrations/` defines them all and documents every column;
//! [`schema`] is diesel's view of the tables.

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) mod purge;
pub(crate) mod queries;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) mod report;
#[cfg(feature = "postgres")]
pub mod schema;
#[cfg(feature = "postgres")]
pub(crate) mod statement;

use std::sync::Arc;
use std::time::Duration;

use crate::database::ConnectError;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
use crate::database::OperatorConnection;
use crate::topology::Topology;
// PostgreSQL's migrations, topology registry and operator queries.
#[cfg(feature = "postgres")]
use {
    crate::database::{self, DEFAULT_CONNECT_TIMEOUT},
    crate::topology::{self, Role},
    diesel::sql_types::{Int8, Nullable, Timestamptz},
    diesel::{QueryResult, QueryableByName},
    diesel_async::async_connection_wrapper::AsyncConnectionWrapper,
    diesel_async::{AsyncPgConnection, RunQueryDsl},
    diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations},
    std::sync::Mutex,
    std::time::Instant,
};

pub use queries::PublishedRows;

/// The migrations that create and evolve the outbox tables, for a migration harness of your
/// own; [`run_migrations`] applies them.
#[cfg(feature = "postgres")]
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

/// The largest payload a unit of work writes by default, in bytes: 1,032,192, nats-server's
/// default `max_payload` (1 MiB, `MAX_PAYLOAD_SIZE` in the server's `server/const.go`), less
/// 16 KiB for the headers the relay adds to each message. The server holds a message's
/// headers and payload together to its `max_payload` (`server/client.go`, `processHeaderPub`);
/// the relay's headers take about 0.6 KB for short ids and names, and at most 8,692 bytes
/// (every token, id and the `ce-source` at its longest and each byte percent-encoded: 8,096;
/// OpenTelemetry's `traceparent` and `tracestate` at theirs: 596; a unit test of the
/// publisher counts them). A larger event is refused at commit
/// ([`UnitOfWorkError::PayloadTooLarge`](crate::UnitOfWorkError::PayloadTooLarge)) rather than
/// refused by the broker, retried and dead-lettered; [`Outbox::with_max_payload`] sets another
/// bound for a server whose `max_payload` is raised.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024 - 16 * 1024;

/// The outbox of one service: where its units of work write events, and under which
/// [`Topology`] (the subject prefix of their subjects, the stream the relay publishes to).
///
/// Cheap to clone. Start units of work with [`Outbox::transaction`]. The first unit of work
/// (and one an hour after) registers the prefix in `outbox_topologies`, in its own statement
/// before `BEGIN`, and logs a warning when a relay of this outbox publishes another prefix
/// (see [`crate::topology`]).
#[derive(Clone)]
pub struct Outbox {
    topology: Arc<Topology>,
    /// When this outbox (and its clones) last registered its topology (PostgreSQL's
    /// `outbox_topologies`).
    #[cfg(feature = "postgres")]
    registered: Arc<Mutex<Option<Instant>>>,
    /// [`Outbox::report_transaction_ids`].
    transaction_ids: bool,
    /// [`Outbox::with_max_payload`].
    max_payload: usize,
}

impl Outbox {
    /// An outbox with the default topology: prefix [`DEFAULT_SUBJECT_PREFIX`](crate::DEFAULT_SUBJECT_PREFIX), stream
    /// `EVENTS`.
    pub fn new() -> Self {
        Self::with_topology(Topology::default())
    }

    /// An outbox whose units of work write under `topology`'s subject prefix. Give the relay
    /// the same value ([`RelayConfig::topology`](crate::RelayConfig::topology)).
    pub fn with_topology(topology: Topology) -> Self {
        Self {
            topology: Arc::new(topology),
            #[cfg(feature = "postgres")]
            registered: Arc::new(Mutex::new(None)),
            transaction_ids: false,
            max_payload: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }

    /// Sets the largest payload, in bytes, that a unit of work of this outbox writes: an
    /// event whose payload JSON is longer fails the unit of work with
    /// [`UnitOfWorkError::PayloadTooLarge`](crate::UnitOfWorkError::PayloadTooLarge), and
    /// nothing is written. Default [`DEFAULT_MAX_PAYLOAD_BYTES`], which fits nats-server's
    /// default `max_payload`; for a server (and stream, `max_msg_size`) that takes larger
    /// messages, their bound less 16 KiB for the relay's headers. A bound the server does not
    /// honour leaves the relay to find the message refused: it retries it and, after
    /// `max_attempts`, dead-letters it, its aggregate's later events waiting behind it.
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// The largest payload a unit of work writes, in bytes ([`Self::with_max_payload`]).
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// Has each unit of work on PostgreSQL ask for its transaction's id when it begins, so
    /// that a unit of work whose connection was lost while its COMMIT was in flight reports
    /// the id ([`UnitOfWorkError::CommitOutcomeUnknown`](crate::UnitOfWorkError)), and
    /// [`transaction_status`](crate::transaction_status) tells, on a new connection, whether
    /// it committed (or that it cannot tell, where the server crashed since).
    /// [`UnitOfWork::transaction_id`](crate::UnitOfWork::transaction_id) gives it inside the
    /// closure. Off by default.
    ///
    /// The cost: on async connections the question rides in the BEGIN's round trip, and a
    /// unit of work of one event took 1.46-1.52x a bare transaction against 1.37-1.43x
    /// without it, 0.060-0.077 ms more (`relay_bench --phases 6`, three runs, 2026-11-28, the
    /// two interleaved in each); on sync diesel's `PgConnection` it takes a round trip of its
    /// own. MySQL keeps no such record, and SQLite's connection cannot be lost: there the
    /// setting changes nothing.
    ///
    /// Needs PostgreSQL 13 or later (`pg_current_xact_id`, `pg_xact_status`); on 12 every
    /// unit of work fails at its BEGIN with "function pg_current_xact_id() does not exist",
    /// and its transaction is rolled back.
    ///
    /// An inbox given this outbox (`InboxConfig::outbox`) asks too, which it does not need:
    /// it settles an unknown outcome by the message's redelivery, which finds the message
    /// applied if the COMMIT ran.
    pub fn report_transaction_ids(mut self, enabled: bool) -> Self {
        self.transaction_ids = enabled;
        self
    }

    /// Whether units of work ask for their transaction's id
    /// ([`Self::report_transaction_ids`]).
    pub fn reports_transaction_ids(&self) -> bool {
        self.transaction_ids
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The subject prefix, `topology().subject_prefix`.
    pub fn subject_prefix(&self) -> &str {
        self.topology.subject_prefix.as_str()
    }

    /// Registers the topology when it has not been for [`topology::REGISTER_EVERY`]. A
    /// failure is logged, never the unit of work's: the registry only serves diagnosis.
    #[cfg(feature = "postgres")]
    pub(crate) async fn register_if_due(&self, conn: &mut AsyncPgConnection) {
        if !self.registration_due() {
            return;
        }
        if let Err(error) = topology::register(conn, Role::Outbox, &self.topology).await {
            self.registration_failed(&error);
        }
    }

    /// Logs a failed registration. A serialization failure is another process registering
    /// the same topology at the same moment on a database whose default isolation is
    /// REPEATABLE READ or SERIALIZABLE (the registration runs at the connection's level,
    /// outside the unit of work's transaction): not worth a warning; the next unit of work
    /// registers again.
    #[cfg(feature = "postgres")]
    pub(crate) fn registration_failed(&self, error: &diesel::result::Error) {
        use diesel::result::{DatabaseErrorKind, Error};
        if matches!(
            error,
            Error::DatabaseError(DatabaseErrorKind::SerializationFailure, _)
        ) {
            tracing::debug!(
                %error,
                "the outbox's topology was registered concurrently; registering again at the \
                 next unit of work"
            );
            *self.registered.lock().unwrap_or_else(|p| p.into_inner()) = None;
        } else {
            tracing::warn!(%error, "cannot register the outbox's topology in outbox_topologies");
        }
    }

    /// Whether this outbox should register its topology now (every
    /// `topology::REGISTER_EVERY`); when it says yes, the time is taken.
    #[cfg(feature = "postgres")]
    pub(crate) fn registration_due(&self) -> bool {
        let mut last = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|at| at.elapsed() < topology::REGISTER_EVERY) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("topology", &self.topology)
            .field("transaction_ids", &self.transaction_ids)
            .finish_non_exhaustive()
    }
}

impl Default for Outbox {
    fn default() -> Self {
        Self::new()
    }
}

/// Migrations could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// No connection to the database (within its
    /// [connect timeout](crate::database::DEFAULT_CONNECT_TIMEOUT), 10 s).
    #[error("cannot run the outbox migrations: {0}")]
    Connect(#[from] ConnectError),
    /// The advisory lock that serialises concurrent migration runs could not be taken.
    #[error("cannot take the outbox migration lock: {0}")]
    Lock(#[from] diesel::result::Error),
    /// A migration failed; the database keeps the migrations applied before it.
    #[error("an outbox migration failed: {0}")]
    Migration(Box<dyn std::error::Error + Send + Sync>),
    /// The database takes no writes, so the migrations cannot create or change the outbox's
    /// tables there; the string says what makes it so and what to run them on instead (the
    /// primary's URL; a SQLite file this process can write). On PostgreSQL this is found
    /// before anything is applied, and names its cause: a hot standby
    /// (`pg_is_in_recovery()`; PostgreSQL docs, "Hot Standby"), or a session read-only by
    /// `default_transaction_read_only` (`transaction_read_only`; "Client Connection
    /// Defaults"). On MySQL, MariaDB and SQLite,
    /// by the refusal of a migration's write (MySQL's errors 1290, "--read-only option", and
    /// 1792; SQLite's `SQLITE_READONLY`); the database keeps the migrations applied before it.
    #[error("cannot run the outbox migrations: {0}")]
    ReadOnly(String),
    /// The session's `search_path` (the string: its setting, as `SHOW search_path` gives it)
    /// names no schema of the database that exists, so the outbox's tables have nowhere to
    /// go: PostgreSQL's `current_schema()` is NULL
    /// (PostgreSQL docs, "System Information Functions"), as under the docs' secure schema
    /// usage pattern (`ALTER ROLE ALL SET search_path = "$user"`, "Schemas: Usage Patterns")
    /// for a role without a schema of its name. Nothing was applied.
    #[error(
        "cannot run the outbox migrations: the search_path ({0}) names no schema that exists \
         in this database, so the outbox's tables have nowhere to go; name one that exists in \
         the URL (`?options=-csearch_path%3D<schema>`), as the relay's, the inbox's and the \
         service's URLs will, or in the role's search_path (`ALTER ROLE ... SET search_path`)"
    )]
    NoSchema(String),
    /// The server is older than the outbox's oldest, and nothing was applied: PostgreSQL
    /// before 13 ([`MINIMUM_POSTGRES`]: the outbox's tables default their ids to
    /// `gen_random_uuid()`, in PostgreSQL's core since 13, its release notes: "Add function
    /// gen_random_uuid() to generate version-4 UUIDs"; the extension `pgcrypto`'s before);
    /// MySQL before 8.0.16 or MariaDB before 10.6 (`crate::mysql::run_migrations`: the
    /// relay's claim takes `FOR UPDATE SKIP LOCKED`, MariaDB's since 10.6, and the tables'
    /// `CHECK` constraints are enforced by MySQL since 8.0.16, parsed and ignored before).
    #[error(
        "cannot run the outbox migrations: the outbox needs {minimum}, and this server is \
         {server}"
    )]
    UnsupportedServer {
        /// The server and its version, as it gives them (`PostgreSQL 12.22`,
        /// `10.5.23-MariaDB`).
        server: String,
        /// The oldest servers the outbox runs on (`PostgreSQL 13 or later`).
        minimum: &'static str,
    },
    /// The blocking task running the migrations panicked or was cancelled.
    #[error("the outbox migration task did not finish: {0}")]
    Task(#[from] tokio::task::JoinError),
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl MigrationError {
    /// A failure of diesel's migration harness on a database of `kind`:
    /// [`ReadOnly`](Self::ReadOnly) where the database refused to write, else
    /// [`Migration`](Self::Migration). The harness gives the database's error as it is where
    /// its own table could not be created (the first write of a run), and in its words only
    /// ("Failed to run <migration> with: ...") where a migration failed, so both are read.
    pub(crate) fn applying(
        error: Box<dyn std::error::Error + Send + Sync>,
        kind: crate::database::Kind,
    ) -> Self {
        use crate::database::{no_writes, refused_writes_in, takes_no_writes};
        let refused = match error.downcast_ref::<diesel::result::Error>() {
            Some(error) => takes_no_writes(error),
            None => refused_writes_in(&error.to_string()).is_some(),
        };
        if refused {
            Self::read_only(no_writes(kind), kind)
        } else {
            Self::Migration(error)
        }
    }

    /// [`ReadOnly`](Self::ReadOnly): `reason` (`the database takes no writes (...)`) and what
    /// to run the migrations on instead.
    pub(crate) fn read_only(reason: &str, kind: crate::database::Kind) -> Self {
        Self::ReadOnly(format!(
            "{reason}, and the migrations write the outbox's tables; run them on {}",
            crate::database::writable_target(kind)
        ))
    }
}

/// The oldest PostgreSQL the outbox runs on, as `server_version_num` spells it: 13.0
/// ([`MigrationError::UnsupportedServer`]). The contract tests' PostgreSQL part passed on
/// 13.23, 14.23, 15, 16.2, 17.10 and 18.4; on 12 the first migration fails.
#[cfg(feature = "postgres")]
pub const MINIMUM_POSTGRES: i32 = 130_000;

/// Applies the pending outbox [`MIGRATIONS`] to the database at `database_url` and returns
/// the versions it applied (empty when the schema is current).
///
/// The connection is opened within [`DEFAULT_CONNECT_TIMEOUT`]; the migrations themselves
/// are not bounded (a migration of a large table may take long).
///
/// Safe to call from every instance at start-up: a PostgreSQL advisory lock serialises
/// concurrent runs. The migrations are recorded in diesel's `__diesel_schema_migrations`
/// table, beside any migrations of your own. Runs on a blocking thread, so it works on both
/// tokio runtime flavours.
///
/// # Errors
/// [`MigrationError::UnsupportedServer`] on PostgreSQL before 13, and
/// [`MigrationError::ReadOnly`] on a database that takes no writes (a hot standby), each
/// with nothing applied; else [`MigrationError`] naming the step that failed.
#[cfg(feature = "postgres")]
pub async fn run_migrations(database_url: &str) -> Result<Vec<String>, MigrationError> {
    let limits = database::Limits {
        connect_timeout: DEFAULT_CONNECT_TIMEOUT,
        // A migration may rewrite a large table: no server-side statement timeout.
        statement_timeout: Duration::ZERO,
    };
    let connection = database::connect(
        database_url,
        None,
        "outbox-migrations",
        limits,
        database::Isolation::ReadCommitted,
        None,
    )
    .await?;
    run_migrations_on(connection).await
}

/// [`run_migrations`] on a connection the service opened (from its pool, with its TLS and
/// credentials: `Object::take` takes one out of a deadpool pool). The connection is consumed:
/// it ends with the advisory lock it takes.
///
/// The migrations are not bounded by a statement timeout of the toolkit's, but a
/// `statement_timeout` set on the session still applies to them.
///
/// # Errors
/// As [`run_migrations`]'s, but for [`MigrationError::Connect`].
#[cfg(feature = "postgres")]
pub async fn run_migrations_on(
    connection: AsyncPgConnection,
) -> Result<Vec<String>, MigrationError> {
    use diesel::connection::SimpleConnection as _;

    #[derive(QueryableByName)]
    struct Target {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
        #[diesel(sql_type = diesel::sql_types::Text)]
        search_path: String,
        #[diesel(sql_type = diesel::sql_types::Integer)]
        version_num: i32,
        #[diesel(sql_type = diesel::sql_types::Text)]
        version: String,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        in_recovery: bool,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        read_only: bool,
    }

    tokio::task::spawn_blocking(move || {
        let mut connection = AsyncConnectionWrapper::<AsyncPgConnection>::from(connection);
        // Session-level lock: held across the migrations' own transactions, released when
        // the connection closes even if a migration fails. The key is "outbox" in ASCII.
        connection.batch_execute("SELECT pg_advisory_lock(122550254464888)")?;
        // Before diesel creates its table there ("no schema has been selected to create in").
        let target: Target = diesel::RunQueryDsl::get_result(
            diesel::sql_query(
                "SELECT current_schema() IS NOT NULL AS exists, \
                 current_setting('search_path') AS search_path, \
                 current_setting('server_version_num')::int4 AS version_num, \
                 current_setting('server_version') AS version, \
                 pg_is_in_recovery() AS in_recovery, \
                 current_setting('transaction_read_only') = 'on' AS read_only",
            ),
            &mut connection,
        )
        .map_err(|e| MigrationError::Migration(Box::new(e)))?;
        if target.version_num < MINIMUM_POSTGRES {
            return Err(MigrationError::UnsupportedServer {
                server: format!("PostgreSQL {}", target.version),
                minimum: "PostgreSQL 13 or later",
            });
        }
        if target.in_recovery {
            return Err(MigrationError::read_only(
                "the database takes no writes (a hot standby: pg_is_in_recovery() is true)",
                database::Kind::Postgres,
            ));
        }
        if target.read_only {
            return Err(MigrationError::read_only(
                "the database takes no writes (transaction_read_only is on: \
                 default_transaction_read_only, set for the database, the role or in the \
                 URL's options)",
                database::Kind::Postgres,
            ));
        }
        if !target.exists {
            return Err(MigrationError::NoSchema(target.search_path));
        }
        let applied = connection
            .run_pending_migrations(MIGRATIONS)
            .map_err(|e| MigrationError::applying(e, database::Kind::Postgres))?
            .into_iter()
            .map(|version| version.to_string())
            .collect();
        connection.batch_execute("SELECT pg_advisory_unlock(122550254464888)")?;
        Ok(applied)
    })
    .await?
}

/// The versions of [`MIGRATIONS`] that the database at the other end of `conn` has not applied,
/// oldest first: empty when the outbox schema is current. The relay and the inbox check this
/// when they connect, and refuse to start on a database that needs [`run_migrations`].
///
/// # Errors
/// The database's error.
#[cfg(feature = "postgres")]
pub async fn pending_migrations(conn: &mut AsyncPgConnection) -> QueryResult<Vec<String>> {
    use diesel::sql_types::{Array, Bool, Text};

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
    let embedded = embedded_versions()?;
    let table: Exists = diesel::sql_query(MIGRATIONS_TABLE_EXISTS)
        .get_result(conn)
        .await?;
    if !table.exists {
        return Ok(embedded);
    }
    let pending: Vec<Version> = diesel::sql_query(PENDING_VERSIONS)
        .bind::<Array<Text>, _>(&embedded)
        .load(conn)
        .await?;
    Ok(pending.into_iter().map(|v| v.version).collect())
}

/// Whether diesel's migrations table exists (a column `exists`).
#[cfg(feature = "postgres")]
pub(crate) const MIGRATIONS_TABLE_EXISTS: &str =
    "SELECT to_regclass('__diesel_schema_migrations') IS NOT NULL AS exists";

/// Of the versions `$1`, those not applied, in order (a column `version`).
#[cfg(feature = "postgres")]
pub(crate) const PENDING_VERSIONS: &str = "SELECT v AS version FROM unnest($1::text[]) WITH ORDINALITY AS e(v, n) \
     WHERE v NOT IN (SELECT version FROM __diesel_schema_migrations) ORDER BY n";

/// The versions of [`MIGRATIONS`], oldest first.
#[cfg(feature = "postgres")]
pub(crate) fn embedded_versions() -> QueryResult<Vec<String>> {
    Ok(
        diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&MIGRATIONS)
            .map_err(diesel::result::Error::QueryBuilderError)?
            .iter()
            .map(|migration| migration.name().version().to_string())
            .collect(),
    )
}

/// The outbox schema is behind this version of the toolkit, or not where the connection
/// looks ([`elsewhere`](Self::elsewhere)).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
#[error(
    "the outbox tables are not migrated: {} not applied; {}run the outbox migrations first \
     (outbox_runtime::run_migrations(database_url), or outbox_runtime::MIGRATIONS with your \
     own diesel migration harness)",
    describe_pending(.pending),
    elsewhere_then(.elsewhere.as_ref())
)]
pub struct MissingMigrations {
    /// The versions not applied, oldest first.
    pub pending: Vec<String>,
    /// Outbox tables the database server holds where this connection does not look, when it
    /// finds none where it looks: a relay, an inbox or a unit of work given the wrong schema
    /// or database, whose migrations would make a second, empty outbox beside the one the
    /// service writes to (where two services keep their outboxes in schemas of one database,
    /// a new one is what the migrations should make). `None` where the outbox tables are where
    /// the connection looks (the schema is only behind), where nothing else holds them, and on
    /// SQLite.
    pub elsewhere: Option<TablesElsewhere>,
}

/// Outbox tables that a connection does not see, of [`MissingMigrations::elsewhere`]. Its
/// `Display` names them and how to point a URL at them: "schema orders holds outbox tables
/// outside the search_path ("$user", public): to use that outbox, name it in the URL
/// (\`?options=-csearch_path%3Dorders\`) or the role's search_path, as the URL its
/// migrations ran on did".
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TablesElsewhere {
    /// PostgreSQL: the schemas of the database (of those the role may use) that hold
    /// `outbox_events` outside the session's `search_path` (PostgreSQL docs, "Schemas: The
    /// Schema Search Path").
    Schemas {
        /// The schemas, in name order.
        schemas: Vec<String>,
        /// The session's `search_path` setting, as `SHOW search_path` gives it.
        search_path: String,
    },
    /// MySQL or MariaDB: the server's other databases that hold `outbox_events` (of those
    /// the account sees in `information_schema.tables`).
    Databases {
        /// The databases, in name order.
        databases: Vec<String>,
        /// The connection's database, which the URL names.
        database: String,
    },
}

impl std::fmt::Display for TablesElsewhere {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, names) = match self {
            Self::Schemas { schemas, .. } => ("schema", schemas),
            Self::Databases { databases, .. } => ("database", databases),
        };
        let (holders, use_it, name) = match names.as_slice() {
            [one] => (
                format!("{kind} {one} holds"),
                "that outbox",
                if is_plain_name(one) {
                    one.clone()
                } else {
                    format!("<{kind}>")
                },
            ),
            many => {
                const SHOWN: usize = 5;
                let more = many.len().saturating_sub(SHOWN);
                let shown = many[..many.len().min(SHOWN)].join(", ");
                let holders = if more == 0 {
                    format!("{kind}s {shown} hold")
                } else {
                    format!("{kind}s {shown} and {more} more hold")
                };
                (holders, "one of them", format!("<{kind}>"))
            }
        };
        match self {
            Self::Schemas { search_path, .. } => write!(
                f,
                "{holders} outbox tables outside the search_path ({search_path}): to use \
                 {use_it}, name it in the URL (`?options=-csearch_path%3D{name}`) or the \
                 role's search_path, as the URL its migrations ran on did"
            ),
            Self::Databases { database, .. } => write!(
                f,
                "{holders} outbox tables, not the URL's database {database}: to use {use_it}, \
                 name it as the URL's database (`mysql://host/{name}`), as the URL its \
                 migrations ran on did"
            ),
        }
    }
}

/// A name that needs no quoting in SQL or a URL: lower-case ASCII letters, digits and `_`,
/// not led by a digit.
fn is_plain_name(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// `{elsewhere}; to make a new one here, `, or nothing.
pub(crate) fn elsewhere_then(elsewhere: Option<&TablesElsewhere>) -> String {
    elsewhere.map_or(String::new(), |elsewhere| {
        format!("{elsewhere}; to make a new one here, ")
    })
}

fn describe_pending(pending: &[String]) -> String {
    match pending {
        [one] => format!("migration {one} is"),
        many => format!("migrations {} are", many.join(", ")),
    }
}

/// The [`MIGRATIONS`] the database at the other end of `conn` lacks, as the relay, the inbox
/// and a unit of work report them: [`pending_migrations`], and where the `search_path` finds
/// no outbox tables, the database's schemas outside it that hold them
/// ([`MissingMigrations::elsewhere`]). `None` when the outbox schema is current.
///
/// # Errors
/// The database's error.
#[cfg(feature = "postgres")]
pub async fn missing_migrations(
    conn: &mut AsyncPgConnection,
) -> QueryResult<Option<MissingMigrations>> {
    let pending = pending_migrations(conn).await?;
    if pending.is_empty() {
        return Ok(None);
    }
    let elsewhere: SchemasElsewhere = diesel::sql_query(TABLES_ELSEWHERE).get_result(conn).await?;
    Ok(Some(MissingMigrations {
        pending,
        elsewhere: elsewhere.into(),
    }))
}

/// Fails with [`MissingMigrations`] when the database lacks some of [`MIGRATIONS`].
#[cfg(feature = "postgres")]
pub(crate) async fn require_migrations(
    conn: &mut AsyncPgConnection,
) -> Result<Result<(), MissingMigrations>, diesel::result::Error> {
    Ok(missing_migrations(conn).await?.map_or(Ok(()), Err))
}

/// The schemas of the database that hold `outbox_events` outside the session's
/// `search_path` and that the role may use (a column `schemas`), where the `search_path` finds
/// none; and the `search_path` (a column `search_path`). Read by [`SchemasElsewhere`].
#[cfg(feature = "postgres")]
pub(crate) const TABLES_ELSEWHERE: &str = "SELECT current_setting('search_path') AS search_path, \
     coalesce(array_agg(n.nspname::text ORDER BY n.nspname), '{}') AS schemas \
     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
     WHERE c.relname = 'outbox_events' AND c.relkind IN ('r', 'p') AND c.relpersistence <> 't' \
       AND to_regclass('outbox_events') IS NULL AND has_schema_privilege(n.oid, 'USAGE')";

/// A row of [`TABLES_ELSEWHERE`].
#[cfg(feature = "postgres")]
#[derive(QueryableByName)]
pub(crate) struct SchemasElsewhere {
    #[diesel(sql_type = diesel::sql_types::Text)]
    search_path: String,
    #[diesel(sql_type = diesel::sql_types::Array<diesel::sql_types::Text>)]
    schemas: Vec<String>,
}

#[cfg(feature = "postgres")]
impl From<SchemasElsewhere> for Option<TablesElsewhere> {
    fn from(row: SchemasElsewhere) -> Self {
        (!row.schemas.is_empty()).then_some(TablesElsewhere::Schemas {
            schemas: row.schemas,
            search_path: row.search_path,
        })
    }
}

/// The state of the outbox, for health checks and dashboards: read by [`stats`] on
/// PostgreSQL, `outbox_runtime::mysql::stats` and `outbox_runtime::sqlite::stats`, and by
/// every relay into its gauges (`outbox_queued_events`, `outbox_oldest_queued_age_seconds`,
/// ...) every [`RelayConfig::stats_interval`](crate::RelayConfig::stats_interval).
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "postgres", derive(QueryableByName))]
pub struct OutboxStats {
    /// Rows waiting to be published (parked ones included, dead letters not).
    #[cfg_attr(feature = "postgres", diesel(sql_type = Int8))]
    pub queued: i64,
    /// Dead letters that still block their aggregate: as many aggregates are blocked.
    #[cfg_attr(feature = "postgres", diesel(sql_type = Int8))]
    pub dead_letters: i64,
    /// Queued rows parked behind a dead letter of their aggregate (counted in `queued`).
    #[cfg_attr(feature = "postgres", diesel(sql_type = Int8))]
    pub blocked: i64,
    /// Dead letters skipped (by [`DeadLetterPolicy::Skip`](crate::DeadLetterPolicy::Skip) or
    /// by an operator) and never published: [`crate::dead_letter::retry`] can still publish
    /// them.
    #[cfg_attr(feature = "postgres", diesel(sql_type = Int8))]
    pub skipped_dead_letters: i64,
    /// When the oldest waiting row's event occurred: `now - oldest_queued_at` is the outbox
    /// lag. `None` when nothing waits.
    #[cfg_attr(feature = "postgres", diesel(sql_type = Nullable<Timestamptz>))]
    pub oldest_queued_at: Option<time::OffsetDateTime>,
}

impl OutboxStats {
    /// The outbox lag: how long ago the oldest waiting event occurred; zero when nothing
    /// waits.
    pub fn lag(&self) -> Duration {
        self.oldest_queued_at.map_or(Duration::ZERO, |oldest| {
            let lag = time::OffsetDateTime::now_utc() - oldest;
            Duration::try_from(lag).unwrap_or(Duration::ZERO)
        })
    }
}

/// Counts what waits in the outbox. Reads only queued rows (the `outbox_events_queued`
/// index) and dead letters (`outbox_events_dead_letters`), however many published rows are
/// kept.
///
/// # Errors
/// The database's error.
#[cfg(feature = "postgres")]
pub async fn stats(conn: &mut AsyncPgConnection) -> QueryResult<OutboxStats> {
    diesel::sql_query(
        "SELECT count(*) FILTER (WHERE dead_lettered_at IS NULL) AS queued, \
                count(*) FILTER (WHERE dead_lettered_at IS NOT NULL) AS dead_letters, \
                count(*) FILTER (WHERE dead_lettered_at IS NULL AND available_at = 'infinity') \
                    AS blocked, \
                min(occurred_at) FILTER (WHERE dead_lettered_at IS NULL) AS oldest_queued_at, \
                (SELECT count(*) FROM outbox_events \
                 WHERE dead_lettered_at IS NOT NULL AND skipped_at IS NOT NULL \
                   AND published_at IS NULL) AS skipped_dead_letters \
         FROM outbox_events WHERE published_at IS NULL AND skipped_at IS NULL",
    )
    .get_result(conn)
    .await
}

/// Creates the daily partitions of `outbox_published` (for [`PublishedRows::Archive`]) from
/// today to `days_ahead` days after, when missing, in the schema of the `outbox_published`
/// that the connection's `search_path` finds (another schema's outbox, whose partitions bear
/// the same names, is not looked at); returns how many it created. A relay in
/// Archive mode does this at start and every hour, two days ahead.
///
/// # Errors
/// The database's error.
#[cfg(feature = "postgres")]
pub async fn create_archive_partitions(
    conn: &mut AsyncPgConnection,
    days_ahead: i32,
) -> QueryResult<i32> {
    #[derive(QueryableByName)]
    struct Created {
        #[diesel(sql_type = diesel::sql_types::Int4)]
        created: i32,
    }
    let row: Created = diesel::sql_query("SELECT outbox_published_partitions($1) AS created")
        .bind::<diesel::sql_types::Int4, _>(days_ahead)
        .get_result(conn)
        .await?;
    Ok(row.created)
}

/// What [`drop_archived`] dropped.
#[cfg(feature = "postgres")]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dropped {
    /// The partitions dropped, a pending detach first and then oldest first, each with its
    /// row count estimate (from the planner's statistics, `pg_class.reltuples`: counting
    /// would read them; 0 when never analyzed).
    pub partitions: Vec<(String, i64)>,
}

/// Drops the partitions of `outbox_published` whose whole day (UTC) lies more than
/// `older_than` in the past: each is detached `CONCURRENTLY` (no lock that blocks the
/// relay's inserts into the partitioned table) and then dropped. Each statement runs on its
/// own, outside any transaction, so `conn` must not be in one. An `older_than` over a
/// thousand years (`Duration::MAX`, say) drops nothing.
///
/// # Errors
/// The database's error; the partitions dropped before it stay dropped. A detach that was
/// interrupted leaves its partition "detach pending", which the next call finishes first
/// (PostgreSQL allows one pending detach per table: ALTER TABLE, `DETACH PARTITION ...
/// FINALIZE`).
#[cfg(feature = "postgres")]
pub async fn drop_archived(
    conn: &mut AsyncPgConnection,
    older_than: Duration,
) -> QueryResult<Dropped> {
    use diesel::sql_types::{Bool, Text};
    use diesel_async::SimpleAsyncConnection as _;

    #[derive(QueryableByName)]
    struct Partition {
        #[diesel(sql_type = Text)]
        name: String,
        #[diesel(sql_type = Int8)]
        rows: i64,
        #[diesel(sql_type = Bool)]
        pending: bool,
    }
    let older_than_ms = purge::age_millis(older_than);
    // The day a partition holds is in its name: outbox_published_pYYYYMMDD.
    let partitions: Vec<Partition> = diesel::sql_query(
        "SELECT c.relname::text AS name, greatest(c.reltuples, 0)::int8 AS rows, \
                i.inhdetachpending AS pending \
         FROM pg_inherits i \
         JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'outbox_published'::regclass \
           AND c.relname ~ '^outbox_published_p[0-9]{8}$' \
           AND (to_date(substr(c.relname, 19), 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC' \
               <= now() - $1 * interval '1 millisecond' \
         ORDER BY i.inhdetachpending DESC, c.relname",
    )
    .bind::<Int8, _>(older_than_ms)
    .load(conn)
    .await?;
    let mut dropped = Dropped::default();
    for partition in partitions {
        let detach = if partition.pending {
            "FINALIZE"
        } else {
            "CONCURRENTLY"
        };
        conn.batch_execute(&format!(
            "ALTER TABLE outbox_published DETACH PARTITION {} {detach}",
            partition.name
        ))
        .await?;
        conn.batch_execute(&format!("DROP TABLE {}", partition.name))
            .await?;
        dropped.partitions.push((partition.name, partition.rows));
    }
    Ok(dropped)
}

/// What waits in the outbox, by aggregate type and event type, as [`queued_by_type`]
/// returns it.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[derive(Clone, Debug, PartialEq, Eq, diesel::QueryableByName)]
pub struct QueuedByType {
    /// The aggregate type.
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub aggregate_type: String,
    /// The event type.
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub event_type: String,
    /// Rows waiting to be published (parked ones included, dead letters not).
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub queued: i64,
    /// Dead letters that block their aggregate.
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub dead_letters: i64,
}

/// What waits in the outbox (the queued rows and the dead letters) by aggregate type and
/// event type, the most queued first, then the most dead letters, then by name. `conn` is
/// any [`OperatorConnection`]. Reads the queued rows only on PostgreSQL and SQLite (their
/// partial index of them), every row of `outbox_events` on MySQL (as
/// [`mysql::stats`](crate::mysql::stats) does).
///
/// # Errors
/// The database's error.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub async fn queued_by_type<C: OperatorConnection>(
    conn: &mut C,
) -> diesel::QueryResult<Vec<QueuedByType>> {
    conn.queued_by_type().await
}

/// How many rows were published in the last minute, counting at most `window` of them in
/// each place that keeps published rows: `outbox_events` for [`PublishedRows::Mark`]
/// (through its index of published rows on PostgreSQL and SQLite), and `outbox_published`
/// for [`PublishedRows::Archive`] (through its index on `published_at`: BRIN on PostgreSQL,
/// the primary key on MySQL). Deleted rows leave no trace ([`PublishedRows::Delete`], the default:
/// read the relay's `outbox_relay_published_total` instead). `conn` is any
/// [`OperatorConnection`]. Its cost is bounded by `window` on PostgreSQL and SQLite,
/// whatever the tables hold; MySQL has no index of `outbox_events` on `published_at`, and
/// reads `outbox_events` until it has counted `window` rows.
///
/// # Errors
/// The database's error.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub async fn published_last_minute<C: OperatorConnection>(
    conn: &mut C,
    window: i64,
) -> diesel::QueryResult<i64> {
    conn.published_last_minute(window).await
}

/// Deletes every row published more than `older_than` ago, in batches of `batch` rows (at
/// least 1), each its own short statement (so no lock is held longer than one batch, and the
/// relay and the unit of work go on meanwhile), and returns how many; `progress` hears the
/// running total after each batch. For [`PublishedRows::Mark`], which keeps published rows:
/// run it periodically to bound the table (`outbox purge`, `outbox relay
/// --purge-older-than`). Queued rows and dead letters (skipped ones included: they can still
/// be retried) are never deleted.
///
/// On PostgreSQL and SQLite the rows are found through a partial index of published rows on
/// `published_at`, oldest first: a purge reads only the rows it deletes, however many rows
/// are kept. On MySQL, which has no partial indexes, through the claim's index on
/// `available_at` (a row is published after it became available): beside the rows it
/// deletes, a purge reads the queued rows and dead letters that became available before the
/// cutoff. `conn` is any [`OperatorConnection`]. An `older_than` over a thousand years
/// (`Duration::MAX`, say) deletes nothing: no row is older.
///
/// # Errors
/// The database's error; the batches before it stay deleted.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub async fn purge_published<C: OperatorConnection>(
    conn: &mut C,
    older_than: Duration,
    batch: i64,
    mut progress: impl FnMut(usize) + Send,
) -> diesel::QueryResult<usize> {
    conn.purge_published(older_than, batch.max(1), &mut progress)
        .await
}

/// Deletes the dedup keys (`#[event(dedup_key)]`) taken longer ago than `older_than`, oldest
/// first, `batch` keys per statement (at least 1), and returns how many. `conn` is any
/// [`OperatorConnection`].
///
/// A key must be kept as long as a duplicate of its event may still be emitted: a client's
/// longest retry, a command's redelivery, a batch job's re-run. An event whose key was
/// purged is written again. Keys are never purged by anything else. An `older_than` over a
/// thousand years (`Duration::MAX`, say) deletes nothing.
///
/// # Errors
/// The database's error; the batches before it stay deleted.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub async fn purge_dedup_keys<C: OperatorConnection>(
    conn: &mut C,
    older_than: Duration,
    batch: i64,
) -> diesel::QueryResult<usize> {
    conn.purge_dedup_keys(older_than, batch.max(1)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(names: &[&str]) -> Vec<String> {
        names.iter().map(|name| name.to_string()).collect()
    }

    #[test]
    fn missing_migrations_name_the_outbox_elsewhere_and_how_to_point_a_url_at_it() {
        let missing = |elsewhere| MissingMigrations {
            pending: names(&["20261121000001", "20261122000002"]),
            elsewhere,
        };
        assert_eq!(
            missing(None).to_string(),
            "the outbox tables are not migrated: migrations 20261121000001, 20261122000002 are \
             not applied; run the outbox migrations first \
             (outbox_runtime::run_migrations(database_url), or outbox_runtime::MIGRATIONS with \
             your own diesel migration harness)"
        );
        let schemas = |schemas: &[&str]| {
            Some(TablesElsewhere::Schemas {
                schemas: names(schemas),
                search_path: "\"$user\", public".to_owned(),
            })
        };
        assert_eq!(
            missing(schemas(&["orders"])).to_string(),
            "the outbox tables are not migrated: migrations 20261121000001, 20261122000002 are \
             not applied; schema orders holds outbox tables outside the search_path (\"$user\", \
             public): to use that outbox, name it in the URL (`?options=-csearch_path%3Dorders`) \
             or the role's search_path, as the URL its migrations ran on did; to make a new one \
             here, run the outbox migrations first \
             (outbox_runtime::run_migrations(database_url), or outbox_runtime::MIGRATIONS with \
             your own diesel migration harness)"
        );
        // A name that needs quoting is not put into a URL as it is.
        for quoted in ["Orders", "order lines", "2026", "a%3Db"] {
            let text = missing(schemas(&[quoted])).to_string();
            assert!(
                text.contains(&format!("schema {quoted} holds outbox tables"))
                    && text.contains("(`?options=-csearch_path%3D<schema>`)"),
                "{text}"
            );
        }
        assert_eq!(
            TablesElsewhere::Databases {
                databases: names(&["a", "b", "c", "d", "e", "f", "g"]),
                database: "orders".to_owned(),
            }
            .to_string(),
            "databases a, b, c, d, e and 2 more hold outbox tables, not the URL's database \
             orders: to use one of them, name it as the URL's database \
             (`mysql://host/<database>`), as the URL its migrations ran on did"
        );
        assert_eq!(
            TablesElsewhere::Databases {
                databases: names(&["billing"]),
                database: "orders".to_owned(),
            }
            .to_string(),
            "database billing holds outbox tables, not the URL's database orders: to use that \
             outbox, name it as the URL's database (`mysql://host/billing`), as the URL its \
             migrations ran on did"
        );
    }
}
