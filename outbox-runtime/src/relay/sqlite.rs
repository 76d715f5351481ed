//! The message relay on SQLite (feature `sqlite`): the PostgreSQL relay's workers, batches
//! and publishing, over this module's statements, under a lease that lets one relay at a
//! time publish a database file's rows.

use std::future::Future;
use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text};
use diesel::sqlite::Sqlite;
use diesel::{Connection as _, QueryResult, QueryableByName, RunQueryDsl};
use diesel_async::SimpleAsyncConnection;
use uuid::Uuid;

use super::polling::{Head, Next, PolledStore, Polling, Rejected, Row, StatsRow, chained, groups};
use super::worker::RelayStore;
use super::{BatchReport, RelayConfig, RelayError, RelayHandle, Shared};
use crate::MissingMigrations;
use crate::database;
use crate::outbox::OutboxStats;
use crate::outbox::queries::{ClaimedEvent, PublishedRows, Rejection, RetryPolicy, claim_window};
use crate::sqlite::{AsyncSqliteConnection, NOW, SqliteConnection};

/// The message relay on SQLite: publishes the rows of the outbox tables of
/// [`crate::sqlite::MIGRATIONS`] to JetStream, exactly as [`Relay`](crate::Relay) publishes
/// PostgreSQL's (same subjects, headers, `Nats-Msg-Id`, retries and dead letters).
///
/// Takes the same [`RelayConfig`], whose `database_url` is the database file's path (or
/// `sqlite://path`). SQLite has one writer at a time, so the relay runs one worker whatever
/// `workers` says, and one relay publishes a file's rows at a time: it holds a lease in
/// `outbox_relay_lease`, lasting [`SqliteRelay::lease`], renewed when half of it has run and
/// checked at every claim, and given back when the relay stops.
/// Another relay on the same file waits as a standby, polling, and takes over once the lease
/// has expired (after a crash: the rows the crashed relay had published but not yet deleted
/// are published again, and JetStream drops the copies inside the stream's duplicate
/// window).
///
/// The relay takes SQLite's write lock only for a moment: to renew the lease (a claim under a
/// fresh lease only reads), to record a rejection, and to delete or mark what was published;
/// never while it publishes.
/// Its `listen` is ignored: a worker that finds nothing waits for a unit of work of this
/// process to commit, or for `poll_interval`. Its outbox gauges are PostgreSQL's, every
/// `stats_interval` ([`stats`](crate::sqlite::stats)). Not supported here: a `connector`.
pub struct SqliteRelay(Polling<SqliteStore>);

impl SqliteRelay {
    /// How long a relay's lease on a database file lasts after its last claim, for
    /// `config`: at least 10 s, and twice what a batch may take between two claims (its
    /// publishes, up to `ack_timeout`, and its delete, which may wait up to
    /// [`BUSY_TIMEOUT`](crate::sqlite::BUSY_TIMEOUT) for the write lock): 20 s with the
    /// defaults. A standby takes over this long after the holder's last claim when the
    /// holder crashed; a relay that stops gracefully gives its lease back at once.
    ///
    /// A lease that runs out while its holder still publishes (a stalled process) lets the
    /// standby publish the same rows: both publish each aggregate in sequence order, and
    /// JetStream stores each `Nats-Msg-Id` once inside the stream's duplicate window.
    pub fn lease(config: &RelayConfig) -> Duration {
        Duration::from_secs(10).max(2 * (config.ack_timeout + crate::sqlite::BUSY_TIMEOUT))
    }

    /// Checks the configuration, makes sure the stream exists (as [`Relay::connect`]), and
    /// that the database file opens and is migrated. A file that does not exist is refused,
    /// not made: the relay serves the database the service's migrations made.
    ///
    /// # Errors
    /// [`RelayError::Config`] (also for a `connector`),
    /// [`RelayError::Stream`], [`RelayError::Connect`] (also for a file that does not
    /// exist, naming its path), [`RelayError::MissingMigrations`].
    ///
    /// [`Relay::connect`]: crate::Relay::connect
    pub async fn connect(
        config: RelayConfig,
        nats: async_nats::Client,
    ) -> Result<Self, RelayError> {
        Polling::connect(config, nats).await.map(Self)
    }

