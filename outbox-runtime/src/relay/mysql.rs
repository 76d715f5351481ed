//! The message relay on MySQL 8 and MariaDB 10.6+ (feature `mysql`): the PostgreSQL relay's
//! workers, batches and publishing, over this module's statements.

use std::future::Future;
use std::time::Duration;

use diesel::mysql::Mysql;
use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{
    AnsiTransactionManager, AsyncMysqlConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use uuid::Uuid;

use super::polling::{Head, Next, PolledStore, Polling, Rejected, Row, StatsRow, chained, groups};
use super::worker::{RelayStore, finish_then_commit};
use super::{BatchReport, RelayConfig, RelayError, RelayHandle, Shared};
use crate::MissingMigrations;
use crate::database;
use crate::outbox::OutboxStats;
use crate::outbox::queries::{ClaimedEvent, Held, PublishedRows, Rejection, RetryPolicy};

/// The message relay on MySQL / MariaDB: publishes the rows of the outbox tables of
/// [`crate::mysql::MIGRATIONS`] to JetStream, exactly as [`Relay`](crate::Relay) publishes
/// PostgreSQL's (same subjects, headers, `Nats-Msg-Id`, retries and dead letters).
///
/// Takes the same [`RelayConfig`], with a `mysql://` URL. Its `listen` is ignored (MySQL has
/// no notifications): a worker that finds nothing waits for a unit of work of this process
/// to commit, or for `poll_interval`. Its outbox gauges are PostgreSQL's, every
/// `stats_interval` ([`stats`](crate::mysql::stats)). Not supported here: a `connector`
/// (connections are opened from the URL).
pub struct MysqlRelay(Polling<AsyncMysqlConnection>);

impl MysqlRelay {
    /// Checks the configuration, makes sure the stream exists (as [`Relay::connect`]), and
    /// that the database is reachable and migrated.
    ///
    /// # Errors
    /// [`RelayError::Config`] (also for a `connector`),
    /// [`RelayError::Stream`], [`RelayError::Connect`], [`RelayError::MissingMigrations`].
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

    /// Claims, publishes and records one batch, in one transaction, on the relay's own
    /// connection (reopened when it was lost), as [`Relay::relay_batch`](crate::Relay::relay_batch).
    ///
    /// # Errors
    /// [`RelayError::Connect`], [`RelayError::Database`] or [`RelayError::TimedOut`].
    pub async fn relay_batch(&mut self) -> Result<BatchReport, RelayError> {
        self.0.relay_batch().await
    }
}

impl PolledStore for AsyncMysqlConnection {
    const NAME: &'static str = "MysqlRelay";

    async fn missing_migrations(&mut self) -> QueryResult<Option<MissingMigrations>> {
        crate::mysql::missing_migrations(self).await
    }

    async fn check_writes(&mut self) -> QueryResult<()> {
        self.batch_execute(super::polling::WRITE_CHECK).await
    }

    async fn lacking_privileges(&mut self, mode: PublishedRows) -> QueryResult<Option<String>> {
        use crate::privileges::{self, Component};
        privileges::lacking_on_mysql(
            self,
            Component::MessageRelay,
            &privileges::mysql_needs(Component::MessageRelay, Some(mode)),
        )
        .await
    }
}

/// The claim's columns, as [`Row`] reads them; `{available}` is the expression of its
/// `available` column.
pub(crate) const COLUMNS: &str = "id, aggregate_type, aggregate_id, aggregate_seq, event_type, \
    event_version, partition_key, subject, payload, headers, \
    TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', occurred_at) AS occurred_us, \
    correlation_id, causation_id";

/// The rows the claim's window reads to find heads, at most. Chosen with
/// `examples/backend_bench` (21,100 events over 1,000 aggregates, batch 2,000, MariaDB
/// 10.11, a noisy two-core host): 64 rows 26.3-28.6k events/s (3 runs), 128 rows 17.6-34.0k
/// (5 runs, median 29.2k), 256 rows 14.6-25.6k (4 runs), PostgreSQL's 25% of the batch
/// (500) 17.1-18.6k. Each head found costs an index probe and a lock, and the rows behind
/// the heads fill the batch.
const MYSQL_CLAIM_WINDOW: i64 = 128;

/// A queued row: not published, not skipped.
const QUEUED: &str = "published_at IS NULL AND skipped_at IS NULL";

/// A claimable row: queued, not a dead letter, not parked.
const CLAIMABLE: &str = "published_at IS NULL AND skipped_at IS NULL \
    AND dead_lettered_at IS NULL AND available_at <= UTC_TIMESTAMP(6)";

/// Deletes the rows `id IN (...)` ([`PublishedRows::Delete`], and the second statement of
/// [`PublishedRows::Archive`]).
const DELETE: &str = "DELETE FROM outbox_events WHERE id IN";

/// Marks the rows `id IN (...)` published ([`PublishedRows::Mark`]).
const MARK: &str = "UPDATE outbox_events SET published_at = UTC_TIMESTAMP(6) WHERE id IN";

/// The most published rows a batch records in its COMMIT's round trip
/// ([`finish_and_commit_sql`]); a larger batch binds their ids and commits apart. The
/// PostgreSQL relay's bound (`queries::MAX_EVENTS_AT_COMMIT`), where thousands of ids as text
/// cost the server more than the round trip saved; not measured apart on MySQL.
const MAX_IDS_AT_COMMIT: usize = 64;

/// The statements that record the published rows `ids` as `mode` says, and the COMMIT, as
/// one multi-statement string for [`RelayStore::finish_and_commit`]; `None` for no rows or
/// more than [`MAX_IDS_AT_COMMIT`]. Each id is a quoted literal of its hyphenated
/// lower-case form, the form the relay binds ([`RelayStore::finish`]): hex digits and
/// hyphens, nothing to escape.
fn finish_and_commit_sql(ids: &[Uuid], mode: PublishedRows) -> Option<String> {
    if ids.is_empty() || ids.len() > MAX_IDS_AT_COMMIT {
        return None;
    }
    let mut list = String::with_capacity(ids.len() * (uuid::fmt::Hyphenated::LENGTH + 4));
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            list.push_str(", ");
        }
        list.push('\'');
        list.push_str(id.hyphenated().encode_lower(&mut Uuid::encode_buffer()));
        list.push('\'');
    }
    Some(match mode {
        PublishedRows::Delete => format!("{DELETE} ({list}); COMMIT"),
        PublishedRows::Mark => format!("{MARK} ({list}); COMMIT"),
        PublishedRows::Archive => format!("{ARCHIVE} ({list}); {DELETE} ({list}); COMMIT"),
    })
}

