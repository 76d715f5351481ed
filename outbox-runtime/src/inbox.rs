//! The inbox: idempotent consumers of the outbox's events.
//!
//! Delivery is at-least-once, so a consumer sees duplicates: a relay that died after a
//! publish and before its commit, a JetStream redelivery after a missed ack, a republish
//! after the stream's duplicate window. The inbox gives a consumer exactly-once *effects*:
//! for each message it opens a database transaction, records the message id (`ce-id`) for
//! the consumer in `outbox_inbox` (unique on both), runs the handler in the same transaction,
//! commits, and only then acks. A message already recorded is acked without calling the
//! handler. The handler gets a [`UnitOfWork`] of that transaction: what it writes, and the
//! events it records, commit with the inbox row or not at all (consume, change state, emit),
//! and those events carry the message's correlation id, the message as their cause, and its
//! trace continued ([`crate::causality`]).
//!
//! # Failures
//! A handler error rolls the transaction back (no inbox row, no write, no event) and naks
//! the message with a delay (`retry_delay`, doubling, capped at `max_retry_delay`); after
//! `max_deliver` deliveries the message is terminated (JetStream stops redelivering it) and
//! kept in `outbox_inbox_dead_letters` with its error, headers and payload. A message the
//! consumer cannot use follows a policy, never a crash or a silent loss:
//! - an event type or version the handler's event type does not carry:
//!   [`UnknownEvents`], skipped with a warning by default (filter the consumer's subject to
//!   the types it handles), or dead-lettered;
//! - a message without `ce-id`/`Nats-Msg-Id` or `ce-type`, with an invalid header, or whose
//!   payload does not decode: [`Unreadable`], dead-lettered by default, or skipped with a
//!   warning.
//!
//! # Order and concurrency
//! Messages with different partition keys (`ce-partitionkey`) are handled in parallel, up to
//! `max_concurrency`; messages with the same key one at a time, in stream order. A message
//! that failed holds its key: the later messages of that key wait (kept alive with progress
//! acks) until it is handled or dead-lettered. Those waiting messages count against
//! `max_ack_pending`: a busy key held long enough can fill that window and delay every other
//! key until its failing message is dead-lettered (after `max_deliver` deliveries). Limits:
//! order holds within one running consumer instance. JetStream (2.9) gives a durable pull
//! consumer's messages to its instances with no regard to keys, so run one instance per
//! consumer where order matters; and after a restart a message that waited behind a failing
//! one can be redelivered before it.
//!
//! # Retention
//! Inbox rows older than `retention` are deleted in batches. An id must stay recorded as
//! long as a duplicate of its message can still arrive, or that duplicate is handled again:
//! retention must exceed the longest redelivery time: the consumer's own redeliveries
//! (`max_deliver` times `ack_wait` plus the nak delays), the producer's relay horizon, and any
//! replay of the stream from an earlier position. The default, 7 days, is far above the
//! first two; a stream replayed from further back needs a longer one.
//!
//! # Observability
//! Every delivery is counted in the `metrics` counter `outbox_inbox_messages_total`, labelled
//! `consumer` and `outcome` ([`Outcome::label`]); the histogram `outbox_inbox_process_seconds`
//! (per `consumer`) times it from decoding to commit; `outbox_inbox_settle_failures_total`
//! counts acks, naks and terms that did not reach JetStream. Each is processed in a `tracing`
//! span, `inbox message`, with its id, type and deliveries. The consumer's backlog is
//! JetStream's own (`num_pending` and `num_ack_pending` in the consumer's info).

mod dispatch;
mod message;
mod queries;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::pull};
use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::causality::Causality;
use crate::event::{DomainEvent, PayloadError};
use crate::outbox::Outbox;
use crate::publisher::DEFAULT_STREAM;
use crate::subject::validate_token;
use crate::unit_of_work::{UnitOfWork, UnitOfWorkError};

pub use message::{Metadata, UnreadableMessage};