    /// The duplicate window of the stream, as read by [`connect`](Self::connect).
    pub fn duplicate_window(&self) -> Duration {
        self.0.duplicate_window()
    }

    /// Runs the relay in a tokio task until [`RelayHandle::shutdown`].
    pub fn spawn(self) -> RelayHandle {
        self.0.spawn()
    }

    /// Publishes until `shutdown` completes, then stops gracefully, as
    /// [`Relay::run`](crate::Relay::run).
    ///
    /// # Errors
    /// [`RelayError::Task`] when a worker panicked (a bug).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), RelayError> {
        self.0.run(shutdown).await
    }

    /// Claims, publishes and records one batch on the relay's own connection, as
    /// [`Relay::relay_batch`](crate::Relay::relay_batch); claims nothing while another relay
    /// holds the lease.
    ///
    /// # Errors
    /// [`RelayError::Connect`], [`RelayError::Database`] or [`RelayError::TimedOut`].
    pub async fn relay_batch(&mut self) -> Result<BatchReport, RelayError> {
        self.0.relay_batch().await
    }

    /// Gives the lease back at once, after [`relay_batch`](Self::relay_batch): the next
    /// relay of the file claims without waiting for the lease to expire. A dropped relay
    /// keeps its lease until then ([`SqliteRelay::lease`]); one that was
    /// [run](Self::run) or [spawned](Self::spawn) gives it back when it stops.
    pub async fn close(self) {
        self.0.close().await;
    }
}

/// A relay's connection to the database file, and its name in the lease.
pub(crate) struct SqliteStore {
    conn: AsyncSqliteConnection,
    /// The relay's name in the lease, the same for each connection it opens (one that
    /// replaces a failed connection keeps the lease); new for each relay, so a restarted
    /// relay waits for its predecessor's lease like any other.
    owner: String,
    /// SQLite's time modifier for the lease's length (`+N.NNN seconds`).
    lease: String,
    /// The lease's length, [`SqliteRelay::lease`].
    lease_length: Duration,
    /// When this connection last took or renewed the lease (read before the statement), if
    /// it holds it; a new connection checks the lease at its first claim.
    renewed: Option<Instant>,
}

impl SqliteStore {
    /// Runs `task` in one `BEGIN IMMEDIATE` transaction on the blocking pool: committed when
    /// it returns `Ok`, rolled back otherwise.
    async fn immediate<R: Send + 'static>(
        &mut self,
        task: impl FnOnce(&mut SqliteConnection) -> QueryResult<R> + Send + 'static,
    ) -> QueryResult<R> {
        self.conn
            .spawn_blocking(move |conn| crate::sqlite::immediate_transaction(conn, task))
            .await
    }
}

impl PolledStore for SqliteStore {
    const NAME: &'static str = "SqliteRelay";

    fn configure(mut config: RelayConfig) -> RelayConfig {
        config.workers = 1;
        config
    }

    async fn missing_migrations(&mut self) -> QueryResult<Option<MissingMigrations>> {
        self.conn
            .spawn_blocking(crate::sqlite::missing_migrations)
            .await
    }

    async fn check_writes(&mut self) -> QueryResult<()> {
        self.conn.batch_execute(super::polling::WRITE_CHECK).await
    }
}

/// The claim's columns, as [`Row`] reads them (`occurred_at` to the millisecond).
pub(crate) const COLUMNS: &str = "id, aggregate_type, aggregate_id, aggregate_seq, event_type, \
    event_version, partition_key, subject, payload, headers, \
    CAST(ROUND((julianday(occurred_at) - 2440587.5) * 86400000.0) AS INTEGER) * 1000 \
        AS occurred_us, \
    correlation_id, causation_id";

