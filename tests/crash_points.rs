//! Deterministic crashes at the points that matter, with the promised outcome of each.
//!
//! The runtime's crash points (compiled in with its `failpoints` feature, which only the
//! tests enable) make the code return at a point as if the process had died there: the
//! transaction in progress rolls back (as PostgreSQL rolls back a dead connection's), and
//! nothing after the point happens (no publish, no mark, no ack). The tests of this binary
//! take turns (`fail::FailScenario`), because crash points are process-wide.

mod support;

use std::time::Duration;

use diesel::prelude::*;
use diesel_async::RunQueryDsl;
use fail::FailScenario;
use outbox_runtime::outbox::schema::{outbox_events, outbox_inbox_attempts};
use outbox_runtime::{Inbox, Relay, UnitOfWorkError};
use support::consumer::{
    Recording, applied, assert_applied_in_order, commit_rounds, consumer_config, consumer_database,
    wait_until_settled,
};
use support::domain::Order;
use support::{Received, TestEnv};

/// Each aggregate's `ce-sequence`s in stream order, and the number of distinct ids.
fn shape(messages: &[Received]) -> (std::collections::BTreeMap<String, Vec<i64>>, usize) {
    let mut sequences: std::collections::BTreeMap<String, Vec<i64>> = Default::default();
    let mut ids = std::collections::BTreeSet::new();
    for message in messages {
        ids.insert(message.header("ce-id"));
        sequences
            .entry(message.header("ce-subject"))
            .or_default()
            .push(message.header("ce-sequence").parse().unwrap());
    }
    (sequences, ids.len())
}

async fn queued(env: &TestEnv) -> i64 {
    outbox_events::table
        .count()
        .get_result(&mut env.conn().await)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_that_dies_right_after_commit_still_has_its_events_published() {
    let scenario = FailScenario::setup();
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    fail::cfg("unit_of_work::after_commit", "1*return").unwrap();
    let mut order = Order::place("o-1", "ada", 1);
    let result = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            uow.track(&mut order);
            Ok::<_, UnitOfWorkError>(())
        })
        .await;
    assert!(
        result.is_err(),
        "the process died before it heard of the commit"
    );
    assert_eq!(queued(&env).await, 1, "committed nonetheless");

    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    while relay.relay_batch().await.unwrap().claimed > 0 {}
    let (sequences, ids) = shape(&env.stream_messages().await);
    assert_eq!((ids, sequences["o-1"].clone()), (1, vec![1]));
    scenario.teardown();
}

/// Commits 5 aggregates x 4 events, then runs one relay batch with `point` set to `action`
/// (it must fail, as a relay dying there), then relays what is left with a new relay.
/// Returns the first relay's stream length at its death.
async fn relay_dies_at(point: &str, action: &str) -> (TestEnv, u64) {
    let env = TestEnv::new().await;
    commit_rounds(&env, 5, 4).await;
    let mut dying = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    fail::cfg(point, action).unwrap();
    assert!(
        dying.relay_batch().await.is_err(),
        "the relay died at {point}"
    );
    fail::remove(point);
    drop(dying);
    let mut stream = env.jetstream().get_stream(&env.stream).await.unwrap();
    let at_death = stream.info().await.unwrap().state.messages;
    assert_eq!(
        queued(&env).await,
        20,
        "its transaction rolled back: every row queued"
    );

    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    while relay.relay_batch().await.unwrap().claimed > 0 {}
    assert_eq!(queued(&env).await, 0);
    (env, at_death)
}

