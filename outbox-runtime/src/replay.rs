//! Replaying the archive: the events a relay in [`PublishedRows::Archive`] mode kept in
//! `outbox_published`, published again to a stream of their own, for a consumer that joins
//! after the live stream's limits (`max_age`, `max_msgs`, `max_bytes`) removed them, or that
//! rebuilds a read model from the start.
//!
//! [`replay_archive`] reads the archive in *archive order*: by aggregate type, aggregate id,
//! sequence (then event id), in pages of [`ReplayConfig::batch_size`] through the index
//! `outbox_published_aggregate`, and publishes each page to [`ReplayConfig::to`], a topology
//! that is not the producer's: an event's subject `{from}.{rest}` becomes `{to}.{rest}`, and
//! its message is the one the relay published, built by the same code: the payload's bytes,
//! `Nats-Msg-Id` and every CloudEvents header (`ce-id` the event id, `ce-sequence` its
//! sequence, `ce-source` [`ReplayConfig::source`], which must be the producer relay's
//! `RelayConfig::source` for the inbox to know a replayed event from its live copy), plus
//! the row's own headers. So a consumer's [`Inbox`](crate::Inbox) takes the replay stream as it
//! takes the live one, and afterwards the live stream: what it applied from the replay it
//! finds recorded and drops as duplicates (within its `retention`, 7 days by default).
//!
//! # Guarantees
//! - Per aggregate, in sequence order: one aggregate's events are published one after another,
//!   each after the previous one's ack, and a page is published only once the page before it
//!   is acked whole; aggregates of one page are published side by side.
//! - At least once: each event of the archive that matches the filters is acked by the
//!   stream. A replay run again, or resumed from an earlier position, publishes the same
//!   message ids: JetStream drops them within the replay stream's duplicate window, the inbox
//!   after it.
//! - Never into the live stream: a target prefix equal to the producer's, or one capturing or
//!   captured by it, is refused before anything is read, and so is a target stream that
//!   captures the producer's subjects (the live stream under another name), since those
//!   copies would reach every live consumer a second time.
//! - Resumable: a failure returns the [`ArchivePosition`] after which nothing is left
//!   unpublished (the last event of the last page acked whole); [`ReplayConfig::after`] starts
//!   there.
//!
//! # Databases
//! [`replay_archive`] reads any [`ArchiveConnection`]: PostgreSQL's archive (daily
//! partitions) by a row comparison on the index in one statement per page; MySQL's and
//! SQLite's (one table) by up to three range reads of the same index per page, neither
//! server ranging an index over a row comparison. The time filters compare with the times as
//! each database keeps them: to the microsecond on PostgreSQL and MySQL, to the millisecond
//! on SQLite.
//!
//! Limits: the archive holds what a relay published in Archive mode and the retention has not
//! dropped (`outbox::drop_archived`, `mysql::purge_archived`, `sqlite::purge_archived`);
//! events published in `Delete` or `Mark` mode, or queued still, are not in it (the live
//! stream carries the queued ones once published). A replay from
//! [`ReplayConfig::published_since`] starts aggregates in the middle of their history: an
//! inbox applies each such aggregate's first replayed event over a gap, recorded in
//! `outbox_inbox_gaps`. The archive has no unique key on an aggregate's sequence, so two
//! archived rows with one sequence (a database restored under a running relay) are both
//! replayed, in event id order, and the inbox applies the first; on MySQL and SQLite a page
//! takes both whole, and a position resumes after every row of its sequence.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use diesel_async::TransactionManager as _;
use uuid::Uuid;

use crate::outbox::queries::ClaimedEvent;
use crate::publisher::{PublishFailure, Publisher, StreamError, ensure_stream};
use crate::topology::{SubjectPrefix, Topology};

#[cfg(doc)]
use crate::PublishedRows;

/// What [`replay_archive`] replays, and where to.
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// The producer's subject prefix: the archived subjects are under it, and only those are
    /// replayed (an archive that holds several outboxes' rows replays one at a time).
    pub from: SubjectPrefix,
    /// Where the events go: a prefix and a stream of their own, created when missing (as a
    /// relay creates its stream, with the stream settings given). Refused when it is the
    /// producer's prefix, or a prefix capturing or captured by it. Give the stream a short
    /// duplicate window, [`DUPLICATE_WINDOW`]: with a stream's default of 2 minutes, a replay
    /// of millions of events holds millions of message ids in the broker's memory.
    pub to: Topology,
    /// The messages' `ce-source`: the producer relay's `RelayConfig::source` (default
    /// `/outbox`). An inbox records a message by source and id, so a replayed event is a
    /// duplicate of its live copy only with the same source.
    pub source: String,
    /// Only events published at or after this time (`published_at`, UTC); `None`: from the
    /// archive's first.
    pub published_since: Option<time::OffsetDateTime>,
    /// Only events published before this time; `None`: up to the archive's last.
    pub published_before: Option<time::OffsetDateTime>,
    /// Only events of these aggregate types; empty: every type.
    pub aggregate_types: Vec<String>,
    /// Start after this position (a position [`ReplayReport::last`] or
    /// [`ReplayError::resume_after`] gave); `None`: from the first event.
    pub after: Option<ArchivePosition>,
    /// Events read and published per page: 1 to 100,000; default 1,000.
    pub batch_size: usize,
    /// How long a publish waits for its ack, and a JetStream API request for its answer.
    /// Default 5 s.
    pub ack_timeout: Duration,
    /// Publishes awaiting their ack at once, at least 1. Default 256.
    pub max_in_flight: usize,
}

