//! The outbox per database backend, one run each, with the same code and the same load:
//!
//! ```sh
//! cargo run --release --features mysql,sqlite --example backend_bench
//! ```
//!
//! For PostgreSQL (diesel-async's `AsyncPgConnection`), MariaDB / MySQL
//! (`AsyncMysqlConnection`) and SQLite (`SyncConnectionWrapper<SqliteConnection>`, a file in
//! the temporary directory, write-ahead log, fsync at each commit), it prints:
//! 1. the unit of work's cost: a business transaction (one INSERT) with one event, against
//!    the same transaction without the outbox (a plain diesel-async transaction),
//!    interleaved, mean and median;
//! 2. relay throughput: `--events` events queued over `--aggregates` aggregates (and figure
//!    1's), drained by one relay with its defaults (events/s until the stream holds them all);
//! 3. commit-to-ack latency at `--rate` events/s offered by 4 writers of the relay's process
//!    (the ack time is the stream's store timestamp), p50 / p99 / max;
//! 4. figure 2's drain of `--events` twice more: deleting the published rows, then with
//!    `PublishedRows::Archive` (each moved to `outbox_published`), the two ways after the same
//!    history;
//!    4b. the archive that drain filled, replayed to a stream of its own
//!    (`outbox_runtime::replay`, one page of 1,000 at a time), events/s;
//! 5. the inbox's throughput: `--inbox-events` events over `--aggregates` aggregates, relayed
//!    to a stream of their own, applied by one inbox instance (`--inbox-concurrency`
//!    handlers at once, the inbox's default 16) on the same
//!    database (each in its transaction: the inbox row, the aggregate's position, one INSERT of
//!    the handler), events/s until the consumer has acked them all.
//!
//! Each backend works in a database and a stream of its own, removed at the end.
//! `OUTBOX_TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`),
//! `OUTBOX_TEST_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`) and `NATS_URL` point
//! it elsewhere.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use async_nats::jetstream::{consumer::DeliverPolicy, consumer::pull};
use clap::Parser;
use diesel::sql_types::BigInt;
use diesel_async::{
    AsyncConnection, AsyncMysqlConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
};
use futures::{FutureExt, StreamExt};
use outbox_runtime::mysql::MysqlRelay;
use outbox_runtime::replay::{ReplayConfig, ReplayReport, replay_archive};
use outbox_runtime::sqlite::{AsyncSqliteConnection, SqliteRelay};
use outbox_runtime::testing::TestEnv;
use outbox_runtime::{
    DomainEvent, Handler, Inbox, InboxConfig, InboxConnection, Metadata, Outbox, PendingEvents,
    PublishedRows, Relay, RelayConfig, RelayHandle, StreamSettings, Topology, UnitOfWork,
    UnitOfWorkError, aggregate,
};
use serde::{Deserialize, Serialize};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser, Clone)]
#[command(about = "The unit of work's cost, relay throughput and latency per database backend")]
struct Args {
    /// Which backends: `postgres`, `mysql`, `sqlite`.
    #[arg(long, value_delimiter = ',', default_value = "postgres,mysql,sqlite")]
    backends: Vec<String>,
    /// Rounds of figure 1 (after 100 to warm up).
    #[arg(long, default_value_t = 1000)]
    transactions: usize,
    /// Events queued for figure 2.
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Aggregates the events are spread over.
    #[arg(long, default_value_t = 1_000)]
    aggregates: usize,
    /// Offered load of figure 3, events per second.
    #[arg(long, default_value_t = 500)]
    rate: u64,
    /// How long figure 3 offers its load, in seconds.
    #[arg(long, default_value_t = 5)]
    latency_secs: u64,
    /// Events the inbox applies in figure 5.
    #[arg(long, default_value_t = 5_000)]
    inbox_events: usize,
    /// The inbox's `max_concurrency` in figure 5 (its default: 16).
    #[arg(long, default_value_t = 16)]
    inbox_concurrency: usize,
}

/// Figure 5's handler: one INSERT per event, in the inbox's transaction.
struct Applier<C>(std::marker::PhantomData<fn() -> C>);

impl<C: InboxConnection> Handler<C> for Applier<C> {
    type Event = Ticked;
    type Error = diesel::result::Error;

