//! A relay worker: one batch per transaction, in a loop that waits when idle and backs off
//! when the broker or the database fails.
//!
//! Within a batch, rows of different aggregates are published concurrently (bounded by the
//! relay's in-flight window) and the rows of one aggregate one after another, each after the
//! previous one's ack: a failure ends that aggregate's chain, so no later event overtakes it.
//!
//! Every query of a batch is bounded by the statement timeout, and every publish by the ack
//! timeout, so a database or a broker that stops answering costs a batch, never the worker:
//! the connection is dropped (PostgreSQL rolls its transaction back when it notices) and the
//! worker starts again on a new one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::connection::State;
use diesel::QueryResult;
#[cfg(feature = "postgres")]
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, TransactionManager};
use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::doorbell::{Doorbell, Rest};
use super::{Backoff, Shared};
use crate::database::{self, Bounded};
use crate::nats::stream_not_found;
use crate::outbox::OutboxStats;
#[cfg(feature = "postgres")]
use crate::outbox::queries;
use crate::outbox::queries::{ClaimedEvent, Held, PublishedRows, Rejection, RetryPolicy};
use crate::publisher::{PublishFailure, Publisher, captures, ensure_stream};

/// What one batch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Rows claimed: heads of their aggregate's queue and rows behind them, within
    /// `batch_size`.
    pub claimed: usize,
    /// Rows acked and marked (or deleted).
    pub published: usize,
    /// Of the published rows, those JetStream already held: a row published again after a
    /// relay died between the ack and its commit, dropped by the stream's dedup.
    pub duplicates: usize,
    /// Rows the broker rejected, or that cannot be published as they stand; each counted an
    /// attempt.
    pub rejected: usize,
    /// Of the rejected rows, those that became dead letters.
    pub dead_lettered: usize,
    /// Rows not published because the broker could not be reached or did not ack in time;
    /// no attempt counted.
    pub transport_failures: usize,
}

/// Opens a relay connection: named `outbox-relay` in `pg_stat_activity` (unless the URL or
/// `PGAPPNAME` names it), within the relay's
/// connect timeout, with its statement timeout, its transactions READ COMMITTED whatever the
/// database's default ([`database::Isolation::ReadCommitted`]), and no `lock_timeout`
/// ([`NO_LOCK_TIMEOUT`]). Reads the session's `idle_in_transaction_session_timeout`, which a
/// batch's keep-alive follows ([`RelayStore::keep_alive_every`]).
#[cfg(feature = "postgres")]
pub(super) async fn connect(shared: &Shared) -> Result<AsyncPgConnection, database::ConnectError> {
    #[derive(diesel::QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        ms: i64,
    }
    use diesel_async::RunQueryDsl as _;
    let mut conn = database::connect(
        &shared.config.database_url,
        shared.config.connector.as_ref(),
        "outbox-relay",
        shared.limits(),
        database::Isolation::ReadCommitted,
        None,
    )
    .await?;
    database::bounded_setup(
        shared.config.statement_timeout,
        &shared.target,
        "switching the session's lock_timeout off",
        diesel_async::SimpleAsyncConnection::batch_execute(&mut conn, NO_LOCK_TIMEOUT),
    )
    .await?;
    let setting = database::bounded_setup(
        shared.config.statement_timeout,
        &shared.target,
        "reading idle_in_transaction_session_timeout",
        diesel::sql_query(IDLE_IN_TRANSACTION).get_result::<Setting>(&mut conn),
    )
    .await?;
    shared.idle_in_transaction_ms.store(
        u64::try_from(setting.ms).unwrap_or(0),
        std::sync::atomic::Ordering::Relaxed,
    );
    Ok(conn)
}

/// A relay session's `lock_timeout`: none, whatever the database's or the role's. An
/// operator's, meant for the applications' sessions, refused the relay's own statements now
/// and then (a batch's lock waits are short: it waits for no row lock, `SKIP LOCKED`), and
/// each refusal cost a reconnect with backoff: under a 1-ms `lock_timeout`, 3 relays beside 4
/// writers logged "the relay's database fails ... canceling statement due to lock timeout"
/// in one run of about fifteen. Its `statement_timeout` bounds every statement instead.
#[cfg(feature = "postgres")]
const NO_LOCK_TIMEOUT: &str = "SET lock_timeout TO 0";

/// The session's `idle_in_transaction_session_timeout` in milliseconds (0: none), as
/// `pg_settings` gives it: the database's, the role's or the server's.
#[cfg(feature = "postgres")]
const IDLE_IN_TRANSACTION: &str = "SELECT setting::int8 AS ms FROM pg_settings \
     WHERE name = 'idle_in_transaction_session_timeout'";

