//! The consumer loop: pulls messages, queues them by ordering key (their aggregate) in
//! stream order, and handles them with bounded concurrency, one at a time per key.
//!
//! An instance holds at most `4 x max_concurrency` messages it has not started (beyond
//! those it keeps aside, which could not start: see below): it asks JetStream for no more
//! than the room it has, so that what a crashed instance leaves unacked is small beside the
//! consumer's `max_ack_pending`, and another instance keeps receiving messages meanwhile.
//!
//! An event whose predecessor is in the stream and not applied is *parked*: kept here (with
//! progress acks), its key's later messages queued behind it, while the consumer's position
//! in its aggregate is checked every [`PARK_CHECK`]; it runs again as soon as the position
//! reaches its predecessor, which another instance applied or JetStream redelivered. A
//! parked event costs no handler and no redelivery, so the messages of one aggregate that
//! JetStream spread over several instances follow each other within milliseconds instead
//! of bouncing between them on nak delays. Parking is bounded: at most half the buffer's
//! worth of keys, each event for `ack_wait` + 1 s at a time and `2 x ack_wait` + 1 s in all.
//! An event that waits in place for its predecessor (see `Inbox::wait_for_predecessor`)
//! stops waiting, and is parked, as soon as an earlier message of its aggregate reaches this
//! instance: that one cannot start until the event's handling ends.
//!
//! A message that must wait otherwise (its handler failed, or parking is full or over its
//! time) is nak'd with a delay and holds its key: the later messages of that key that
//! arrive meanwhile, or were waiting, are *kept aside*: held here with progress acks, not
//! counted against the buffer's room (so the instance goes on pulling its other keys'
//! messages), and run in order once the held message comes back and is processed. The
//! messages behind a parked event beyond half the buffer are kept aside as well. Only the
//! held message goes back to JetStream: a key's chain handed back was redelivered once per
//! retry at best, and, with the host loaded, came back out of stream order, since JetStream
//! redelivers nak'd messages in the order their delays end (nats-server
//! `server/consumer.go`, `checkPending`, `processNak`: v2.9.10, v2.14.5), which the naks'
//! transit times shift; each gap then sent the rest round again. The key stops waiting
//! for its held message here [`Hold::release`] after it is due (it went to another
//! instance, or is late): what it kept aside then runs, and the database's order check
//! (see `inbox::order`) waits for the held message wherever it went. That check makes all
//! of this an economy, not the guarantee: a message that overtakes its predecessor anyway
//! is held when it reaches the database.
//!
//! At most the consumer's `max_ack_pending` messages are kept aside, the most JetStream
//! delivers unacked anyway (a message nak'd back stays pending there too), so an instance
//! holds at most that many messages' payloads beyond its buffer. Beyond it (a consumer
//! whose limit is higher on the server), a key's later messages are nak'd back, to come
//! back together, at one instant (just after the held message; a fixed time after the first
//! of them behind a parked event), rather than each a fixed delay after it arrived. Until
//! they are due back, those that come back with their held message (its delay under a
//! second) count against the buffer's room: JetStream delivers in stream order, so while an
//! aggregate's chain waits, pulling more would mostly fetch more of that chain only to hand
//! it back again. Behind a longer wait (a handler's retry delay of seconds) they are nak'd to
//! come back with the held message too (within `ack_wait`), but not counted, or the
//! instance would stop pulling its other aggregates' messages for as long (see
//! `Hold::returns_behind`). The room comes back [`RETURN_MARGIN`] after they are due:
//! nats-server queues an expired nak delay for redelivery when its pending timer fires, a
//! millisecond after the due time or 10 ms after the last nak (`server/consumer.go`,
//! `ackWait`, `processNak`), and a pull sent before that receives the chain's later messages
//! ahead of them.
//!
//! Messages are pulled by bounded requests, one at a time, each for as many messages as the
//! buffer has room for and ended by JetStream when they are delivered or after a second, so
//! that the instance knows at every moment which messages may still reach it. A request
//! JetStream does not end a second after that (lost with a server that died, or sent while
//! the consumer elected a leader) is given up, and the instance asks again.
//!
//! Messages waiting in the buffer and messages being handled are kept from redelivery with
//! progress acks every third of `ack_wait`. On a graceful stop the waiting ones, and every
//! message of the pull request in progress (read until JetStream ends it), are nak'd for
//! immediate redelivery.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::message::{Metadata, ordering_key};
use super::store::Aggregate;
use super::{Handler, Inbox, InboxConnection, InboxError, Outcome};

/// How many messages an instance holds that it has not started, per handler it runs.
const BUFFERED_PER_HANDLER: usize = 4;

/// Beyond `ack_wait`, how long an event stays parked at a time (beyond `2 x ack_wait`, in
/// all): time for a predecessor a dead instance held to be redelivered and applied.
const PARK_SLACK: Duration = Duration::from_secs(1);