/// What a consumer does with each event.
///
/// Implement it with an `async fn`:
///
/// ```ignore
/// impl Handler for Reservations {
///     type Event = OrderEvent;
///     type Error = diesel::result::Error;
///
///     async fn handle(&self, event: OrderEvent, message: &Metadata, uow: &mut UnitOfWork<'_>)
///         -> Result<(), Self::Error> { /* writes on uow.conn(), events via uow.track */ Ok(()) }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// The event type it consumes: decoded from each message by `ce-type` and
    /// `ce-eventversion`.
    type Event: DomainEvent;
    /// Its error; the inbox records the `Display` text (in `last_error` of a dead letter).
    type Error: fmt::Display + Send + 'static;

    /// Handles one event, inside the transaction that records the message in the inbox.
    /// Write through `uow.conn()`; record events with `uow.track` or `uow.emit`.
    fn handle(
        &self,
        event: Self::Event,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// What the inbox does with an event type or version the handler's event type does not carry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnknownEvents {
    /// Ack it and log a warning. The default: a consumer's subject filter may catch types
    /// it does not handle.
    #[default]
    Skip,
    /// Dead-letter it.
    DeadLetter,
}

/// What the inbox does with a message it cannot read: missing or invalid headers, or a
/// payload that does not decode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Unreadable {
    /// Dead-letter it, whole. The default.
    #[default]
    DeadLetter,
    /// Ack it and log a warning.
    Skip,
}

/// How a consumer runs: a plain struct with documented defaults. Start from
/// [`InboxConfig::new`].
#[derive(Clone, Debug)]
pub struct InboxConfig {
    /// The consumer's name: the durable JetStream consumer, and its key in the inbox table.
    /// A valid NATS subject token.
    pub consumer: String,
    /// The PostgreSQL URL of the consumer's database (its inbox, its tables, its outbox).
    pub database_url: String,
    /// Where the handlers' events go. Default [`Outbox::new`].
    pub outbox: Outbox,
    /// The stream to consume. Default `EVENTS`.
    pub stream: String,
    /// The subjects to consume, as one NATS subject filter, e.g. `events.Order.*.Placed`.
    /// Default `events.>`.
    pub filter_subject: String,
    /// Deliveries before a failing message is dead-lettered. Default 5.
    pub max_deliver: u32,
    /// How long JetStream waits for an ack before it redelivers. Default 30 s.
    pub ack_wait: Duration,
    /// The nak delay after the first failure; it doubles with each delivery. Default 1 s.
    pub retry_delay: Duration,
    /// The longest nak delay. Default 60 s.
    pub max_retry_delay: Duration,
    /// Messages handled at once (different partition keys), and database connections.
    /// Default 16.
    pub max_concurrency: usize,
    /// Messages JetStream delivers before it waits for acks: the consumer's
    /// `max_ack_pending`, which bounds the messages held in memory (waiting behind their key
    /// or for a free handler). Default 1,000, the NATS server's own default for a consumer
    /// (docs.nats.io, JetStream consumers, "MaxAckPending").
    pub max_ack_pending: usize,
    /// Event types the handler does not carry. Default [`UnknownEvents::Skip`].
    pub unknown_events: UnknownEvents,
    /// Messages that cannot be read. Default [`Unreadable::DeadLetter`].
    pub unreadable: Unreadable,
    /// How long a handled message's id is kept. Default 7 days (see the module
    /// documentation for why it must exceed the longest redelivery time).
    pub retention: Duration,
    /// How often expired inbox rows are deleted. Default 1 min.
    pub purge_interval: Duration,
}