/// The worker loop: batches until `stop`, then returns after the batch in progress.
///
/// `peers` are the other workers' wake-ups: a batch that published rows makes new heads
/// claimable (the rows behind the published ones), which a peer that found nothing to claim
/// would otherwise only see at its next poll.
pub(super) async fn run<C: RelayStore>(
    shared: Arc<Shared>,
    me: usize,
    mut conn: Option<C>,
    wake: Arc<Notify>,
    peers: Vec<Arc<Notify>>,
    doorbell: Option<Arc<Doorbell>>,
    stop: CancellationToken,
) {
    let config = &shared.config;
    let mut backoff = Backoff::new(config.max_backoff);
    // Batches in a row that claimed rows.
    let mut streak = 0;
    // When the connection was last used, against `RelayStore::idle_limit`.
    let mut used = tokio::time::Instant::now();
    while !stop.is_cancelled() {
        let epoch = doorbell.as_ref().map_or(0, |doorbell| doorbell.epoch());
        if C::idle_too_long(&shared, used) {
            conn = None;
        }
        let step = step(&shared, me, &mut conn, &stop).await;
        if !matches!(step, Step::BrokerDown) {
            used = tokio::time::Instant::now();
        }
        if matches!(step, Step::Busy) {
            streak += 1;
            if let Some(doorbell) = &doorbell {
                doorbell.busy(streak);
            }
            peers.iter().for_each(|peer| peer.notify_one());
        } else {
            streak = 0;
        }
        match step {
            Step::Busy => backoff.reset(),
            // Woken by a notification, by another worker's batch, or when the relay's poll
            // falls due (one worker's, for all); without a listener, polling alone.
            Step::Idle => {
                backoff.reset();
                let rest = doorbell
                    .as_ref()
                    .map_or(Rest::Sleep, |doorbell| doorbell.idle(epoch));
                let armed = async {
                    match (&doorbell, rest) {
                        (Some(doorbell), Rest::Arm) => doorbell.armed().await,
                        _ => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    () = stop.cancelled() => {}
                    () = wake.notified() => {}
                    () = armed => {}
                    () = shared.held.poll_due(config.poll_interval) => {}
                }
                if let (Some(doorbell), Rest::Sleep) = (&doorbell, rest) {
                    doorbell.awake();
                }
            }
            // Nothing to do until the client is connected again: look every 100 ms, so the
            // relay resumes as soon as the broker is back, however long it was away.
            Step::BrokerDown => {
                backoff.reset();
                let _resting = doorbell.as_deref().map(Doorbell::resting);
                tokio::select! {
                    biased;
                    () = stop.cancelled() => {}
                    () = tokio::time::sleep(BROKER_POLL) => {}
                }
            }
            // Notifications do not shorten a backoff: they would hammer a broker that is
            // failing. A reconnect does: the failure was the connection's.
            Step::Failed { connects } => {
                let pause = backoff.next();
                let _resting = doorbell.as_deref().map(Doorbell::resting);
                tokio::select! {
                    biased;
                    () = stop.cancelled() => {}
                    () = tokio::time::sleep(pause) => {}
                    () = reconnected(&shared.publisher, connects) => backoff.reset(),
                }
            }
        }
    }
    if let Some(conn) = conn.as_mut() {
        conn.close().await;
    }
}

/// How often a worker looks whether the broker is back.
const BROKER_POLL: Duration = Duration::from_millis(100);

/// Completes once the client has connected again since it had connected `connects` times.
async fn reconnected(publisher: &Publisher, connects: u64) {
    loop {
        tokio::time::sleep(BROKER_POLL).await;
        let state = publisher.client().connection_state();
        if state == State::Connected && publisher.connects() > connects {
            return;
        }
    }
}

enum Step {
    /// The batch claimed rows: there may be more at once. (A batch can be smaller than
    /// `batch_size` with rows still queued: the claim's window bounds how many heads it
    /// looks at.)
    Busy,
    /// Nothing was claimable: wait for a notification or the poll interval.
    Idle,
    /// The client is not connected to the broker: claiming would only lock rows to fail
    /// them. Wait until it is.
    BrokerDown,
    /// A publish failed in transport, or the database failed: back off. `connects` is the
    /// client's connect count at the failure.
    Failed { connects: u64 },
}

async fn step<C: RelayStore>(
    shared: &Shared,
    me: usize,
    conn_slot: &mut Option<C>,
    stop: &CancellationToken,
) -> Step {
    let connects = shared.publisher.connects();
    if shared.nats.connection_state() != State::Connected {
        metrics::counter!("outbox_relay_broker_unavailable_total").increment(1);
        shared.health.broker_down();
        return Step::BrokerDown;
    }
    shared.health.broker_up();
    if conn_slot.is_none() {
        match C::connect(shared).await {
            Ok(conn) => *conn_slot = Some(conn),
            Err(error) => {
                let stream = &shared.config.topology.stream.name;
                shared
                    .health
                    .database_failed(stream, "connect", &error.to_string());
                return Step::Failed { connects };
            }
        }
    }
    let conn = conn_slot.as_mut().expect("connected above");
    match relay_batch(shared, Some(me), conn, stop).await {
        Ok(outcome) => {
            shared.health.database_ok();
            match outcome.transport_error {
                Some(error) => {
                    shared.health.transport_failed(&error);
                    if outcome.no_responders {
                        restore_missing_stream(shared).await;
                    }
                    Step::Failed { connects }
                }
                None => {
                    // A batch that claimed nothing (or whose rows were all refused) says
                    // nothing of publishes.
                    if outcome.report.published > 0 {
                        shared.health.transport_ok();
                    }
                    if outcome.report.claimed > 0 {
                        Step::Busy
                    } else {
                        Step::Idle
                    }
                }
            }
        }
        Err(error) => {
            let stream = &shared.config.topology.stream.name;
            // A database that stopped taking writes (a primary demoted under a fixed
            // address), or a privilege revoked from the relay's role, is named as such, with
            // what to do.
            let hint = match &error {
                Bounded::Failed(error) => database::refusal_hint(error, C::KIND, "relay"),
                Bounded::TimedOut(_) => String::new(),
            };
            shared
                .health
                .database_failed(stream, "batch", &format!("{error}{hint}"));
            // The transaction's state is unknown (a timeout) or failed: a new connection
            // starts clean, and PostgreSQL rolls back what this one left.
            *conn_slot = None;
            Step::Failed { connects }
        }
    }
}

/// A batch's report, with the first transport failure it met.
pub(super) struct BatchOutcome {
    pub report: BatchReport,
    pub transport_error: Option<String>,
    /// Whether a publish found no responder: JetStream is down, or the stream is gone.
    pub no_responders: bool,
}

/// After a publish found no responder: where JetStream answers that the relay's stream does
/// not exist (an operator deleted it, or the server lost its store), creates it again as the
/// relay did at start-up ([`ensure_stream`]) when `StreamSettings::create` allows, and says
/// so; otherwise says that it is missing, once per look. Where the stream exists and its
/// subjects no longer capture `{prefix}.>` (edited since start-up), says so, naming them,
/// and changes nothing: the stream is the operator's. The rows wait in the outbox either
/// way, their attempts not counted. Where JetStream does not answer, nothing: the worker
/// backs off and publishes again, as for any transport failure.
async fn restore_missing_stream(shared: &Shared) {
    let _one_at_a_time = shared.stream_check.lock().await;
    let config = &shared.config;
    let settings = &config.topology.stream;
    let prefix = config.topology.subject_prefix.as_str();
    let jetstream = shared.publisher.jetstream();
    let lookup = tokio::time::timeout(config.ack_timeout, jetstream.get_stream(&settings.name));
    match lookup.await {
        Ok(Err(error)) if stream_not_found(&error) => {}
        Ok(Ok(stream)) => {
            let subjects = &stream.cached_info().config.subjects;
            if !captures(subjects, prefix) {
                tracing::error!(
                    stream = %settings.name, ?subjects,
                    "the JetStream stream's subjects no longer capture all of \"{prefix}.>\" \
                     (changed since the relay started): publishes outside them find no stream; \
                     the events wait in the outbox until the stream captures them again \
                     (nats stream edit --subjects)"
                );
            }
            return;
        }
        _ => return,
    }
    if !settings.create {
        tracing::error!(
            stream = %settings.name, domain = ?settings.domain,
            "the JetStream stream does not exist, and StreamSettings::create is off: the relay \
             publishes nothing until it does (create it); the events wait in the outbox"
        );
        return;
    }
    match ensure_stream(jetstream, settings, prefix, config.ack_timeout).await {
        Ok(_) => tracing::warn!(
            stream = %settings.name,
            "the JetStream stream was gone (deleted, or its server lost its store); the relay \
             created it again, as at start-up: the old stream's messages, consumers and \
             duplicate window are not in it"
        ),
        Err(error) => tracing::error!(
            stream = %settings.name, %error,
            "the JetStream stream is gone and could not be created again; the relay retries"
        ),
    }
}

/// Why a batch failed: a query failed or did not answer in time.
pub(super) type BatchError = Bounded<diesel::result::Error>;

/// Claims, publishes and records one batch in one transaction. `me` is the worker's index
/// in [`HeldAggregates`] (`None` outside the worker loop). On an error the transaction is
/// rolled back, or, when the database did not answer, left for the caller to drop with the
/// connection.
pub(super) async fn relay_batch<C: RelayStore>(
    shared: &Shared,
    me: Option<usize>,
    conn: &mut C,
    stop: &CancellationToken,
) -> Result<BatchOutcome, BatchError> {
    let (limit, target) = (shared.config.statement_timeout, shared.target.as_str());
    let started = Instant::now();
    // Released whether the transaction commits, rolls back or fails.
    let _holding = shared.held.holding(me);
    let ended = async {
        let (outcome, published) = batch(shared, me, conn, stop).await?;
        database::bounded(
            limit,
            target,
            "recording published rows and the COMMIT of a relay batch",
            conn.finish_and_commit(&published, shared.config.published),
        )
        .await?;
        Ok(outcome)
    };
    let outcome = match ended.await {
        Ok(outcome) => outcome,
        Err(error @ Bounded::TimedOut(_)) => return Err(error),
        Err(error) => {
            // Where the failure ended the transaction already, this only warns.
            let _ = database::bounded(
                limit,
                target,
                "the ROLLBACK of a relay batch",
                conn.rollback(),
            )
            .await;
            return Err(error);
        }
    };

    let report = &outcome.report;
    metrics::counter!("outbox_relay_duplicates_total").increment(report.duplicates as u64);
    metrics::counter!("outbox_relay_dead_lettered_total").increment(report.dead_lettered as u64);
    if report.claimed > 0 {
        metrics::histogram!("outbox_relay_batch_seconds").record(started.elapsed());
        tracing::debug!(
            claimed = report.claimed,
            published = report.published,
            duplicates = report.duplicates,
            rejected = report.rejected,
            dead_lettered = report.dead_lettered,
            transport_failures = report.transport_failures,
            elapsed = ?started.elapsed(),
            "relay batch"
        );
    } else {
        metrics::gauge!("outbox_relay_lag_seconds").set(0.0);
    }
    Ok(outcome)
}

/// Awaits `publishing`, the batch's publishes and its looks at the stream after a missing
/// ack ([`resolve_unacknowledged`]), sending the session [`RelayStore::keep_alive`] every
/// [`RelayStore::keep_alive_every`] meanwhile.
async fn while_publishing<C: RelayStore, T>(
    shared: &Shared,
    conn: &mut C,
    publishing: impl Future<Output = T>,
) -> Result<T, BatchError> {
    let Some(every) = C::keep_alive_every(shared) else {
        return Ok(publishing.await);
    };
    tokio::pin!(publishing);
    loop {
        tokio::select! {
            biased;
            outcome = &mut publishing => return Ok(outcome),
            () = tokio::time::sleep(every) => {
                let (limit, target) = (shared.config.statement_timeout, shared.target.as_str());
                database::bounded(limit, target, "the relay's keep-alive", conn.keep_alive())
                    .await?;
            }
        }
    }
}

/// The batch's work inside its transaction, but the end: what it did, and the ids of the
/// rows the broker acked, for [`RelayStore::finish_and_commit`].
async fn batch<C: RelayStore>(
    shared: &Shared,
    me: Option<usize>,
    conn: &mut C,
    stop: &CancellationToken,
) -> Result<(BatchOutcome, Vec<Uuid>), BatchError> {
    let config = &shared.config;
    let (limit, target) = (config.statement_timeout, shared.target.as_str());
    let batch_size = i64::try_from(config.batch_size).unwrap_or(i64::MAX);
    let claimed;
    let chains = {
        // One claim at a time in a relay: each sees all that its peers hold.
        let _turn = shared.held.turn().await;
        let peers_hold = shared.held.others(me);
        let held = Held {
            types: peers_hold.iter().map(|(t, _)| t.as_str()).collect(),
            ids: peers_hold.iter().map(|(_, i)| i.as_str()).collect(),
        };
        claimed = database::bounded(
            limit,
            target,
            "the BEGIN and claim of a relay batch",
            conn.begin_and_claim(batch_size, &held),
        )
        .await?;
        let chains = chains(&claimed, config.batch_size);
        metrics::counter!(
            "outbox_relay_claims_total",
            "stream" => config.topology.stream.name.clone(),
            "found" => if chains.is_empty() { "nothing" } else { "rows" },
        )
        .increment(1);
        shared.held.hold(
            me,
            chains.iter().map(|chain| {
                (
                    chain[0].aggregate_type.clone(),
                    chain[0].aggregate_id.clone(),
                )
            }),
        );
        chains
    };
    let mut report = BatchReport {
        claimed: chains.iter().map(|chain| chain.len()).sum(),
        ..BatchReport::default()
    };
    if let Some(oldest) = chains.iter().map(|chain| chain[0].occurred_at).min() {
        let lag = time::OffsetDateTime::now_utc() - oldest;
        metrics::gauge!("outbox_relay_lag_seconds").set(lag.as_seconds_f64());
    }
    crash_point!("relay::before_publish", |_| Err(Bounded::Failed(
        crate::unit_of_work::simulated_crash()
    )));
    // The publishes, then the looks at the stream after a missing ack: network work only, as
    // long as the acks and the ack timeouts make it, the batch's session kept alive meanwhile.
    // Unordered: the outcomes are independent, and polling them in any order is cheaper than
    // join_all's ordered bookkeeping.
    let publishing = async {
        let mut outcomes = chains
            .iter()
            .map(|chain| publish_chain(&shared.publisher, chain, stop))
            .collect::<futures::stream::FuturesUnordered<_>>()
            .collect::<Vec<ChainOutcome<'_>>>()
            .await;
        resolve_unacknowledged(shared, &mut outcomes).await;
        outcomes
    };
    let outcomes = while_publishing(shared, conn, publishing).await?;
    if outcomes.iter().any(|outcome| outcome.crashed) {
        return Err(Bounded::Failed(crate::unit_of_work::simulated_crash()));
    }

    let mut transport_error = None;
    let mut no_responders = false;
    let mut published: Vec<Uuid> = Vec::with_capacity(report.claimed);
    let mut by_type: HashMap<&str, u64> = HashMap::new();
    // The outcomes come in completion order: each carries its chain.
    for outcome in &outcomes {
        for row in &outcome.chain[..outcome.published.len()] {
            *by_type.entry(row.event_type.as_str()).or_default() += 1;
        }
    }
    for (event_type, count) in by_type {
        metrics::counter!("outbox_relay_published_total", "event_type" => event_type.to_owned())
            .increment(count);
    }
    for outcome in outcomes {
        published.extend(outcome.published);
        report.duplicates += outcome.duplicates;
        let Some((row, failure)) = outcome.failure else {
            continue;
        };
        let (error, policy, kind) = match failure {
            PublishFailure::Transport { kind, error } => {
                report.transport_failures += 1;
                no_responders |= kind == "no_responders";
                metrics::counter!("outbox_relay_transport_failures_total", "kind" => kind)
                    .increment(1);
                tracing::debug!(id = %row.id, %error, "publish failed in transport");
                transport_error.get_or_insert(error);
                continue;
            }
            // A row that cannot be published as it stands will not be publishable at the
            // next attempt either: it is a dead letter at once, for an operator to fix.
            PublishFailure::Invalid(error) => (
                error,
                RetryPolicy {
                    max_attempts: 1,
                    ..shared.retry
                },
                "invalid",
            ),
            PublishFailure::Rejected { kind, error } => (error, shared.retry, kind),
            PublishFailure::Unacknowledged { .. } => unreachable!("resolved while publishing"),
        };
        metrics::counter!("outbox_relay_rejected_total", "kind" => kind).increment(1);
        let rejection = database::bounded(
            limit,
            target,
            "recording a rejected row",
            conn.reject(row.id, &error, policy),
        )
        .await?;
        report.rejected += 1;
        if rejection.dead_lettered {
            report.dead_lettered += 1;
            tracing::error!(
                id = %row.id, subject = %crate::subject::shortened(&row.subject, 128),
                attempts = rejection.attempts, %error,
                "dead-lettered an event that cannot be published"
            );
        } else {
            tracing::warn!(
                id = %row.id, subject = %crate::subject::shortened(&row.subject, 128),
                attempts = rejection.attempts, %error,
                "the broker rejected an event; it will be retried"
            );
        }
    }
    report.published = published.len();
    crash_point!("relay::after_publish", |_| Err(Bounded::Failed(
        crate::unit_of_work::simulated_crash()
    )));
    Ok((
        BatchOutcome {
            report,
            transport_error,
            no_responders,
        },
        published,
    ))
}

/// Resolves each [`PublishFailure::Unacknowledged`] of `outcomes` (a missing ack while the
/// connection stayed up) into a transport failure or a rejection: asks the stream, once per
/// batch, whether it answers ([`stream_answer_now`]) and, where it answers and acknowledges
/// publishes, whether it holds the message ([`holds`]); where it does not, the server dropped
/// the message on purpose. Each look is bounded by the ack timeout.
async fn resolve_unacknowledged(shared: &Shared, outcomes: &mut [ChainOutcome<'_>]) {
    let config = &shared.config;
    let mut stream_answer = None;
    for (row, failure) in outcomes
        .iter_mut()
        .filter_map(|outcome| outcome.failure.as_mut())
    {
        let PublishFailure::Unacknowledged { error, connects } = failure else {
            continue;
        };
        let (error, connects) = (std::mem::take(error), *connects);
        if stream_answer.is_none() {
            stream_answer = Some(stream_answer_now(shared, connects).await);
        }
        let stream = &config.topology.stream.name;
        let answer = stream_answer.as_mut().expect("asked above");
        let held = answer.holds(row, config).await;
        *failure = match (answer, held) {
            (StreamAnswer::Silent, _) => PublishFailure::Transport {
                kind: "no_ack",
                error,
            },
            // The stream stored the message (its republish will be a duplicate it
            // acks once acks are back): nothing is wrong with the message.
            (StreamAnswer::WithoutAcks, _) => PublishFailure::Transport {
                kind: "no_ack",
                error: format!(
                    "{error}: the stream {stream:?} does not acknowledge publishes \
                     (no_ack was set on it); the events wait in the outbox until it \
                     acknowledges them again"
                ),
            },
            // Its ack was lost, or the stream took it before an edit that lifted
            // no_ack: its republish will be a duplicate the stream acks.
            (StreamAnswer::Answers(_), Some(true)) => PublishFailure::Transport {
                kind: "no_ack",
                error: format!(
                    "{error}, though the stream {stream:?} holds the message: its ack \
                     was lost"
                ),
            },
            (StreamAnswer::Answers(_), held) => PublishFailure::Rejected {
                kind: "no_ack",
                error: format!(
                    "{error} while the stream {stream:?} answered{}; the server dropped \
                     the message (a publish permission that denies the subject is the \
                     usual cause; see the server's log)",
                    if held.is_some() {
                        ", and it does not hold the message"
                    } else {
                        ""
                    }
                ),
            },
        };
    }
}

/// What the relay's stream says, asked after a publish went unacknowledged.
enum StreamAnswer {
    /// No answer within the ack timeout, or the client reconnected since the publish: the
    /// missing ack says nothing of the message.
    Silent,
    /// It answered, and acknowledges publishes: the server dropped a message it does not
    /// hold ([`holds`]), looked up through the stream while it answers such looks.
    Answers(Option<Box<async_nats::jetstream::stream::Stream>>),
    /// It answered with `no_ack` set (an operator's edit since the relay connected, where
    /// such a stream is refused): it stores publishes and acknowledges none.
    WithoutAcks,
}

impl StreamAnswer {
    /// Whether the answering stream holds `row`'s message ([`holds`]); `None` where that is
    /// unknown: the stream did not answer, or did not answer a look before. A look left
    /// unanswered (a user not permitted to get messages gets no answer) is not made again:
    /// for the rest of the batch the relay decides as without it, rather than wait for each.
    async fn holds(&mut self, row: &ClaimedEvent, config: &crate::RelayConfig) -> Option<bool> {
        let Self::Answers(lookups) = self else {
            return None;
        };
        let held = holds(lookups.as_deref()?, row, config).await;
        if held.is_none() {
            *lookups = None;
        }
        held
    }
}

/// What the relay's stream says now ([`StreamAnswer`]), on the connection that sent a
/// publish when the client had connected `connects` times: no reconnect since, and a stream
/// info request answered within the ack timeout.
async fn stream_answer_now(shared: &Shared, connects: u64) -> StreamAnswer {
    let publisher = &shared.publisher;
    if publisher.connects() != connects || shared.nats.connection_state() != State::Connected {
        return StreamAnswer::Silent;
    }
    let info = publisher
        .jetstream()
        .get_stream(&shared.config.topology.stream.name);
    match tokio::time::timeout(shared.config.ack_timeout, info).await {
        Ok(Ok(stream)) if stream.cached_info().config.no_ack => StreamAnswer::WithoutAcks,
        Ok(Ok(stream)) => StreamAnswer::Answers(Some(Box::new(stream))),
        _ => StreamAnswer::Silent,
    }
}

/// Whether `stream` holds `row`'s unacknowledged message: the last message on the row's
/// subject carries the row's `Nats-Msg-Id`. `None` when the stream did not answer the look
/// within the ack timeout (nor does it answer a user whose permissions deny
/// `$JS.API.STREAM.MSG.GET.<stream>`). The relay is the only publisher of an aggregate's
/// subjects while it holds the aggregate's head, and a chain stops at its first failure, so a
/// stored message is that last one; where other messages share the subject the answer is
/// "no", and the row is counted as dropped, as without the look.
async fn holds(
    stream: &async_nats::jetstream::stream::Stream,
    row: &ClaimedEvent,
    config: &crate::RelayConfig,
) -> Option<bool> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let last = stream.get_last_raw_message_by_subject(&row.subject);
    let message = match tokio::time::timeout(config.ack_timeout, last).await {
        Ok(Ok(message)) => message,
        Ok(Err(error)) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {
            return Some(false);
        }
        _ => return None,
    };
    let mut id = [0_u8; uuid::fmt::Hyphenated::LENGTH];
    let id = row.id.hyphenated().encode_lower(&mut id);
    Some(
        message
            .headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .is_some_and(|stored| stored.as_str() == id),
    )
}

/// The aggregates each worker of a relay holds (claimed heads, until its transaction ends),
/// so that its peers' claims skip them instead of looking up heads they cannot lock.
///
/// The workers claim in turn ([`turn`](Self::turn)): a claim that ran beside a peer's
/// would not know what the peer is claiming, read the same window, find its heads locked
/// and come back empty, paying a full claim for nothing (measured with `relay_bench`
/// figure 3: a worker came back empty from 5 to 16 times in its 20 to 26 claims of a drain).
///
/// Idle workers poll for the relay, not each for itself ([`poll_due`](Self::poll_due)): a
/// claim by any worker counts as the relay's look, and the next poll comes a poll interval
/// after the relay's last claim began. A worker that finds rows wakes its peers, so one
/// look per interval sees what N would, and an idle relay costs the database one claim per
/// poll interval whatever its worker count (per worker, an idle relay of 4 workers claimed
/// 4 times per interval; beside a busy relay, each such claim walks the heads the busy one
/// holds and finds them locked).
pub(super) struct HeldAggregates {
    slots: Vec<std::sync::Mutex<Vec<(String, String)>>>,
    turn: tokio::sync::Mutex<()>,
    /// When the relay's last claim took its turn, or its last poll fell due.
    last_look: std::sync::Mutex<tokio::time::Instant>,
}

impl HeldAggregates {
    pub(super) fn new(workers: usize) -> Self {
        Self {
            slots: (0..workers).map(|_| std::sync::Mutex::default()).collect(),
            turn: tokio::sync::Mutex::new(()),
            last_look: std::sync::Mutex::new(tokio::time::Instant::now()),
        }
    }

    /// Waits for the relay's turn to claim; the turn ends when the guard drops, after the
    /// claim's aggregates are recorded with [`hold`](Self::hold).
    async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        let turn = self.turn.lock().await;
        *self.last_look() = tokio::time::Instant::now();
        turn
    }

    fn last_look(&self) -> std::sync::MutexGuard<'_, tokio::time::Instant> {
        // The guarded value is an instant, whole whatever a panicking holder did.
        self.last_look
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Completes once `interval` has passed since the relay last looked for rows (a claim
    /// took its turn, or a poll fell due), and counts as the relay's look from then: of idle
    /// workers whose intervals run out together, one goes on to claim and the others wait
    /// a whole interval more. So a row committed without a notification is claimed within
    /// about `interval`, as when each worker polled on its own. Cancel-safe: the look is
    /// taken only when the future completes.
    pub(super) async fn poll_due(&self, interval: Duration) {
        loop {
            let due = {
                let mut last = self.last_look();
                let due = *last + interval;
                let now = tokio::time::Instant::now();
                if now >= due {
                    *last = now;
                    return;
                }
                due
            };
            tokio::time::sleep_until(due).await;
        }
    }

    fn slot(&self, worker: usize) -> std::sync::MutexGuard<'_, Vec<(String, String)>> {
        // A poisoned slot only means a worker panicked while holding it: its list of
        // aggregates is still a list of aggregates.
        self.slots[worker]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What the other workers hold.
    fn others(&self, me: Option<usize>) -> Vec<(String, String)> {
        (0..self.slots.len())
            .filter(|worker| Some(*worker) != me)
            .flat_map(|worker| self.slot(worker).clone())
            .collect()
    }

    fn hold(&self, me: Option<usize>, aggregates: impl Iterator<Item = (String, String)>) {
        if let Some(me) = me {
            *self.slot(me) = aggregates.collect();
        }
    }

    /// A guard that empties `me`'s slot when dropped.
    fn holding(&self, me: Option<usize>) -> impl Drop + '_ {
        struct Release<'h>(&'h HeldAggregates, Option<usize>);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                if let Some(me) = self.1 {
                    self.0.slot(me).clear();
                }
            }
        }
        Release(self, me)
    }
}

