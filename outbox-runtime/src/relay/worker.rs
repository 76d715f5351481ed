//! A relay worker: one batch per transaction, in a loop that waits when idle and backs off
//! when the broker or the database fails.
//!
//! Within a batch, rows of different aggregates are published concurrently (bounded by the
//! relay's in-flight window) and the rows of one aggregate one after another, each after the
//! previous one's ack: a failure ends that aggregate's chain, so no later event overtakes it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::connection::State;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{Backoff, Shared};
use crate::outbox::queries::{self, ClaimedEvent, Held};
use crate::publisher::{PublishFailure, Publisher};

/// What one batch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Rows claimed: heads of their aggregate's queue and rows behind them, within
    /// `batch_size`.
    pub claimed: usize,
    /// Rows acked and marked (or deleted).
    pub published: usize,
    /// Rows the broker rejected; each counted an attempt.
    pub rejected: usize,
    /// Of the rejected rows, those that became dead letters.
    pub dead_lettered: usize,
    /// Rows not published because the broker could not be reached or did not ack in time;
    /// no attempt counted.
    pub transport_failures: usize,
}

/// Opens a relay connection: named in `pg_stat_activity`.
pub(super) async fn connect(
    database_url: &str,
) -> Result<AsyncPgConnection, diesel::ConnectionError> {
    let mut conn = AsyncPgConnection::establish(database_url).await?;
    conn.batch_execute("SET application_name TO 'outbox-relay'")
        .await
        .map_err(|e| diesel::ConnectionError::BadConnection(e.to_string()))?;
    Ok(conn)
}