/// How long after the first of them the messages nak'd from behind a key's parked event
/// (half the buffer waits behind parked events already) come back, together.
const BEHIND_PARKED_DELAY: Duration = Duration::from_millis(250);

pub(super) async fn run<H: Handler<C>, C: InboxConnection>(
    inbox: Inbox<H, C>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), InboxError> {
    let config = inbox.shared.config.clone();
    let stop = CancellationToken::new();
    // Whichever way this function ends (its future dropped, a panic unwinding out of a
    // message's transaction), the tasks it started stop (the purge loop by this token, the
    // position check and the consumer's restoration as their handles drop), so that they do
    // not keep the inbox's pool, and its idle connections, alive, nor create the consumer
    // again after the instance ended (a connection dropped mid-transaction is closed at once:
    // `crate::database::Pooled`).
    let _stop_on_exit = stop.clone().drop_guard();
    let purging = tokio::spawn(purge_loop(inbox.clone(), stop.clone()));
    let max_buffered = config.max_concurrency.saturating_mul(BUFFERED_PER_HANDLER);
    let mut queues = Queues::new(
        config.max_concurrency,
        max_buffered,
        config.max_ack_pending,
        config.ack_wait,
    );
    // The position check of the parked events in progress: a task of its own, since it
    // waits for a pooled connection that only the handlers this loop drives give back.
    let mut checking: Option<AbortOnDropHandle<Option<Positions>>> = None;
    let mut park_check = tokio::time::interval(PARK_CHECK);
    park_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut jobs: FuturesUnordered<BoxFuture<'static, Finished>> = FuturesUnordered::new();
    // The pull request in progress: at most as many messages as the buffer has room for,
    // ended by JetStream when they are delivered or after `PULL_EXPIRES`. One at a time, so
    // that this instance always knows what may still arrive.
    let mut pull: Option<pull::Batch> = None;
    // When the pull request in progress should have ended, with its grace.
    let mut pull_ends = Instant::now();
    let mut reconnect = Duration::from_millis(100);
    let mut heartbeat = tokio::time::interval(progress_interval(config.ack_wait));
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tokio::pin!(shutdown);

    // After a pull request that failed or went unanswered (as one for a consumer that does
    // not exist does), a task asks JetStream whether the consumer is gone and creates it
    // again if so (while the loop goes on: the messages in progress are not held up by
    // JetStream's answer); after one that failed, the next request waits `reconnect`
    // (doubling to 10 s), so a consumer JetStream keeps refusing (over its limits, its
    // stream missing) is not asked in a loop.
    let mut failed = false;
    let mut unanswered = false;
    let mut restoring: Option<AbortOnDropHandle<()>> = None;

    loop {
        if (failed || unanswered) && restoring.as_ref().is_none_or(|task| task.is_finished()) {
            let inbox = inbox.clone();
            restoring = Some(AbortOnDropHandle::new(tokio::spawn(async move {
                inbox.restore_consumer().await
            })));
        }
        unanswered = false;
        if failed {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = tokio::time::sleep(reconnect) => {}
            }
            reconnect = (reconnect * 2).min(Duration::from_secs(10));
            failed = false;
        }
        let room = queues.room();
        if pull.is_none() && room > 0 {
            let requested = inbox
                .consumer()
                .batch()
                .max_messages(room)
                .expires(PULL_EXPIRES)
                .messages()
                .await;
            match requested {
                Ok(batch) => {
                    pull = Some(batch);
                    pull_ends = Instant::now() + PULL_EXPIRES + PULL_GRACE;
                }
                Err(error) => {
                    tracing::warn!(%error, "the inbox cannot pull messages; retrying");
                    failed = true;
                    continue;
                }
            }
        }
        let next_return = queues.next_return();
        let next_release = queues.next_release();
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
            () = tokio::time::sleep_until(pull_ends), if pull.is_some() => {
                tracing::debug!(
                    "a pull request went unanswered (the server died with it, the consumer \
                     is electing a leader, or it is gone); asking again"
                );
                pull = None;
                unanswered = true;
                Vec::new()
            }
            // The buffer's room was taken by messages handed back, the first of which is back
            // at JetStream now: pull again.
            () = tokio::time::sleep_until(next_return.unwrap_or(pull_ends)),
                if pull.is_none() && next_return.is_some() => Vec::new(),
            // A held key whose message did not come back here in time runs what it kept
            // aside: the database's order check waits for the held message, wherever it went.
            () = tokio::time::sleep_until(next_release.unwrap_or(pull_ends)),
                if next_release.is_some() => {
                queues.release_due();
                Vec::new()
            }
            _ = heartbeat.tick() => {
                // The ack floor is kept fresh for a consumer created again (see
                // `Inbox::restore_consumer`); read in a task of its own, since JetStream may
                // take its time to answer.
                let reader = inbox.clone();
                tokio::spawn(async move { reader.read_ack_floor().await });
                queues.heartbeat().await
            }
            _ = park_check.tick(), if checking.is_none() && queues.has_parked() => {
                checking = Some(AbortOnDropHandle::new(tokio::spawn(check_positions(
                    inbox.clone(),
                    queues.parked_aggregates(),
                ))));
                Vec::new()
            }
            checked = async { checking.as_mut().expect("guarded").await }, if checking.is_some() => {
                checking = None;
                queues.unpark(checked.ok().flatten().unwrap_or_default());
                Vec::new()
            }
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
        if tokio::time::timeout(PULL_EXPIRES + PULL_GRACE, rest)
            .await
            .is_err()
        {
            tracing::debug!("the last pull request did not end in time");
        }
    }
    nak_all(handed_back).await;
    drop((checking, restoring));
    while jobs.next().await.is_some() {}
    stop.cancel();
    purging.await?;
    Ok(())
}