/// The claimed rows of one aggregate, in sequence order.
type Chain<'a> = &'a [ClaimedEvent];

/// What a relay batch needs from its database, beside diesel's transaction manager: the
/// claim, the record of a rejection and the end of published rows, each with the
/// guarantees `outbox::queries` gives for PostgreSQL.
pub(super) trait RelayStore: Send + Sized + 'static {
    /// The database the relay publishes from.
    const KIND: database::Kind;

    /// Opens a connection for a worker, within the connect timeout.
    fn connect(
        shared: &Shared,
    ) -> impl Future<Output = Result<Self, database::ConnectError>> + Send;

    /// Opens a batch: the transaction its claim, rejections and deletes run in.
    fn begin(&mut self) -> impl Future<Output = QueryResult<()>> + Send;

    /// Ends a batch that went through.
    fn commit(&mut self) -> impl Future<Output = QueryResult<()>> + Send;

    /// Ends a batch that failed.
    fn rollback(&mut self) -> impl Future<Output = QueryResult<()>> + Send;

    /// Called once when the worker stops gracefully: gives back what the connection holds
    /// beyond a transaction (SQLite's relay lease).
    fn close(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Claims a batch (see `queries::claim_batch`).
    fn claim(
        &mut self,
        batch: i64,
        held: &Held<'_>,
    ) -> impl Future<Output = QueryResult<Vec<ClaimedEvent>>> + Send;

    /// Opens a batch and claims it: [`begin`](Self::begin), then [`claim`](Self::claim). On
    /// an error the transaction may be open: the caller rolls it back.
    fn begin_and_claim(
        &mut self,
        batch: i64,
        held: &Held<'_>,
    ) -> impl Future<Output = QueryResult<Vec<ClaimedEvent>>> + Send {
        async move {
            self.begin().await?;
            self.claim(batch, held).await
        }
    }

    /// Records a rejected publish (see `queries::record_rejection`).
    fn reject(
        &mut self,
        id: Uuid,
        error: &str,
        policy: RetryPolicy,
    ) -> impl Future<Output = QueryResult<Rejection>> + Send;

    /// Deletes, marks or archives the published rows (see `queries::finish_published`).
    fn finish(
        &mut self,
        ids: &[Uuid],
        mode: PublishedRows,
    ) -> impl Future<Output = QueryResult<()>> + Send;

    /// Ends a batch that went through: [`finish`](Self::finish) for the published rows
    /// `ids` (none: nothing to record), then [`commit`](Self::commit). On an error the
    /// transaction may still be open: the caller rolls it back.
    fn finish_and_commit(
        &mut self,
        ids: &[Uuid],
        mode: PublishedRows,
    ) -> impl Future<Output = QueryResult<()>> + Send {
        finish_then_commit(self, ids, mode)
    }

    /// Counts what waits in the outbox, for the gauges (see `outbox::stats`).
    fn stats(&mut self) -> impl Future<Output = QueryResult<OutboxStats>> + Send;

    /// How long a connection may sit unused before the server closes it (MySQL's session
    /// `wait_timeout`, which the relay sets), less a margin: a worker opens a new one rather
    /// than meet "server has gone away" after a long broker outage. `None`: no limit.
    fn idle_limit(_shared: &Shared) -> Option<Duration> {
        None
    }

    /// Whether a connection last used at `used` has sat unused past
    /// [`idle_limit`](Self::idle_limit): its server has closed it, or is about to, and the
    /// caller quietly opens another.
    fn idle_too_long(shared: &Shared, used: tokio::time::Instant) -> bool {
        Self::idle_limit(shared).is_some_and(|limit| used.elapsed() >= limit)
    }

    /// How often a batch sends its session a statement while it publishes, where the server
    /// closes a session that sends nothing for a while (MySQL's `wait_timeout`): a live
    /// relay's batch is then never cut, however long its publishes take. `None`: never.
    fn keep_alive_every(_shared: &Shared) -> Option<Duration> {
        None
    }

    /// The keep-alive statement of [`keep_alive_every`](Self::keep_alive_every).
    fn keep_alive(&mut self) -> impl Future<Output = QueryResult<()>> + Send {
        async { Ok(()) }
    }
}

