//! The consumer loop: pulls messages, queues them by ordering key (their aggregate) in
//! stream order, and handles them with bounded concurrency, one at a time per key.
//!
//! An instance holds at most `4 x max_concurrency` messages it has not started: it asks
//! JetStream for no more than the room it has, so that what a crashed instance
//! leaves unacked is small beside the consumer's `max_ack_pending`, and another instance
//! keeps receiving messages meanwhile.
//!
//! A message that must wait (its handler failed, or an earlier event of its aggregate is not
//! applied) is nak'd with a delay and holds its key: the later messages of that key that
//! arrive meanwhile are nak'd back too, rather than kept, so the buffer holds only messages
//! that can run. The key is released when the held message comes back and is processed, or,
//! if it went to another instance, after its delay plus `ack_wait`. The database's order
//! check (see `inbox::order`) makes this an economy, not the guarantee: a message that
//! overtakes its predecessor anyway is held when it reaches the database.
//!
//! Messages are pulled by bounded requests, one at a time, each for as many messages as the
//! buffer has room for and ended by JetStream when they are delivered or after a second, so
//! that the instance knows at every moment which messages may still reach it.
//!
//! Messages waiting in the buffer and messages being handled are kept from redelivery with
//! progress acks every third of `ack_wait`. On a graceful stop the waiting ones, and every
//! message of the pull request in progress (read until JetStream ends it), are nak'd for
//! immediate redelivery.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::message::ordering_key;
use super::{Handler, Inbox, InboxError, Outcome};

/// How many messages an instance holds that it has not started, per handler it runs.
const BUFFERED_PER_HANDLER: usize = 4;

pub(super) async fn run<H: Handler>(
    inbox: Inbox<H>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), InboxError> {
    let config = inbox.shared.config.clone();
    let stop = CancellationToken::new();
    let purging = tokio::spawn(purge_loop(inbox.clone(), stop.clone()));
    let max_buffered = config.max_concurrency.saturating_mul(BUFFERED_PER_HANDLER);
    let mut queues = Queues::new(config.max_concurrency, config.ack_wait);
    let mut jobs: FuturesUnordered<BoxFuture<'static, Finished>> = FuturesUnordered::new();
    // The pull request in progress: at most as many messages as the buffer has room for,
    // ended by JetStream when they are delivered or after `PULL_EXPIRES`. One at a time, so
    // that this instance always knows what may still arrive.
    let mut pull: Option<pull::Batch> = None;
    let mut reconnect = Duration::from_millis(100);
    let mut heartbeat = tokio::time::interval(progress_interval(config.ack_wait));
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tokio::pin!(shutdown);

    // After a pull request that failed, the next waits `reconnect` (doubling to 10 s), so a
    // consumer JetStream keeps refusing (deleted, over its limits) is not asked in a loop.
    let mut failed = false;

    loop {
        if failed {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = tokio::time::sleep(reconnect) => {}
            }
            reconnect = (reconnect * 2).min(Duration::from_secs(10));
            failed = false;
        }
        let room = max_buffered.saturating_sub(queues.buffered());
        if pull.is_none() && room > 0 {
            let requested = inbox
                .consumer()
                .batch()
                .max_messages(room)
                .expires(PULL_EXPIRES)
                .messages()
                .await;
            match requested {
                Ok(batch) => pull = Some(batch),
                Err(error) => {
                    tracing::warn!(%error, "the inbox cannot pull messages; retrying");
                    failed = true;
                    continue;
                }
            }
        }
        let naks = tokio::select! {
            biased;
            () = &mut shutdown => break,
            Some(finished) = jobs.next(), if !jobs.is_empty() => queues.finished(finished),
            next = next_message(&mut pull), if pull.is_some() => match next {
                Some(Ok(message)) => {
                    reconnect = Duration::from_millis(100);
                    queues.route(message)
                }
                Some(Err(error)) => {
                    tracing::warn!(%error, "the inbox's pull request failed; retrying");
                    pull = None;
                    failed = true;
                    Vec::new()
                }
                None => {
                    pull = None;
                    Vec::new()
                }
            },
            _ = heartbeat.tick() => queues.heartbeat().await,
        };
        nak_all(naks).await;
        while let Some(job) = queues.next_to_start() {
            jobs.push(Box::pin(handle(inbox.clone(), job)));
        }
    }

    // Hand back what this instance holds and has not started, for immediate redelivery: the
    // waiting messages, and every message of the pull request in progress, read until
    // JetStream ends it (at most `PULL_EXPIRES`; a message delivered after this instance
    // stopped reading would wait out `ack_wait`). Let the messages in progress finish.
    let mut handed_back = queues.release_waiting();
    if let Some(mut batch) = pull.take() {
        let rest = async {
            while let Some(next) = batch.next().await {
                if let Ok(message) = next {
                    handed_back.push((message, Duration::ZERO));
                }
            }
        };
        if tokio::time::timeout(PULL_EXPIRES + Duration::from_secs(1), rest)
            .await
            .is_err()
        {
            tracing::debug!("the last pull request did not end in time");
        }
    }
    nak_all(handed_back).await;
    while jobs.next().await.is_some() {}
    stop.cancel();
    purging.await?;
    Ok(())
}