/// A queued row: not published, not skipped (the terms of the `outbox_events_queued` index).
const QUEUED: &str = "published_at IS NULL AND skipped_at IS NULL";

/// The end of time, in the tables' shape: rows behind a dead letter wait for an operator.
const FOREVER: &str = "9999-12-31 23:59:59.999";

impl RelayStore for SqliteStore {
    const KIND: database::Kind = database::Kind::Sqlite;

    async fn connect(shared: &Shared) -> Result<Self, database::ConnectError> {
        let conn = database::connect_sqlite(&shared.config.database_url, shared.limits()).await?;
        let lease_length = SqliteRelay::lease(&shared.config);
        Ok(Self {
            conn: AsyncSqliteConnection::new(conn),
            owner: shared.instance.to_string(),
            lease: format!("+{:.3} seconds", lease_length.as_secs_f64()),
            lease_length,
            renewed: None,
        })
    }

    // A batch is not one transaction here: its claim, rejections and deletes each take the
    // write lock for a moment, and the lease keeps other relays off meanwhile.
    async fn begin(&mut self) -> QueryResult<()> {
        Ok(())
    }

    async fn commit(&mut self) -> QueryResult<()> {
        Ok(())
    }

    async fn rollback(&mut self) -> QueryResult<()> {
        Ok(())
    }

    async fn close(&mut self) {
        self.renewed = None;
        let owner = self.owner.clone();
        let released = self
            .immediate(move |conn| {
                diesel::sql_query("DELETE FROM outbox_relay_lease WHERE owner = ?")
                    .bind::<Text, _>(&owner)
                    .execute(conn)
            })
            .await;
        if let Err(error) = released {
            tracing::warn!(
                %error,
                "cannot give back the relay's lease; another relay takes over when it expires"
            );
        }
    }

    /// The claim: the lease, taken or renewed when half of it has run (nothing is claimed
    /// while another relay holds it), then [`claimable`]. A renewal is a write, so it runs
    /// in a `BEGIN IMMEDIATE` transaction with the reads; a claim under a fresh lease is a
    /// read-only transaction, which neither waits for nor holds up writers (write-ahead log).
    ///
    /// Guarantee: a row is claimed only when no row of its aggregate with a lower sequence is
    /// queued, and only by the lease's holder.
    async fn claim(
        &mut self,
        batch: i64,
        _held: &crate::outbox::queries::Held<'_>,
    ) -> QueryResult<Vec<ClaimedEvent>> {
        if self
            .renewed
            .is_some_and(|at| at.elapsed() < self.lease_length / 2)
        {
            let owner = self.owner.clone();
            let claimed = self
                .conn
                .spawn_blocking(move |conn| {
                    conn.transaction(|conn| {
                        // Still ours (a relay that stalled past its lease finds it taken).
                        #[derive(QueryableByName)]
                        struct Held {
                            #[diesel(sql_type = Bool)]
                            held: bool,
                        }
                        let Held { held } = diesel::sql_query(format!(
                            "SELECT EXISTS (SELECT 1 FROM outbox_relay_lease \
                                 WHERE name = 'relay' AND owner = ? AND expires_at > {NOW}) \
                             AS held"
                        ))
                        .bind::<Text, _>(&owner)
                        .get_result(conn)?;
                        if !held {
                            return Ok(None);
                        }
                        claimable(conn, batch).map(Some)
                    })
                })
                .await?;
            if let Some(claimed) = claimed {
                return Ok(claimed);
            }
            self.renewed = None;
        }
        let (owner, lease) = (self.owner.clone(), self.lease.clone());
        let renewing = Instant::now();
        let claimed = self
            .immediate(move |conn| {
                let leased = diesel::sql_query(format!(
                    "INSERT INTO outbox_relay_lease (name, owner, expires_at) \
                     VALUES ('relay', ?, strftime('%Y-%m-%d %H:%M:%f', 'now', ?)) \
                     ON CONFLICT (name) DO UPDATE SET \
                         owner = excluded.owner, expires_at = excluded.expires_at \
                     WHERE outbox_relay_lease.owner = excluded.owner \
                        OR outbox_relay_lease.expires_at < {NOW}"
                ))
                .bind::<Text, _>(&owner)
                .bind::<Text, _>(&lease)
                .execute(conn)?;
                if leased == 0 {
                    return Ok(None);
                }
                claimable(conn, batch).map(Some)
            })
            .await?;
        self.renewed = claimed.is_some().then_some(renewing);
        Ok(claimed.unwrap_or_default())
    }