#[cfg(feature = "postgres")]
impl RelayStore for AsyncPgConnection {
    const KIND: database::Kind = database::Kind::Postgres;

    async fn connect(shared: &Shared) -> Result<Self, database::ConnectError> {
        connect(shared).await
    }

    /// A third of the session's `idle_in_transaction_session_timeout`, when it has one (an
    /// operator's, on the database or the role, to end the transactions of clients that
    /// stopped): the server ends a session idle in a transaction for longer (PostgreSQL docs,
    /// section 20.11.1, "Statement Behavior"), and a batch's transaction sends nothing while
    /// it waits for its acks, which one aggregate's chain, published one after another,
    /// makes as long as the chain, nor while it looks at the stream after a missing ack (up
    /// to two ack timeouts). A live relay's batch is never cut; a relay that stopped still
    /// is, at the operator's timeout.
    fn keep_alive_every(shared: &Shared) -> Option<Duration> {
        match shared
            .idle_in_transaction_ms
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            0 => None,
            ms => Some(Duration::from_millis(ms) / 3),
        }
    }

    async fn keep_alive(&mut self) -> QueryResult<()> {
        use diesel_async::RunQueryDsl as _;
        diesel::sql_query("SELECT 1").execute(self).await.map(drop)
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

    async fn claim(&mut self, batch: i64, held: &Held<'_>) -> QueryResult<Vec<ClaimedEvent>> {
        queries::claim_batch(self, batch, held).await
    }

    /// [`queries::BEGIN_RELAY_BATCH`] and the claim pipelined, in one round trip: each
    /// request is sent when its future is first polled (tokio-postgres's pipelining, which
    /// diesel-async's connection offers through shared references), and `join!` polls the
    /// BEGIN first. Should the claim ever reach the server first, it fails rather than lock
    /// rows outside the transaction (see [`queries::claim_batch`]). diesel's transaction
    /// manager is told of the BEGIN, as its own `begin_transaction` would, so that the
    /// batch's COMMIT and ROLLBACK go through it.
    async fn begin_and_claim(
        &mut self,
        batch: i64,
        held: &Held<'_>,
    ) -> QueryResult<Vec<ClaimedEvent>> {
        crate::unit_of_work::outside_transaction(self)?;
        let (begun, claimed) = {
            let conn: &AsyncPgConnection = self;
            let mut beginning = conn;
            futures::join!(
                diesel_async::SimpleAsyncConnection::batch_execute(
                    &mut beginning,
                    queries::BEGIN_RELAY_BATCH
                ),
                queries::claim_batch(conn, batch, held),
            )
        };
        // Whatever the BEGIN's outcome: the caller's ROLLBACK after an error then ends what
        // it may have opened (outside a transaction, a ROLLBACK only warns).
        crate::unit_of_work::record_begin(self)?;
        begun?;
        claimed
    }

    async fn reject(
        &mut self,
        id: Uuid,
        error: &str,
        policy: RetryPolicy,
    ) -> QueryResult<Rejection> {
        queries::record_rejection(self, id, error, policy).await
    }

    async fn finish(&mut self, ids: &[Uuid], mode: PublishedRows) -> QueryResult<()> {
        queries::finish_published(self, ids, mode).await
    }

    /// The statement and the COMMIT in one round trip
    /// (`queries::finish_published_and_commit`) for up to `queries::MAX_EVENTS_AT_COMMIT`
    /// rows; two for more; a plain COMMIT when no row was published.
    async fn finish_and_commit(&mut self, ids: &[Uuid], mode: PublishedRows) -> QueryResult<()> {
        match queries::finish_published_and_commit(ids, mode) {
            Some(sql) => crate::unit_of_work::commit_checked(self, &sql)
                .await
                .map_err(|failed| failed.error),
            None => finish_then_commit(self, ids, mode).await,
        }
    }

    async fn stats(&mut self) -> QueryResult<OutboxStats> {
        crate::outbox::stats(self).await
    }
}