/// How long a pull request waits at JetStream for messages: also the longest a graceful stop
/// waits for the one in progress to end, and how often an idle consumer asks again.
const PULL_EXPIRES: Duration = Duration::from_secs(1);

/// The next message of the pull request in progress (`None` when it ended).
async fn next_message(
    pull: &mut Option<pull::Batch>,
) -> Option<Result<jetstream::Message, async_nats::Error>> {
    pull.as_mut()?.next().await
}

/// Progress acks (and the heartbeat) come every third of `ack_wait`, so two may be lost
/// before JetStream redelivers.
fn progress_interval(ack_wait: Duration) -> Duration {
    (ack_wait / 3).max(Duration::from_millis(30))
}

async fn nak_all(messages: Vec<(jetstream::Message, Duration)>) {
    for (message, delay) in messages {
        let delay = (!delay.is_zero()).then_some(delay);
        if let Err(error) = message.ack_with(AckKind::Nak(delay)).await {
            tracing::debug!(%error, "a nak did not reach JetStream; it comes back after ack_wait");
        }
    }
}

/// A message to handle, with how long it has waited for its predecessor so far.
struct Job {
    key: String,
    message: jetstream::Message,
    held_for: Duration,
}

/// A message handled: its key, its stream sequence, what came of it, and whether it was
/// settled (a test's crash point leaves it unsettled).
struct Finished {
    key: String,
    sequence: u64,
    outcome: Outcome,
    settled: bool,
}

async fn handle<H: Handler>(inbox: Inbox<H>, job: Job) -> Finished {
    let Job {
        key,
        message,
        held_for,
    } = job;
    let sequence = sequence(&message);
    let config = &inbox.shared.config;
    let started = std::time::Instant::now();
    let processed = {
        // A long handler keeps its message: progress acks while it runs.
        let processing = inbox.process_held(&message, held_for);
        tokio::pin!(processing);
        // interval_at, not interval: an interval's immediate first tick still waits for the
        // timer wheel's next millisecond, which would be the main cost of a fast message.
        let every = progress_interval(config.ack_wait);
        let mut progress = tokio::time::interval_at(Instant::now() + every, every);
        loop {
            tokio::select! {
                processed = &mut processing => break processed,
                _ = progress.tick() => {
                    if let Err(error) = message.ack_with(AckKind::Progress).await {
                        tracing::debug!(%error, "progress ack failed");
                    }
                }
            }
        }
    };
    let consumer = config.consumer.clone();
    metrics::histogram!("outbox_inbox_process_seconds", "consumer" => consumer.clone())
        .record(started.elapsed());
    metrics::counter!(
        "outbox_inbox_messages_total",
        "consumer" => consumer.clone(),
        "outcome" => processed.outcome.label(),
    )
    .increment(1);
    let settle = processed.settle;
    crash_point!("inbox::after_commit", |_| Finished {
        key: key.clone(),
        sequence,
        outcome: processed.outcome.clone(),
        settled: false,
    });
    if settle && let Err(error) = processed.outcome.settle(&message).await {
        metrics::counter!("outbox_inbox_settle_failures_total", "consumer" => consumer)
            .increment(1);
        tracing::warn!(%error, "cannot settle a message; JetStream will redeliver it");
    }
    Finished {
        key,
        sequence,
        outcome: processed.outcome,
        settled: settle,
    }
}