impl ReplayConfig {
    /// Replays the archive of the producer whose prefix is `from` into `to`, with
    /// `ce-source` `/outbox` (the relay's default), every event, 1,000 per page.
    pub fn new(from: SubjectPrefix, to: Topology) -> Self {
        Self {
            from,
            to,
            source: "/outbox".to_owned(),
            published_since: None,
            published_before: None,
            aggregate_types: Vec::new(),
            after: None,
            batch_size: 1_000,
            ack_timeout: Duration::from_secs(5),
            max_in_flight: 256,
        }
    }

    /// Whether these settings can work, before anything is connected: [`replay_archive`]
    /// checks them first too.
    ///
    /// # Errors
    /// [`ReplayError::Settings`], naming the first setting that cannot work and why.
    pub fn check(&self) -> Result<(), ReplayError> {
        self.fault().map_err(ReplayError::Settings)
    }

    fn fault(&self) -> Result<(), String> {
        let from = self.from.as_str();
        let to = self.to.subject_prefix.as_str();
        let under = |inner: &str, outer: &str| {
            inner == outer
                || inner
                    .strip_prefix(outer)
                    .is_some_and(|rest| rest.starts_with('.'))
        };
        if under(to, from) || under(from, to) {
            return Err(format!(
                "the replay's prefix `{to}` is the producer's prefix `{from}` or shares its \
                 subjects: its messages would reach the live stream and every live consumer \
                 a second time; give the replay a prefix of its own (such as `replay`)"
            ));
        }
        self.to
            .stream
            .check()
            .map_err(|error| format!("the replay's stream {error}"))?;
        if !(1..=100_000).contains(&self.batch_size) {
            return Err(format!(
                "batch_size {} is outside 1 to 100,000",
                self.batch_size
            ));
        }
        if self.max_in_flight == 0 {
            return Err("max_in_flight is 0: no publish could be sent".to_owned());
        }
        if self.ack_timeout.is_zero() {
            return Err("ack_timeout is 0: no publish could be acked".to_owned());
        }
        crate::publisher::check_source(&self.source).map_err(|e| e.to_string())?;
        if let (Some(since), Some(before)) = (self.published_since, self.published_before)
            && since >= before
        {
            return Err(format!(
                "published_since ({since}) is not before published_before ({before}): \
                 no event could match"
            ));
        }
        Ok(())
    }
}

/// The duplicate window of a replay stream: 10 seconds, where a stream's default
/// ([`StreamSettings::default`](crate::StreamSettings)) is 2 minutes; `outbox replay` creates
/// its stream with it.
///
/// nats-server keeps the id of every message a stream stored within its duplicate window in
/// memory (NATS docs, "JetStream Model Deep Dive", message deduplication): 115-151 bytes an
/// id on nats-server 2.15.1, 165-252 on 2.9.10 (BENCHMARKS.md, "Replaying the archive"), so a
/// stream holds about its publish rate times the window of them. A replay publishes tens of
/// thousands of events a second: into a 2-minute window at 25,000 events/s, 3 million ids,
/// 0.35 to 0.75 GB of the broker the live streams run on. A replay needs the window less than
/// a relay does: within a run no event is published twice (a failure stops the run), so its
/// duplicates come only from a run again, which the window drops if it starts within it, and
/// the consumer's inbox after it.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(10);

/// A place in archive order: an event's aggregate type, aggregate id, sequence and id.
///
/// Written and read as a JSON array, `["order","o-17",42,"0193…-…"]`, which carries any
/// aggregate type or id (a comma or a quote in either included).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ArchivePosition {
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id.
    pub aggregate_id: String,
    /// The event's sequence in its aggregate.
    pub aggregate_seq: i64,
    /// The event's id (orders two archived rows with one sequence).
    pub id: Uuid,
}

impl fmt::Display for ArchivePosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let array = serde_json::json!([
            self.aggregate_type,
            self.aggregate_id,
            self.aggregate_seq,
            self.id
        ]);
        write!(f, "{array}")
    }
}

/// A text that is not an [`ArchivePosition`]: what it should be and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error(
    "{text:?} is not an archive position, a JSON array [aggregate type, aggregate id, \
     sequence, event id] such as [\"order\",\"o-17\",42,\"0193a1e2-7c4d-7b1a-9c3e-5f60a7b8c9d0\"]: {reason}"
)]
pub struct InvalidPosition {
    /// The text, cut to 128 bytes.
    pub text: String,
    /// What is wrong with it.
    pub reason: String,
}

impl FromStr for ArchivePosition {
    type Err = InvalidPosition;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: String| InvalidPosition {
            text: crate::subject::shortened(text, 128),
            reason,
        };
        let (aggregate_type, aggregate_id, aggregate_seq, id): (String, String, i64, Uuid) =
            serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
        if aggregate_seq < 1 {
            return Err(invalid(format!(
                "the sequence {aggregate_seq} is below 1, where every aggregate starts"
            )));
        }
        Ok(Self {
            aggregate_type,
            aggregate_id,
            aggregate_seq,
            id,
        })
    }
}

/// What a replay did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Events the replay stream stored, duplicates included.
    pub published: u64,
    /// Of those, the ones it held already (inside its duplicate window: a replay run again).
    pub duplicates: u64,
    /// The last event published, after which a later replay starts to take what has been
    /// archived since (`None` when nothing matched).
    pub last: Option<ArchivePosition>,
}