/// Copies the rows `id IN (...)` into the archive, whole, stamped with the time of their
/// publication ([`PublishedRows::Archive`]; migration `2026-11-26-000003_archive`).
const ARCHIVE: &str = "INSERT INTO outbox_published (id, aggregate_type, aggregate_id, \
        aggregate_seq, event_type, event_version, partition_key, subject, payload, headers, \
        occurred_at, correlation_id, causation_id, attempts, published_at) \
    SELECT id, aggregate_type, aggregate_id, aggregate_seq, event_type, event_version, \
        partition_key, subject, payload, headers, occurred_at, correlation_id, causation_id, \
        attempts, UTC_TIMESTAMP(6) \
    FROM outbox_events WHERE id IN";

/// The claim's second statement for `aggregates` aggregates (binds: each one's type and id):
/// each aggregate's lowest queued sequence, as [`Head`]s; an aggregate with no queued row
/// left has no row.
///
/// One branch per aggregate, its key as constants, so that the optimizer plans each branch
/// from the index itself (a dive into the unique key's range of that aggregate). As one
/// dependent subquery per window aggregate (`WHERE q.aggregate_type = c.aggregate_type ...
/// ORDER BY q.aggregate_seq LIMIT 1`), MariaDB 10.11 planned the lookup from the table's
/// statistics, and while they were stale (a table filled since they were taken, as a new
/// outbox's is) it read the whole unique index from its start instead of the aggregate's
/// range, for each aggregate of the window: in the server's slow log, one claim of 0.85 s
/// that examined 639,754 rows (`type: index`, 4,993 rows read per aggregate), and figure 2 of
/// `examples/backend_bench` 6.2-6.5k events/s on a new database against 21.5-22.7k once its
/// statistics had caught up.
fn heads_statement(aggregates: usize) -> String {
    groups(
        aggregates,
        "(SELECT aggregate_type, aggregate_id, aggregate_seq AS head FROM outbox_events \
          WHERE aggregate_type = ? AND aggregate_id = ? \
            AND published_at IS NULL AND skipped_at IS NULL \
          ORDER BY aggregate_seq LIMIT 1)",
        " UNION ALL ",
    )
}

