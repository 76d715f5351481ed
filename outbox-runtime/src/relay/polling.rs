//! The message relay on databases without notifications (MySQL, SQLite): the PostgreSQL
//! relay's workers, batches and publishing over a [`PolledStore`], woken by polling and by
//! the units of work of its own process.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text};
use diesel::{QueryResult, QueryableByName};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::worker::{self, RelayStore};
use super::{BatchReport, RelayConfig, RelayError, RelayHandle, Shared};
use crate::commits::COMMITS;
use crate::database;
use crate::outbox::queries::{ClaimedEvent, JsonBytes, JsonText, RetryPolicy};
use crate::outbox::{MissingMigrations, OutboxStats, PublishedRows};
use crate::spawned::Spawned;

/// A database the polling relay publishes from.
pub(super) trait PolledStore: RelayStore {
    /// The relay's name, for errors.
    const NAME: &'static str;

    /// Adapts the configuration to the database (e.g. the number of workers).
    fn configure(config: RelayConfig) -> RelayConfig {
        config
    }

    /// The outbox's migrations the database lacks; `None` when it lacks none.
    fn missing_migrations(
        &mut self,
    ) -> impl Future<Output = QueryResult<Option<MissingMigrations>>> + Send;

    /// Runs [`WRITE_CHECK`]: fails where the database takes no writes.
    fn check_writes(&mut self) -> impl Future<Output = QueryResult<()>> + Send;

    /// What the connection's account lacks of the privileges the relay needs in `mode`, as
    /// a sentence naming each ([`crate::privileges`]); `None` where it lacks none, and on
    /// SQLite, which has no privileges.
    fn lacking_privileges(
        &mut self,
        _mode: PublishedRows,
    ) -> impl Future<Output = QueryResult<Option<String>>> + Send {
        async { Ok(None) }
    }
}

/// [`Polling::connect`]'s check that the database takes the relay's writes: an update of no
/// rows, which a database without writes refuses all the same (MySQL's `read_only` and a
/// READ ONLY transaction, and SQLite's read-only file, are checked before a row is read).
pub(super) const WRITE_CHECK: &str =
    "UPDATE outbox_events SET published_at = published_at WHERE 1 = 0";

/// A relay without a listener: its workers poll, and are woken by each commit of this
/// process.
pub(super) struct Polling<C> {
    shared: Arc<Shared>,
    duplicate_window: Duration,
    /// The connection of [`relay_batch`](Self::relay_batch), and then of the first worker.
    conn: Option<C>,
    /// When `conn` was last used, against `RelayStore::idle_limit`.
    used: tokio::time::Instant,
}

impl<C: PolledStore> Polling<C> {
    /// Checks the configuration, makes sure the stream exists (as `Relay::connect`), and
    /// that the database is reachable and migrated.
    pub(super) async fn connect(
        config: RelayConfig,
        nats: async_nats::Client,
    ) -> Result<Self, RelayError> {
        let relay = C::NAME;
        C::KIND
            .check(&config.database_url, relay)
            .map_err(RelayError::Config)?;
        #[cfg(feature = "postgres")]
        if config.connector.is_some() {
            return Err(RelayError::Config(format!(
                "a connector opens PostgreSQL connections; {relay} opens its own from \
                 database_url"
            )));
        }
        let config = C::configure(config);
        let (shared, duplicate_window) = Shared::prepare(config, nats).await?;
        let mut conn = C::connect(&shared).await?;
        // Before the migrations check: MySQL shows an account only the tables it holds a
        // privilege on, so one without any on `__diesel_schema_migrations` would be told the
        // database lacks every migration.
        match database::bounded(
            shared.config.statement_timeout,
            &shared.target,
            "the privileges check",
            conn.lacking_privileges(shared.config.published),
        )
        .await
        {
            Ok(None) => {}
            Ok(Some(lacking)) => {
                return Err(RelayError::Connect(database::ConnectError {
                    target: shared.target.clone(),
                    reason: format!("checking the relay's privileges: {lacking}"),
                }));
            }
            Err(database::Bounded::Failed(error)) => return Err(error.into()),
            Err(database::Bounded::TimedOut(timed_out)) => return Err(timed_out.into()),
        }
        let missing = database::bounded(
            shared.config.statement_timeout,
            &shared.target,
            "the migrations check",
            conn.missing_migrations(),
        )
        .await?;
        if let Some(missing) = missing {
            return Err(missing.into());
        }
        // The relay's first write, of no rows: a database that takes none is named now,
        // where every batch would fail, and the relay would publish nothing, for as long as
        // it runs.
        match database::bounded(
            shared.config.statement_timeout,
            &shared.target,
            "the write check",
            conn.check_writes(),
        )
        .await
        {
            Ok(()) => {}
            Err(database::Bounded::Failed(error)) => {
                return Err(RelayError::Connect(database::ConnectError {
                    target: shared.target.clone(),
                    reason: format!(
                        "checking that the relay can write the outbox: {error}{}",
                        database::refusal_hint(&error, C::KIND, "relay")
                    ),
                }));
            }
            Err(database::Bounded::TimedOut(timed_out)) => return Err(timed_out.into()),
        }
        Ok(Self {
            shared,
            duplicate_window,
            conn: Some(conn),
            used: tokio::time::Instant::now(),
        })
    }