/// Why a replay stopped. Every variant but [`Settings`](Self::Settings) and
/// [`Stream`](Self::Stream) carries the position to resume after: everything before it and
/// at it was acked by the replay stream.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The settings cannot work (the message says which one and why); nothing was read.
    #[error("the replay's settings: {0}")]
    Settings(String),
    /// The target stream could not be found, created, or used: it captures the producer's
    /// subjects, or JetStream refused it.
    #[error("the replay's stream: {0}")]
    Stream(#[from] StreamError),
    /// The archive could not be read.
    #[error("reading the archive{}: {source}", resume_text(.resume_after.as_deref()))]
    Database {
        /// The database's error.
        source: diesel::result::Error,
        /// Everything up to here was replayed.
        resume_after: Option<Box<ArchivePosition>>,
    },
    /// An event could not be published: JetStream refused it, did not ack it within
    /// `ack_timeout`, or could not be reached; or the event cannot be a message under the
    /// replay's prefix (its subject would be too long).
    #[error("publishing the event at {event}{}: {reason}", resume_text(.resume_after.as_deref()))]
    Publish {
        /// The event: its place in the archive, its id last.
        event: ArchivePosition,
        /// Why it was not published.
        reason: String,
        /// Everything up to here was replayed.
        resume_after: Option<Box<ArchivePosition>>,
    },
}

fn resume_text(after: Option<&ArchivePosition>) -> String {
    match after {
        Some(position) => format!(" (replayed up to {position}: resume after it)"),
        None => " (nothing replayed yet: start again)".to_owned(),
    }
}

impl ReplayError {
    /// The position to resume after ([`ReplayConfig::after`]): `None` when nothing was
    /// replayed, or for [`Settings`](Self::Settings) and [`Stream`](Self::Stream), where
    /// nothing was read.
    pub fn resume_after(&self) -> Option<&ArchivePosition> {
        match self {
            Self::Settings(_) | Self::Stream(_) => None,
            Self::Database { resume_after, .. } | Self::Publish { resume_after, .. } => {
                resume_after.as_deref()
            }
        }
    }
}

/// Replays the archive of `conn`'s database as `config` says, over `nats`, calling
/// `on_page` with the running totals after each page acked whole; returns the totals.
///
/// Runs alongside the producer's relays (it reads committed rows only, and takes no lock);
/// what they archive while it runs is replayed if its position is still ahead of the
/// replay's.
///
/// # Errors
/// [`ReplayError::Settings`] for settings that cannot work and for a connection inside a
/// transaction (give the replay one of its own), [`ReplayError::Stream`] for a
/// target stream that captures the producer's subjects or that JetStream refuses,
/// [`ReplayError::Database`] when the archive cannot be read (a database without the
/// migrations, a role without `SELECT` on `outbox_published`), [`ReplayError::Publish`]
/// when an event is not acked: the last two say where to resume.
pub async fn replay_archive<C: ArchiveConnection>(
    conn: &mut C,
    nats: async_nats::Client,
    config: &ReplayConfig,
    mut on_page: impl FnMut(&ReplayReport),
) -> Result<ReplayReport, ReplayError> {
    config.check()?;
    // Each page reads in a transaction of its own; inside the caller's, PostgreSQL's page
    // settings (`SET LOCAL`) would last until the caller's transaction ends, and apply to
    // its statements after the replay.
    let depth = C::TransactionManager::transaction_manager_status_mut(conn).transaction_depth();
    if !matches!(depth, Ok(None)) {
        return Err(ReplayError::Settings(
            "its connection is inside a transaction (or in a broken one): a replay reads each \
             page in a transaction of its own, whose settings would outlast the page in \
             yours; give it a connection of its own"
                .to_owned(),
        ));
    }
    let to = config.to.subject_prefix.as_str();
    let publisher = Publisher::new(
        nats,
        to,
        &config.source,
        config.ack_timeout,
        config.max_in_flight,
        config.to.stream.domain.as_deref(),
    )
    .map_err(|e| ReplayError::Settings(e.to_string()))?;
    let stream = ensure_stream(
        publisher.jetstream(),
        &config.to.stream,
        to,
        config.ack_timeout,
    )
    .await?;
    let from = config.from.as_str();
    if stream
        .subjects
        .iter()
        .any(|filter| takes_some_of(filter, from))
    {
        return Err(ReplayError::Stream(StreamError::Api {
            stream: config.to.stream.name.clone(),
            message: format!(
                "it captures some of the producer's subjects `{from}.>` ({}): it is the live \
                 stream, or holds its subjects too; give the replay a stream of its own",
                stream.subjects.join(", ")
            ),
        }));
    }
    let mut report = ReplayReport {
        last: config.after.clone(),
        ..ReplayReport::default()
    };
    let from_dot = format!("{from}.");
    loop {
        let page = Page {
            from_dot: from_dot.clone(),
            after: report.last.clone(),
            since: config.published_since,
            before: config.published_before,
            types: config.aggregate_types.clone(),
            limit: config.batch_size,
        };
        let mut rows = conn
            .page(&page)
            .await
            .map_err(|source| ReplayError::Database {
                source,
                resume_after: report.last.clone().map(Box::new),
            })?;
        let Some(last) = rows.last().map(position) else {
            return Ok(report);
        };
        for row in &mut rows {
            // Selected by this prefix; a database comparing otherwise than byte by byte
            // could select another spelling, which is refused rather than cut.
            let Some(rest) = row.subject.strip_prefix(from_dot.as_str()) else {
                return Err(ReplayError::Publish {
                    event: position(row),
                    reason: format!(
                        "its subject {:?} is not under the prefix `{from}`",
                        crate::subject::shortened(&row.subject, 256)
                    ),
                    resume_after: report.last.clone().map(Box::new),
                });
            };
            row.subject = format!("{to}.{rest}");
        }
        // Each aggregate's events together, in the order read (its sequence order), whatever
        // the database's collation took for one aggregate (MySQL's pads spaces: `o-1` and
        // `o-1 ` compare equal, and their rows come interleaved).
        rows.sort_by(|a, b| {
            (a.aggregate_type.as_bytes(), a.aggregate_id.as_bytes())
                .cmp(&(b.aggregate_type.as_bytes(), b.aggregate_id.as_bytes()))
        });
        let chains = rows.chunk_by(|a, b| {
            a.aggregate_type == b.aggregate_type && a.aggregate_id == b.aggregate_id
        });
        let outcomes =
            futures::future::join_all(chains.map(|chain| publish_chain(&publisher, chain))).await;
        for outcome in outcomes {
            let (published, duplicates) =
                outcome.map_err(|(row, reason)| ReplayError::Publish {
                    event: position(row),
                    reason,
                    resume_after: report.last.clone().map(Box::new),
                })?;
            report.published += published;
            report.duplicates += duplicates;
        }
        let full = rows.len() >= config.batch_size;
        report.last = Some(last);
        on_page(&report);
        if !full {
            return Ok(report);
        }
    }
}

