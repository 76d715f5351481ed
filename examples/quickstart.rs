//! Quickstart: orders commit through the unit of work, the relay publishes their events to
//! JetStream, and a consumer prints each event as it arrives on its subject.
//!
//! ```sh
//! cargo run --example quickstart
//! ```
//!
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`) and `NATS_URL`
//! (default `nats://127.0.0.1:4222`) point it elsewhere. It exits 0 once every event it
//! committed has arrived, and 1 if they have not within 30 seconds or on an error, which it
//! prints (with how to start the services when it could not reach one).
//!
//! The database is chosen by the URL: `postgres://` (the default build), `mysql://` (MySQL 8
//! or MariaDB 10.6+, built with `--features mysql`), or a SQLite file's path (built with
//! `--features sqlite`); the same orders and events on each:
//!
//! ```sh
//! DATABASE_URL=mysql://root@127.0.0.1:3306/test cargo run --features mysql --example quickstart
//! DATABASE_URL=orders.db cargo run --features sqlite --example quickstart
//! ```

use std::collections::HashSet;
use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures::StreamExt;
use outbox_runtime::ConnectError;
use outbox_runtime::database::Kind;
use outbox_runtime::nats::NatsConnectError;
use outbox_runtime::{
    BackendConnection, DomainEvent, Outbox, PendingEvents, Relay, RelayConfig, RelayHandle,
    UnitOfWork, UnitOfWorkError, aggregate,
};
use serde::{Deserialize, Serialize};

/// The events of an order. Each variant is one event type; its fields are the payload.
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed {
        customer: String,
    },
    ItemAdded {
        sku: String,
        quantity: u32,
        price_cents: i64,
    },
    Shipped {
        carrier: String,
    },
}

/// An order: the aggregate. `#[aggregate]` adds `record`, `pending_events()` and the rest.
#[aggregate]
#[derive(Debug)]
struct Order {
    id: String,
    customer: String,
    total_cents: i64,
    status: &'static str,
    pending_events: PendingEvents<OrderEvent>,
}

impl Order {
    fn place(id: &str, customer: &str) -> Self {
        let mut order = Order {
            id: id.to_owned(),
            customer: customer.to_owned(),
            total_cents: 0,
            status: "placed",
            pending_events: PendingEvents::new(),
        };
        order.record(OrderEvent::Placed {
            customer: customer.to_owned(),
        });
        order
    }

    fn add_item(&mut self, sku: &str, quantity: u32, price_cents: i64) {
        self.total_cents += i64::from(quantity) * price_cents;
        self.record(OrderEvent::ItemAdded {
            sku: sku.to_owned(),
            quantity,
            price_cents,
        });
    }

    fn ship(&mut self, carrier: &str) {
        self.status = "shipped";
        self.record(OrderEvent::Shipped {
            carrier: carrier.to_owned(),
        });
    }
}

// A table name of its own, so that the quickstart runs on a database that already holds a
// service's `orders` (which it would otherwise take for its own and fail to write).
diesel::table! {
    quickstart_orders (id) {
        id -> Text,
        customer -> Text,
        total_cents -> Int8,
        status -> Text,
    }
}

/// The database the quickstart runs on: how it opens a connection, saves an order in a unit
/// of work, and starts the relay that publishes its outbox.
trait Database {
    type Conn: BackendConnection;

    /// Migrates the outbox tables, creates `quickstart_orders`, and opens a connection.
    async fn open(url: &str) -> Result<Self::Conn, Box<dyn std::error::Error>>;

    /// Saves the order's row and hands its events to the unit of work: one transaction.
    async fn save(
        uow: &mut UnitOfWork<'_, Self::Conn>,
        order: &mut Order,
    ) -> Result<(), UnitOfWorkError>;

    /// Starts the database's relay (it makes sure the EVENTS stream exists).
    async fn relay(
        config: RelayConfig,
        nats: async_nats::Client,
    ) -> Result<RelayHandle, Box<dyn std::error::Error>>;
}

/// PostgreSQL, on diesel-async's `AsyncPgConnection`.
struct Postgres;

impl Database for Postgres {
    type Conn = AsyncPgConnection;

    async fn open(url: &str) -> Result<AsyncPgConnection, Box<dyn std::error::Error>> {
        outbox_runtime::run_migrations(url).await?;
        let mut conn = AsyncPgConnection::establish(url).await?;
        conn.batch_execute(
            "CREATE TABLE IF NOT EXISTS quickstart_orders (
                id text PRIMARY KEY, customer text NOT NULL,
                total_cents bigint NOT NULL, status text NOT NULL)",
        )
        .await?;
        Ok(conn)
    }

    async fn save(uow: &mut UnitOfWork<'_>, order: &mut Order) -> Result<(), UnitOfWorkError> {
        let row = (
            quickstart_orders::id.eq(&order.id),
            quickstart_orders::customer.eq(&order.customer),
            quickstart_orders::total_cents.eq(order.total_cents),
            quickstart_orders::status.eq(order.status),
        );
        diesel::insert_into(quickstart_orders::table)
            .values(row)
            .on_conflict(quickstart_orders::id)
            .do_update()
            .set(row)
            .execute(uow.conn())
            .await?;
        uow.track(order);
        Ok(())
    }

    async fn relay(
        config: RelayConfig,
        nats: async_nats::Client,
    ) -> Result<RelayHandle, Box<dyn std::error::Error>> {
        Ok(Relay::connect(config, nats).await?.spawn())
    }
}