fn sequence(message: &jetstream::Message) -> u64 {
    message.info().map_or(u64::MAX, |info| info.stream_sequence)
}

/// The messages of one ordering key.
#[derive(Default)]
struct Key {
    /// Received and not started, by stream sequence.
    waiting: BTreeMap<u64, jetstream::Message>,
    /// The sequence of the message being handled.
    running: Option<u64>,
    /// A nak'd message the key waits for, and until when at most.
    held_for: Option<(u64, Instant)>,
    /// Whether the key is in the ready queue.
    ready: bool,
}

impl Key {
    fn held(&self, now: Instant) -> Option<(u64, Instant)> {
        self.held_for.filter(|(_, until)| now < *until)
    }

    fn can_start(&self, now: Instant) -> bool {
        let Some(&first) = self.waiting.keys().next() else {
            return false;
        };
        self.running.is_none()
            && match self.held(now) {
                None => true,
                Some((sequence, _)) => first <= sequence,
            }
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_none() && self.held_for.is_none()
    }
}

struct Queues {
    keys: HashMap<String, Key>,
    ready: VecDeque<String>,
    running: usize,
    buffered: usize,
    max_running: usize,
    ack_wait: Duration,
    /// Since when each message (by stream sequence) has waited for its predecessor.
    held_since: HashMap<u64, Instant>,
}

impl Queues {
    fn new(max_running: usize, ack_wait: Duration) -> Self {
        Self {
            keys: HashMap::new(),
            ready: VecDeque::new(),
            running: 0,
            buffered: 0,
            max_running,
            ack_wait,
            held_since: HashMap::new(),
        }
    }

    /// Messages received and not started.
    fn buffered(&self) -> usize {
        self.buffered
    }

    /// Queues a received message; returns what to nak (a later message of a held key).
    fn route(&mut self, message: jetstream::Message) -> Vec<(jetstream::Message, Duration)> {
        let now = Instant::now();
        let key_name = ordering_key(&message);
        let sequence = sequence(&message);
        let key = self.keys.entry(key_name.clone()).or_default();
        if key.running == Some(sequence) {
            // Redelivered while being handled: the handling settles it.
            return Vec::new();
        }
        if let Some((held, until)) = key.held(now)
            && sequence > held
        {
            // It would only wait here: let JetStream keep it until the held one is back.
            return vec![(message, (until - now).min(Duration::from_secs(1)))];
        }
        if key.waiting.insert(sequence, message).is_none() {
            self.buffered += 1;
        }
        if !key.ready {
            key.ready = true;
            self.ready.push_back(key_name);
        }
        Vec::new()
    }

    fn next_to_start(&mut self) -> Option<Job> {
        let now = Instant::now();
        while self.running < self.max_running {
            let key_name = self.ready.pop_front()?;
            let Some(key) = self.keys.get_mut(&key_name) else {
                continue;
            };
            key.ready = false;
            if !key.can_start(now) {
                continue;
            }
            let (sequence, message) = key.waiting.pop_first().expect("can_start saw one");
            self.buffered -= 1;
            key.held_for = None;
            key.running = Some(sequence);
            self.running += 1;
            let held_for = self
                .held_since
                .get(&sequence)
                .map_or(Duration::ZERO, |since| now - *since);
            return Some(Job {
                key: key_name,
                message,
                held_for,
            });
        }
        None
    }

