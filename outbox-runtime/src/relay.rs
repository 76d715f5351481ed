//! The message relay: a polling publisher, woken early by `LISTEN/NOTIFY`, that moves
//! committed outbox rows to JetStream.
//!
//! A relay runs [`workers`](RelayConfig::workers) batch loops and one listener:
//! - each worker repeats one transaction per batch: claim queued rows (the head of each
//!   aggregate's queue, locked with `FOR UPDATE SKIP LOCKED`, and the rows behind it: one
//!   aggregate is published by one relay at a time, in order), publish them with their
//!   JetStream acks awaited, record what the broker rejected, mark (or delete) the acked rows
//!   in one statement, commit. Workers overlap one batch's commit with the next one's
//!   publishes. They claim in turn, each claim leaving out the aggregates its peers hold, so
//!   a claim never reads heads its own relay has locked; several relay processes on one
//!   outbox behave like more workers, except that they do not know what the others hold.
//! - the listener holds a dedicated connection that `LISTEN`s on its outbox table's channel
//!   ([`notification_channel`]) and wakes the workers at each notification. The outbox's
//!   insert trigger notifies only while a relay waits for rows: when all its workers found
//!   nothing to claim, the listener takes the *doorbell*, an advisory lock each inserting
//!   transaction tries in shared mode (see [`doorbell_lock`]), and a worker claims once more
//!   before they sleep. A notifying
//!   transaction serialises its COMMIT with every other notifying one, so under load, when
//!   the relay is busy, units of work do not notify. Workers also poll every
//!   [`poll_interval`](RelayConfig::poll_interval), so a lost notification or a dropped
//!   listening connection only delays a batch.
//!
//! Delivery is at-least-once: a relay that dies after an ack and before its commit leaves the
//! row queued, and the next claim publishes it again with the same `Nats-Msg-Id`, which
//! JetStream drops inside the stream's duplicate window. [`Relay::connect`] warns when that
//! window is shorter than the relay's [redelivery horizon](RelayConfig::redelivery_horizon).
//!
//! Nothing is lost to a fault: a broker outage of any length pauses the workers (no attempt
//! counted; they resume as soon as the client reconnects, and the outage is logged as a
//! warning); a rejection is retried and eventually dead-lettered (see [`crate::dead_letter`]);
//! a row that cannot be published as it stands (a subject outside the prefix, say) is
//! dead-lettered at once; a dropped database connection is reopened, and one whose server
//! stops answering is dropped after the statement timeout. The relay stops only when told
//! to, after finishing its batches.

// Without PostgreSQL, only the workers' idle protocol of the doorbell is used (no one rings).
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
mod doorbell;
#[cfg(feature = "postgres")]
mod listener;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) mod polling;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
mod worker;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::database::{
    self, Bounded, ConnectError, DEFAULT_CONNECT_TIMEOUT, DEFAULT_STATEMENT_TIMEOUT, Redacted,
    TimedOut,
};
use crate::outbox::queries::RetryPolicy;
use crate::outbox::{MissingMigrations, PublishedRows};
use crate::publisher::{InvalidSource, Publisher, StreamError, ensure_stream};
use crate::spawned::Spawned;
use crate::topology::Topology;
// PostgreSQL's relay: its listener, doorbell, topology registry and housekeeping.
#[cfg(feature = "postgres")]
use {
    crate::database::Connector,
    crate::outbox::require_migrations,
    crate::topology::{self, Role},
    diesel_async::AsyncPgConnection,
    doorbell::Doorbell,
    std::future::Future,
    tokio::sync::Notify,
    tokio::task::JoinSet,
};

#[cfg(feature = "postgres")]
pub use doorbell::{BUSY_LOCK, DOORBELL_LOCK, busy_lock, doorbell_lock, notification_channel};
pub use worker::BatchReport;

/// What happens to the later rows of an aggregate when one of its rows is dead-lettered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeadLetterPolicy {
    /// They wait behind it until an operator retries or skips it
    /// ([`crate::dead_letter`]): the aggregate's order is never broken. The default.
    #[default]
    Block,
    /// The dead letter is skipped at once and they flow on; consumers see a gap in the
    /// aggregate's `ce-sequence`, and a later retry publishes it out of order.
    Skip,
}

/// The longest duration a [`RelayConfig`] takes in any of its fields: 2^31 - 1 ms (24 days,
/// 20 h 31 min 23.647 s), the largest `statement_timeout` PostgreSQL accepts (an `int` of
/// milliseconds: PostgreSQL docs, "Client Connection Defaults"). A longer one is refused at
/// start-up with [`RelayError::Config`] naming the field, rather than overflowing the sums
/// the relay makes of them ([`RelayConfig::redelivery_horizon`], deadlines).
pub const MAX_DURATION: Duration = Duration::from_millis(2_147_483_647);

/// The shortest interval that paces one of the toolkit's loops: a relay's `poll_interval`,
/// `max_backoff` and (when not zero, which switches it off) `stats_interval`, an inbox's
/// `purge_interval`. A shorter one, zero above all, is refused at start-up with an error
/// naming the field: the loop would run again at once. Measured with `outbox relay
/// --poll-interval 0s`: an idle relay claimed without a pause, at 100% of a core, and
/// PostgreSQL at 45%; with `max_backoff` zero every pause after a failure is zero (read in
/// the code), so a relay whose database is down would reconnect without a pause.
pub const MIN_INTERVAL: Duration = Duration::from_millis(1);

/// The most [`workers`](RelayConfig::workers) a relay runs; more are refused at start-up with
/// [`RelayError::Config`] naming the field. Each worker holds a database connection of its
/// own, and a server allows only so many: PostgreSQL 100 by default (`max_connections`,
/// PostgreSQL docs, "Connection Settings"), MySQL 151, MariaDB 151 (`max_connections`, their
/// server system variables). The workers of one relay claim in turn, one claim at a time,
/// so beyond a few they wait for their turn rather than relay faster; a relay needs more
/// instances, not more workers, to spread over machines. Measured with `outbox relay
/// --workers 2000` against this machine's PostgreSQL (100 connections): the relay took
/// every connection the server had left, so that every other client was refused ("sorry,
/// too many clients already"), and its log alternated between the database failing and
/// answering again, over 300 lines in an 11-s run; with 100,000 workers it had not stopped
/// 6 minutes after SIGTERM.
pub const MAX_WORKERS: usize = 64;

/// The first of `intervals` (a configuration field's name, its value) under
/// [`MIN_INTERVAL`], as the error that names it.
pub(crate) fn too_short<'a>(
    intervals: impl IntoIterator<Item = (&'a str, Duration)>,
) -> Result<(), String> {
    match intervals
        .into_iter()
        .find(|(_, value)| *value < MIN_INTERVAL)
    {
        Some((name, value)) => Err(format!(
            "{name} must be at least {MIN_INTERVAL:?}, not {value:?}: a shorter one repeats \
             its loop without a pause"
        )),
        None => Ok(()),
    }
}

/// `retry_delay` over `max_retry_delay`, which caps every `delay` ("retry's", "nak's"), as the
/// error that names both: the first delay would silently be the cap.
pub(crate) fn over_its_cap(
    retry_delay: Duration,
    max_retry_delay: Duration,
    delay: &str,
) -> Result<(), String> {
    if retry_delay > max_retry_delay {
        return Err(format!(
            "retry_delay {retry_delay:?} is longer than max_retry_delay {max_retry_delay:?}, \
             which caps every {delay} delay: raise max_retry_delay or shorten retry_delay"
        ));
    }
    Ok(())
}

