//! The service's own connections: a relay and an inbox that open theirs through a
//! `Connector` (a closure, or the service's deadpool pool) rather than from a URL, and the
//! migrations run on a connection the service opened.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::{AsyncConnection, AsyncPgConnection};
use outbox_runtime::{Connector, Handler, Inbox, Metadata, Relay, UnitOfWork, pending_migrations};
use support::consumer::{consumer_config, relay_all, run_until_settled};
use support::domain::{Order, OrderEvent};
use support::{TestEnv, nats_url};

/// A URL no server answers: whatever connects must have used the connector.
const NOWHERE: &str = "postgres://nobody@127.0.0.1:1/nowhere";

#[tokio::test]
async fn a_relay_opens_its_connections_with_the_connector_it_is_given() {
    let env = TestEnv::new().await;
    env.commit(&mut Order::place("o-1", "ada", 1)).await;
    let opened = Arc::new(AtomicUsize::new(0));
    let (url, counter) = (env.database_url.clone(), Arc::clone(&opened));
    let mut config = env.relay_config();
    config.database_url = NOWHERE.to_owned();
    config.connector = Some(Connector::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
        let url = url.clone();
        async move { AsyncPgConnection::establish(&url).await }
    }));
    let mut relay = Relay::connect(config, env.nats.clone()).await.unwrap();
    assert_eq!(relay.relay_batch().await.unwrap().claimed, 1);
    assert_eq!(
        env.stream_len().await,
        1,
        "published through the connector's connection"
    );
    assert!(opened.load(Ordering::SeqCst) >= 1);

    // A connector that fails names the database by the URL, without reaching it.
    let mut config = env.relay_config();
    config.database_url = "postgres://app:s3cret@db.internal/orders".to_owned();
    config.connector = Some(Connector::new(|| async {
        Err::<AsyncPgConnection, _>("the vault is sealed")
    }));
    let error = Relay::connect(config, env.nats.clone())
        .await
        .err()
        .expect("no connection, no relay")
        .to_string();
    assert!(
        error.contains("the vault is sealed")
            && error.contains("postgres://app@db.internal/orders"),
        "{error}"
    );
    assert!(!error.contains("s3cret"), "{error}");
}

/// Counts the order events it handles.
#[derive(Clone, Default)]
struct Counting(Arc<AtomicUsize>);

impl Handler for Counting {
    type Event = OrderEvent;
    type Error = String;

    async fn handle(
        &self,
        _event: OrderEvent,
        _message: &Metadata,
        _uow: &mut UnitOfWork<'_>,
    ) -> Result<(), String> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_takes_its_connections_from_the_services_pool() {
    let producer = TestEnv::new().await;
    for id in ["o-1", "o-2", "o-3"] {
        producer.commit(&mut Order::place(id, "ada", 1)).await;
    }
    relay_all(&producer).await;

    let consumer = TestEnv::new().await;
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(&consumer.database_url);
    let pool = Pool::builder(manager).max_size(2).build().unwrap();
    let mut config = consumer_config(&consumer, &producer, "pooled");
    config.database_url = NOWHERE.to_owned();
    config.connector = Some(Connector::from_pool(pool.clone()));
    let handled = Counting::default();
    let inbox = Inbox::connect(config, producer.nats.clone(), handled.clone())
        .await
        .unwrap();
    run_until_settled(inbox, "the pooled consumer", Duration::from_secs(20)).await;
    assert_eq!(handled.0.load(Ordering::SeqCst), 3);
    // The connections were taken out of the service's pool: its slots are all free.
    let status = pool.status();
    assert_eq!(status.size - status.available, 0, "{status:?}");
}

#[tokio::test]
async fn the_migrations_run_on_a_connection_the_service_opened() {
    let env = TestEnv::unmigrated(&nats_url()).await;
    let pending = pending_migrations(&mut env.conn().await).await.unwrap();
    assert!(!pending.is_empty());
    let applied = outbox_runtime::run_migrations_on(env.conn().await)
        .await
        .unwrap();
    assert_eq!(applied, pending);
    assert!(
        pending_migrations(&mut env.conn().await)
            .await
            .unwrap()
            .is_empty()
    );
}