    pub(super) fn duplicate_window(&self) -> Duration {
        self.duplicate_window
    }

    pub(super) fn spawn(self) -> RelayHandle {
        RelayHandle(Spawned::new(|shutdown| self.run(shutdown)))
    }

    pub(super) async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), RelayError> {
        let stop = CancellationToken::new();
        // Whichever way this function ends (its future dropped, a panic), the tasks it started
        // stop with it.
        let _stop_on_exit = stop.clone().drop_guard();
        let wakers: Vec<Arc<Notify>> = (0..self.shared.config.workers)
            .map(|_| Arc::new(Notify::new()))
            .collect();
        let mut workers = JoinSet::new();
        let stale = C::idle_too_long(&self.shared, self.used);
        let mut first_conn = self.conn.filter(|_| !stale);
        for (index, wake) in wakers.iter().enumerate() {
            let (shared, wake, stop) = (Arc::clone(&self.shared), Arc::clone(wake), stop.clone());
            let peers = wakers
                .iter()
                .enumerate()
                .filter(|(other, _)| *other != index)
                .map(|(_, peer)| Arc::clone(peer))
                .collect();
            let conn = first_conn.take();
            workers.spawn(async move {
                worker::run::<C>(shared, index, conn, wake, peers, None, stop).await
            });
        }
        let doorbell = {
            let stop = stop.clone();
            tokio::spawn(async move { ring_on_commits(&wakers, &stop).await })
        };
        let gauges = (!self.shared.config.stats_interval.is_zero()).then(|| {
            let (shared, stop) = (Arc::clone(&self.shared), stop.clone());
            tokio::spawn(async move { super::read_stats::<C>(&shared, stop).await })
        });

        tokio::pin!(shutdown);
        let mut outcome = Ok(());
        tokio::select! {
            () = &mut shutdown => {}
            Some(joined) = workers.join_next() => {
                tracing::error!(
                    error = ?joined.as_ref().err(),
                    "a relay worker ended; stopping the relay"
                );
                outcome = joined.map_err(RelayError::from);
            }
        }
        stop.cancel();
        while let Some(joined) = workers.join_next().await {
            if let Err(error) = joined {
                outcome = outcome.and(Err(error.into()));
            }
        }
        doorbell.await?;
        if let Some(gauges) = gauges {
            gauges.await?;
        }
        outcome
    }

    pub(super) async fn relay_batch(&mut self) -> Result<BatchReport, RelayError> {
        if C::idle_too_long(&self.shared, self.used) {
            self.conn = None;
        }
        self.used = tokio::time::Instant::now();
        let conn = match &mut self.conn {
            Some(conn) => conn,
            conn => conn.insert(C::connect(&self.shared).await?),
        };
        let result = worker::relay_batch(&self.shared, None, conn, &CancellationToken::new()).await;
        match result {
            Ok(outcome) => Ok(outcome.report),
            Err(error) => {
                self.conn = None;
                Err(error.into())
            }
        }
    }

    /// Closes the connection of [`relay_batch`](Self::relay_batch), giving back what it holds
    /// (SQLite's lease).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(super) async fn close(mut self) {
        if let Some(mut conn) = self.conn.take() {
            conn.close().await;
        }
    }
}

