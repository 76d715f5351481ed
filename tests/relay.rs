//! The relay against the real PostgreSQL and NATS JetStream: what a committed unit of work
//! becomes on the stream, header for header.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_runtime::outbox::schema::outbox_events;
use outbox_runtime::{Relay, RelayError, StreamError, UnitOfWorkError};
use support::counters::Counters;
use support::domain::{Order, OrderEvent, PaymentCaptured};
use support::{Received, TestEnv};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

type Row = (
    uuid::Uuid,
    String,
    String,
    i64,
    String,
    i32,
    String,
    String,
    serde_json::Value,
    OffsetDateTime,
);

async fn rows(conn: &mut AsyncPgConnection) -> Vec<Row> {
    outbox_events::table
        .select((
            outbox_events::id,
            outbox_events::aggregate_type,
            outbox_events::aggregate_id,
            outbox_events::aggregate_seq,
            outbox_events::event_type,
            outbox_events::event_version,
            outbox_events::partition_key,
            outbox_events::subject,
            outbox_events::payload,
            outbox_events::occurred_at,
        ))
        .order(outbox_events::id)
        .load(conn)
        .await
        .unwrap()
}

fn header_names(message: &Received) -> BTreeSet<String> {
    message
        .headers
        .iter()
        .map(|(name, _)| name.to_string())
        .collect()
}

const CONTRACT_HEADERS: [&str; 15] = [
    "Nats-Msg-Id",
    "ce-specversion",
    "ce-id",
    "ce-source",
    "ce-type",
    "ce-time",
    "ce-subject",
    "ce-aggregatetype",
    "ce-sequence",
    "ce-partitionkey",
    "ce-eventversion",
    "ce-correlationid",
    "ce-causationid",
    "ce-datacontenttype",
    "content-type",
];

#[tokio::test]
async fn a_committed_unit_of_work_becomes_exactly_the_expected_messages() {
    let env = TestEnv::new().await;
    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    let mut conn = env.conn().await;
    let mut first = Order::place("o-1", "ada", 4200);
    first.record(OrderEvent::ItemAdded {
        sku: "tea".into(),
        quantity: 2,
    });
    let mut second = Order::place("o-2", "grace", 100);
    env.outbox()
        .transaction(&mut conn, async |uow| {
            uow.track(&mut first);
            uow.track(&mut second);
            let payment = PaymentCaptured {
                merchant: "acme".into(),
                amount_cents: 4300,
            };
            uow.emit("Payment", "pay-1", &payment);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();

    let rows = rows(&mut conn).await;
    let report = relay.relay_batch().await.unwrap();
    assert_eq!((report.claimed, report.published), (4, 4), "{report:?}");

    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), rows.len(), "one message per row, no more");
    let by_id: BTreeMap<String, &Received> = messages
        .iter()
        .map(|m| (m.header("Nats-Msg-Id"), m))
        .collect();
    assert_eq!(by_id.len(), 4, "every message has its own id");

    let expected_names: BTreeSet<String> = CONTRACT_HEADERS.iter().map(|h| h.to_string()).collect();
    for (id, agg_type, agg_id, seq, event_type, version, key, subject, payload, occurred) in &rows {
        let message = by_id[&id.hyphenated().to_string()];
        assert_eq!(message.subject.as_str(), subject);
        assert_eq!(
            header_names(message),
            expected_names,
            "no header more or less"
        );
        for (name, values) in message.headers.iter() {
            assert_eq!(values.len(), 1, "one value of {name}: {values:?}");
        }
        assert_eq!(message.header("ce-specversion"), "1.0");
        assert_eq!(message.header("ce-id"), id.hyphenated().to_string());
        assert_eq!(message.header("ce-source"), "/tests");
        assert_eq!(&message.header("ce-type"), event_type);
        assert_eq!(&message.header("ce-subject"), agg_id);
        assert_eq!(&message.header("ce-aggregatetype"), agg_type);
        assert_eq!(message.header("ce-sequence"), format!("{seq:019}"));
        assert_eq!(&message.header("ce-partitionkey"), key);
        assert_eq!(message.header("ce-eventversion"), version.to_string());
        assert_eq!(message.header("ce-datacontenttype"), "application/json");
        assert_eq!(message.header("content-type"), "application/json");
        let time = OffsetDateTime::parse(&message.header("ce-time"), &Rfc3339).unwrap();
        assert_eq!(time, *occurred);
        assert!(message.header("ce-time").ends_with('Z'), "UTC");
        let sent: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(&sent, payload);
    }
    // One unit of work, one conversation: its events share a fresh correlation id, which is
    // also their cause.
    let correlations: BTreeSet<String> = messages
        .iter()
        .map(|m| m.header("ce-correlationid"))
        .collect();
    assert_eq!(correlations.len(), 1, "{correlations:?}");
    for message in &messages {
        assert_eq!(
            message.header("ce-causationid"),
            message.header("ce-correlationid")
        );
        assert!(!by_id.contains_key(&message.header("ce-correlationid")));
    }

    let subjects: Vec<&str> = messages.iter().map(|m| m.subject.as_str()).collect();
    let p = &env.prefix;
    let placed = format!("{p}.Order.o-1.Placed");
    let added = format!("{p}.Order.o-1.LineAdded");
    let position = |s: &str| subjects.iter().position(|x| *x == s).unwrap();
    assert!(
        position(&placed) < position(&added),
        "o-1 in sequence order"
    );
    assert!(subjects.contains(&format!("{p}.Payment.acme.PaymentCaptured").as_str()));

    // Every published row is gone (the default deletes them): the next batch finds nothing
    // and publishes nothing.
    assert_eq!(relay.relay_batch().await.unwrap().claimed, 0);
    assert_eq!(env.stream_messages().await.len(), 4);
    let left: i64 = outbox_events::table
        .count()
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, 0);

    // The payload decodes back into the event type it came from.
    let added_message = messages
        .iter()
        .find(|m| m.subject.as_str() == added)
        .unwrap();
    use outbox_runtime::DomainEvent as _;
    let decoded = OrderEvent::from_payload(
        &added_message.header("ce-type"),
        added_message.header("ce-eventversion").parse().unwrap(),
        &added_message.payload,
    )
    .unwrap();
    assert_eq!(
        decoded,
        OrderEvent::ItemAdded {
            sku: "tea".into(),
            quantity: 2
        }
    );
}

