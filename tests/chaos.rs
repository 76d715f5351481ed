//! The chaos run: the whole promise under real processes and real faults.
//!
//! Writers commit units of work over a few hundred aggregates, about a tenth of them rolled
//! back (some by the closure, some failing at COMMIT itself on a deferred constraint, after
//! the outbox's insert ran). Three relay processes (the third archiving what it publishes,
//! `PublishedRows::Archive`, the others deleting it) and two instances of one inbox consumer
//! (processes too: this same binary, started with `OUTBOX_CHAOS_ROLE`) move the events.
//! Meanwhile: relays are SIGKILLed and restarted at random, the consumer's instances are
//! SIGKILLed and stopped with SIGTERM (a deploy) and restarted, the relays' and consumers'
//! database connections are terminated with `pg_terminate_backend`, and the run's own
//! nats-server (own port and store, never the shared one) is killed and restarted, twice at
//! least, once for more than 30 s.
//!
//! Then the writers stop, everything drains (bounded), and the run checks: every committed
//! event is in the stream exactly once; nothing of a rolled-back unit of work is anywhere;
//! each aggregate's events are in the stream in order without gaps; the consumer applied
//! each event exactly once and in its aggregate's order; nothing is left queued, nothing
//! dead-lettered, no gap recorded; what was archived was committed, once. It prints its
//! counts, so that a run documents itself.
//!
//! `cargo test --test chaos` runs it for 90 s (about two minutes with the drain); `cargo test
//! --test chaos -- --duration 600` runs it for ten minutes. Other flags: `--aggregates N`
//! (300), `--rate EVENTS_PER_S` (300), `--seed N`.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_runtime::{
    DomainEvent, Handler, Inbox, InboxConfig, Metadata, PendingEvents, PublishedRows, Relay,
    RelayConfig, StreamSettings, Topology, UnitOfWork, UnitOfWorkError, aggregate,
};
use serde::{Deserialize, Serialize};
use support::{NatsServer, TestEnv};
use tokio::signal::unix::{SignalKind, signal};

/// The run's one event: a booking, carrying a token the writer chose, unique per event.
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
enum LedgerEvent {
    Booked { token: String },
}

#[aggregate]
struct Account {
    id: String,
    pending_events: PendingEvents<LedgerEvent>,
}

const ROLE: &str = "OUTBOX_CHAOS_ROLE";
const CONSUMER: &str = "chaos";

fn main() -> ExitCode {
    match std::env::var(ROLE).as_deref() {
        Ok("relay") => child(relay_process),
        Ok("consumer") => child(consumer_process),
        _ => orchestrate(),
    }
}

// ---------------------------------------------------------------------------------------
// The child processes.

/// What a child reads from its environment.
struct ChildEnv {
    database_url: String,
    nats_url: String,
    prefix: String,
    stream: String,
    stats: PathBuf,
}

impl ChildEnv {
    /// The run's prefix and stream (created by the test, before the processes).
    fn topology(&self) -> Topology {
        Topology::new(
            self.prefix.parse().expect("a valid prefix"),
            StreamSettings {
                name: self.stream.clone(),
                create: false,
                ..StreamSettings::default()
            },
        )
    }

    fn read() -> Self {
        let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is set"));
        Self {
            database_url: var("OUTBOX_CHAOS_DATABASE_URL"),
            nats_url: var("OUTBOX_CHAOS_NATS_URL"),
            prefix: var("OUTBOX_CHAOS_PREFIX"),
            stream: var("OUTBOX_CHAOS_STREAM"),
            stats: var("OUTBOX_CHAOS_STATS").into(),
        }
    }
}

/// Runs a child: logs to stderr, its counters to its stats file every 500 ms and at exit;
/// exit 0 after a graceful stop on SIGTERM.
fn child<F, Fut>(role: F) -> ExitCode
where
    F: FnOnce(ChildEnv) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .init();
    let env = ChildEnv::read();
    let stats = env.stats.clone();
    let counters = support::counters::Counters::installed();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let outcome = runtime.block_on(async {
        let dump = tokio::spawn({
            let stats = stats.clone();
            async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    write_stats(&stats, &counters.all());
                }
            }
        });
        let outcome = role(env).await;
        dump.abort();
        outcome
    });
    write_stats(&stats, &counters.all());
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("chaos child failed: {error}");
            ExitCode::FAILURE
        }
    }
}

fn write_stats(path: &Path, counters: &BTreeMap<String, u64>) {
    let text: String = counters
        .iter()
        .map(|(key, value)| format!("{key} {value}\n"))
        .collect();
    let temporary = path.with_extension("tmp");
    if std::fs::write(&temporary, text).is_ok() {
        let _ = std::fs::rename(temporary, path);
    }
}