/// The consumer's last applied sequence in some aggregates.
type Positions = Vec<(Aggregate, i64)>;

/// How often the positions of the parked events' aggregates are read.
const PARK_CHECK: Duration = Duration::from_millis(5);

/// The longest one position check may take (a pooled connection may be slow to come back):
/// the parked events wait for the next check, or their time.
const PARK_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// The consumer's positions in `aggregates`; `None` when the database did not answer in
/// time (the parked events wait for the next check, or their time).
async fn check_positions<H: Handler<C>, C: InboxConnection>(
    inbox: Inbox<H, C>,
    aggregates: Vec<Aggregate>,
) -> Option<Positions> {
    let config = &inbox.shared.config;
    let read = async {
        let mut conn = C::pooled(&inbox.shared.pool).await.ok()?;
        conn.positions(&config.consumer, &aggregates).await.ok()
    };
    tokio::time::timeout(config.statement_timeout.min(PARK_CHECK_TIMEOUT), read)
        .await
        .ok()
        .flatten()
}

/// How long a pull request waits at JetStream for messages: also the longest a graceful stop
/// waits for the one in progress to end, and how often an idle consumer asks again.
const PULL_EXPIRES: Duration = Duration::from_secs(1);

/// How long past `PULL_EXPIRES` a pull request may go without JetStream ending it before the
/// instance gives it up and asks again. JetStream ends an expired request with a status
/// message (408); a request the server died with, or that reached a consumer electing a
/// leader, is never answered, and async-nats's own timer would end it only 5 s after its
/// expiry, all that time with nothing received. A message JetStream delivered to a request
/// given up comes back after `ack_wait`.
const PULL_GRACE: Duration = Duration::from_secs(1);

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

/// A message to handle, with how long it has waited for its predecessor so far, and
/// whether it may be parked if it must wait again.
struct Job {
    key: String,
    message: jetstream::Message,
    held_for: Duration,
    may_park: bool,
    /// Cancelled when an earlier message of its key reaches the instance while it runs.
    earlier_here: CancellationToken,
}

/// A message handled: its key, its stream sequence, what came of it, and whether it was
/// settled (a test's crash point leaves it unsettled).
struct Finished {
    key: String,
    sequence: u64,
    outcome: Outcome,
    settled: bool,
    /// A held event kept here instead of nak'd, and what it waits on.
    parked: Option<(jetstream::Message, Parked)>,
}

/// An event kept by this instance until its aggregate's position reaches its predecessor.
struct Parked {
    /// Its stream sequence.
    sequence: u64,
    aggregate: Aggregate,
    /// Its `ce-sequence`.
    seq: i64,
    /// Since when it is parked this time.
    since: Instant,
}

