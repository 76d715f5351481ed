//! The inbox: idempotent consumers of the outbox's events.
//!
//! Delivery is at-least-once, so a consumer sees duplicates: a relay that died after a
//! publish and before its commit, a JetStream redelivery after a missed ack, a republish
//! after the stream's duplicate window. The inbox gives a consumer exactly-once *effects*:
//! for each message it opens a database transaction, records the message for the consumer
//! in `outbox_inbox` (unique on consumer, `ce-source` and `ce-id`: CloudEvents makes source
//! and id together unique), runs the handler in the same transaction, commits, and only then
//! acks. A message already recorded is acked without calling the handler. The handler gets
//! a [`UnitOfWork`] of that transaction: what it writes, and the events it records, commit
//! with the inbox row or not at all (consume, change state, emit), and those events carry the
//! message's correlation id, the message as their cause, and its trace continued
//! ([`crate::causality`]).
//!
//! # Order
//! Each aggregate's events are applied in `ce-sequence` order, across restarts and across
//! several instances of one consumer. The same transaction moves the consumer's position in
//! the aggregate (`outbox_inbox_positions`) to the event, and only when it is the next one;
//! an event whose predecessor the consumer has not applied waits for it (in place while the
//! aggregate's position moves, then parked in the instance until the position reaches it,
//! else a nak with a short delay; none counts a failure: see `dispatch`), and one whose
//! predecessor will never come (skipped on the producer side, cut from the stream) is
//! applied over the gap, which is recorded in
//! `outbox_inbox_gaps`. The stream tells the two apart: the relay publishes an aggregate's
//! events in order, so a predecessor still to come is in the stream between the message of
//! the last applied event and this one, on the aggregate's subjects that the consumer's
//! filter takes (read with `STREAM.MSG.GET` by subject); one that is not there never comes.
//! If it comes after all (a skipped dead letter retried later), it is dead-lettered as late,
//! never applied out of order. A predecessor that is there and does not settle within
//! `gap_timeout` is treated as a gap. A lookup JetStream does not answer within 2 s (its
//! server died with the request, or the stream is electing a leader) holds the event and
//! asks again later: it never applies it over a gap. The lookup covers the subjects of the
//! event's own partition key and of the aggregate id: an aggregate whose events use yet
//! other partition keys can have a predecessor it missed dead-lettered as late. Within
//! an instance, the messages of one aggregate are handled one at a time in stream order,
//! those of different aggregates in parallel, up to `max_concurrency`. A message without an
//! aggregate (`ce-aggregatetype`, `ce-subject`, `ce-sequence`: a foreign producer's) is
//! ordered by its partition key within an instance only.
//!
//! # Failures
//! A handler error (or panic, or a call still running at `handler_timeout`) rolls the
//! transaction back (no inbox row, no write, no event), is counted in
//! `outbox_inbox_attempts`, and naks the message with a delay (`retry_delay`,
//! doubling, capped at `max_retry_delay`); at `max_attempts` failures the message is
//! dead-lettered in `outbox_inbox_dead_letters` with its error, headers and payload, and its
//! aggregate moves on. Only handler failures count: JetStream's own delivery count is
//! unlimited, so a consumer that crashes, restarts or loses its database never uses up a
//! message's attempts. A message the consumer cannot use follows a policy, never a crash or
//! a silent loss:
//! - an event type the handler's event type does not carry: [`UnknownEvents`], skipped
//!   with a warning by default (filter the consumer's subject to the types it handles), or
//!   dead-lettered;
//! - a type it carries at a version newer than it reads (a producer released before the
//!   consumer): [`NewerVersions`], left by default for an instance that reads it (nak'd,
//!   counting no failure, its aggregate's later events waiting behind it) up to
//!   `gap_timeout`, then dead-lettered; or dead-lettered at once;
//! - a message without `ce-id`/`Nats-Msg-Id` or `ce-type`, with an invalid header or an
//!   identity header over [`MAX_ID_BYTES`](crate::causality::MAX_ID_BYTES), or whose payload does not decode:
//!   [`Unreadable`], dead-lettered by default, or skipped with a warning.
//!
//! An operator reads the dead letters with [`dead_letters`] and [`dead_letter`] (or `outbox
//! inbox-dead-letters list` and `show`) and counts them with [`dead_letter_counts`]. Once the
//! handler is fixed, [`Inbox::replay_dead_letter`] applies one where it stands (after the
//! aggregate's later events) and deletes it, and [`Inbox::replay_dead_letters`] the oldest
//! of the consumer's in turn (a redrive); one dealt with by hand is removed by
//! [`discard_dead_letter`] (or all of a consumer's by [`discard_dead_letters`]). Either way
//! the message stays recorded, so it is never handled again.
//!
//! # Restarts
//! JetStream gives a message that an instance received and did not settle to another after
//! `ack_wait` (5 s by default); the inbox keeps the messages it works on or holds alive with
//! progress acks, so a long handler is not redelivered meanwhile. An instance holds at most
//! `4 x max_concurrency` messages it has not started (64 by default), far below the
//! consumer's `max_ack_pending` (1,000), so the other instances, or a restarted one, keep
//! receiving messages while a dead instance's wait out their `ack_wait`. Beyond those it
//! keeps aside the later messages of an aggregate whose event waits (for a retry, or for its
//! predecessor), up to `max_ack_pending` in all: they run in order once that event is
//! applied, rather than going back to JetStream, which redelivers nak'd messages in the
//! order their delays end, not always the aggregate's. Worst cases: after a
//! crash, the dead instance's messages, and the later events of their aggregates, wait
//! `ack_wait`; the rest flow at once. On a graceful stop ([`InboxHandle::shutdown`]) the
//! instance naks what it has not started, for immediate redelivery, and finishes what it has.
//!
//! A durable consumer deleted under running instances (by an operator, or with its stream,
//! which a relay creates again) is created again by them with the settings `connect` left
//! it with: in the same stream delivering from above the ack floor last read (every third of
//! `ack_wait`), in a stream created since from its first message. The consumer's positions
//! hold stream sequences of the stream each event was applied from; before an event is
//! applied over a gap, the stream must still hold the last applied event at the recorded
//! sequence, else the predecessor is looked for from the ack floor. One deleted while no
//! instance runs (or lost with a server's store) is created by the next `connect`, which
//! delivers the stream from its first message, and logs a warning when the consumer has
//! positions in the database (see "Retention" for what that redelivers).
//!
//! # Retention
//! Inbox rows older than `retention` are deleted in batches. An id must stay recorded as
//! long as a duplicate of its message can still arrive, or that duplicate is handled again:
//! retention must exceed the longest redelivery time: the consumer's own redeliveries
//! (`max_attempts` times `ack_wait` plus the nak delays), the producer's relay horizon, and
//! any replay of the stream from an earlier position. The default, 7 days, is far above the
//! first two; a stream replayed from further back needs a longer one. Positions are kept:
//! one row per aggregate. So a duplicate of an aggregate's event that comes after its id was
//! purged is not applied again (the aggregate's position is at or past it), but the inbox
//! cannot tell it from an event of the aggregate it never applied (a skipped dead letter
//! published late, or an event numbered the same by a producer whose database was restored):
//! it is dead-lettered as late, for an operator to check and discard. A message without an
//! aggregate (a foreign producer's) is handled again.
//!
//! # Databases
//! The inbox runs on the connection `C` of [`Inbox<H, C>`](Inbox), its handler's
//! [`UnitOfWork`] on the same: `AsyncPgConnection` (the default), `AsyncMysqlConnection`
//! (feature `mysql`; [`crate::mysql`] says how its sessions differ) or
//! `AsyncSqliteConnection` (feature `sqlite`; [`crate::sqlite`]: messages are applied one at
//! a time). The tables are the same on each, in each database's migrations; PostgreSQL runs
//! the statement that records a message and moves the aggregate's position as a function of
//! its migrations, MySQL and SQLite as the statements that function runs. The guarantees
//! above hold on all three, and the same tests check them on each (`tests/contract.rs`).
//!
//! # Observability
//! Every delivery is counted in the `metrics` counter `outbox_inbox_messages_total`, labelled
//! `consumer` and `outcome` ([`Outcome::label`]); the histogram `outbox_inbox_process_seconds`
//! (per `consumer`) times it from decoding to commit; `outbox_inbox_settle_failures_total`
//! counts acks, naks and terms that did not reach JetStream, and `outbox_inbox_gaps_total`
//! the events applied over a gap. Each message is processed in a `tracing` span, `inbox
//! message`, with its id, type and deliveries. The consumer's backlog is JetStream's own
//! (`num_pending` and `num_ack_pending` in the consumer's info): each running instance reads
//! it every third of `ack_wait` (with the ack floor) and sets the gauges
//! `outbox_inbox_pending` and `outbox_inbox_ack_pending` (per `consumer`; the instances of
//! one consumer report the same figures).

mod dispatch;
mod letters;
mod message;
#[cfg(feature = "mysql")]
mod mysql;
mod order;
#[cfg(any(feature = "mysql", feature = "sqlite"))]
mod portable;
#[cfg(feature = "postgres")]
mod queries;
#[cfg(feature = "sqlite")]
mod sqlite;
mod store;

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::pull};
#[cfg(feature = "postgres")]
use diesel_async::AsyncPgConnection;
use diesel_async::SimpleAsyncConnection;
use futures::FutureExt;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::causality::Causality;
#[cfg(feature = "postgres")]
use crate::database::Connector;
use crate::database::{
    self, Bounded, ConnectError, DEFAULT_CONNECT_TIMEOUT, DEFAULT_STATEMENT_TIMEOUT, Kind,
    Redacted, TimedOut,
};
use crate::event::{EventSet, PayloadError};
use crate::outbox::{MissingMigrations, Outbox};
use crate::relay::{over_its_cap, too_long, too_short};
use crate::spawned::Spawned;
use crate::subject::validate_token;
use crate::topology::Topology;
use crate::unit_of_work::{UnitOfWork, UnitOfWorkError};

pub use letters::{
    DeadLetter, DeadLetterDetail, dead_letter, dead_letter_counts, dead_letter_sources,
    dead_letters, discard_dead_letter, discard_dead_letters,
};
pub use message::{Metadata, UnreadableMessage};
use order::Predecessor;
pub use store::InboxConnection;
use store::{MessageKey, Place, Recorded, Session};

/// [`Inbox::connect`]'s check that the database takes the inbox's writes: an update of no
/// rows, which a database without writes refuses all the same (PostgreSQL checks a
/// read-only transaction, and the role's privileges, before it reads a row; so do MySQL's
/// `read_only` and SQLite's read-only file). The same SQL on the three databases.
const WRITE_CHECK: &str = "UPDATE outbox_inbox_positions SET last_seq = last_seq WHERE 1 = 0";

/// Declares [`Handler`], with `$default` (`= AsyncPgConnection`) as its connection when the
/// build has PostgreSQL: a default that other features change would break code that
/// relies on it when a crate elsewhere in the build turns a feature on.
macro_rules! handler_trait {
    ($($default:tt)*) => {
        /// What a consumer does with each event, on the connection `C`: PostgreSQL's unless said
        /// otherwise (with the feature `postgres`), so `Handler` is a handler on an
        /// `AsyncPgConnection`.
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
        ///
        /// On MySQL or SQLite, implement `Handler<AsyncMysqlConnection>` (or
        /// `Handler<AsyncSqliteConnection>`) and run it in an `Inbox<_, AsyncMysqlConnection>`:
        /// the handler gets a [`UnitOfWork`] on that connection.
        pub trait Handler<C: InboxConnection $($default)*>: Send + Sync + 'static {
            /// The events it consumes: one [`DomainEvent`](crate::DomainEvent) type, or
            /// several in an enum with `#[derive(EventSet)]` (one durable consumer for the
            /// events of several aggregates). Decoded from each message by `ce-type` and
            /// `ce-eventversion`.
            type Event: EventSet;
            /// Its error; the inbox records the `Display` text (in the dead letter's `error`).
            type Error: fmt::Display + Send + 'static;

            /// Handles one event, inside the transaction that records the message in the inbox.
            /// Write through `uow.conn()`; record events with `uow.track` or `uow.emit`. Do not
            /// send `COMMIT` or `ROLLBACK` on the connection: return an error to roll back (a
            /// transaction ended by the handler fails the message, and nothing it did is acked).
            fn handle(
                &self,
                event: Self::Event,
                message: &Metadata,
                uow: &mut UnitOfWork<'_, C>,
            ) -> impl Future<Output = Result<(), Self::Error>> + Send;
        }
    };
}

#[cfg(feature = "postgres")]
handler_trait!(= AsyncPgConnection);
#[cfg(not(feature = "postgres"))]
handler_trait!();

/// The most handlers an inbox instance runs at once ([`InboxConfig::max_concurrency`]):
/// each holds a database connection with its transaction open, and the connection pool
/// sets room aside for as many. About ten times PostgreSQL's default `max_connections`
/// (100; PostgreSQL 15 documentation, 20.3 "Connections and Authentication") and seven times
/// MySQL's (151): a consumer needing more runs more instances.
pub const MAX_CONCURRENCY: usize = 1024;

/// What the inbox does with an event type the handler's event type does not carry. A type
/// it carries, at a version newer than every one it reads, follows [`NewerVersions`]; a
/// version below 1 makes the message unreadable ([`Unreadable`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnknownEvents {
    /// Ack it and log a warning. The default: a consumer's subject filter may catch types
    /// it does not handle.
    #[default]
    Skip,
    /// Dead-letter it.
    DeadLetter,
}