/// An aggregate of the claim's window.
#[derive(QueryableByName)]
struct Aggregate {
    #[diesel(sql_type = Text)]
    aggregate_type: String,
    #[diesel(sql_type = Text)]
    aggregate_id: String,
}

/// The end of time, for MySQL's DATETIME: rows behind a dead letter wait for an operator.
const FOREVER: &str = "9999-12-31 23:59:59.999999";

/// The server-side `wait_timeout` of a relay's MySQL session (MySQL docs, "Server System
/// Variables", `wait_timeout`; MariaDB's likewise): after this long without a statement the
/// server closes the session and rolls back its transaction.
///
/// A relay whose host vanished mid-batch (a node lost, a network cut: no FIN, no RST) holds
/// its claimed heads locked until the server closes its session. MySQL offers no per-session
/// TCP keepalive (PostgreSQL's bound, see `database::connect`; MariaDB's
/// `tcp_keepalive_time` is global), and the default `wait_timeout` is 8 hours, during which
/// no other relay publishes those aggregates. A live relay's session goes without a
/// statement between polls (`poll_interval`), and while its batch publishes, when it sends
/// a keep-alive statement every third of this bound (`RelayStore::keep_alive_every`): the
/// bound is twice `poll_interval` plus 20 s, rounded up to whole seconds (21 s with the
/// defaults).
pub(crate) fn session_wait_timeout(config: &RelayConfig) -> Duration {
    let idle = config.poll_interval * 2 + Duration::from_secs(20);
    Duration::from_secs(idle.as_secs() + u64::from(idle.subsec_nanos() > 0))
}

/// The statement that sets a relay session's lock waits, row locks'
/// (`innodb_lock_wait_timeout`) and metadata locks' (`lock_wait_timeout`: a DDL's, a `LOCK
/// TABLES`), to its `statement_timeout`, rounded up to whole seconds, at least 1 (MySQL docs,
/// "InnoDB Startup Options and System Variables" and "Server System Variables"; MariaDB's
/// likewise, where 0 would mean no wait at all), whatever the server's or an operator's:
/// theirs, meant for the applications' sessions, refused the relay's statements behind a lock
/// held a little longer (1 s against a 2-s `LOCK TABLES`, or a writer's transaction on a
/// rejected row's aggregate), and the relay reconnected with backoff. The relay gives up on a
/// statement at its `statement_timeout` all the same, dropping its connection; the server
/// then gives up waiting about as soon, and rolls the batch back.
pub(crate) fn lock_waits(statement_timeout: Duration) -> String {
    let seconds = statement_timeout.as_secs() + u64::from(statement_timeout.subsec_nanos() > 0);
    let seconds = seconds.max(1);
    format!("SET SESSION innodb_lock_wait_timeout = {seconds}, lock_wait_timeout = {seconds}")
}

impl RelayStore for AsyncMysqlConnection {
    const KIND: database::Kind = database::Kind::Mysql;

    /// Opens a session ([`session_wait_timeout`]) whose lock waits last as long as its
    /// statements may ([`lock_waits`]), and reads MariaDB's idle transaction timeouts
    /// ([`IDLE_TRANSACTION_TIMEOUTS`](crate::mysql::IDLE_TRANSACTION_TIMEOUTS)), the shortest
    /// of which [`keep_alive_every`](RelayStore::keep_alive_every) follows.
    async fn connect(shared: &Shared) -> Result<Self, database::ConnectError> {
        let mut conn = database::connect_mysql(
            &shared.config.database_url,
            shared.limits(),
            session_wait_timeout(&shared.config),
        )
        .await?;
        database::bounded_setup(
            shared.config.statement_timeout,
            &shared.target,
            "setting the session's lock wait timeouts",
            conn.batch_execute(&lock_waits(shared.config.statement_timeout)),
        )
        .await?;
        let idle = database::bounded_setup(
            shared.config.statement_timeout,
            &shared.target,
            "reading idle_transaction_timeout",
            crate::mysql::idle_transaction_timeouts(&mut conn),
        )
        .await?;
        let shortest = idle.iter().map(|&(_, seconds)| seconds).min().unwrap_or(0);
        shared.idle_in_transaction_ms.store(
            shortest.saturating_mul(1_000),
            std::sync::atomic::Ordering::Relaxed,
        );
        Ok(conn)
    }

    /// Five seconds short of [`session_wait_timeout`].
    fn idle_limit(shared: &Shared) -> Option<Duration> {
        Some(session_wait_timeout(&shared.config).saturating_sub(Duration::from_secs(5)))
    }