async fn handle<H: Handler<C>, C: InboxConnection>(inbox: Inbox<H, C>, job: Job) -> Finished {
    let Job {
        key,
        message,
        held_for,
        may_park,
        earlier_here,
    } = job;
    let sequence = sequence(&message);
    let config = &inbox.shared.config;
    let started = std::time::Instant::now();
    let processed = {
        // A long handler keeps its message: progress acks while it runs.
        let processing = inbox.process_held(&message, held_for, &earlier_here);
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
        parked: None,
    });
    if may_park
        && settle
        && matches!(processed.outcome, Outcome::Held { .. })
        && let Ok(metadata) = Metadata::read(&message)
        && let Some((aggregate_type, aggregate_id, seq)) = metadata.place()
    {
        let parked = Parked {
            sequence,
            aggregate: Aggregate {
                source: metadata.source.clone().unwrap_or_default(),
                aggregate_type: aggregate_type.to_owned(),
                aggregate_id: aggregate_id.to_owned(),
            },
            seq,
            since: Instant::now(),
        };
        return Finished {
            key,
            sequence,
            outcome: processed.outcome,
            settled: true,
            parked: Some((message, parked)),
        };
    }
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
        parked: None,
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
    /// Cancelled when an earlier message of the key arrives while it is handled (the
    /// running message would otherwise wait in place for it, while it cannot start).
    earlier_here: CancellationToken,
    /// A nak'd message the key waits for.
    held_for: Option<Hold>,
    /// Later messages kept here while the key waits for its held message (or its parked
    /// event), by stream sequence: not counted against the buffer's room, and not handed
    /// back, so that they neither come back from JetStream out of order nor take the room
    /// the instance pulls its other keys' messages with.
    aside: BTreeMap<u64, jetstream::Message>,
    /// The parked event (in `waiting`) and what it waits on.
    parked: Option<Parked>,
    /// When the messages nak'd from behind the parked event come back.
    behind_parked_back: Option<Instant>,
    /// Whether the key is in the ready queue.
    ready: bool,
}

/// A key's message nak'd with a delay, which the key's later messages wait for.
#[derive(Clone, Copy)]
struct Hold {
    /// Its stream sequence.
    sequence: u64,
    /// When JetStream redelivers it.
    back: Instant,
    /// The latest the later messages nak'd behind it are due back: `back` plus `ack_wait`
    /// (within which the held message comes back even if its nak was lost).
    until: Instant,
    /// When the key stops waiting for it here (it went to another instance, or is late):
    /// `back` plus its delay, at least [`RETURN_MARGIN`] and at most [`SHORT_HOLD`]. The
    /// key's messages then run, and the database's order check waits for the held one.
    release: Instant,
}

impl Hold {
    /// The nak delay of a later message of the key, nak'd at `now`: all of them come back
    /// together, [`RETURN_MARGIN`] after the held message (which has then started, and the
    /// key's messages that arrive while it runs wait here, in order), however long its delay,
    /// but within `ack_wait` (the held message comes back then if its nak was lost); once
    /// that time has passed (the held message went to another instance, or is late),
    /// [`SHORT_HOLD`] at most, until the key stops waiting.
    fn delay_behind(&self, now: Instant) -> Duration {
        if now < self.back {
            (self.back - now + RETURN_MARGIN).min(self.until - self.back)
        } else {
            (self.until - now).min(SHORT_HOLD)
        }
    }

    /// Whether the later messages of the key nak'd at `now` come back with the held message
    /// within [`SHORT_HOLD`]: only those count against the room the instance pulls for.
    /// Behind a longer wait (a retry delay of seconds) the instance goes on pulling: the
    /// chain's later messages are nak'd to come back with the held one too, and its other
    /// aggregates' messages are among those it pulls (an instance that stopped pulling for
    /// as long would leave them behind).
    fn returns_behind(&self, now: Instant) -> bool {
        now < self.back && self.back - now + RETURN_MARGIN <= SHORT_HOLD
    }
}

/// How soon a held message must be due back for the messages nak'd behind it to count
/// against the instance's room; also the longest nak delay behind a held message that is
/// late.
const SHORT_HOLD: Duration = Duration::from_secs(1);

/// How long after a held message the later messages of its key are nak'd to come back, so
/// that JetStream redelivers the held one first; also how close an instant at which a
/// key's nak'd messages come back may be for another message to be nak'd to the same one,
/// and how long after nak'd messages are due back their room is pulled for again.
const RETURN_MARGIN: Duration = Duration::from_millis(20);

impl Key {
    /// The nak delay of a message behind the key's parked event, nak'd at `now`: every such
    /// message comes back at one instant, [`BEHIND_PARKED_DELAY`] after the first of them,
    /// while it is [`RETURN_MARGIN`] away or more.
    fn behind_parked_delay(&mut self, now: Instant) -> Duration {
        let back = match self.behind_parked_back {
            Some(back) if back >= now + RETURN_MARGIN => back,
            _ => *self.behind_parked_back.insert(now + BEHIND_PARKED_DELAY),
        };
        back - now
    }

    fn held(&self, now: Instant) -> Option<Hold> {
        self.held_for.filter(|hold| now < hold.release)
    }

    /// Whether the messages kept aside may join the waiting ones: the key neither waits for
    /// a held message nor has one running (it may fail again) or parked.
    fn may_release_aside(&self, now: Instant) -> bool {
        !self.aside.is_empty()
            && self.held(now).is_none()
            && self.running.is_none()
            && self.parked.is_none()
    }