/// What the inbox does with an event of a type the handler's event type carries, at a
/// version newer than every one it reads ([`PayloadError::newest_version_read`]): a
/// producer released before its consumer, as in a rolling deploy that starts with the
/// producer. Never skipped: the consumer takes the type, and an event of it acked unread
/// would be lost to it, its aggregate's later events applied without it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NewerVersions {
    /// Leave it for an instance of the consumer that reads it, for up to `gap_timeout`
    /// (5 min by default): nak it, counting no failure, with the handler's delays
    /// (`retry_delay` doubling with each delivery, up to `max_retry_delay`), and warn (once
    /// per instance and event type and version). Its aggregate's later events wait behind
    /// it, as behind any unapplied predecessor; the instance goes on applying the other
    /// aggregates' events. The default: in a rolling deploy the consumer's next release
    /// takes it, and the aggregate's events are applied in order. Once its naks add up to
    /// `gap_timeout` (counted from its deliveries, so across instances and restarts) it is
    /// dead-lettered, naming the versions and the wait, and its aggregate moves on: the
    /// aggregate's later events would be applied over it then anyway, and a consumer that
    /// lags its producer by days would otherwise hold such events pending by the hundred,
    /// up to `max_ack_pending`, where JetStream stops delivering it anything. Replay the dead
    /// letters once the release that reads them runs ([`Inbox::replay_dead_letters`]).
    #[default]
    Wait,
    /// Dead-letter it, and its aggregate moves on: for an operator to replay
    /// ([`Inbox::replay_dead_letter`]) once a release that reads it runs, or to discard.
    DeadLetter,
}

/// What the inbox does with a message it cannot read: missing or invalid headers, or a
/// payload that does not decode (or that an upcast refuses: [`PayloadError::Upcast`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Unreadable {
    /// Dead-letter it, whole. The default.
    #[default]
    DeadLetter,
    /// Ack it and log a warning.
    Skip,
}

/// How a consumer runs: a plain struct with documented defaults. Start from
/// [`InboxConfig::new`]. Its `Debug` shows the database URL without its password.
/// `ack_wait`, `retry_delay`, `max_retry_delay`, `connect_timeout` and `statement_timeout`
/// are at most [`MAX_DURATION`](crate::relay::MAX_DURATION); the other durations take any
/// length (`Duration::MAX`: never).
#[derive(Clone)]
pub struct InboxConfig {
    /// The consumer's name: the durable JetStream consumer, and its key in the inbox tables.
    /// A valid NATS subject token, at most 255 bytes (nats-server's limit on names).
    pub consumer: String,
    /// The URL of the consumer's database (its inbox, its tables, its outbox): a
    /// PostgreSQL URL, a `mysql://` URL or a SQLite file, the database of the inbox's
    /// connection type ([`Inbox::connect`] refuses another).
    pub database_url: String,
    /// Where the handlers' events go. Default [`Outbox::new`].
    pub outbox: Outbox,
    /// The topology the consumer reads: the producing service's (the same value its units of
    /// work and relay take, [`crate::topology`]); the consumer reads its stream. Default
    /// [`Topology::default`]: prefix `events`, stream `EVENTS`.
    pub topology: Topology,
    /// The subjects to consume, as NATS subject filters under the topology's prefix, e.g.
    /// `["events.Order.*.Placed", "events.Payment.>"]`. Default empty: all of them,
    /// `{prefix}.>`. One filter works on every server; several make one durable consumer
    /// take several subjects (the consumer's `filter_subjects`, nats-server 2.10 and later;
    /// NATS docs, JetStream consumers, "FilterSubjects"), and [`Inbox::connect`] refuses them
    /// on an older server, naming its version. A filter that is not a subject filter
    /// ([`validate_filter`](crate::subject::validate_filter)), or cannot match a subject
    /// under the prefix, is refused too.
    pub filter_subjects: Vec<String>,
    /// Handler failures (errors or panics) before a message is dead-lettered. Deliveries do
    /// not count: a crash or a restart never dead-letters a message. Default 5.
    pub max_attempts: u32,
    /// How long one call of the handler may take. A call that has not returned by then is
    /// dropped and fails as a handler error does: its transaction rolls back (a query of it
    /// still running on the server ends at `statement_timeout`), the attempt counts, the
    /// message is nak'd with its delay and dead-lettered at `max_attempts`, and its
    /// aggregate moves on. Without it, a handler that never returns (a call to a service
    /// that never answers) would hold its aggregate, a handler slot and a connection with
    /// an open transaction for ever, kept from redelivery by the inbox's progress acks.
    /// A call is dropped where it awaits: one that blocks its thread without awaiting is not
    /// cut off (run blocking work with `tokio::task::spawn_blocking`). On PostgreSQL the
    /// inbox's sessions set `idle_in_transaction_session_timeout` to `handler_timeout` plus
    /// `statement_timeout` (none past `i32::MAX` ms), whatever the database's: a handler may
    /// work that long without a statement and still commit.
    /// Default 5 min; `Duration::MAX` means never.
    pub handler_timeout: Duration,
    /// How long JetStream waits for an ack (or a progress ack) before it gives a message to
    /// another instance: the longest wait, after a crash, for the messages the dead
    /// instance held. The inbox sends progress acks every third of it for the messages it
    /// works on or holds. Default 5 s.
    pub ack_wait: Duration,
    /// The nak delay after the first handler failure; it doubles with each failure.
    /// Default 1 s.
    pub retry_delay: Duration,
    /// The longest nak delay. Default 60 s.
    /// At least `retry_delay`, or the configuration is refused.
    pub max_retry_delay: Duration,
    /// Messages handled at once (different aggregates), and database connections. An
    /// instance also holds up to four times this many messages it has not started, beyond
    /// those it keeps aside behind a retry or a parked event (see `max_ack_pending`).
    /// Default 16; 1 to [`MAX_CONCURRENCY`] (1,024).
    pub max_concurrency: usize,
    /// Messages JetStream delivers, across the consumer's instances, before it waits for
    /// acks: the consumer's `max_ack_pending`. Default 1,000, the NATS server's own default
    /// for a consumer (docs.nats.io, JetStream consumers, "MaxAckPending").
    ///
    /// Also the most messages an instance keeps aside (in memory, with progress acks, not
    /// handed back) while an earlier message of their aggregate waits for a retry or is
    /// parked; they run in order once it is applied. A bound on an instance's memory:
    /// this many messages' payloads beyond its buffer.
    ///
    /// While this many are unacked, JetStream delivers the consumer no new message (only
    /// redeliveries: nats-server `server/consumer.go`, `getNextMsg`), and the messages kept
    /// aside are unacked: an aggregate that waits with more later messages in the stream than
    /// this holds up every other aggregate of the consumer until its waiting event is applied
    /// or dead-lettered (with the defaults, `max_attempts` handler calls and the nak delays
    /// between them). Raise it where one aggregate's backlog can outgrow it.
    pub max_ack_pending: usize,
    /// How long an event waits for a predecessor that is in the stream and not applied
    /// before it is applied over it (the predecessor is then dead-lettered when it comes).
    /// A safety valve: a predecessor settles within its own retries. Default 5 min.
    pub gap_timeout: Duration,
    /// Event types the handler does not carry. Default [`UnknownEvents::Skip`].
    pub unknown_events: UnknownEvents,
    /// Events of a type the handler carries at a version newer than it reads. Default
    /// [`NewerVersions::Wait`].
    pub newer_versions: NewerVersions,
    /// Messages that cannot be read. Default [`Unreadable::DeadLetter`].
    pub unreadable: Unreadable,
    /// How long a handled message's id is kept. Default 7 days (see the module
    /// documentation for why it must exceed the longest redelivery time); at least the
    /// consumer's own redeliveries, `max_attempts` times `ack_wait` plus the nak delays (40 s
    /// with the defaults), or the configuration is refused. `Duration::MAX` (anything over a
    /// thousand years) keeps them for ever.
    pub retention: Duration,
    /// How often expired inbox rows are deleted. Default 1 min; at least
    /// [`MIN_INTERVAL`](crate::relay::MIN_INTERVAL) (to keep ids for ever, set `retention`
    /// to `Duration::MAX`).
    pub purge_interval: Duration,
    /// How long opening a database connection may take. Default
    /// [`DEFAULT_CONNECT_TIMEOUT`] (10 s).
    pub connect_timeout: Duration,
    /// Opens the consumer's connections the service's way (its pool's TLS, credentials and
    /// setup) instead of from `database_url`, which then only names the database in logs.
    /// The inbox holds up to `max_concurrency` connections, in a pool of its own. Default
    /// `None`. PostgreSQL only: an inbox on MySQL or SQLite refuses it.
    #[cfg(feature = "postgres")]
    pub connector: Option<Connector>,
    /// How long one query may take: enforced by the inbox on its own queries, and on
    /// PostgreSQL also set as the sessions' server-side `statement_timeout` (the handlers'
    /// queries included). Default [`DEFAULT_STATEMENT_TIMEOUT`] (30 s).
    pub statement_timeout: Duration,
}

impl fmt::Debug for InboxConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("InboxConfig");
        debug
            .field("consumer", &self.consumer)
            .field("database_url", &Redacted(&self.database_url))
            .field("outbox", &self.outbox)
            .field("topology", &self.topology)
            .field("filter_subjects", &self.filter_subjects)
            .field("max_attempts", &self.max_attempts)
            .field("handler_timeout", &self.handler_timeout)
            .field("ack_wait", &self.ack_wait)
            .field("retry_delay", &self.retry_delay)
            .field("max_retry_delay", &self.max_retry_delay)
            .field("max_concurrency", &self.max_concurrency)
            .field("max_ack_pending", &self.max_ack_pending)
            .field("gap_timeout", &self.gap_timeout)
            .field("unknown_events", &self.unknown_events)
            .field("newer_versions", &self.newer_versions)
            .field("unreadable", &self.unreadable)
            .field("retention", &self.retention)
            .field("purge_interval", &self.purge_interval)
            .field("connect_timeout", &self.connect_timeout);
        #[cfg(feature = "postgres")]
        debug.field("connector", &self.connector);
        debug
            .field("statement_timeout", &self.statement_timeout)
            .finish()
    }
}

/// The most times a nak delay doubles (`retry_delay` x 2^20, before `max_retry_delay` caps
/// it): later failures wait as long as the last doubled one.
const NAK_DOUBLINGS: u64 = 20;