/// [`RelayStore::finish`] for the published rows `ids` (none: nothing to record), then
/// [`RelayStore::commit`]: the end of a batch in two round trips.
pub(super) async fn finish_then_commit<C: RelayStore>(
    conn: &mut C,
    ids: &[Uuid],
    mode: PublishedRows,
) -> QueryResult<()> {
    if !ids.is_empty() {
        conn.finish(ids, mode).await?;
    }
    conn.commit().await
}

/// Splits claimed rows (grouped by aggregate, heads first in claim order) into one chain per
/// aggregate, within a budget of `batch_size` rows: every head first, then the rows behind
/// the heads in claim order. A chain stops before a row that is not available (parked, or a
/// dead letter).
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
    /// The chain published (its first `published.len()` rows were).
    chain: Chain<'a>,
    published: Vec<Uuid>,
    /// Of the published, those JetStream held already.
    duplicates: usize,
    failure: Option<(&'a ClaimedEvent, PublishFailure)>,
    /// A test's crash point stopped the chain (never set without the `failpoints` feature).
    crashed: bool,
}

/// Publishes one aggregate's rows in order, each after the previous one's ack; stops at the
/// first failure, so no later event overtakes it, and before any new publish once `stop` is
/// signalled (the rows left stay queued).
async fn publish_chain<'a>(
    publisher: &Publisher,
    chain: Chain<'a>,
    stop: &CancellationToken,
) -> ChainOutcome<'a> {
    let mut outcome = ChainOutcome {
        chain,
        published: Vec::with_capacity(chain.len()),
        duplicates: 0,
        failure: None,
        crashed: false,
    };
    for row in chain {
        if stop.is_cancelled() {
            break;
        }
        match publisher.publish(row).await {
            Ok(duplicate) => {
                outcome.published.push(row.id);
                outcome.duplicates += usize::from(duplicate);
                let delay = time::OffsetDateTime::now_utc() - row.occurred_at;
                metrics::histogram!("outbox_relay_publish_delay_seconds")
                    .record(delay.as_seconds_f64().max(0.0));
            }
            Err(failure) => {
                outcome.failure = Some((row, failure));
                break;
            }
        }
        if crashes_mid_batch() {
            outcome.crashed = true;
            break;
        }
    }
    outcome
}

/// Whether a test's crash point stops the batch after this publish, as a relay that died
/// mid-batch would (always `false` without the `failpoints` feature).
fn crashes_mid_batch() -> bool {
    crash_point!("relay::mid_batch", |_| true);
    false
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
            payload: crate::outbox::queries::JsonBytes(bytes::Bytes::from_static(b"{}")),
            headers: crate::outbox::queries::JsonText(b"{}".to_vec()),
            occurred_at: time::OffsetDateTime::UNIX_EPOCH,
            correlation_id: None,
            causation_id: None,
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
}