#[tokio::test]
async fn a_row_inserted_by_plain_sql_is_relayed_with_its_headers() {
    let env = TestEnv::new().await;
    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    let mut conn = env.conn().await;
    let subject = format!("{}.Invoice.inv-7.Issued", env.prefix);
    conn.batch_execute(&format!(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                    partition_key, subject, payload, headers) \
         VALUES ('Invoice', 'inv-7', 5, 'Issued', 'inv-7', '{subject}', \
                 '{{\"amount_cents\": 990}}', \
                 '{{\"traceparent\": \"00-4bf92f3577b34da6-00f067aa0ba902b7-01\", \"x-tenant\": [\"eu\", \"b2b\"], \
                    \"ce-source\": \"/forged\", \"content-type\": \"text/plain\", \
                    \"CE-Sequence\": \"0000000000000000999\", \"Ce-Id\": \"forged\"}}')"
    ))
    .await
    .unwrap();

    assert_eq!(relay.relay_batch().await.unwrap().published, 1);

    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), 1);
    let message = &messages[0];
    assert_eq!(message.subject.as_str(), subject);
    assert_eq!(message.header("ce-type"), "Issued");
    assert_eq!(message.header("ce-sequence"), "0000000000000000005");
    assert_eq!(message.header("ce-eventversion"), "1");
    let id = message.header("ce-id");
    assert_eq!(
        message.header("ce-correlationid"),
        id,
        "its own conversation"
    );
    assert_eq!(message.header("ce-causationid"), id);
    // The relay's own headers win over a row's headers of the same name, whatever its case:
    // a reader comparing names without case sees one value of each, the relay's.
    for contract in CONTRACT_HEADERS {
        let values: Vec<&str> = message
            .headers
            .iter()
            .filter(|(name, _)| name.to_string().eq_ignore_ascii_case(contract))
            .flat_map(|(_, values)| values.iter().map(|v| v.as_str()))
            .collect();
        assert_eq!(values.len(), 1, "{contract}: {values:?}");
    }
    assert_eq!(message.header("ce-source"), "/tests");
    assert_eq!(message.header("content-type"), "application/json");
    assert_eq!(message.header("ce-specversion"), "1.0");
    assert_eq!(
        message.header("traceparent"),
        "00-4bf92f3577b34da6-00f067aa0ba902b7-01"
    );
    let tenants: Vec<&str> = message
        .headers
        .get_all("x-tenant")
        .map(|v| v.as_str())
        .collect();
    assert_eq!(tenants, ["eu", "b2b"]);
    let payload: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
    assert_eq!(payload, serde_json::json!({"amount_cents": 990}));
}