/// Publishes one aggregate's events in order, each after the previous one's ack; returns how
/// many were published and how many of those the stream held already, or the first that
/// failed and why.
async fn publish_chain<'a>(
    publisher: &Publisher,
    chain: &'a [ClaimedEvent],
) -> Result<(u64, u64), (&'a ClaimedEvent, String)> {
    let mut published = 0;
    let mut duplicates = 0;
    for row in chain {
        let duplicate = publisher
            .publish(row)
            .await
            .map_err(|failure| (row, describe(failure)))?;
        published += 1;
        duplicates += u64::from(duplicate);
    }
    Ok((published, duplicates))
}

fn describe(failure: PublishFailure) -> String {
    match failure {
        PublishFailure::Invalid(reason) => {
            format!("it cannot be a message under the replay's prefix: {reason}")
        }
        PublishFailure::Rejected { error, .. } => format!("JetStream refused it: {error}"),
        PublishFailure::Transport { error, .. } => format!("JetStream was not reached: {error}"),
        PublishFailure::Unacknowledged { error, .. } => format!(
            "{error} (the broker is slow or stopping, the stream does not ack publishes, or \
             the connection may not publish to the replay's subjects)"
        ),
    }
}

/// Whether the subject filter `filter` matches some subject under `prefix` (`{prefix}.>`).
fn takes_some_of(filter: &str, prefix: &str) -> bool {
    let mut tokens = filter.split('.');
    for prefix_token in prefix.split('.') {
        match tokens.next() {
            Some(">") => return true,
            Some(token) if token == "*" || token == prefix_token => {}
            _ => return false,
        }
    }
    tokens.next().is_some()
}

fn position(row: &ClaimedEvent) -> ArchivePosition {
    ArchivePosition {
        aggregate_type: row.aggregate_type.clone(),
        aggregate_id: row.aggregate_id.clone(),
        aggregate_seq: row.aggregate_seq,
        id: row.id,
    }
}

/// What one page reads: the events under `from_dot` (the producer's prefix and a dot) after
/// `after` in archive order, within the filters, at most `limit`.
#[derive(Clone, Debug)]
pub(crate) struct Page {
    from_dot: String,
    after: Option<ArchivePosition>,
    since: Option<time::OffsetDateTime>,
    before: Option<time::OffsetDateTime>,
    types: Vec<String>,
    limit: usize,
}

/// A connection to a database whose archive [`replay_archive`] reads:
/// `AsyncPgConnection` (PostgreSQL's daily partitions), `AsyncMysqlConnection` (feature
/// `mysql`) or `AsyncSqliteConnection` (feature `sqlite`), whose archive is one table.
///
/// Sealed: implemented by the toolkit for the databases it has statements for.
#[allow(private_bounds)]
pub trait ArchiveConnection: Send + sealed::ReadsArchive {}

impl<C: Send + sealed::ReadsArchive> ArchiveConnection for C {}

pub(crate) mod sealed {
    use super::{ClaimedEvent, Page};

    /// Reads a page of the archive, on a connection of diesel-async's.
    pub(crate) trait ReadsArchive: diesel_async::AsyncConnection {
        /// The page's events in archive order, with the columns of a claimed row.
        fn page(
            &mut self,
            page: &Page,
        ) -> impl std::future::Future<Output = diesel::QueryResult<Vec<ClaimedEvent>>> + Send;
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use diesel::sql_types::{Array, BigInt, Text, Timestamptz, Uuid as SqlUuid};
    use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

    use super::{ClaimedEvent, Page};

