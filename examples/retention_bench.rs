//! The retention benchmark: what removing millions of kept published rows costs, and what it
//! does to the services that keep writing and relaying meanwhile, for both layouts.
//!
//! ```sh
//! cargo run --release --example retention_bench -- --rows 10000000
//! ```
//!
//! For each layout, in a database and a stream of its own (removed at the end):
//!
//! - `mark` ([`PublishedRows::Mark`]): `--rows` published rows kept in `outbox_events`,
//!   removed by [`outbox::purge_published`] in batches of `--batch`, then `VACUUM`, which the
//!   deleted rows need before their space is reused (this server may run autovacuum; the
//!   benchmark runs it at once, to measure it);
//! - `archive` ([`PublishedRows::Archive`]): the same rows in ten daily partitions of
//!   `outbox_published`, removed by [`outbox::drop_archived`].
//!
//! Before the relay starts, in the `archive` layout, the newest seeded day (a tenth of the
//! rows) is replayed to a stream of its own (`outbox_runtime::replay`), and its rate printed.
//!
//! With `--replay-memory`, the whole archive is then replayed twice more, each time into a
//! nats-server of its own (`NATS_SERVER_BIN`, else `nats-server` on the PATH, else Debian's;
//! a fresh store on a free port): into a stream with a stream's default duplicate window (2
//! minutes), then with a replay's ([`replay::DUPLICATE_WINDOW`]), and the server's peak
//! resident memory is printed beside the rate: the broker memory the message ids in the
//! window hold.
//!
//! While the relay runs in that layout, writers commit units of work of two events at a
//! fixed rate. The figures of each phase (before, while the removal runs, right after it,
//! and while the VACUUM runs) are the unit of work's commit time and the time from a commit's return
//! to its events' arrival on a core NATS subscription of the stream's subjects (the relay's
//! claim, publish, ack and finish), as percentiles in milliseconds.
//!
//! `OUTBOX_BENCH_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`) and
//! `NATS_URL` point it elsewhere.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use diesel::QueryableByName;
use diesel::sql_types::Int8;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures::StreamExt;
use outbox_runtime::replay::{self, ReplayConfig, replay_archive};
use outbox_runtime::{
    DomainEvent, Outbox, PendingEvents, PublishedRows, Relay, StreamSettings, Topology,
    UnitOfWorkError, aggregate, outbox,
};
use serde::{Deserialize, Serialize};

#[path = "../tests/support/cluster.rs"]
mod cluster;
#[path = "../tests/support/nats.rs"]
mod nats;
#[path = "support/place.rs"]
mod place;

use place::{BoxError, Place};

