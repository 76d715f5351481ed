//! What the consumer tests share: a consumer's database with a record of what its handler
//! applied, in the order it applied it, and the steps that bring a producer's events to it.

use std::collections::BTreeMap;
use std::time::Duration;

use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_runtime::{
    Handler, Inbox, InboxConfig, InboxConnection, InboxHandle, Metadata, Relay, UnitOfWork,
};

use super::domain::{Order, OrderEvent};
use super::{TestEnv, wait_until};

/// A consumer's database: its own test database, with the table `applied` where
/// [`Recording`] writes each event it applies, numbered in commit order per aggregate (the
/// inbox applies one aggregate's events one transaction after another).
pub async fn consumer_database() -> TestEnv {
    let env = TestEnv::new().await;
    env.conn()
        .await
        .batch_execute(
            "CREATE TABLE applied (n bigserial PRIMARY KEY, aggregate text NOT NULL, \
             seq bigint NOT NULL, message_id text NOT NULL, deliveries bigint NOT NULL)",
        )
        .await
        .unwrap();
    env
}

/// The configuration of a consumer `name` of `producer`'s stream, on `consumer`'s database:
/// fast redeliveries, for tests.
pub fn consumer_config(consumer: &TestEnv, producer: &TestEnv, name: &str) -> InboxConfig {
    let mut config = InboxConfig::new(name, &consumer.database_url);
    config.outbox = consumer.outbox();
    config.topology = producer.topology();
    config.ack_wait = Duration::from_secs(1);
    config.retry_delay = Duration::from_millis(50);
    config.max_retry_delay = Duration::from_millis(200);
    config
}

/// Relays everything the producer committed so far.
pub async fn relay_all(producer: &TestEnv) {
    drain(producer.relay_config(), producer).await;
}

/// Relays everything the producer committed so far in Archive mode: each published row is
/// moved to `outbox_published`.
pub async fn archive_all(producer: &TestEnv) {
    let mut config = producer.relay_config();
    config.published = outbox_runtime::PublishedRows::Archive;
    drain(config, producer).await;
}

/// Runs a relay of `config` batch after batch until one claims nothing.
async fn drain(config: outbox_runtime::RelayConfig, producer: &TestEnv) {
    let mut relay = Relay::connect(config, producer.nats.clone()).await.unwrap();
    while relay.relay_batch().await.unwrap().claimed > 0 {}
}

/// Waits until JetStream has nothing left for the inbox's consumer: every message delivered
/// and settled.
pub async fn wait_until_settled<H: Handler<C>, C: InboxConnection>(
    inbox: &Inbox<H, C>,
    what: &str,
    timeout: Duration,
) {
    wait_until(what, timeout, || async {
        // A request met during a cluster's leader election times out: ask again.
        let mut consumer = inbox.consumer().clone();
        let info = consumer.info().await.ok()?;
        (info.num_ack_pending == 0 && info.num_pending == 0).then_some(())
    })
    .await;
}

/// Every delivery JetStream has made to the inbox's consumer, redeliveries included: the
/// consumer's sequence.
pub async fn deliveries(inbox: &Inbox<impl Handler>) -> u64 {
    let mut consumer = inbox.consumer().clone();
    consumer.info().await.unwrap().delivered.consumer_sequence
}

/// Waits until `count` events are applied in `consumer`'s database and every message is
/// settled.
pub async fn wait_until_applied(
    inbox: &Inbox<impl Handler>,
    consumer: &TestEnv,
    count: usize,
    timeout: Duration,
) {
    wait_until(&format!("{count} applied"), timeout, || async {
        (applied_count(&mut consumer.conn().await).await == count).then_some(())
    })
    .await;
    wait_until_settled(inbox, "every message settled", Duration::from_secs(10)).await;
}

/// Runs the inbox until every message is settled (within `timeout`), then shuts it down.
pub async fn run_until_settled(inbox: Inbox<impl Handler>, what: &str, timeout: Duration) {
    let probe = inbox.clone();
    let running = inbox.spawn();
    wait_until_settled(&probe, what, timeout).await;
    running.shutdown().await.unwrap();
}

/// Writes each event it applies into `applied`, in the inbox's transaction; sleeps
/// `delay` first (a slow handler).
#[derive(Clone, Default)]
pub struct Recording {
    pub delay: Duration,
}

impl Handler for Recording {
    type Event = OrderEvent;
    type Error = diesel::result::Error;

    async fn handle(
        &self,
        _event: OrderEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        record_applied(message, uow).await
    }
}

/// Writes the event of `message` into `applied`, in the handler's transaction `uow`.
pub async fn record_applied(
    message: &Metadata,
    uow: &mut UnitOfWork<'_>,
) -> Result<(), diesel::result::Error> {
    diesel::sql_query(
        "INSERT INTO applied (aggregate, seq, message_id, deliveries) VALUES ($1, $2, $3, $4)",
    )
    .bind::<diesel::sql_types::Text, _>(message.aggregate_id.as_str())
    .bind::<diesel::sql_types::Int8, _>(message.sequence)
    .bind::<diesel::sql_types::Text, _>(&message.id)
    .bind::<diesel::sql_types::Int8, _>(i64::try_from(message.deliveries).unwrap())
    .execute(uow.conn())
    .await?;
    Ok(())
}