/// The first of `durations` (a configuration field's name, its value) over [`MAX_DURATION`],
/// as the error that names it; `what` takes them ("a relay").
pub(crate) fn too_long<const N: usize>(
    what: &str,
    durations: [(&str, Duration); N],
) -> Result<(), String> {
    match durations.iter().find(|(_, value)| *value > MAX_DURATION) {
        Some((name, value)) => Err(format!(
            "{name} {value:?} is longer than {what} takes: at most {MAX_DURATION:?} (2^31 - 1 \
             ms, PostgreSQL's longest statement_timeout)"
        )),
        None => Ok(()),
    }
}

/// How the relay runs: a plain struct with documented defaults. Start from
/// [`RelayConfig::new`] and set fields. Its `Debug` shows the database URL without its
/// password. Each duration is at most [`MAX_DURATION`].
#[derive(Clone)]
pub struct RelayConfig {
    /// The URL of the database holding the outbox table: PostgreSQL's for `Relay`, a
    /// `mysql://` URL for `mysql::MysqlRelay`, a file's path for `sqlite::SqliteRelay`.
    pub database_url: String,
    /// The subject prefix of the outbox's events and the stream that captures `{prefix}.>`:
    /// the same value as the units of work's
    /// ([`Outbox::with_topology`](crate::Outbox::with_topology)). Rows outside the prefix are
    /// dead-lettered. Default [`Topology::default`]: `events`, stream `EVENTS`.
    pub topology: Topology,
    /// The `ce-source` of every message: a URI-reference naming the producing service
    /// (CloudEvents 1.0, section 3.1.1 `source`). Default `/outbox`.
    pub source: String,
    /// Batch loops, each with its own database connection. Two let one batch's commit
    /// overlap the next one's publishes. Default 2; 1 to [`MAX_WORKERS`] (64).
    pub workers: usize,
    /// The most rows claimed per batch (one transaction). The relay holds a batch's rows in
    /// memory: about `batch_size` times the average payload. Default 2000.
    pub batch_size: usize,
    /// The most publishes awaiting their ack at once, across the relay's workers (a publish
    /// beyond waits for one to be acked): at most tokio's `Semaphore::MAX_PERMITS`, which
    /// bounds it. Default 1024.
    pub max_in_flight: usize,
    /// Wake on `LISTEN/NOTIFY` when rows commit (inserts notify only while the relay waits:
    /// see the module's documentation). When `false`, the relay only polls. Default `true`.
    pub listen: bool,
    /// How long an idle relay waits before it looks again without a notification: a poll
    /// falls due this long after the relay's last claim began, and one of its idle workers
    /// claims (the others wait on; a claim that finds rows wakes them), so an idle relay
    /// claims once per interval whatever its `workers`. Default 500 ms; at least
    /// [`MIN_INTERVAL`].
    pub poll_interval: Duration,
    /// How long to wait for a JetStream ack before the publish counts as a transport
    /// failure. Default 5 s, async-nats's own default.
    pub ack_timeout: Duration,
    /// Delete acked rows, mark them published and keep them, or move them to the archive's
    /// daily partitions. Default [`PublishedRows::Delete`]: the table holds only what is
    /// queued, and relaying measured 1.19-1.54x faster than marking (the README's benchmark,
    /// figure 3, two runs of 2026-11-28; 1.35-1.5x in the five earlier runs of BENCHMARKS.md).
    pub published: PublishedRows,
    /// Rejections before a row becomes a dead letter. Default 10.
    pub max_attempts: u32,
    /// The delay before a rejected row's first retry; it doubles with each attempt, with
    /// jitter. Default 1 s.
    pub retry_delay: Duration,
    /// The longest delay between retries of a rejected row. Default 5 min.
    /// At least `retry_delay`, or the configuration is refused.
    pub max_retry_delay: Duration,
    /// What a dead letter does to the later rows of its aggregate. Default
    /// [`DeadLetterPolicy::Block`].
    pub dead_letters: DeadLetterPolicy,
    /// The longest pause after a transport failure or a database error; pauses start at
    /// 100 ms and double up to this. A pause ends early when the NATS client reconnects.
    /// Default 30 s; at least [`MIN_INTERVAL`].
    pub max_backoff: Duration,
    /// How long opening a database connection may take, server answer included. Default
    /// [`DEFAULT_CONNECT_TIMEOUT`] (10 s).
    pub connect_timeout: Duration,
    /// Opens the relay's connections the service's way (its pool's TLS, credentials and
    /// setup) instead of from `database_url`, which then only names the database in logs.
    /// The relay holds `workers` connections, one more while `listen` (the `LISTEN`
    /// connection) and one more while `stats_interval` is not zero (the gauges' query), and
    /// opens one for a moment each hour (housekeeping). Default `None`.
    #[cfg(feature = "postgres")]
    pub connector: Option<Connector>,
    /// How long one of the relay's queries may take: set as the session's server-side
    /// `statement_timeout` (on MySQL, as its lock waits, `innodb_lock_wait_timeout` and
    /// `lock_wait_timeout`), and enforced by the relay itself, which drops a connection whose
    /// server does not answer in time (its transaction is rolled back, its rows claimed
    /// again). Default [`DEFAULT_STATEMENT_TIMEOUT`] (30 s).
    pub statement_timeout: Duration,
    /// How often the relay reads the outbox's state into the gauges `outbox_queued_events`,
    /// `outbox_oldest_queued_age_seconds`, `outbox_dead_letters`, `outbox_blocked_events`
    /// and `outbox_skipped_dead_letters` (one query on the queued rows; every replica runs
    /// it). `Duration::ZERO` switches it off; any other value is at least [`MIN_INTERVAL`].
    /// Default 15 s.
    pub stats_interval: Duration,
}

impl std::fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = f.debug_struct("RelayConfig");
        out.field("database_url", &Redacted(&self.database_url))
            .field("topology", &self.topology)
            .field("source", &self.source)
            .field("workers", &self.workers)
            .field("batch_size", &self.batch_size)
            .field("max_in_flight", &self.max_in_flight)
            .field("listen", &self.listen)
            .field("poll_interval", &self.poll_interval)
            .field("ack_timeout", &self.ack_timeout)
            .field("published", &self.published)
            .field("max_attempts", &self.max_attempts)
            .field("retry_delay", &self.retry_delay)
            .field("max_retry_delay", &self.max_retry_delay)
            .field("dead_letters", &self.dead_letters)
            .field("max_backoff", &self.max_backoff)
            .field("connect_timeout", &self.connect_timeout);
        #[cfg(feature = "postgres")]
        out.field("connector", &self.connector);
        out.field("statement_timeout", &self.statement_timeout)
            .field("stats_interval", &self.stats_interval)
            .finish()
    }
}

impl RelayConfig {
    /// The defaults, for the database at `database_url`.
    pub fn new(database_url: impl Into<String>) -> Self {
        Self {
            database_url: database_url.into(),
            topology: Topology::default(),
            source: "/outbox".to_owned(),
            workers: 2,
            batch_size: 2000,
            max_in_flight: 1024,
            listen: true,
            poll_interval: Duration::from_millis(500),
            ack_timeout: Duration::from_secs(5),
            published: PublishedRows::Delete,
            max_attempts: 10,
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(300),
            dead_letters: DeadLetterPolicy::Block,
            max_backoff: Duration::from_secs(30),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            #[cfg(feature = "postgres")]
            connector: None,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            stats_interval: Duration::from_secs(15),
        }
    }