    /// Records a finished message; returns what to nak (the later messages of a key that is
    /// now held).
    fn finished(&mut self, finished: Finished) -> Vec<(jetstream::Message, Duration)> {
        self.running -= 1;
        let now = Instant::now();
        let wait = match &finished.outcome {
            Outcome::Retry { delay, .. } | Outcome::Held { delay, .. } if finished.settled => {
                Some(*delay)
            }
            // Unsettled: it comes back after ack_wait.
            _ if !finished.settled => Some(Duration::ZERO),
            _ => None,
        };
        if matches!(finished.outcome, Outcome::Held { .. }) {
            self.held_since.entry(finished.sequence).or_insert(now);
        } else {
            self.held_since.remove(&finished.sequence);
        }
        let Some(key) = self.keys.get_mut(&finished.key) else {
            return Vec::new();
        };
        key.running = None;
        let mut naks = Vec::new();
        if let Some(delay) = wait {
            let until = now + delay + self.ack_wait;
            key.held_for = Some((finished.sequence, until));
            let later = key.waiting.split_off(&finished.sequence);
            self.buffered -= later.len();
            let back_in = delay.min(Duration::from_secs(1));
            naks.extend(later.into_values().map(|message| (message, back_in)));
        }
        if key.idle() {
            self.keys.remove(&finished.key);
        } else if !key.ready {
            key.ready = true;
            self.ready.push_back(finished.key);
        }
        naks
    }

    /// Keeps waiting messages from redelivery, releases keys whose held message did not
    /// come back in time, and forgets holds of messages long gone to other instances.
    async fn heartbeat(&mut self) -> Vec<(jetstream::Message, Duration)> {
        let now = Instant::now();
        let mut released = Vec::new();
        for (name, key) in &mut self.keys {
            for message in key.waiting.values() {
                if let Err(error) = message.ack_with(AckKind::Progress).await {
                    tracing::debug!(%error, "progress ack failed");
                }
            }
            if key.held_for.is_some_and(|(_, until)| now >= until) {
                key.held_for = None;
                released.push(name.clone());
            }
        }
        for name in released {
            if let Some(key) = self.keys.get_mut(&name) {
                if key.idle() {
                    self.keys.remove(&name);
                } else if !key.ready {
                    key.ready = true;
                    self.ready.push_back(name);
                }
            }
        }
        let forget_after = Duration::from_secs(3600);
        self.held_since
            .retain(|_, since| now.duration_since(*since) < forget_after);
        Vec::new()
    }

    /// Takes every message received and not started, to hand back on a graceful stop.
    fn release_waiting(&mut self) -> Vec<(jetstream::Message, Duration)> {
        let mut messages = Vec::with_capacity(self.buffered);
        for key in self.keys.values_mut() {
            messages.extend(
                std::mem::take(&mut key.waiting)
                    .into_values()
                    .map(|message| (message, Duration::ZERO)),
            );
        }
        self.buffered = 0;
        messages
    }
}

/// Deletes expired inbox rows every `purge_interval`, until stopped.
async fn purge_loop<H: Handler>(inbox: Inbox<H>, stop: CancellationToken) {
    const BATCH: i64 = 1000;
    let config = &inbox.shared.config;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(config.purge_interval) => {}
        }
        let Ok(mut conn) = inbox.shared.pool.get().await else {
            continue;
        };
        loop {
            let purged = tokio::time::timeout(
                config.statement_timeout,
                super::purge(&mut conn, &config.consumer, config.retention, BATCH),
            )
            .await;
            match purged {
                Ok(Ok(deleted)) if deleted < BATCH as usize => break,
                Ok(Ok(_)) => {}
                Ok(Err(error)) => {
                    tracing::warn!(%error, "inbox retention failed");
                    break;
                }
                Err(_) => {
                    tracing::warn!("inbox retention did not finish within the statement timeout");
                    break;
                }
            }
        }
    }
}