    /// A third of [`session_wait_timeout`], or of MariaDB's idle transaction timeout
    /// ([`IDLE_TRANSACTION_TIMEOUTS`](crate::mysql::IDLE_TRANSACTION_TIMEOUTS)) when one is
    /// set and shorter: a batch's transaction sends nothing while it waits for its acks, for
    /// as long as one aggregate's chain takes to publish, nor while it looks at the stream
    /// after a missing ack (up to two ack timeouts); a live relay's batch is never cut.
    fn keep_alive_every(shared: &Shared) -> Option<Duration> {
        let wait = session_wait_timeout(&shared.config);
        let idle = Duration::from_millis(std::sync::atomic::AtomicU64::load(
            &shared.idle_in_transaction_ms,
            std::sync::atomic::Ordering::Relaxed,
        ));
        Some(if idle.is_zero() { wait } else { wait.min(idle) } / 3)
    }

    async fn keep_alive(&mut self) -> QueryResult<()> {
        diesel::sql_query("DO 0").execute(self).await.map(drop)
    }

    async fn begin(&mut self) -> QueryResult<()> {
        AnsiTransactionManager::begin_transaction(self).await
    }

    async fn commit(&mut self) -> QueryResult<()> {
        AnsiTransactionManager::commit_transaction(self).await
    }

    async fn rollback(&mut self) -> QueryResult<()> {
        AnsiTransactionManager::rollback_transaction(self).await
    }

