//! The inbox against the real PostgreSQL and NATS: duplicates, a consumer killed between
//! commit and ack, failing handlers and dead letters, per-key order with parallel keys, and
//! correlation through a chain of two services.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures::StreamExt;
use outbox_runtime::outbox::schema::{outbox_inbox, outbox_inbox_dead_letters};
use outbox_runtime::{
    DomainEvent, Handler, Inbox, Metadata, Outcome, Traceparent, UnitOfWork, UnitOfWorkError,
};
use serde::{Deserialize, Serialize};
use support::consumer::{consumer_config, relay_all, run_until_settled, wait_until_settled};
use support::counters::Counters;
use support::domain::{Order, OrderEvent};
use support::{TestEnv, wait_until};

/// A consumer's database: its own test database, with a counter its handlers bump.
async fn consumer_database() -> TestEnv {
    let env = TestEnv::new().await;
    env.conn()
        .await
        .batch_execute("CREATE TABLE effects (key text PRIMARY KEY, n bigint NOT NULL)")
        .await
        .unwrap();
    env
}

async fn effects(env: &TestEnv) -> BTreeMap<String, i64> {
    #[derive(QueryableByName)]
    struct Effect {
        #[diesel(sql_type = diesel::sql_types::Text)]
        key: String,
        #[diesel(sql_type = diesel::sql_types::Int8)]
        n: i64,
    }
    let rows: Vec<Effect> = diesel::sql_query("SELECT key, n FROM effects")
        .load(&mut env.conn().await)
        .await
        .unwrap();
    rows.into_iter().map(|e| (e.key, e.n)).collect()
}

async fn bump(conn: &mut AsyncPgConnection, key: &str) -> QueryResult<usize> {
    diesel::sql_query(
        "INSERT INTO effects VALUES ($1, 1) ON CONFLICT (key) DO UPDATE SET n = effects.n + 1",
    )
    .bind::<diesel::sql_types::Text, _>(key)
    .execute(conn)
    .await
}

/// How many times a handler was called. (A function: on an `Arc`, `.load` would resolve to
/// diesel-async's `RunQueryDsl::load`, implemented for every type.)
fn calls(counter: &AtomicUsize) -> usize {
    counter.load(Ordering::SeqCst)
}

/// Counts every order event it is given, by aggregate.
#[derive(Clone, Default)]
struct Counting {
    calls: Arc<AtomicUsize>,
}

impl Handler for Counting {
    type Event = OrderEvent;
    type Error = diesel::result::Error;

    async fn handle(
        &self,
        _event: OrderEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        (*self.calls).fetch_add(1, Ordering::SeqCst);
        bump(uow.conn(), message.aggregate_id.as_str()).await?;
        Ok(())
    }
}

