//! Outbox + Inbox, end to end: two services, each with its own database, outbox and relay.
//!
//! The shop places orders through its outbox; its relay publishes `shop.Order.*.Placed`. The
//! inventory service consumes them through its inbox: in one transaction it records the
//! message, reserves stock in its own tables and records `StockReserved` (or `StockShortage`)
//! in its own outbox; its relay publishes `inventory.Stock.*`. The shop prints each answer
//! with the correlation id and cause it inherited. One order is delivered twice, as a relay
//! that died before its commit would deliver it: the inbox skips the copy.
//!
//! ```sh
//! cargo run --example inventory
//! ```
//!
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`) is the shop's database;
//! the inventory's is `INVENTORY_DATABASE_URL`, by default the database `outbox_inventory`
//! on the same server (created when missing). `NATS_URL` defaults to `nats://127.0.0.1:4222`.

use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures::StreamExt;
use outbox_runtime::{
    DomainEvent, Handler, Inbox, InboxConfig, Metadata, Outbox, PendingEvents, Relay, RelayConfig,
    StreamSettings, Topology, UnitOfWork, UnitOfWorkError, aggregate,
};
use serde::{Deserialize, Serialize};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// ---- The shop ---------------------------------------------------------------------------

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Line {
    sku: String,
    quantity: i64,
}

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed { customer: String, lines: Vec<Line> },
}

#[aggregate]
struct Order {
    id: String,
    pending_events: PendingEvents<OrderEvent>,
}

/// What the inventory answers, as the shop reads it.
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
enum StockEvent {
    StockReserved { order_id: String, lines: Vec<Line> },
    StockShortage { order_id: String, sku: String },
}

// ---- The inventory service --------------------------------------------------------------

/// Reserves stock for each placed order, in the inventory's own tables, and says so through
/// the inventory's outbox: all in the inbox's transaction.
struct Reservations;

impl Handler for Reservations {
    type Event = OrderEvent;
    type Error = diesel::result::Error;

    async fn handle(
        &self,
        event: OrderEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        let OrderEvent::Placed { lines, .. } = event;
        let order_id = message.aggregate_id.clone();

        // Lock the stock rows the order names, then take all of it or none of it.
        #[derive(QueryableByName)]
        struct Available {
            #[diesel(sql_type = Text)]
            sku: String,
            #[diesel(sql_type = BigInt)]
            available: i64,
        }
        let skus: Vec<&str> = lines.iter().map(|line| line.sku.as_str()).collect();
        let stock: Vec<Available> = diesel::sql_query(
            "SELECT sku, available FROM stock WHERE sku = ANY($1) ORDER BY sku FOR UPDATE",
        )
        .bind::<Array<Text>, _>(&skus)
        .load(uow.conn())
        .await?;
        let available = |sku: &str| {
            stock
                .iter()
                .find(|row| row.sku == sku)
                .map_or(0, |row| row.available)
        };
        if let Some(short) = lines
            .iter()
            .find(|line| available(&line.sku) < line.quantity)
        {
            println!(
                "  inventory: order {order_id}: not enough {} (message {})",
                short.sku, message.id
            );
            let shortage = StockEvent::StockShortage {
                order_id: order_id.clone(),
                sku: short.sku.clone(),
            };
            uow.emit("Stock", &order_id, &shortage);
            return Ok(());
        }
        for line in &lines {
            diesel::sql_query("UPDATE stock SET available = available - $2 WHERE sku = $1")
                .bind::<Text, _>(&line.sku)
                .bind::<BigInt, _>(line.quantity)
                .execute(uow.conn())
                .await?;
        }
        println!(
            "  inventory: order {order_id}: reserved {} line(s) (message {})",
            lines.len(),
            message.id
        );
        let reserved = StockEvent::StockReserved {
            order_id: order_id.clone(),
            lines,
        };
        uow.emit("Stock", &order_id, &reserved);
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let shop_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let inventory_url = match std::env::var("INVENTORY_DATABASE_URL") {
        Ok(url) => url,
        Err(_) => create_inventory_database(&shop_url).await?,
    };

    // Each service: its migrations, its tables, its outbox, its relay and stream.
    outbox_runtime::run_migrations(&shop_url).await?;
    outbox_runtime::run_migrations(&inventory_url).await?;
    let mut inventory_db = AsyncPgConnection::establish(&inventory_url).await?;
    inventory_db
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS stock (sku text PRIMARY KEY, available bigint NOT NULL);
             INSERT INTO stock VALUES ('tea', 10), ('coffee', 3)
                 ON CONFLICT (sku) DO UPDATE SET available = excluded.available;",
        )
        .await?;
    let nats = outbox_runtime::nats::connect(&nats_url).await?;
    // Each service's topology, configured once: its units of work, its relay and its
    // consumers take the same value.
    let topology = |prefix: &str, stream: &str| -> Result<Topology, BoxError> {
        let stream = StreamSettings {
            name: stream.to_owned(),
            ..StreamSettings::default()
        };
        Ok(Topology::new(prefix.parse()?, stream))
    };
    let shop = topology("shop", "SHOP")?;
    let inventory = topology("inventory", "INVENTORY")?;
    let shop_outbox = Outbox::with_topology(shop.clone());
    let inventory_outbox = Outbox::with_topology(inventory.clone());
    let relay_config = |url: &str, topology: &Topology, source: &str| {
        let mut config = RelayConfig::new(url);
        config.topology = topology.clone();
        config.source = source.to_owned();
        config
    };
    let mut shop_relay = Relay::connect(relay_config(&shop_url, &shop, "/shop"), nats.clone())
        .await?
        .spawn();
    let mut inventory_relay = Relay::connect(
        relay_config(&inventory_url, &inventory, "/inventory"),
        nats.clone(),
    )
    .await?
    .spawn();