    /// The longest time between a publish whose mark was lost and the publish of the same
    /// row again, while the database answers: the ack may time out (`ack_timeout`), the mark
    /// may time out (`statement_timeout`), the worker pauses (up to `max_backoff`), then it
    /// claims again (within `poll_interval`). A relay process that dies is redelivered
    /// sooner: PostgreSQL releases its locks when its connection closes. The stream's
    /// duplicate window must be longer for JetStream to drop such a duplicate. (A database
    /// that freezes holds the rows until it notices the closed connection, which may be
    /// later: the inbox's dedup covers what falls outside the window.)
    pub fn redelivery_horizon(&self) -> Duration {
        self.ack_timeout + self.statement_timeout + self.max_backoff + self.poll_interval
    }

    /// Checks the configuration without connecting anything: what every relay's `connect`
    /// ([`Relay::connect`], and on MySQL and SQLite theirs) refuses before it touches NATS
    /// or the database, so that a service or a daemon can refuse a bad setting at once,
    /// whether or not the servers are up. A relay on MySQL or SQLite also refuses a
    /// `connector` at its `connect`.
    ///
    /// # Errors
    /// [`RelayError::Config`], naming the setting and its bound: a timeout of zero, an
    /// interval under [`MIN_INTERVAL`] or a duration over [`MAX_DURATION`], a count of zero
    /// (`workers`, `batch_size`, `max_in_flight`, `max_attempts`), `retry_delay` over
    /// `max_retry_delay`, more than [`MAX_WORKERS`] workers, `max_attempts` over
    /// `i32::MAX`, stream settings a stream would not take (its name, `replicas` outside 1
    /// to 5, a `duplicate_window` of zero or over `max_age`, a `max_bytes` below 1 other
    /// than -1: [`StreamSettings`](crate::StreamSettings)), or `max_in_flight` over tokio's
    /// semaphore's `MAX_PERMITS`.
    pub fn validate(&self) -> Result<(), RelayError> {
        for (name, value) in [
            ("connect_timeout", self.connect_timeout),
            ("statement_timeout", self.statement_timeout),
            ("ack_timeout", self.ack_timeout),
        ] {
            if value.is_zero() {
                return Err(RelayError::Config(format!(
                    "{name} must be longer than zero"
                )));
            }
        }
        // `stats_interval` zero switches the gauges off.
        let stats =
            (!self.stats_interval.is_zero()).then_some(("stats_interval", self.stats_interval));
        too_short(
            [
                ("poll_interval", self.poll_interval),
                ("max_backoff", self.max_backoff),
            ]
            .into_iter()
            .chain(stats),
        )
        .map_err(RelayError::Config)?;
        too_long(
            "a relay",
            [
                ("poll_interval", self.poll_interval),
                ("ack_timeout", self.ack_timeout),
                ("retry_delay", self.retry_delay),
                ("max_retry_delay", self.max_retry_delay),
                ("max_backoff", self.max_backoff),
                ("connect_timeout", self.connect_timeout),
                ("statement_timeout", self.statement_timeout),
                ("stats_interval", self.stats_interval),
            ],
        )
        .map_err(RelayError::Config)?;
        let positive = [
            ("workers", self.workers),
            ("batch_size", self.batch_size),
            ("max_in_flight", self.max_in_flight),
            ("max_attempts", self.max_attempts as usize),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(RelayError::Config(format!("{name} must be at least 1")));
            }
        }
        over_its_cap(self.retry_delay, self.max_retry_delay, "retry's")
            .map_err(RelayError::Config)?;
        if self.workers > MAX_WORKERS {
            return Err(RelayError::Config(format!(
                "workers {} is more than a relay runs ({MAX_WORKERS}): each holds a database \
                 connection, and a relay's workers claim in turn",
                self.workers
            )));
        }
        if i32::try_from(self.max_attempts).is_err() {
            return Err(RelayError::Config(format!(
                "max_attempts {} is larger than the attempts column holds",
                self.max_attempts
            )));
        }
        self.topology
            .stream
            .check()
            .map_err(|error| RelayError::Config(format!("topology.stream.{error}")))?;
        // The publisher bounds the acks outstanding with a tokio semaphore of this many permits.
        if self.max_in_flight > tokio::sync::Semaphore::MAX_PERMITS {
            return Err(RelayError::Config(format!(
                "max_in_flight {} is more than the publisher's semaphore holds ({})",
                self.max_in_flight,
                tokio::sync::Semaphore::MAX_PERMITS
            )));
        }
        Ok(())
    }

    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            max_attempts: i32::try_from(self.max_attempts).unwrap_or(i32::MAX),
            base_delay_ms: millis(self.retry_delay),
            max_delay_ms: millis(self.max_retry_delay),
            dead_letters_block: self.dead_letters == DeadLetterPolicy::Block,
        }
    }
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// The relay failed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The configuration is not usable.
    #[error("relay configuration: {0}")]
    Config(String),
    /// The stream is missing or does not capture the outbox's subjects.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// No connection to the database (within `connect_timeout`).
    #[error("relay: {0}")]
    Connect(#[from] ConnectError),
    /// The outbox tables are missing or behind this version of the toolkit.
    #[error("relay: {0}")]
    MissingMigrations(#[from] MissingMigrations),
    /// A query failed.
    #[error("relay database error: {0}")]
    Database(#[from] diesel::result::Error),
    /// A query did not finish within `statement_timeout`; its connection was dropped.
    #[error("relay: {0}")]
    TimedOut(#[from] TimedOut),
    /// A relay task panicked or was aborted.
    #[error("relay task did not finish: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl From<Bounded<diesel::result::Error>> for RelayError {
    fn from(error: Bounded<diesel::result::Error>) -> Self {
        match error {
            Bounded::Failed(error) => Self::Database(error),
            Bounded::TimedOut(timed_out) => Self::TimedOut(timed_out),
        }
    }
}

impl From<InvalidSource> for RelayError {
    fn from(error: InvalidSource) -> Self {
        Self::Config(error.to_string())
    }
}

/// Warns when the broker takes smaller messages than units of work write by default: the
/// server's `max_payload` (from its `INFO`), or the stream's `max_msg_size`, under nats-server's
/// default of 1 MiB, which [`DEFAULT_MAX_PAYLOAD_BYTES`](crate::DEFAULT_MAX_PAYLOAD_BYTES) and
/// the relay's headers fill. An event between the two bounds commits, and the broker refuses
/// its message: it is retried and, after `max_attempts`, dead-lettered, its aggregate's later
/// events waiting behind it.
fn warn_if_messages_are_bounded_below_the_default(
    nats: &async_nats::Client,
    stream: &async_nats::jetstream::stream::Config,
) {
    const SERVER_DEFAULT: usize = 1024 * 1024;
    // Zero before the server's INFO arrived: not known, and nothing to say.
    let server = nats.server_info().max_payload;
    if server == 0 {
        return;
    }
    let stream_limit = usize::try_from(stream.max_message_size)
        .ok()
        .filter(|&n| n > 0);
    let (limit, what) = match stream_limit {
        Some(limit) if limit < server => (limit, "the stream's max_msg_size"),
        _ => (server, "the NATS server's max_payload"),
    };
    if limit < SERVER_DEFAULT {
        let headers = SERVER_DEFAULT - crate::DEFAULT_MAX_PAYLOAD_BYTES;
        tracing::warn!(
            stream = %stream.name,
            limit,
            "{what} is {limit} bytes, under the 1 MiB that units of work fill by default (a \
             payload of up to {} bytes and the relay's headers): the broker will refuse the \
             message of a larger event, which the relay retries and then dead-letters; bound \
             the units of work with Outbox::with_max_payload({})",
            crate::DEFAULT_MAX_PAYLOAD_BYTES,
            limit.saturating_sub(headers)
        );
    }
}

/// What the workers share.
struct Shared {
    config: RelayConfig,
    /// The database URL without its password, for errors and logs.
    target: String,
    retry: RetryPolicy,
    publisher: Publisher,
    nats: async_nats::Client,
    held: worker::HeldAggregates,
    health: Health,
    /// This relay's name among the relays of its database (SQLite's lease owner): the same
    /// for all its connections, new for each relay.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    instance: uuid::Uuid,
    /// Held by the worker that looks whether the stream is gone (after publishes found no
    /// responder), so that the relay looks, and creates it again, once at a time.
    stream_check: tokio::sync::Mutex<()>,
    /// How long the server lets the relay's sessions sit idle in a transaction, in
    /// milliseconds, 0 for no limit, as its latest connection read it (PostgreSQL's
    /// `idle_in_transaction_session_timeout`, MariaDB's `idle_transaction_timeout` and its
    /// kin): a batch keeps its session alive within it while it publishes.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    idle_in_transaction_ms: std::sync::atomic::AtomicU64,
}

impl Shared {
    /// What every relay does before it touches its database: checks the configuration,
    /// makes sure the stream exists and captures the prefix, and warns when its duplicate
    /// window is shorter than the redelivery horizon. Returns the shared state and the
    /// stream's duplicate window.
    async fn prepare(
        config: RelayConfig,
        nats: async_nats::Client,
    ) -> Result<(Arc<Self>, Duration), RelayError> {
        config.validate()?;
        #[cfg(feature = "failpoints")]
        crate::crash_points_from_env();
        describe_metrics();
        let publisher = Publisher::new(
            nats.clone(),
            config.topology.subject_prefix.as_str(),
            &config.source,
            config.ack_timeout,
            config.max_in_flight,
            config.topology.stream.domain.as_deref(),
        )?;
        let stream = ensure_stream(
            publisher.jetstream(),
            &config.topology.stream,
            config.topology.subject_prefix.as_str(),
            config.ack_timeout,
        )
        .await?;
        warn_if_messages_are_bounded_below_the_default(&nats, &stream);
        let horizon = config.redelivery_horizon();
        if stream.duplicate_window < horizon {
            tracing::warn!(
                stream = %config.topology.stream.name,
                duplicate_window = ?stream.duplicate_window,
                redelivery_horizon = ?horizon,
                "the stream's duplicate window is shorter than the relay's redelivery horizon \
                 (ack_timeout + max_backoff + poll_interval): a row published again after a lost \
                 mark may be stored twice; widen the stream's duplicate_window"
            );
        }
        let shared = Arc::new(Self {
            retry: config.retry_policy(),
            held: worker::HeldAggregates::new(config.workers),
            target: database::redacted(&config.database_url),
            config,
            publisher,
            nats,
            health: Health::new(),
            instance: uuid::Uuid::now_v7(),
            stream_check: tokio::sync::Mutex::new(()),
            idle_in_transaction_ms: std::sync::atomic::AtomicU64::new(0),
        });
        Ok((shared, stream.duplicate_window))
    }

    /// Registers the relay's topology, reporting the units of work that write under another
    /// prefix ([`topology::register`]), within the statement timeout.
    #[cfg(feature = "postgres")]
    async fn register_topology(
        &self,
        conn: &mut AsyncPgConnection,
    ) -> Result<(), Bounded<diesel::result::Error>> {
        database::bounded(
            self.config.statement_timeout,
            &self.target,
            "registering the topology",
            topology::register(conn, Role::Relay, &self.config.topology),
        )
        .await
    }

    fn limits(&self) -> database::Limits {
        database::Limits {
            connect_timeout: self.config.connect_timeout,
            statement_timeout: self.config.statement_timeout,
        }
    }
}

/// What the relay logs about its broker and its database: a warning when a failure starts,
/// and when it changes cause (a lost connection, then a database that takes no writes: a
/// primary demoted under its address), a reminder every [`Health::REMIND`] while it lasts,
/// and a note when it ends, however many workers meet it. A failure is never silent, and
/// never a line per batch.
struct Health {
    broker: Streak,
    transport: Streak,
    database: Streak,
}

impl Health {
    const REMIND: Duration = Duration::from_secs(30);

    fn new() -> Self {
        Self {
            broker: Streak::default(),
            transport: Streak::default(),
            database: Streak::default(),
        }
    }

    fn broker_down(&self) {
        if let Some(repeat) = self.broker.failed("") {
            tracing::warn!(
                down_for = ?repeat,
                "the NATS client is disconnected; the relay publishes nothing until it \
                 reconnects (no attempt is counted, nothing is lost)"
            );
        }
    }

    fn broker_up(&self) {
        if let Some(lasted) = self.broker.ended() {
            tracing::info!(after = ?lasted, "the NATS client is connected again; relaying");
        }
    }

    fn transport_failed(&self, error: &str) {
        if let Some(repeat) = self.transport.failed(error) {
            tracing::warn!(
                %error, failing_for = ?repeat,
                "publishes fail in transport (broker unreachable, slow or stopping, or its \
                 stream full); the relay backs off and retries without counting attempts"
            );
        }
    }

    fn transport_ok(&self) {
        if let Some(lasted) = self.transport.ended() {
            tracing::info!(after = ?lasted, "publishes are acked again");
        }
    }

    /// Counts a failure of the database of the relay of `stream`, `kind` `connect` (no
    /// connection) or `batch` (a batch's statement failed or timed out), and logs it as a run
    /// of failures.
    fn database_failed(&self, stream: &str, kind: &'static str, error: &str) {
        metrics::counter!(
            "outbox_relay_database_failures_total",
            "stream" => stream.to_owned(),
            "kind" => kind,
        )
        .increment(1);
        if let Some(repeat) = self.database.failed(error) {
            tracing::warn!(
                %error, failing_for = ?repeat,
                "the relay's database fails; it reconnects with backoff"
            );
        }
    }

    fn database_ok(&self) {
        if let Some(lasted) = self.database.ended() {
            tracing::info!(after = ?lasted, "the relay's database answers again");
        }
    }
}

/// A run of failures of one kind: when it started, when it was last logged, and the causes
/// it logged.
#[derive(Default)]
struct Streak(std::sync::Mutex<Option<Run>>);

/// [`Streak`]'s run of failures.
struct Run {
    started: std::time::Instant,
    logged: std::time::Instant,
    /// The errors logged in this run, at most [`Streak::CAUSES`].
    causes: Vec<String>,
}

impl Streak {
    /// The distinct errors a run logs as they come: past these, only its reminders (errors
    /// that vary from one failure to the next never make a line per batch).
    const CAUSES: usize = 4;

    /// Records a failure for `error`; returns how long the run has lasted when it is time to
    /// log it: the run's first failure, a failure of an error the run has not logged (up to
    /// [`CAUSES`](Self::CAUSES) of them), and a reminder every [`Health::REMIND`].
    fn failed(&self, error: &str) -> Option<Duration> {
        let now = std::time::Instant::now();
        let mut run = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(run) = &mut *run else {
            *run = Some(Run {
                started: now,
                logged: now,
                causes: vec![error.to_owned()],
            });
            return Some(Duration::ZERO);
        };
        let new_cause =
            run.causes.len() < Self::CAUSES && !run.causes.iter().any(|cause| cause == error);
        if new_cause {
            run.causes.push(error.to_owned());
        }
        if new_cause || now.duration_since(run.logged) >= Health::REMIND {
            run.logged = now;
            Some(now.duration_since(run.started))
        } else {
            None
        }
    }

    /// Records a success; returns how long the run lasted when one ended.
    fn ended(&self) -> Option<Duration> {
        let mut run = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        run.take().map(|run| run.started.elapsed())
    }
}

/// The message relay. Create it with [`Relay::connect`], then [`spawn`](Relay::spawn) it,
/// or drive it with [`run`](Relay::run) or, one batch at a time,
/// [`relay_batch`](Relay::relay_batch).
#[cfg(feature = "postgres")]
pub struct Relay {
    shared: Arc<Shared>,
    duplicate_window: Duration,
    /// The connection of [`relay_batch`](Relay::relay_batch).
    conn: Option<AsyncPgConnection>,
}

#[cfg(feature = "postgres")]
impl Relay {
    /// Checks the configuration, makes sure the stream exists and captures the prefix
    /// (creating it when [`StreamSettings::create`](crate::StreamSettings::create) allows), reads its duplicate window
    /// (warning when it is shorter than the [redelivery horizon](RelayConfig::redelivery_horizon)),
    /// and checks that the database is reachable, migrated, and that its role holds the
    /// privileges the relay needs ([`privileges`](crate::privileges)).
    ///
    /// # Errors
    /// [`RelayError::Config`], [`RelayError::Stream`], [`RelayError::Connect`] (also for a
    /// role that lacks privileges, naming each, and a database that takes no writes),
    /// [`RelayError::MissingMigrations`], [`RelayError::Database`] (a check's query failed) or
    /// [`RelayError::TimedOut`].
    pub async fn connect(
        config: RelayConfig,
        nats: async_nats::Client,
    ) -> Result<Self, RelayError> {
        database::Kind::Postgres
            .check(&config.database_url, "Relay")
            .map_err(RelayError::Config)?;
        let (shared, duplicate_window) = Shared::prepare(config, nats).await?;
        let mut conn = worker::connect(&shared).await?;
        let limit = shared.config.statement_timeout;
        // A role without a privilege the relay needs is named now, with each privilege it
        // lacks, where every batch would fail with "permission denied" for as long as the
        // relay ran.
        let lacking = database::bounded(
            limit,
            &shared.target,
            "the privileges check",
            crate::privileges::lacking(
                &mut conn,
                crate::privileges::Component::MessageRelay,
                &crate::privileges::relay_needs(Some(shared.config.published)),
            ),
        )
        .await;
        match lacking {
            Ok(None) => {}
            Ok(Some(lacking)) => {
                return Err(RelayError::Connect(ConnectError {
                    target: shared.target.clone(),
                    reason: format!("checking the relay's privileges: {lacking}"),
                }));
            }
            Err(Bounded::Failed(error)) => return Err(error.into()),
            Err(Bounded::TimedOut(timed_out)) => return Err(timed_out.into()),
        }
        let checked = database::bounded(
            limit,
            &shared.target,
            "the migrations check",
            require_migrations(&mut conn),
        )
        .await;
        match checked {
            Ok(Ok(())) => {}
            Ok(Err(missing)) => return Err(missing.into()),
            Err(Bounded::Failed(error)) => return Err(error.into()),
            Err(Bounded::TimedOut(timed_out)) => return Err(timed_out.into()),
        }
        // Reports, now, the units of work that write under another prefix than this relay
        // publishes (their rows would be dead-lettered). The relay's first write: a database
        // that takes none is named as such here.
        match shared.register_topology(&mut conn).await {
            Ok(()) => {}
            Err(Bounded::Failed(error)) => {
                return Err(RelayError::Connect(ConnectError {
                    target: shared.target.clone(),
                    reason: format!(
                        "registering the relay's topology: {error}{}",
                        database::refusal_hint(&error, database::Kind::Postgres, "relay")
                    ),
                }));
            }
            Err(Bounded::TimedOut(timed_out)) => return Err(timed_out.into()),
        }
        Ok(Self {
            shared,
            duplicate_window,
            conn: Some(conn),
        })
    }

    /// The duplicate window of the stream, as read by [`connect`](Relay::connect).
    pub fn duplicate_window(&self) -> Duration {
        self.duplicate_window
    }

    /// Runs the relay in a tokio task until [`RelayHandle::shutdown`].
    pub fn spawn(self) -> RelayHandle {
        RelayHandle(Spawned::new(|shutdown| self.run(shutdown)))
    }

    /// Publishes until `shutdown` completes, then stops gracefully: no new batch is claimed,
    /// a batch in progress publishes nothing more, waits for the acks in flight (each bounded
    /// by `ack_timeout`), marks what was acked and commits.
    ///
    /// Failures never end the relay: a broker outage or a database error pauses the worker
    /// that met it, with backoff. Dropped before it returns (a `tokio::select!` whose other
    /// branch won), it stops its tasks and closes its connections; what a batch in progress
    /// published is published again by the next relay (JetStream drops the copies inside its
    /// duplicate window).
    ///
    /// # Errors
    /// [`RelayError::Task`] when a worker panicked (a bug); the other workers are stopped
    /// gracefully first.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), RelayError> {
        let stop = CancellationToken::new();
        // Whichever way this function ends (its future dropped, a panic), the tasks it started
        // stop with it.
        let _stop_on_exit = stop.clone().drop_guard();
        let wakers: Vec<Arc<Notify>> = (0..self.shared.config.workers)
            .map(|_| Arc::new(Notify::new()))
            .collect();
        let doorbell = self
            .shared
            .config
            .listen
            .then(|| Arc::new(Doorbell::new(self.shared.config.workers)));
        let mut workers = JoinSet::new();
        let mut first_conn = self.conn;
        for (index, wake) in wakers.iter().enumerate() {
            let (shared, wake, stop) = (Arc::clone(&self.shared), Arc::clone(wake), stop.clone());
            let peers = wakers
                .iter()
                .enumerate()
                .filter(|(other, _)| *other != index)
                .map(|(_, peer)| Arc::clone(peer))
                .collect();
            let conn = first_conn.take();
            let doorbell = doorbell.clone();
            workers.spawn(async move {
                worker::run(shared, index, conn, wake, peers, doorbell, stop).await
            });
        }
        let listener = doorbell.map(|doorbell| {
            let (shared, stop) = (Arc::clone(&self.shared), stop.clone());
            tokio::spawn(async move { listener::run(&shared, wakers, &doorbell, stop).await })
        });
        let housekeeping = {
            let (shared, stop) = (Arc::clone(&self.shared), stop.clone());
            tokio::spawn(async move { keep_house(&shared, stop).await })
        };
        let gauges = (!self.shared.config.stats_interval.is_zero()).then(|| {
            let (shared, stop) = (Arc::clone(&self.shared), stop.clone());
            tokio::spawn(async move { read_stats::<AsyncPgConnection>(&shared, stop).await })
        });

        tokio::pin!(shutdown);
        let mut outcome = Ok(());
        tokio::select! {
            () = &mut shutdown => {}
            Some(joined) = workers.join_next() => {
                tracing::error!(error = ?joined.as_ref().err(), "a relay worker ended; stopping the relay");
                outcome = joined.map_err(RelayError::from);
            }
        }
        stop.cancel();
        while let Some(joined) = workers.join_next().await {
            if let Err(error) = joined {
                outcome = outcome.and(Err(error.into()));
            }
        }
        if let Some(listener) = listener {
            listener.await?;
        }
        if let Some(gauges) = gauges {
            gauges.await?;
        }
        housekeeping.await?;
        outcome
    }

    /// Claims, publishes and records one batch, in one transaction, on the relay's own
    /// connection (reopened when it was lost). For tools and tests: [`run`](Relay::run) is
    /// how a relay normally works.
    ///
    /// # Errors
    /// [`RelayError::Connect`], [`RelayError::Database`] or [`RelayError::TimedOut`]; the
    /// transaction is rolled back (or dropped with its connection), and rows published before
    /// the error are published again by a later batch (JetStream drops them as duplicates
    /// inside its window).
    pub async fn relay_batch(&mut self) -> Result<BatchReport, RelayError> {
        let conn = match &mut self.conn {
            Some(conn) => conn,
            conn => conn.insert(worker::connect(&self.shared).await?),
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
}

/// Reads the outbox's state into gauges every `stats_interval` until `stop`, on a
/// connection of its own (reopened when lost; a failure is logged at DEBUG and the gauges
/// keep their last values).
async fn read_stats<C: worker::RelayStore>(shared: &Shared, stop: CancellationToken) {
    let mut conn = None;
    let mut used = tokio::time::Instant::now();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(shared.config.stats_interval) => {}
        }
        if C::idle_too_long(shared, used) {
            conn = None;
        }
        if conn.is_none() {
            conn = C::connect(shared).await.ok();
        }
        let Some(connection) = conn.as_mut() else {
            continue;
        };
        let read = database::bounded(
            shared.config.statement_timeout,
            &shared.target,
            "the outbox's stats",
            connection.stats(),
        )
        .await;
        used = tokio::time::Instant::now();
        match read {
            Ok(stats) => {
                metrics::gauge!("outbox_queued_events").set(stats.queued as f64);
                metrics::gauge!("outbox_oldest_queued_age_seconds").set(stats.lag().as_secs_f64());
                metrics::gauge!("outbox_dead_letters").set(stats.dead_letters as f64);
                metrics::gauge!("outbox_blocked_events").set(stats.blocked as f64);
                metrics::gauge!("outbox_skipped_dead_letters")
                    .set(stats.skipped_dead_letters as f64);
            }
            Err(error) => {
                tracing::debug!(%error, "cannot read the outbox's stats");
                conn = None;
            }
        }
    }
}

/// The relay's hourly chores until `stop`: registers its topology again (the registry forgets
/// a relay unseen for a day, see [`crate::topology`]) and, under [`PublishedRows::Archive`],
/// creates `outbox_published`'s partitions two days ahead, at start too, so that a day's
/// first archived rows never wait for its partition (the archive creates a missing one
/// itself, as a last resort).
#[cfg(feature = "postgres")]
async fn keep_house(shared: &Shared, stop: CancellationToken) {
    let archive = shared.config.published == PublishedRows::Archive;
    // Registered by `connect` a moment ago; partitions are wanted at once.
    let mut register = false;
    loop {
        if register || archive {
            let chores = async {
                let mut conn = worker::connect(shared).await.map_err(|e| e.to_string())?;
                if register {
                    shared
                        .register_topology(&mut conn)
                        .await
                        .map_err(|e| format!("cannot register the relay's topology: {e}"))?;
                }
                if !archive {
                    return Ok(0);
                }
                database::bounded(
                    shared.config.statement_timeout,
                    &shared.target,
                    "creating archive partitions",
                    crate::outbox::create_archive_partitions(&mut conn, 2),
                )
                .await
                .map_err(|e| format!("cannot create archive partitions ahead: {e}"))
            };
            match chores.await {
                Ok(0) => {}
                Ok(created) => tracing::info!(created, "created archive partitions ahead"),
                Err(error) => tracing::warn!(%error, "relay housekeeping"),
            }
        }
        register = true;
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(topology::REGISTER_EVERY) => {}
        }
    }
}

/// Describes the relay's metrics (units and help texts for an exporter).
fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "outbox_relay_published_total",
        "Events published and acked, by event_type"
    );
    describe_counter!(
        "outbox_relay_duplicates_total",
        "Published events JetStream already held (republished inside the duplicate window)"
    );
    describe_counter!(
        "outbox_relay_rejected_total",
        "Events the broker rejected or that cannot be published, by kind (invalid, refused, not_an_ack, no_ack); each counts an attempt"
    );
    describe_counter!(
        "outbox_relay_dead_lettered_total",
        "Events that became dead letters"
    );
    describe_counter!(
        "outbox_relay_transport_failures_total",
        "Publishes that failed in transport, by kind (disconnected, no_responders, unavailable, no_ack); no attempt counted"
    );
    describe_counter!(
        "outbox_relay_broker_unavailable_total",
        "Times a relay worker found the NATS client disconnected (once per 100 ms while it is)"
    );
    describe_counter!(
        "outbox_relay_database_failures_total",
        "Failures of a relay worker's database, by stream and kind (connect: no connection; batch: a batch's statement failed or timed out); the worker reconnects with backoff, nothing is claimed meanwhile"
    );
    describe_counter!(
        "outbox_relay_claims_total",
        "Claims, by stream and by what they found (rows, nothing); many that find nothing while events wait mean relays contend for the same aggregates"
    );
    describe_counter!(
        "outbox_relay_notifications_total",
        "LISTEN/NOTIFY wake-ups: notifications received while this relay held the doorbell"
    );
    describe_counter!(
        "outbox_relay_doorbell_armed_total",
        "Times this relay armed the doorbell (took its advisory lock), so that units of work notify while it waits"
    );
    describe_histogram!(
        "outbox_relay_batch_seconds",
        Unit::Seconds,
        "Duration of a relay batch that claimed rows"
    );
    describe_histogram!(
        "outbox_relay_publish_delay_seconds",
        Unit::Seconds,
        "From an event's occurred_at (its transaction's start) to its JetStream ack"
    );
    describe_gauge!(
        "outbox_relay_lag_seconds",
        Unit::Seconds,
        "Age of the oldest event in the relay's last batch (0 when idle)"
    );
    describe_gauge!(
        "outbox_queued_events",
        "Events waiting to be published (parked ones included, dead letters not)"
    );
    describe_gauge!(
        "outbox_oldest_queued_age_seconds",
        Unit::Seconds,
        "The outbox lag: age of the oldest waiting event"
    );
    describe_gauge!(
        "outbox_dead_letters",
        "Dead letters that block their aggregate (as many aggregates are blocked)"
    );
    describe_gauge!(
        "outbox_blocked_events",
        "Events waiting behind a dead letter of their aggregate"
    );
    describe_gauge!(
        "outbox_skipped_dead_letters",
        "Skipped dead letters, never published, still retryable"
    );
}