impl InboxConfig {
    /// The defaults, for the consumer `consumer` on the database at `database_url`.
    pub fn new(consumer: impl Into<String>, database_url: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
            database_url: database_url.into(),
            outbox: Outbox::new(),
            stream: DEFAULT_STREAM.to_owned(),
            filter_subject: "events.>".to_owned(),
            max_deliver: 5,
            ack_wait: Duration::from_secs(30),
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(60),
            max_concurrency: 16,
            max_ack_pending: 1000,
            unknown_events: UnknownEvents::Skip,
            unreadable: Unreadable::DeadLetter,
            retention: Duration::from_secs(7 * 24 * 3600),
            purge_interval: Duration::from_secs(60),
        }
    }

    fn validate(&self) -> Result<(), InboxError> {
        validate_token(&self.consumer).map_err(|reason| {
            InboxError::Config(format!(
                "consumer name {:?} is not a valid NATS name: {reason}",
                self.consumer
            ))
        })?;
        for (name, value) in [
            ("max_deliver", self.max_deliver as usize),
            ("max_concurrency", self.max_concurrency),
            ("max_ack_pending", self.max_ack_pending),
        ] {
            if value == 0 {
                return Err(InboxError::Config(format!("{name} must be at least 1")));
            }
        }
        Ok(())
    }

    /// The nak delay after `deliveries` deliveries: `retry_delay * 2^(deliveries - 1)`,
    /// capped at `max_retry_delay`.
    fn nak_delay(&self, deliveries: u64) -> Duration {
        let doublings = u32::try_from(deliveries.saturating_sub(1).min(20)).unwrap_or(20);
        self.retry_delay
            .saturating_mul(2_u32.saturating_pow(doublings))
            .min(self.max_retry_delay)
    }
}

/// The inbox failed.
#[derive(Debug, thiserror::Error)]
pub enum InboxError {
    /// The configuration is not usable.
    #[error("inbox configuration: {0}")]
    Config(String),
    /// The stream or the consumer cannot be used.
    #[error("inbox consumer {consumer:?} on stream {stream:?}: {message}")]
    Consumer {
        /// The consumer name.
        consumer: String,
        /// The stream name.
        stream: String,
        /// What went wrong.
        message: String,
    },
    /// No connection to the database.
    #[error("inbox database connection: {0}")]
    Connect(String),
    /// A query failed.
    #[error("inbox database error: {0}")]
    Database(#[from] diesel::result::Error),
    /// An ack, nak or term did not reach JetStream.
    #[error("inbox could not settle a message: {0}")]
    Settle(String),
    /// An inbox task panicked or was aborted.
    #[error("inbox task did not finish: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// What processing a delivery came to, and how it is settled with JetStream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Handled and committed: ack.
    Handled,
    /// Already recorded in the inbox, the handler not called: ack.
    Duplicate,
    /// Skipped by policy (an unknown event type, an unreadable message): ack.
    Skipped {
        /// Why.
        reason: String,
    },
    /// The handler failed: nak, redelivered after `delay`.
    Retry {
        /// The nak delay.
        delay: Duration,
        /// The handler's error.
        error: String,
    },
    /// Recorded in the dead-letter table: term, never redelivered.
    DeadLettered {
        /// Why.
        error: String,
    },
}

impl Outcome {
    /// The outcome's name, as the `outcome` label of `outbox_inbox_messages_total`:
    /// `handled`, `duplicate`, `skipped`, `retry` or `dead_lettered`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Handled => "handled",
            Self::Duplicate => "duplicate",
            Self::Skipped { .. } => "skipped",
            Self::Retry { .. } => "retry",
            Self::DeadLettered { .. } => "dead_lettered",
        }
    }

    /// Acks, naks or terminates the delivery, as the outcome says.
    ///
    /// # Errors
    /// [`InboxError::Settle`] when JetStream cannot be reached; the message is then
    /// redelivered after `ack_wait`, and the inbox skips it if it was handled.
    pub async fn settle(&self, message: &jetstream::Message) -> Result<(), InboxError> {
        let kind = match self {
            Self::Handled | Self::Duplicate | Self::Skipped { .. } => AckKind::Ack,
            Self::Retry { delay, .. } => AckKind::Nak(Some(*delay)),
            Self::DeadLettered { .. } => AckKind::Term,
        };
        message
            .ack_with(kind)
            .await
            .map_err(|e| InboxError::Settle(e.to_string()))
    }
}

/// Why a transaction of the inbox did not commit.
enum Failure {
    Handler(String),
    Outbox(UnitOfWorkError),
}

impl From<UnitOfWorkError> for Failure {
    fn from(error: UnitOfWorkError) -> Self {
        Self::Outbox(error)
    }
}

impl From<diesel::result::Error> for Failure {
    fn from(error: diesel::result::Error) -> Self {
        Self::Outbox(error.into())
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Handler(error) => write!(f, "handler failed: {error}"),
            Self::Outbox(error) => write!(f, "{error}"),
        }
    }
}