    // The inventory's inbox consumes the shop's placed orders.
    let mut inbox_config = InboxConfig::new("inventory-reservations", &inventory_url);
    inbox_config.outbox = inventory_outbox;
    inbox_config.topology = shop;
    inbox_config.filter_subjects = vec!["shop.Order.*.Placed".to_owned()];
    let mut inbox = Inbox::connect(inbox_config, nats.clone(), Reservations)
        .await?
        .spawn();

    // The shop listens for the inventory's answers.
    let js = async_nats::jetstream::new(nats.clone());
    let answers = js
        .get_stream("INVENTORY")
        .await?
        .create_consumer(pull::OrderedConfig {
            filter_subject: "inventory.Stock.>".to_owned(),
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await?;
    let mut answers = answers.messages().await?;

    // The shop places three orders, each in its own unit of work.
    let run = &uuid::Uuid::now_v7().simple().to_string()[20..];
    let orders = [
        ("ada", vec![("tea", 2)]),
        ("grace", vec![("tea", 1), ("coffee", 2)]),
        ("edsger", vec![("coffee", 5)]),
    ];
    let mut shop_db = AsyncPgConnection::establish(&shop_url).await?;
    let mut ids = Vec::new();
    for (n, (customer, lines)) in orders.into_iter().enumerate() {
        let mut order = Order {
            id: format!("{run}-{n}"),
            pending_events: PendingEvents::new(),
        };
        order.record(OrderEvent::Placed {
            customer: customer.to_owned(),
            lines: lines
                .iter()
                .map(|(sku, quantity)| Line {
                    sku: (*sku).to_owned(),
                    quantity: *quantity,
                })
                .collect(),
        });
        let correlation = shop_outbox
            .transaction(&mut shop_db, async |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(uow.correlation_id().to_owned())
            })
            .await?;
        println!(
            "shop: placed order {} for {customer} (correlation {correlation})",
            order.id
        );
        ids.push(order.id);
    }

    // A duplicate delivery: the first order's message stored again under another
    // Nats-Msg-Id (as a relay republishing it after the duplicate window would), same ce-id.
    let first_placed = wait_for_placed(&js, &ids[0]).await?;
    let mut headers = first_placed.headers.clone().unwrap_or_default();
    headers.insert("Nats-Msg-Id", uuid::Uuid::now_v7().to_string());
    js.publish_with_headers(
        first_placed.subject.clone(),
        headers,
        first_placed.payload.clone(),
    )
    .await?
    .await?;
    println!("shop: order {} delivered a second time", ids[0]);

    let answering = tokio::time::timeout(Duration::from_secs(30), async {
        let mut answered = 0;
        while answered < ids.len() {
            let message = answers.next().await.ok_or("the answers ended")??;
            let headers = message.headers.clone().unwrap_or_default();
            let header = |name: &str| headers.get(name).map(|v| v.to_string()).unwrap_or_default();
            if !ids.contains(&header("ce-subject")) {
                continue;
            }
            answered += 1;
            println!(
                "shop: {} {} (correlation {}, caused by {})",
                message.subject,
                String::from_utf8_lossy(&message.payload),
                header("ce-correlationid"),
                header("ce-causationid"),
            );
        }
        Ok::<_, BoxError>(())
    });
    // The relays and the inbox stop by themselves only on a bug: end with its error rather
    // than wait out the 30 s.
    let answered = tokio::select! {
        answered = answering => answered,
        stopped = shop_relay.stopped() => {
            return Err(format!("the shop's relay stopped: {stopped:?}").into());
        }
        stopped = inventory_relay.stopped() => {
            return Err(format!("the inventory's relay stopped: {stopped:?}").into());
        }
        stopped = inbox.stopped() => {
            return Err(format!("the inbox stopped: {stopped:?}").into());
        }
    };

    // The duplicate was skipped: stock moved once per order.
    #[derive(QueryableByName)]
    struct Stock {
        #[diesel(sql_type = Text)]
        sku: String,
        #[diesel(sql_type = BigInt)]
        available: i64,
    }
    wait_until_drained(&js, "SHOP", "inventory-reservations").await?;
    let stock: Vec<Stock> = diesel::sql_query("SELECT sku, available FROM stock ORDER BY sku")
        .load(&mut inventory_db)
        .await?;
    let stock: Vec<String> = stock
        .iter()
        .map(|s| format!("{} {}", s.sku, s.available))
        .collect();
    println!("inventory: stock now {}", stock.join(", "));

    inbox.shutdown().await?;
    inventory_relay.shutdown().await?;
    shop_relay.shutdown().await?;
    match answered {
        Ok(result) => result?,
        Err(_) => return Err("not every order was answered within 30 s".into()),
    }
    if stock != ["coffee 1", "tea 7"] {
        return Err(format!("unexpected stock: {stock:?}").into());
    }
    println!("every order answered; the duplicate changed nothing");
    Ok(())
}

/// The published `Placed` message of order `id`, read back from the shop's stream.
async fn wait_for_placed(
    js: &async_nats::jetstream::Context,
    id: &str,
) -> Result<async_nats::jetstream::Message, BoxError> {
    let placed = js
        .get_stream("SHOP")
        .await?
        .create_consumer(pull::OrderedConfig {
            filter_subject: format!("shop.Order.{id}.Placed"),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = placed.messages().await?;
    let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
        .await?
        .ok_or("no placed message")??;
    Ok(message)
}

/// Waits until the durable consumer `name` has had every message of its stream acked: the
/// duplicate included.
async fn wait_until_drained(
    js: &async_nats::jetstream::Context,
    stream: &str,
    name: &str,
) -> Result<(), BoxError> {
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        js.get_stream(stream).await?.get_consumer(name).await?;
    for _ in 0..100 {
        let info = consumer.info().await?;
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("the consumer {name} did not drain within 10 s").into())
}

/// The inventory's database beside the shop's: `outbox_inventory`, created when missing.
async fn create_inventory_database(shop_url: &str) -> Result<String, BoxError> {
    let (server, _) = shop_url
        .rsplit_once('/')
        .ok_or("DATABASE_URL has no database name")?;
    let mut conn = AsyncPgConnection::establish(shop_url).await?;
    #[derive(QueryableByName)]
    struct Exists {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
    }
    let exists: Exists = diesel::sql_query(
        "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'outbox_inventory') AS exists",
    )
    .get_result(&mut conn)
    .await?;
    if !exists.exists {
        conn.batch_execute("CREATE DATABASE outbox_inventory")
            .await?;
    }
    Ok(format!("{server}/outbox_inventory"))
}