/// A running relay task.
pub struct RelayHandle(Spawned<RelayError>);

impl RelayHandle {
    /// Stops the relay gracefully (see [`Relay::run`]) and waits for it.
    ///
    /// # Errors
    /// What the relay returned, or [`RelayError::Task`] when it panicked; `Ok(())` when
    /// [`stopped`](Self::stopped) has returned already.
    pub async fn shutdown(self) -> Result<(), RelayError> {
        self.0.shutdown().await
    }

    /// Waits until the relay stops without being asked to. It does only when one of its
    /// workers panicked (a bug: failures of the broker and the database are retried, never
    /// returned), after stopping the others gracefully; the rows it had not published stay
    /// queued for the next relay. A service selects on it beside its own shutdown signal, so
    /// that a relay that stopped ends the process (and its supervisor starts it again)
    /// instead of leaving the outbox to fill with nobody publishing; the `outbox relay`
    /// daemon does so and exits with status 2.
    ///
    /// Cancel-safe: dropped unfinished (a `tokio::select!` whose other branch won), it loses
    /// nothing, and the next call waits on. Once it has returned, it returns `Ok(())` at once,
    /// and so does [`shutdown`](Self::shutdown).
    ///
    /// ```no_run
    /// # async fn service(config: outbox_runtime::RelayConfig, nats: outbox_runtime::async_nats::Client)
    /// # -> Result<(), Box<dyn std::error::Error>> {
    /// let mut relay = outbox_runtime::Relay::connect(config, nats).await?.spawn();
    /// tokio::select! {
    ///     _ = tokio::signal::ctrl_c() => relay.shutdown().await?,
    ///     // A bug stopped it: end the process, for its supervisor to start it again.
    ///     stopped = relay.stopped() => return Err(format!("the relay stopped: {stopped:?}").into()),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// What the relay returned: [`RelayError::Task`] when a worker panicked, or the relay
    /// task itself did.
    pub async fn stopped(&mut self) -> Result<(), RelayError> {
        self.0.stopped().await
    }
}