struct Shared<H> {
    config: InboxConfig,
    handler: H,
    pool: Pool<AsyncPgConnection>,
    consumer: jetstream::consumer::PullConsumer,
}

/// An idempotent consumer: a handler behind the inbox. Create it with
/// [`Inbox::connect`], then [`spawn`](Inbox::spawn) it or [`run`](Inbox::run) it.
pub struct Inbox<H: Handler> {
    shared: Arc<Shared<H>>,
}

impl<H: Handler> Clone for Inbox<H> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<H: Handler> Inbox<H> {
    /// Checks the configuration, gets or creates the durable pull consumer (explicit acks,
    /// `ack_wait`, `max_ack_pending`, `filter_subject`; an existing consumer keeps its
    /// settings, and only its filter is checked), and opens the database pool.
    ///
    /// # Errors
    /// [`InboxError::Config`], [`InboxError::Consumer`] (the stream is missing, or an
    /// existing consumer of that name filters another subject) or [`InboxError::Connect`].
    pub async fn connect(
        config: InboxConfig,
        nats: async_nats::Client,
        handler: H,
    ) -> Result<Self, InboxError> {
        config.validate()?;
        let consumer_error = |message: String| InboxError::Consumer {
            consumer: config.consumer.clone(),
            stream: config.stream.clone(),
            message,
        };
        let stream = jetstream::new(nats)
            .get_stream(&config.stream)
            .await
            .map_err(|e| consumer_error(e.to_string()))?;
        let mut consumer: jetstream::consumer::PullConsumer = stream
            .get_or_create_consumer(
                &config.consumer,
                pull::Config {
                    durable_name: Some(config.consumer.clone()),
                    filter_subject: config.filter_subject.clone(),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: config.ack_wait,
                    max_ack_pending: i64::try_from(config.max_ack_pending).unwrap_or(i64::MAX),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| consumer_error(e.to_string()))?;
        let existing = consumer
            .info()
            .await
            .map_err(|e| consumer_error(e.to_string()))?
            .config
            .filter_subject
            .clone();
        if existing != config.filter_subject {
            return Err(consumer_error(format!(
                "the consumer exists with filter subject {existing:?}, not {:?}; delete it or \
                 choose another consumer name",
                config.filter_subject
            )));
        }

        let mut manager = ManagerConfig::default();
        manager.custom_setup = Box::new(|url| {
            let url = url.to_owned();
            Box::pin(async move {
                let mut conn = AsyncPgConnection::establish(&url).await?;
                conn.batch_execute("SET application_name TO 'outbox-inbox'")
                    .await
                    .map_err(|e| diesel::ConnectionError::BadConnection(e.to_string()))?;
                Ok(conn)
            })
        });
        let pool = Pool::builder(AsyncDieselConnectionManager::new_with_config(
            config.database_url.clone(),
            manager,
        ))
        .max_size(config.max_concurrency)
        .build()
        .map_err(|e| InboxError::Connect(e.to_string()))?;
        drop(
            pool.get()
                .await
                .map_err(|e| InboxError::Connect(e.to_string()))?,
        );

        Ok(Self {
            shared: Arc::new(Shared {
                config,
                handler,
                pool,
                consumer,
            }),
        })
    }

    /// The durable JetStream consumer, for fetching messages by hand.
    pub fn consumer(&self) -> &jetstream::consumer::PullConsumer {
        &self.shared.consumer
    }

    /// Runs the consumer in a tokio task until [`InboxHandle::shutdown`].
    pub fn spawn(self) -> InboxHandle {
        let shutdown = CancellationToken::new();
        let signal = shutdown.clone();
        let task = tokio::spawn(async move { self.run(signal.cancelled_owned()).await });
        InboxHandle { shutdown, task }
    }

    /// Consumes until `shutdown` completes, then stops pulling, lets the messages in
    /// progress finish and settle, and returns. Messages received and not yet started stay
    /// unacked and are redelivered to the next instance.
    ///
    /// # Errors
    /// [`InboxError::Task`] when a task of the inbox panicked. Failures of the broker or
    /// the database are retried, not returned.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), InboxError> {
        dispatch::run(self, shutdown).await
    }