fn assert_each_once_in_order(messages: &[Received]) {
    let (sequences, ids) = shape(messages);
    assert_eq!(
        (messages.len(), ids),
        (20, 20),
        "every event once in the stream"
    );
    for (aggregate, seqs) in sequences {
        assert_eq!(seqs, [1, 2, 3, 4], "{aggregate} in order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_dies_after_its_claim_publishes_nothing_and_loses_nothing() {
    let scenario = FailScenario::setup();
    let (env, at_death) = relay_dies_at("relay::before_publish", "return").await;
    assert_eq!(at_death, 0);
    assert_each_once_in_order(&env.stream_messages().await);
    scenario.teardown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_dies_mid_batch_is_followed_without_duplicates_or_reordering() {
    let scenario = FailScenario::setup();
    let (env, at_death) = relay_dies_at("relay::mid_batch", "3*off->return").await;
    assert!(at_death >= 3, "it published before it died: {at_death}");
    assert_each_once_in_order(&env.stream_messages().await);
    scenario.teardown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_dies_between_the_acks_and_the_mark_is_deduplicated_by_jetstream() {
    let scenario = FailScenario::setup();
    let (env, at_death) = relay_dies_at("relay::after_publish", "return").await;
    assert_eq!(at_death, 20, "everything was acked before it died");
    assert_each_once_in_order(&env.stream_messages().await);
    scenario.teardown();
}

/// Runs a consumer of 9 messages until every one is settled, with `point` set to `action`;
/// returns the consumer's database, and how many deliveries JetStream made.
async fn consume_with_crash(point: &str, action: &str) -> (TestEnv, u64) {
    let producer = TestEnv::new().await;
    commit_rounds(&producer, 3, 3).await;
    support::consumer::relay_all(&producer).await;
    let consumer = consumer_database().await;
    let inbox = Inbox::connect(
        consumer_config(&consumer, &producer, "crashing"),
        producer.nats.clone(),
        Recording::default(),
    )
    .await
    .unwrap();
    fail::cfg(point, action).unwrap();
    let probe = inbox.clone();
    let running = inbox.spawn();
    wait_until_settled(&probe, "every message settled", Duration::from_secs(20)).await;
    running.shutdown().await.unwrap();
    fail::remove(point);
    let deliveries = support::consumer::deliveries(&probe).await;
    (consumer, deliveries)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_dies_between_its_handler_and_its_commit_applies_the_event_once() {
    let scenario = FailScenario::setup();
    let (consumer, deliveries) = consume_with_crash("inbox::before_commit", "1*return").await;
    assert!(
        deliveries > 9,
        "the crashed message came again: {deliveries} deliveries"
    );
    let mut conn = consumer.conn().await;
    assert_applied_in_order(&applied(&mut conn).await, 3, 3);
    let attempts: i64 = outbox_inbox_attempts::table
        .count()
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(attempts, 0, "a crash is not a failed attempt");
    scenario.teardown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_dies_between_its_commit_and_its_ack_applies_the_event_once() {
    let scenario = FailScenario::setup();
    let (consumer, deliveries) = consume_with_crash("inbox::after_commit", "1*return").await;
    assert!(
        deliveries > 9,
        "the unacked message came again: {deliveries} deliveries"
    );
    assert_applied_in_order(&applied(&mut consumer.conn().await).await, 3, 3);
    scenario.teardown();
}

/// A relay whose worker panics (a bug) stops by itself, and its handle says so: a service
/// that selects on `RelayHandle::stopped` sees it and exits, rather than running on with
/// nothing published. The rows stay queued, and the next relay publishes them once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_worker_panics_is_seen_stopped_and_loses_nothing() {
    let scenario = FailScenario::setup();
    let env = TestEnv::new().await;
    commit_rounds(&env, 5, 4).await;
    let relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    fail::cfg("relay::before_publish", "panic(a bug in a worker)").unwrap();
    let mut running = relay.spawn();
    let stopped = tokio::time::timeout(Duration::from_secs(20), running.stopped())
        .await
        .expect("the relay stopped by itself within 20 s");
    fail::remove("relay::before_publish");
    match stopped {
        Err(outbox_runtime::RelayError::Task(error)) => assert!(error.is_panic(), "{error}"),
        other => panic!("a worker's panic, not {other:?}"),
    }
    assert!(
        matches!(running.stopped().await, Ok(())),
        "once it has returned, `stopped` returns at once"
    );
    running.shutdown().await.unwrap();
    assert_eq!(queued(&env).await, 20, "every row queued");

    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    while relay.relay_batch().await.unwrap().claimed > 0 {}
    assert_each_once_in_order(&env.stream_messages().await);
    scenario.teardown();
}

/// An inbox whose task panics (a bug; a handler's own panic is caught and retried) stops by
/// itself, and its handle says so. The panic here unwinds out of a message's open
/// transaction, which holds its aggregate's position: nothing of the stopped inbox may keep
/// that transaction open (its pooled connection went back to the pool with the transaction
/// open, and held the lock as long as the pool lived, which a task that outlived the inbox,
/// or a clone the service keeps, made for good: the next instance waited on it). The next
/// instance applies every event once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_whose_task_panics_is_seen_stopped_and_leaves_no_transaction_open() {
    let scenario = FailScenario::setup();
    let producer = TestEnv::new().await;
    commit_rounds(&producer, 3, 3).await;
    support::consumer::relay_all(&producer).await;
    let consumer = consumer_database().await;
    let config = consumer_config(&consumer, &producer, "panicking");
    let inbox = Inbox::connect(config.clone(), producer.nats.clone(), Recording::default())
        .await
        .unwrap();
    // The service keeps a clone (for `consumer()` or `replay_dead_letter`), and with it the
    // stopped inbox's pool.
    let kept = inbox.clone();
    fail::cfg("inbox::before_commit", "1*panic(a bug in the inbox)").unwrap();
    let mut running = inbox.spawn();
    let stopped = tokio::time::timeout(Duration::from_secs(20), running.stopped())
        .await
        .expect("the inbox stopped by itself within 20 s");
    fail::remove("inbox::before_commit");
    match stopped {
        Err(outbox_runtime::InboxError::Task(error)) => assert!(error.is_panic(), "{error}"),
        other => panic!("a task's panic, not {other:?}"),
    }
    running.shutdown().await.unwrap();
    support::until_no_inbox_transaction_open(&consumer).await;

    let inbox = Inbox::connect(config, producer.nats.clone(), Recording::default())
        .await
        .unwrap();
    let probe = inbox.clone();
    let running = inbox.spawn();
    wait_until_settled(&probe, "every message settled", Duration::from_secs(30)).await;
    running.shutdown().await.unwrap();
    assert_applied_in_order(&applied(&mut consumer.conn().await).await, 3, 3);
    drop(kept);
    scenario.teardown();
}