    fn can_start(&self, now: Instant) -> bool {
        let Some(&first) = self.waiting.keys().next() else {
            return false;
        };
        self.running.is_none()
            && match self.held(now) {
                None => true,
                Some(hold) => first <= hold.sequence,
            }
            && self
                .parked
                .as_ref()
                .is_none_or(|parked| first < parked.sequence)
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty()
            && self.aside.is_empty()
            && self.running.is_none()
            && self.held_for.is_none()
            && self.parked.is_none()
    }
}

struct Queues {
    keys: HashMap<String, Key>,
    ready: VecDeque<String>,
    running: usize,
    buffered: usize,
    /// Keys with a parked event.
    parked: usize,
    /// Messages kept aside, across keys.
    aside: usize,
    max_running: usize,
    max_buffered: usize,
    /// The most messages kept aside: the consumer's `max_ack_pending`, which JetStream
    /// holds the messages nak'd back under as well (they stay pending until acked).
    max_aside: usize,
    ack_wait: Duration,
    /// Since when each message (by stream sequence) has waited for its predecessor.
    held_since: HashMap<u64, Instant>,
    /// When the room of each message nak'd back to return with its held message is free
    /// again: [`RETURN_MARGIN`] after JetStream is due to redeliver it.
    returning: BinaryHeap<Reverse<Instant>>,
    /// When each hold is released ([`Hold::release`]), by key: every hold has its entry,
    /// since its key may keep messages aside until then.
    releases: BinaryHeap<Reverse<(Instant, String)>>,
}

impl Queues {
    fn new(max_running: usize, max_buffered: usize, max_aside: usize, ack_wait: Duration) -> Self {
        Self {
            keys: HashMap::new(),
            ready: VecDeque::new(),
            running: 0,
            buffered: 0,
            parked: 0,
            aside: 0,
            max_running,
            max_buffered,
            max_aside,
            ack_wait,
            held_since: HashMap::new(),
            returning: BinaryHeap::new(),
            releases: BinaryHeap::new(),
        }
    }

    /// When the first hold is released.
    fn next_release(&self) -> Option<Instant> {
        self.releases.peek().map(|Reverse((release, _))| *release)
    }

