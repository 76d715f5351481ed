//! The consumer loop: pulls messages, queues them by partition key in stream order, and
//! handles them with bounded concurrency, one at a time per key.
//!
//! A message whose handling failed (nak'd with a delay) holds its key: the later messages
//! of the key wait until it is redelivered and handled or dead-lettered, so they cannot
//! overtake it. Waiting messages are kept from redelivery with progress acks. A key held by a
//! message that never comes back (another instance of the consumer took it) is released
//! after the nak delay plus `ack_wait`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::message::partition_key;
use super::{Handler, Inbox, InboxError, Outcome};

pub(super) async fn run<H: Handler>(
    inbox: Inbox<H>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), InboxError> {
    let config = inbox.shared.config.clone();
    let stop = CancellationToken::new();
    let purging = tokio::spawn(purge_loop(inbox.clone(), stop.clone()));
    let mut queues = Queues::new(config.max_concurrency, config.ack_wait);
    let mut jobs: FuturesUnordered<BoxFuture<'static, Finished>> = FuturesUnordered::new();
    let mut messages = None;
    let mut reconnect = Duration::from_millis(100);
    let mut heartbeat =
        tokio::time::interval((config.ack_wait / 3).max(Duration::from_millis(100)));
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tokio::pin!(shutdown);

    loop {
        let stream = match &mut messages {
            Some(stream) => stream,
            None => match inbox.consumer().messages().await {
                Ok(stream) => {
                    reconnect = Duration::from_millis(100);
                    messages.insert(stream)
                }
                Err(error) => {
                    tracing::warn!(%error, "the inbox cannot pull messages; retrying");
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(reconnect) => {}
                    }
                    reconnect = (reconnect * 2).min(Duration::from_secs(10));
                    continue;
                }
            },
        };
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            Some(finished) = jobs.next(), if !jobs.is_empty() => queues.finished(finished),
            next = stream.next() => match next {
                Some(Ok(message)) => queues.route(message),
                Some(Err(error)) => tracing::warn!(%error, "the inbox's message stream reported an error"),
                None => messages = None,
            },
            _ = heartbeat.tick() => queues.heartbeat().await,
        }
        while let Some((key, message)) = queues.next_to_start() {
            jobs.push(Box::pin(handle(inbox.clone(), key, message)));
        }
    }

    // Stop pulling; let the messages in progress finish and settle. Queued ones stay
    // unacked and are redelivered after ack_wait.
    drop(messages);
    while jobs.next().await.is_some() {}
    stop.cancel();
    purging.await?;
    Ok(())
}

/// A message handled: its key, its stream sequence, and what came of it.
struct Finished {
    key: String,
    sequence: u64,
    outcome: Outcome,
}

async fn handle<H: Handler>(inbox: Inbox<H>, key: String, message: jetstream::Message) -> Finished {
    let sequence = sequence(&message);
    let started = std::time::Instant::now();
    let outcome = match inbox.process(&message).await {
        Ok(outcome) => outcome,
        Err(error) => Outcome::Retry {
            delay: inbox.shared.config.retry_delay,
            error: error.to_string(),
        },
    };
    let consumer = inbox.shared.config.consumer.clone();
    metrics::histogram!("outbox_inbox_process_seconds", "consumer" => consumer.clone())
        .record(started.elapsed());
    metrics::counter!(
        "outbox_inbox_messages_total",
        "consumer" => consumer.clone(),
        "outcome" => outcome.label(),
    )
    .increment(1);
    if let Err(error) = outcome.settle(&message).await {
        metrics::counter!("outbox_inbox_settle_failures_total", "consumer" => consumer)
            .increment(1);
        tracing::warn!(%error, "cannot settle a message; JetStream will redeliver it");
    }
    Finished {
        key,
        sequence,
        outcome,
    }
}

fn sequence(message: &jetstream::Message) -> u64 {
    message.info().map_or(u64::MAX, |info| info.stream_sequence)
}

/// The messages of one partition key.
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
    fn can_start(&self, now: Instant) -> bool {
        let Some(&first) = self.waiting.keys().next() else {
            return false;
        };
        self.running.is_none()
            && match self.held_for {
                None => true,
                Some((sequence, until)) => first == sequence || now >= until,
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
    max_running: usize,
    ack_wait: Duration,
}

impl Queues {
    fn new(max_running: usize, ack_wait: Duration) -> Self {
        Self {
            keys: HashMap::new(),
            ready: VecDeque::new(),
            running: 0,
            max_running,
            ack_wait,
        }
    }

    fn route(&mut self, message: jetstream::Message) {
        let key_name = partition_key(&message);
        let sequence = sequence(&message);
        let key = self.keys.entry(key_name.clone()).or_default();
        if key.running == Some(sequence) {
            // Redelivered while being handled: the handling settles it.
            return;
        }
        if key.held_for.is_some_and(|(held, _)| held == sequence) {
            key.held_for = None;
        }
        key.waiting.insert(sequence, message);
        if !key.ready {
            key.ready = true;
            self.ready.push_back(key_name);
        }
    }

    fn next_to_start(&mut self) -> Option<(String, jetstream::Message)> {
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
            key.held_for = None;
            key.running = Some(sequence);
            self.running += 1;
            return Some((key_name, message));
        }
        None
    }

    fn finished(&mut self, finished: Finished) {
        self.running -= 1;
        let Some(key) = self.keys.get_mut(&finished.key) else {
            return;
        };
        key.running = None;
        if let Outcome::Retry { delay, .. } = finished.outcome {
            key.held_for = Some((finished.sequence, Instant::now() + delay + self.ack_wait));
        }
        if key.idle() {
            self.keys.remove(&finished.key);
        } else if !key.ready {
            key.ready = true;
            self.ready.push_back(finished.key);
        }
    }

    /// Keeps waiting messages from redelivery, and releases keys whose held message did not
    /// come back in time.
    async fn heartbeat(&mut self) {
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
            match super::purge(&mut conn, &config.consumer, config.retention, BATCH).await {
                Ok(deleted) if deleted < BATCH as usize => break,
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "inbox retention failed");
                    break;
                }
            }
        }
    }
}