    /// Records a rejection, as `queries::record_rejection` on PostgreSQL: one more attempt,
    /// the error, then a retry after `base * 2^(attempts - 1)` ms (capped, with equal
    /// jitter) or, at `max_attempts`, a dead letter; the aggregate's later rows, and those
    /// units of work add meanwhile (`outbox_aggregates.blocked_until`), wait behind it.
    async fn reject(
        &mut self,
        id: Uuid,
        error: &str,
        policy: RetryPolicy,
    ) -> QueryResult<Rejection> {
        let (id, error) = (id.to_string(), error.to_owned());
        self.immediate(move |conn| {
            #[derive(QueryableByName)]
            struct Attempts {
                #[diesel(sql_type = Integer)]
                attempts: i32,
            }
            let Attempts { attempts } =
                diesel::sql_query("SELECT attempts FROM outbox_events WHERE id = ?")
                    .bind::<Text, _>(&id)
                    .get_result(conn)?;
            let Next {
                attempts,
                dead,
                skipped,
                delay_us,
            } = Next::after(attempts, policy);
            // The delay with equal jitter, in seconds: delay * (0.5 + [0, 0.5)).
            diesel::sql_query(format!(
                "UPDATE outbox_events SET attempts = ?, last_error = ?, \
                     dead_lettered_at = CASE WHEN ? THEN {NOW} END, \
                     skipped_at = CASE WHEN ? THEN {NOW} END, \
                     available_at = CASE WHEN ? THEN available_at ELSE strftime( \
                         '%Y-%m-%d %H:%M:%f', 'now', \
                         '+' || (? * (0.5 + (abs(random()) % 1000000) / 2000000.0) / 1e6) \
                             || ' seconds') END \
                 WHERE id = ?"
            ))
            .bind::<Integer, _>(attempts)
            .bind::<Text, _>(&error)
            .bind::<Bool, _>(dead)
            .bind::<Bool, _>(skipped)
            .bind::<Bool, _>(dead)
            .bind::<BigInt, _>(delay_us)
            .bind::<Text, _>(&id)
            .execute(conn)?;
            let rejected: Rejected = diesel::sql_query(
                "SELECT aggregate_type, aggregate_id, aggregate_seq, attempts, \
                        dead_lettered_at IS NOT NULL AS dead_lettered, \
                        CASE WHEN skipped_at IS NOT NULL THEN NULL \
                             WHEN dead_lettered_at IS NOT NULL THEN ? \
                             ELSE available_at END AS blocked_until \
                 FROM outbox_events WHERE id = ?",
            )
            .bind::<Text, _>(FOREVER)
            .bind::<Text, _>(&id)
            .get_result(conn)?;
            if let Some(until) = &rejected.blocked_until {
                diesel::sql_query(format!(
                    "UPDATE outbox_events SET available_at = ? \
                     WHERE aggregate_type = ? AND aggregate_id = ? AND aggregate_seq > ? \
                       AND {QUEUED} AND available_at < ?"
                ))
                .bind::<Text, _>(until)
                .bind::<Text, _>(&rejected.aggregate_type)
                .bind::<Text, _>(&rejected.aggregate_id)
                .bind::<BigInt, _>(rejected.aggregate_seq)
                .bind::<Text, _>(until)
                .execute(conn)?;
            }
            diesel::sql_query(
                "UPDATE outbox_aggregates SET blocked_until = ? \
                 WHERE aggregate_type = ? AND aggregate_id = ?",
            )
            .bind::<Nullable<Text>, _>(rejected.blocked_until.as_deref())
            .bind::<Text, _>(&rejected.aggregate_type)
            .bind::<Text, _>(&rejected.aggregate_id)
            .execute(conn)?;
            Ok(Rejection {
                dead_lettered: rejected.dead_lettered,
                attempts: rejected.attempts,
            })
        })
        .await
    }