impl InboxConfig {
    /// The defaults, for the consumer `consumer` on the database at `database_url`.
    pub fn new(consumer: impl Into<String>, database_url: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
            database_url: database_url.into(),
            outbox: Outbox::new(),
            topology: Topology::default(),
            filter_subjects: Vec::new(),
            max_attempts: 5,
            handler_timeout: Duration::from_secs(300),
            ack_wait: Duration::from_secs(5),
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(60),
            max_concurrency: 16,
            max_ack_pending: 1000,
            gap_timeout: Duration::from_secs(300),
            unknown_events: UnknownEvents::Skip,
            newer_versions: NewerVersions::Wait,
            unreadable: Unreadable::DeadLetter,
            retention: Duration::from_secs(7 * 24 * 3600),
            purge_interval: Duration::from_secs(60),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            #[cfg(feature = "postgres")]
            connector: None,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
        }
    }

    /// The subject filters the consumer takes: `filter_subjects`, or all the topology's
    /// subjects.
    pub fn filters(&self) -> Vec<String> {
        if self.filter_subjects.is_empty() {
            vec![self.topology.subject_prefix.all_subjects()]
        } else {
            self.filter_subjects.clone()
        }
    }

    /// Checks the configuration without connecting anything: what [`Inbox::connect`]
    /// refuses before it asks NATS or the database, so that a service can refuse a bad
    /// setting at once, whether or not the servers are up. `connect` also refuses an empty
    /// `database_url` (without a connector) and one of another database than the handler's
    /// connection type (before it connects, knowing that type), and several
    /// `filter_subjects` on a server before 2.10 (from the server's version).
    ///
    /// # Errors
    /// [`InboxError::Config`], naming the setting and its bound: a filter that is not a
    /// subject filter ([`validate_filter`](crate::subject::validate_filter)) or lies outside
    /// the topology's prefix, a stream or consumer name NATS refuses (the consumer's at most 255
    /// bytes), a count of zero (`max_attempts`, `max_concurrency`, `max_ack_pending`),
    /// `max_concurrency` over [`MAX_CONCURRENCY`], `max_attempts` over `i32::MAX`,
    /// `ack_wait` under 100 ms, a timeout under 1 ms, a `purge_interval` under
    /// [`MIN_INTERVAL`](crate::relay::MIN_INTERVAL), a duration over
    /// [`MAX_DURATION`](crate::relay::MAX_DURATION), `retry_delay` over `max_retry_delay`, or a
    /// `retention` shorter than [`own_redelivery_time`](Self::own_redelivery_time).
    pub fn validate(&self) -> Result<(), InboxError> {
        let prefix = &self.topology.subject_prefix;
        for filter in &self.filter_subjects {
            crate::subject::validate_filter(filter)
                .map_err(|error| InboxError::Config(error.to_string()))?;
        }
        if let Some(filter) = self
            .filter_subjects
            .iter()
            .find(|filter| !prefix.can_match(filter))
        {
            return Err(InboxError::Config(format!(
                "filter subject {filter:?} matches no subject under the topology's prefix \
                 {prefix:?}: the relay publishes only \"{prefix}.>\"; use the producer's \
                 topology, or a filter under its prefix"
            )));
        }
        self.topology
            .stream
            .check_address()
            .map_err(|error| InboxError::Config(format!("topology.stream.{error}")))?;
        validate_token(&self.consumer).map_err(|reason| {
            InboxError::Config(format!(
                "consumer name {:?} is not a valid NATS name: {reason}",
                crate::subject::shortened(&self.consumer, 64)
            ))
        })?;
        if self.consumer.len() > 255 {
            return Err(InboxError::Config(format!(
                "consumer name is {} bytes long, over nats-server's limit of 255",
                self.consumer.len()
            )));
        }
        for (name, value) in [
            ("max_attempts", self.max_attempts as usize),
            ("max_concurrency", self.max_concurrency),
            ("max_ack_pending", self.max_ack_pending),
        ] {
            if value == 0 {
                return Err(InboxError::Config(format!("{name} must be at least 1")));
            }
        }
        if self.max_concurrency > MAX_CONCURRENCY {
            return Err(InboxError::Config(format!(
                "max_concurrency {} is more than an inbox runs ({MAX_CONCURRENCY}): each \
                 handler holds a database connection, its transaction open",
                self.max_concurrency
            )));
        }
        if i32::try_from(self.max_attempts).is_err() {
            return Err(InboxError::Config(format!(
                "max_attempts {} is larger than the attempts column holds",
                self.max_attempts
            )));
        }
        for (name, value, least) in [
            ("ack_wait", self.ack_wait, Duration::from_millis(100)),
            (
                "connect_timeout",
                self.connect_timeout,
                Duration::from_millis(1),
            ),
            (
                "statement_timeout",
                self.statement_timeout,
                Duration::from_millis(1),
            ),
            (
                "handler_timeout",
                self.handler_timeout,
                Duration::from_millis(1),
            ),
        ] {
            if value < least {
                return Err(InboxError::Config(format!(
                    "{name} must be at least {least:?}, not {value:?}"
                )));
            }
        }
        too_short([("purge_interval", self.purge_interval)]).map_err(InboxError::Config)?;
        // What the inbox adds up into deadlines, and sends to PostgreSQL as an `int` of
        // milliseconds: at most the relay's bound. (`gap_timeout`, `handler_timeout`,
        // `retention` and `purge_interval` have no upper bound: `Duration::MAX` means never.)
        too_long(
            "an inbox",
            [
                ("ack_wait", self.ack_wait),
                ("retry_delay", self.retry_delay),
                ("max_retry_delay", self.max_retry_delay),
                ("connect_timeout", self.connect_timeout),
                ("statement_timeout", self.statement_timeout),
            ],
        )
        .map_err(InboxError::Config)?;
        over_its_cap(self.retry_delay, self.max_retry_delay, "nak's")
            .map_err(InboxError::Config)?;
        let redeliveries = self.own_redelivery_time();
        if self.retention < redeliveries {
            return Err(InboxError::Config(format!(
                "retention {:?} is shorter than this consumer's own redeliveries can take \
                 ({redeliveries:?}: max_attempts x ack_wait plus the nak delays): a duplicate \
                 arriving after its id was purged would be handled again",
                self.retention
            )));
        }
        Ok(())
    }

    /// How long the consumer itself may go on delivering one message: `max_attempts` times
    /// `ack_wait` (each delivery may be redelivered after it) plus the nak delays between
    /// attempts (40 s with [`InboxConfig::new`]'s defaults; `Duration::MAX` where the sum
    /// overflows). The shortest `retention` [`Inbox::connect`] accepts: an id purged sooner
    /// could be handled again by a redelivery (see the module documentation's "Retention",
    /// which also names the producer relay's horizon and replays).
    pub fn own_redelivery_time(&self) -> Duration {
        self.ack_wait
            .saturating_mul(self.max_attempts)
            .saturating_add(self.naks_before(u64::from(self.max_attempts)))
    }

    /// The nak delays a message has waited through before its `deliveries`th delivery when
    /// each earlier one was nak'd with [`nak_delay`](Self::nak_delay) (`Duration::MAX` where
    /// the sum overflows).
    fn naks_before(&self, deliveries: u64) -> Duration {
        let naks = deliveries.saturating_sub(1);
        // The delays double up to nak `NAK_DOUBLINGS + 1`; the rest repeat the last.
        let doubling = naks.min(NAK_DOUBLINGS + 1);
        let doubled = (1..=doubling).fold(Duration::ZERO, |sum, n| {
            sum.saturating_add(self.nak_delay(n))
        });
        let repeated = u32::try_from(naks - doubling).unwrap_or(u32::MAX);
        doubled.saturating_add(self.nak_delay(doubling).saturating_mul(repeated))
    }

    /// The nak delay after `failures` handler failures: `retry_delay * 2^(failures - 1)`,
    /// capped at `max_retry_delay`.
    fn nak_delay(&self, failures: u64) -> Duration {
        let doublings = u32::try_from(failures.saturating_sub(1).min(NAK_DOUBLINGS))
            .expect("at most NAK_DOUBLINGS");
        self.retry_delay
            .saturating_mul(2_u32.saturating_pow(doublings))
            .min(self.max_retry_delay)
    }

    /// The nak delay of a message that waits for its predecessor, at its `deliveries`th
    /// delivery: 100 ms doubling to 1 s, so it comes back soon after the predecessor is
    /// applied.
    fn hold_delay(deliveries: u64) -> Duration {
        let doublings = u32::try_from(deliveries.saturating_sub(1).min(4)).unwrap_or(4);
        (Duration::from_millis(100) * 2_u32.pow(doublings)).min(Duration::from_secs(1))
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
    /// No connection to the database (within `connect_timeout`).
    #[error("inbox: {0}")]
    Connect(String),
    /// The inbox tables are missing or behind this version of the toolkit.
    #[error("inbox: {0}")]
    MissingMigrations(#[from] MissingMigrations),
    /// A query failed.
    #[error("inbox database error: {0}")]
    Database(#[from] diesel::result::Error),
    /// A query did not finish within `statement_timeout`.
    #[error("inbox: {0}")]
    TimedOut(#[from] TimedOut),
    /// An ack, nak or term did not reach JetStream.
    #[error("inbox could not settle a message: {0}")]
    Settle(String),
    /// An inbox task panicked or was aborted.
    #[error("inbox task did not finish: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The transaction of a replayed dead letter failed on the database's side, or its
    /// commit's outcome is unknown ([`Inbox::replay_dead_letter`]). (Not named `UnitOfWork`:
    /// a variant of that name makes rustc spell the type `outbox_runtime::UnitOfWork` in
    /// every diagnostic, the ui-tests' among them.)
    #[error("inbox: replaying a dead letter: {0}")]
    Replay(UnitOfWorkError),
}

impl From<Bounded<diesel::result::Error>> for InboxError {
    fn from(error: Bounded<diesel::result::Error>) -> Self {
        match error {
            Bounded::Failed(error) => Self::Database(error),
            Bounded::TimedOut(timed_out) => Self::TimedOut(timed_out),
        }
    }
}

/// What [`Inbox::replay_dead_letter`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Replayed {
    /// The handler applied the message, and its dead letter is deleted, in one transaction.
    Handled,
    /// The consumer has no such dead letter: never had, or it was replayed or discarded.
    NotFound,
    /// The handler failed again, or the message cannot be read or decoded: nothing changed,
    /// and the dead letter stays.
    Failed {
        /// Why, as a dead letter's `error` says it.
        error: String,
    },
}

/// What [`Inbox::replay_dead_letters`] did with the dead letters it took.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Applied by the handler, each with its dead letter deleted in its transaction.
    pub handled: usize,
    /// Gone before their turn: replayed or discarded meanwhile by someone else.
    pub not_found: usize,
    /// Those the handler failed again, or that cannot be read or decoded, in the order they
    /// were tried (oldest first): they stay dead letters, unchanged.
    pub failed: Vec<FailedReplay>,
}

/// A dead letter [`Inbox::replay_dead_letters`] could not apply: its key and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedReplay {
    /// The message's `ce-source` (empty when it had none).
    pub source: String,
    /// The message's id (`ce-id`, or `Nats-Msg-Id`).
    pub message_id: String,
    /// Why, as [`Replayed::Failed`] says it.
    pub error: String,
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
    /// The handler failed, or the database did, or the event is at a version newer than
    /// the handler reads ([`NewerVersions::Wait`]): nak, redelivered after `delay`.
    Retry {
        /// The nak delay.
        delay: Duration,
        /// What failed.
        error: String,
    },
    /// An earlier event of its aggregate has not been applied yet: nak, redelivered after
    /// `delay`, counting no failure.
    Held {
        /// The nak delay.
        delay: Duration,
        /// What it waits for.
        reason: String,
    },
    /// Recorded in the dead-letter table: term, never redelivered.
    DeadLettered {
        /// Why.
        error: String,
    },
}

impl Outcome {
    /// The outcome's name, as the `outcome` label of `outbox_inbox_messages_total`:
    /// `handled`, `duplicate`, `skipped`, `retry`, `held` or `dead_lettered`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Handled => "handled",
            Self::Duplicate => "duplicate",
            Self::Skipped { .. } => "skipped",
            Self::Retry { .. } => "retry",
            Self::Held { .. } => "held",
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
            Self::Retry { delay, .. } | Self::Held { delay, .. } => AckKind::Nak(Some(*delay)),
            Self::DeadLettered { .. } => AckKind::Term,
        };
        message
            .ack_with(kind)
            .await
            .map_err(|e| InboxError::Settle(e.to_string()))
    }
}

/// A processed delivery: its outcome, and whether to settle it (a test's crash point
/// leaves a message unsettled, as a process that died there would).
pub(crate) struct Processed {
    pub outcome: Outcome,
    pub settle: bool,
}

impl From<Outcome> for Processed {
    fn from(outcome: Outcome) -> Self {
        Self {
            outcome,
            settle: true,
        }
    }
}

/// What the transaction that applies a message does after recording it.
enum Body<E> {
    Handle(E),
    Skip(String),
    DeadLetter(String),
    /// At a version newer than the handler reads, left for an instance that reads it.
    Newer(String),
}

/// The most event types and versions newer than the handler reads that an instance warns
/// of ([`Inbox::warn_newer`]); it logs the others at debug level.
const MAX_WARNED_NEWER: usize = 64;

/// How long an event waits in place for its predecessor while the aggregate's position
/// does not move, before it is parked or nak'd (see [`Inbox::wait_for_predecessor`]).
const PREDECESSOR_STALL: Duration = Duration::from_millis(250);

/// The longest pause between two tries of an event waiting in place for its predecessor.
const PREDECESSOR_POLL: Duration = Duration::from_millis(16);

/// Why the transaction that applies a message did not commit.
enum Failure {
    /// The handler returned an error or panicked: counts toward `max_attempts`.
    Handler(String),
    /// The database (or the outbox's checks of the handler's events) failed.
    Outbox(UnitOfWorkError),
    /// The inbox's own query did not answer in time.
    TimedOut(TimedOut),
    /// An earlier event of the aggregate has not been applied.
    Gap { last_seq: i64, stream_sequence: i64 },
    /// A later event of the aggregate was applied already.
    Late { last_seq: i64 },
    /// The event is at a version newer than the handler reads: left for an instance that
    /// reads it, counting no failure.
    Newer(String),
    /// A test's crash point.
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    Crash,
}

impl From<UnitOfWorkError> for Failure {
    fn from(error: UnitOfWorkError) -> Self {
        Self::Outbox(error)
    }
}

impl From<diesel::result::Error> for Failure {
    fn from(error: diesel::result::Error) -> Self {
        Self::Outbox(UnitOfWorkError::from_database(error))
    }
}

impl From<Bounded<diesel::result::Error>> for Failure {
    fn from(error: Bounded<diesel::result::Error>) -> Self {
        match error {
            Bounded::Failed(error) => error.into(),
            Bounded::TimedOut(timed_out) => Self::TimedOut(timed_out),
        }
    }
}

impl From<Bounded<UnitOfWorkError>> for Failure {
    fn from(error: Bounded<UnitOfWorkError>) -> Self {
        match error {
            Bounded::Failed(error) => Self::Outbox(error),
            Bounded::TimedOut(timed_out) => Self::TimedOut(timed_out),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Handler(error) => write!(f, "handler failed: {error}"),
            Self::Outbox(error) => write!(f, "{error}"),
            Self::TimedOut(timed_out) => write!(f, "{timed_out}"),
            Self::Gap { last_seq, .. } => {
                write!(
                    f,
                    "an earlier event of its aggregate (after {last_seq}) is not applied"
                )
            }
            Self::Late { last_seq } => write!(
                f,
                "it arrived after event {last_seq} of its aggregate was applied; applying it \
                 now would break the aggregate's order"
            ),
            Self::Newer(reason) => f.write_str(reason),
            Self::Crash => f.write_str("simulated crash (a test's crash point)"),
        }
    }
}

impl Failure {
    /// Whether the failure is the handler's (its error, its panic, its events that the
    /// outbox refused, or its ending the transaction): those count toward `max_attempts`.
    /// The database's failures and timeouts do not.
    fn is_handlers(&self) -> bool {
        match self {
            Self::Handler(_) => true,
            Self::Outbox(error) => !matches!(
                error,
                UnitOfWorkError::Database(_)
                    | UnitOfWorkError::MissingPrivilege { .. }
                    | UnitOfWorkError::CommitOutcomeUnknown { .. }
                    | UnitOfWorkError::MissingMigrations(_)
            ),
            _ => false,
        }
    }
}

struct Shared<H, C: InboxConnection> {
    config: InboxConfig,
    /// The consumer's subject filters ([`InboxConfig::filters`]).
    filters: Vec<String>,
    /// The consumer has no filter on the server (created so where `filters` took every
    /// subject of the stream, [`takes_whole_stream`], or found so): a message under none of
    /// `filters`, of a subject the stream captured since, is skipped here, as a filter would
    /// have left it out.
    unfiltered: bool,
    /// Whether a message outside the filters was skipped (and warned of) yet.
    skipped_outside: AtomicBool,
    /// The event types and versions newer than the handler reads that were warned of.
    warned_newer: Mutex<HashSet<(String, i32)>>,
    /// The database URL without its password.
    target: String,
    handler: H,
    pool: C::Pool,
    stream: jetstream::stream::Stream,
    consumer: jetstream::consumer::PullConsumer,
    /// The consumer's settings as `connect` left them: what it is created again with.
    consumer_config: pull::Config,
    /// What the instance knows of the consumer's progress, and in which stream.
    ack_floor: Mutex<AckFloor>,
}

/// The consumer's ack floor when last read: every message at or below it is settled, so a
/// predecessor lookup starts above it, and a consumer created again delivers from above it.
struct AckFloor {
    /// A stream sequence.
    sequence: u64,
    /// When it was read; `None`: read it again before it is used.
    read_at: Option<Instant>,
    /// When the stream it counts in was created (nanoseconds since the Unix epoch, as
    /// JetStream reports it): a stream deleted and created again starts its sequences over.
    stream_created: i128,
    /// When the consumer it was read from was created (the same unit), or 0 when not known: a
    /// consumer created since may be in a stream created since, by another instance, and
    /// then the stream is read again before the floor is attributed to it.
    consumer_created: i128,
}

/// An idempotent consumer: a handler behind the inbox, on the connection `C` (PostgreSQL's
/// unless said otherwise; `Inbox<H, AsyncMysqlConnection>` on MySQL or MariaDB, `Inbox<H,
/// AsyncSqliteConnection>` on SQLite). Create it with [`Inbox::connect`], then
/// [`spawn`](Inbox::spawn) it or [`run`](Inbox::run) it.
#[cfg(feature = "postgres")]
pub struct Inbox<H: Handler<C>, C: InboxConnection = AsyncPgConnection> {
    shared: Arc<Shared<H, C>>,
}