#[derive(Parser)]
#[command(about = "Measures batched deletes against dropped partitions at millions of rows")]
struct Args {
    /// Published rows kept, then removed.
    #[arg(long, default_value_t = 10_000_000)]
    rows: i64,
    /// Size of each kept row's JSON payload, in bytes.
    #[arg(long, default_value_t = 256)]
    payload: usize,
    /// Rows per DELETE of the batched purge.
    #[arg(long, default_value_t = 10_000)]
    batch: i64,
    /// Units of work committed per second while it runs (two events each).
    #[arg(long, default_value_t = 250)]
    rate: u64,
    /// Length of the phases before and right after the removal, in seconds (the removal's
    /// and the VACUUM's phases last as long as they run).
    #[arg(long, default_value_t = 15)]
    window_secs: u64,
    /// In the archive layout, also replay the whole archive into a nats-server of its own,
    /// once with a stream's default duplicate window and once with a replay's, and print the
    /// server's peak memory.
    #[arg(long)]
    replay_memory: bool,
    /// The layouts to measure.
    #[arg(long, value_delimiter = ',', default_values = ["mark", "archive"])]
    layouts: Vec<Layout>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Layout {
    Mark,
    Archive,
}

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
struct Ticked {
    n: u64,
}

#[aggregate(name = "Probe")]
struct Probe {
    id: String,
    pending_events: PendingEvents<Ticked>,
}

#[derive(QueryableByName)]
struct Number {
    #[diesel(sql_type = Int8)]
    n: i64,
}

async fn number(conn: &mut AsyncPgConnection, sql: &str) -> Result<i64, BoxError> {
    Ok(diesel::sql_query(sql).get_result::<Number>(conn).await?.n)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    println!(
        "retention of {} kept rows ({}-byte payloads); load: {} units of work/s of 2 events",
        args.rows, args.payload, args.rate
    );
    for layout in args.layouts.clone() {
        let place = Place::new("retention").await?;
        let result = run(&args, layout, &place).await;
        place.clean_up().await;
        result?;
    }
    Ok(())
}

async fn run(args: &Args, layout: Layout, place: &Place) -> Result<(), BoxError> {
    println!("\n== layout: {layout:?}");
    let mut conn = place.conn().await?;
    let seeded = Instant::now();
    seed(&mut conn, args, layout).await?;
    conn.batch_execute("VACUUM ANALYZE").await?;
    conn.batch_execute("CHECKPOINT").await?;
    let table = match layout {
        Layout::Mark => "outbox_events",
        Layout::Archive => "outbox_published",
    };
    let size_sql = format!(
        "SELECT sum(pg_total_relation_size(c))::int8 AS n FROM \
         (SELECT '{table}'::regclass AS c UNION ALL \
          SELECT inhrelid FROM pg_inherits WHERE inhparent = '{table}'::regclass) t"
    );
    let before = number(&mut conn, &size_sql).await?;
    println!(
        "seeded {} rows in {:.0} s; {table}: {} MiB",
        args.rows,
        seeded.elapsed().as_secs_f64(),
        before >> 20
    );

    if layout == Layout::Archive {
        replay_newest_day(args, place, &mut conn).await?;
        if args.replay_memory {
            replay_memory(&mut conn).await?;
        }
    }

    let mut config = place.relay_config();
    config.published = match layout {
        Layout::Mark => PublishedRows::Mark,
        Layout::Archive => PublishedRows::Archive,
    };
    let relay = Relay::connect(config, place.nats.clone()).await?.spawn();
    let load = Load::start(args, place).await?;

    let window = Duration::from_secs(args.window_secs);
    load.phase(0);
    tokio::time::sleep(window).await;

    load.phase(1);
    let started = Instant::now();
    let removed = match layout {
        Layout::Mark => {
            let mut shown = Instant::now();
            let removed = outbox::purge_published(
                &mut conn,
                Duration::from_secs(86_400),
                args.batch,
                |removed| {
                    if shown.elapsed() >= Duration::from_secs(10) {
                        eprintln!(
                            "  deleted {removed} ({:.0}/s)",
                            removed as f64 / started.elapsed().as_secs_f64()
                        );
                        shown = Instant::now();
                    }
                },
            )
            .await?;
            removed as i64
        }
        Layout::Archive => {
            let dropped = outbox::drop_archived(&mut conn, Duration::from_secs(86_400)).await?;
            dropped.partitions.iter().map(|p| p.1).sum()
        }
    };
    let took = started.elapsed();

    load.phase(2);
    tokio::time::sleep(window).await;
    let vacuum = if layout == Layout::Mark {
        load.phase(3);
        let started = Instant::now();
        conn.batch_execute("VACUUM outbox_events").await?;
        Some(started.elapsed())
    } else {
        None
    };
    let samples = load.stop().await?;
    relay.shutdown().await?;
    let after = number(&mut conn, &size_sql).await?;

    println!(
        "removed {removed} rows in {:.2} s: {:.0} rows/s{}",
        took.as_secs_f64(),
        removed as f64 / took.as_secs_f64(),
        match vacuum {
            Some(vacuum) => format!("; then VACUUM {:.1} s", vacuum.as_secs_f64()),
            None => String::new(),
        }
    );
    println!(
        "{table}: {} MiB before, {} MiB after",
        before >> 20,
        after >> 20
    );
    let names = [
        format!("before ({} s)", args.window_secs),
        format!("during the removal ({:.2} s)", took.as_secs_f64()),
        format!("right after ({} s)", args.window_secs),
        format!(
            "during the VACUUM ({:.2} s)",
            vacuum.unwrap_or_default().as_secs_f64()
        ),
    ];
    println!(
        "{:<32} {:>7} {:>8}  {:>29}  {:>29}",
        "phase", "units", "units/s", "commit ms p50 / p99 / max", "commit-to-NATS ms p50/p99/max"
    );
    for (phase, name) in names.iter().enumerate() {
        let Some(sample) = samples.get(&phase) else {
            continue;
        };
        println!(
            "{name:<32} {:>7} {:>8.0}  {:>29}  {:>29}",
            sample.commits.len(),
            sample.commits.len() as f64 / sample.length.as_secs_f64(),
            percentiles(&sample.commits),
            percentiles(&sample.delivered),
        );
    }
    Ok(())
}

/// Replays the newest seeded day of the archive (a tenth of `args.rows`, one event for each
/// of as many aggregates, up to 100,000) to a stream of its own ([`replay_archive`]), and
/// prints its rate; the stream is deleted afterwards.
async fn replay_newest_day(
    args: &Args,
    place: &Place,
    conn: &mut AsyncPgConnection,
) -> Result<(), BoxError> {
    let day = time::OffsetDateTime::now_utc().date() - time::Duration::days(2);
    let mut config = ReplayConfig::new(
        "x".parse()?,
        Topology::new(
            format!("{}r", place.prefix).parse()?,
            StreamSettings {
                name: format!("{}_REPLAY", place.stream),
                ..StreamSettings::default()
            },
        ),
    );
    config.published_since = Some(day.midnight().assume_utc());
    let started = Instant::now();
    let report = replay_archive(conn, place.nats.clone(), &config, |_| {}).await;
    let took = started.elapsed();
    let _ = async_nats::jetstream::new(place.nats.clone())
        .delete_stream(&config.to.stream.name)
        .await;
    let report = report?;
    println!(
        "replayed the newest day, {} of {} events, to a stream of its own in {:.2} s: {:.0} \
         events/s ({} per page)",
        report.published,
        args.rows,
        took.as_secs_f64(),
        report.published as f64 / took.as_secs_f64(),
        config.batch_size
    );
    Ok(())
}

/// Replays the whole archive once per duplicate window (a stream's default, then a
/// replay's), each time into a nats-server of its own, and prints the rate and the server's
/// peak resident memory; then what the longer window cost per message id it held more.
async fn replay_memory(conn: &mut AsyncPgConnection) -> Result<(), BoxError> {
    let mut runs = Vec::new();
    for window in [
        StreamSettings::default().duplicate_window,
        replay::DUPLICATE_WINDOW,
    ] {
        // Killed, and its store removed, when dropped at the end of the run.
        let server = nats::NatsServer::start().await;
        let pid = server
            .pid()
            .ok_or("the benchmark's nats-server is not running")?;
        let client = async_nats::connect(server.url()).await?;
        let before = memory(pid, "VmRSS")?;
        let config = ReplayConfig::new(
            "x".parse()?,
            Topology::new(
                "replay".parse()?,
                StreamSettings {
                    name: "REPLAY".to_owned(),
                    duplicate_window: window,
                    ..StreamSettings::default()
                },
            ),
        );
        let started = Instant::now();
        let report = replay_archive(conn, client, &config, |_| {}).await?;
        let took = started.elapsed().as_secs_f64();
        let peak = memory(pid, "VmHWM")?;
        let rate = report.published as f64 / took;
        // The ids the window held at most: those of its last `window` of publishes.
        let held = (rate * window.as_secs_f64()).min(report.published as f64);
        println!(
            "replayed the whole archive, {} events, with a duplicate window of {window:?}, into \
             a nats-server of its own in {took:.2} s: {rate:.0} events/s; the server's peak \
             memory {} MiB ({} MiB before), its window holding up to {held:.0} message ids",
            report.published,
            peak >> 20,
            before >> 20,
        );
        runs.push((window, held, peak));
    }
    if let [
        (long, long_held, long_peak),
        (short, short_held, short_peak),
    ] = runs[..]
    {
        println!(
            "the {long:?} window against the {short:?} one: {:.0} more message ids held, {} MiB \
             more at the peak: {:.0} B per message id",
            long_held - short_held,
            long_peak.saturating_sub(short_peak) >> 20,
            long_peak.saturating_sub(short_peak) as f64 / (long_held - short_held).max(1.0),
        );
    }
    Ok(())
}

/// A memory figure of process `pid`'s `/proc/{pid}/status` (`VmRSS`, `VmHWM`), in bytes.
fn memory(pid: u32, field: &str) -> Result<u64, BoxError> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .ok_or_else(|| format!("no {field} in process {pid}'s /proc status"))?;
    Ok(kib << 10)
}

