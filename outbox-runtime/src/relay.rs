//! The message relay: a polling publisher that moves committed outbox rows to JetStream.
//!
//! Each batch is one database transaction: claim pending rows (see
//! [`claim_batch`](crate::outbox::queries::claim_batch) for the locking and ordering
//! guarantee), publish them with their JetStream acks awaited, mark the acked rows published,
//! commit. Rows of different aggregates are published concurrently; rows of one aggregate one
//! after another, each after the previous one's ack, so a failure stops that aggregate's chain
//! before a later event can overtake it.
//!
//! Delivery is at-least-once: a relay that dies after a publish and before its commit leaves
//! the row pending, and the next claim publishes it again with the same `Nats-Msg-Id`, which
//! JetStream drops inside the stream's duplicate window.

use std::future::Future;
use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::outbox::DEFAULT_SUBJECT_PREFIX;
use crate::outbox::queries::{self, ClaimedEvent};
use crate::publisher::{
    InvalidSource, PublishFailure, Publisher, StreamError, StreamSettings, ensure_stream,
};
use crate::subject::{InvalidSubjectPrefix, validate_prefix};

/// How the relay runs. A plain struct with documented defaults; start from
/// [`RelayConfig::new`].
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// The PostgreSQL URL of the database holding the outbox table.
    pub database_url: String,
    /// The subject prefix of the outbox's events; the stream must capture `{prefix}.>`.
    /// Default [`DEFAULT_SUBJECT_PREFIX`].
    pub subject_prefix: String,
    /// The stream the relay publishes to.
    pub stream: StreamSettings,
    /// The `ce-source` of every message: a URI-reference naming the producing service
    /// (CloudEvents 1.0, section 3.1.1, `source`). Default `/outbox`.
    pub source: String,
    /// The most rows claimed and published per batch (one transaction). Default 500.
    pub batch_size: usize,
    /// How long the relay sleeps when it found nothing to publish. Default 500 ms.
    pub poll_interval: Duration,
    /// How long to wait for a JetStream ack before the publish counts as a transport
    /// failure. Default 5 s, async-nats's own default.
    pub ack_timeout: Duration,
    /// The delay before a rejected row is claimed again. Default 1 s.
    pub retry_delay: Duration,
    /// The longest pause after a transport failure or a database error; pauses start at
    /// 100 ms and double up to this. Default 30 s.
    pub max_backoff: Duration,
}

impl RelayConfig {
    /// The defaults, for the database at `database_url`.
    pub fn new(database_url: impl Into<String>) -> Self {
        Self {
            database_url: database_url.into(),
            subject_prefix: DEFAULT_SUBJECT_PREFIX.to_owned(),
            stream: StreamSettings::default(),
            source: "/outbox".to_owned(),
            batch_size: 500,
            poll_interval: Duration::from_millis(500),
            ack_timeout: Duration::from_secs(5),
            retry_delay: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
        }
    }
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
    /// No connection to the database.
    #[error("relay cannot connect to the database: {0}")]
    Connect(#[from] diesel::ConnectionError),
    /// A query failed.
    #[error("relay database error: {0}")]
    Database(#[from] diesel::result::Error),
    /// The relay task panicked or was aborted.
    #[error("relay task did not finish: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl From<InvalidSubjectPrefix> for RelayError {
    fn from(error: InvalidSubjectPrefix) -> Self {
        Self::Config(error.to_string())
    }
}

impl From<InvalidSource> for RelayError {
    fn from(error: InvalidSource) -> Self {
        Self::Config(error.to_string())
    }
}

/// What one batch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Rows claimed (heads and the rows queued behind them, within `batch_size`).
    pub claimed: usize,
    /// Rows published and marked.
    pub published: usize,
    /// Rows the broker rejected; each counted an attempt.
    pub rejected: usize,
    /// Rows not published because the broker could not be reached; no attempt counted.
    pub transport_failures: usize,
}

/// The message relay. Create it with [`Relay::connect`], then [`spawn`](Relay::spawn) it
/// or drive it with [`run`](Relay::run) or [`relay_batch`](Relay::relay_batch).
pub struct Relay {
    config: RelayConfig,
    publisher: Publisher,
    conn: Option<AsyncPgConnection>,
}

impl Relay {
    /// Checks the configuration, makes sure the stream exists (creating it when
    /// [`StreamSettings::create`] allows), and connects to the database.
    ///
    /// # Errors
    /// [`RelayError::Config`], [`RelayError::Stream`] or [`RelayError::Connect`].
    pub async fn connect(
        config: RelayConfig,
        nats: async_nats::Client,
    ) -> Result<Self, RelayError> {
        validate_prefix(&config.subject_prefix)?;
        if config.batch_size == 0 {
            return Err(RelayError::Config(
                "batch_size must be at least 1".to_owned(),
            ));
        }
        let publisher = Publisher::new(nats, &config.source, config.ack_timeout)?;
        ensure_stream(
            publisher.jetstream(),
            &config.stream,
            &config.subject_prefix,
        )
        .await?;
        let conn = AsyncPgConnection::establish(&config.database_url).await?;
        Ok(Self {
            config,
            publisher,
            conn: Some(conn),
        })
    }