/// An idempotent consumer: a handler behind the inbox, on the connection `C`
/// (`Inbox<H, AsyncMysqlConnection>` on MySQL or MariaDB, `Inbox<H, AsyncSqliteConnection>`
/// on SQLite). Create it with [`Inbox::connect`], then [`spawn`](Inbox::spawn) it or
/// [`run`](Inbox::run) it.
#[cfg(not(feature = "postgres"))]
pub struct Inbox<H: Handler<C>, C: InboxConnection> {
    shared: Arc<Shared<H, C>>,
}

impl<H: Handler<C>, C: InboxConnection> Clone for Inbox<H, C> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<H: Handler<C>, C: InboxConnection> Inbox<H, C> {
    /// Checks the configuration, gets or creates the durable pull consumer (explicit acks,
    /// `ack_wait`, `max_ack_pending`, the filter subjects, unlimited deliveries: the inbox
    /// counts handler failures itself; no pull request limits, `max_batch` and
    /// `max_expires`; whole messages, not headers only; an existing consumer's filter and
    /// acks are checked, and these other settings updated to the inbox's), opens the database
    /// pool and checks that the inbox's role holds the privileges it needs (PostgreSQL: see
    /// the `privileges` module), that the inbox tables are migrated, and that the database
    /// takes writes (an update of no rows).
    ///
    /// Where the filters take every subject the stream captures (the default, `{prefix}.>`,
    /// on the topology's stream), the consumer is created without a filter: it gets the same
    /// messages, and nats-server before 2.9.15 spends up to ten times less CPU on each (a
    /// filtered consumer can make it count the pending messages by their subjects, one
    /// partition key each, for every message it delivers; BENCHMARKS.md, "Consumer
    /// instances"). An existing consumer without a filter is taken as it is, and a message of
    /// a subject the stream captured since, under none of the filters, is skipped
    /// ([`Outcome::Skipped`], acked). An existing consumer with filters must have these.
    ///
    /// # Errors
    /// [`InboxError::Config`] (also for a `database_url` that is empty without a `connector`
    /// or names another database than `C`'s, or a `connector` on MySQL or SQLite),
    /// [`InboxError::Consumer`] (the stream is missing: the producer's relay creates it when
    /// it starts, so an inbox connected before any relay ran is refused saying so; no
    /// JetStream at the server
    /// ([`NO_JETSTREAM`](crate::nats::NO_JETSTREAM)); or an existing consumer of that name
    /// has other filter subjects, or acks other than explicitly),
    /// [`InboxError::Connect`] (also for a database that takes no writes: a hot standby
    /// or a replica, a role without them, a read-only SQLite file, named as such; for a
    /// SQLite file that does not exist, which it does not make; and for a PostgreSQL role
    /// that lacks privileges, naming each),
    /// [`InboxError::MissingMigrations`] or [`InboxError::TimedOut`].
    pub async fn connect(
        config: InboxConfig,
        nats: async_nats::Client,
        handler: H,
    ) -> Result<Self, InboxError> {
        config.validate()?;
        check_database::<C>(&config)?;
        describe_metrics();
        let consumer_error = |message: String| InboxError::Consumer {
            consumer: config.consumer.clone(),
            stream: config.topology.stream.name.clone(),
            message,
        };
        let filters = config.filters();
        if filters.len() > 1 {
            let version = nats.server_info().version;
            if !supports_filter_subjects(&version) {
                return Err(InboxError::Config(format!(
                    "{} filter subjects need nats-server 2.10 or later (a consumer's \
                     filter_subjects), and the server is {version}; use one filter, or one \
                     consumer per filter",
                    filters.len()
                )));
            }
        }
        let stream = config
            .topology
            .stream
            .jetstream(nats)
            .get_stream(&config.topology.stream.name)
            .await
            .map_err(|e| {
                consumer_error(if crate::nats::stream_not_found(&e) {
                    let place =
                        crate::publisher::in_domain(config.topology.stream.domain.as_deref());
                    format!(
                        "the stream does not exist (yet){place}: the producer's relay creates it \
                         when it starts; start a relay first, or connect again once one runs"
                    )
                } else {
                    config.topology.stream.api_error_text(&e)
                })
            })?;
        // Where the filters take every subject of the stream, the consumer has none: the same
        // messages, and far less of an older nats-server's time (see `takes_whole_stream`).
        let stream_config = &stream.cached_info().config;
        let whole_stream = takes_whole_stream(stream_config, &filters);
        let (filter_subject, filter_subjects) = match filters.as_slice() {
            _ if whole_stream => (String::new(), Vec::new()),
            [one] => (one.clone(), Vec::new()),
            several => (String::new(), several.to_vec()),
        };
        let wanted = pull::Config {
            durable_name: Some(config.consumer.clone()),
            filter_subject,
            filter_subjects,
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_deliver: -1,
            max_ack_pending: i64::try_from(config.max_ack_pending).unwrap_or(i64::MAX),
            ..Default::default()
        };
        let mut consumer: jetstream::consumer::PullConsumer = stream
            .get_or_create_consumer(&config.consumer, wanted.clone())
            .await
            .map_err(|e| consumer_error(e.to_string()))?;
        let existing = consumer
            .info()
            .await
            .map_err(|e| consumer_error(e.to_string()))?
            .config
            .clone();
        unfit_consumer(&existing).map_err(consumer_error)?;
        // A consumer without a filter, created so, takes what the filters take and whatever
        // subjects the stream captured since: the inbox skips those (`process_held`). One with
        // filters must have these.
        let unfiltered = existing.filter_subject.is_empty() && existing.filter_subjects.is_empty();
        if unfiltered {
            if !whole_stream {
                tracing::warn!(
                    consumer = %config.consumer,
                    stream = %config.topology.stream.name,
                    stream_subjects = ?stream_config.subjects,
                    ?filters,
                    "the consumer has no filter and the stream captures more than the filters \
                     take: JetStream delivers those messages too, and the inbox skips (acks) \
                     them"
                );
            }
        } else {
            let mut existing_filters = if existing.filter_subjects.is_empty() {
                vec![existing.filter_subject.clone()]
            } else {
                existing.filter_subjects.clone()
            };
            existing_filters.sort();
            let mut wanted_filters = filters.clone();
            wanted_filters.sort();
            if existing_filters != wanted_filters {
                return Err(consumer_error(format!(
                    "the consumer exists with filter subjects {existing_filters:?}, not \
                     {wanted_filters:?}; delete it (`nats consumer rm`) once every instance \
                     with the old filters has stopped (a running one creates it again with \
                     them) to have the next connect deliver the whole stream under the new \
                     filters (what the consumer handled within its retention is dropped as a \
                     duplicate; any other event of an aggregate up to the position the \
                     consumer reached in it, of a newly taken subject too, is dead-lettered as \
                     late, never applied out of order; any other message without an aggregate \
                     is handled), or choose another consumer name, which handles the whole \
                     stream as new"
                )));
            }
        }
        // Pull request limits (`max_batch`, `max_expires`; none on a consumer the inbox
        // creates) under what the inbox asks for make JetStream refuse each of its pulls
        // ("Exceeded MaxRequestBatch", "Exceeded MaxRequestExpires"), and headers only leave
        // no event to decode: set to the inbox's like the rest.
        let outdated = existing.ack_wait != wanted.ack_wait
            || existing.max_deliver != wanted.max_deliver
            || existing.max_ack_pending != wanted.max_ack_pending
            || existing.max_batch != wanted.max_batch
            || existing.max_expires != wanted.max_expires
            || existing.headers_only != wanted.headers_only;
        if outdated {
            let mut updated = existing.clone();
            updated.ack_wait = wanted.ack_wait;
            updated.max_deliver = wanted.max_deliver;
            updated.max_ack_pending = wanted.max_ack_pending;
            updated.max_batch = wanted.max_batch;
            updated.max_expires = wanted.max_expires;
            updated.headers_only = wanted.headers_only;
            consumer = stream
                .update_consumer(updated_pull_config(&updated))
                .await
                .map_err(|e| consumer_error(format!("updating its settings: {e}")))?;
        }
        let ack_floor = AckFloor {
            sequence: consumer.cached_info().ack_floor.stream_sequence,
            read_at: Some(Instant::now()),
            stream_created: stream.cached_info().created.unix_timestamp_nanos(),
            consumer_created: consumer.cached_info().created.unix_timestamp_nanos(),
        };
        let consumer_config = updated_pull_config(&consumer.cached_info().config);

        let target = database::redacted(&config.database_url);
        let pool = C::pool(
            config.database_url.clone(),
            Session::of(&config),
            config.max_concurrency,
        )
        .map_err(InboxError::Connect)?;
        let mut conn = C::pooled(&pool).await.map_err(InboxError::Connect)?;
        // A role without a privilege the inbox needs is named now, where every message
        // would fail with "permission denied" and come again, unhandled.
        match database::bounded(
            config.statement_timeout,
            &target,
            "the privileges check",
            conn.lacking_privileges(),
        )
        .await
        {
            Ok(None) => {}
            Ok(Some(lacking)) => {
                return Err(InboxError::Connect(
                    ConnectError {
                        target: target.to_string(),
                        reason: format!("checking the inbox's privileges: {lacking}"),
                    }
                    .to_string(),
                ));
            }
            Err(Bounded::Failed(error)) => return Err(error.into()),
            Err(Bounded::TimedOut(timed_out)) => return Err(timed_out.into()),
        }
        match database::bounded(
            config.statement_timeout,
            &target,
            "the migrations check",
            conn.missing_migrations(),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(missing)) => return Err(missing.into()),
            Err(Bounded::Failed(error)) => return Err(error.into()),
            Err(Bounded::TimedOut(timed_out)) => return Err(timed_out.into()),
        }
        // The inbox's first write, of no rows: a database that takes none (a replica's URL,
        // a role or a file without writes) is named now, where every message would fail
        // and come again, unhandled, for as long as the inbox runs.
        match database::bounded(
            config.statement_timeout,
            &target,
            "the write check",
            conn.batch_execute(WRITE_CHECK),
        )
        .await
        {
            Ok(()) => {}
            Err(Bounded::Failed(error)) => {
                return Err(InboxError::Connect(
                    ConnectError {
                        target: target.to_string(),
                        reason: format!(
                            "checking that the inbox can write its tables: {error}{}",
                            database::refusal_hint(&error, C::KIND, "inbox")
                        ),
                    }
                    .to_string(),
                ));
            }
            Err(Bounded::TimedOut(timed_out)) => return Err(timed_out.into()),
        }
        // A durable consumer that has delivered nothing, of a consumer that applied events
        // before: JetStream's consumer is new (deleted, or lost with a server's store), and
        // the stream comes again from its first message.
        let info = consumer.cached_info();
        if info.delivered.stream_sequence == 0 && info.num_pending > 0 {
            let applied_before = database::bounded(
                config.statement_timeout,
                &target,
                "looking for the consumer's positions",
                conn.has_positions(&config.consumer),
            )
            .await?;
            if applied_before {
                tracing::warn!(
                    consumer = %config.consumer,
                    stream = %config.topology.stream.name,
                    pending = info.num_pending,
                    "the durable consumer is new, and this consumer applied events before: \
                     it delivers the stream again from its first message; what it handled \
                     within its retention is dropped as a duplicate, any other event of an \
                     aggregate up to the position the consumer reached in it is dead-lettered \
                     as late, and a message without an aggregate handled longer ago is \
                     handled again"
                );
            }
        }
        drop(conn);