    /// Processes one delivery in one transaction and says how to settle it; does not ack.
    /// [`run`](Inbox::run) does this for every message, then [`Outcome::settle`]s it.
    ///
    /// # Errors
    /// None for a failure of the handler or the database: those are [`Outcome::Retry`] (or
    /// [`Outcome::DeadLettered`] at the last delivery).
    pub async fn process(&self, message: &jetstream::Message) -> Result<Outcome, InboxError> {
        let config = &self.shared.config;
        let metadata = match Metadata::read(message) {
            Ok(metadata) => metadata,
            Err(unreadable) => {
                let error = unreadable.to_string();
                return Ok(self
                    .by_policy(message, None, config.unreadable == Unreadable::Skip, error)
                    .await);
            }
        };
        let span = tracing::debug_span!(
            "inbox message",
            consumer = %config.consumer,
            id = %metadata.id,
            event_type = %metadata.event_type,
            deliveries = metadata.deliveries,
        );
        Ok(self.process_read(message, metadata).instrument(span).await)
    }

    /// [`process`](Self::process), once the metadata is read.
    async fn process_read(&self, message: &jetstream::Message, metadata: Metadata) -> Outcome {
        let config = &self.shared.config;
        if metadata.deliveries > u64::from(config.max_deliver) {
            // Failed every time, or the consumer died handling it: give up before the
            // handler runs once more.
            let error = format!(
                "delivered {} times without being handled (max_deliver {})",
                metadata.deliveries, config.max_deliver
            );
            return self.dead_letter_or_retry(message, &metadata, error).await;
        }
        let event = match H::Event::from_payload(
            &metadata.event_type,
            metadata.event_version,
            &message.payload,
        ) {
            Ok(event) => event,
            Err(error @ PayloadError::UnknownEventType { .. }) => {
                let skip = config.unknown_events == UnknownEvents::Skip;
                return self
                    .by_policy(message, Some(&metadata), skip, error.to_string())
                    .await;
            }
            Err(error @ PayloadError::Json { .. }) => {
                let skip = config.unreadable == Unreadable::Skip;
                return self
                    .by_policy(message, Some(&metadata), skip, error.to_string())
                    .await;
            }
        };

        match self.handle(event, &metadata).await {
            Ok(outcome) => outcome,
            Err(failure) if metadata.deliveries >= u64::from(config.max_deliver) => {
                self.dead_letter_or_retry(message, &metadata, failure.to_string())
                    .await
            }
            Err(failure) => {
                let delay = config.nak_delay(metadata.deliveries);
                tracing::warn!(error = %failure, ?delay, "handling failed; the message will be redelivered");
                Outcome::Retry {
                    delay,
                    error: failure.to_string(),
                }
            }
        }
    }

    /// The transaction: record the message, handle it, commit. A recorded message is a
    /// duplicate and the handler is not called.
    async fn handle(&self, event: H::Event, metadata: &Metadata) -> Result<Outcome, Failure> {
        let shared = &*self.shared;
        let mut conn = shared
            .pool
            .get()
            .await
            .map_err(|e| Failure::Outbox(UnitOfWorkError::Database(pool_error(e))))?;
        let causality = Causality::caused_by(
            &metadata.id,
            metadata.correlation_id.as_deref(),
            metadata.traceparent.as_ref(),
        );
        shared
            .config
            .outbox
            .transaction_with(&mut conn, causality, async |uow| {
                if !queries::record_handled(uow.conn(), &shared.config.consumer, &metadata.id)
                    .await?
                {
                    return Ok(Outcome::Duplicate);
                }
                shared
                    .handler
                    .handle(event, metadata, uow)
                    .await
                    .map_err(|e| Failure::Handler(e.to_string()))?;
                Ok(Outcome::Handled)
            })
            .await
    }

    /// Skips, or dead-letters, a message the handler cannot take.
    async fn by_policy(
        &self,
        message: &jetstream::Message,
        metadata: Option<&Metadata>,
        skip: bool,
        reason: String,
    ) -> Outcome {
        if skip {
            tracing::warn!(subject = %message.subject, %reason, "skipping a message by policy");
            return Outcome::Skipped { reason };
        }
        match metadata {
            Some(metadata) => self.dead_letter_or_retry(message, metadata, reason).await,
            None => self.dead_letter_unread(message, reason).await,
        }
    }