/// Exponential pause after failures: 100 ms, doubling, capped.
struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);

    fn new(max: Duration) -> Self {
        Self {
            next: Self::FIRST.min(max),
            max,
        }
    }

    fn next(&mut self) -> Duration {
        let pause = self.next;
        self.next = (self.next * 2).min(self.max);
        pause
    }

    fn reset(&mut self) {
        self.next = Self::FIRST.min(self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(350));
        let pauses: Vec<_> = (0..4).map(|_| backoff.next().as_millis()).collect();
        assert_eq!(pauses, [100, 200, 350, 350]);
        backoff.reset();
        assert_eq!(backoff.next().as_millis(), 100);
    }

    #[test]
    fn a_run_of_failures_logs_its_start_and_each_new_cause_once() {
        let streak = Streak::default();
        let logged = |error: &str| streak.failed(error).is_some();
        assert!(logged("connection lost"), "the run's first failure");
        assert!(!logged("connection lost"), "the same cause again");
        assert!(logged("read-only"), "a new cause: a demoted primary, say");
        assert!(!logged("read-only") && !logged("connection lost"));
        assert!(logged("third") && logged("fourth"));
        assert!(!logged("fifth"), "past Streak::CAUSES, only the reminders");
        assert!(streak.ended().is_some() && streak.ended().is_none());
        assert!(logged("connection lost"), "a new run logs its start again");
    }

    #[test]
    fn the_redelivery_horizon_of_the_defaults_fits_jetstreams_default_window() {
        let config = RelayConfig::new("postgres://");
        assert_eq!(config.redelivery_horizon(), Duration::from_millis(65_500));
        assert!(config.redelivery_horizon() < crate::StreamSettings::default().duplicate_window);
    }

    #[test]
    fn a_duration_too_long_for_the_relay_is_refused_with_its_name() {
        type Field = fn(&mut RelayConfig) -> &mut Duration;
        let fields: [(&str, Field); 8] = [
            ("poll_interval", |c| &mut c.poll_interval),
            ("ack_timeout", |c| &mut c.ack_timeout),
            ("retry_delay", |c| &mut c.retry_delay),
            ("max_retry_delay", |c| &mut c.max_retry_delay),
            ("max_backoff", |c| &mut c.max_backoff),
            ("connect_timeout", |c| &mut c.connect_timeout),
            ("statement_timeout", |c| &mut c.statement_timeout),
            ("stats_interval", |c| &mut c.stats_interval),
        ];
        for (name, field) in fields {
            let mut config = RelayConfig::new("postgres://");
            // A cap that lets the first retry's delay be this long.
            config.max_retry_delay = MAX_DURATION;
            *field(&mut config) = MAX_DURATION;
            assert!(config.validate().is_ok(), "{name} at the bound");
            // Every sum the relay makes of its durations holds at the bound.
            let _ = config.redelivery_horizon();
            for value in [MAX_DURATION + Duration::from_millis(1), Duration::MAX] {
                *field(&mut config) = value;
                match config.validate() {
                    Err(RelayError::Config(message)) => assert!(
                        message.starts_with(&format!("{name} {value:?} is longer")),
                        "{message}"
                    ),
                    other => panic!("{name} = {value:?}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn an_interval_that_would_loop_without_a_pause_is_refused_with_its_name() {
        type Field = fn(&mut RelayConfig) -> &mut Duration;
        let fields: [(&str, Field); 3] = [
            ("poll_interval", |c| &mut c.poll_interval),
            ("max_backoff", |c| &mut c.max_backoff),
            ("stats_interval", |c| &mut c.stats_interval),
        ];
        for (name, field) in fields {
            let mut config = RelayConfig::new("postgres://");
            *field(&mut config) = MIN_INTERVAL;
            assert!(config.validate().is_ok(), "{name} at the bound");
            for value in [
                MIN_INTERVAL - Duration::from_nanos(1),
                Duration::from_nanos(1),
            ] {
                *field(&mut config) = value;
                match config.validate() {
                    Err(RelayError::Config(message)) => assert_eq!(
                        message,
                        format!(
                            "{name} must be at least 1ms, not {value:?}: a shorter one repeats \
                             its loop without a pause"
                        )
                    ),
                    other => panic!("{name} = {value:?}: {other:?}"),
                }
            }
        }
        // Zero: the gauges off, the others refused, by name.
        for (name, field) in fields {
            let mut config = RelayConfig::new("postgres://");
            *field(&mut config) = Duration::ZERO;
            match (name, config.validate()) {
                ("stats_interval", Ok(())) => {}
                (_, Err(RelayError::Config(message)))
                    if message.starts_with(&format!("{name} must be at least 1ms, not 0ns")) => {}
                (_, other) => panic!("{name} = 0: {other:?}"),
            }
        }
    }

    #[test]
    fn stream_durations_longer_than_jetstream_carries_are_refused_with_their_name() {
        let longest = Duration::from_nanos(i64::MAX.unsigned_abs());
        type Field = fn(&mut crate::StreamSettings) -> &mut Duration;
        let fields: [(&str, Field); 2] = [
            ("topology.stream.duplicate_window", |s| {
                &mut s.duplicate_window
            }),
            ("topology.stream.max_age", |s| &mut s.max_age),
        ];
        for (name, field) in fields {
            let mut config = RelayConfig::new("postgres://");
            *field(&mut config.topology.stream) = longest;
            assert!(config.validate().is_ok(), "{name} at the bound");
            *field(&mut config.topology.stream) = longest + Duration::from_nanos(1);
            match config.validate() {
                Err(RelayError::Config(message)) => {
                    assert!(message.starts_with(&format!("{name} ")), "{message}");
                }
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    /// Windows nats-server would replace (a zero duplicate window) or refuse (a max age under
    /// 100 ms, a duplicate window over the max age) are refused by name before it is asked.
    #[test]
    fn stream_windows_nats_server_would_replace_or_refuse_are_refused_by_name() {
        let refused = |duplicate_window: u64, max_age: u64| {
            let mut config = RelayConfig::new("postgres://");
            config.topology.stream.duplicate_window = Duration::from_millis(duplicate_window);
            config.topology.stream.max_age = Duration::from_millis(max_age);
            match config.validate() {
                Err(RelayError::Config(message)) => Some(message),
                Ok(()) => None,
                Err(other) => panic!("{other:?}"),
            }
        };
        let message = refused(0, 0).unwrap();
        assert!(
            message.starts_with("topology.stream.duplicate_window 0ns "),
            "{message}"
        );
        let message = refused(50, 99).unwrap();
        assert!(
            message.starts_with("topology.stream.max_age 99ms is shorter"),
            "{message}"
        );
        let message = refused(120_000, 60_000).unwrap();
        assert!(
            message.starts_with(
                "topology.stream.duplicate_window 120s is longer than \
                 max_age 60s"
            ),
            "{message}"
        );
        // Taken: a window within the age, at the least age, or with no age limit.
        for (duplicate_window, max_age) in [(100, 100), (1, 0), (120_000, 120_000)] {
            assert_eq!(refused(duplicate_window, max_age), None);
        }
    }

    /// Stream names nats-server refuses are refused by name, with the rule they break (an
    /// empty one was "empty name cannot be empty", from async-nats, after connecting).
    #[test]
    fn stream_names_nats_server_refuses_are_refused_with_the_rule() {
        let checked = |name: &str| {
            let mut config = RelayConfig::new("postgres://");
            config.topology.stream.name = name.to_owned();
            config.validate().err().map(|error| error.to_string())
        };
        for (name, says) in [
            ("", "\"\" is not a JetStream stream name: it is empty"),
            ("EV.ENTS", "it contains '.', the NATS token separator"),
            ("EV ENTS", "it contains whitespace (' ')"),
            ("EVENTS>", "it contains the NATS wildcard '>'"),
            ("EV/ENTS", "it contains the path separator '/'"),
            ("EV\\ENTS", "it contains the path separator '\\\\'"),
        ] {
            let error = checked(name).unwrap_or_else(|| panic!("{name:?} was taken"));
            assert!(
                error.starts_with("relay configuration: topology.stream.name ")
                    && error.ends_with(says),
                "{name:?}: {error}"
            );
        }
        assert_eq!(
            checked(&"E".repeat(300)),
            Some(format!(
                "relay configuration: topology.stream.name \"{}...\" is not a JetStream \
                 stream name: it is 300 bytes long, over nats-server's limit of 255",
                "E".repeat(64)
            ))
        );
        for name in ["EVENTS", "orders-events_2", "ÉVÉNEMENTS", &"E".repeat(255)] {
            assert_eq!(checked(name), None, "{name}");
        }
    }

    #[test]
    fn stream_replicas_and_max_bytes_nats_server_would_change_are_refused() {
        let refused = |set: fn(&mut crate::StreamSettings)| {
            let mut config = RelayConfig::new("postgres://");
            set(&mut config.topology.stream);
            match config.validate() {
                Err(RelayError::Config(message)) => message,
                other => panic!("{other:?}"),
            }
        };
        assert!(refused(|s| s.replicas = 0).starts_with("topology.stream.replicas 0 "));
        assert!(refused(|s| s.replicas = 6).starts_with("topology.stream.replicas 6 "));
        assert!(refused(|s| s.max_bytes = 0).starts_with("topology.stream.max_bytes 0 "));
        assert!(refused(|s| s.max_bytes = -7).starts_with("topology.stream.max_bytes -7 "));
        for (replicas, max_bytes) in [(1, -1), (3, 1), (5, i64::MAX)] {
            let mut config = RelayConfig::new("postgres://");
            config.topology.stream.replicas = replicas;
            config.topology.stream.max_bytes = max_bytes;
            assert!(
                config.validate().is_ok(),
                "{replicas} replicas, {max_bytes} bytes"
            );
        }
    }

    #[test]
    fn a_jetstream_domain_that_is_not_one_subject_token_is_refused() {
        let checked = |domain: &str| {
            let mut config = RelayConfig::new("postgres://");
            config.topology.stream.domain = Some(domain.to_owned());
            config.validate().err().map(|error| error.to_string())
        };
        for (domain, says) in [
            ("", "it is empty"),
            ("hub.east", "it contains '.', the NATS token separator"),
            ("hub east", "it contains whitespace (' ')"),
            ("hub*", "it contains the NATS wildcard '*'"),
            ("hub>", "it contains the NATS wildcard '>'"),
        ] {
            assert_eq!(
                checked(domain),
                Some(format!(
                    "relay configuration: topology.stream.domain {domain:?} is not a JetStream \
                     domain: {says}"
                )),
            );
        }
        for domain in ["hub", "edge-1", "Ürümqi_2"] {
            assert_eq!(checked(domain), None, "{domain}");
        }
    }

    #[test]
    fn more_acks_in_flight_than_a_semaphore_holds_are_refused() {
        let mut config = RelayConfig::new("postgres://");
        config.max_in_flight = tokio::sync::Semaphore::MAX_PERMITS;
        assert!(config.validate().is_ok());
        config.max_in_flight = usize::MAX;
        match config.validate() {
            Err(RelayError::Config(message)) => {
                assert!(message.starts_with("max_in_flight "), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_debug_form_hides_the_database_password() {
        let config = RelayConfig::new("postgres://relay:s3cret@db.internal:5433/orders");
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(
            shown.contains("postgres://relay@db.internal:5433/orders"),
            "{shown}"
        );
    }

    #[test]
    fn more_workers_than_a_relay_runs_are_refused_with_the_bound() {
        let mut config = RelayConfig::new("postgres://");
        config.workers = MAX_WORKERS;
        assert!(config.validate().is_ok(), "workers at the bound");
        for workers in [MAX_WORKERS + 1, 2_000, usize::MAX] {
            config.workers = workers;
            match config.validate() {
                Err(RelayError::Config(message)) => assert_eq!(
                    message,
                    format!(
                        "workers {workers} is more than a relay runs (64): each holds a \
                         database connection, and a relay's workers claim in turn"
                    )
                ),
                other => panic!("workers = {workers}: {other:?}"),
            }
        }
    }

    /// A first delay over the cap was silently replaced by the cap.
    #[test]
    fn a_retry_delay_longer_than_its_cap_is_refused_naming_both() {
        let mut config = RelayConfig::new("postgres://");
        config.retry_delay = config.max_retry_delay;
        assert!(config.validate().is_ok(), "retry_delay at its cap");
        config.retry_delay = Duration::from_secs(2 * 3600);
        config.max_retry_delay = Duration::from_secs(1);
        match config.validate() {
            Err(RelayError::Config(message)) => assert_eq!(
                message,
                "retry_delay 7200s is longer than max_retry_delay 1s, which caps every retry's \
                 delay: raise max_retry_delay or shorten retry_delay"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn zero_sizes_are_refused_by_name() {
        let mut config = RelayConfig::new("postgres://");
        config.max_in_flight = 0;
        let error = config.validate().unwrap_err();
        assert_eq!(
            error.to_string(),
            "relay configuration: max_in_flight must be at least 1"
        );
    }
}