/// Every applied event, `(aggregate, seq)`, in the order they were applied.
pub async fn applied_in_order(conn: &mut AsyncPgConnection) -> Vec<(String, i64)> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        aggregate: String,
        #[diesel(sql_type = diesel::sql_types::Int8)]
        seq: i64,
    }
    let rows: Vec<Row> = diesel::sql_query("SELECT aggregate, seq FROM applied ORDER BY n")
        .load(conn)
        .await
        .unwrap();
    rows.into_iter()
        .map(|row| (row.aggregate, row.seq))
        .collect()
}

/// What was applied: each aggregate's sequences in the order they were applied.
pub async fn applied(conn: &mut AsyncPgConnection) -> BTreeMap<String, Vec<i64>> {
    let mut applied: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (aggregate, seq) in applied_in_order(conn).await {
        applied.entry(aggregate).or_default().push(seq);
    }
    applied
}

/// How many events were applied.
pub async fn applied_count(conn: &mut AsyncPgConnection) -> usize {
    applied(conn).await.values().map(Vec::len).sum()
}

/// Asserts that every one of `aggregates` aggregates had its `events` events applied once
/// each, in sequence order.
pub fn assert_applied_in_order(
    applied: &BTreeMap<String, Vec<i64>>,
    aggregates: usize,
    events: i64,
) {
    assert_eq!(applied.len(), aggregates, "every aggregate");
    let expected: Vec<i64> = (1..=events).collect();
    let broken: Vec<(&String, &Vec<i64>)> = applied
        .iter()
        .filter(|(_, seqs)| **seqs != expected)
        .collect();
    assert!(
        broken.is_empty(),
        "applied out of order or not exactly once: {broken:?}"
    );
}

/// Commits `events` events for each of `aggregates` orders (`o-0`, `o-1`, ...): `Placed`,
/// then `Shipped`s, one unit of work per event and round by round, so that the aggregates
/// interleave in the stream.
pub async fn commit_rounds(producer: &TestEnv, aggregates: usize, events: usize) {
    let mut conn = producer.conn().await;
    let mut orders = orders(aggregates);
    for round in 0..events {
        commit_round(producer, &mut conn, &mut orders, round).await;
    }
}

/// A producer's orders `o-0`, `o-1`, ..., committed round by round as in
/// [`commit_rounds`], each call going on where the last one left off.
pub struct Rounds<'a> {
    producer: &'a TestEnv,
    conn: AsyncPgConnection,
    orders: Vec<Order>,
    next: usize,
}

impl<'a> Rounds<'a> {
    /// `aggregates` orders of `producer`, none committed yet.
    pub async fn new(producer: &'a TestEnv, aggregates: usize) -> Self {
        Self {
            producer,
            conn: producer.conn().await,
            orders: orders(aggregates),
            next: 0,
        }
    }

    /// Commits the next `rounds` rounds and relays everything the producer committed.
    pub async fn commit_and_relay(&mut self, rounds: usize) {
        for round in self.next..self.next + rounds {
            commit_round(self.producer, &mut self.conn, &mut self.orders, round).await;
        }
        self.next += rounds;
        relay_all(self.producer).await;
    }
}

/// `aggregates` orders `o-0`, `o-1`, ..., placed and not committed.
pub fn orders(aggregates: usize) -> Vec<Order> {
    (0..aggregates)
        .map(|n| Order::place(&format!("o-{n}"), "ada", 1))
        .collect()
}

/// Commits round `round` of [`commit_rounds`]: one event of each order (`Placed` in round
/// 0, else `Shipped`), one unit of work each.
pub async fn commit_round(
    producer: &TestEnv,
    conn: &mut AsyncPgConnection,
    orders: &mut [Order],
    round: usize,
) {
    for order in orders {
        if round > 0 {
            order.record(OrderEvent::Shipped);
        }
        producer
            .outbox()
            .transaction(conn, async |uow| {
                uow.track(order);
                Ok::<_, outbox_runtime::UnitOfWorkError>(())
            })
            .await
            .expect("the unit of work commits");
    }
}

/// Spawns `count` instances of the consumer `config` describes, each on a NATS client of
/// its own (as separate processes would be), at `nats_url`.
pub async fn spawn_instances<H: Handler + Clone>(
    config: &InboxConfig,
    handler: &H,
    nats_url: &str,
    count: usize,
) -> Vec<InboxHandle> {
    let mut running = Vec::new();
    for _ in 0..count {
        let nats = outbox_runtime::nats::connect(nats_url).await.unwrap();
        running.push(
            Inbox::connect(config.clone(), nats, handler.clone())
                .await
                .unwrap()
                .spawn(),
        );
    }
    running
}