    /// With [`PublishedRows::Archive`], each row is copied whole into `outbox_published`
    /// (stamped now, UTC) and then deleted, in one `BEGIN IMMEDIATE` transaction: a row
    /// another relay archived meanwhile (after this one's lease ran out) is gone, and is
    /// neither copied nor deleted twice.
    async fn finish(&mut self, ids: &[Uuid], mode: PublishedRows) -> QueryResult<()> {
        const DELETE: &str = "DELETE FROM outbox_events WHERE id IN";
        let statements = match mode {
            PublishedRows::Delete => vec![DELETE.to_owned()],
            PublishedRows::Mark => vec![format!(
                "UPDATE outbox_events SET published_at = {NOW} WHERE id IN"
            )],
            PublishedRows::Archive => vec![archive_statement(), DELETE.to_owned()],
        };
        let ids: Vec<String> = ids.iter().map(Uuid::to_string).collect();
        self.immediate(move |conn| {
            // Within SQLite's limit of bound values per statement.
            for chunk in ids.chunks(10_000) {
                for sql in &statements {
                    let mut statement =
                        diesel::sql_query(format!("{sql} ({})", groups(chunk.len(), "?", ", ")))
                            .into_boxed::<Sqlite>();
                    for id in chunk {
                        statement = statement.bind::<Text, _>(id.as_str());
                    }
                    statement.execute(conn)?;
                }
            }
            Ok(())
        })
        .await
    }

    async fn stats(&mut self) -> QueryResult<OutboxStats> {
        self.conn.spawn_blocking(stats).await
    }
}

/// Copies the rows `id IN (...)` into the archive, whole, stamped with the time of their
/// publication ([`PublishedRows::Archive`]; migration `2026-11-26-000004_archive`).
fn archive_statement() -> String {
    format!(
        "INSERT INTO outbox_published (id, aggregate_type, aggregate_id, aggregate_seq, \
             event_type, event_version, partition_key, subject, payload, headers, occurred_at, \
             correlation_id, causation_id, attempts, published_at) \
         SELECT id, aggregate_type, aggregate_id, aggregate_seq, event_type, event_version, \
             partition_key, subject, payload, headers, occurred_at, correlation_id, \
             causation_id, attempts, {NOW} \
         FROM outbox_events WHERE id IN"
    )
}