#[tokio::test]
async fn the_relay_refuses_a_missing_stream_it_may_not_create_and_a_stream_that_misses_the_prefix()
{
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.topology.stream.create = false;
    let error = Relay::connect(config, env.nats.clone())
        .await
        .err()
        .unwrap();
    assert!(
        matches!(&error, RelayError::Stream(StreamError::Missing { stream, .. }) if *stream == env.stream),
        "{error:?}"
    );
    assert!(error.to_string().contains("does not exist"), "{error}");

    env.jetstream()
        .create_stream(async_nats::jetstream::stream::Config {
            name: env.stream.clone(),
            subjects: vec![format!("{}.Order.>", env.prefix)],
            ..Default::default()
        })
        .await
        .unwrap();
    let error = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .err()
        .unwrap();
    assert!(
        matches!(
            &error,
            RelayError::Stream(StreamError::DoesNotCapture { .. })
        ),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .contains(&format!("does not cover \"{}.>\"", env.prefix)),
        "{error}"
    );
}

#[tokio::test]
async fn a_row_whose_subject_lies_outside_the_prefix_is_dead_lettered_at_once_while_others_flow() {
    let env = TestEnv::new().await;
    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    let mut conn = env.conn().await;
    // A subject outside the relay's prefix: another stream's, or nobody's.
    conn.batch_execute(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                    partition_key, subject, payload) \
         VALUES ('Stray', 's-1', 1, 'Lost', 's-1', 'nowhere.Stray.s-1.Lost', '{}')",
    )
    .await
    .unwrap();
    let mut order = Order::place("o-1", "ada", 1);
    env.commit(&mut order).await;

    let report = relay.relay_batch().await.unwrap();
    assert_eq!(
        (report.published, report.rejected, report.dead_lettered),
        (1, 1, 1),
        "{report:?}"
    );
    let (attempts, last_error): (i32, Option<String>) = outbox_events::table
        .filter(outbox_events::aggregate_id.eq("s-1"))
        .select((outbox_events::attempts, outbox_events::last_error))
        .first(&mut conn)
        .await
        .unwrap();
    assert_eq!(attempts, 1);
    assert!(
        last_error
            .as_deref()
            .is_some_and(|e| e.contains("does not start with the relay's prefix")),
        "{last_error:?}"
    );
    assert_eq!(
        env.stream_messages().await.len(),
        1,
        "the order's event went through"
    );
}