/// Retries `connect` every 500 ms until it succeeds, or returns `None` on SIGTERM: a
/// process that starts while the broker or the database is away waits for them.
async fn connect_until<T, Fut>(
    sigterm: &mut tokio::signal::unix::Signal,
    what: &str,
    mut connect: impl FnMut() -> Fut,
) -> Option<T>
where
    Fut: std::future::Future<Output = Result<T, String>>,
{
    loop {
        tokio::select! {
            _ = sigterm.recv() => return None,
            connected = connect() => match connected {
                Ok(value) => return Some(value),
                Err(error) => tracing::warn!(%error, "{what} cannot start yet; retrying"),
            },
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn relay_process(env: ChildEnv) -> Result<(), String> {
    let mut sigterm = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut config = RelayConfig::new(&env.database_url);
    config.topology = env.topology();
    config.source = "/chaos".to_owned();
    if std::env::var("OUTBOX_CHAOS_ARCHIVE").is_ok() {
        config.published = PublishedRows::Archive;
    }
    config.batch_size = 500;
    config.poll_interval = Duration::from_millis(100);
    config.ack_timeout = Duration::from_secs(2);
    config.max_backoff = Duration::from_secs(2);
    config.connect_timeout = Duration::from_secs(5);
    config.statement_timeout = Duration::from_secs(5);
    let relay = connect_until(&mut sigterm, "the relay", || async {
        let nats = outbox_runtime::nats::connect(&env.nats_url)
            .await
            .map_err(|e| e.to_string())?;
        Relay::connect(config.clone(), nats)
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let Some(relay) = relay else {
        return Ok(());
    };
    relay
        .run(async move {
            sigterm.recv().await;
        })
        .await
        .map_err(|e| e.to_string())
}

/// Applies each booking: one row per event, numbered in the order of the transactions that
/// applied them.
struct Applying;

impl Handler for Applying {
    type Event = LedgerEvent;
    type Error = diesel::result::Error;

    async fn handle(
        &self,
        event: LedgerEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        let LedgerEvent::Booked { token } = event;
        diesel::sql_query("INSERT INTO chaos_applied (aggregate, seq, token) VALUES ($1, $2, $3)")
            .bind::<diesel::sql_types::Text, _>(message.aggregate_id.as_str())
            .bind::<diesel::sql_types::Int8, _>(message.sequence)
            .bind::<diesel::sql_types::Text, _>(token)
            .execute(uow.conn())
            .await?;
        Ok(())
    }
}

async fn consumer_process(env: ChildEnv) -> Result<(), String> {
    let mut sigterm = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut config = InboxConfig::new(CONSUMER, &env.database_url);
    config.topology = env.topology();
    config.ack_wait = Duration::from_secs(2);
    config.retry_delay = Duration::from_millis(100);
    config.max_retry_delay = Duration::from_secs(1);
    config.connect_timeout = Duration::from_secs(5);
    config.statement_timeout = Duration::from_secs(5);
    let inbox = connect_until(&mut sigterm, "the inbox", || async {
        let nats = outbox_runtime::nats::connect(&env.nats_url)
            .await
            .map_err(|e| e.to_string())?;
        Inbox::connect(config.clone(), nats, Applying)
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let Some(inbox) = inbox else {
        return Ok(());
    };
    inbox
        .run(async move {
            sigterm.recv().await;
        })
        .await
        .map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------------------
// The orchestrator.

struct Options {
    duration: Duration,
    aggregates: usize,
    rate: f64,
    seed: u64,
    /// Whether to run at all: libtest's arguments select it as they select a test named
    /// `chaos` (`cargo test some_test` and `--skip chaos` skip it, `--skip some_test` does
    /// not: `support::libtest`), and `--list` lists it.
    skip: bool,
    list: bool,
}

impl Options {
    fn parse() -> Self {
        let mut options = Self {
            duration: Duration::from_secs(90),
            aggregates: 300,
            rate: 300.0,
            seed: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
            skip: false,
            list: false,
        };
        // cargo test may pass its own flags (--nocapture, a filter): only ours are read.
        let args: Vec<String> = std::env::args().collect();
        let value = |flag: &str| {
            args.iter()
                .position(|arg| arg == flag)
                .and_then(|at| args.get(at + 1))
        };
        if let Some(secs) = value("--duration").and_then(|v| v.parse().ok()) {
            options.duration = Duration::from_secs(secs);
        }
        if let Some(n) = value("--aggregates").and_then(|v| v.parse().ok()) {
            options.aggregates = n;
        }
        if let Some(rate) = value("--rate").and_then(|v| v.parse().ok()) {
            options.rate = rate;
        }
        if let Some(seed) = value("--seed").and_then(|v| v.parse().ok()) {
            options.seed = seed;
        }
        const VALUED: [&str; 4] = ["--duration", "--aggregates", "--rate", "--seed"];
        options.skip =
            !support::libtest::selects("chaos", args.get(1..).unwrap_or_default(), &VALUED);
        options.list = args.iter().any(|arg| arg == "--list");
        options
    }
}

fn orchestrate() -> ExitCode {
    let options = Options::parse();
    if options.list {
        // Listed where it would run (`--list --ignored` lists ignored tests only).
        if !options.skip {
            println!("chaos: test");
        }
        return ExitCode::SUCCESS;
    }
    if options.skip {
        println!("chaos run: filtered out");
        return ExitCode::SUCCESS;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    match runtime.block_on(run(&options)) {
        Ok(report) => {
            println!("{report}");
            println!("chaos run: every check held");
            ExitCode::SUCCESS
        }
        Err(failure) => {
            eprintln!("{failure}");
            eprintln!("chaos run FAILED (seed {})", options.seed);
            ExitCode::FAILURE
        }
    }
}

/// A child process of the run.
struct Process {
    role: &'static str,
    index: usize,
    child: Option<std::process::Child>,
    starts: usize,
}

/// The children, and how to start them.
struct Fleet {
    exe: PathBuf,
    dir: PathBuf,
    nats_url: String,
    prefix: String,
    stream: String,
    producer_url: String,
    consumer_url: String,
    relays: Vec<Process>,
    consumers: Vec<Process>,
    /// Exits that were not the run's doing.
    unexpected: Vec<String>,
}

impl Fleet {
    fn process(&mut self, role: &str, index: usize) -> &mut Process {
        match role {
            "relay" => &mut self.relays[index],
            _ => &mut self.consumers[index],
        }
    }

    /// Starts the child `role` `index` (again), logging to `{role}-{index}.log` and writing
    /// its counters to a stats file of this start's own.
    fn launch(&mut self, role: &'static str, index: usize) {
        let starts = self.process(role, index).starts;
        let name = format!("{role}-{index}");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))
            .expect("a log file");
        let database_url = if role == "relay" {
            &self.producer_url
        } else {
            &self.consumer_url
        };
        let child = std::process::Command::new(&self.exe)
            .env(ROLE, role)
            .env("OUTBOX_CHAOS_DATABASE_URL", database_url)
            .env("OUTBOX_CHAOS_NATS_URL", &self.nats_url)
            .env("OUTBOX_CHAOS_PREFIX", &self.prefix)
            .env("OUTBOX_CHAOS_STREAM", &self.stream)
            .env(
                "OUTBOX_CHAOS_STATS",
                self.dir.join(format!("{name}-{starts}.stats")),
            )
            .envs(
                (role == "relay" && index == ARCHIVING_RELAY)
                    .then_some(("OUTBOX_CHAOS_ARCHIVE", "1")),
            )
            .stdout(log.try_clone().expect("the log"))
            .stderr(log)
            .spawn()
            .expect("start a child");
        let process = self.process(role, index);
        process.child = Some(child);
        process.starts += 1;
    }

    /// Sends `sig` and waits for the process to end; returns its exit status.
    async fn stop(
        &mut self,
        role: &'static str,
        index: usize,
        sig: &str,
    ) -> Option<std::process::ExitStatus> {
        let mut child = self.process(role, index).child.take()?;
        support::signal(child.id(), sig);
        tokio::task::spawn_blocking(move || child.wait().ok())
            .await
            .ok()
            .flatten()
    }

    /// Notes children that ended without being told to, and starts them again.
    fn check(&mut self) {
        let mut ended = Vec::new();
        for process in self.relays.iter_mut().chain(self.consumers.iter_mut()) {
            if let Some(child) = &mut process.child
                && let Ok(Some(status)) = child.try_wait()
            {
                ended.push((process.role, process.index, status));
                process.child = None;
            }
        }
        for (role, index, status) in ended {
            self.unexpected
                .push(format!("{role} {index} exited on its own: {status}"));
            self.launch(role, index);
        }
    }
}

/// What the run did, for its report.
#[derive(Default)]
struct Counts {
    units_committed: u64,
    units_rolled_back: u64,
    units_failed_at_commit: u64,
    relay_kills: u64,
    consumer_kills: u64,
    consumer_stops: u64,
    broker_outages: Vec<Duration>,
    terminations: u64,
    terminated_connections: i64,
}

/// The relay that archives what it publishes (`PublishedRows::Archive`).
const ARCHIVING_RELAY: usize = 2;

/// The writers' record: each committed event's token and aggregate, the tokens of
/// rolled-back units of work, and how many units of work ended each way.
#[derive(Default)]
struct Ledger {
    committed: Vec<(String, String)>,
    rolled_back: Vec<String>,
    units_committed: u64,
    units_rolled_back: u64,
    units_failed_at_commit: u64,
}

async fn run(options: &Options) -> Result<String, String> {
    let started = Instant::now();
    let mut rng = fastrand::Rng::with_seed(options.seed);
    let mut server = NatsServer::start().await;
    let producer = TestEnv::with_nats(&server.url()).await;
    let consumer = TestEnv::with_nats(&server.url()).await;
    let dir = std::env::temp_dir().join(format!("outbox-chaos-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;

    let mut conn = producer.conn().await;
    conn.batch_execute(
        "CREATE TABLE chaos_ledger (token text PRIMARY KEY, aggregate text NOT NULL); \
         CREATE TABLE chaos_poison (k bigint, \
             CONSTRAINT chaos_poison_k UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)",
    )
    .await
    .map_err(|e| e.to_string())?;
    consumer
        .conn()
        .await
        .batch_execute(
            "CREATE TABLE chaos_applied (n bigserial PRIMARY KEY, aggregate text NOT NULL, \
             seq bigint NOT NULL, token text NOT NULL)",
        )
        .await
        .map_err(|e| e.to_string())?;
    producer.create_stream(Duration::from_secs(120)).await;

    let mut fleet = Fleet {
        exe: std::env::current_exe().map_err(|e| e.to_string())?,
        dir: dir.clone(),
        nats_url: server.url(),
        prefix: producer.prefix.clone(),
        stream: producer.stream.clone(),
        producer_url: producer.database_url.clone(),
        consumer_url: consumer.database_url.clone(),
        relays: (0..3)
            .map(|index| Process {
                role: "relay",
                index,
                child: None,
                starts: 0,
            })
            .collect(),
        consumers: (0..2)
            .map(|index| Process {
                role: "consumer",
                index,
                child: None,
                starts: 0,
            })
            .collect(),
        unexpected: Vec::new(),
    };
    for index in 0..3 {
        fleet.launch("relay", index);
    }
    for index in 0..2 {
        fleet.launch("consumer", index);
    }

    // The writers.
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop_writing = tokio_util::sync::CancellationToken::new();
    const WRITERS: u64 = 4;
    let mut writers = Vec::new();
    for writer in 0..WRITERS {
        let (url, outbox) = (producer.database_url.clone(), producer.outbox());
        let (ledger, stop) = (Arc::clone(&ledger), stop_writing.clone());
        let aggregates = options.aggregates;
        // Two events a unit of work on average, so this pause gives the rate asked for.
        let pause = Duration::from_secs_f64(WRITERS as f64 * 2.0 / options.rate);
        let seed = options.seed.wrapping_add(writer + 1);
        writers.push(tokio::spawn(async move {
            write(url, outbox, aggregates, pause, seed, ledger, stop).await
        }));
    }

    // The faults.
    let mut counts = Counts::default();
    let deadline = started + options.duration;
    let secs = |s: f64| Duration::from_secs_f64(s);
    let mut next_relay_kill = Instant::now() + secs(rng.f64() * 3.0 + 1.5);
    let mut next_terminate = Instant::now() + secs(rng.f64() * 4.0 + 4.0);
    let mut next_consumer = Instant::now() + secs(rng.f64() * 7.0 + 8.0);
    let mut outages = broker_schedule(options.duration, started);
    let mut consumer_faults = 0_u64;
    let terminate_sql = format!(
        "SELECT count(pg_terminate_backend(pid)) AS count FROM pg_stat_activity \
         WHERE datname IN ('{}', '{}') AND application_name IN ('outbox-relay', 'outbox-inbox')",
        db_name(&producer.database_url),
        db_name(&consumer.database_url)
    );
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        fleet.check();
        let now = Instant::now();
        if now >= next_relay_kill {
            let index = rng.usize(0..3);
            if fleet.stop("relay", index, "KILL").await.is_some() {
                counts.relay_kills += 1;
            }
            tokio::time::sleep(secs(rng.f64() * 0.9 + 0.1)).await;
            fleet.launch("relay", index);
            next_relay_kill = Instant::now() + secs(rng.f64() * 3.0 + 1.5);
        }
        if now >= next_terminate {
            #[derive(QueryableByName)]
            struct Terminated {
                #[diesel(sql_type = diesel::sql_types::Int8)]
                count: i64,
            }
            if let Ok(done) = diesel::sql_query(&terminate_sql)
                .get_result::<Terminated>(&mut conn)
                .await
            {
                counts.terminations += 1;
                counts.terminated_connections += done.count;
            }
            next_terminate = Instant::now() + secs(rng.f64() * 4.0 + 4.0);
        }
        if now >= next_consumer {
            let index = rng.usize(0..2);
            // The first fault of each kind early, then either at random.
            let kill = match consumer_faults {
                0 => true,
                1 => false,
                _ => rng.bool(),
            };
            consumer_faults += 1;
            if kill {
                if fleet.stop("consumer", index, "KILL").await.is_some() {
                    counts.consumer_kills += 1;
                }
            } else {
                match fleet.stop("consumer", index, "TERM").await {
                    Some(status) if status.success() => counts.consumer_stops += 1,
                    Some(status) => fleet
                        .unexpected
                        .push(format!("consumer {index} exited {status} on SIGTERM")),
                    None => {}
                }
            }
            tokio::time::sleep(secs(rng.f64() * 1.3 + 0.2)).await;
            fleet.launch("consumer", index);
            next_consumer = Instant::now() + secs(rng.f64() * 7.0 + 8.0);
        }
        if let Some(&(at, length)) = outages.front()
            && now >= at
        {
            outages.pop_front();
            server.stop();
            let down = Instant::now();
            let back = down + length;
            // The rest of the chaos goes on while the broker is away.
            while Instant::now() < back {
                tokio::time::sleep(Duration::from_millis(200)).await;
                fleet.check();
                if Instant::now() >= next_relay_kill {
                    let index = rng.usize(0..3);
                    if fleet.stop("relay", index, "KILL").await.is_some() {
                        counts.relay_kills += 1;
                    }
                    fleet.launch("relay", index);
                    next_relay_kill = Instant::now() + secs(rng.f64() * 3.0 + 1.5);
                }
            }
            server.restart().await;
            counts.broker_outages.push(down.elapsed());
        }
    }

    // Drain.
    stop_writing.cancel();
    for writer in writers {
        writer.await.map_err(|e| e.to_string())??;
    }
    let writing_stopped = Instant::now();
    let (committed, rolled_back) = {
        let ledger = ledger.lock().unwrap();
        counts.units_committed = ledger.units_committed;
        counts.units_rolled_back = ledger.units_rolled_back;
        counts.units_failed_at_commit = ledger.units_failed_at_commit;
        (ledger.committed.clone(), ledger.rolled_back.clone())
    };
    let drain_limit = Duration::from_secs(180);
    let mut consumer_conn = consumer.conn().await;
    let drained = loop {
        fleet.check();
        let queued = count(&mut conn, "SELECT count(*) AS count FROM outbox_events").await;
        let applied = count(
            &mut consumer_conn,
            "SELECT count(*) AS count FROM chaos_applied",
        )
        .await;
        if queued == 0 && applied == committed.len() as i64 {
            break Ok(writing_stopped.elapsed());
        }
        if writing_stopped.elapsed() > drain_limit {
            break Err(format!(
                "not drained after {drain_limit:?}: {queued} queued, {applied} of {} applied",
                committed.len()
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for index in 0..3 {
        if let Some(status) = fleet.stop("relay", index, "TERM").await
            && !status.success()
        {
            fleet
                .unexpected
                .push(format!("relay {index} exited {status} on SIGTERM"));
        }
    }
    for index in 0..2 {
        if let Some(status) = fleet.stop("consumer", index, "TERM").await
            && !status.success()
        {
            fleet
                .unexpected
                .push(format!("consumer {index} exited {status} on SIGTERM"));
        }
    }

    // Check.
    let mut violations: Vec<String> = fleet.unexpected.clone();
    let drain = match drained {
        Ok(drain) => drain,
        Err(failure) => {
            violations.push(failure);
            writing_stopped.elapsed()
        }
    };
    let messages = producer.stream_messages().await;
    let events: Vec<Streamed> = messages.iter().map(Streamed::read).collect();
    violations.extend(check_stream(&events, &committed, &rolled_back));
    let applied = applied_rows(&mut consumer_conn).await;
    violations.extend(check_applied(&applied, &committed, &rolled_back));
    for (what, sql, conn) in [
        (
            "rows left in the outbox",
            "SELECT count(*) AS count FROM outbox_events",
            &mut conn,
        ),
        (
            "consumer dead letters",
            "SELECT count(*) AS count FROM outbox_inbox_dead_letters",
            &mut consumer_conn,
        ),
    ] {
        let n = count(conn, sql).await;
        if n != 0 {
            violations.push(format!("{n} {what}"));
        }
    }
    let archived = archived_tokens(&mut conn).await;
    violations.extend(check_archived(&archived, &committed));
    let gaps = count(
        &mut consumer_conn,
        "SELECT count(*) AS count FROM outbox_inbox_gaps",
    )
    .await;
    if gaps != 0 {
        violations.push(format!("{gaps} gaps recorded by the consumer"));
    }
    let stats = read_stats(&dir);
    let sum = |prefix: &str| -> u64 {
        stats
            .iter()
            .filter(|(key, _)| key.starts_with(prefix))
            .map(|(_, value)| value)
            .sum()
    };
    let distinct_ids: BTreeSet<&str> = events.iter().map(|e| e.id.as_str()).collect();
    let rolled_back_events = rolled_back.len();
    let report = format!(
        "chaos run: {:?} of faults (seed {}), {} aggregates, {:.0} committed events/s \
         (--rate {})\n\
         committed: {} units of work, {} events; rolled back: {} units ({} of them failing at \
         COMMIT, after the outbox insert), {} events\n\
         published: {} messages in the stream, {} distinct ids; duplicates dropped by \
         JetStream: at least {}; archived by relay {ARCHIVING_RELAY}: {}\n\
         applied: {} events by the consumer's two instances; duplicates skipped by the inbox: \
         at least {}; waits for a predecessor: at least {}\n\
         faults: relay SIGKILL {}; consumer SIGKILL {}, SIGTERM {}; broker killed {} times \
         (outages {:?}); pg_terminate_backend {} rounds, {} connections\n\
         drain: {:.1} s after the writers stopped; whole run {:.0} s\n\
         violations: {}",
        options.duration,
        options.seed,
        options.aggregates,
        committed.len() as f64 / options.duration.as_secs_f64(),
        options.rate,
        counts.units_committed,
        committed.len(),
        counts.units_rolled_back,
        counts.units_failed_at_commit,
        rolled_back_events,
        events.len(),
        distinct_ids.len(),
        sum("outbox_relay_duplicates_total"),
        archived.len(),
        applied.len(),
        sum("outbox_inbox_messages_total{consumer=chaos,outcome=duplicate}"),
        sum("outbox_inbox_messages_total{consumer=chaos,outcome=held}"),
        counts.relay_kills,
        counts.consumer_kills,
        counts.consumer_stops,
        counts.broker_outages.len(),
        counts
            .broker_outages
            .iter()
            .map(|d| Duration::from_secs(d.as_secs()))
            .collect::<Vec<_>>(),
        counts.terminations,
        counts.terminated_connections,
        drain.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        if violations.is_empty() {
            "none".to_owned()
        } else {
            violations.len().to_string()
        },
    );
    let faults_missing = counts.relay_kills == 0
        || counts.consumer_kills == 0
        || counts.consumer_stops == 0
        || counts.broker_outages.len() < 2
        || counts
            .broker_outages
            .iter()
            .all(|d| *d < Duration::from_secs(30))
        || counts.terminated_connections == 0;
    if faults_missing {
        violations.push(format!(
            "the run did not inject every fault it promises (needs --duration 90 or more): \
             relay kills {}, consumer kills {}, consumer stops {}, outages {:?}, \
             terminated connections {}",
            counts.relay_kills,
            counts.consumer_kills,
            counts.consumer_stops,
            counts.broker_outages,
            counts.terminated_connections
        ));
    }
    if violations.is_empty() {
        let _ = std::fs::remove_dir_all(&dir);
        Ok(report)
    } else {
        Err(format!(
            "{report}\n{}\nchild logs and stats: {}",
            violations
                .iter()
                .take(40)
                .map(|v| format!("  - {v}"))
                .collect::<Vec<_>>()
                .join("\n"),
            dir.display()
        ))
    }
}

/// When the broker goes away, and for how long: at an eighth of the run for 3 s, at a third
/// for 31 s, and, in a longer run, every 100 s after, alternately 5 s and 35 s.
fn broker_schedule(duration: Duration, started: Instant) -> VecDeque<(Instant, Duration)> {
    let mut outages = VecDeque::from([
        (started + duration / 8, Duration::from_secs(3)),
        (started + duration / 3, Duration::from_secs(31)),
    ]);
    let mut at = duration / 3 + Duration::from_secs(100);
    let mut long = false;
    while at + Duration::from_secs(40) < duration {
        let length = Duration::from_secs(if long { 35 } else { 5 });
        outages.push_back((started + at, length));
        long = !long;
        at += Duration::from_secs(100);
    }
    outages
}

fn db_name(url: &str) -> &str {
    url.rsplit('/').next().unwrap_or_default()
}

/// The token of each row in the archive, `outbox_published`.
async fn archived_tokens(conn: &mut AsyncPgConnection) -> Vec<String> {
    #[derive(QueryableByName)]
    struct Token {
        #[diesel(sql_type = diesel::sql_types::Text)]
        token: String,
    }
    diesel::sql_query("SELECT payload ->> 'token' AS token FROM outbox_published")
        .load::<Token>(conn)
        .await
        .expect("read the archive")
        .into_iter()
        .map(|t| t.token)
        .collect()
}

/// The archive holds only committed events, each once, and the archiving relay did archive.
fn check_archived(archived: &[String], committed: &[(String, String)]) -> Vec<String> {
    let mut violations = Vec::new();
    if archived.is_empty() {
        violations.push("the archiving relay archived nothing".to_owned());
    }
    let distinct: BTreeSet<&str> = archived.iter().map(String::as_str).collect();
    if distinct.len() != archived.len() {
        violations.push(format!(
            "{} events archived more than once",
            archived.len() - distinct.len()
        ));
    }
    let committed: BTreeSet<&str> = committed.iter().map(|(token, _)| token.as_str()).collect();
    let foreign = distinct.iter().filter(|t| !committed.contains(*t)).count();
    if foreign > 0 {
        violations.push(format!("{foreign} archived events were never committed"));
    }
    violations
}

async fn count(conn: &mut AsyncPgConnection, sql: &str) -> i64 {
    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::Int8)]
        count: i64,
    }
    diesel::sql_query(sql)
        .get_result::<Count>(conn)
        .await
        .map_or(-1, |row| row.count)
}

/// How a writer's unit of work ends.
enum Ending {
    Commit,
    /// The closure returns an error: rolled back before any COMMIT.
    Rollback,
    /// A deferred constraint fails at COMMIT, after the outbox insert ran.
    FailAtCommit,
}

/// A writer: units of work of 1 to 3 events on random aggregates until `stop`.
async fn write(
    url: String,
    outbox: outbox_runtime::Outbox,
    aggregates: usize,
    pause: Duration,
    seed: u64,
    ledger: Arc<Mutex<Ledger>>,
    stop: tokio_util::sync::CancellationToken,
) -> Result<(), String> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut conn = AsyncPgConnection::establish(&url)
        .await
        .map_err(|e| e.to_string())?;
    while !stop.is_cancelled() {
        let aggregate = format!("a-{}", rng.usize(0..aggregates));
        let tokens: Vec<String> = (0..rng.usize(1..=3))
            .map(|_| uuid::Uuid::new_v4().to_string())
            .collect();
        let ending = match rng.u32(0..100) {
            0..90 => Ending::Commit,
            90..96 => Ending::Rollback,
            _ => Ending::FailAtCommit,
        };
        // A fresh value each time: a rolled-back unit of work keeps its events pending on
        // the aggregate, and this one must not commit them later.
        let mut account = Account {
            id: aggregate.clone(),
            pending_events: PendingEvents::new(),
        };
        for token in &tokens {
            account.record(LedgerEvent::Booked {
                token: token.clone(),
            });
        }
        let poison = rng.i64(..);
        let outcome = outbox
            .transaction(&mut conn, async |uow| {
                for token in &tokens {
                    diesel::sql_query(
                        "INSERT INTO chaos_ledger (token, aggregate) VALUES ($1, $2)",
                    )
                    .bind::<diesel::sql_types::Text, _>(token)
                    .bind::<diesel::sql_types::Text, _>(&aggregate)
                    .execute(uow.conn())
                    .await?;
                }
                uow.track(&mut account);
                match ending {
                    Ending::Commit => Ok(()),
                    Ending::Rollback => Err(UnitOfWorkError::Database(
                        diesel::result::Error::RollbackTransaction,
                    )),
                    Ending::FailAtCommit => {
                        diesel::sql_query("INSERT INTO chaos_poison (k) VALUES ($1), ($1)")
                            .bind::<diesel::sql_types::Int8, _>(poison)
                            .execute(uow.conn())
                            .await?;
                        Ok(())
                    }
                }
            })
            .await;
        {
            let mut ledger = ledger.lock().unwrap();
            match (outcome, ending) {
                (Ok(()), Ending::Commit) => {
                    ledger.units_committed += 1;
                    ledger
                        .committed
                        .extend(tokens.into_iter().map(|token| (token, aggregate.clone())));
                }
                (Err(_), Ending::Rollback) => {
                    ledger.units_rolled_back += 1;
                    ledger.rolled_back.extend(tokens);
                }
                (Err(_), Ending::FailAtCommit) => {
                    ledger.units_rolled_back += 1;
                    ledger.units_failed_at_commit += 1;
                    ledger.rolled_back.extend(tokens);
                }
                (Ok(()), _) => return Err("a unit of work that had to fail committed".into()),
                (Err(error), Ending::Commit) => {
                    return Err(format!("a unit of work failed: {error}"));
                }
            }
        }
        tokio::time::sleep(pause).await;
    }
    Ok(())
}

/// One message of the stream, as the checks read it.
struct Streamed {
    id: String,
    aggregate: String,
    seq: i64,
    token: String,
}

impl Streamed {
    fn read(message: &support::Received) -> Self {
        let token = serde_json::from_slice::<serde_json::Value>(&message.payload)
            .ok()
            .and_then(|payload| payload["token"].as_str().map(str::to_owned))
            .unwrap_or_default();
        Self {
            id: message.header("ce-id"),
            aggregate: message.header("ce-subject"),
            seq: message.header("ce-sequence").parse().unwrap_or(-1),
            token,
        }
    }
}

fn check_stream(
    events: &[Streamed],
    committed: &[(String, String)],
    rolled_back: &[String],
) -> Vec<String> {
    let mut violations = Vec::new();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for event in events {
        *seen.entry(event.token.as_str()).or_default() += 1;
    }
    let twice = seen.values().filter(|n| **n > 1).count();
    if twice > 0 {
        violations.push(format!(
            "{twice} events stored more than once in the stream"
        ));
    }
    let missing = committed
        .iter()
        .filter(|(token, _)| !seen.contains_key(token.as_str()))
        .count();
    if missing > 0 {
        violations.push(format!(
            "{missing} committed events missing from the stream"
        ));
    }
    let ghosts = rolled_back
        .iter()
        .filter(|token| seen.contains_key(token.as_str()))
        .count();
    if ghosts > 0 {
        violations.push(format!(
            "{ghosts} events of rolled-back units of work in the stream"
        ));
    }
    let mut by_aggregate: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for event in events {
        by_aggregate
            .entry(&event.aggregate)
            .or_default()
            .push(event.seq);
    }
    for (aggregate, seqs) in by_aggregate {
        let expected: Vec<i64> = (1..=seqs.len() as i64).collect();
        if seqs != expected {
            violations.push(format!(
                "aggregate {aggregate} out of order or with gaps in the stream: {seqs:?}"
            ));
        }
    }
    violations
}

/// The consumer's applied rows: (aggregate, seq, token), in the order applied.
async fn applied_rows(conn: &mut AsyncPgConnection) -> Vec<(String, i64, String)> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        aggregate: String,
        #[diesel(sql_type = diesel::sql_types::Int8)]
        seq: i64,
        #[diesel(sql_type = diesel::sql_types::Text)]
        token: String,
    }
    diesel::sql_query("SELECT aggregate, seq, token FROM chaos_applied ORDER BY n")
        .load::<Row>(conn)
        .await
        .map(|rows| {
            rows.into_iter()
                .map(|r| (r.aggregate, r.seq, r.token))
                .collect()
        })
        .unwrap_or_default()
}

fn check_applied(
    applied: &[(String, i64, String)],
    committed: &[(String, String)],
    rolled_back: &[String],
) -> Vec<String> {
    let mut violations = Vec::new();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (_, _, token) in applied {
        *seen.entry(token.as_str()).or_default() += 1;
    }
    let twice = seen.values().filter(|n| **n > 1).count();
    if twice > 0 {
        violations.push(format!("{twice} events applied more than once"));
    }
    let missing = committed
        .iter()
        .filter(|(token, _)| !seen.contains_key(token.as_str()))
        .count();
    if missing > 0 {
        violations.push(format!("{missing} committed events never applied"));
    }
    let ghosts = rolled_back
        .iter()
        .filter(|token| seen.contains_key(token.as_str()))
        .count();
    if ghosts > 0 {
        violations.push(format!(
            "{ghosts} events of rolled-back units of work applied"
        ));
    }
    let mut by_aggregate: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (aggregate, seq, _) in applied {
        by_aggregate.entry(aggregate).or_default().push(*seq);
    }
    let mut out_of_order = 0;
    for (aggregate, seqs) in by_aggregate {
        let expected: Vec<i64> = (1..=seqs.len() as i64).collect();
        if seqs != expected {
            out_of_order += 1;
            if out_of_order <= 5 {
                violations.push(format!(
                    "aggregate {aggregate} applied out of order: {:?}",
                    &seqs[..seqs.len().min(30)]
                ));
            }
        }
    }
    if out_of_order > 5 {
        violations.push(format!(
            "{out_of_order} aggregates applied out of order in all"
        ));
    }
    violations
}

/// Every child's last counters, summed by key.
fn read_stats(dir: &Path) -> BTreeMap<String, u64> {
    let mut totals = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return totals;
    };
    for entry in entries.flatten() {
        if entry.path().extension().is_none_or(|ext| ext != "stats") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        for line in text.lines() {
            if let Some((key, value)) = line.rsplit_once(' ')
                && let Ok(value) = value.parse::<u64>()
            {
                *totals.entry(key.to_owned()).or_default() += value;
            }
        }
    }
    totals
}