/// Wakes every worker whenever a unit of work of this process commits events, until `stop`.
/// A worker's `Notify` keeps the wake-up for it when it is busy, so a commit made while it
/// claims is not missed.
async fn ring_on_commits(wakers: &[Arc<Notify>], stop: &CancellationToken) {
    let mut seen = COMMITS.count();
    loop {
        let commit = COMMITS.notified();
        tokio::pin!(commit);
        // Registered before the count is read: a commit after this line completes `commit`.
        commit.as_mut().enable();
        let now = COMMITS.count();
        if now != seen {
            seen = now;
            wakers.iter().for_each(|waker| waker.notify_one());
            continue;
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = commit => {}
        }
    }
}

/// `(...)` groups of `width` placeholders, `n` of them, joined by `joiner`.
pub(super) fn groups(n: usize, group: &str, joiner: &str) -> String {
    vec![group; n].join(joiner)
}

/// An aggregate's head, as the claim's first statement finds it.
#[derive(QueryableByName)]
pub(super) struct Head {
    #[diesel(sql_type = Text)]
    pub(super) aggregate_type: String,
    #[diesel(sql_type = Text)]
    pub(super) aggregate_id: String,
    /// `None` when its rows were published since the window was read (SQLite's claim;
    /// MySQL's returns no row for such an aggregate).
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(super) head: Option<i64>,
}

/// A row of the claim.
#[derive(QueryableByName)]
pub(crate) struct Row {
    #[diesel(sql_type = Text)]
    pub(super) id: String,
    #[diesel(sql_type = Text)]
    pub(super) aggregate_type: String,
    #[diesel(sql_type = Text)]
    pub(super) aggregate_id: String,
    #[diesel(sql_type = BigInt)]
    pub(super) aggregate_seq: i64,
    #[diesel(sql_type = Text)]
    pub(super) event_type: String,
    #[diesel(sql_type = Integer)]
    pub(super) event_version: i32,
    #[diesel(sql_type = Text)]
    pub(super) partition_key: String,
    #[diesel(sql_type = Text)]
    pub(super) subject: String,
    #[diesel(sql_type = Text)]
    pub(super) payload: String,
    #[diesel(sql_type = Text)]
    pub(super) headers: String,
    /// `occurred_at` in microseconds since the epoch (UTC).
    #[diesel(sql_type = BigInt)]
    pub(super) occurred_us: i64,
    #[diesel(sql_type = Nullable<Text>)]
    pub(super) correlation_id: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(super) causation_id: Option<String>,
    #[diesel(sql_type = Bool)]
    pub(super) available: bool,
}

/// What a polled database's stats query returns: `oldest_us` is the oldest waiting row's
/// `occurred_at` in microseconds since the epoch (UTC).
#[derive(QueryableByName)]
pub(super) struct StatsRow {
    #[diesel(sql_type = BigInt)]
    queued: i64,
    #[diesel(sql_type = BigInt)]
    dead_letters: i64,
    #[diesel(sql_type = BigInt)]
    blocked: i64,
    #[diesel(sql_type = BigInt)]
    skipped_dead_letters: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    oldest_us: Option<i64>,
}

impl StatsRow {
    pub(super) fn into_stats(self) -> QueryResult<OutboxStats> {
        let oldest_queued_at = self
            .oldest_us
            .map(|us| time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(us) * 1_000))
            .transpose()
            .map_err(|e| {
                diesel::result::Error::DeserializationError(
                    format!("the oldest queued row's occurred_at: {e}").into(),
                )
            })?;
        Ok(OutboxStats {
            queued: self.queued,
            dead_letters: self.dead_letters,
            blocked: self.blocked,
            skipped_dead_letters: self.skipped_dead_letters,
            oldest_queued_at,
        })
    }
}