/// Commits one order (Placed, then `extra` Shipped) through the producer's outbox.
async fn place(producer: &TestEnv, id: &str, extra: usize) {
    let mut order = Order::place(id, "ada", 1);
    for _ in 0..extra {
        order.record(OrderEvent::Shipped);
    }
    producer.commit(&mut order).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_message_stored_twice_after_the_dedup_window_changes_state_once() {
    let producer = TestEnv::new().await;
    producer.create_stream(Duration::from_secs(1)).await;
    place(&producer, "o-1", 0).await;
    relay_all(&producer).await;
    let original = producer.stream_messages().await.remove(0);

    // The same message again inside the window: JetStream drops it. After the window (a
    // relay republishing a row very late): stored a second time.
    let republish = async || {
        producer
            .jetstream()
            .publish_with_headers(
                original.subject.clone(),
                original.headers.clone(),
                original.payload.clone().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap()
    };
    assert!(republish().await.duplicate);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!republish().await.duplicate);
    assert_eq!(producer.stream_messages().await.len(), 2);

    let counters = Counters::installed();
    let consumer = consumer_database().await;
    let handler = Counting::default();
    let inbox = Inbox::connect(
        consumer_config(&consumer, &producer, "dedup"),
        producer.nats.clone(),
        handler.clone(),
    )
    .await
    .unwrap()
    .spawn();
    wait_until("both copies acked", Duration::from_secs(10), || async {
        let mut info = producer
            .jetstream()
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
                "dedup",
                &producer.stream,
            )
            .await
            .unwrap();
        let info = info.info().await.unwrap();
        (info.ack_floor.stream_sequence == 2).then_some(())
    })
    .await;
    inbox.shutdown().await.unwrap();

    assert_eq!(calls(&handler.calls), 1, "handled once");
    assert_eq!(
        effects(&consumer).await,
        BTreeMap::from([("o-1".to_owned(), 1)])
    );
    let messages = "outbox_inbox_messages_total{consumer=dedup,outcome=";
    assert_eq!(counters.get(&format!("{messages}handled}}")), 1);
    assert_eq!(counters.get(&format!("{messages}duplicate}}")), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_between_commit_and_ack_skips_the_redelivery() {
    let producer = TestEnv::new().await;
    place(&producer, "o-1", 0).await;
    relay_all(&producer).await;
    let consumer = consumer_database().await;
    let config = consumer_config(&consumer, &producer, "crashy");

    // The first instance handles and commits, and dies before its ack.
    let first = Counting::default();
    let inbox = Inbox::connect(config.clone(), producer.nats.clone(), first.clone())
        .await
        .unwrap();
    let mut batch = inbox
        .consumer()
        .fetch()
        .max_messages(1)
        .messages()
        .await
        .unwrap();
    let message = batch.next().await.unwrap().unwrap();
    assert_eq!(inbox.process(&message).await.unwrap(), Outcome::Handled);
    drop((message, batch, inbox));
    assert_eq!(
        effects(&consumer).await,
        BTreeMap::from([("o-1".to_owned(), 1)])
    );

    // Restarted: JetStream redelivers after ack_wait; the inbox finds the message recorded.
    let second = Counting::default();
    let inbox = Inbox::connect(config, producer.nats.clone(), second.clone())
        .await
        .unwrap();
    run_until_settled(inbox, "the redelivery acked", Duration::from_secs(10)).await;

    assert_eq!(calls(&first.calls), 1);
    assert_eq!(calls(&second.calls), 0, "the handler was not called again");
    assert_eq!(
        effects(&consumer).await,
        BTreeMap::from([("o-1".to_owned(), 1)])
    );
}

/// Writes its effect, then fails: the effect must not survive.
#[derive(Clone, Default)]
struct Failing {
    calls: Arc<AtomicUsize>,
}

impl Handler for Failing {
    type Event = OrderEvent;
    type Error = String;

    async fn handle(
        &self,
        _event: OrderEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        (*self.calls).fetch_add(1, Ordering::SeqCst);
        bump(uow.conn(), "written-then-rolled-back")
            .await
            .map_err(|e| e.to_string())?;
        Err(format!("stock service unavailable for {}", message.id))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_handler_leaves_no_trace_is_retried_then_dead_lettered() {
    let producer = TestEnv::new().await;
    place(&producer, "o-1", 0).await;
    relay_all(&producer).await;
    let message_id = producer.stream_messages().await[0]
        .headers
        .get("ce-id")
        .unwrap()
        .to_string();
    let counters = Counters::installed();
    let consumer = consumer_database().await;
    let mut config = consumer_config(&consumer, &producer, "failing");
    config.max_attempts = 3;
    let handler = Failing::default();
    let inbox = Inbox::connect(config, producer.nats.clone(), handler.clone())
        .await
        .unwrap();
    let probe = inbox.clone();
    let running = inbox.spawn();

    let mut conn = consumer.conn().await;
    type Letter = (String, String, String, Vec<u8>, i64, serde_json::Value);
    let letter: Letter = wait_until("a dead letter", Duration::from_secs(15), || async {
        outbox_inbox_dead_letters::table
            .select((
                outbox_inbox_dead_letters::consumer,
                outbox_inbox_dead_letters::message_id,
                outbox_inbox_dead_letters::error,
                outbox_inbox_dead_letters::payload,
                outbox_inbox_dead_letters::deliveries,
                outbox_inbox_dead_letters::headers,
            ))
            .first(&mut consumer.conn().await)
            .await
            .ok()
    })
    .await;
    wait_until_settled(&probe, "the message terminated", Duration::from_secs(10)).await;
    running.shutdown().await.unwrap();

    assert_eq!(calls(&handler.calls), 3, "tried max_attempts times");
    assert!(
        effects(&consumer).await.is_empty(),
        "no trace of the failed attempts"
    );
    let (name, id, error, payload, deliveries, headers) = letter;
    assert_eq!(
        (name.as_str(), id.as_str(), deliveries),
        ("failing", message_id.as_str(), 3)
    );
    assert_eq!(
        error,
        format!(
            "handler failed: stock service unavailable for {message_id} (failed 3 times; \
             max_attempts 3)"
        )
    );
    let payload: serde_json::Value = serde_json::from_slice(&payload).unwrap();
    assert_eq!(
        payload,
        serde_json::json!({"customer": "ada", "total_cents": 1})
    );
    assert_eq!(headers["ce-type"], serde_json::json!(["Placed"]));
    let recorded: i64 = outbox_inbox::table
        .filter(outbox_inbox::message_id.eq(&message_id))
        .count()
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(recorded, 1, "recorded, so a late copy is skipped");
    let messages = "outbox_inbox_messages_total{consumer=failing,outcome=";
    assert_eq!(counters.get(&format!("{messages}retry}}")), 2);
    assert_eq!(counters.get(&format!("{messages}dead_lettered}}")), 1);
    assert_eq!(counters.get(&format!("{messages}handled}}")), 0);
}

/// When one event was handled.
#[derive(Clone, Copy, Debug)]
struct Run {
    sequence: i64,
    started: Instant,
    ended: Instant,
}

/// Records when it handled each event, by key, and fails the first delivery of `o-0` #3.
#[derive(Clone, Default)]
struct Timing {
    handled: Arc<Mutex<Vec<(String, Run)>>>,
}

impl Handler for Timing {
    type Event = OrderEvent;
    type Error = String;

    async fn handle(
        &self,
        _event: OrderEvent,
        message: &Metadata,
        _uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        let key = message.partition_key.clone();
        let sequence = message.sequence;
        if key == "o-0" && sequence == 3 && message.deliveries == 1 {
            return Err("first delivery of o-0 #3 fails".to_owned());
        }
        let started = Instant::now();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let run = Run {
            sequence,
            started,
            ended: Instant::now(),
        };
        self.handled.lock().unwrap().push((key, run));
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_is_handled_in_stream_order_while_keys_run_in_parallel() {
    const KEYS: usize = 4;
    const PER_KEY: usize = 8;
    let producer = TestEnv::new().await;
    for round in 0..PER_KEY {
        for key in 0..KEYS {
            // One event per unit of work, so the keys interleave in the stream.
            let mut order = Order::place(&format!("o-{key}"), "ada", 1);
            if round > 0 {
                order = Order {
                    id: format!("o-{key}"),
                    status: "placed".into(),
                    pending_events: Default::default(),
                };
                order.record(OrderEvent::Shipped);
            }
            producer.commit(&mut order).await;
        }
    }
    relay_all(&producer).await;
    let consumer = consumer_database().await;
    let mut config = consumer_config(&consumer, &producer, "ordered");
    config.max_concurrency = 8;
    // A window smaller than the stream: keys wait on JetStream as well as on each other.
    config.max_ack_pending = 6;
    let handler = Timing::default();
    let inbox = Inbox::connect(config, producer.nats.clone(), handler.clone())
        .await
        .unwrap();
    let info = inbox.consumer().clone().info().await.unwrap().clone();
    assert_eq!(
        info.config.max_ack_pending, 6,
        "the window reaches JetStream"
    );
    let running = inbox.spawn();
    wait_until("every event handled", Duration::from_secs(20), || async {
        (handler.handled.lock().unwrap().len() == KEYS * PER_KEY).then_some(())
    })
    .await;
    running.shutdown().await.unwrap();

    let handled = handler.handled.lock().unwrap().clone();
    let mut by_key: BTreeMap<String, Vec<Run>> = BTreeMap::new();
    for (key, run) in &handled {
        by_key.entry(key.clone()).or_default().push(*run);
    }
    for (key, runs) in &by_key {
        let sequences: Vec<i64> = runs.iter().map(|r| r.sequence).collect();
        assert_eq!(
            sequences,
            (1..=PER_KEY as i64).collect::<Vec<_>>(),
            "key {key} in stream order, o-0 #3 failing once included"
        );
        for pair in runs.windows(2) {
            assert!(pair[0].ended <= pair[1].started, "key {key}: one at a time");
        }
    }
    // Different keys overlapped: some event started before another key's had ended.
    let overlapped = handled.iter().any(|(a_key, a)| {
        handled
            .iter()
            .any(|(b_key, b)| a_key != b_key && a.started < b.ended && b.started < a.ended)
    });
    assert!(overlapped, "keys ran in parallel");
}

/// Service B's event, recorded when it reserves stock for an order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
struct StockReserved {
    order_id: String,
}

/// Service B: reserves stock for each placed order and says so through its own outbox.
struct Reserving;

impl Handler for Reserving {
    type Event = OrderEvent;
    type Error = UnitOfWorkError;

    async fn handle(
        &self,
        event: OrderEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        if let OrderEvent::Placed { .. } = event {
            let order_id = message.aggregate_id.clone();
            bump(uow.conn(), &order_id).await?;
            uow.emit(
                "Stock",
                &order_id,
                &StockReserved {
                    order_id: order_id.clone(),
                },
            );
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correlation_causation_and_trace_flow_through_a_chain_of_two_services() {
    const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    // Service A commits an order in a traced request; its relay publishes it.
    let service_a = TestEnv::new().await;
    let mut conn = service_a.conn().await;
    let mut order = Order::place("o-7", "ada", 1);
    service_a
        .outbox()
        .transaction(&mut conn, async |uow| {
            uow.set_traceparent(TRACE.parse().unwrap());
            uow.track(&mut order);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
    relay_all(&service_a).await;
    let placed = service_a.stream_messages().await.remove(0);
    let placed_id = placed.header("ce-id");
    let correlation = placed.header("ce-correlationid");
    assert_eq!(placed.header("ce-causationid"), correlation, "a root");
    assert_eq!(placed.header("traceparent"), TRACE);

    // Service B consumes it and emits StockReserved through its own outbox and relay.
    let service_b = consumer_database().await;
    let inbox = Inbox::connect(
        consumer_config(&service_b, &service_a, "inventory"),
        service_a.nats.clone(),
        Reserving,
    )
    .await
    .unwrap()
    .spawn();
    wait_until("the order handled", Duration::from_secs(10), || async {
        (effects(&service_b).await.get("o-7") == Some(&1)).then_some(())
    })
    .await;
    inbox.shutdown().await.unwrap();
    relay_all(&service_b).await;

    let reserved = service_b.stream_messages().await.remove(0);
    assert_eq!(
        reserved.subject,
        format!("{}.Stock.o-7.StockReserved", service_b.prefix)
    );
    assert_eq!(reserved.header("ce-correlationid"), correlation);
    assert_eq!(reserved.header("ce-causationid"), placed_id);
    let trace: Traceparent = reserved.header("traceparent").parse().unwrap();
    let parent: Traceparent = TRACE.parse().unwrap();
    assert_eq!(trace.trace_id(), parent.trace_id(), "the same trace");
    assert_ne!(
        trace.parent_id(),
        parent.parent_id(),
        "continued by service B"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_types_are_skipped_unreadable_messages_dead_lettered_and_old_ids_purged() {
    let producer = TestEnv::new().await;
    relay_all(&producer).await; // creates the stream
    let js = producer.jetstream();
    let publish = async |subject: String, headers: HeaderMap, payload: &'static [u8]| {
        js.publish_with_headers(subject, headers, payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    };
    let headers = |pairs: &[(&'static str, &'static str)]| {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, *value);
        }
        headers
    };
    let p = &producer.prefix;
    publish(
        format!("{p}.Order.o-1.Refunded"),
        headers(&[("ce-id", "m-unknown"), ("ce-type", "Refunded")]),
        b"{}",
    )
    .await;
    publish(
        format!("{p}.Order.o-2.Placed"),
        headers(&[("ce-id", "m-no-type")]),
        b"{}",
    )
    .await;
    publish(
        format!("{p}.Order.o-3.Placed"),
        headers(&[("ce-id", "m-bad-json"), ("ce-type", "Placed")]),
        b"not json",
    )
    .await;
    // A version below 1 (the contract's versions start at 1): unreadable, not unknown.
    publish(
        format!("{p}.Order.o-4.Placed"),
        headers(&[
            ("ce-id", "m-version-0"),
            ("ce-type", "Placed"),
            ("ce-eventversion", "0"),
        ]),
        br#"{"customer":"ada","total_cents":1}"#,
    )
    .await;

    let consumer = consumer_database().await;
    let handler = Counting::default();
    let inbox = Inbox::connect(
        consumer_config(&consumer, &producer, "policies"),
        producer.nats.clone(),
        handler.clone(),
    )
    .await
    .unwrap();
    run_until_settled(inbox, "all four settled", Duration::from_secs(10)).await;

    assert_eq!(calls(&handler.calls), 0);
    let mut conn = consumer.conn().await;
    let letters: Vec<(String, String)> = outbox_inbox_dead_letters::table
        .select((
            outbox_inbox_dead_letters::message_id,
            outbox_inbox_dead_letters::error,
        ))
        .order(outbox_inbox_dead_letters::stream_sequence)
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(letters.len(), 3, "{letters:?}");
    assert_eq!(letters[0].0, "stream-sequence-2");
    assert!(
        letters[0].1.contains("has no ce-type header"),
        "{}",
        letters[0].1
    );
    assert_eq!(letters[1].0, "m-bad-json");
    assert!(letters[1].1.contains("expected ident"), "{}", letters[1].1);
    assert_eq!(
        letters[2].0, "stream-sequence-4",
        "unread: keyed by its place"
    );
    assert!(
        letters[2]
            .1
            .contains("header ce-eventversion is invalid: \"0\""),
        "{}",
        letters[2].1
    );

    // Retention: ids older than the cut are deleted, newer ones kept.
    conn.batch_execute(
        "INSERT INTO outbox_inbox (consumer, message_id, handled_at) VALUES \
         ('policies', 'old', now() - interval '2 hours'), ('policies', 'new', now())",
    )
    .await
    .unwrap();
    // Retention for ever (`Duration::MAX`) deletes nothing and fails nothing.
    let kept = outbox_runtime::inbox::purge(&mut conn, "policies", Duration::MAX, 10).await;
    assert_eq!(kept.unwrap(), 0);
    let purged = outbox_runtime::inbox::purge(&mut conn, "policies", Duration::from_secs(3600), 10)
        .await
        .unwrap();
    assert_eq!(purged, 1);
    let left: Vec<String> = outbox_inbox::table
        .filter(outbox_inbox::message_id.eq_any(["old", "new"]))
        .select(outbox_inbox::message_id)
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, ["new"]);
}

/// Keeps the metadata of every message it handles.
#[derive(Clone, Default)]
struct Keeping {
    seen: Arc<Mutex<Vec<Metadata>>>,
}

impl Handler for Keeping {
    type Event = OrderEvent;
    type Error = String;

    async fn handle(
        &self,
        _event: OrderEvent,
        message: &Metadata,
        _uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        self.seen.lock().unwrap().push(message.clone());
        Ok(())
    }
}

#[tokio::test]
async fn the_relays_messages_carry_their_aggregate_directly_and_a_foreign_one_gets_empty_values() {
    let producer = TestEnv::new().await;
    place(&producer, "o-1", 1).await;
    relay_all(&producer).await;
    let mut headers = HeaderMap::new();
    headers.insert("ce-id", "foreign-1");
    headers.insert("ce-type", "Shipped");
    producer
        .jetstream()
        .publish_with_headers(
            format!("{}.Order.x.Shipped", producer.prefix),
            headers,
            "{}".into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    let consumer = consumer_database().await;
    let handler = Keeping::default();
    let inbox = Inbox::connect(
        consumer_config(&consumer, &producer, "keeping"),
        producer.nats.clone(),
        handler.clone(),
    )
    .await
    .unwrap();
    run_until_settled(inbox, "three handled", Duration::from_secs(10)).await;

    let seen = handler.seen.lock().unwrap().clone();
    let mut places: Vec<(&str, &str, i64)> = seen
        .iter()
        .map(|m| {
            (
                m.aggregate_type.as_str(),
                m.aggregate_id.as_str(),
                m.sequence,
            )
        })
        .collect();
    places.sort(); // the foreign message's key runs beside the aggregate's
    assert_eq!(
        places,
        [("", "", 0), ("Order", "o-1", 1), ("Order", "o-1", 2)]
    );
}

/// The events of two aggregates (orders, and payments partitioned by merchant), one
/// consumer for both.
#[derive(Debug, outbox_runtime::EventSet)]
enum Commerce {
    Order(OrderEvent),
    Payment(support::domain::PaymentCaptured),
}

/// Records each event it applies under a key that names its member, variant and aggregate.
struct Dispatching;

impl Handler for Dispatching {
    type Event = Commerce;
    type Error = diesel::result::Error;

    async fn handle(
        &self,
        event: Commerce,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        let key = match event {
            Commerce::Order(OrderEvent::Placed { .. }) => {
                format!("placed:{}", message.aggregate_id)
            }
            Commerce::Order(OrderEvent::Shipped) => format!("shipped:{}", message.aggregate_id),
            Commerce::Order(OrderEvent::ItemAdded { .. }) => {
                format!("added:{}", message.aggregate_id)
            }
            Commerce::Payment(payment) => {
                format!("paid:{}:{}", payment.merchant, message.aggregate_id)
            }
        };
        bump(uow.conn(), &key).await?;
        Ok(())
    }
}

/// Commits orders `o-1` and `o-2` (Placed, Shipped), each with a payment of merchant `m-7`
/// (aggregate `pay-o-N`) in the same unit of work, and relays them.
async fn commit_orders_and_payments(producer: &TestEnv) {
    for id in ["o-1", "o-2"] {
        let mut order = Order::place(id, "ada", 10);
        order.record(OrderEvent::Shipped);
        producer
            .outbox()
            .transaction(&mut producer.conn().await, async |uow| {
                uow.track(&mut order);
                uow.emit(
                    "Payment",
                    &format!("pay-{id}"),
                    &support::domain::PaymentCaptured {
                        merchant: "m-7".to_owned(),
                        amount_cents: 10,
                    },
                );
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap();
    }
    relay_all(producer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_durable_consumer_dispatches_the_events_of_two_aggregates_each_once() {
    let producer = TestEnv::new().await;
    commit_orders_and_payments(&producer).await;

    let consumer = consumer_database().await;
    let config = consumer_config(&consumer, &producer, "commerce");
    assert!(
        config.filter_subjects.is_empty(),
        "all of the producer's subjects"
    );
    let inbox = Inbox::connect(config, producer.nats.clone(), Dispatching)
        .await
        .unwrap();
    run_until_settled(inbox, "both aggregates' events", Duration::from_secs(20)).await;

    let expected: BTreeMap<String, i64> = [
        "placed:o-1",
        "shipped:o-1",
        "paid:m-7:pay-o-1",
        "placed:o-2",
        "shipped:o-2",
        "paid:m-7:pay-o-2",
    ]
    .into_iter()
    .map(|key| (key.to_owned(), 1))
    .collect();
    assert_eq!(effects(&consumer).await, expected);
    let consumers: Vec<String> = producer
        .jetstream()
        .get_stream(&producer.stream)
        .await
        .unwrap()
        .consumer_names()
        .map(|name| name.unwrap())
        .collect()
        .await;
    assert_eq!(consumers, ["commerce"], "one durable consumer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_filter_subjects_make_one_consumer_on_a_current_server_and_are_refused_by_2_9() {
    let producer = TestEnv::new().await;
    commit_orders_and_payments(&producer).await;

    let consumer = consumer_database().await;
    let mut config = consumer_config(&consumer, &producer, "placed-and-paid");
    config.filter_subjects = vec![
        format!("{}.Order.*.Placed", producer.prefix),
        format!("{}.Payment.>", producer.prefix),
    ];
    let version = producer.nats.server_info().version;
    let current = outbox_runtime::nats::server_at_least(&version, 2, 10);
    let connected = Inbox::connect(config, producer.nats.clone(), Dispatching).await;
    if !current {
        let error = connected
            .err()
            .expect("2.9 takes one filter subject")
            .to_string();
        assert!(
            error.contains("2.10") && error.contains(&version),
            "{error}"
        );
        return;
    }
    run_until_settled(
        connected.unwrap(),
        "placed orders and payments",
        Duration::from_secs(20),
    )
    .await;
    let expected: BTreeMap<String, i64> = [
        "placed:o-1",
        "paid:m-7:pay-o-1",
        "placed:o-2",
        "paid:m-7:pay-o-2",
    ]
    .into_iter()
    .map(|key| (key.to_owned(), 1))
    .collect();
    assert_eq!(
        effects(&consumer).await,
        expected,
        "no Shipped: it is filtered out"
    );
    let info = producer
        .jetstream()
        .get_stream(&producer.stream)
        .await
        .unwrap()
        .get_consumer::<async_nats::jetstream::consumer::pull::Config>("placed-and-paid")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    assert_eq!(info.filter_subjects.len(), 2, "{info:?}");
}

/// Each running instance sets the consumer's backlog gauges from JetStream's own figures
/// (`num_pending`, `num_ack_pending`): above zero while messages wait, zero once every
/// message is settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_inbox_reports_its_consumers_backlog_in_gauges() {
    let counters = Counters::installed();
    let producer = TestEnv::new().await;
    for n in 0..20 {
        place(&producer, &format!("o-{n}"), 0).await;
    }
    relay_all(&producer).await;
    let consumer = support::consumer::consumer_database().await;
    let mut config = consumer_config(&consumer, &producer, "backlog");
    config.max_concurrency = 1;
    let handler = support::consumer::Recording {
        delay: Duration::from_millis(150),
    };
    let inbox = Inbox::connect(config, producer.nats.clone(), handler)
        .await
        .unwrap();
    let probe = inbox.clone();
    let running = inbox.spawn();
    let (pending, ack_pending) = (
        "outbox_inbox_pending{consumer=backlog}",
        "outbox_inbox_ack_pending{consumer=backlog}",
    );
    let waiting = wait_until("a backlog reported", Duration::from_secs(10), || async {
        counters.gauge(pending).filter(|waiting| *waiting > 0.0)
    })
    .await;
    assert!(waiting <= 20.0, "{waiting} undelivered of 20");
    wait_until_settled(&probe, "every message settled", Duration::from_secs(30)).await;
    wait_until(
        "the backlog reported empty",
        Duration::from_secs(5),
        || async {
            (counters.gauge(pending) == Some(0.0) && counters.gauge(ack_pending) == Some(0.0))
                .then_some(())
        },
    )
    .await;
    running.shutdown().await.unwrap();
}