        Ok(Self {
            shared: Arc::new(Shared {
                filters,
                unfiltered,
                skipped_outside: AtomicBool::new(false),
                warned_newer: Mutex::default(),
                config,
                target,
                handler,
                pool,
                stream,
                consumer,
                consumer_config,
                ack_floor: Mutex::new(ack_floor),
            }),
        })
    }

    /// The durable JetStream consumer, for fetching messages by hand.
    pub fn consumer(&self) -> &jetstream::consumer::PullConsumer {
        &self.shared.consumer
    }

    /// Runs the consumer in a tokio task until [`InboxHandle::shutdown`].
    pub fn spawn(self) -> InboxHandle {
        InboxHandle(Spawned::new(|shutdown| self.run(shutdown)))
    }

    /// Consumes until `shutdown` completes, then stops pulling, naks the messages it holds
    /// and has not started (JetStream redelivers them at once, to another instance or the
    /// next one), lets the messages in progress finish and settle, and returns.
    /// Dropped before it returns (a `tokio::select!` whose other branch won), it stops its
    /// tasks, and what it held comes again after `ack_wait`. A connection a message's
    /// transaction was open on is closed at once (the database rolls the transaction back and
    /// frees the aggregate's position it locked); the pool's idle ones close with the last
    /// clone of the inbox.
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
    /// [`Outcome::DeadLettered`] at the last attempt), as is an event at a version newer
    /// than the handler reads.
    pub async fn process(&self, message: &jetstream::Message) -> Result<Outcome, InboxError> {
        Ok(self
            .process_held(message, Duration::ZERO, &CancellationToken::new())
            .await
            .outcome)
    }

    /// [`process`](Self::process), for a message that has waited `held_for` for its
    /// predecessor so far. `earlier_here` is cancelled when an earlier message of the same
    /// aggregate reaches this instance meanwhile: the message then stops waiting in place
    /// for its predecessor (see [`Self::wait_for_predecessor`]).
    pub(crate) async fn process_held(
        &self,
        message: &jetstream::Message,
        held_for: Duration,
        earlier_here: &CancellationToken,
    ) -> Processed {
        let config = &self.shared.config;
        if self.shared.unfiltered
            && !self
                .shared
                .filters
                .iter()
                .any(|filter| order::covers(filter, &message.subject))
        {
            let reason = format!(
                "subject {:?} is under none of the inbox's filters {:?} (its consumer has no \
                 filter on the server, and the stream captures more)",
                message.subject.as_str(),
                self.shared.filters
            );
            // Once per instance: a stream that captures another service's subjects would
            // otherwise log each of its messages.
            if !self.shared.skipped_outside.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    consumer = %config.consumer, %reason,
                    "skipping a message, and the next ones outside the filters without a warning"
                );
            } else {
                tracing::debug!(consumer = %config.consumer, %reason, "skipping a message");
            }
            return Outcome::Skipped { reason }.into();
        }
        let metadata = match Metadata::read(message) {
            Ok(metadata) => metadata,
            Err(unreadable) => {
                let error = unreadable.to_string();
                if config.unreadable == Unreadable::Skip {
                    tracing::warn!(subject = %message.subject, %error, "skipping an unreadable message");
                    return Outcome::Skipped { reason: error }.into();
                }
                return self.dead_letter_unread(message, error).await.into();
            }
        };
        #[cfg(not(feature = "opentelemetry"))]
        let span = tracing::debug_span!(
            "inbox message",
            consumer = %config.consumer,
            id = %metadata.id,
            event_type = %metadata.event_type,
            deliveries = metadata.deliveries,
        );
        // The consumer span of the message's trace, in place of the one above: the handler's
        // unit of work takes its context.
        #[cfg(feature = "opentelemetry")]
        let span = crate::telemetry::consumer_span(&config.consumer, &metadata, message);
        self.process_read(message, &metadata, held_for, earlier_here)
            .instrument(span)
            .await
    }

    /// What the transaction does with the message: decoded again for each attempt (a
    /// transaction that found a gap rolled back before the handler took the event).
    fn body(&self, message: &jetstream::Message, metadata: &Metadata) -> Body<H::Event> {
        let config = &self.shared.config;
        match H::Event::decode(
            &metadata.event_type,
            metadata.event_version,
            &message.payload,
        ) {
            Ok(event) => Body::Handle(event),
            Err(error) => {
                if let Some(newest) = error.newest_version_read() {
                    let reason = format!(
                        "{error}; version {} is newer than {newest}, the newest this \
                         consumer reads",
                        metadata.event_version
                    );
                    // Its naks so far, wherever they were: each instance naks it so.
                    let waited = config.naks_before(metadata.deliveries);
                    return match config.newer_versions {
                        NewerVersions::Wait if waited < config.gap_timeout => Body::Newer(format!(
                            "{reason}: left for a release of the consumer that reads it"
                        )),
                        NewerVersions::Wait => Body::DeadLetter(format!(
                            "{reason}, and no release that reads it took it within gap_timeout \
                             ({:?})",
                            config.gap_timeout
                        )),
                        NewerVersions::DeadLetter => Body::DeadLetter(reason),
                    };
                }
                let skip = match error {
                    PayloadError::UnknownEventType { .. } => {
                        config.unknown_events == UnknownEvents::Skip
                    }
                    PayloadError::Json { .. } | PayloadError::Upcast { .. } => {
                        config.unreadable == Unreadable::Skip
                    }
                };
                if skip {
                    Body::Skip(error.to_string())
                } else {
                    Body::DeadLetter(error.to_string())
                }
            }
        }
    }

    /// Warns that an event at a version newer than the handler reads was left for another
    /// instance: once per instance and event type and version (each such message comes
    /// back with its nak delay, for as long as no instance reads it), at debug level after.
    /// Remembers at most [`MAX_WARNED_NEWER`] of them: messages of made-up versions grow
    /// no set.
    fn warn_newer(&self, metadata: &Metadata, reason: &str, delay: Duration) {
        let first = {
            let mut warned = self
                .shared
                .warned_newer
                .lock()
                .expect("never poisoned: no code panics holding it");
            warned.len() < MAX_WARNED_NEWER
                && warned.insert((metadata.event_type.clone(), metadata.event_version))
        };
        if first {
            tracing::warn!(
                %reason, ?delay,
                "an event newer than this consumer reads waits for a release that reads it, \
                 up to gap_timeout; the next ones of this type and version without a warning"
            );
        } else {
            tracing::debug!(%reason, ?delay, "an event newer than this consumer reads waits");
        }
    }

    /// [`process`](Self::process), once the metadata is read.
    async fn process_read(
        &self,
        message: &jetstream::Message,
        metadata: &Metadata,
        held_for: Duration,
        earlier_here: &CancellationToken,
    ) -> Processed {
        let config = &self.shared.config;
        let mut result = self
            .apply(message, metadata, self.body(message, metadata), None)
            .await;
        if let Err(Failure::Gap {
            last_seq,
            stream_sequence,
        }) = result
        {
            let gap = match self
                .look_for_predecessor(metadata, last_seq, stream_sequence)
                .await
            {
                Ok(gap) => Some(gap),
                Err(predecessor) if held_for < config.gap_timeout => {
                    result = self
                        .wait_for_predecessor(
                            message,
                            metadata,
                            (last_seq, stream_sequence),
                            earlier_here,
                        )
                        .await;
                    if let Err(Failure::Gap { .. }) = result {
                        let delay = InboxConfig::hold_delay(metadata.deliveries);
                        tracing::debug!(%predecessor, ?delay, "waiting for an earlier event of the aggregate");
                        return Outcome::Held {
                            delay,
                            reason: predecessor,
                        }
                        .into();
                    }
                    None
                }
                Err(predecessor) => Some(Gap {
                    reason: format!(
                        "{predecessor}, and it did not settle within gap_timeout ({:?})",
                        config.gap_timeout
                    ),
                    record: true,
                }),
            };
            if let Some(gap) = gap {
                result = self
                    .apply(message, metadata, self.body(message, metadata), Some(&gap))
                    .await;
            }
        }
        let failure = match result {
            Ok(outcome) => return outcome.into(),
            Err(failure) => failure,
        };
        match failure {
            Failure::Crash => Processed {
                outcome: Outcome::Retry {
                    delay: Duration::ZERO,
                    error: failure.to_string(),
                },
                settle: false,
            },
            Failure::Late { .. } => self
                .dead_letter_unordered(message, Some(metadata), failure.to_string())
                .await
                .into(),
            Failure::Gap { .. } => Outcome::Held {
                delay: InboxConfig::hold_delay(metadata.deliveries),
                reason: failure.to_string(),
            }
            .into(),
            Failure::Newer(reason) => {
                let delay = config.nak_delay(metadata.deliveries);
                self.warn_newer(metadata, &reason, delay);
                Outcome::Retry {
                    delay,
                    error: reason,
                }
                .into()
            }
            failure if failure.is_handlers() => self
                .handler_failed(message, metadata, failure.to_string())
                .await
                .into(),
            failure => {
                let delay = config.retry_delay;
                // A database that stopped taking writes (a primary demoted under a fixed
                // address), or a privilege revoked from the inbox's role, is named as such,
                // with what to do.
                let hint = match &failure {
                    Failure::Outbox(UnitOfWorkError::Database(error)) => {
                        database::refusal_hint(error, C::KIND, "inbox")
                    }
                    _ => String::new(),
                };
                let error = format!("{failure}{hint}");
                tracing::warn!(%error, ?delay, "the inbox's database failed; the message will be redelivered");
                Outcome::Retry { delay, error }.into()
            }
        }
    }

    /// Waits here for an event whose predecessor is in the stream and not applied, trying
    /// it again as the aggregate's position moves: the predecessor is most often being
    /// applied by another instance right now (JetStream hands each instance its own run of
    /// a busy aggregate's messages), and commits within milliseconds, where a nak would cost
    /// its delay. Gives up, returning the last [`Failure::Gap`], when the position has not
    /// moved for [`PREDECESSOR_STALL`] (the predecessor waits for a redelivery or a retry of
    /// its own: the event is then parked or nak'd, freeing its handler slot), after a
    /// third of `ack_wait` in all, or at once when `earlier_here` is cancelled: an earlier
    /// message of the aggregate reached this instance, where it waits until this event's
    /// handling ends (one message of an aggregate at a time), so that waiting would only
    /// stall the aggregate for [`PREDECESSOR_STALL`].
    async fn wait_for_predecessor(
        &self,
        message: &jetstream::Message,
        metadata: &Metadata,
        (mut last_seq, mut stream_sequence): (i64, i64),
        earlier_here: &CancellationToken,
    ) -> Result<Outcome, Failure> {
        let started = tokio::time::Instant::now();
        let limit = self.shared.config.ack_wait / 3;
        let mut moved = started;
        let mut pause = Duration::from_millis(1);
        loop {
            tokio::select! {
                biased;
                // The earlier message waits behind this one in the instance, where it cannot
                // run until this one ends: waiting would only stall the aggregate.
                () = earlier_here.cancelled() => {
                    return Err(Failure::Gap { last_seq, stream_sequence });
                }
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(PREDECESSOR_POLL);
            let result = self
                .apply(message, metadata, self.body(message, metadata), None)
                .await;
            let now = tokio::time::Instant::now();
            match result {
                Err(Failure::Gap {
                    last_seq: seq,
                    stream_sequence: at,
                }) if now - started < limit && now - moved < PREDECESSOR_STALL => {
                    if seq > last_seq {
                        (last_seq, stream_sequence, moved, pause) =
                            (seq, at, now, Duration::from_millis(1));
                    }
                }
                result => return result,
            }
        }
    }

    /// Counts a handler failure; dead-letters the message at `max_attempts`, else retries it.
    async fn handler_failed(
        &self,
        message: &jetstream::Message,
        metadata: &Metadata,
        error: String,
    ) -> Outcome {
        let config = &self.shared.config;
        let key = self.key(metadata);
        let counted = async {
            let mut conn = self.connection().await?;
            database::bounded(
                config.statement_timeout,
                &self.shared.target,
                "counting a handler failure",
                conn.count_failure(key, &error),
            )
            .await
            .map_err(Failure::from)
        };
        let failures = match counted.await {
            Ok(failures) => failures,
            Err(count_error) => {
                tracing::warn!(%error, %count_error, "a handler failed, and counting it failed too; retrying");
                return Outcome::Retry {
                    delay: config.retry_delay,
                    error,
                };
            }
        };
        if failures < config.max_attempts {
            let delay = config.nak_delay(u64::from(failures));
            tracing::warn!(%error, failures, ?delay, "handling failed; the message will be redelivered");
            return Outcome::Retry { delay, error };
        }
        let error = format!(
            "{error} (failed {failures} times; max_attempts {})",
            config.max_attempts
        );
        match self
            .apply(message, metadata, Body::DeadLetter(error.clone()), None)
            .await
        {
            Ok(outcome) => outcome,
            Err(failure @ Failure::Late { .. }) => {
                self.dead_letter_unordered(message, Some(metadata), failure.to_string())
                    .await
            }
            Err(failure) => {
                tracing::warn!(%failure, "cannot record a dead letter; retrying the message");
                Outcome::Retry {
                    delay: config.retry_delay,
                    error: format!("{error}; and recording it as a dead letter failed: {failure}"),
                }
            }
        }
    }

    fn key<'m>(&'m self, metadata: &'m Metadata) -> MessageKey<'m> {
        MessageKey {
            consumer: &self.shared.config.consumer,
            source: metadata.source.as_deref().unwrap_or_default(),
            message_id: &metadata.id,
        }
    }

    fn place<'m>(metadata: &'m Metadata) -> Option<Place<'m>> {
        let (aggregate_type, aggregate_id, seq) = metadata.place()?;
        Some(Place {
            aggregate_type,
            aggregate_id,
            seq,
            stream_sequence: i64::try_from(metadata.stream_sequence).unwrap_or(i64::MAX),
        })
    }

    async fn connection(&self) -> Result<C::Pooled, Failure> {
        C::pooled(&self.shared.pool)
            .await
            .map_err(|e| Failure::Outbox(UnitOfWorkError::Database(pool_error(e))))
    }

    /// The transaction that applies a message: record it (and move its aggregate's
    /// position, or find that it is not the next one), then handle, skip or dead-letter it,
    /// and commit. `gap`: the caller found that the events before it will not come.
    async fn apply(
        &self,
        message: &jetstream::Message,
        metadata: &Metadata,
        body: Body<H::Event>,
        gap: Option<&Gap>,
    ) -> Result<Outcome, Failure> {
        let shared = &*self.shared;
        let (limit, target) = (shared.config.statement_timeout, shared.target.as_str());
        let key = self.key(metadata);
        let place = Self::place(metadata);
        let mut conn = self.connection().await?;
        let causality = Causality::caused_by(
            &metadata.id,
            metadata.correlation_id.as_deref(),
            metadata.traceparent.as_ref(),
        );
        shared
            .config
            .outbox
            .transaction_with(&mut *conn, causality, async |uow| {
                let recorded = database::bounded(
                    limit,
                    target,
                    "recording a message in the inbox",
                    uow.conn().record(key, place, gap.is_some()),
                )
                .await?;
                match recorded {
                    Recorded::Duplicate => return Ok(Outcome::Duplicate),
                    Recorded::Gap {
                        last_seq,
                        stream_sequence,
                    } => {
                        return Err(Failure::Gap {
                            last_seq,
                            stream_sequence,
                        });
                    }
                    Recorded::Late { last_seq } => return Err(Failure::Late { last_seq }),
                    Recorded::Next { previous_seq } => {
                        // Recorded only when the position did jump: the predecessor may have
                        // been applied since the lookup.
                        let jumped = previous_seq.zip(place).and_then(|(previous, place)| {
                            (previous < place.seq - 1).then_some((previous, place))
                        });
                        if let (Some(gap), Some((previous, place))) =
                            (gap.filter(|gap| gap.record), jumped)
                        {
                            tracing::warn!(
                                aggregate_type = place.aggregate_type,
                                aggregate_id = place.aggregate_id,
                                after = previous, next = place.seq, reason = %gap.reason,
                                "applying an event over a gap in its aggregate's sequence"
                            );
                            metrics::counter!(
                                "outbox_inbox_gaps_total",
                                "consumer" => shared.config.consumer.clone()
                            )
                            .increment(1);
                            database::bounded(
                                limit,
                                target,
                                "recording a gap",
                                uow.conn().insert_gap(key, place, previous, &gap.reason),
                            )
                            .await?;
                        }
                    }
                }
                match body {
                    Body::Handle(event) => {
                        self.handle(event, metadata, uow).await?;
                        crash_point!("inbox::before_commit", |_| Err(Failure::Crash));
                        // The outbox's flush checks the transaction too; without events, the
                        // COMMIT does where it can, else this statement, which also forgets
                        // a retried message's failed attempts.
                        let retried = metadata.deliveries > 1;
                        if retried || (uow.event_count() == 0 && !uow.check_at_commit()) {
                            database::bounded(
                                limit,
                                target,
                                "finishing a handled message",
                                uow.conn().finish(key, retried),
                            )
                            .await?;
                        }
                        Ok(Outcome::Handled)
                    }
                    Body::Skip(reason) => {
                        tracing::warn!(%reason, "skipping a message by policy");
                        Ok(Outcome::Skipped { reason })
                    }
                    // Not recorded: the rollback undoes the record and the position's move.
                    Body::Newer(reason) => Err(Failure::Newer(reason)),
                    Body::DeadLetter(error) => {
                        let headers = message::headers_json(message);
                        let subject = message::storable_text(&message.subject);
                        let letter = store::DeadLetter {
                            key,
                            subject: &subject,
                            headers: &headers,
                            payload: &message.payload,
                            error: &message::storable_text(&error),
                            deliveries: i64::try_from(metadata.deliveries).unwrap_or(i64::MAX),
                            stream_sequence: i64::try_from(metadata.stream_sequence)
                                .unwrap_or(i64::MAX),
                        };
                        database::bounded(
                            limit,
                            target,
                            "recording a dead letter",
                            uow.conn().insert_dead_letter(&letter),
                        )
                        .await?;
                        tracing::error!(message_id = %metadata.id, %error, "dead-lettered a message");
                        Ok(Outcome::DeadLettered { error })
                    }
                }
            })
            .await
    }

    /// Runs the handler on `event` within `handler_timeout`: its error, its panic or its
    /// timeout is a [`Failure::Handler`].
    async fn handle(
        &self,
        event: H::Event,
        metadata: &Metadata,
        uow: &mut UnitOfWork<'_, C>,
    ) -> Result<(), Failure> {
        let handler_timeout = self.shared.config.handler_timeout;
        let handled = tokio::time::timeout(
            handler_timeout,
            AssertUnwindSafe(self.shared.handler.handle(event, metadata, uow)).catch_unwind(),
        )
        .await;
        match handled {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(error))) => Err(Failure::Handler(error.to_string())),
            Err(_) => Err(Failure::Handler(format!(
                "the handler did not return within handler_timeout ({handler_timeout:?})"
            ))),
            Ok(Err(panic)) => Err(Failure::Handler(format!(
                "the handler panicked: {}",
                panic_message(&panic)
            ))),
        }
    }

    /// Applies this consumer's dead letter of the message `message_id` from `source` (empty
    /// for a message without `ce-source`) now, once a fix is deployed: decodes the message as
    /// it was received and runs the handler on it, in one transaction that also deletes the
    /// dead letter (and the message's failed attempts), so two replays of it never both
    /// apply it. The event is applied where it stands, outside its aggregate's order: the
    /// consumer's position in the aggregate does not move, and later events applied since
    /// stay applied. Replaying is the operator's decision that this is right for the event
    /// (an effect that does not depend on order, or a late one); otherwise deal with the
    /// dead letter by hand and [`discard_dead_letter`] it. The handler's events are caused by
    /// the message, as when it is delivered.
    ///
    /// # Errors
    /// [`InboxError::Connect`] without a connection from the pool; [`InboxError::Database`]
    /// when the dead letter cannot be read; [`InboxError::Replay`] when the transaction
    /// fails on the database's side (nothing changed) or its commit's outcome is unknown;
    /// [`InboxError::TimedOut`] for one of the inbox's statements over `statement_timeout`.
    /// A handler that fails again, and a message that cannot be read or decoded, are
    /// [`Replayed::Failed`], not errors.
    pub async fn replay_dead_letter(
        &self,
        source: &str,
        message_id: &str,
    ) -> Result<Replayed, InboxError> {
        let shared = &*self.shared;
        let (limit, target) = (shared.config.statement_timeout, shared.target.as_str());
        let consumer = shared.config.consumer.as_str();
        let mut conn = C::pooled(&shared.pool).await.map_err(InboxError::Connect)?;
        let read = letters::dead_letter(&mut *conn, consumer, source, message_id);
        let letter = database::bounded(limit, target, "reading a dead letter", read).await;
        let Some(letter) = letter? else {
            return Ok(Replayed::NotFound);
        };
        let subject = letter.letter.subject.clone();
        let headers = message::headers_from_json(&letter.headers);
        let stream_sequence = u64::try_from(letter.letter.stream_sequence).unwrap_or(0);
        let deliveries = u64::try_from(letter.letter.deliveries).unwrap_or(1);
        let metadata = match Metadata::from_headers(subject, &headers, stream_sequence, deliveries)
        {
            Ok(metadata) => metadata,
            Err(unreadable) => {
                return Ok(Replayed::Failed {
                    error: unreadable.to_string(),
                });
            }
        };
        let event = match H::Event::decode(
            &metadata.event_type,
            metadata.event_version,
            &letter.payload,
        ) {
            Ok(event) => event,
            Err(error) => {
                return Ok(Replayed::Failed {
                    error: error.to_string(),
                });
            }
        };
        let key = MessageKey {
            consumer,
            source,
            message_id,
        };
        let causality = Causality::caused_by(
            &metadata.id,
            metadata.correlation_id.as_deref(),
            metadata.traceparent.as_ref(),
        );
        let replayed = shared
            .config
            .outbox
            .transaction_with(&mut *conn, causality, async |uow| {
                let discard = uow.conn().discard(key);
                if !database::bounded(limit, target, "deleting a dead letter", discard).await? {
                    // Replayed or discarded since it was read.
                    return Ok(Replayed::NotFound);
                }
                self.handle(event, &metadata, uow).await?;
                let finish = uow.conn().finish(key, true);
                database::bounded(limit, target, "finishing a replayed message", finish).await?;
                Ok(Replayed::Handled)
            })
            .await;
        match replayed {
            Ok(replayed) => {
                if replayed == Replayed::Handled {
                    tracing::info!(consumer, source, message_id, "replayed a dead letter");
                }
                Ok(replayed)
            }
            Err(failure) if failure.is_handlers() => Ok(Replayed::Failed {
                error: failure.to_string(),
            }),
            Err(Failure::TimedOut(timed_out)) => Err(InboxError::TimedOut(timed_out)),
            Err(Failure::Outbox(error)) => Err(InboxError::Replay(error)),
            // A gap, a late event or a crash point are of delivered messages, never a replay's.
            Err(other) => Ok(Replayed::Failed {
                error: other.to_string(),
            }),
        }
    }

    /// Replays this consumer's dead letters, the oldest first, at most `limit` of them (none
    /// when it is 0 or less), each as [`replay_dead_letter`](Self::replay_dead_letter) does:
    /// in a transaction of its own that applies it where it stands and deletes it. A redrive,
    /// once a fix for the handler is deployed. One that fails again stays, is reported, and
    /// does not stop the others; being the oldest, it is taken first again by the next call,
    /// so a `limit` above the failures' count is what lets a later call reach newer ones.
    /// Dead letters are replayed in the order they were dead-lettered, which for one
    /// aggregate is as a rule its sequence order (an event waits for its predecessor's
    /// outcome); each is applied outside its aggregate's order, as
    /// [`replay_dead_letter`](Self::replay_dead_letter) explains.
    ///
    /// # Errors
    /// As [`replay_dead_letter`](Self::replay_dead_letter), and [`InboxError::Database`] when
    /// the list cannot be read. The call stops at the first: the dead letters replayed
    /// before it stay replayed (each committed on its own), the others stay dead letters.
    pub async fn replay_dead_letters(&self, limit: i64) -> Result<ReplayReport, InboxError> {
        let shared = &*self.shared;
        let (timeout, target) = (shared.config.statement_timeout, shared.target.as_str());
        let consumer = shared.config.consumer.as_str();
        let letters = {
            let mut conn = C::pooled(&shared.pool).await.map_err(InboxError::Connect)?;
            let read = letters::dead_letters(&mut *conn, Some(consumer), limit);
            database::bounded(timeout, target, "listing dead letters", read).await?
        };
        let mut report = ReplayReport::default();
        for letter in letters {
            match self
                .replay_dead_letter(&letter.source, &letter.message_id)
                .await?
            {
                Replayed::Handled => report.handled += 1,
                Replayed::NotFound => report.not_found += 1,
                Replayed::Failed { error } => report.failed.push(FailedReplay {
                    source: letter.source,
                    message_id: letter.message_id,
                    error,
                }),
            }
        }
        Ok(report)
    }

    /// Looks in the stream for the unapplied predecessor of an event whose aggregate's last
    /// applied event is `last_seq` (at `stream_sequence`). `Ok`: there is none, apply over the
    /// gap; `Err`: what it waits for.
    async fn look_for_predecessor(
        &self,
        metadata: &Metadata,
        last_seq: i64,
        stream_sequence: i64,
    ) -> Result<Gap, String> {
        let shared = &*self.shared;
        let config = &shared.config;
        // A delivered message lies above its consumer's ack floor: a floor that does not is
        // of a stream created again since it was read, and is read again.
        let mut ack_floor = self.ack_floor().await;
        if ack_floor >= metadata.stream_sequence {
            ack_floor = self
                .read_ack_floor()
                .await
                .filter(|floor| *floor < metadata.stream_sequence)
                .unwrap_or(0);
        }
        let mut from = u64::try_from(stream_sequence).unwrap_or(0);
        // Whether `from` is the position's record of where the last applied event was.
        let mut from_position = true;
        loop {
            let found = order::predecessor(
                &shared.stream,
                &shared.filters,
                metadata,
                last_seq,
                from,
                ack_floor,
            )
            .await;
            match found {
                Predecessor::Missing { filtered } => {
                    // The position's stream sequence is of the stream the event was applied
                    // from: one created again since numbers its messages from 1, and a search
                    // from there would miss a predecessor below it. Before applying over a
                    // gap, the stream must hold the last applied event there; if it does not,
                    // the search starts again from the ack floor.
                    if from_position && from > ack_floor {
                        from_position = false;
                        match order::holds(&shared.stream, metadata, last_seq, from).await {
                            Ok(true) => {}
                            Ok(false) => {
                                from = 0;
                                continue;
                            }
                            Err(error) => return Err(format!("the stream cannot tell: {error}")),
                        }
                    }
                    return Ok(Gap {
                        reason: format!(
                            "events {} to {} of the aggregate are not in the stream",
                            last_seq + 1,
                            metadata.sequence - 1
                        ),
                        record: !filtered,
                    });
                }
                Predecessor::Unknown(error) => {
                    return Err(format!("the stream cannot tell: {error}"));
                }
                Predecessor::Pending {
                    seq,
                    stream_sequence,
                    id,
                } => {
                    let mut conn = self.connection().await.map_err(|e| e.to_string())?;
                    let settled = database::bounded(
                        config.statement_timeout,
                        &shared.target,
                        "checking a predecessor",
                        conn.settled(
                            &config.consumer,
                            metadata.source.as_deref().unwrap_or_default(),
                            id.as_deref().filter(|id| !id.contains('\0')),
                            stream_sequence,
                        ),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                    if !settled {
                        return Err(format!(
                            "event {seq} of the aggregate (stream sequence {stream_sequence}) is \
                             not applied yet"
                        ));
                    }
                    from = stream_sequence;
                    from_position = false;
                }
            }
        }
    }

    /// The consumer's ack floor, read again when the last reading is over a second old (or
    /// was forgotten).
    async fn ack_floor(&self) -> u64 {
        let (floor, read_at) = {
            let known = self.lock_ack_floor();
            (known.sequence, known.read_at)
        };
        if read_at.is_some_and(|at| at.elapsed() < Duration::from_secs(1)) {
            return floor;
        }
        self.read_ack_floor().await.unwrap_or(floor)
    }

    /// Reads the consumer's ack floor from JetStream (waiting at most
    /// [`order::LOOKUP_TIMEOUT`] for each answer) and keeps it, with the stream it counts in;
    /// `None` when JetStream did not tell.
    ///
    /// The stream is read again when the consumer is not the one last read: another instance
    /// may have created the stream and the consumer again, and [`Self::restore_consumer`]
    /// delivers from above the floor only in the stream the floor was read in. The stream is
    /// read between two readings of the consumer, and the floor kept only when both found
    /// the same consumer: a consumer lives no longer than its stream, so that stream is the
    /// one read. (Attributed to an older stream instead, a floor would only make a restore
    /// deliver the whole stream again, which the inbox's records dedup; attributed to a newer
    /// one, it would skip that stream's first messages.)
    pub(crate) async fn read_ack_floor(&self) -> Option<u64> {
        let info = self.consumer_info().await?;
        let known_consumer = self.lock_ack_floor().consumer_created;
        let (info, stream_created) = if info.created.unix_timestamp_nanos() == known_consumer {
            (info, None)
        } else {
            let mut stream = self.shared.stream.clone();
            let stream_info = tokio::time::timeout(order::LOOKUP_TIMEOUT, stream.info())
                .await
                .ok()?
                .ok()?;
            let again = self.consumer_info().await?;
            if again.created != info.created {
                return None;
            }
            (again, Some(stream_info.created.unix_timestamp_nanos()))
        };
        let floor = info.ack_floor.stream_sequence;
        // The consumer's backlog, as JetStream counts it for the durable consumer (every
        // instance reports the same figures).
        let consumer = self.shared.config.consumer.clone();
        metrics::gauge!("outbox_inbox_pending", "consumer" => consumer.clone())
            .set(info.num_pending as f64);
        metrics::gauge!("outbox_inbox_ack_pending", "consumer" => consumer)
            .set(info.num_ack_pending as f64);
        let mut known = self.lock_ack_floor();
        known.sequence = floor;
        known.read_at = Some(Instant::now());
        known.consumer_created = info.created.unix_timestamp_nanos();
        if let Some(created) = stream_created {
            known.stream_created = created;
        }
        Some(floor)
    }

    /// The durable consumer's info, as JetStream answers within [`order::LOOKUP_TIMEOUT`].
    async fn consumer_info(&self) -> Option<jetstream::consumer::Info> {
        let mut consumer = self.shared.consumer.clone();
        let read = tokio::time::timeout(order::LOOKUP_TIMEOUT, consumer.info()).await;
        read.ok()?.ok().cloned()
    }

    fn lock_ack_floor(&self) -> std::sync::MutexGuard<'_, AckFloor> {
        self.shared
            .ack_floor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Called when a pull request failed or went unanswered (as one for a consumer that does
    /// not exist does), in a task of its own. The ack floor is read again before its next use
    /// (the consumer may have been created again meanwhile, by another instance). If JetStream
    /// says the durable consumer is gone (an operator deleted it, or its stream went with it
    /// and a relay created the stream again), creates it with the settings `connect` left it
    /// with, delivering, in the same stream, from above the ack floor last read (every
    /// message at or below it was settled: nothing settled is delivered again beyond the
    /// last seconds' worth, which the inbox's records dedup), and in a stream created since,
    /// from its first message. A consumer that exists, a stream that is missing (a relay
    /// creates it again; this logs a warning), a JetStream that does not answer within
    /// [`order::LOOKUP_TIMEOUT`], or a creation that fails (another instance's came first):
    /// nothing more is done, and the next pull request tells again.
    pub(crate) async fn restore_consumer(&self) {
        use jetstream::context::ConsumerInfoErrorKind;
        let shared = &*self.shared;
        let (consumer, stream_name) =
            (&shared.config.consumer, &shared.config.topology.stream.name);
        self.lock_ack_floor().read_at = None;
        let looked =
            tokio::time::timeout(order::LOOKUP_TIMEOUT, shared.stream.consumer_info(consumer))
                .await;
        match looked
            .as_ref()
            .map(|found| found.as_ref().map_err(|e| e.kind()))
        {
            Ok(Err(ConsumerInfoErrorKind::NotFound)) => {}
            Ok(Err(ConsumerInfoErrorKind::StreamNotFound)) => {
                tracing::warn!(
                    stream = %stream_name,
                    "the inbox's stream is missing (deleted, or its server lost its store); \
                     waiting for a relay to create it again"
                );
                return;
            }
            _ => return,
        }
        let mut stream = shared.stream.clone();
        let Ok(Ok(info)) = tokio::time::timeout(order::LOOKUP_TIMEOUT, stream.info()).await else {
            return;
        };
        let created = info.created.unix_timestamp_nanos();
        let (same_stream, floor) = {
            let known = self.lock_ack_floor();
            (known.stream_created == created, known.sequence)
        };
        let mut config = shared.consumer_config.clone();
        config.deliver_policy = if same_stream && floor > 0 {
            jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: floor + 1,
            }
        } else {
            jetstream::consumer::DeliverPolicy::All
        };
        let created_again =
            tokio::time::timeout(order::LOOKUP_TIMEOUT, stream.create_consumer(config)).await;
        match created_again {
            Ok(Ok(_)) if same_stream => {
                tracing::warn!(
                    %consumer, stream = %stream_name, from_stream_sequence = floor + 1,
                    "the inbox's durable consumer was gone; created it again, delivering \
                     from above its ack floor"
                );
            }
            Ok(Ok(_)) => {
                *self.lock_ack_floor() = AckFloor {
                    sequence: 0,
                    read_at: Some(Instant::now()),
                    stream_created: created,
                    // Read again, with the stream, at the next reading of the floor.
                    consumer_created: 0,
                };
                tracing::warn!(
                    %consumer, stream = %stream_name,
                    "the inbox's stream was created again, and its durable consumer with it; \
                     delivering from the new stream's first message (what the old stream \
                     held and this consumer had not settled is gone with it)"
                );
            }
            Ok(Err(error)) => {
                tracing::debug!(%error, "creating the inbox's consumer again failed");
            }
            Err(_) => tracing::debug!("creating the inbox's consumer again went unanswered"),
        }
    }

    /// Dead-letters a message outside its aggregate's order: one that arrived late, or whose
    /// metadata could not be read (keyed by its stream sequence).
    async fn dead_letter_unordered(
        &self,
        message: &jetstream::Message,
        metadata: Option<&Metadata>,
        error: String,
    ) -> Outcome {
        let info = message.info().ok();
        let stream_sequence = info.as_ref().map_or(0, |info| info.stream_sequence);
        let unread_id = store::unread_id(stream_sequence);
        let key = match metadata {
            Some(metadata) => self.key(metadata),
            None => MessageKey {
                consumer: &self.shared.config.consumer,
                source: "",
                message_id: &unread_id,
            },
        };
        let headers = message::headers_json(message);
        let subject = message::storable_text(&message.subject);
        let stored_error = message::storable_text(&error);
        let letter = store::DeadLetter {
            key,
            subject: &subject,
            headers: &headers,
            payload: &message.payload,
            error: &stored_error,
            deliveries: info.as_ref().map_or(1, |info| info.delivered),
            stream_sequence: i64::try_from(stream_sequence).unwrap_or(i64::MAX),
        };
        let (limit, target) = (
            self.shared.config.statement_timeout,
            self.shared.target.as_str(),
        );
        let written = async {
            let mut conn = self.connection().await?;
            database::bounded(
                limit,
                target,
                "recording a dead letter",
                conn.dead_letter_alone(&letter),
            )
            .await
            .map_err(Failure::from)
        };
        match written.await {
            Ok(()) => {
                tracing::error!(message_id = key.message_id, %error, "dead-lettered a message");
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

    /// Dead-letters a message whose metadata could not be read.
    async fn dead_letter_unread(&self, message: &jetstream::Message, error: String) -> Outcome {
        self.dead_letter_unordered(message, None, error).await
    }
}

/// A gap the inbox applies an event over.
pub(crate) struct Gap {
    /// Why the events in between will not be applied.
    reason: String,
    /// Whether to record it: not when the consumer's filter leaves those events out.
    record: bool,
}

/// Whether a nats-server of `version` (`2.9.10`, `2.10.0-RC.1`, ...) takes a consumer with
/// several `filter_subjects`: 2.10 and later.
fn supports_filter_subjects(version: &str) -> bool {
    crate::nats::server_at_least(version, 2, 10)
}

/// Whether `filters` take every message a stream of `config` stores: it captures only
/// subjects that some filter covers (no sources, mirror or subject transform, whose messages
/// keep or take other subjects). A consumer without a filter then gets the same messages,
/// and costs the server less: nats-server before 2.9.15 (Debian's 2.9.10) counts a filtered
/// consumer's pending messages (`consumer.go`, `streamNumPending`) by comparing the subjects
/// of a message block's messages with each of its distinct subjects that match
/// (`filestore.go`, `filteredPendingLocked`), once for each message delivered when that
/// count's last sequence came out 0 (which it does in one of its branches), and the relay's
/// subjects carry a partition key each: 95% of the server's CPU in a profile of one inbox
/// instance, up to 1.1 ms a message (BENCHMARKS.md, "Consumer instances"). A consumer without
/// a filter takes the count's shortcut.
fn takes_whole_stream(config: &jetstream::stream::Config, filters: &[String]) -> bool {
    !config.subjects.is_empty()
        && config.mirror.is_none()
        && config.sources.as_ref().is_none_or(Vec::is_empty)
        && config.subject_transform.is_none()
        && config
            .subjects
            .iter()
            .all(|subject| filters.iter().any(|filter| order::covers(filter, subject)))
}

/// Why a durable consumer that exists under the inbox's name (created by an operator or
/// another tool) cannot give exactly-once effects, if it cannot: it acks other than
/// explicitly. With `none` JetStream never delivers again a message whose handler failed or
/// whose instance died; with `all` the ack of one message settles every message before it,
/// which other handlers may not have committed. JetStream does not change a consumer's ack
/// policy ("ack policy can not be updated", error code 10012, on 2.9.10 and 2.15.1), so the
/// error says to delete it or choose another name.
fn unfit_consumer(existing: &jetstream::consumer::Config) -> Result<(), String> {
    use jetstream::consumer::AckPolicy;
    let why = match existing.ack_policy {
        AckPolicy::Explicit => return Ok(()),
        AckPolicy::None => {
            "acks none (ack_policy none): JetStream would never deliver again a message whose \
             handler failed or whose instance died"
        }
        AckPolicy::All => {
            "acks all (ack_policy all): the ack of one message would settle the messages \
             before it that other handlers have not committed"
        }
        // A server-managed sourcing consumer's policy (nats-server 2.14), acked by flow
        // control rather than by its client.
        #[allow(unreachable_patterns)]
        _ => "is acked by the server, not by its client (ack_policy flow_control)",
    };
    Err(format!(
        "the consumer exists and {why}; the inbox acks each message explicitly once its \
         transaction commits. JetStream does not change this on an existing consumer: delete \
         it (`nats consumer rm`) to have the next connect create it, or choose another \
         consumer name"
    ))
}

/// A consumer's settings on the server, as a pull consumer's configuration for an update.
fn updated_pull_config(info: &jetstream::consumer::Config) -> pull::Config {
    pull::Config {
        durable_name: info.durable_name.clone(),
        name: info.name.clone(),
        description: info.description.clone(),
        deliver_policy: info.deliver_policy,
        ack_policy: info.ack_policy,
        ack_wait: info.ack_wait,
        max_deliver: info.max_deliver,
        filter_subject: info.filter_subject.clone(),
        filter_subjects: info.filter_subjects.clone(),
        replay_policy: info.replay_policy,
        rate_limit: info.rate_limit,
        sample_frequency: info.sample_frequency,
        max_waiting: info.max_waiting,
        max_ack_pending: info.max_ack_pending,
        headers_only: info.headers_only,
        max_batch: info.max_batch,
        max_bytes: info.max_bytes,
        max_expires: info.max_expires,
        inactive_threshold: info.inactive_threshold,
        num_replicas: info.num_replicas,
        memory_storage: info.memory_storage,
        backoff: info.backoff.clone(),
        ..Default::default()
    }
}

/// Describes the inbox's metrics (units and help texts for an exporter).
fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "outbox_inbox_messages_total",
        "Deliveries processed, by consumer and outcome (handled, duplicate, skipped, retry, held, dead_lettered)"
    );
    describe_counter!(
        "outbox_inbox_settle_failures_total",
        "Acks, naks and terms that did not reach JetStream, by consumer"
    );
    describe_counter!(
        "outbox_inbox_gaps_total",
        "Events applied over a gap in their aggregate's sequence, by consumer"
    );
    describe_histogram!(
        "outbox_inbox_process_seconds",
        Unit::Seconds,
        "From decoding a delivery to its commit, by consumer"
    );
    describe_gauge!(
        "outbox_inbox_pending",
        "Messages of the stream the durable consumer has not delivered yet (JetStream's num_pending), by consumer"
    );
    describe_gauge!(
        "outbox_inbox_ack_pending",
        "Messages delivered and not yet settled (JetStream's num_ack_pending), by consumer"
    );
}

/// The text of a panic's payload.
fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

fn pool_error(error: impl fmt::Display) -> diesel::result::Error {
    diesel::result::Error::DatabaseError(
        diesel::result::DatabaseErrorKind::ClosedConnection,
        Box::new(error.to_string()),
    )
}

/// A running consumer task.
pub struct InboxHandle(Spawned<InboxError>);

impl InboxHandle {
    /// Stops the consumer gracefully (see [`Inbox::run`]) and waits for it.
    ///
    /// # Errors
    /// What the consumer returned, or [`InboxError::Task`] when it panicked; `Ok(())` when
    /// [`stopped`](Self::stopped) has returned already.
    pub async fn shutdown(self) -> Result<(), InboxError> {
        self.0.shutdown().await
    }

    /// Waits until the consumer stops without being asked to. It does only when a task of
    /// the inbox panicked (a bug: a handler's panic is caught and retried like its error, and
    /// failures of the broker and the database are retried, never returned); the messages
    /// it had not acked are delivered again, to another instance or the next one, after
    /// `ack_wait`. A service selects on it beside its own shutdown signal, so that a consumer
    /// that stopped ends the process (and its supervisor starts it again) instead of leaving
    /// the stream unread.
    ///
    /// Cancel-safe: dropped unfinished (a `tokio::select!` whose other branch won), it loses
    /// nothing, and the next call waits on. Once it has returned, it returns `Ok(())` at once,
    /// and so does [`shutdown`](Self::shutdown).
    ///
    /// # Errors
    /// What the consumer returned: [`InboxError::Task`] when a task of it panicked.
    pub async fn stopped(&mut self) -> Result<(), InboxError> {
        self.0.stopped().await
    }
}

/// Deletes up to `limit` of `consumer`'s inbox rows handled more than `older_than` ago,
/// oldest first, and failed attempts as old; returns how many inbox rows. A running
/// [`Inbox`] does this every `purge_interval` with its `retention`. An `older_than` over a
/// thousand years (`Duration::MAX`, say) deletes nothing. An `older_than` shorter than the
/// consumer's [`InboxConfig::own_redelivery_time`] (or the producer relay's
/// [`RelayConfig::redelivery_horizon`](crate::RelayConfig::redelivery_horizon)) deletes ids a
/// duplicate may still meet, which is then handled again; `outbox purge` refuses one under
/// the defaults' (66 s).
///
/// # Errors
/// The database's error.
pub async fn purge<C: InboxConnection>(
    conn: &mut C,
    consumer: &str,
    older_than: Duration,
    limit: i64,
) -> diesel::QueryResult<usize> {
    conn.purge(consumer, older_than, limit).await
}

/// The consumers that have rows in the inbox, in byte order (on PostgreSQL and MySQL a
/// loose index scan of the primary key: one probe per consumer, however many rows each
/// has; SQLite reads the primary key whole).
///
/// # Errors
/// The database's error.
pub async fn consumers<C: InboxConnection>(conn: &mut C) -> diesel::QueryResult<Vec<String>> {
    conn.consumers().await
}

/// Refuses an empty `database_url` or one of another database than `C`'s (unless a connector
/// opens PostgreSQL's connections, when the URL only names the database), and a connector on
/// MySQL or SQLite.
fn check_database<C: InboxConnection>(config: &InboxConfig) -> Result<(), InboxError> {
    #[cfg(feature = "postgres")]
    if config.connector.is_some() {
        return if C::KIND == Kind::Postgres {
            Ok(())
        } else {
            Err(InboxError::Config(
                "a connector opens PostgreSQL connections; an inbox on MySQL or SQLite opens \
                 its own from database_url"
                    .to_owned(),
            ))
        };
    }
    if config.database_url.trim().is_empty() {
        // SQLite would open a temporary database of its own for the empty path.
        return Err(InboxError::Config(
            "database_url is empty: the inbox needs its database's URL (or, on PostgreSQL, a \
             connector)"
                .to_owned(),
        ));
    }
    let kind = config
        .database_url
        .parse::<Kind>()
        .map_err(|error| InboxError::Config(format!("database_url: {error}")))?;
    if kind == C::KIND {
        return Ok(());
    }
    let (what, connection, feature) = match kind {
        Kind::Postgres => ("a PostgreSQL URL", "AsyncPgConnection", "postgres"),
        Kind::Mysql => ("a MySQL URL", "AsyncMysqlConnection", "mysql"),
        Kind::Sqlite => ("a SQLite file", "AsyncSqliteConnection", "sqlite"),
    };
    Err(InboxError::Config(format!(
        "database_url {} is {what}, and this inbox runs on {}: make it an Inbox<_, \
         {connection}> with a Handler<{connection}> (feature `{feature}`)",
        database::redacted(&config.database_url),
        std::any::type_name::<C>()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_takes_the_whole_stream_only_where_its_filters_cover_what_the_stream_stores() {
        let stream = |subjects: &[&str]| jetstream::stream::Config {
            subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        };
        let filters =
            |filters: &[&str]| filters.iter().map(|f| (*f).to_owned()).collect::<Vec<_>>();
        let all = filters(&["events.>"]);
        assert!(takes_whole_stream(&stream(&["events.>"]), &all));
        assert!(takes_whole_stream(&stream(&["events.Order.>"]), &all));
        assert!(takes_whole_stream(
            &stream(&["events.Order.>", "events.Payment.>"]),
            &filters(&["events.Payment.>", "events.Order.>"])
        ));
        assert!(!takes_whole_stream(&stream(&["events.>", "audit.>"]), &all));
        assert!(!takes_whole_stream(
            &stream(&["events.>"]),
            &filters(&["events.Order.>"])
        ));
        assert!(
            !takes_whole_stream(&stream(&[]), &all),
            "a stream of sources only"
        );
        let sourced = jetstream::stream::Config {
            sources: Some(vec![jetstream::stream::Source {
                name: "OTHER".to_owned(),
                ..Default::default()
            }]),
            ..stream(&["events.>"])
        };
        assert!(
            !takes_whole_stream(&sourced, &all),
            "sourced messages keep their subjects"
        );
        let mirror = jetstream::stream::Config {
            mirror: Some(jetstream::stream::Source {
                name: "OTHER".to_owned(),
                ..Default::default()
            }),
            ..stream(&["events.>"])
        };
        assert!(!takes_whole_stream(&mirror, &all));
        let transformed = jetstream::stream::Config {
            subject_transform: Some(jetstream::stream::SubjectTransform {
                source: "events.>".to_owned(),
                destination: "copied.>".to_owned(),
            }),
            ..stream(&["events.>"])
        };
        assert!(
            !takes_whole_stream(&transformed, &all),
            "stored under other subjects"
        );
    }

    #[test]
    fn filter_subjects_need_2_10() {
        for (version, supported) in [
            ("2.9.10", false),
            ("2.9.25", false),
            ("2.10.0", true),
            ("2.10.0-RC.1", true),
            ("2.15.1", true),
            ("3.0.0", true),
            ("", false),
        ] {
            assert_eq!(supports_filter_subjects(version), supported, "{version}");
        }
    }

    #[test]
    fn holds_come_back_soon() {
        let delays: Vec<u128> = (1..=7)
            .map(|d| InboxConfig::hold_delay(d).as_millis())
            .collect();
        assert_eq!(delays, [100, 200, 400, 800, 1000, 1000, 1000]);
    }

    #[test]
    fn the_debug_form_hides_the_database_password() {
        let config = InboxConfig::new("c", "postgres://inbox:s3cret@db/orders");
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("postgres://inbox@db/orders"), "{shown}");
    }

    #[test]
    fn the_naks_before_a_delivery_add_up_its_earlier_delays() {
        let mut config = InboxConfig::new("c", "postgres://");
        config.retry_delay = Duration::from_millis(100);
        config.max_retry_delay = Duration::from_millis(350);
        let waited: Vec<u128> = (0..=6).map(|d| config.naks_before(d).as_millis()).collect();
        // Before the first delivery and the first nak, nothing; then 100, 200, 350, 350.
        assert_eq!(waited, [0, 0, 100, 300, 650, 1000, 1350]);
        // Past the doubling naks, at most u32::MAX repeats of the last are counted: decades
        // past any gap_timeout but "never". The first delivery beyond them counts no more.
        let last_counted = 1 + (NAK_DOUBLINGS + 1) + u64::from(u32::MAX);
        assert!(config.naks_before(last_counted) > config.naks_before(last_counted - 1));
        assert_eq!(
            config.naks_before(u64::MAX),
            config.naks_before(last_counted)
        );
        config.max_retry_delay = Duration::MAX;
        config.retry_delay = Duration::MAX;
        assert_eq!(config.naks_before(3), Duration::MAX);
    }

    #[test]
    fn nak_delays_double_from_the_first_and_are_capped() {
        let mut config = InboxConfig::new("c", "postgres://");
        config.retry_delay = Duration::from_millis(100);
        config.max_retry_delay = Duration::from_millis(350);
        let delays: Vec<u128> = (1..=5).map(|d| config.nak_delay(d).as_millis()).collect();
        assert_eq!(delays, [100, 200, 350, 350, 350]);
    }

    #[test]
    fn a_duration_too_long_for_the_inbox_is_refused_with_its_name() {
        use crate::relay::MAX_DURATION;
        type Field = fn(&mut InboxConfig) -> &mut Duration;
        let fields: [(&str, Field); 5] = [
            ("ack_wait", |c| &mut c.ack_wait),
            ("retry_delay", |c| &mut c.retry_delay),
            ("max_retry_delay", |c| &mut c.max_retry_delay),
            ("connect_timeout", |c| &mut c.connect_timeout),
            ("statement_timeout", |c| &mut c.statement_timeout),
        ];
        for (name, field) in fields {
            let mut config = InboxConfig::new("c", "postgres://");
            // Ids kept for ever: an ack_wait this long needs a longer retention; and a cap
            // that lets the first delay be this long.
            config.retention = Duration::MAX;
            config.max_retry_delay = MAX_DURATION;
            *field(&mut config) = MAX_DURATION;
            assert!(config.validate().is_ok(), "{name} at the bound");
            for value in [MAX_DURATION + Duration::from_millis(1), Duration::MAX] {
                *field(&mut config) = value;
                match config.validate() {
                    Err(InboxError::Config(message)) => assert!(
                        message.starts_with(&format!("{name} {value:?} is longer")),
                        "{message}"
                    ),
                    other => panic!("{name} = {value:?}: {other:?}"),
                }
            }
        }
        // A purge loop without a pause is refused; `retention` keeps ids for ever instead.
        for value in [Duration::ZERO, Duration::from_nanos(999_999)] {
            let mut config = InboxConfig::new("c", "postgres://");
            config.purge_interval = value;
            match config.validate() {
                Err(InboxError::Config(message)) => assert!(
                    message.starts_with(&format!(
                        "purge_interval must be at least 1ms, not {value:?}"
                    )),
                    "{message}"
                ),
                other => panic!("purge_interval = {value:?}: {other:?}"),
            }
        }
        // A handler given no time at all is refused, naming the field.
        let mut config = InboxConfig::new("c", "postgres://");
        config.handler_timeout = Duration::ZERO;
        match config.validate() {
            Err(InboxError::Config(message)) => {
                assert_eq!(message, "handler_timeout must be at least 1ms, not 0ns")
            }
            other => panic!("handler_timeout = 0: {other:?}"),
        }
        // Never: a gap waited for, ids purged, a purge run, a handler cut off.
        let mut config = InboxConfig::new("c", "postgres://");
        config.gap_timeout = Duration::MAX;
        config.retention = Duration::MAX;
        config.purge_interval = Duration::MAX;
        config.handler_timeout = Duration::MAX;
        assert!(config.validate().is_ok());
    }

    /// Ids purged before the consumer's own redeliveries of them end would let a duplicate be
    /// handled again: refused, naming the bound.
    #[test]
    fn a_retention_shorter_than_the_consumers_own_redeliveries_is_refused() {
        // With the defaults (5 attempts, 5 s ack_wait, naks of 1, 2, 4 and 8 s) that is 40 s.
        let mut config = InboxConfig::new("c", "postgres://");
        assert_eq!(config.own_redelivery_time(), Duration::from_secs(40));
        config.retention = Duration::from_secs(40);
        assert!(config.validate().is_ok(), "retention at the bound");
        for retention in [Duration::ZERO, Duration::from_secs(39)] {
            config.retention = retention;
            match config.validate() {
                Err(InboxError::Config(message)) => assert_eq!(
                    message,
                    format!(
                        "retention {retention:?} is shorter than this consumer's own \
                         redeliveries can take (40s: max_attempts x ack_wait plus the nak \
                         delays): a duplicate arriving after its id was purged would be \
                         handled again"
                    )
                ),
                other => panic!("retention = {retention:?}: {other:?}"),
            }
        }
        // The most attempts: summed without a loop per attempt, and without overflowing.
        config.max_attempts = u32::MAX;
        config.ack_wait = Duration::from_secs(60);
        assert!(config.own_redelivery_time() > Duration::from_secs(60) * u32::MAX);
        config.ack_wait = Duration::MAX;
        assert_eq!(config.own_redelivery_time(), Duration::MAX);
    }

    /// A first delay over the cap was silently replaced by the cap.
    #[test]
    fn a_retry_delay_longer_than_its_cap_is_refused_naming_both() {
        let mut config = InboxConfig::new("c", "postgres://");
        config.retry_delay = config.max_retry_delay;
        assert!(config.validate().is_ok(), "retry_delay at its cap");
        config.retry_delay = Duration::from_secs(120);
        match config.validate() {
            Err(InboxError::Config(message)) => assert_eq!(
                message,
                "retry_delay 120s is longer than max_retry_delay 60s, which caps every nak's \
                 delay: raise max_retry_delay or shorten retry_delay"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_producers_stream_name_is_checked() {
        let mut config = InboxConfig::new("c", "postgres://");
        config.topology.stream.name = String::new();
        assert_eq!(
            config.validate().unwrap_err().to_string(),
            "inbox configuration: topology.stream.name \"\" is not a JetStream stream name: it \
             is empty"
        );
    }

    #[test]
    fn the_producers_jetstream_domain_is_checked() {
        let mut config = InboxConfig::new("c", "postgres://");
        config.topology.stream.domain = Some("hub.east".to_owned());
        assert_eq!(
            config.validate().unwrap_err().to_string(),
            "inbox configuration: topology.stream.domain \"hub.east\" is not a JetStream \
             domain: it contains '.', the NATS token separator"
        );
        config.topology.stream.domain = Some("hub".to_owned());
        assert!(config.validate().is_ok());
    }

    #[test]
    fn a_consumer_name_is_checked() {
        let config = InboxConfig::new("orders.reservations", "postgres://");
        let error = config.validate().unwrap_err();
        assert!(error.to_string().contains("orders.reservations"), "{error}");
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn an_inbox_refuses_a_url_of_another_database_naming_the_connection_to_use() {
        use diesel_async::AsyncMysqlConnection;
        let config = InboxConfig::new("c", "postgres://app:secret@db/orders");
        let error = check_database::<AsyncMysqlConnection>(&config)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("is a PostgreSQL URL")
                && error.contains("Inbox<_, AsyncPgConnection>")
                && error.contains("AsyncMysqlConnection")
                && !error.contains("secret"),
            "{error}"
        );
        let config = InboxConfig::new("c", "mysql://app@db/orders");
        assert!(check_database::<AsyncMysqlConnection>(&config).is_ok());
    }

    /// An empty `database_url` is refused before anything connects, where the inbox went on
    /// to connect with it (SQLite opening a temporary database of its own, which then lacked
    /// the migrations); with a connector, the URL only names the database.
    #[test]
    fn an_inbox_without_a_connector_refuses_an_empty_database_url() {
        fn refused<C: InboxConnection>() {
            for url in ["", "  "] {
                let error = check_database::<C>(&InboxConfig::new("c", url))
                    .unwrap_err()
                    .to_string();
                assert!(
                    error.contains("database_url is empty: the inbox needs its database's URL"),
                    "{url:?}: {error}"
                );
            }
        }
        #[cfg(feature = "postgres")]
        refused::<AsyncPgConnection>();
        #[cfg(feature = "mysql")]
        refused::<diesel_async::AsyncMysqlConnection>();
        #[cfg(feature = "sqlite")]
        refused::<crate::sqlite::AsyncSqliteConnection>();
        #[cfg(feature = "postgres")]
        {
            let mut config = InboxConfig::new("c", "");
            config.connector = Some(Connector::new(|| async {
                Err::<AsyncPgConnection, _>("unused")
            }));
            assert!(check_database::<AsyncPgConnection>(&config).is_ok());
        }
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn an_inbox_on_sqlite_refuses_a_mysql_url() {
        use crate::sqlite::AsyncSqliteConnection;
        let config = InboxConfig::new("c", "mysql://app@db/orders");
        let error = check_database::<AsyncSqliteConnection>(&config)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("is a MySQL URL") && error.contains("AsyncMysqlConnection"),
            "{error}"
        );
        assert!(
            check_database::<AsyncSqliteConnection>(&InboxConfig::new("c", "orders.db")).is_ok()
        );
    }

    #[cfg(all(feature = "postgres", feature = "mysql"))]
    #[test]
    fn a_connector_is_refused_on_mysql() {
        let mut config = InboxConfig::new("c", "mysql://app@db/orders");
        config.connector = Some(Connector::new(|| async {
            Err::<AsyncPgConnection, _>("unused")
        }));
        let error = check_database::<diesel_async::AsyncMysqlConnection>(&config)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("a connector opens PostgreSQL connections"),
            "{error}"
        );
    }
}