    /// The claim, in four statements inside the batch's transaction (READ COMMITTED):
    ///
    /// 1. the window: the oldest claimable rows (`outbox_events_claimable`;
    ///    [`MYSQL_CLAIM_WINDOW`] rows), reduced to their aggregates, leaving out those `held`
    ///    by this relay's other workers;
    /// 2. the heads: each window aggregate's lowest queued sequence, read in the unique
    ///    key's order up to the first queued row (a plain read: the latest committed rows),
    ///    one `UNION ALL` branch per aggregate with its key as constants (see
    ///    [`heads_statement`]). With [`PublishedRows::Mark`] that read steps over the
    ///    aggregate's published rows, which MySQL cannot leave out of an index as
    ///    PostgreSQL's partial indexes do: purge them;
    /// 3. the heads that are claimable, locked with `FOR UPDATE SKIP LOCKED`: a locking read
    ///    sees the newest committed version, so a head another relay published since step 2
    ///    is gone or no longer queued, and a head another relay holds is skipped;
    /// 4. the rows queued behind each locked head, in sequence order, within the batch.
    ///
    /// Guarantee, as on PostgreSQL: a row is claimed only when no row of its aggregate with a
    /// lower sequence is queued, and the locked head keeps every other relay from its
    /// aggregate until this transaction ends.
    async fn claim(&mut self, batch: i64, held: &Held<'_>) -> QueryResult<Vec<ClaimedEvent>> {
        let window = batch.clamp(1, MYSQL_CLAIM_WINDOW);
        let not_held = if held.types.is_empty() {
            String::new()
        } else {
            format!(
                " AND (aggregate_type, aggregate_id) NOT IN ({})",
                groups(held.types.len(), "(?, ?)", ", ")
            )
        };
        let mut aggregates = diesel::sql_query(format!(
            "SELECT DISTINCT w.aggregate_type, w.aggregate_id FROM ( \
                 SELECT aggregate_type, aggregate_id FROM outbox_events \
                 WHERE {CLAIMABLE}{not_held} ORDER BY available_at, id LIMIT ?) w"
        ))
        .into_boxed::<Mysql>();
        for (aggregate_type, aggregate_id) in held.types.iter().zip(&held.ids) {
            aggregates = aggregates
                .bind::<Text, _>(*aggregate_type)
                .bind::<Text, _>(*aggregate_id);
        }
        let aggregates: Vec<Aggregate> = aggregates.bind::<BigInt, _>(window).load(self).await?;
        if aggregates.is_empty() {
            return Ok(Vec::new());
        }
        let mut heads = diesel::sql_query(heads_statement(aggregates.len())).into_boxed::<Mysql>();
        for aggregate in &aggregates {
            heads = heads
                .bind::<Text, _>(aggregate.aggregate_type.as_str())
                .bind::<Text, _>(aggregate.aggregate_id.as_str());
        }
        let heads: Vec<(Head, i64)> = heads
            .load::<Head>(self)
            .await?
            .into_iter()
            .filter_map(|head| head.head.map(|seq| (head, seq)))
            .collect();
        if heads.is_empty() {
            return Ok(Vec::new());
        }

        let mut lock = diesel::sql_query(format!(
            "SELECT {COLUMNS}, TRUE AS available FROM outbox_events \
             WHERE ({}) AND {CLAIMABLE} FOR UPDATE SKIP LOCKED",
            groups(
                heads.len(),
                "(aggregate_type = ? AND aggregate_id = ? AND aggregate_seq = ?)",
                " OR "
            )
        ))
        .into_boxed::<Mysql>();
        for (head, seq) in &heads {
            lock = lock
                .bind::<Text, _>(head.aggregate_type.as_str())
                .bind::<Text, _>(head.aggregate_id.as_str())
                .bind::<BigInt, _>(*seq);
        }
        let locked: Vec<Row> = lock.load(self).await?;
        let room = batch - i64::try_from(locked.len()).unwrap_or(i64::MAX);
        let followers: Vec<Row> = if locked.is_empty() || room <= 0 {
            Vec::new()
        } else {
            let mut behind = diesel::sql_query(format!(
                "SELECT {COLUMNS}, \
                        (dead_lettered_at IS NULL AND available_at <= UTC_TIMESTAMP(6)) AS available \
                 FROM outbox_events WHERE {QUEUED} AND ({}) \
                 ORDER BY aggregate_type, aggregate_id, aggregate_seq LIMIT ?",
                groups(
                    locked.len(),
                    "(aggregate_type = ? AND aggregate_id = ? AND aggregate_seq > ?)",
                    " OR "
                )
            ))
            .into_boxed::<Mysql>();
            for head in &locked {
                behind = behind
                    .bind::<Text, _>(head.aggregate_type.as_str())
                    .bind::<Text, _>(head.aggregate_id.as_str())
                    .bind::<BigInt, _>(head.aggregate_seq);
            }
            behind.bind::<BigInt, _>(room).load(self).await?
        };

        chained(locked, followers)
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
        let id = id.to_string();
        #[derive(QueryableByName)]
        struct Attempts {
            #[diesel(sql_type = Integer)]
            attempts: i32,
        }
        let Attempts { attempts } =
            diesel::sql_query("SELECT attempts FROM outbox_events WHERE id = ? FOR UPDATE")
                .bind::<Text, _>(&id)
                .get_result(self)
                .await?;
        let Next {
            attempts,
            dead,
            skipped,
            delay_us,
        } = Next::after(attempts, policy);
        diesel::sql_query(
            "UPDATE outbox_events SET attempts = ?, last_error = ?, \
                 dead_lettered_at = IF(?, UTC_TIMESTAMP(6), NULL), \
                 skipped_at = IF(?, UTC_TIMESTAMP(6), NULL), \
                 available_at = IF(?, available_at, \
                     UTC_TIMESTAMP(6) + INTERVAL FLOOR(? * (0.5 + RAND() / 2)) MICROSECOND) \
             WHERE id = ?",
        )
        .bind::<Integer, _>(attempts)
        .bind::<Text, _>(error)
        .bind::<Bool, _>(dead)
        .bind::<Bool, _>(skipped)
        .bind::<Bool, _>(dead)
        .bind::<BigInt, _>(delay_us)
        .bind::<Text, _>(&id)
        .execute(self)
        .await?;
        let rejected: Rejected = diesel::sql_query(
            "SELECT aggregate_type, aggregate_id, aggregate_seq, attempts, \
                    dead_lettered_at IS NOT NULL AS dead_lettered, \
                    CASE WHEN skipped_at IS NOT NULL THEN NULL \
                         WHEN dead_lettered_at IS NOT NULL THEN ? \
                         ELSE CAST(available_at AS CHAR) END AS blocked_until \
             FROM outbox_events WHERE id = ?",
        )
        .bind::<Text, _>(FOREVER)
        .bind::<Text, _>(&id)
        .get_result(self)
        .await?;
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
            .execute(self)
            .await?;
        }
        diesel::sql_query(
            "UPDATE outbox_aggregates SET blocked_until = ? \
             WHERE aggregate_type = ? AND aggregate_id = ?",
        )
        .bind::<Nullable<Text>, _>(rejected.blocked_until.as_deref())
        .bind::<Text, _>(&rejected.aggregate_type)
        .bind::<Text, _>(&rejected.aggregate_id)
        .execute(self)
        .await?;
        Ok(Rejection {
            dead_lettered: rejected.dead_lettered,
            attempts: rejected.attempts,
        })
    }

    /// With [`PublishedRows::Archive`], each row is copied whole into `outbox_published`
    /// (stamped `UTC_TIMESTAMP(6)`) and then deleted, both in the batch's transaction: the
    /// rows are the batch's claimed ones, which no other relay takes while this batch holds
    /// their aggregates' heads, so what is copied is what was published.
    async fn finish(&mut self, ids: &[Uuid], mode: PublishedRows) -> QueryResult<()> {
        let statements: &[&str] = match mode {
            PublishedRows::Delete => &[DELETE],
            PublishedRows::Mark => &[MARK],
            PublishedRows::Archive => &[ARCHIVE, DELETE],
        };
        // Within MySQL's placeholders a statement, whatever the batch size.
        for chunk in ids.chunks(crate::mysql::MAX_BOUND_VALUES) {
            let ids: Vec<String> = chunk.iter().map(Uuid::to_string).collect();
            for sql in statements {
                let mut statement =
                    diesel::sql_query(format!("{sql} ({})", groups(ids.len(), "?", ", ")))
                        .into_boxed::<Mysql>();
                for id in &ids {
                    statement = statement.bind::<Text, _>(id.as_str());
                }
                statement.execute(self).await?;
            }
        }
        Ok(())
    }

    /// [`finish_and_commit_sql`] in one round trip, through the unit of work's checked
    /// commit: MySQL stops a multi-statement string at its first error (MySQL 8.0 C API,
    /// "Multiple Statement Execution Support"), so a failed statement skips the COMMIT and
    /// the batch is rolled back. Two round trips for more than [`MAX_IDS_AT_COMMIT`] rows; a
    /// plain COMMIT when no row was published.
    async fn finish_and_commit(&mut self, ids: &[Uuid], mode: PublishedRows) -> QueryResult<()> {
        match finish_and_commit_sql(ids, mode) {
            Some(sql) => crate::unit_of_work::commit_checked(self, &sql)
                .await
                .map_err(|failed| failed.error),
            None => finish_then_commit(self, ids, mode).await,
        }
    }

    async fn stats(&mut self) -> QueryResult<OutboxStats> {
        stats(self).await
    }
}

