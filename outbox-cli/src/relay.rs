//! `outbox relay`: the message relay as a daemon.
//!
//! Every `RelayConfig` setting is a flag and an `OUTBOX_*` variable, with the library's
//! default. The process runs one relay (several processes on one outbox share the work, as
//! replicas), optionally serves Prometheus metrics, optionally deletes published rows on a
//! schedule, and on SIGTERM or SIGINT stops gracefully: no new claim, the acks in flight
//! awaited, what was acked marked, then exit 0; a relay that cannot stop within
//! `--shutdown-timeout` exits 1.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, ValueEnum};
use humantime::Duration as Span;
use outbox_runtime::database::Kind;
use outbox_runtime::publisher::StorageType;
use outbox_runtime::{
    DeadLetterPolicy, PublishedRows, Relay, RelayConfig, RelayHandle, StreamSettings, SubjectPrefix,
};
use tokio::signal::unix::{SignalKind, signal};

use crate::nats::NatsArgs;
use crate::{Ended, LogArgs};

/// The shortest `--purge-interval`.
const MIN_PURGE_INTERVAL: Duration = Duration::from_secs(1);

fn defaults() -> RelayConfig {
    RelayConfig::new("")
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Published {
    /// Delete acked rows (the table holds only what is queued).
    Delete,
    /// Keep acked rows with `published_at` (purge them with --purge-older-than or `outbox
    /// purge`).
    Mark,
    /// Move acked rows to `outbox_published` (on PostgreSQL in daily partitions, UTC, that
    /// --purge-older-than or `outbox purge` drop whole; on MySQL and SQLite they delete its
    /// old rows in batches).
    Archive,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Storage {
    /// On disk: survives a server restart.
    File,
    /// In memory only.
    Memory,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum DeadLetters {
    /// Later events of the aggregate wait behind a dead letter.
    Block,
    /// A dead letter is skipped at once; later events flow.
    Skip,
}

#[derive(Debug, Args)]
pub(crate) struct RelayArgs {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    log: LogArgs,
    /// The subject prefix; the stream captures `{prefix}.>`.
    #[arg(long, env = "OUTBOX_SUBJECT_PREFIX", default_value_t = defaults().topology.subject_prefix)]
    subject_prefix: SubjectPrefix,
    /// The JetStream stream.
    #[arg(long, env = "OUTBOX_STREAM", default_value_t = defaults().topology.stream.name)]
    stream: String,
    /// The JetStream domain of the stream, when it is not the connected server's: the hub's,
    /// for a relay connected to a leaf node.
    #[arg(long, env = "OUTBOX_JETSTREAM_DOMAIN")]
    jetstream_domain: Option<String>,
    /// Fail when the stream does not exist, instead of creating it.
    #[arg(long, env = "OUTBOX_NO_CREATE_STREAM")]
    no_create_stream: bool,
    /// The stream's duplicate window (set on a stream the relay creates; a difference with
    /// an existing stream is logged).
    #[arg(long, env = "OUTBOX_DUPLICATE_WINDOW", default_value_t = defaults().topology.stream.duplicate_window.into())]
    duplicate_window: Span,
    /// The stream's replicas in a cluster (1 to 5).
    #[arg(long, env = "OUTBOX_STREAM_REPLICAS", default_value_t = defaults().topology.stream.replicas)]
    stream_replicas: usize,
    /// The stream's storage.
    #[arg(long, env = "OUTBOX_STREAM_STORAGE", value_enum, default_value_t = Storage::File)]
    stream_storage: Storage,
    /// How long the stream keeps a message (0s: until a limit removes it).
    #[arg(long, env = "OUTBOX_STREAM_MAX_AGE", default_value_t = defaults().topology.stream.max_age.into())]
    stream_max_age: Span,
    /// The most bytes the stream holds (-1: no limit).
    #[arg(long, env = "OUTBOX_STREAM_MAX_BYTES", default_value_t = defaults().topology.stream.max_bytes, allow_hyphen_values = true)]
    stream_max_bytes: i64,
    /// The messages' `ce-source` (a URI-reference naming the producing service).
    #[arg(long, env = "OUTBOX_SOURCE", default_value_t = defaults().source)]
    source: String,
    /// Batch loops, each with its own database connection: 1 to 64.
    #[arg(long, env = "OUTBOX_WORKERS", default_value_t = defaults().workers)]
    workers: usize,
    /// Rows claimed per batch.
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = defaults().batch_size)]
    batch_size: usize,
    /// Publishes awaiting their ack at once.
    #[arg(long, env = "OUTBOX_MAX_IN_FLIGHT", default_value_t = defaults().max_in_flight)]
    max_in_flight: usize,
    /// Do not LISTEN for commits; only poll.
    #[arg(long, env = "OUTBOX_NO_LISTEN")]
    no_listen: bool,
    /// How long an idle worker waits before it looks again.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value_t = defaults().poll_interval.into())]
    poll_interval: Span,
    /// How long to wait for a JetStream ack.
    #[arg(long, env = "OUTBOX_ACK_TIMEOUT", default_value_t = defaults().ack_timeout.into())]
    ack_timeout: Span,
    /// What becomes of an acked row.
    #[arg(long, env = "OUTBOX_PUBLISHED", value_enum, default_value = "delete")]
    published: Published,
    /// Rejections before a row becomes a dead letter.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value_t = defaults().max_attempts)]
    max_attempts: u32,
    /// The delay before a rejected row's first retry (doubling).
    #[arg(long, env = "OUTBOX_RETRY_DELAY", default_value_t = defaults().retry_delay.into())]
    retry_delay: Span,
    /// The longest delay between retries of a rejected row.
    #[arg(long, env = "OUTBOX_MAX_RETRY_DELAY", default_value_t = defaults().max_retry_delay.into())]
    max_retry_delay: Span,
    /// What a dead letter does to the later events of its aggregate.
    #[arg(long, env = "OUTBOX_DEAD_LETTERS", value_enum, default_value = "block")]
    dead_letters: DeadLetters,
    /// The longest pause after a failure.
    #[arg(long, env = "OUTBOX_MAX_BACKOFF", default_value_t = defaults().max_backoff.into())]
    max_backoff: Span,
    /// How long opening a database connection may take.
    #[arg(long, env = "OUTBOX_CONNECT_TIMEOUT", default_value_t = defaults().connect_timeout.into())]
    connect_timeout: Span,
    /// How long one query may take.
    #[arg(long, env = "OUTBOX_STATEMENT_TIMEOUT", default_value_t = defaults().statement_timeout.into())]
    statement_timeout: Span,
    /// How often the outbox's state is read into the gauges (0s: never).
    #[arg(long, env = "OUTBOX_STATS_INTERVAL", default_value_t = defaults().stats_interval.into())]
    stats_interval: Span,
    /// Serve Prometheus metrics at this address (e.g. 0.0.0.0:9464), path /metrics.
    #[arg(long, env = "OUTBOX_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Delete published and archived rows older than this, in batches (on PostgreSQL drop
    /// the archive's days that ended longer ago than this), every --purge-interval (with
    /// --published mark or archive).
    #[arg(long, env = "OUTBOX_PURGE_OLDER_THAN")]
    purge_older_than: Option<Span>,
    /// How often the relay purges; at least 1s.
    #[arg(long, env = "OUTBOX_PURGE_INTERVAL", default_value = "1m")]
    purge_interval: Span,
    /// The longest graceful stop after SIGTERM or SIGINT.
    #[arg(long, env = "OUTBOX_SHUTDOWN_TIMEOUT", default_value = "30s")]
    shutdown_timeout: Span,
}

impl RelayArgs {
    fn config(&self, database_url: &str) -> RelayConfig {
        let mut config = RelayConfig::new(database_url);
        config.topology.subject_prefix = self.subject_prefix.clone();
        config.topology.stream = StreamSettings {
            name: self.stream.clone(),
            create: !self.no_create_stream,
            duplicate_window: self.duplicate_window.into(),
            replicas: self.stream_replicas,
            storage: match self.stream_storage {
                Storage::File => StorageType::File,
                Storage::Memory => StorageType::Memory,
            },
            max_age: self.stream_max_age.into(),
            max_bytes: self.stream_max_bytes,
            domain: self.jetstream_domain.clone(),
        };
        config.source = self.source.clone();
        config.workers = self.workers;
        config.batch_size = self.batch_size;
        config.max_in_flight = self.max_in_flight;
        config.listen = !self.no_listen;
        config.poll_interval = self.poll_interval.into();
        config.ack_timeout = self.ack_timeout.into();
        config.published = match self.published {
            Published::Delete => PublishedRows::Delete,
            Published::Mark => PublishedRows::Mark,
            Published::Archive => PublishedRows::Archive,
        };
        config.max_attempts = self.max_attempts;
        config.retry_delay = self.retry_delay.into();
        config.max_retry_delay = self.max_retry_delay.into();
        config.dead_letters = match self.dead_letters {
            DeadLetters::Block => DeadLetterPolicy::Block,
            DeadLetters::Skip => DeadLetterPolicy::Skip,
        };
        config.max_backoff = self.max_backoff.into();
        config.connect_timeout = self.connect_timeout.into();
        config.statement_timeout = self.statement_timeout.into();
        config.stats_interval = self.stats_interval.into();
        config
    }
}

pub(crate) async fn run(database_url: &str, args: RelayArgs) -> Result<Ended, String> {
    args.log.install()?;
    // Each purge opens a connection of its own: more often than once a second is a
    // connection storm, and zero a loop without a pause.
    if args.purge_older_than.is_some() && *args.purge_interval < MIN_PURGE_INTERVAL {
        return Err(format!(
            "--purge-interval must be at least {MIN_PURGE_INTERVAL:?}, not {}",
            args.purge_interval
        ));
    }
    if let Some(address) = args.metrics_addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(address)
            // Histograms as buckets (a Grafana heatmap, histogram_quantile over replicas),
            // from 1 ms to 5 min.
            .set_buckets(&[
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 300.0,
            ])
            .map_err(|e| e.to_string())?
            .install()
            .map_err(|e| format!("cannot serve metrics at {address}: {e}"))?;
        tracing::info!(%address, "serving Prometheus metrics at /metrics");
    }
    let mut terminate = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    let config = args.config(database_url);
    let kind = Kind::of(database_url);
    check(kind, &config)?;
    let nats = args.nats.connect("outbox-relay").await?;
    let mut relay = connect(kind, config.clone(), nats).await?;
    tracing::info!(
        database = %outbox_runtime::database::redacted(database_url),
        stream = %config.topology.stream.name,
        prefix = %config.topology.subject_prefix,
        workers = config.workers,
        "relaying"
    );
    let purging = args.purge_older_than.map(|older_than| {
        tokio::spawn(purge_on_schedule(
            database_url.to_owned(),
            older_than.into(),
            args.purge_interval.into(),
        ))
    });

    let signalled = tokio::select! {
        _ = terminate.recv() => Ok("SIGTERM"),
        _ = interrupt.recv() => Ok("SIGINT"),
        stopped = relay.stopped() => Err(stopped.err()),
    };
    if let Some(purging) = purging {
        purging.abort();
    }
    let which = match signalled {
        Ok(which) => which,
        Err(error) => {
            // A worker panicked (a bug): exit, so that a supervisor starts the relay again,
            // rather than stay up with nothing published.
            let why = error.map_or_else(String::new, |error| format!(": {error}"));
            tracing::error!("the relay stopped by itself{why}; exiting");
            return Err(format!("the relay stopped by itself{why}"));
        }
    };
    let limit: Duration = args.shutdown_timeout.into();
    tracing::info!(signal = which, timeout = ?limit, "stopping gracefully");
    match tokio::time::timeout(limit, relay.shutdown()).await {
        Ok(Ok(())) => {
            tracing::info!("stopped");
            Ok(Ended::Done)
        }
        Ok(Err(error)) => Err(format!("the relay failed while stopping: {error}")),
        Err(_) => {
            tracing::error!(timeout = ?limit, "the relay did not stop in time");
            Ok(Ended::Unhealthy)
        }
    }
}