/// Puts `args.rows` published rows where the layout keeps them, a million per statement.
async fn seed(conn: &mut AsyncPgConnection, args: &Args, layout: Layout) -> Result<(), BoxError> {
    const CHUNK: i64 = 1_000_000;
    let payload = place::payload(args.payload);
    let days: i64 = 10;
    let per_day = (args.rows + days - 1) / days;
    if layout == Layout::Archive {
        for back in 2..days + 2 {
            conn.batch_execute(&format!(
                "DO $$ DECLARE \
                   day date := (now() AT TIME ZONE 'UTC')::date - {back}; \
                   name text := 'outbox_published_p' || to_char(day, 'YYYYMMDD'); \
                 BEGIN \
                   EXECUTE format('CREATE TABLE %I (LIKE outbox_published)', name); \
                   EXECUTE format('ALTER TABLE outbox_published ATTACH PARTITION %I \
                     FOR VALUES FROM (%L) TO (%L)', name, day::timestamp AT TIME ZONE 'UTC', \
                     (day + 1)::timestamp AT TIME ZONE 'UTC'); \
                 END $$"
            ))
            .await?;
        }
    }
    let mut from = 0;
    while from < args.rows {
        let to = (from + CHUNK).min(args.rows);
        // UUIDv7-shaped ids two days old and more, in time order like the unit of work's;
        // a hundred thousand aggregates; published rows spread over the layout's days.
        let select = format!(
            "SELECT (lpad(to_hex((extract(epoch FROM now() - interval '12 days') * 1000)::int8 \
                     + n / 20), 12, '0') || '7' || substr(md5(n::text), 1, 3) || '8' \
                     || substr(md5(n::text), 4, 15))::uuid, \
                    'Seed', 'seed-' || (n % 100000), n / 100000 + 1, 'Seeded', 1, \
                    'seed-' || (n % 100000), 'x.Seed.Seeded', '{payload}'::jsonb, '{{}}'::jsonb, \
                    now() - interval '12 days', NULL, NULL, 1, \
                    ((now() AT TIME ZONE 'UTC')::date - 2 - n / {per_day} \
                      + (n % {per_day}) * interval '86399 seconds' / {per_day}) \
                      AT TIME ZONE 'UTC' \
             FROM generate_series({from}, {}) n",
            to - 1
        );
        let insert = match layout {
            Layout::Mark => format!(
                "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, \
                   event_type, event_version, partition_key, subject, payload, headers, \
                   occurred_at, correlation_id, causation_id, attempts, published_at) {select}"
            ),
            Layout::Archive => format!("INSERT INTO outbox_published {select}"),
        };
        conn.batch_execute(&insert).await?;
        from = to;
        eprintln!("  seeded {from}");
    }
    Ok(())
}