    /// Runs the relay in a tokio task until [`RelayHandle::shutdown`].
    pub fn spawn(self) -> RelayHandle {
        let shutdown = CancellationToken::new();
        let signal = shutdown.clone();
        let task = tokio::spawn(async move { self.run(signal.cancelled_owned()).await });
        RelayHandle { shutdown, task }
    }

    /// Publishes batches until `shutdown` completes. A batch in progress is finished first;
    /// a database or broker failure pauses the loop (with backoff) and never ends it.
    ///
    /// # Errors
    /// None today: every failure is logged and retried. The `Result` is kept so a fatal
    /// condition can be reported without a breaking change.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> Result<(), RelayError> {
        tokio::pin!(shutdown);
        let mut backoff = Backoff::new(self.config.max_backoff);
        loop {
            let pause = match self.relay_batch().await {
                Ok(report) if report.transport_failures > 0 => backoff.next(),
                Ok(report) => {
                    backoff.reset();
                    if report.claimed == 0 {
                        self.config.poll_interval
                    } else {
                        Duration::ZERO
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "relay batch failed; reconnecting after a pause");
                    self.conn = None;
                    backoff.next()
                }
            };
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Claims, publishes and marks one batch, in one transaction.
    ///
    /// # Errors
    /// [`RelayError::Connect`] or [`RelayError::Database`]; the transaction is rolled back,
    /// and rows published before the error are published again by a later batch (JetStream
    /// drops them as duplicates inside its window).
    pub async fn relay_batch(&mut self) -> Result<BatchReport, RelayError> {
        if self.conn.is_none() {
            self.conn = Some(AsyncPgConnection::establish(&self.config.database_url).await?);
        }
        let conn = self.conn.as_mut().expect("connected above");
        let publisher = &self.publisher;
        let config = &self.config;
        let batch_size = i64::try_from(config.batch_size).unwrap_or(i64::MAX);
        let report = conn
            .transaction::<_, diesel::result::Error, _>(async |conn| {
                let claimed = queries::claim_batch(conn, batch_size, batch_size).await?;
                let chains = chains(&claimed, config.batch_size);
                let outcomes = futures::future::join_all(
                    chains.iter().map(|chain| publish_chain(publisher, chain)),
                )
                .await;
                let mut report = BatchReport {
                    claimed: chains.iter().map(|c| c.len()).sum(),
                    ..BatchReport::default()
                };
                let mut published: Vec<Uuid> = Vec::with_capacity(report.claimed);
                for outcome in outcomes {
                    published.extend(outcome.published);
                    match outcome.failure {
                        Some((row, PublishFailure::Rejected(error))) => {
                            report.rejected += 1;
                            tracing::warn!(id = %row.id, subject = %row.subject, %error, "broker rejected an event");
                            let retry_ms = millis(config.retry_delay);
                            queries::record_rejection(conn, row.id, &error, retry_ms).await?;
                        }
                        Some((row, PublishFailure::Transport(error))) => {
                            report.transport_failures += 1;
                            tracing::debug!(id = %row.id, %error, "publish failed in transport");
                        }
                        None => {}
                    }
                }
                report.published = published.len();
                if !published.is_empty() {
                    queries::mark_published(conn, &published).await?;
                }
                Ok(report)
            })
            .await?;
        if report.claimed > 0 {
            tracing::debug!(?report, "relay batch");
        }
        Ok(report)
    }
}

/// A running relay task.
pub struct RelayHandle {
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), RelayError>>,
}

impl RelayHandle {
    /// Signals the relay to stop after its current batch and waits for it.
    ///
    /// # Errors
    /// What the relay returned, or [`RelayError::Task`] when it panicked.
    pub async fn shutdown(self) -> Result<(), RelayError> {
        self.shutdown.cancel();
        self.task.await?
    }
}

/// The claimed rows of one aggregate, in sequence order.
type Chain<'a> = &'a [ClaimedEvent];

/// Splits claimed rows (grouped by aggregate, heads first in claim order) into one chain per
/// aggregate, within a budget of `batch_size` rows: every head first, then the rows behind
/// the heads in claim order. A chain stops before a row that is not yet available.
fn chains(rows: &[ClaimedEvent], batch_size: usize) -> Vec<Chain<'_>> {
    let mut chains: Vec<Chain<'_>> = rows
        .chunk_by(|a, b| a.aggregate_type == b.aggregate_type && a.aggregate_id == b.aggregate_id)
        .map(|chain| {
            let available = chain.iter().take_while(|row| row.available).count();
            &chain[..available]
        })
        .filter(|chain| !chain.is_empty())
        .collect();
    chains.truncate(batch_size);
    let mut budget = batch_size - chains.len();
    for chain in &mut chains {
        let extra = (chain.len() - 1).min(budget);
        budget -= extra;
        *chain = &chain[..=extra];
    }
    chains
}