/// Refuses, before anything is connected, what the relay would refuse once connected: its
/// configuration, a database this build does not relay, a SQLite file that is not there.
/// So the setting at fault is named whether or not NATS and the database are up.
fn check(kind: Kind, config: &RelayConfig) -> Result<(), String> {
    config.validate().map_err(|e| e.to_string())?;
    match kind {
        Kind::Postgres => Ok(()),
        #[cfg(feature = "mysql")]
        Kind::Mysql => Ok(()),
        #[cfg(not(feature = "mysql"))]
        Kind::Mysql => Err(built_without("mysql")),
        #[cfg(feature = "sqlite")]
        Kind::Sqlite => crate::operate::sqlite_file_exists(&config.database_url),
        #[cfg(not(feature = "sqlite"))]
        Kind::Sqlite => Err(built_without("sqlite")),
    }
}

/// The relay of the database `kind`, connected and running (after [`check`]).
async fn connect(
    kind: Kind,
    config: RelayConfig,
    nats: async_nats::Client,
) -> Result<RelayHandle, String> {
    match kind {
        Kind::Postgres => Ok(Relay::connect(config, nats)
            .await
            .map_err(|e| e.to_string())?
            .spawn()),
        #[cfg(feature = "mysql")]
        Kind::Mysql => Ok(outbox_runtime::mysql::MysqlRelay::connect(config, nats)
            .await
            .map_err(|e| e.to_string())?
            .spawn()),
        #[cfg(not(feature = "mysql"))]
        Kind::Mysql => Err(built_without("mysql")),
        #[cfg(feature = "sqlite")]
        Kind::Sqlite => Ok(outbox_runtime::sqlite::SqliteRelay::connect(config, nats)
            .await
            .map_err(|e| e.to_string())?
            .spawn()),
        #[cfg(not(feature = "sqlite"))]
        Kind::Sqlite => Err(built_without("sqlite")),
    }
}