/// The claimable rows, within `batch`, inside the claim's transaction: the heads, found as on
/// MySQL (a window of the oldest claimable rows, reduced to their aggregates, and each
/// aggregate's lowest queued sequence) and kept when claimable; then the rows queued behind
/// them, in sequence order.
fn claimable(conn: &mut SqliteConnection, batch: i64) -> QueryResult<Vec<ClaimedEvent>> {
    let heads: Vec<Head> = diesel::sql_query(format!(
        "SELECT c.aggregate_type, c.aggregate_id, ( \
                 SELECT MIN(q.aggregate_seq) FROM outbox_events q \
                 WHERE q.aggregate_type = c.aggregate_type \
                   AND q.aggregate_id = c.aggregate_id \
                   AND q.published_at IS NULL AND q.skipped_at IS NULL) AS head \
             FROM (SELECT DISTINCT w.aggregate_type, w.aggregate_id FROM ( \
                     SELECT aggregate_type, aggregate_id FROM outbox_events \
                     WHERE published_at IS NULL AND skipped_at IS NULL \
                       AND dead_lettered_at IS NULL AND available_at <= {NOW} \
                     ORDER BY available_at, id LIMIT ?) w) c"
    ))
    .bind::<BigInt, _>(claim_window(batch))
    .load(conn)?;
    let heads: Vec<(Head, i64)> = heads
        .into_iter()
        .filter_map(|head| head.head.map(|seq| (head, seq)))
        .collect();
    if heads.is_empty() {
        return Ok(Vec::new());
    }
    let mut claimable = diesel::sql_query(format!(
        "SELECT {COLUMNS}, 1 AS available FROM outbox_events \
             WHERE ({}) AND {QUEUED} AND dead_lettered_at IS NULL AND available_at <= {NOW}",
        groups(
            heads.len(),
            "(aggregate_type = ? AND aggregate_id = ? AND aggregate_seq = ?)",
            " OR "
        )
    ))
    .into_boxed::<Sqlite>();
    for (head, seq) in &heads {
        claimable = claimable
            .bind::<Text, _>(head.aggregate_type.as_str())
            .bind::<Text, _>(head.aggregate_id.as_str())
            .bind::<BigInt, _>(*seq);
    }
    let locked: Vec<Row> = claimable.load(conn)?;
    let room = batch - i64::try_from(locked.len()).unwrap_or(i64::MAX);
    let followers: Vec<Row> = if locked.is_empty() || room <= 0 {
        Vec::new()
    } else {
        let mut behind = diesel::sql_query(format!(
            "SELECT {COLUMNS}, \
                        (dead_lettered_at IS NULL AND available_at <= {NOW}) AS available \
                 FROM outbox_events WHERE {QUEUED} AND ({}) \
                 ORDER BY aggregate_type, aggregate_id, aggregate_seq LIMIT ?",
            groups(
                locked.len(),
                "(aggregate_type = ? AND aggregate_id = ? AND aggregate_seq > ?)",
                " OR "
            )
        ))
        .into_boxed::<Sqlite>();
        for head in &locked {
            behind = behind
                .bind::<Text, _>(head.aggregate_type.as_str())
                .bind::<Text, _>(head.aggregate_id.as_str())
                .bind::<BigInt, _>(head.aggregate_seq);
        }
        behind.bind::<BigInt, _>(room).load(conn)?
    };
    chained(locked, followers)
}

/// Counts what waits in a SQLite outbox: what [`crate::outbox::stats`] counts on PostgreSQL,
/// in one read (it takes no write lock). Every relay runs it into its gauges every
/// [`RelayConfig::stats_interval`].
///
/// # Errors
/// The database's error.
pub fn stats(conn: &mut SqliteConnection) -> QueryResult<OutboxStats> {
    let row: StatsRow = diesel::sql_query(format!(
        "SELECT COALESCE(SUM(dead_lettered_at IS NULL), 0) AS queued, \
                COALESCE(SUM(dead_lettered_at IS NOT NULL), 0) AS dead_letters, \
                COALESCE(SUM(dead_lettered_at IS NULL AND available_at = '{FOREVER}'), 0) \
                    AS blocked, \
                (SELECT count(*) FROM outbox_events \
                 WHERE dead_lettered_at IS NOT NULL AND skipped_at IS NOT NULL \
                   AND published_at IS NULL) AS skipped_dead_letters, \
                CAST(ROUND((julianday(MIN(CASE WHEN dead_lettered_at IS NULL \
                    THEN occurred_at END)) - 2440587.5) * 86400000.0) AS INTEGER) * 1000 \
                    AS oldest_us \
         FROM outbox_events WHERE {QUEUED}"
    ))
    .get_result(conn)?;
    row.into_stats()
}