    impl super::sealed::ReadsArchive for AsyncPgConnection {
        /// The order's first three keys are the index `outbox_published_aggregate`'s (each
        /// partition's, merged), and the row comparison starts each page where the last
        /// ended (`COLLATE "C"` columns: byte order, as the index's).
        async fn page(&mut self, page: &Page) -> diesel::QueryResult<Vec<ClaimedEvent>> {
            let mut sql = String::from(
                "SELECT id, aggregate_type, aggregate_id, aggregate_seq, event_type, \
                        event_version, partition_key, subject, payload, headers, occurred_at, \
                        correlation_id, causation_id, true AS available \
                 FROM outbox_published WHERE starts_with(subject, $1)",
            );
            // Each condition's parameters are numbered after the ones before it.
            let mut n = 1;
            let mut parameter = || {
                n += 1;
                format!("${n}")
            };
            if page.after.is_some() {
                let (t, a, s, i) = (parameter(), parameter(), parameter(), parameter());
                sql.push_str(&format!(
                    " AND (aggregate_type, aggregate_id, aggregate_seq, id) > ({t}, {a}, {s}, {i})"
                ));
            }
            if page.since.is_some() {
                sql.push_str(&format!(" AND published_at >= {}", parameter()));
            }
            if page.before.is_some() {
                sql.push_str(&format!(" AND published_at < {}", parameter()));
            }
            if !page.types.is_empty() {
                sql.push_str(&format!(" AND aggregate_type = ANY({})", parameter()));
            }
            sql.push_str(" ORDER BY aggregate_type, aggregate_id, aggregate_seq, id LIMIT ");
            sql.push_str(&page.limit.to_string());
            let mut query = diesel::sql_query(sql)
                .into_boxed()
                .bind::<Text, _>(&page.from_dot);
            if let Some(after) = &page.after {
                query = query
                    .bind::<Text, _>(&after.aggregate_type)
                    .bind::<Text, _>(&after.aggregate_id)
                    .bind::<BigInt, _>(after.aggregate_seq)
                    .bind::<SqlUuid, _>(after.id);
            }
            if let Some(since) = page.since {
                query = query.bind::<Timestamptz, _>(since);
            }
            if let Some(before) = page.before {
                query = query.bind::<Timestamptz, _>(before);
            }
            if !page.types.is_empty() {
                query = query.bind::<Array<Text>, _>(&page.types);
            }
            self.transaction(async |conn| {
                conn.batch_execute(ORDERED_SCAN).await?;
                query.load(conn).await
            })
            .await
        }
    }

    /// Steers a page's read to the ordered index scan, within the page's transaction only.
    /// PostgreSQL estimates a row comparison by its first column alone (`aggregate_type >
    /// 'Order'`: almost no row), and `starts_with` by a default selectivity, so it took a page
    /// for a few rows and read the whole archive, sorting it, to return 1,000 of them: 132 ms
    /// a page at 300,000 archived rows, growing with the archive; the ordered scan reads the
    /// page's rows alone (1.4 ms; `EXPLAIN ANALYZE`, PostgreSQL 15). Without JIT compilation:
    /// the sort by event id within a sequence is a sort `enable_sort = off` prices at its
    /// disabled-node cost (10^10), far over `jit_above_cost` (100,000 by default), and each
    /// page over ten daily partitions was compiled (79 functions, 120 ms) to run in 8 ms
    /// (PostgreSQL docs, 32.2 "When to JIT?"). `SET LOCAL` ends with the transaction
    /// (PostgreSQL docs, SET), so the connection's own settings are left as they were.
    const ORDERED_SCAN: &str = "SET LOCAL enable_seqscan = off; \
                                SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; \
                                SET LOCAL jit = off";
}

/// The archive of MySQL and SQLite: one table, with the index `outbox_published_aggregate` on
/// `(aggregate_type, aggregate_id, aggregate_seq)`. Neither server ranges an index over a
/// row comparison, and a sort by a fourth key would sort the rest of the archive for each
/// page, so a page is read by up to three statements, each a range of that index read in its
/// order: the rest of the position's aggregate, the later aggregates of its type, the later
/// types; then, when the page is full, every row of its last key, so that a key the page
/// cut (two archived rows with one sequence, which only a database restored under a running
/// relay leaves) is replayed whole and the next page starts after it.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
mod portable {
    use diesel::sql_types::{BigInt, Text};

    use super::{ArchivePosition, ClaimedEvent, Page};
    use crate::relay::polling::Row;