/// Counts what waits in a MySQL outbox: what [`crate::outbox::stats`] counts on PostgreSQL,
/// in one statement. It reads every row of `outbox_events` (MySQL has no partial index to
/// keep published rows out): cheap with [`PublishedRows::Delete`], the default; with
/// [`PublishedRows::Mark`], purge the published rows ([`crate::outbox::purge_published`]).
/// Every relay runs it into its gauges every [`RelayConfig::stats_interval`].
///
/// # Errors
/// The database's error.
pub async fn stats(conn: &mut AsyncMysqlConnection) -> QueryResult<OutboxStats> {
    let row: StatsRow = diesel::sql_query(format!(
        "SELECT CAST(COALESCE(SUM(dead_lettered_at IS NULL), 0) AS SIGNED) AS queued, \
                CAST(COALESCE(SUM(dead_lettered_at IS NOT NULL), 0) AS SIGNED) AS dead_letters, \
                CAST(COALESCE(SUM(dead_lettered_at IS NULL AND available_at = '{FOREVER}'), 0) \
                    AS SIGNED) AS blocked, \
                (SELECT COUNT(*) FROM outbox_events \
                 WHERE dead_lettered_at IS NOT NULL AND skipped_at IS NOT NULL \
                   AND published_at IS NULL) AS skipped_dead_letters, \
                TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', \
                    MIN(CASE WHEN dead_lettered_at IS NULL THEN occurred_at END)) AS oldest_us \
         FROM outbox_events WHERE {QUEUED}"
    ))
    .get_result(conn)
    .await?;
    row.into_stats()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_waits_round_the_statement_timeout_up_to_whole_seconds() {
        let seconds = |timeout| {
            let sql = lock_waits(timeout);
            let (_, value) = sql.rsplit_once("= ").unwrap();
            assert!(
                sql.contains(&format!("innodb_lock_wait_timeout = {value},")),
                "both waits alike: {sql}"
            );
            value.parse::<u64>().unwrap()
        };
        assert_eq!(seconds(Duration::from_secs(30)), 30, "the default");
        assert_eq!(seconds(Duration::from_millis(1_200)), 2);
        assert_eq!(
            seconds(Duration::from_millis(100)),
            1,
            "never 0: no wait at all on MariaDB"
        );
    }
}