    async fn dead_letter_or_retry(
        &self,
        message: &jetstream::Message,
        metadata: &Metadata,
        error: String,
    ) -> Outcome {
        let letter = queries::DeadLetter {
            consumer: &self.shared.config.consumer,
            message_id: &metadata.id,
            subject: &metadata.subject,
            headers: &message::headers_json(message),
            payload: &message.payload,
            error: &error,
            deliveries: i64::try_from(metadata.deliveries).unwrap_or(i64::MAX),
            stream_sequence: i64::try_from(metadata.stream_sequence).unwrap_or(i64::MAX),
        };
        self.record(letter, error.clone()).await
    }

    /// Dead-letters a message whose metadata could not be read: keyed by its stream
    /// sequence.
    async fn dead_letter_unread(&self, message: &jetstream::Message, error: String) -> Outcome {
        let info = message.info().ok();
        let stream_sequence = info.as_ref().map_or(0, |info| info.stream_sequence);
        let id = format!("stream-sequence-{stream_sequence}");
        let letter = queries::DeadLetter {
            consumer: &self.shared.config.consumer,
            message_id: &id,
            subject: &message.subject,
            headers: &message::headers_json(message),
            payload: &message.payload,
            error: &error,
            deliveries: info.as_ref().map_or(1, |info| info.delivered),
            stream_sequence: i64::try_from(stream_sequence).unwrap_or(i64::MAX),
        };
        self.record(letter, error.clone()).await
    }

    /// Writes a dead letter; when the database cannot take it, the message is retried
    /// instead of lost.
    async fn record(&self, letter: queries::DeadLetter<'_>, error: String) -> Outcome {
        let written = async {
            let mut conn = self.shared.pool.get().await.map_err(pool_error)?;
            queries::record_dead_letter(&mut conn, &letter).await
        };
        match written.await {
            Ok(()) => {
                tracing::error!(message_id = letter.message_id, %error, "dead-lettered a message");
                Outcome::DeadLettered { error }
            }
            Err(db_error) => {
                tracing::warn!(%db_error, "cannot record a dead letter; retrying the message");
                Outcome::Retry {
                    delay: self.shared.config.retry_delay,
                    error: format!("{error}; and recording it as a dead letter failed: {db_error}"),
                }
            }
        }
    }
}

fn pool_error(error: impl fmt::Display) -> diesel::result::Error {
    diesel::result::Error::DatabaseError(
        diesel::result::DatabaseErrorKind::ClosedConnection,
        Box::new(error.to_string()),
    )
}

/// A running consumer task.
pub struct InboxHandle {
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), InboxError>>,
}

impl InboxHandle {
    /// Stops the consumer gracefully (see [`Inbox::run`]) and waits for it.
    ///
    /// # Errors
    /// What the consumer returned, or [`InboxError::Task`] when it panicked.
    pub async fn shutdown(self) -> Result<(), InboxError> {
        self.shutdown.cancel();
        self.task.await?
    }
}

/// Deletes up to `limit` of `consumer`'s inbox rows handled more than `older_than` ago,
/// oldest first, and returns how many. A running [`Inbox`] does this every
/// `purge_interval` with its `retention`.
///
/// # Errors
/// The database's error.
pub async fn purge(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    older_than: Duration,
    limit: i64,
) -> diesel::QueryResult<usize> {
    let older_than_ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
    queries::purge(conn, consumer, older_than_ms, limit).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nak_delays_double_from_the_first_and_are_capped() {
        let mut config = InboxConfig::new("c", "postgres://");
        config.retry_delay = Duration::from_millis(100);
        config.max_retry_delay = Duration::from_millis(350);
        let delays: Vec<u128> = (1..=5).map(|d| config.nak_delay(d).as_millis()).collect();
        assert_eq!(delays, [100, 200, 350, 350, 350]);
    }

    #[test]
    fn a_consumer_name_is_checked() {
        let config = InboxConfig::new("orders.reservations", "postgres://");
        let error = config.validate().unwrap_err();
        assert!(error.to_string().contains("orders.reservations"), "{error}");
    }
}