/// What the load measured in one phase.
#[derive(Default)]
struct Sample {
    length: Duration,
    commits: Vec<Duration>,
    delivered: Vec<Duration>,
}

/// Writers committing units of work at a fixed rate, and a subscriber timing their arrival.
struct Load {
    phase: Arc<AtomicUsize>,
    /// When the current phase started, and how long each finished one lasted.
    since: Mutex<(Instant, HashMap<usize, Duration>)>,
    stop: Arc<AtomicBool>,
    writers: Vec<tokio::task::JoinHandle<Result<(), BoxError>>>,
    subscriber: tokio::task::JoinHandle<()>,
    /// Per event `n`: its phase, its commit's duration and return, and its arrival.
    records: Arc<Mutex<Records>>,
}

#[derive(Default)]
struct Records {
    committed: HashMap<u64, (usize, Duration, Instant)>,
    arrived: HashMap<u64, Instant>,
}

impl Load {
    const WRITERS: u64 = 4;

    async fn start(args: &Args, place: &Place) -> Result<Self, BoxError> {
        let phase = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let records = Arc::new(Mutex::new(Records::default()));
        let mut subscription = place.nats.subscribe(format!("{}.>", place.prefix)).await?;
        let subscriber = {
            let records = Arc::clone(&records);
            tokio::spawn(async move {
                while let Some(message) = subscription.next().await {
                    let at = Instant::now();
                    if let Ok(event) = serde_json::from_slice::<Ticked>(&message.payload) {
                        records.lock().unwrap().arrived.entry(event.n).or_insert(at);
                    }
                }
            })
        };
        let outbox = Outbox::with_topology(place.topology());
        let period = Duration::from_secs_f64(Self::WRITERS as f64 / args.rate as f64);
        let mut writers = Vec::new();
        for writer in 0..Self::WRITERS {
            let (phase, stop, records) =
                (Arc::clone(&phase), Arc::clone(&stop), Arc::clone(&records));
            let outbox = outbox.clone();
            let mut conn = place.conn().await?;
            writers.push(tokio::spawn(async move {
                let mut ticks = tokio::time::interval(period);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut unit = 0_u64;
                while !AtomicBool::load(&stop, Ordering::Relaxed) {
                    ticks.tick().await;
                    let n = (unit * Self::WRITERS + writer) * 2;
                    let mut probe = Probe {
                        id: format!("probe-{}", n % 1_000),
                        pending_events: PendingEvents::new(),
                    };
                    probe.record(Ticked { n });
                    probe.record(Ticked { n: n + 1 });
                    let now = AtomicUsize::load(&phase, Ordering::Relaxed);
                    let started = Instant::now();
                    outbox
                        .transaction(&mut conn, async |uow| {
                            uow.track(&mut probe);
                            Ok::<_, UnitOfWorkError>(())
                        })
                        .await?;
                    let (took, at) = (started.elapsed(), Instant::now());
                    let mut records = records.lock().unwrap();
                    records.committed.insert(n, (now, took, at));
                    records.committed.insert(n + 1, (now, took, at));
                    unit += 1;
                }
                Ok(())
            }));
        }
        Ok(Self {
            phase,
            since: Mutex::new((Instant::now(), HashMap::new())),
            stop,
            writers,
            subscriber,
            records,
        })
    }