/// The error for a database this build does not relay.
#[cfg_attr(all(feature = "mysql", feature = "sqlite"), allow(dead_code))]
fn built_without(feature: &str) -> String {
    format!(
        "DATABASE_URL names a database this build of outbox does not relay: build it with \
         `--features {feature}` (cargo install outbox-cli --features {feature})"
    )
}

/// Deletes published rows older than `older_than` every `interval`, in batches of 10,000,
/// and the archive's (on PostgreSQL its partitions whose day ended longer ago), until
/// aborted.
async fn purge_on_schedule(database_url: String, older_than: Duration, interval: Duration) {
    use crate::operate::{ArchivePurged, Operator, on_operator};
    const BATCH: i64 = 10_000;
    loop {
        tokio::time::sleep(interval).await;
        let Ok(mut operator) = Operator::connect(&database_url).await else {
            tracing::warn!("retention cannot connect to the database; trying again later");
            continue;
        };
        let purged = on_operator!(&mut operator, conn => {
            outbox_runtime::outbox::purge_published(conn, older_than, BATCH, |_| {}).await
        });
        match purged {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(deleted, ?older_than, "deleted published rows"),
            Err(error) => tracing::warn!(%error, "retention failed"),
        }
        match operator.purge_archive(older_than, BATCH, |_| {}).await {
            Ok(ArchivePurged::Partitions(partitions)) => {
                for (partition, rows) in partitions {
                    tracing::info!(%partition, rows, "dropped an archive partition");
                }
            }
            Ok(ArchivePurged::Rows(0)) => {}
            Ok(ArchivePurged::Rows(deleted)) => {
                tracing::info!(deleted, ?older_than, "deleted archived rows");
            }
            Err(error) => {
                let error = crate::operate::archive_error(error);
                tracing::warn!(%error, "the archive's retention failed");
            }
        }
    }
}