    /// What a statement of the page selects besides the filters.
    pub(super) enum Range<'a> {
        /// The archive's first rows.
        First,
        /// The position's aggregate, after its sequence.
        RestOfAggregate(&'a ArchivePosition),
        /// The position's type, after its aggregate.
        LaterAggregates(&'a ArchivePosition),
        /// After the position's type.
        LaterTypes(&'a ArchivePosition),
        /// Every row of one key (type, aggregate, sequence).
        Key(&'a ArchivePosition),
    }

    /// A value bound to a statement.
    pub(super) enum Bind {
        Text(String),
        Int(i64),
    }

    /// How the database writes what the statements need.
    pub(super) struct Dialect {
        /// The archive's columns as `relay::polling::Row` reads them.
        pub(super) columns: &'static str,
        /// True, as the database writes it (`available`).
        pub(super) truth: &'static str,
        /// Whether the subject starts with the prefix: two parameters, its length in
        /// characters and the prefix.
        pub(super) starts_with: &'static str,
        /// A time as the database compares it with `published_at`.
        pub(super) time: fn(time::OffsetDateTime) -> String,
    }

    /// The statement of `range` within `page`'s filters, at most `limit` rows, and its
    /// values.
    fn statement(
        dialect: &Dialect,
        page: &Page,
        range: &Range<'_>,
        limit: usize,
    ) -> (String, Vec<Bind>) {
        let mut sql = format!(
            "SELECT {}, {} AS available FROM outbox_published WHERE {}",
            dialect.columns, dialect.truth, dialect.starts_with
        );
        let mut binds = vec![
            Bind::Int(i64::try_from(page.from_dot.chars().count()).unwrap_or(i64::MAX)),
            Bind::Text(page.from_dot.clone()),
        ];
        let text = |value: &str| Bind::Text(value.to_owned());
        let order = match range {
            Range::First => "aggregate_type, aggregate_id, aggregate_seq",
            Range::RestOfAggregate(p) => {
                sql.push_str(" AND aggregate_type = ? AND aggregate_id = ? AND aggregate_seq > ?");
                binds.extend([
                    text(&p.aggregate_type),
                    text(&p.aggregate_id),
                    Bind::Int(p.aggregate_seq),
                ]);
                "aggregate_seq"
            }
            Range::LaterAggregates(p) => {
                sql.push_str(" AND aggregate_type = ? AND aggregate_id > ?");
                binds.extend([text(&p.aggregate_type), text(&p.aggregate_id)]);
                "aggregate_id, aggregate_seq"
            }
            Range::LaterTypes(p) => {
                sql.push_str(" AND aggregate_type > ?");
                binds.push(text(&p.aggregate_type));
                "aggregate_type, aggregate_id, aggregate_seq"
            }
            Range::Key(p) => {
                sql.push_str(" AND aggregate_type = ? AND aggregate_id = ? AND aggregate_seq = ?");
                binds.extend([
                    text(&p.aggregate_type),
                    text(&p.aggregate_id),
                    Bind::Int(p.aggregate_seq),
                ]);
                "id"
            }
        };
        if let Some(since) = page.since {
            sql.push_str(" AND published_at >= ?");
            binds.push(Bind::Text((dialect.time)(since)));
        }
        if let Some(before) = page.before {
            sql.push_str(" AND published_at < ?");
            binds.push(Bind::Text((dialect.time)(before)));
        }
        if !page.types.is_empty() {
            let marks = vec!["?"; page.types.len()].join(", ");
            sql.push_str(&format!(" AND aggregate_type IN ({marks})"));
            binds.extend(page.types.iter().map(|t| text(t)));
        }
        sql.push_str(&format!(" ORDER BY {order}"));
        // A key's rows are read whole.
        if !matches!(range, Range::Key(_)) {
            sql.push_str(&format!(" LIMIT {limit}"));
        }
        (sql, binds)
    }

    /// The reading of one page: [`next`](Self::next) gives each statement to run, and
    /// [`take`](Self::take) what it returned, until `next` gives none; then
    /// [`rows`](Self::rows) is the page.
    pub(super) struct Reading<'a> {
        dialect: &'a Dialect,
        page: &'a Page,
        ranges: Vec<Range<'a>>,
        /// The ranges read so far.
        read: usize,
        /// The page's last key, once it was read whole.
        completed: bool,
        rows: Vec<ClaimedEvent>,
    }

    impl<'a> Reading<'a> {
        pub(super) fn new(dialect: &'a Dialect, page: &'a Page) -> Self {
            let ranges = match &page.after {
                None => vec![Range::First],
                Some(p) => vec![
                    Range::RestOfAggregate(p),
                    Range::LaterAggregates(p),
                    Range::LaterTypes(p),
                ],
            };
            Self {
                dialect,
                page,
                ranges,
                read: 0,
                completed: false,
                rows: Vec::new(),
            }
        }

        /// The next statement to run, and its values; `None` once the page is read.
        pub(super) fn next(&self) -> Option<(String, Vec<Bind>)> {
            if self.completed {
                return None;
            }
            // The key's rows can take the page past its limit.
            let left = self.page.limit.saturating_sub(self.rows.len());
            if left > 0 {
                let range = self.ranges.get(self.read)?;
                return Some(statement(self.dialect, self.page, range, left));
            }
            let last = self.rows.last().map(super::position)?;
            Some(statement(
                self.dialect,
                self.page,
                &Range::Key(&last),
                usize::MAX,
            ))
        }

        /// Takes what the statement [`next`](Self::next) gave returned.
        pub(super) fn take(&mut self, rows: Vec<ClaimedEvent>) {
            if self.rows.len() < self.page.limit {
                self.rows.extend(rows);
                self.read += 1;
                return;
            }
            // The page's last key whole: its rows the ranges did not reach come after it.
            for row in rows {
                if !self.rows.iter().rev().any(|seen| seen.id == row.id) {
                    self.rows.push(row);
                }
            }
            self.completed = true;
        }

        /// The page, once read.
        pub(super) fn rows(self) -> Vec<ClaimedEvent> {
            self.rows
        }
    }

    /// `sql` with `binds` bound, for database `DB`.
    pub(super) fn bound<'f, DB>(
        sql: String,
        binds: Vec<Bind>,
    ) -> diesel::query_builder::BoxedSqlQuery<'f, DB, diesel::query_builder::SqlQuery>
    where
        DB: diesel::backend::Backend
            + diesel::sql_types::HasSqlType<Text>
            + diesel::sql_types::HasSqlType<BigInt>,
        String: diesel::serialize::ToSql<Text, DB>,
        i64: diesel::serialize::ToSql<BigInt, DB>,
    {
        let mut query = diesel::sql_query(sql).into_boxed::<DB>();
        for bind in binds {
            query = match bind {
                Bind::Text(value) => query.bind::<Text, _>(value),
                Bind::Int(value) => query.bind::<BigInt, _>(value),
            };
        }
        query
    }

    /// The rows a statement read, as the claim's rows.
    pub(super) fn claimed(rows: Vec<Row>) -> diesel::QueryResult<Vec<ClaimedEvent>> {
        rows.into_iter().map(Row::into_claimed).collect()
    }

    /// `time`, rounded up to `digits` decimals of a second, as `YYYY-MM-DD HH:MM:SS.fff...`
    /// in UTC: how both databases keep `published_at` (MySQL's `DATETIME(6)`, SQLite's text
    /// of `strftime('%Y-%m-%d %H:%M:%f')`, milliseconds). A stored time, a multiple of the
    /// precision, is at or after `time` exactly when it is at or after the rounded one, and
    /// before it exactly when it is before the rounded one.
    pub(super) fn utc_text(time: time::OffsetDateTime, digits: u32) -> String {
        let unit = 10_i128.pow(9 - digits);
        let nanos = time.unix_timestamp_nanos();
        let rounded = nanos.div_euclid(unit) * unit + if nanos % unit == 0 { 0 } else { unit };
        let time = time::OffsetDateTime::from_unix_timestamp_nanos(rounded).unwrap_or(time);
        let fraction = i128::from(time.nanosecond()) / unit;
        format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02}.{fraction:0width$}",
            time.year(),
            u8::from(time.month()),
            time.day(),
            time.hour(),
            time.minute(),
            time.second(),
            width = digits as usize
        )
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use diesel::mysql::Mysql;
    use diesel_async::{AsyncMysqlConnection, RunQueryDsl};