/// MySQL 8 or MariaDB 10.6+, on diesel-async's `AsyncMysqlConnection` (feature `mysql`).
#[cfg(feature = "mysql")]
struct Mysql;

#[cfg(feature = "mysql")]
impl Database for Mysql {
    type Conn = diesel_async::AsyncMysqlConnection;

    async fn open(url: &str) -> Result<Self::Conn, Box<dyn std::error::Error>> {
        outbox_runtime::mysql::run_migrations(url).await?;
        let mut conn = outbox_runtime::mysql::establish(url).await?;
        conn.batch_execute(
            "CREATE TABLE IF NOT EXISTS quickstart_orders (
                id VARCHAR(64) PRIMARY KEY, customer TEXT NOT NULL,
                total_cents BIGINT NOT NULL, status TEXT NOT NULL)",
        )
        .await?;
        Ok(conn)
    }

    async fn save(
        uow: &mut UnitOfWork<'_, Self::Conn>,
        order: &mut Order,
    ) -> Result<(), UnitOfWorkError> {
        let row = (
            quickstart_orders::id.eq(&order.id),
            quickstart_orders::customer.eq(&order.customer),
            quickstart_orders::total_cents.eq(order.total_cents),
            quickstart_orders::status.eq(order.status),
        );
        diesel::insert_into(quickstart_orders::table)
            .values(row)
            .on_conflict(diesel::dsl::DuplicatedKeys)
            .do_update()
            .set(row)
            .execute(uow.conn())
            .await?;
        uow.track(order);
        Ok(())
    }

    async fn relay(
        config: RelayConfig,
        nats: async_nats::Client,
    ) -> Result<RelayHandle, Box<dyn std::error::Error>> {
        Ok(outbox_runtime::mysql::MysqlRelay::connect(config, nats)
            .await?
            .spawn())
    }
}

/// A SQLite file, on diesel's `SqliteConnection` behind diesel-async's wrapper (feature
/// `sqlite`).
#[cfg(feature = "sqlite")]
struct Sqlite;

#[cfg(feature = "sqlite")]
impl Database for Sqlite {
    type Conn = outbox_runtime::sqlite::AsyncSqliteConnection;

    async fn open(url: &str) -> Result<Self::Conn, Box<dyn std::error::Error>> {
        let mut conn = outbox_runtime::sqlite::establish(url)?;
        outbox_runtime::sqlite::run_migrations(&mut conn)?;
        let mut conn = outbox_runtime::sqlite::AsyncSqliteConnection::new(conn);
        conn.batch_execute(
            "CREATE TABLE IF NOT EXISTS quickstart_orders (
                id TEXT PRIMARY KEY, customer TEXT NOT NULL,
                total_cents INTEGER NOT NULL, status TEXT NOT NULL)",
        )
        .await?;
        Ok(conn)
    }

    async fn save(
        uow: &mut UnitOfWork<'_, Self::Conn>,
        order: &mut Order,
    ) -> Result<(), UnitOfWorkError> {
        let row = (
            quickstart_orders::id.eq(&order.id),
            quickstart_orders::customer.eq(&order.customer),
            quickstart_orders::total_cents.eq(order.total_cents),
            quickstart_orders::status.eq(order.status),
        );
        diesel::insert_into(quickstart_orders::table)
            .values(row)
            .on_conflict(quickstart_orders::id)
            .do_update()
            .set(row)
            .execute(uow.conn())
            .await?;
        uow.track(order);
        Ok(())
    }

    async fn relay(
        config: RelayConfig,
        nats: async_nats::Client,
    ) -> Result<RelayHandle, Box<dyn std::error::Error>> {
        Ok(outbox_runtime::sqlite::SqliteRelay::connect(config, nats)
            .await?
            .spawn())
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let Err(error) = quickstart(&database_url, &nats_url).await else {
        return ExitCode::SUCCESS;
    };
    // The error and what caused it, as sentences (each already names the server, without
    // its password), and what to do when a server is not there.
    eprintln!("quickstart: {error}");
    let mut unreachable = false;
    let mut said = error.to_string();
    let mut cause: Option<&dyn Error> = Some(&*error);
    while let Some(error) = cause {
        unreachable |= error.is::<ConnectError>() || error.is::<NatsConnectError>();
        cause = error.source();
        // A cause that its error's message already quotes is not said twice.
        if let Some(cause) = cause.map(ToString::to_string)
            && !said.contains(&cause)
        {
            eprintln!("  caused by: {cause}");
            said = cause;
        }
    }
    if unreachable {
        eprintln!(
            "the quickstart needs the database of DATABASE_URL and a NATS server with JetStream \
             at NATS_URL (by default PostgreSQL 15 on 127.0.0.1:5432, database `test`, and \
             nats-server -js on 127.0.0.1:4222); `docker compose up -d` in this repository \
             starts both (compose.yaml)"
        );
    }
    ExitCode::FAILURE
}