    /// Starts phase `phase`: what is committed from now on counts in it.
    fn phase(&self, phase: usize) {
        let mut since = self.since.lock().unwrap();
        let (started, lengths) = &mut *since;
        let current = AtomicUsize::swap(&self.phase, phase, Ordering::Relaxed);
        if phase != current {
            lengths.insert(current, started.elapsed());
        }
        *started = Instant::now();
    }

    /// Stops the writers, waits (30 s at most) for every committed event to arrive, and
    /// returns each phase's sample.
    async fn stop(self) -> Result<HashMap<usize, Sample>, BoxError> {
        let (started, mut lengths) = self.since.into_inner().unwrap();
        lengths.insert(
            AtomicUsize::load(&self.phase, Ordering::Relaxed),
            started.elapsed(),
        );
        self.stop.store(true, Ordering::Relaxed);
        for writer in self.writers {
            writer.await??;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let missing = {
                let records = self.records.lock().unwrap();
                records
                    .committed
                    .keys()
                    .filter(|n| !records.arrived.contains_key(n))
                    .count()
            };
            if missing == 0 {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("{missing} committed events never arrived").into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.subscriber.abort();
        let records = self.records.lock().unwrap();
        let mut samples: HashMap<usize, Sample> = HashMap::new();
        for (n, (phase, took, at)) in &records.committed {
            let sample = samples.entry(*phase).or_default();
            sample.length = lengths.get(phase).copied().unwrap_or_default();
            if n % 2 == 0 {
                sample.commits.push(*took);
            }
            sample
                .delivered
                .push(records.arrived[n].saturating_duration_since(*at));
        }
        Ok(samples)
    }
}

/// "p50 / p99 / max" of `values`, in milliseconds.
fn percentiles(values: &[Duration]) -> String {
    let mut sorted = values.to_vec();
    sorted.sort();
    let at = |q: f64| {
        let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
        sorted[i].as_secs_f64() * 1e3
    };
    if sorted.is_empty() {
        return "-".to_owned();
    }
    format!("{:.1} / {:.1} / {:.1}", at(0.5), at(0.99), at(1.0))
}