    use super::portable::{self, Dialect, Reading};
    use super::{ClaimedEvent, Page};

    const MYSQL: Dialect = Dialect {
        columns: crate::relay::mysql::COLUMNS,
        truth: "TRUE",
        starts_with: "LEFT(subject, ?) = ?",
        time: |time| portable::utc_text(time, 6),
    };

    impl super::sealed::ReadsArchive for AsyncMysqlConnection {
        async fn page(&mut self, page: &Page) -> diesel::QueryResult<Vec<ClaimedEvent>> {
            let mut reading = Reading::new(&MYSQL, page);
            while let Some((sql, binds)) = reading.next() {
                let rows = portable::bound::<Mysql>(sql, binds).load(self).await?;
                reading.take(portable::claimed(rows)?);
            }
            Ok(reading.rows())
        }
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use diesel::RunQueryDsl;
    use diesel::sqlite::Sqlite;

    use super::portable::{self, Dialect, Reading};
    use super::{ClaimedEvent, Page};
    use crate::sqlite::AsyncSqliteConnection;

    const SQLITE: Dialect = Dialect {
        columns: crate::relay::sqlite::COLUMNS,
        truth: "1",
        starts_with: "substr(subject, 1, ?) = ?",
        time: |time| portable::utc_text(time, 3),
    };