struct ChainOutcome<'a> {
    published: Vec<Uuid>,
    failure: Option<(&'a ClaimedEvent, PublishFailure)>,
}

/// Publishes one aggregate's rows in order, each after the previous one's ack; stops at the
/// first failure so no later event overtakes it.
async fn publish_chain<'a>(publisher: &Publisher, chain: Chain<'a>) -> ChainOutcome<'a> {
    let mut published = Vec::with_capacity(chain.len());
    for row in chain {
        if let Err(failure) = publisher.publish(row).await {
            return ChainOutcome {
                published,
                failure: Some((row, failure)),
            };
        }
        published.push(row.id);
    }
    ChainOutcome {
        published,
        failure: None,
    }
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
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
            next: Self::FIRST,
            max,
        }
    }

    fn next(&mut self) -> Duration {
        let pause = self.next.min(self.max);
        self.next = (self.next * 2).min(self.max);
        pause
    }

    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(aggregate: &str, seq: i64, available: bool) -> ClaimedEvent {
        ClaimedEvent {
            id: Uuid::now_v7(),
            aggregate_type: "Order".into(),
            aggregate_id: aggregate.into(),
            aggregate_seq: seq,
            event_type: "Placed".into(),
            event_version: 1,
            partition_key: aggregate.into(),
            subject: format!("events.Order.{aggregate}.Placed"),
            payload: queries::JsonText(b"{}".to_vec()),
            headers: serde_json::json!({}),
            occurred_at: time::OffsetDateTime::UNIX_EPOCH,
            available,
        }
    }

    fn shape(chains: &[Chain<'_>]) -> Vec<(String, Vec<i64>)> {
        chains
            .iter()
            .map(|c| {
                (
                    c[0].aggregate_id.clone(),
                    c.iter().map(|r| r.aggregate_seq).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn heads_come_first_then_followers_within_the_budget() {
        let rows = [
            row("a", 1, true),
            row("a", 2, true),
            row("a", 3, true),
            row("b", 5, true),
            row("b", 6, true),
            row("c", 1, true),
        ];
        assert_eq!(
            shape(&chains(&rows, 4)),
            [
                ("a".into(), vec![1, 2]),
                ("b".into(), vec![5]),
                ("c".into(), vec![1])
            ]
        );
        assert_eq!(
            shape(&chains(&rows, 2)),
            [("a".into(), vec![1]), ("b".into(), vec![5])]
        );
        assert_eq!(shape(&chains(&rows, 100)).len(), 3);
    }

    #[test]
    fn a_chain_stops_before_a_row_that_is_not_available() {
        let rows = [row("a", 1, true), row("a", 2, false), row("a", 3, true)];
        assert_eq!(shape(&chains(&rows, 10)), [("a".into(), vec![1])]);
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(350));
        let pauses: Vec<_> = (0..4).map(|_| backoff.next().as_millis()).collect();
        assert_eq!(pauses, [100, 200, 350, 350]);
        backoff.reset();
        assert_eq!(backoff.next().as_millis(), 100);
    }
}