/// The worker loop: batches until `stop`, then returns after the batch in progress.
///
/// `peers` are the other workers' wake-ups: a batch that published rows makes new heads
/// claimable (the rows behind the published ones), which a peer that found nothing to claim
/// would otherwise only see at its next poll.
pub(super) async fn run(
    shared: Arc<Shared>,
    me: usize,
    mut conn: Option<AsyncPgConnection>,
    wake: Arc<Notify>,
    peers: Vec<Arc<Notify>>,
    stop: CancellationToken,
) {
    let config = &shared.config;
    let mut backoff = Backoff::new(config.max_backoff);
    while !stop.is_cancelled() {
        let step = step(&shared, me, &mut conn, &stop).await;
        if matches!(step, Step::Busy) {
            peers.iter().for_each(|peer| peer.notify_one());
        }
        let wait = match step {
            Step::Busy => {
                backoff.reset();
                continue;
            }
            Step::Idle => {
                backoff.reset();
                Wait::ForWork(config.poll_interval)
            }
            Step::Failed => Wait::Backoff(backoff.next()),
        };
        match wait {
            // Woken by a notification, or after the poll interval.
            Wait::ForWork(poll) => tokio::select! {
                biased;
                () = stop.cancelled() => {}
                () = wake.notified() => {}
                () = tokio::time::sleep(poll) => {}
            },
            // Notifications do not shorten a backoff: they would hammer a broker that is down.
            Wait::Backoff(pause) => tokio::select! {
                biased;
                () = stop.cancelled() => {}
                () = tokio::time::sleep(pause) => {}
            },
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
    /// The broker or the database failed: back off.
    Failed,
}

enum Wait {
    ForWork(Duration),
    Backoff(Duration),
}

async fn step(
    shared: &Shared,
    me: usize,
    conn_slot: &mut Option<AsyncPgConnection>,
    stop: &CancellationToken,
) -> Step {
    // While the broker is unreachable, claiming would only lock rows to fail them.
    if shared.nats.connection_state() != State::Connected {
        metrics::counter!("outbox_relay_broker_unavailable_total").increment(1);
        return Step::Failed;
    }
    if conn_slot.is_none() {
        match connect(&shared.config.database_url).await {
            Ok(conn) => *conn_slot = Some(conn),
            Err(error) => {
                tracing::warn!(%error, "relay cannot connect to the database; retrying");
                return Step::Failed;
            }
        }
    }
    let conn = conn_slot.as_mut().expect("connected above");
    match relay_batch(shared, Some(me), conn, stop).await {
        Ok(report) if report.transport_failures > 0 => Step::Failed,
        Ok(report) if report.claimed > 0 => Step::Busy,
        Ok(_) => Step::Idle,
        Err(error) => {
            tracing::warn!(%error, "relay batch failed; reopening the connection");
            *conn_slot = None;
            Step::Failed
        }
    }
}

/// Claims, publishes and records one batch in one transaction. `me` is the worker's index
/// in [`HeldAggregates`] (`None` outside the worker loop).
pub(super) async fn relay_batch(
    shared: &Shared,
    me: Option<usize>,
    conn: &mut AsyncPgConnection,
    stop: &CancellationToken,
) -> Result<BatchReport, diesel::result::Error> {
    let config = &shared.config;
    let started = Instant::now();
    let batch_size = i64::try_from(config.batch_size).unwrap_or(i64::MAX);
    let peers_hold = shared.held.others(me);
    let held = Held {
        types: peers_hold.iter().map(|(t, _)| t.as_str()).collect(),
        ids: peers_hold.iter().map(|(_, i)| i.as_str()).collect(),
    };
    // Released whether the transaction commits, rolls back or fails.
    let _holding = shared.held.holding(me);
    let report = conn
        .transaction::<_, diesel::result::Error, _>(async |conn| {
            let claimed = queries::claim_batch(conn, batch_size, &held).await?;
            let chains = chains(&claimed, config.batch_size);
            shared.held.hold(
                me,
                chains.iter().map(|chain| {
                    (
                        chain[0].aggregate_type.clone(),
                        chain[0].aggregate_id.clone(),
                    )
                }),
            );
            let mut report = BatchReport {
                claimed: chains.iter().map(|chain| chain.len()).sum(),
                ..BatchReport::default()
            };
            if let Some(oldest) = chains.iter().map(|chain| chain[0].occurred_at).min() {
                let lag = time::OffsetDateTime::now_utc() - oldest;
                metrics::gauge!("outbox_relay_lag_seconds").set(lag.as_seconds_f64());
            }
            // Unordered: the outcomes are independent, and polling them in any order is
            // cheaper than join_all's ordered bookkeeping.
            let outcomes: Vec<ChainOutcome<'_>> = chains
                .iter()
                .map(|chain| publish_chain(&shared.publisher, chain, stop))
                .collect::<futures::stream::FuturesUnordered<_>>()
                .collect()
                .await;

            let mut published: Vec<Uuid> = Vec::with_capacity(report.claimed);
            for outcome in outcomes {
                published.extend(outcome.published);
                match outcome.failure {
                    Some((row, PublishFailure::Rejected(error))) => {
                        let rejection =
                            queries::record_rejection(conn, row.id, &error, shared.retry).await?;
                        report.rejected += 1;
                        if rejection.dead_lettered {
                            report.dead_lettered += 1;
                            tracing::error!(
                                id = %row.id, subject = %row.subject, attempts = rejection.attempts,
                                %error, "dead-lettered an event the broker kept rejecting"
                            );
                        } else {
                            tracing::warn!(
                                id = %row.id, subject = %row.subject, attempts = rejection.attempts,
                                %error, "the broker rejected an event; it will be retried"
                            );
                        }
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
                queries::finish_published(conn, &published, config.published).await?;
            }
            Ok(report)
        })
        .await?;

    metrics::counter!("outbox_relay_published_total").increment(report.published as u64);
    metrics::counter!("outbox_relay_rejected_total").increment(report.rejected as u64);
    metrics::counter!("outbox_relay_dead_lettered_total").increment(report.dead_lettered as u64);
    metrics::counter!("outbox_relay_transport_failures_total")
        .increment(report.transport_failures as u64);
    if report.claimed > 0 {
        metrics::histogram!("outbox_relay_batch_seconds").record(started.elapsed());
        tracing::debug!(
            claimed = report.claimed,
            published = report.published,
            rejected = report.rejected,
            dead_lettered = report.dead_lettered,
            transport_failures = report.transport_failures,
            elapsed = ?started.elapsed(),
            "relay batch"
        );
    } else {
        metrics::gauge!("outbox_relay_lag_seconds").set(0.0);
    }
    Ok(report)
}

/// The aggregates each worker of a relay holds (claimed heads, until its transaction ends),
/// so that its peers' claims skip them instead of looking up heads they cannot lock.
pub(super) struct HeldAggregates {
    slots: Vec<std::sync::Mutex<Vec<(String, String)>>>,
}

impl HeldAggregates {
    pub(super) fn new(workers: usize) -> Self {
        Self {
            slots: (0..workers).map(|_| std::sync::Mutex::default()).collect(),
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
    published: Vec<Uuid>,
    failure: Option<(&'a ClaimedEvent, PublishFailure)>,
}

/// Publishes one aggregate's rows in order, each after the previous one's ack; stops at the
/// first failure, so no later event overtakes it, and before any new publish once `stop` is
/// signalled (the rows left stay queued).
async fn publish_chain<'a>(
    publisher: &Publisher,
    chain: Chain<'a>,
    stop: &CancellationToken,
) -> ChainOutcome<'a> {
    let mut published = Vec::with_capacity(chain.len());
    for row in chain {
        if stop.is_cancelled() {
            break;
        }
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
            payload: queries::JsonBytes(bytes::Bytes::from_static(b"{}")),
            headers: queries::JsonText(b"{}".to_vec()),
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