/// Runs the quickstart on the database `database_url` names.
async fn quickstart(database_url: &str, nats_url: &str) -> Result<(), Box<dyn Error>> {
    // A typo in the scheme (`postgress://`) is said as such, not taken for a SQLite path.
    let kind = database_url
        .parse::<Kind>()
        .map_err(|error| format!("DATABASE_URL: {error}"))?;
    match kind {
        Kind::Postgres => run::<Postgres>(database_url, nats_url).await,
        #[cfg(feature = "mysql")]
        Kind::Mysql => run::<Mysql>(database_url, nats_url).await,
        #[cfg(not(feature = "mysql"))]
        Kind::Mysql => Err(built_without("mysql")),
        // A SQLite file: a path, `sqlite://path` or a `file:` URI.
        #[cfg(feature = "sqlite")]
        Kind::Sqlite => run::<Sqlite>(database_url, nats_url).await,
        #[cfg(not(feature = "sqlite"))]
        Kind::Sqlite => Err(built_without("sqlite")),
    }
}

/// The error for a `DATABASE_URL` whose database this build left out.
#[cfg_attr(all(feature = "mysql", feature = "sqlite"), allow(dead_code))]
fn built_without(feature: &str) -> Box<dyn std::error::Error> {
    format!(
        "DATABASE_URL names a database this build does not have: run with `--features {feature}`"
    )
    .into()
}

/// Commits orders on `D`, relays their events, and prints them as a consumer receives them.
async fn run<D: Database>(
    database_url: &str,
    nats_url: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut conn = D::open(database_url).await?;
    let nats = outbox_runtime::nats::connect(nats_url).await?;
    let mut relay = D::relay(RelayConfig::new(database_url), nats.clone()).await?;

    // A consumer of order events, from now on.
    let stream = async_nats::jetstream::new(nats)
        .get_stream("EVENTS")
        .await?;
    let consumer = stream
        .create_consumer(pull::OrderedConfig {
            filter_subject: "events.Order.>".to_owned(),
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;

    // Business transactions: each order is saved with its events, atomically.
    let outbox = Outbox::new();
    let run = uuid::Uuid::now_v7().simple().to_string();
    let mut expected = 0;
    let mut ids = HashSet::new();
    for (n, customer) in ["ada", "grace", "edsger"].into_iter().enumerate() {
        let mut order = Order::place(&format!("{}-{n}", &run[20..]), customer);
        order.add_item("tea", 2, 450);
        expected += order.pending_events().len();
        outbox
            .transaction(&mut conn, async |uow| D::save(uow, &mut order).await)
            .await?;
        assert!(order.pending_events().is_empty(), "drained after commit");

        if n != 1 {
            order.ship("dhl");
            expected += order.pending_events().len();
            outbox
                .transaction(&mut conn, async |uow| D::save(uow, &mut order).await)
                .await?;
        }
        ids.insert(order.id);
    }

    // A unit of work that fails rolls back: no order row, no event, ever.
    let mut ghost = Order::place(&format!("{}-ghost", &run[20..]), "nobody");
    let failed = outbox
        .transaction(&mut conn, async |uow| {
            D::save(uow, &mut ghost).await?;
            Err::<(), _>(UnitOfWorkError::Database(
                diesel::result::Error::RollbackTransaction,
            ))
        })
        .await;
    assert!(failed.is_err() && ghost.pending_events().len() == 1);
    println!(
        "committed {expected} events for {} orders; one unit of work rolled back",
        ids.len()
    );

    let arrivals = async {
        let mut seen = 0;
        while seen < expected {
            let message = messages.next().await.ok_or("the consumer stopped")??;
            let headers = message.headers.clone().unwrap_or_default();
            let header = |name: &str| headers.get(name).map(|v| v.as_str().to_owned());
            let aggregate = header("ce-subject").unwrap_or_default();
            if ids.contains(&aggregate) {
                seen += 1;
                println!(
                    "{:<45} ce-sequence={} {}",
                    message.subject,
                    header("ce-sequence").unwrap_or_default(),
                    String::from_utf8_lossy(&message.payload)
                );
            } else if aggregate.ends_with("-ghost") {
                return Err(
                    format!("a rolled-back event was published: {}", message.subject).into(),
                );
            }
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    };
    // A relay stops by itself only on a bug (a worker panicked): a service selects on
    // `stopped()` beside its own work, and ends with its error rather than wait on.
    let arrived = tokio::select! {
        arrived = tokio::time::timeout(Duration::from_secs(30), arrivals) => arrived,
        stopped = relay.stopped() => {
            return Err(format!("the relay stopped: {stopped:?}").into());
        }
    };
    relay.shutdown().await?;
    match arrived {
        Ok(result) => result?,
        Err(_) => return Err("not every event arrived within 30 s".into()),
    }
    println!("all {expected} events arrived");
    Ok(())
}