/// Commits the events `orders` recorded in one unit of work.
async fn commit_orders(
    outbox: &outbox_runtime::Outbox,
    conn: &mut AsyncPgConnection,
    orders: &mut [Order],
) {
    outbox
        .transaction(conn, async |uow| {
            for order in orders.iter_mut() {
                uow.track(order);
            }
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn a_spawned_relay_publishes_each_aggregate_in_order_across_small_batches() {
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.batch_size = 3;
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut conn = env.conn().await;
    let outbox = env.outbox();
    for round in 0..4 {
        let mut orders: Vec<Order> = (0..3)
            .map(|n| Order::place(&format!("o-{n}"), "ada", round))
            .collect();
        for order in &mut orders {
            order.record(OrderEvent::Shipped);
        }
        commit_orders(&outbox, &mut conn, &mut orders).await;
    }

    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let messages = loop {
        let messages = env.stream_messages().await;
        if messages.len() >= 24 || tokio::time::Instant::now() > deadline {
            break messages;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    relay.shutdown().await.unwrap();

    assert_eq!(messages.len(), 24);
    let mut sequences: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for message in &messages {
        sequences
            .entry(message.header("ce-subject"))
            .or_default()
            .push(message.header("ce-sequence").parse().unwrap());
    }
    for (aggregate, seqs) in &sequences {
        assert_eq!(*seqs, (1..=8).collect::<Vec<_>>(), "aggregate {aggregate}");
    }
}

/// A relay's workers claim in turn: a claim knows what its peer holds and takes other
/// aggregates, so no claim comes back empty while aggregates wait that no worker holds.
/// (Side by side, a worker woken by its peer's batch claimed at the moment the peer claimed
/// again, read the same window and found its heads locked: this test saw 2 to 4 empty claims
/// before the 30th claim that found rows, in 4 runs of 4.)
#[tokio::test]
async fn a_relays_workers_claim_in_turn_and_do_not_come_back_empty_while_rows_wait() {
    const ORDERS: usize = 300;
    const EVENTS: usize = ORDERS * 5;
    // A claim's window of 50 rows holds 10 aggregates' 5 events each: 30 claims take all.
    const BATCH: usize = 50;
    const CLAIMS: u64 = (EVENTS / BATCH) as u64;
    let counters = Counters::installed();
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let mut orders: Vec<Order> = (0..ORDERS)
        .map(|n| Order::place(&format!("o-{n}"), "ada", 1))
        .collect();
    for order in &mut orders {
        for _ in 0..4 {
            order.record(OrderEvent::Shipped);
        }
    }
    commit_orders(&env.outbox(), &mut conn, &mut orders).await;

    let mut config = env.relay_config();
    config.workers = 2;
    config.batch_size = BATCH;
    // No polls: every claim is a worker's own or a wake-up's.
    config.poll_interval = std::time::Duration::from_secs(60);
    let stream = config.topology.stream.name.clone();
    let key = |found: &str| Counters::claims_key(&stream, found);
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    // Until the last claim that finds rows, every claim finds some: aggregates no worker
    // holds are left. (After it, the workers' last claims find nothing, as they should.)
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let (mut seen, mut empty) = (0, 0);
    while tokio::time::Instant::now() < deadline {
        let all = counters.all();
        let count = |found| all.get(&key(found)).copied().unwrap_or(0);
        if count("rows") >= CLAIMS {
            break;
        }
        (seen, empty) = (count("rows"), count("nothing"));
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let published = loop {
        let published = env.stream_messages().await.len();
        if published >= EVENTS || tokio::time::Instant::now() > deadline {
            break published;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    relay.shutdown().await.unwrap();
    assert_eq!(published, EVENTS);
    assert_eq!(counters.get(&key("rows")), CLAIMS);
    assert!(
        seen >= CLAIMS - 5,
        "the drain was watched up to claim {seen} only"
    );
    assert_eq!(
        empty, 0,
        "{empty} claims found nothing while aggregates waited that no worker held (watched up to \
         the {seen}th claim that found rows)"
    );
}

/// An idle relay polls once per poll interval, not once per worker: its workers' polls are
/// the relay's, a claim by any of them counts, and one that finds rows wakes the others.
/// (Each worker polling on its own, this relay of 4 workers claimed about 4 times per
/// interval.) A row committed without a notification is still claimed within the interval.
#[tokio::test]
async fn an_idle_relay_polls_once_per_interval_whatever_its_workers() {
    const WORKERS: usize = 4;
    const INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);
    const WATCHED: std::time::Duration = std::time::Duration::from_secs(2);
    let counters = Counters::installed();
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.workers = WORKERS;
    config.poll_interval = INTERVAL;
    // Polling only: no claim after arming a doorbell, no notification.
    config.listen = false;
    let key = Counters::claims_key(&config.topology.stream.name, "nothing");
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    // Past the workers' first claims.
    tokio::time::sleep(3 * INTERVAL).await;
    let before = counters.get(&key);
    tokio::time::sleep(WATCHED).await;
    let polls = counters.get(&key) - before;
    let intervals = (WATCHED.as_millis() / INTERVAL.as_millis()) as u64;
    assert!(
        polls <= intervals + 2,
        "{polls} empty claims in {intervals} poll intervals by an idle relay of {WORKERS} workers"
    );
    assert!(
        polls >= intervals / 2,
        "the idle relay polled {polls} times in {intervals} poll intervals"
    );

    let mut conn = env.conn().await;
    let started = std::time::Instant::now();
    support::insert_raw(
        &mut conn,
        "polled",
        &format!("{}.Raw.polled.Written", env.prefix),
    )
    .await;
    env.until_stream_holds(1, std::time::Duration::from_secs(5))
        .await;
    let waited = started.elapsed();
    relay.shutdown().await.unwrap();
    println!("{polls} empty claims in {intervals} poll intervals; a row waited {waited:?}");
    assert!(
        waited < 10 * INTERVAL,
        "a row committed without a notification waited {waited:?} for a relay polling every \
         {INTERVAL:?}"
    );
}

#[tokio::test]
async fn in_mark_mode_published_rows_stay_with_their_time_and_are_not_claimed_again() {
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.published = outbox_runtime::PublishedRows::Mark;
    let mut relay = Relay::connect(config, env.nats.clone()).await.unwrap();
    let mut conn = env.conn().await;
    let mut order = Order::place("o-1", "ada", 1);
    order.record(OrderEvent::Shipped);
    env.commit(&mut order).await;

    assert_eq!(relay.relay_batch().await.unwrap().published, 2);
    let published: Vec<Option<OffsetDateTime>> = outbox_events::table
        .select(outbox_events::published_at)
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(published.len(), 2, "the rows stay");
    assert!(published.iter().all(Option::is_some), "{published:?}");
    assert_eq!(relay.relay_batch().await.unwrap().claimed, 0);
    assert_eq!(env.stream_messages().await.len(), 2);

    let stats = outbox_runtime::outbox::stats(&mut conn).await.unwrap();
    assert_eq!((stats.queued, stats.dead_letters), (0, 0));
    let purged =
        outbox_runtime::outbox::purge_published(&mut conn, std::time::Duration::ZERO, 100, |_| {})
            .await
            .unwrap();
    assert_eq!(purged, 2);
}

/// An event whose JSON PostgreSQL's `jsonb` would rewrite: keys out of its order (shorter
/// keys first), no spaces, a duplicate-free object with an escaped character.
#[derive(serde::Serialize, serde::Deserialize, outbox_runtime::DomainEvent)]
#[event(name = "Signed")]
struct Signed {
    zeta_long_key: u32,
    a: String,
}

#[tokio::test]
async fn a_message_carries_the_payload_bytes_the_producer_wrote() {
    let env = TestEnv::new().await;
    let event = Signed {
        zeta_long_key: 7,
        a: "tab\there, \u{e9}".to_owned(),
    };
    let written = serde_json::to_vec(&event).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&written),
        r#"{"zeta_long_key":7,"a":"tab\there, é"}"#
    );
    env.outbox()
        .transaction(&mut env.conn().await, async |uow| {
            uow.emit("Document", "d-1", &event);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    assert_eq!(relay.relay_batch().await.unwrap().published, 1);
    let messages = env.stream_messages().await;
    assert_eq!(
        String::from_utf8_lossy(&messages[0].payload),
        String::from_utf8_lossy(&written),
        "the payload as serde wrote it, byte for byte"
    );
}

/// A relay of `env` that treats published rows as `mode` says, with what its connections
/// send.
async fn instrumented_relay(
    env: &TestEnv,
    mode: outbox_runtime::PublishedRows,
) -> (Relay, support::SentStatements) {
    let sent = support::SentStatements::default();
    let mut config = env.relay_config();
    config.published = mode;
    let (url, instrumentation) = (env.database_url.clone(), sent.clone());
    config.connector = Some(outbox_runtime::Connector::new(move || {
        let (url, instrumentation) = (url.clone(), instrumentation.clone());
        async move {
            let mut conn = AsyncPgConnection::establish(&url).await?;
            conn.set_instrumentation(instrumentation);
            Ok::<_, diesel::ConnectionError>(conn)
        }
    }));
    let relay = Relay::connect(config, env.nats.clone()).await.unwrap();
    (relay, sent)
}

/// What each statement a relay's connection sent was, in a batch's terms.
fn batch_shapes(sent: &support::SentStatements) -> Vec<String> {
    sent.take_shapes()
        .into_iter()
        .map(|sql| {
            let shape = if sql.starts_with("WITH oldest AS") {
                "the claim"
            } else if sql.ends_with("); COMMIT") {
                if sql.starts_with("DELETE FROM outbox_events WHERE id = ANY(E'{") {
                    "the delete with COMMIT"
                } else if sql.starts_with("UPDATE outbox_events SET published_at = now()") {
                    "the mark with COMMIT"
                } else if sql.starts_with("SELECT outbox_archive_published(E'{") {
                    "the archive with COMMIT"
                } else {
                    return sql;
                }
            } else {
                return sql;
            };
            shape.to_owned()
        })
        .collect()
}

#[tokio::test]
async fn a_relay_batch_records_its_published_rows_in_the_commits_round_trip() {
    use outbox_runtime::PublishedRows;
    for (n, (mode, end)) in [
        (PublishedRows::Delete, "the delete with COMMIT"),
        (PublishedRows::Mark, "the mark with COMMIT"),
        (PublishedRows::Archive, "the archive with COMMIT"),
    ]
    .into_iter()
    .enumerate()
    {
        let env = TestEnv::new().await;
        let (mut relay, sent) = instrumented_relay(&env, mode).await;
        // Nothing to publish: the batch ends with a plain COMMIT.
        assert_eq!(relay.relay_batch().await.unwrap().claimed, 0);
        let shapes = batch_shapes(&sent);
        assert_eq!(
            shapes[shapes.len() - 3..],
            ["BEGIN", "the claim", "COMMIT"],
            "{mode:?}: {shapes:?}"
        );

        let mut order = Order::place(&format!("o-{n}"), "ada", 1);
        order.record(OrderEvent::Shipped);
        env.commit(&mut order).await;
        env.commit(&mut Order::place(&format!("p-{n}"), "grace", 2))
            .await;
        assert_eq!(relay.relay_batch().await.unwrap().published, 3);
        assert_eq!(
            batch_shapes(&sent),
            ["BEGIN", "the claim", end],
            "{mode:?}: one round trip records the rows and commits"
        );
        // What the statement did holds: no row is queued, none is claimed again.
        let mut conn = env.conn().await;
        let stats = outbox_runtime::outbox::stats(&mut conn).await.unwrap();
        assert_eq!(stats.queued, 0, "{mode:?}");
        assert_eq!(relay.relay_batch().await.unwrap().claimed, 0, "{mode:?}");
        let kept: i64 = outbox_events::table
            .count()
            .get_result(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            kept,
            if mode == PublishedRows::Mark { 3 } else { 0 },
            "{mode:?}"
        );
        assert_eq!(env.stream_messages().await.len(), 3, "{mode:?}");
    }
}

#[tokio::test]
async fn a_relay_batch_of_more_than_64_rows_binds_their_ids_and_commits_apart() {
    let env = TestEnv::new().await;
    let (mut relay, sent) = instrumented_relay(&env, outbox_runtime::PublishedRows::Delete).await;
    assert_eq!(relay.relay_batch().await.unwrap().claimed, 0);
    sent.take_shapes();
    let mut order = Order::place("o-1", "ada", 1);
    for _ in 0..64 {
        order.record(OrderEvent::Shipped);
    }
    env.commit(&mut order).await;
    assert_eq!(relay.relay_batch().await.unwrap().published, 65);
    let shapes = batch_shapes(&sent);
    assert_eq!(shapes.len(), 4, "{shapes:?}");
    assert_eq!(shapes[..2], ["BEGIN", "the claim"]);
    assert!(
        shapes[2].starts_with("DELETE FROM outbox_events WHERE id = ANY($1)"),
        "{shapes:?}"
    );
    assert_eq!(shapes[3], "COMMIT");
    let mut conn = env.conn().await;
    assert_eq!(
        outbox_runtime::outbox::stats(&mut conn)
            .await
            .unwrap()
            .queued,
        0
    );
}

#[tokio::test]
async fn a_relay_batch_whose_delete_fails_commits_nothing_and_the_rows_are_published_again() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    conn.batch_execute(
        "CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'deletes refused'; END $$; \
         CREATE TRIGGER refuse_delete BEFORE DELETE ON outbox_events \
         FOR EACH ROW EXECUTE FUNCTION refuse_delete()",
    )
    .await
    .unwrap();
    let mut order = Order::place("o-1", "ada", 1);
    order.record(OrderEvent::Shipped);
    env.commit(&mut order).await;
    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    let error = relay.relay_batch().await.unwrap_err().to_string();
    assert!(error.contains("deletes refused"), "{error}");
    // Published, but the COMMIT after the failed delete did not run: the rows stay queued.
    assert_eq!(env.stream_messages().await.len(), 2);
    let stats = outbox_runtime::outbox::stats(&mut conn).await.unwrap();
    assert_eq!(stats.queued, 2);

    conn.batch_execute("DROP TRIGGER refuse_delete ON outbox_events")
        .await
        .unwrap();
    let report = relay.relay_batch().await.unwrap();
    assert_eq!((report.published, report.duplicates), (2, 2), "{report:?}");
    let stats = outbox_runtime::outbox::stats(&mut conn).await.unwrap();
    assert_eq!(stats.queued, 0);
    assert_eq!(
        env.stream_messages().await.len(),
        2,
        "JetStream dropped the duplicates"
    );
}

/// A claim of up to 10 rows on `conn`: in a transaction marked as a relay batch's
/// (`Some(true)`), in one that is not (`Some(false)`), or alone (`None`).
async fn claim_in(conn: &mut AsyncPgConnection, mark: Option<bool>) -> QueryResult<usize> {
    let Some(marked) = mark else {
        return outbox_runtime::__private::claim_probe(conn, 10).await;
    };
    conn.transaction(async |conn| {
        if marked {
            conn.batch_execute("SET LOCAL outbox.relay_batch = 'on'")
                .await?;
        }
        outbox_runtime::__private::claim_probe(conn, 10).await
    })
    .await
}

#[tokio::test]
async fn the_claim_refuses_to_run_outside_a_relay_batchs_transaction() {
    let env = TestEnv::new().await;
    env.commit(&mut Order::place("o-1", "ada", 1)).await;
    let mut conn = env.conn().await;
    // Alone, its locks would end with the statement; in a transaction not marked as a relay
    // batch's, the same: it fails and claims nothing. In a marked one it claims, and the
    // mark ends with its transaction.
    for (mark, claims) in [
        (None, false),
        (Some(false), false),
        (Some(true), true),
        (None, false),
    ] {
        match claim_in(&mut conn, mark).await {
            Ok(claimed) => assert!(claims && claimed == 1, "{mark:?}: {claimed}"),
            Err(error) => assert!(
                !claims
                    && error
                        .to_string()
                        .contains("outbox.claim_outside_its_relay_batch"),
                "{mark:?}: {error}"
            ),
        }
    }
}

#[tokio::test]
async fn a_relay_batch_commits_without_waiting_for_its_wal_flush_and_a_unit_of_work_waits() {
    use outbox_runtime::PublishedRows;
    for (n, mode) in [
        PublishedRows::Delete,
        PublishedRows::Mark,
        PublishedRows::Archive,
    ]
    .into_iter()
    .enumerate()
    {
        let env = TestEnv::new().await;
        let mut conn = env.conn().await;
        // Each change to a queued row, with the durability its transaction commits with.
        conn.batch_execute(
            "CREATE TABLE commit_modes (op text NOT NULL, synchronous_commit text NOT NULL); \
             CREATE FUNCTION record_commit_mode() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN INSERT INTO commit_modes VALUES (TG_OP, current_setting('synchronous_commit')); \
             RETURN NULL; END $$; \
             CREATE TRIGGER record_commit_mode AFTER INSERT OR UPDATE OR DELETE ON outbox_events \
             FOR EACH ROW EXECUTE FUNCTION record_commit_mode()",
        )
        .await
        .unwrap();
        let mut order = Order::place(&format!("o-{n}"), "ada", 1);
        order.record(OrderEvent::Shipped);
        env.commit(&mut order).await;
        let mut config = env.relay_config();
        config.published = mode;
        let mut relay = Relay::connect(config, env.nats.clone()).await.unwrap();
        assert_eq!(relay.relay_batch().await.unwrap().published, 2, "{mode:?}");
        // A batch of more than 64 rows records them apart from its COMMIT.
        for _ in 0..65 {
            order.record(OrderEvent::Shipped);
        }
        env.commit(&mut order).await;
        assert_eq!(relay.relay_batch().await.unwrap().published, 65, "{mode:?}");

        let seen: Vec<(String, String)> = diesel::sql_query(
            "SELECT op, synchronous_commit FROM commit_modes GROUP BY 1, 2 ORDER BY 1, 2",
        )
        .load::<OpMode>(&mut conn)
        .await
        .unwrap()
        .into_iter()
        .map(|row| (row.op, row.synchronous_commit))
        .collect();
        let relay_op = if mode == PublishedRows::Mark {
            "UPDATE"
        } else {
            "DELETE"
        };
        let mut expected = [(relay_op, "off"), ("INSERT", "on")];
        expected.sort();
        assert_eq!(
            seen,
            expected.map(|(op, setting)| (op.to_owned(), setting.to_owned())),
            "{mode:?}: the relay's batches commit asynchronously, the units of work durably"
        );
        let stats = outbox_runtime::outbox::stats(&mut conn).await.unwrap();
        assert_eq!(stats.queued, 0, "{mode:?}");
    }
}

#[derive(QueryableByName)]
struct OpMode {
    #[diesel(sql_type = diesel::sql_types::Text)]
    op: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    synchronous_commit: String,
}