    /// Releases the holds that are due: their keys' later messages may start, those kept
    /// aside joining the waiting ones; a key left with nothing is forgotten.
    fn release_due(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((release, _))) = self.releases.peek()
            && *release <= now
        {
            let Reverse((_, name)) = self.releases.pop().expect("peeked");
            self.release_aside(&name, now);
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

    /// Moves the messages `name` kept aside to its waiting ones, where the key may take
    /// them ([`Key::may_release_aside`]), and queues the key to run.
    fn release_aside(&mut self, name: &str, now: Instant) {
        let Some(key) = self.keys.get_mut(name) else {
            return;
        };
        if key.held_for.is_some_and(|hold| now >= hold.release) {
            key.held_for = None;
        }
        if !key.may_release_aside(now) {
            return;
        }
        let aside = std::mem::take(&mut key.aside);
        self.aside -= aside.len();
        for (sequence, message) in aside {
            // One received again since was kept among the waiting ones: that delivery is
            // the one to settle.
            if let std::collections::btree_map::Entry::Vacant(entry) = key.waiting.entry(sequence) {
                entry.insert(message);
                self.buffered += 1;
            }
        }
        if !key.ready {
            key.ready = true;
            self.ready.push_back(name.to_owned());
        }
    }

    /// Keeps `message`, a later message of a held key or one behind a parked event, aside;
    /// gives it back when the most messages are kept aside already.
    fn keep_aside(
        &mut self,
        key_name: &str,
        message: jetstream::Message,
    ) -> Option<jetstream::Message> {
        if self.aside >= self.max_aside {
            return Some(message);
        }
        let key = self.keys.get_mut(key_name).expect("a key that waits");
        if key.aside.insert(sequence(&message), message).is_none() {
            self.aside += 1;
        }
        None
    }

    /// How many messages to pull: the buffer's room, less the messages nak'd back to return
    /// with their held message that are not back at JetStream yet.
    fn room(&mut self) -> usize {
        let now = Instant::now();
        while self
            .returning
            .peek()
            .is_some_and(|Reverse(back)| *back <= now)
        {
            self.returning.pop();
        }
        self.max_buffered
            .saturating_sub(self.buffered)
            .saturating_sub(self.returning.len())
    }

    /// When the room of the first message nak'd back to return with its held message is
    /// free again.
    fn next_return(&self) -> Option<Instant> {
        self.returning.peek().map(|Reverse(back)| *back)
    }

    /// The naks of later messages of `hold`'s key, at `now`: each with the hold's
    /// [`Hold::delay_behind`], counted against the buffer's room until it is back at
    /// JetStream when it comes back with the held message ([`Hold::returns_behind`]).
    fn nak_behind(
        &mut self,
        hold: Hold,
        now: Instant,
        messages: impl IntoIterator<Item = jetstream::Message>,
    ) -> Vec<(jetstream::Message, Duration)> {
        let delay = hold.delay_behind(now);
        let naks: Vec<_> = messages
            .into_iter()
            .map(|message| (message, delay))
            .collect();
        if hold.returns_behind(now) {
            let free_again = Reverse(now + delay + RETURN_MARGIN);
            self.returning
                .extend(std::iter::repeat_n(free_again, naks.len()));
        }
        naks
    }

    /// Queues a received message, or keeps it aside (a later message of a held key, or one
    /// behind a parked event); returns what to nak (such a message, when the most are kept
    /// aside already).
    fn route(&mut self, message: jetstream::Message) -> Vec<(jetstream::Message, Duration)> {
        let now = Instant::now();
        let key_name = ordering_key(&message);
        let sequence = sequence(&message);
        // A hold released a moment ago (its timer not served yet): what its key kept aside
        // joins the waiting messages before this one is queued beside them.
        self.release_aside(&key_name, now);
        // Counted only for a message behind a parked event: route runs for every message.
        let behind_parked = self
            .keys
            .get(&key_name)
            .and_then(|key| key.parked.as_ref())
            .is_some_and(|parked| sequence > parked.sequence);
        let blocked_full = behind_parked && self.blocked() >= self.max_buffered / 2;
        let key = self.keys.entry(key_name.clone()).or_default();
        if key.running == Some(sequence) {
            // Redelivered while being handled: the handling settles it.
            return Vec::new();
        }
        if key.running.is_some_and(|running| sequence < running) {
            key.earlier_here.cancel();
        }
        if let Some(hold) = key.held(now)
            && sequence > hold.sequence
        {
            // It would only wait among the waiting messages: kept aside, or, when the most
            // are kept aside, handed back to JetStream until the held one is back.
            return match self.keep_aside(&key_name, message) {
                None => Vec::new(),
                Some(message) => self.nak_behind(hold, now, [message]),
            };
        }
        if blocked_full {
            // Half the buffer waits behind parked events already: keep room to receive the
            // predecessors they wait for. Kept aside, or, when the most are kept aside,
            // handed back to come back together.
            let Some(message) = self.keep_aside(&key_name, message) else {
                return Vec::new();
            };
            let key = self.keys.get_mut(&key_name).expect("routed above");
            return vec![(message, key.behind_parked_delay(now))];
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
            key.earlier_here = CancellationToken::new();
            self.running += 1;
            let held_for = self
                .held_since
                .get(&sequence)
                .map_or(Duration::ZERO, |since| now - *since);
            let may_park =
                self.parked < self.max_buffered / 2 && held_for < 2 * self.ack_wait + PARK_SLACK;
            return Some(Job {
                key: key_name,
                message,
                held_for,
                may_park,
                earlier_here: key.earlier_here.clone(),
            });
        }
        None
    }

    /// Records a finished message; returns what to nak (the later messages of a key that is
    /// now held, or is parked, beyond what may be kept aside).
    fn finished(&mut self, finished: Finished) -> Vec<(jetstream::Message, Duration)> {
        self.running -= 1;
        let now = Instant::now();
        if let Some((message, parked)) = finished.parked {
            self.held_since.entry(finished.sequence).or_insert(now);
            let key = self.keys.entry(finished.key.clone()).or_default();
            key.running = None;
            if key.waiting.insert(parked.sequence, message).is_none() {
                self.buffered += 1;
            }
            let parked_at = parked.sequence;
            if key.parked.replace(parked).is_none() {
                self.parked += 1;
            }
            // An earlier message of the key that arrived meanwhile may run.
            if key.can_start(now) && !key.ready {
                key.ready = true;
                self.ready.push_back(finished.key.clone());
            }
            // Keep room to receive the predecessors the parked events wait for: no more than
            // half the buffer waits behind them; this key's latest messages are kept aside
            // (or, when the most are, handed back to come back together).
            let excess = self.blocked().saturating_sub(self.max_buffered / 2);
            let key = self.keys.get_mut(&finished.key).expect("parked above");
            let mut behind = Vec::new();
            while behind.len() < excess
                && let Some(entry) = key.waiting.last_entry()
                && *entry.key() > parked_at
            {
                behind.push(entry.remove());
            }
            self.buffered -= behind.len();
            let mut naks = Vec::new();
            for message in behind {
                if let Some(message) = self.keep_aside(&finished.key, message) {
                    let key = self.keys.get_mut(&finished.key).expect("parked above");
                    naks.push((message, key.behind_parked_delay(now)));
                }
            }
            return naks;
        }
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
        let behind = wait.map(|delay| {
            let back = now + delay;
            let until = back + self.ack_wait;
            let hold = Hold {
                sequence: finished.sequence,
                back,
                until,
                release: (back + delay.clamp(RETURN_MARGIN, SHORT_HOLD)).min(until),
            };
            key.held_for = Some(hold);
            (hold, key.waiting.split_off(&finished.sequence))
        });
        if key.idle() {
            self.keys.remove(&finished.key);
            return Vec::new();
        }
        if !key.ready {
            key.ready = true;
            self.ready.push_back(finished.key.clone());
        }
        let Some((hold, later)) = behind else {
            // Its message settled: what the key kept aside may run.
            self.release_aside(&finished.key, now);
            return Vec::new();
        };
        self.buffered -= later.len();
        self.releases
            .push(Reverse((hold.release, finished.key.clone())));
        let mut naks = Vec::new();
        for message in later.into_values() {
            if let Some(message) = self.keep_aside(&finished.key, message) {
                naks.push(message);
            }
        }
        self.nak_behind(hold, now, naks)
    }

    /// Keeps waiting and kept-aside messages from redelivery, releases parked events whose
    /// time is up, and forgets holds of messages long gone to other instances. (Held keys
    /// are released by their timer: [`Queues::release_due`].)
    async fn heartbeat(&mut self) -> Vec<(jetstream::Message, Duration)> {
        let now = Instant::now();
        for key in self.keys.values() {
            for message in key.waiting.values().chain(key.aside.values()) {
                if let Err(error) = message.ack_with(AckKind::Progress).await {
                    tracing::debug!(%error, "progress ack failed");
                }
            }
        }
        // Parked events whose time is up run again, whether or not a position check ends.
        self.unpark(Vec::new());
        let forget_after = Duration::from_secs(3600);
        self.held_since
            .retain(|_, since| now.duration_since(*since) < forget_after);
        Vec::new()
    }

    /// Messages waiting behind a parked event (the parked ones included).
    fn blocked(&self) -> usize {
        self.keys
            .values()
            .filter(|key| key.parked.is_some())
            .map(|key| key.waiting.len())
            .sum()
    }

    fn has_parked(&self) -> bool {
        self.parked > 0
    }

    /// The aggregates the parked events wait on (one per key: an event with an aggregate
    /// is ordered by it).
    fn parked_aggregates(&self) -> Vec<Aggregate> {
        self.keys
            .values()
            .filter_map(|key| key.parked.as_ref().map(|parked| parked.aggregate.clone()))
            .collect()
    }

    /// Releases the parked events whose predecessor is applied (by `positions`, the
    /// consumer's last applied sequence per aggregate), and those parked for `ack_wait` +
    /// [`PARK_SLACK`]: they run again.
    fn unpark(&mut self, positions: Positions) {
        let now = Instant::now();
        let positions: HashMap<Aggregate, i64> = positions.into_iter().collect();
        let mut released = Vec::new();
        for (name, key) in &mut self.keys {
            let Some(parked) = &key.parked else {
                continue;
            };
            let applied = positions
                .get(&parked.aggregate)
                .is_some_and(|last_seq| *last_seq >= parked.seq - 1);
            if applied || now - parked.since >= self.ack_wait + PARK_SLACK {
                key.parked = None;
                self.parked -= 1;
                released.push(name.clone());
            }
        }
        for name in released {
            // What the key kept aside may wait again (the parked event may have gone aside
            // itself, behind a held message that failed once more).
            self.release_aside(&name, now);
            if let Some(key) = self.keys.get_mut(&name)
                && !key.ready
            {
                key.ready = true;
                self.ready.push_back(name);
            }
        }
    }

    /// Takes every message received and not started, to hand back on a graceful stop.
    fn release_waiting(&mut self) -> Vec<(jetstream::Message, Duration)> {
        let mut messages = Vec::with_capacity(self.buffered);
        self.parked = 0;
        for key in self.keys.values_mut() {
            key.parked = None;
            let mut kept = std::mem::take(&mut key.waiting);
            for (sequence, message) in std::mem::take(&mut key.aside) {
                kept.entry(sequence).or_insert(message);
            }
            messages.extend(kept.into_values().map(|message| (message, Duration::ZERO)));
        }
        self.buffered = 0;
        self.aside = 0;
        messages
    }
}

/// Deletes expired inbox rows every `purge_interval`, until stopped.
async fn purge_loop<H: Handler<C>, C: InboxConnection>(
    inbox: Inbox<H, C>,
    stop: CancellationToken,
) {
    const BATCH: i64 = 1000;
    let config = &inbox.shared.config;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(config.purge_interval) => {}
        }
        let Ok(mut conn) = C::pooled(&inbox.shared.pool).await else {
            continue;
        };
        loop {
            let purged = tokio::time::timeout(
                config.statement_timeout,
                super::purge(&mut *conn, &config.consumer, config.retention, BATCH),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A JetStream context on a client that never connects: the messages below are only
    /// queued, never settled.
    async fn context() -> jetstream::Context {
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect("nats://127.0.0.1:1")
            .await
            .expect("a client that connects later");
        jetstream::new(client)
    }

    /// Stream message `sequence`, ordered by `key` (its subject: no headers).
    fn message(context: &jetstream::Context, key: &str, sequence: u64) -> jetstream::Message {
        jetstream::Message {
            message: async_nats::Message {
                subject: key.into(),
                reply: Some(format!("$JS.ACK.S.C.1.{sequence}.{sequence}.0.0").into()),
                payload: Default::default(),
                headers: None,
                status: None,
                description: None,
                length: 0,
            },
            context: context.clone(),
        }
    }

    fn finished(key: &str, sequence: u64, outcome: Outcome) -> Finished {
        Finished {
            key: key.to_owned(),
            sequence,
            outcome,
            settled: true,
            parked: None,
        }
    }

    fn retry() -> Outcome {
        Outcome::Retry {
            delay: RETURN_MARGIN,
            error: "failed".to_owned(),
        }
    }

    fn started(queues: &mut Queues) -> Option<u64> {
        queues.next_to_start().map(|job| sequence(&job.message))
    }

    fn aggregate() -> Aggregate {
        Aggregate {
            source: String::new(),
            aggregate_type: "Order".to_owned(),
            aggregate_id: "o-1".to_owned(),
        }
    }

    #[tokio::test]
    async fn a_held_keys_later_messages_are_kept_aside_and_run_in_order_after_it() {
        let context = context().await;
        let mut queues = Queues::new(4, 16, 100, Duration::from_secs(5));
        assert!(queues.route(message(&context, "a", 1)).is_empty());
        assert_eq!(started(&mut queues), Some(1));
        assert!(queues.route(message(&context, "a", 2)).is_empty());
        assert!(queues.finished(finished("a", 1, retry())).is_empty());
        assert!(queues.route(message(&context, "a", 3)).is_empty());
        assert_eq!((queues.aside, queues.buffered), (2, 0));
        assert_eq!(queues.room(), 16, "what is kept aside takes no room");
        assert_eq!(started(&mut queues), None);
        // The held message comes back and is applied: the two follow, in order.
        assert!(queues.route(message(&context, "a", 1)).is_empty());
        assert_eq!(started(&mut queues), Some(1));
        assert!(
            queues
                .finished(finished("a", 1, Outcome::Handled))
                .is_empty()
        );
        assert_eq!((queues.aside, queues.buffered), (0, 2));
        assert_eq!(started(&mut queues), Some(2));
        assert!(
            queues
                .finished(finished("a", 2, Outcome::Handled))
                .is_empty()
        );
        assert_eq!(started(&mut queues), Some(3));
    }

    #[tokio::test]
    async fn a_key_whose_held_message_is_late_runs_what_it_kept_aside() {
        let context = context().await;
        let mut queues = Queues::new(4, 16, 100, Duration::from_secs(5));
        queues.route(message(&context, "a", 1));
        started(&mut queues);
        queues.finished(finished("a", 1, retry()));
        queues.route(message(&context, "a", 2));
        queues.route(message(&context, "a", 3));
        let release = queues.next_release().expect("a hold to release");
        tokio::time::sleep_until(release).await;
        queues.release_due();
        assert_eq!(started(&mut queues), Some(2));
        // It waits for the held message, parked; which comes late and fails once more: the
        // parked event goes aside with the rest.
        let parked = Parked {
            sequence: 2,
            aggregate: aggregate(),
            seq: 2,
            since: Instant::now(),
        };
        let mut parked_here = finished(
            "a",
            2,
            Outcome::Held {
                delay: RETURN_MARGIN,
                reason: "its predecessor".to_owned(),
            },
        );
        parked_here.parked = Some((message(&context, "a", 2), parked));
        assert!(queues.finished(parked_here).is_empty());
        queues.route(message(&context, "a", 1));
        assert_eq!(started(&mut queues), Some(1));
        queues.finished(finished("a", 1, retry()));
        assert_eq!(queues.aside, 2);
        queues.route(message(&context, "a", 1));
        assert_eq!(started(&mut queues), Some(1));
        queues.finished(finished("a", 1, Outcome::Handled));
        assert_eq!(
            started(&mut queues),
            None,
            "the parked event is still parked"
        );
        // The position check finds the predecessor applied: the parked event runs, and the
        // one behind it.
        queues.unpark(vec![(aggregate(), 1)]);
        assert_eq!(started(&mut queues), Some(2));
        queues.finished(finished("a", 2, Outcome::Handled));
        assert_eq!(started(&mut queues), Some(3));
    }
}