    impl super::sealed::ReadsArchive for AsyncSqliteConnection {
        async fn page(&mut self, page: &Page) -> diesel::QueryResult<Vec<ClaimedEvent>> {
            let page = page.clone();
            self.spawn_blocking(move |conn| {
                let mut reading = Reading::new(&SQLITE, &page);
                while let Some((sql, binds)) = reading.next() {
                    let rows = portable::bound::<Sqlite>(sql, binds).load(conn)?;
                    reading.take(portable::claimed(rows)?);
                }
                Ok(reading.rows())
            })
            .await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StreamSettings;

    fn config(from: &str, to: &str) -> ReplayConfig {
        ReplayConfig::new(
            from.parse().unwrap(),
            Topology::new(
                to.parse().unwrap(),
                StreamSettings {
                    name: "REPLAY".into(),
                    ..StreamSettings::default()
                },
            ),
        )
    }

    #[test]
    fn a_target_sharing_the_producers_subjects_is_refused() {
        for (from, to) in [
            ("events", "events"),
            ("events", "events.replay"),
            ("acme.events", "acme"),
        ] {
            let error = config(from, to).fault().unwrap_err();
            assert!(
                error.contains(&format!("`{to}`")) && error.contains(&format!("`{from}`")),
                "{from} -> {to}: {error}"
            );
        }
        for (from, to) in [("events", "replay"), ("events", "eventsx"), ("a.b", "a.c")] {
            assert_eq!(config(from, to).fault(), Ok(()), "{from} -> {to}");
        }
    }

    #[test]
    fn a_stream_filter_takes_some_of_a_prefix_when_a_subject_matches_both() {
        for filter in [
            ">",
            "events.>",
            "*.>",
            "events.order.>",
            "events.*",
            "*.*.x",
        ] {
            assert!(takes_some_of(filter, "events"), "{filter}");
        }
        for filter in ["events", "replay.>", "eventsx.>", "*", "event.>"] {
            assert!(!takes_some_of(filter, "events"), "{filter}");
        }
        assert!(takes_some_of("acme.*.>", "acme.events"));
        assert!(!takes_some_of("acme.orders.>", "acme.events"));
    }

    #[test]
    fn settings_that_cannot_work_are_named() {
        let mut c = config("events", "replay");
        c.batch_size = 0;
        assert!(c.fault().unwrap_err().contains("batch_size 0"));
        let mut c = config("events", "replay");
        c.to.stream.name = "RE.PLAY".into();
        assert!(c.fault().unwrap_err().contains("the replay's stream name"));
        let mut c = config("events", "replay");
        c.max_in_flight = 0;
        assert!(c.fault().unwrap_err().contains("max_in_flight"));
        let mut c = config("events", "replay");
        c.ack_timeout = Duration::ZERO;
        assert!(c.fault().unwrap_err().contains("ack_timeout"));
        let mut c = config("events", "replay");
        let now = time::OffsetDateTime::now_utc();
        c.published_since = Some(now);
        c.published_before = Some(now);
        assert!(c.fault().unwrap_err().contains("published_since"));
    }

    #[cfg(any(feature = "mysql", feature = "sqlite"))]
    #[test]
    fn a_time_is_written_as_the_database_keeps_it_rounded_up_to_its_precision() {
        use time::macros::datetime;
        for (time, digits, text) in [
            (
                datetime!(2026-12-04 10:00:00 UTC),
                3,
                "2026-12-04 10:00:00.000",
            ),
            (
                datetime!(2026-12-04 10:00:00.000_4 UTC),
                3,
                "2026-12-04 10:00:00.001",
            ),
            (
                datetime!(2026-12-04 10:00:00.123_456_7 UTC),
                6,
                "2026-12-04 10:00:00.123457",
            ),
            (
                datetime!(2026-12-31 23:59:59.999_9 UTC),
                3,
                "2027-01-01 00:00:00.000",
            ),
            (
                datetime!(2026-12-04 12:00:00 +02:00),
                6,
                "2026-12-04 10:00:00.000000",
            ),
        ] {
            assert_eq!(portable::utc_text(time, digits), text, "{time}");
        }
    }

    /// An archived row of `aggregate_id` at `seq`, with id `id`.
    #[cfg(any(feature = "mysql", feature = "sqlite"))]
    fn row(aggregate_id: &str, seq: i64, id: u128) -> ClaimedEvent {
        use crate::outbox::queries::{JsonBytes, JsonText};
        ClaimedEvent {
            id: Uuid::from_u128(id),
            aggregate_type: "Order".into(),
            aggregate_id: aggregate_id.into(),
            aggregate_seq: seq,
            event_type: "Placed".into(),
            event_version: 1,
            partition_key: aggregate_id.into(),
            subject: format!("events.Order.{aggregate_id}.Placed"),
            payload: JsonBytes(bytes::Bytes::from_static(b"{}")),
            headers: JsonText(b"{}".to_vec()),
            occurred_at: time::OffsetDateTime::UNIX_EPOCH,
            correlation_id: None,
            causation_id: None,
            available: true,
        }
    }

    /// A page on MySQL and SQLite: the ranges after the position in turn, until the page is
    /// full, then its last key whole, so that a key the limit cut (two archived rows with one
    /// sequence) is replayed whole and the next page starts after it.
    #[cfg(any(feature = "mysql", feature = "sqlite"))]
    #[test]
    fn a_portable_page_reads_its_ranges_in_turn_then_its_last_key_whole() {
        use portable::{Dialect, Reading};
        const DIALECT: Dialect = Dialect {
            columns: "*",
            truth: "1",
            starts_with: "substr(subject, 1, ?) = ?",
            time: |time| portable::utc_text(time, 3),
        };
        let page = Page {
            from_dot: "events.".into(),
            after: Some(ArchivePosition {
                aggregate_type: "Order".into(),
                aggregate_id: "o-1".into(),
                aggregate_seq: 4,
                id: Uuid::from_u128(1),
            }),
            since: None,
            before: None,
            types: Vec::new(),
            limit: 3,
        };
        let mut reading = Reading::new(&DIALECT, &page);
        let mut statements = Vec::new();
        let mut answers = vec![
            // The rest of o-1: one row. Later aggregates of its type: two, the last cut.
            vec![row("o-1", 5, 10)],
            vec![row("o-2", 1, 11), row("o-2", 2, 12)],
            // o-2's sequence 2 whole: the row read, and one more.
            vec![row("o-2", 2, 12), row("o-2", 2, 13)],
        ]
        .into_iter();
        while let Some((sql, _)) = reading.next() {
            statements.push(sql);
            reading.take(answers.next().expect("no more statements than answers"));
        }
        let conditions: Vec<&str> = statements
            .iter()
            .map(|sql| {
                let start = sql.find("? AND ").map_or(0, |at| at + 6);
                &sql[start..]
            })
            .collect();
        assert_eq!(
            conditions,
            [
                "aggregate_type = ? AND aggregate_id = ? AND aggregate_seq > ? \
                 ORDER BY aggregate_seq LIMIT 3",
                "aggregate_type = ? AND aggregate_id > ? ORDER BY aggregate_id, aggregate_seq \
                 LIMIT 2",
                "aggregate_type = ? AND aggregate_id = ? AND aggregate_seq = ? ORDER BY id",
            ]
        );
        let read: Vec<(String, i64, u128)> = reading
            .rows()
            .into_iter()
            .map(|r| (r.aggregate_id, r.aggregate_seq, r.id.as_u128()))
            .collect();
        assert_eq!(
            read,
            [
                ("o-1".to_owned(), 5, 10),
                ("o-2".to_owned(), 1, 11),
                ("o-2".to_owned(), 2, 12),
                ("o-2".to_owned(), 2, 13)
            ]
        );
    }

    #[test]
    fn a_position_reads_back_what_it_writes_whatever_its_ids_hold() {
        let position = ArchivePosition {
            aggregate_type: "order".into(),
            aggregate_id: "o-1,\"x\"]".into(),
            aggregate_seq: 42,
            id: Uuid::now_v7(),
        };
        let text = position.to_string();
        assert_eq!(text.parse::<ArchivePosition>().unwrap(), position);
    }

    #[test]
    fn a_text_that_is_not_a_position_says_what_one_is() {
        for (text, reason) in [
            ("order,o-1,3", "expected value"),
            ("[\"order\",\"o-1\",3]", "invalid length 3"),
            (
                "[\"order\",\"o-1\",0,\"0193a1e2-7c4d-7b1a-9c3e-5f60a7b8c9d0\"]",
                "below 1",
            ),
            ("[\"order\",\"o-1\",3,\"x\"]", "UUID"),
        ] {
            let error = text.parse::<ArchivePosition>().unwrap_err().to_string();
            assert!(
                error.contains("JSON array") && error.contains(reason),
                "{text}: {error}"
            );
        }
    }
}