impl Row {
    pub(crate) fn into_claimed(self) -> QueryResult<ClaimedEvent> {
        let invalid = |what: String| diesel::result::Error::DeserializationError(what.into());
        let id = Uuid::parse_str(&self.id)
            .map_err(|e| invalid(format!("outbox_events.id {:?} is not a UUID: {e}", self.id)))?;
        let occurred_at =
            time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(self.occurred_us) * 1_000)
                .map_err(|e| invalid(format!("outbox_events.occurred_at of {id}: {e}")))?;
        Ok(ClaimedEvent {
            id,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            aggregate_seq: self.aggregate_seq,
            event_type: self.event_type,
            event_version: self.event_version,
            partition_key: self.partition_key,
            subject: self.subject,
            payload: JsonBytes(bytes::Bytes::from(self.payload)),
            headers: JsonText(self.headers.into_bytes()),
            occurred_at,
            correlation_id: self.correlation_id,
            causation_id: self.causation_id,
            available: self.available,
        })
    }
}

/// The rejected row's state after its rejection was recorded.
#[derive(QueryableByName)]
pub(super) struct Rejected {
    #[diesel(sql_type = Text)]
    pub(super) aggregate_type: String,
    #[diesel(sql_type = Text)]
    pub(super) aggregate_id: String,
    #[diesel(sql_type = BigInt)]
    pub(super) aggregate_seq: i64,
    #[diesel(sql_type = Integer)]
    pub(super) attempts: i32,
    #[diesel(sql_type = Bool)]
    pub(super) dead_lettered: bool,
    /// Until when the aggregate's later rows wait: the retry time, the end of time behind a
    /// dead letter that blocks, or `None` behind a skipped one.
    #[diesel(sql_type = Nullable<Text>)]
    pub(super) blocked_until: Option<String>,
}

/// The claim's rows in the order `worker::chains` reads: each aggregate's head (`locked`),
/// then the rows behind it (`followers`) in sequence order.
pub(super) fn chained(
    mut locked: Vec<Row>,
    mut followers: Vec<Row>,
) -> QueryResult<Vec<ClaimedEvent>> {
    let mut rows = Vec::with_capacity(locked.len() + followers.len());
    followers.sort_by(|a, b| {
        (&a.aggregate_type, &a.aggregate_id, a.aggregate_seq).cmp(&(
            &b.aggregate_type,
            &b.aggregate_id,
            b.aggregate_seq,
        ))
    });
    let mut followers = followers.into_iter().peekable();
    locked.sort_by(|a, b| {
        (&a.aggregate_type, &a.aggregate_id).cmp(&(&b.aggregate_type, &b.aggregate_id))
    });
    for head in locked {
        let key = (head.aggregate_type.clone(), head.aggregate_id.clone());
        rows.push(head.into_claimed()?);
        while let Some(row) =
            followers.next_if(|row| (&row.aggregate_type, &row.aggregate_id) == (&key.0, &key.1))
        {
            rows.push(row.into_claimed()?);
        }
    }
    Ok(rows)
}

/// A rejected row's next state, as `queries::record_rejection` computes it on PostgreSQL.
pub(super) struct Next {
    /// The attempts counted, this one included.
    pub(super) attempts: i32,
    /// The row becomes a dead letter.
    pub(super) dead: bool,
    /// ... that does not block its aggregate's later rows.
    pub(super) skipped: bool,
    /// The retry's delay before jitter: `base * 2^(attempts - 1)`, capped, in microseconds.
    pub(super) delay_us: i64,
}

impl Next {
    /// The state after one more rejection of a row rejected `attempts` times before.
    pub(super) fn after(attempts: i32, policy: RetryPolicy) -> Self {
        let attempts = attempts.saturating_add(1);
        let dead = attempts >= policy.max_attempts;
        let exponent = u32::try_from(attempts - 1).unwrap_or(0).min(40);
        Self {
            attempts,
            dead,
            skipped: dead && !policy.dead_letters_block,
            delay_us: policy
                .base_delay_ms
                .saturating_mul(1_i64 << exponent)
                .min(policy.max_delay_ms)
                .saturating_mul(1_000),
        }
    }
}