    async fn handle(
        &self,
        event: Ticked,
        _message: &Metadata,
        uow: &mut UnitOfWork<'_, C>,
    ) -> Result<(), Self::Error> {
        // Ids above figure 1's orders.
        let id = 1_000_000_000 + event.n;
        uow.conn()
            .batch_execute(&format!("INSERT INTO bench_orders VALUES ({id}, 4200)"))
            .await
    }
}

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
struct Ticked {
    n: u64,
    pad: String,
}

#[aggregate]
struct Probe {
    id: String,
    pending_events: PendingEvents<Ticked>,
}

/// A payload of about 200 bytes, as the project's other benchmarks use.
fn tick(n: u64) -> Ticked {
    Ticked {
        n,
        pad: "x".repeat(170),
    }
}

/// What differs per backend; everything else is the same code.
macro_rules! backend {
    ($name:ident, $conn:ty, $open:path, $relay:ty, $insert:expr, $create:expr) => {
        mod $name {
            use super::*;

            pub async fn conn(url: &str) -> Result<$conn, BoxError> {
                $open(url).await
            }

            /// Figure 1: (mean, median) in ms of the bare transaction and of the unit of work.
            pub async fn cost(
                url: &str,
                outbox: &Outbox,
                rounds: usize,
            ) -> Result<[(f64, f64); 2], BoxError> {
                let mut conn = conn(url).await?;
                conn.batch_execute($create).await?;
                let mut times: [Vec<f64>; 2] = Default::default();
                let mut order_id = 0_i64;
                for round in 0..rounds + 100 {
                    order_id += 1;
                    let started = Instant::now();
                    conn.transaction::<_, diesel::result::Error, _>(async move |conn| {
                        diesel::sql_query($insert)
                            .bind::<BigInt, _>(order_id)
                            .execute(conn)
                            .await?;
                        Ok(())
                    })
                    .await?;
                    let bare = started.elapsed();
                    order_id += 1;
                    let mut probe = Probe {
                        id: format!("cost-{}", order_id % 1000),
                        pending_events: PendingEvents::new(),
                    };
                    probe.record(tick(order_id as u64));
                    let started = Instant::now();
                    outbox
                        .transaction(&mut conn, async |uow| {
                            diesel::sql_query($insert)
                                .bind::<BigInt, _>(order_id)
                                .execute(uow.conn())
                                .await?;
                            uow.track(&mut probe);
                            Ok::<_, UnitOfWorkError>(())
                        })
                        .await?;
                    if round >= 100 {
                        times[0].push(bare.as_secs_f64() * 1e3);
                        times[1].push(started.elapsed().as_secs_f64() * 1e3);
                    }
                }
                Ok(times.map(|mut samples| {
                    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
                    samples.sort_by(f64::total_cmp);
                    (mean, samples[samples.len() / 2])
                }))
            }

            /// Queues `events` over `aggregates` whose ids begin with `name`, in units of
            /// work of 100 events.
            pub async fn seed(
                url: &str,
                outbox: &Outbox,
                name: &str,
                events: usize,
                aggregates: usize,
            ) -> Result<(), BoxError> {
                let mut conn = conn(url).await?;
                let mut probes: Vec<Probe> = (0..aggregates)
                    .map(|i| Probe {
                        id: format!("{name}-{i}"),
                        pending_events: PendingEvents::new(),
                    })
                    .collect();
                for chunk in (0..events).collect::<Vec<_>>().chunks(100) {
                    outbox
                        .transaction(&mut conn, async |uow| {
                            for &n in chunk {
                                let probe = &mut probes[n % aggregates];
                                probe.record(tick(n as u64));
                                uow.track(probe);
                            }
                            Ok::<_, UnitOfWorkError>(())
                        })
                        .await?;
                }
                Ok(())
            }

            /// Figure 5: how long an inbox on `url` takes to apply every message of
            /// `topology`'s stream.
            pub async fn consume(
                url: &str,
                nats: async_nats::Client,
                topology: Topology,
                concurrency: usize,
            ) -> Result<Duration, BoxError> {
                let mut config = InboxConfig::new("bench", url);
                config.max_concurrency = concurrency;
                config.outbox = Outbox::with_topology(topology.clone());
                config.topology = topology;
                let inbox: Inbox<Applier<$conn>, $conn> =
                    Inbox::connect(config, nats, Applier(std::marker::PhantomData)).await?;
                let mut durable = inbox.consumer().clone();
                let started = Instant::now();
                let running = inbox.spawn();
                loop {
                    let info = durable.info().await?;
                    if info.num_pending == 0 && info.num_ack_pending == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let took = started.elapsed();
                running.shutdown().await?;
                Ok(took)
            }

            pub async fn spawn_relay(
                config: RelayConfig,
                nats: async_nats::Client,
            ) -> Result<RelayHandle, BoxError> {
                Ok(<$relay>::connect(config, nats).await?.spawn())
            }

            /// Figure 4b: the archive replayed as `config` says.
            pub async fn replay(
                url: &str,
                config: &ReplayConfig,
                nats: async_nats::Client,
            ) -> Result<ReplayReport, BoxError> {
                let mut conn = conn(url).await?;
                Ok(replay_archive(&mut conn, nats, config, |_| {}).await?)
            }

            /// Figure 3's writers: commit one event at each tick until `duration` has passed;
            /// returns each event's commit time.
            pub async fn write(
                url: String,
                outbox: Outbox,
                writer: u64,
                writers: u64,
                period: Duration,
                duration: Duration,
            ) -> Result<Vec<(u64, SystemTime)>, BoxError> {
                let mut conn = conn(&url).await?;
                let mut ticks = tokio::time::interval(period);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                let started = Instant::now();
                let mut committed = Vec::new();
                let mut n = 1_000_000_000 + writer;
                while started.elapsed() < duration {
                    ticks.tick().await;
                    let mut probe = Probe {
                        id: format!("lat-{}", n % 100),
                        pending_events: PendingEvents::new(),
                    };
                    probe.record(tick(n));
                    outbox
                        .transaction(&mut conn, async |uow| {
                            uow.track(&mut probe);
                            Ok::<_, UnitOfWorkError>(())
                        })
                        .await?;
                    committed.push((n, SystemTime::now()));
                    n += writers;
                }
                Ok(committed)
            }
        }
    };
}

/// diesel-async's own connect, for the servers.
async fn establish<C: AsyncConnection>(url: &str) -> Result<C, BoxError> {
    Ok(C::establish(url).await?)
}

/// The toolkit's SQLite connection: write-ahead log and a busy timeout.
async fn establish_sqlite(url: &str) -> Result<AsyncSqliteConnection, BoxError> {
    Ok(AsyncSqliteConnection::new(
        outbox_runtime::sqlite::establish(url)?,
    ))
}

backend!(
    pg,
    AsyncPgConnection,
    establish,
    Relay,
    "INSERT INTO bench_orders VALUES ($1, 4200)",
    "CREATE TABLE bench_orders (id bigint PRIMARY KEY, total_cents bigint NOT NULL)"
);
backend!(
    my,
    AsyncMysqlConnection,
    establish,
    MysqlRelay,
    "INSERT INTO bench_orders VALUES (?, 4200)",
    "CREATE TABLE bench_orders (id BIGINT PRIMARY KEY, total_cents BIGINT NOT NULL) ENGINE = InnoDB"
);
backend!(
    lite,
    AsyncSqliteConnection,
    establish_sqlite,
    SqliteRelay,
    "INSERT INTO bench_orders VALUES (?, 4200)",
    "CREATE TABLE bench_orders (id INTEGER PRIMARY KEY, total_cents INTEGER NOT NULL)"
);

/// The database a run works on.
enum Database {
    /// The test kit's PostgreSQL database (`TestEnv`).
    Postgres,
    Mysql(MysqlDatabase),
    /// A SQLite file.
    Sqlite(String),
}

/// Calls `$module::$f($args)` for the backend of `$database`.
macro_rules! on {
    ($database:expr, $f:ident($($arg:expr),*)) => {
        match $database {
            Database::Postgres => pg::$f($($arg),*).await,
            Database::Mysql(_) => my::$f($($arg),*).await,
            Database::Sqlite(_) => lite::$f($($arg),*).await,
        }
    };
}

/// A throwaway MySQL database.
struct MysqlDatabase {
    admin_url: String,
    name: String,
    url: String,
}

impl MysqlDatabase {
    async fn create() -> Result<Self, BoxError> {
        let admin_url = std::env::var("OUTBOX_TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
        let name = format!(
            "outbox_bench_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        AsyncMysqlConnection::establish(&admin_url)
            .await?
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await?;
        let (server, _) = admin_url.rsplit_once('/').ok_or("a URL with a database")?;
        let url = format!("{server}/{name}");
        outbox_runtime::mysql::run_migrations(&url).await?;
        Ok(Self {
            admin_url,
            name,
            url,
        })
    }

    async fn drop_database(self) -> Result<(), BoxError> {
        AsyncMysqlConnection::establish(&self.admin_url)
            .await?
            .batch_execute(&format!("DROP DATABASE {}", self.name))
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    println!(
        "outbox per backend: {} transactions, {} events over {} aggregates, {} events/s for {} s",
        args.transactions, args.events, args.aggregates, args.rate, args.latency_secs
    );
    for backend in &args.backends {
        // The stream, prefix and (for PostgreSQL) database of this backend's run.
        let env = TestEnv::new().await;
        let outbox = env.outbox();
        let database = match backend.as_str() {
            "postgres" => Database::Postgres,
            "mysql" => Database::Mysql(MysqlDatabase::create().await?),
            "sqlite" => {
                let path = std::env::temp_dir()
                    .join(format!("outbox-bench-{}.db", uuid::Uuid::new_v4().simple()))
                    .to_string_lossy()
                    .into_owned();
                outbox_runtime::sqlite::run_migrations(&mut outbox_runtime::sqlite::establish(
                    &path,
                )?)?;
                Database::Sqlite(path)
            }
            other => {
                return Err(format!("unknown backend {other:?} (postgres, mysql, sqlite)").into());
            }
        };
        let url = match &database {
            Database::Postgres => env.database_url.clone(),
            Database::Mysql(db) => db.url.clone(),
            Database::Sqlite(path) => path.clone(),
        };
        let mut config = env.relay_config();
        config.database_url = url.clone();
        config.poll_interval = Duration::from_millis(500);
        println!("\n== {backend}");

        let [bare, unit] = on!(&database, cost(&url, &outbox, args.transactions))?;
        println!(
            "1. unit of work, 1 event: mean {:.3} ms, median {:.3} ms; bare transaction \
             {:.3} / {:.3} ms; ratio {:.2}x (mean), {:.2}x (median)",
            unit.0,
            unit.1,
            bare.0,
            bare.1,
            unit.0 / bare.0,
            unit.1 / bare.1
        );

        on!(
            &database,
            seed(&url, &outbox, "seed", args.events, args.aggregates)
        )?;
        let started = Instant::now();
        let relay = on!(&database, spawn_relay(config.clone(), env.nats.clone()))?;
        // Figure 1's events are queued too: (100 + transactions), drained with the seed.
        let queued = args.transactions + 100 + args.events;
        env.until_stream_holds(queued as u64, Duration::from_secs(600))
            .await;
        let drained = started.elapsed();
        println!(
            "2. relay throughput: {queued} events in {:.2?}: {:.0} events/s",
            drained,
            queued as f64 / drained.as_secs_f64()
        );

        let mut stream = env.jetstream().get_stream(&env.stream).await?;
        let first_new = stream.info().await?.state.last_sequence + 1;
        const WRITERS: u64 = 4;
        let period = Duration::from_secs_f64(WRITERS as f64 / args.rate as f64);
        let duration = Duration::from_secs(args.latency_secs);
        let writers: Vec<_> = (0..WRITERS)
            .map(|writer| {
                let (url, outbox) = (url.clone(), outbox.clone());
                let write = match &database {
                    Database::Postgres => {
                        pg::write(url, outbox, writer, WRITERS, period, duration).boxed()
                    }
                    Database::Mysql(_) => {
                        my::write(url, outbox, writer, WRITERS, period, duration).boxed()
                    }
                    Database::Sqlite(_) => {
                        lite::write(url, outbox, writer, WRITERS, period, duration).boxed()
                    }
                };
                tokio::spawn(write)
            })
            .collect();
        let mut committed: HashMap<u64, SystemTime> = HashMap::new();
        for writer in writers {
            committed.extend(writer.await??);
        }
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: first_new,
                },
                ..Default::default()
            })
            .await?;
        let mut messages = consumer.messages().await?;
        let mut latencies = Vec::with_capacity(committed.len());
        while latencies.len() < committed.len() {
            let message = tokio::time::timeout(Duration::from_secs(30), messages.next())
                .await?
                .ok_or("the consumer ended")??;
            let stored = message.info()?.published;
            let event: Ticked = serde_json::from_slice(&message.payload)?;
            let commit = time::OffsetDateTime::from(committed[&event.n]);
            latencies.push((stored - commit).as_seconds_f64() * 1e3);
        }
        relay.shutdown().await?;
        latencies.sort_by(f64::total_cmp);
        let percentile = |p: f64| latencies[((latencies.len() - 1) as f64 * p).round() as usize];
        println!(
            "3. commit-to-ack, {} events at {:.0} events/s offered: p50 {:.1} ms, p99 {:.1} ms, \
             max {:.1} ms",
            latencies.len(),
            latencies.len() as f64 / duration.as_secs_f64(),
            percentile(0.5),
            percentile(0.99),
            latencies[latencies.len() - 1]
        );

        // Figure 4: figure 2's drain again, deleting and then archiving, so that the two
        // ways meet the same table (a first drain on a fresh database can run at another pace).
        for (name, published) in [
            ("deleting", PublishedRows::Delete),
            ("archiving", PublishedRows::Archive),
        ] {
            on!(
                &database,
                seed(&url, &outbox, "seed", args.events, args.aggregates)
            )?;
            let before = stream.info().await?.state.messages;
            let mut config = config.clone();
            config.published = published;
            let started = Instant::now();
            let relay = on!(&database, spawn_relay(config, env.nats.clone()))?;
            env.until_stream_holds(before + args.events as u64, Duration::from_secs(600))
                .await;
            let drained = started.elapsed();
            relay.shutdown().await?;
            println!(
                "4. relay throughput, {name} ({published:?}): {} events in {:.2?}: {:.0} events/s",
                args.events,
                drained,
                args.events as f64 / drained.as_secs_f64()
            );
        }

        // Figure 4b: the archive figure 4 filled, replayed to a stream of its own.
        let replay = ReplayConfig::new(
            env.prefix.parse()?,
            Topology::new(
                format!("{}re", env.prefix).parse()?,
                StreamSettings {
                    name: format!("{}_RE", env.stream),
                    ..StreamSettings::default()
                },
            ),
        );
        let started = Instant::now();
        let replayed = on!(&database, replay(&url, &replay, env.nats.clone()));
        let took = started.elapsed();
        let _ = async_nats::jetstream::new(env.nats.clone())
            .delete_stream(&replay.to.stream.name)
            .await;
        let replayed = replayed?;
        println!(
            "4b. archive replay: {} events in {took:.2?}: {:.0} events/s",
            replayed.published,
            replayed.published as f64 / took.as_secs_f64()
        );

        // Figure 5: the inbox on this database, reading a stream of its own.
        let topology = Topology::new(
            format!("{}in", env.prefix).parse()?,
            StreamSettings {
                name: format!("{}_IN", env.stream),
                ..StreamSettings::default()
            },
        );
        let inbox_outbox = Outbox::with_topology(topology.clone());
        on!(
            &database,
            // Aggregates of their own: their first events are sequence 1, as a consumer
            // that follows a stream from its start sees them (on figure 2's aggregates, each
            // first event would be applied over a gap after a lookup in the stream).
            seed(
                &url,
                &inbox_outbox,
                "inbox",
                args.inbox_events,
                args.aggregates
            )
        )?;
        let mut inbox_relay = config.clone();
        inbox_relay.topology = topology.clone();
        let relay = on!(&database, spawn_relay(inbox_relay, env.nats.clone()))?;
        loop {
            if let Ok(mut stream) = env.jetstream().get_stream(&topology.stream.name).await
                && stream.info().await?.state.messages == args.inbox_events as u64
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        relay.shutdown().await?;
        let took = on!(
            &database,
            consume(
                &url,
                env.nats.clone(),
                topology.clone(),
                args.inbox_concurrency
            )
        )?;
        println!(
            "5. inbox throughput, one instance, max_concurrency {}: {} events in {:.2?}: \
             {:.0} events/s",
            args.inbox_concurrency,
            args.inbox_events,
            took,
            args.inbox_events as f64 / took.as_secs_f64()
        );
        env.jetstream().delete_stream(&topology.stream.name).await?;

        match database {
            Database::Postgres => {}
            Database::Mysql(db) => db.drop_database().await?,
            Database::Sqlite(path) => {
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{path}{suffix}"));
                }
            }
        }
    }
    Ok(())
}
