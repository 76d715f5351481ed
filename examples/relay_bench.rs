//! The relay benchmark: one run on the local PostgreSQL and NATS, printing each figure, its
//! ratio and its target.
//!
//! ```sh
//! cargo run --release --example relay_bench -- --events 100000 --payload 256
//! ```
//!
//! 1. the ceiling: raw async JetStream publishes of the same messages to the same stream;
//! 2. the naive relay of the well-known articles: batches of 100, one publish awaited at a
//!    time, one UPDATE per row;
//! 3. this relay with its defaults, with 2 and 3 instances, and with each other way of finishing
//!    published rows (marking them, archiving them to daily partitions);
//! 4. the ratios 3/1 and 3/2;
//! 5. commit-to-ack latency at a fixed offered load, with notifications and polling only (the
//!    ack time is the stream's store timestamp of each message);
//! 6. the unit of work's cost: a business transaction with 1 and 10 events against none, and
//!    one unit of work of 10,000 events over as many aggregates, new and again;
//! 7. the claim rate with a million published rows kept against an empty table;
//! 8. the inbox: messages handled per second with a one-row business write, against a plain
//!    consumer doing the same write without an inbox; with an emitted event; on one key.
//!
//! It works in a database and a stream of its own, removed at the end. `OUTBOX_BENCH_DATABASE_URL`
//! (default `postgres://postgres@127.0.0.1:5432/postgres`) and `NATS_URL` point it elsewhere.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::DeliverPolicy, consumer::pull};
use clap::Parser;
use diesel::QueryableByName;
use diesel::sql_types::{Array, Int8, Text, Uuid as SqlUuid};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures::stream::FuturesUnordered;
use futures::{StreamExt, TryStreamExt};
use outbox_runtime::{
    DomainEvent, Handler, Inbox, InboxConfig, Metadata, Outbox, PendingEvents, PublishedRows,
    Relay, RelayConfig, UnitOfWork, UnitOfWorkError, aggregate,
};
use serde::{Deserialize, Serialize};

#[path = "support/place.rs"]
mod place;

use place::{BoxError, Place};

#[derive(Parser, Clone)]
#[command(about = "Measures the outbox relay against the JetStream ceiling and a naive relay")]
struct Args {
    /// Events in each throughput run.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Size of each event's JSON payload, in bytes.
    #[arg(long, default_value_t = 256)]
    payload: usize,
    /// Aggregates the events are spread over, round robin.
    #[arg(long, default_value_t = 1_000)]
    aggregates: usize,
    /// Offered load of the latency runs, in events per second.
    #[arg(long, default_value_t = 1_000)]
    rate: u64,
    /// Length of each latency run, in seconds.
    #[arg(long, default_value_t = 10)]
    latency_secs: u64,
    /// Units of work per variant in the cost measurement.
    #[arg(long, default_value_t = 2_000)]
    transactions: usize,
    /// Published rows kept in the table for the claim measurement.
    #[arg(long, default_value_t = 1_000_000)]
    published_rows: usize,
    /// The measurements to run, by number (1 to 8); all by default. Ratios are printed when
    /// both their parts ran.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 3, 5, 6, 7, 8])]
    phases: Vec<u8>,
}

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
struct Ticked {
    n: u64,
    pad: String,
}

#[aggregate(name = "Probe")]
struct Probe {
    id: String,
    pending_events: PendingEvents<Ticked>,
}

struct Bench {
    args: Args,
    place: Place,
    /// The payload of every seeded row: a JSON object of `args.payload` bytes.
    payload: String,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let place = Place::new("bench").await?;
    let payload = place::payload(args.payload);
    let bench = Bench {
        args,
        place,
        payload,
    };
    let result = bench.run().await;
    bench.place.clean_up().await;
    result
}

impl Bench {
    async fn run(&self) -> Result<(), BoxError> {
        let a = &self.args;
        let phase = |n: u8| a.phases.contains(&n);
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        println!(
            "relay_bench: {} events of {} B over {} aggregates; {cores} cores; release build: {}",
            a.events,
            self.payload.len(),
            a.aggregates,
            !cfg!(debug_assertions)
        );
        let defaults = self.place.relay_config();
        println!(
            "relay defaults: workers {}, batch_size {}, max_in_flight {}, poll_interval {:?}, published rows: {:?}\n",
            defaults.workers,
            defaults.batch_size,
            defaults.max_in_flight,
            defaults.poll_interval,
            defaults.published
        );

        let ceiling = if phase(1) {
            let ceiling = self.ceiling().await?;
            report(
                "1. ceiling: raw async JetStream publishes",
                ceiling,
                "events/s",
            );
            Some(ceiling)
        } else {
            None
        };
        let naive = if phase(2) {
            let naive = self.naive_relay().await?;
            report(
                "2. naive relay (batch 100, 1 publish awaited at a time, 1 UPDATE per row)",
                naive,
                "events/s",
            );
            Some(naive)
        } else {
            None
        };
        if phase(3) {
            let relay = self.drain("Relay1", 1, self.place.relay_config()).await?;
            report("3. this relay, defaults", relay, "events/s");
            let relay2 = self.drain("Relay2", 2, self.place.relay_config()).await?;
            report("3. this relay, 2 instances", relay2, "events/s");
            let relay3 = self.drain("Relay3x", 3, self.place.relay_config()).await?;
            report("3. this relay, 3 instances", relay3, "events/s");
            println!(
                "   scale-out: 2 instances / 1 = {:.2}x, 3 instances / 1 = {:.2}x (target: never below 1)",
                relay2 / relay,
                relay3 / relay
            );
            let defaults = self.place.relay_config().published;
            let others = [
                PublishedRows::Delete,
                PublishedRows::Mark,
                PublishedRows::Archive,
            ];
            for (i, mode) in others.into_iter().filter(|m| *m != defaults).enumerate() {
                let mut other = self.place.relay_config();
                other.published = mode;
                let other_rate = self.drain(&format!("Relay{}", i + 3), 1, other).await?;
                report(
                    &format!("3. this relay, published rows: {mode:?}"),
                    other_rate,
                    "events/s",
                );
            }
            println!();
            if let Some(ceiling) = ceiling {
                let r = relay / ceiling;
                ratio("4. ratio 3/1 (this relay / ceiling)", r, ">= 0.5", r >= 0.5);
            }
            if let Some(naive) = naive {
                let r = relay / naive;
                ratio(
                    "4. ratio 3/2 (this relay / naive relay)",
                    r,
                    ">= 10",
                    r >= 10.0,
                );
            }
            println!();
        }

        if phase(5) {
            let notified = self
                .latency("LatencyNotify", self.place.relay_config())
                .await?;
            let mut polling = self.place.relay_config();
            polling.listen = false;
            let polled = self.latency("LatencyPoll", polling.clone()).await?;
            for (label, l) in [
                ("notifications".to_owned(), &notified),
                (
                    format!("polling only ({:?})", polling.poll_interval),
                    &polled,
                ),
            ] {
                println!(
                    "5. commit-to-ack latency, {label}, offered {:.0} events/s: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} events)",
                    l.offered_rate, l.p50_ms, l.p99_ms, l.max_ms, l.count
                );
            }
            ratio(
                "5. p99 with notifications (ms)",
                notified.p99_ms,
                "<= 25",
                notified.p99_ms <= 25.0,
            );
            println!();
        }

        if phase(6) {
            let cost = self.unit_of_work_cost().await?;
            println!(
                "6. unit of work, mean per transaction: none {:.3} ms, 1 event {:.3} ms, 10 events {:.3} ms (medians {:.3} / {:.3} / {:.3} ms)",
                cost.mean[0],
                cost.mean[1],
                cost.mean[2],
                cost.median[0],
                cost.median[1],
                cost.median[2]
            );
            let one = cost.mean[1] / cost.mean[0];
            ratio("6. 1 event / none", one, "<= 1.3", one <= 1.3);
            untargeted_ratio("6. 10 events / none", cost.mean[2] / cost.mean[0]);
            println!(
                "6. one unit of work of {BULK} events over as many aggregates: new {:.0} ms, again {:.0} ms",
                cost.bulk_ms[0], cost.bulk_ms[1]
            );
            println!();
        }

        if phase(7) {
            let claims = self.claim_rate().await?;
            println!(
                "7. claim rate (batch {}, {} queued rows): empty table {:.0} claims/s; {} published rows kept {:.0} claims/s (before VACUUM {:.0})",
                defaults.batch_size,
                CLAIM_QUEUED,
                claims.empty,
                self.args.published_rows,
                claims.full,
                claims.full_before_vacuum
            );
            let full = claims.full / claims.empty;
            ratio("7. claim rate, full / empty", full, ">= 0.9", full >= 0.9);
            println!();
        }

        if phase(8) {
            let inbox = self.inbox_rates().await?;
            report(
                "8. plain consumer: the write, commit, ack (no inbox)",
                inbox.plain,
                "messages/s",
            );
            report("8. inbox: the same write", inbox.inbox, "messages/s");
            report(
                "8. inbox: the same write and one emitted event",
                inbox.emitting,
                "messages/s",
            );
            report(
                &format!(
                    "8. inbox: every message on one partition key ({} messages)",
                    inbox.hot_count
                ),
                inbox.hot,
                "messages/s",
            );
            untargeted_ratio("8. inbox / plain consumer", inbox.inbox / inbox.plain);
        }
        Ok(())
    }
}

fn report(label: &str, value: f64, unit: &str) {
    println!("{label:<78} {value:>10.0} {unit}");
}

fn ratio(label: &str, value: f64, target: &str, met: bool) {
    let verdict = if met { "met" } else { "NOT MET" };
    println!("{label:<78} {value:>10.2}   target {target}: {verdict}");
}

/// A ratio printed for information: no target, so no verdict.
fn untargeted_ratio(label: &str, value: f64) {
    println!("{label:<78} {value:>10.2}");
}

/// The headers the relay sends, for the ceiling and the naive relay to send the same.
fn message_headers(id: uuid::Uuid, kind: &str, aggregate: &str, seq: i64) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let id = id.hyphenated().to_string();
    headers.insert("Nats-Msg-Id", id.as_str());
    headers.insert("ce-specversion", "1.0");
    headers.insert("ce-id", id.as_str());
    headers.insert("ce-source", "/bench");
    headers.insert("ce-type", "Ticked");
    headers.insert("ce-time", "2026-11-21T12:00:00.123456Z");
    headers.insert("ce-subject", aggregate);
    headers.insert("ce-aggregatetype", kind);
    headers.insert("ce-sequence", format!("{seq:019}"));
    headers.insert("ce-partitionkey", aggregate);
    headers.insert("ce-eventversion", "1");
    headers.insert("ce-datacontenttype", "application/json");
    headers.insert("content-type", "application/json");
    headers
}

const CLAIM_QUEUED: usize = 10_000;

/// CPU time spent by this process (the relay runs in it), by `nats-server` and by the
/// `postgres` processes, from `/proc` (Linux): where the machine's cores went during a run.
/// Kept per process, so that a connection opened during a measurement counts from zero; one
/// closed during it drops out (its last share is lost, never subtracted).
#[derive(Default)]
struct CpuTimes {
    /// Seconds of user and system time, by pid, with the process's kind.
    processes: HashMap<u32, (Process, f64)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Process {
    Bench,
    Nats,
    Postgres,
}

impl CpuTimes {
    fn now() -> Self {
        let mut times = CpuTimes::default();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return times;
        };
        let me = std::process::id();
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // "pid (comm) state ... utime stime": fields 14 and 15, counted after the comm.
            let Some((comm, rest)) = stat
                .split_once(") ")
                .map(|(a, b)| (a.rsplit('(').next().unwrap_or(""), b))
            else {
                continue;
            };
            let process = match comm {
                _ if pid == me => Process::Bench,
                "nats-server" => Process::Nats,
                "postgres" => Process::Postgres,
                _ => continue,
            };
            let fields: Vec<&str> = rest.split(' ').collect();
            let ticks: f64 = [11, 12]
                .iter()
                .filter_map(|&i| fields.get(i)?.parse::<f64>().ok())
                .sum();
            times.processes.insert(pid, (process, ticks / 100.0)); // USER_HZ
        }
        times
    }

    /// CPU microseconds per event since `start`, as "bench+relay / nats / postgres".
    fn per_event_since(start: CpuTimes, events: usize) -> String {
        let now = CpuTimes::now();
        let us = |kind: Process| {
            let seconds: f64 = now
                .processes
                .iter()
                .filter(|(_, (process, _))| *process == kind)
                .map(|(pid, (_, seconds))| {
                    seconds - start.processes.get(pid).map_or(0.0, |(_, before)| *before)
                })
                .sum();
            seconds * 1e6 / events as f64
        };
        format!(
            "CPU per event: bench/relay {:.0} us, nats-server {:.0} us, postgres {:.0} us",
            us(Process::Bench),
            us(Process::Nats),
            us(Process::Postgres)
        )
    }
}

/// Acks the ceiling keeps outstanding: most of async-nats's default `max_ack_inflight`.
const CEILING_WINDOW: usize = 4_096;

struct Latency {
    count: usize,
    offered_rate: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

struct Cost {
    mean: [f64; 3],
    median: [f64; 3],
    /// Milliseconds for one unit of work of `BULK` events over as many new aggregates, then
    /// over the same aggregates again.
    bulk_ms: [f64; 2],
}

/// Events (one per aggregate) of the large unit of work in figure 6.
const BULK: usize = 10_000;

struct Claims {
    empty: f64,
    full: f64,
    full_before_vacuum: f64,
}

struct InboxRates {
    plain: f64,
    inbox: f64,
    emitting: f64,
    hot: f64,
    hot_count: usize,
}

impl Bench {
    /// Seeds `count` queued rows of aggregate type `kind`, round robin over the aggregates.
    async fn seed(
        &self,
        conn: &mut AsyncPgConnection,
        kind: &str,
        count: usize,
    ) -> Result<(), BoxError> {
        const CHUNK: usize = 10_000;
        let aggregates = self.args.aggregates.max(1);
        for start in (0..count).step_by(CHUNK) {
            let end = (start + CHUNK).min(count);
            let ids: Vec<uuid::Uuid> = (start..end).map(|_| uuid::Uuid::now_v7()).collect();
            let aggs: Vec<String> = (start..end)
                .map(|i| format!("a{}", i % aggregates))
                .collect();
            let seqs: Vec<i64> = (start..end).map(|i| (i / aggregates) as i64 + 1).collect();
            diesel::sql_query(
                "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, \
                     event_type, partition_key, subject, payload) \
                 SELECT id, $1, agg, seq, 'Ticked', agg, $2 || '.' || $1 || '.' || agg || '.Ticked', $3::jsonb \
                 FROM unnest($4::uuid[], $5::text[], $6::int8[]) AS t(id, agg, seq)",
            )
            .bind::<Text, _>(kind)
            .bind::<Text, _>(&self.place.prefix)
            .bind::<Text, _>(&self.payload)
            .bind::<Array<SqlUuid>, _>(ids)
            .bind::<Array<Text>, _>(aggs)
            .bind::<Array<Int8>, _>(seqs)
            .execute(conn)
            .await?;
        }
        conn.batch_execute("ANALYZE outbox_events").await?;
        Ok(())
    }

    async fn queued(conn: &mut AsyncPgConnection, kind: &str) -> Result<bool, BoxError> {
        #[derive(QueryableByName)]
        struct Found {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            queued: bool,
        }
        let found: Found = diesel::sql_query(
            "SELECT EXISTS (SELECT 1 FROM outbox_events WHERE aggregate_type = $1 \
                 AND published_at IS NULL AND skipped_at IS NULL) AS queued",
        )
        .bind::<Text, _>(kind)
        .get_result(conn)
        .await?;
        Ok(found.queued)
    }

    /// Figure 1: raw async publishes of the same messages, acks awaited together.
    async fn ceiling(&self) -> Result<f64, BoxError> {
        let js = jetstream::new(self.place.nats.clone());
        let aggregates = self.args.aggregates.max(1);
        let messages: Vec<(String, HeaderMap)> = (0..self.args.events)
            .map(|i| {
                let aggregate = format!("a{}", i % aggregates);
                let seq = (i / aggregates) as i64 + 1;
                let subject = format!("{}.Ceiling.{aggregate}.Ticked", self.place.prefix);
                let headers = message_headers(uuid::Uuid::now_v7(), "Ceiling", &aggregate, seq);
                (subject, headers)
            })
            .collect();
        let payload = bytes::Bytes::from(self.payload.clone());
        let cpu = CpuTimes::now();
        let started = Instant::now();
        publish_pipelined(&js, messages, payload).await?;
        let rate = self.args.events as f64 / started.elapsed().as_secs_f64();
        println!("   {}", CpuTimes::per_event_since(cpu, self.args.events));
        Ok(rate)
    }

    /// Figure 2: the relay of the well-known articles. It reads through the outbox's claimable-rows
    /// index, so what it measures is its round trips, not a missing index.
    async fn naive_relay(&self) -> Result<f64, BoxError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = SqlUuid)]
            id: uuid::Uuid,
            #[diesel(sql_type = Text)]
            aggregate_id: String,
            #[diesel(sql_type = Int8)]
            aggregate_seq: i64,
            #[diesel(sql_type = Text)]
            subject: String,
            #[diesel(sql_type = Text)]
            payload: String,
        }
        let mut conn = AsyncPgConnection::establish(&self.place.database_url).await?;
        self.seed(&mut conn, "Naive", self.args.events).await?;
        let js = jetstream::new(self.place.nats.clone());
        let cpu = CpuTimes::now();
        let started = Instant::now();
        loop {
            let js = &js;
            let relayed = conn
                .transaction::<_, BoxError, _>(async |conn| {
                    let rows: Vec<Row> = diesel::sql_query(
                        "SELECT id, aggregate_id, aggregate_seq, subject, payload::text AS payload \
                         FROM outbox_events \
                         WHERE published_at IS NULL AND skipped_at IS NULL \
                           AND dead_lettered_at IS NULL AND available_at <= now() \
                           AND aggregate_type = 'Naive' \
                         ORDER BY available_at, id LIMIT 100 FOR UPDATE SKIP LOCKED",
                    )
                    .load(conn)
                    .await?;
                    for row in &rows {
                        let headers =
                            message_headers(row.id, "Naive", &row.aggregate_id, row.aggregate_seq);
                        js.publish_with_headers(
                            row.subject.clone(),
                            headers,
                            row.payload.clone().into(),
                        )
                        .await?
                        .await?;
                        diesel::sql_query(
                            "UPDATE outbox_events SET published_at = now() WHERE id = $1",
                        )
                        .bind::<SqlUuid, _>(row.id)
                        .execute(conn)
                        .await?;
                    }
                    Ok(rows.len())
                })
                .await?;
            if relayed == 0 {
                break;
            }
        }
        let rate = self.args.events as f64 / started.elapsed().as_secs_f64();
        println!("   {}", CpuTimes::per_event_since(cpu, self.args.events));
        Ok(rate)
    }

    /// Figure 3: seeds the events, then times `instances` relays until none is queued.
    async fn drain(
        &self,
        kind: &str,
        instances: usize,
        config: RelayConfig,
    ) -> Result<f64, BoxError> {
        let mut conn = AsyncPgConnection::establish(&self.place.database_url).await?;
        self.seed(&mut conn, kind, self.args.events).await?;
        let mut relays = Vec::new();
        for _ in 0..instances {
            relays.push(Relay::connect(config.clone(), self.place.nats.clone()).await?);
        }
        // Progress is watched on the stream (cheap for NATS), then the last marks in the
        // database: polling the table would load the PostgreSQL being measured.
        let mut stream = jetstream::new(self.place.nats.clone())
            .get_stream(&self.place.stream)
            .await?;
        let done = stream.info().await?.state.messages + self.args.events as u64;
        let cpu = CpuTimes::now();
        let started = Instant::now();
        let handles: Vec<_> = relays.into_iter().map(Relay::spawn).collect();
        while stream.info().await?.state.messages < done {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        while Self::queued(&mut conn, kind).await? {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let elapsed = started.elapsed();
        println!("   {}", CpuTimes::per_event_since(cpu, self.args.events));
        for handle in handles {
            handle.shutdown().await?;
        }
        Ok(self.args.events as f64 / elapsed.as_secs_f64())
    }

    /// Figure 5: commits one event per unit of work at `rate` for `latency_secs`, with the relay
    /// running; the latency of an event is its stream store time minus its commit time.
    async fn latency(&self, kind: &str, config: RelayConfig) -> Result<Latency, BoxError> {
        const PRODUCERS: u64 = 4;
        let mut stream = jetstream::new(self.place.nats.clone())
            .get_stream(&self.place.stream)
            .await?;
        let first_new = stream.info().await?.state.last_sequence + 1;
        let relay = Relay::connect(config, self.place.nats.clone())
            .await?
            .spawn();
        let outbox = Outbox::with_topology(self.place.topology());
        let committed: Arc<Mutex<HashMap<u64, SystemTime>>> = Arc::default();
        let duration = Duration::from_secs(self.args.latency_secs);
        let period = Duration::from_secs_f64(PRODUCERS as f64 / self.args.rate as f64);
        let pad = "x".repeat(self.args.payload.saturating_sub(30));
        let started = Instant::now();
        let mut producers = Vec::new();
        for producer in 0..PRODUCERS {
            let (outbox, committed, pad) = (outbox.clone(), Arc::clone(&committed), pad.clone());
            let (url, kind, aggregates) = (
                self.place.database_url.clone(),
                kind.to_owned(),
                self.args.aggregates as u64,
            );
            producers.push(tokio::spawn(async move {
                let mut conn = AsyncPgConnection::establish(&url).await?;
                let mut ticks = tokio::time::interval(period);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                let mut n = producer;
                while started.elapsed() < duration {
                    ticks.tick().await;
                    let mut probe = Probe {
                        id: format!("{kind}-{}", n % aggregates),
                        pending_events: PendingEvents::new(),
                    };
                    probe.record(Ticked {
                        n,
                        pad: pad.clone(),
                    });
                    outbox
                        .transaction(&mut conn, async |uow| {
                            uow.track(&mut probe);
                            Ok::<_, UnitOfWorkError>(())
                        })
                        .await?;
                    committed
                        .lock()
                        .expect("not poisoned")
                        .insert(n, SystemTime::now());
                    n += PRODUCERS;
                }
                Ok::<_, BoxError>(())
            }));
        }
        for producer in producers {
            producer.await??;
        }
        let produced_in = started.elapsed();
        let committed = std::mem::take(&mut *committed.lock().expect("not poisoned"));

        // Every committed event, as stored: its store time is its ack time.
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: format!("{}.Probe.*.Ticked", self.place.prefix),
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
        Ok(Latency {
            count: latencies.len(),
            offered_rate: latencies.len() as f64 / produced_in.as_secs_f64(),
            p50_ms: percentile(0.50),
            p99_ms: percentile(0.99),
            max_ms: latencies[latencies.len() - 1],
        })
    }

    /// Figure 6: the same business transaction with 0, 1 and 10 events, interleaved.
    async fn unit_of_work_cost(&self) -> Result<Cost, BoxError> {
        let mut conn = AsyncPgConnection::establish(&self.place.database_url).await?;
        conn.batch_execute(
            "CREATE TABLE bench_orders (id bigint PRIMARY KEY, total_cents bigint NOT NULL)",
        )
        .await?;
        let outbox = Outbox::with_topology(self.place.topology());
        let pad = "x".repeat(self.args.payload.saturating_sub(30));
        let mut times: [Vec<f64>; 3] = Default::default();
        let mut order_id = 0_i64;
        for round in 0..self.args.transactions + 100 {
            for (variant, events) in [0_usize, 1, 10].into_iter().enumerate() {
                order_id += 1;
                let mut probe = Probe {
                    id: format!("cost-{}", order_id % 1000),
                    pending_events: PendingEvents::new(),
                };
                for n in 0..events {
                    probe.record(Ticked {
                        n: n as u64,
                        pad: pad.clone(),
                    });
                }
                let started = Instant::now();
                outbox
                    .transaction(&mut conn, async |uow| {
                        diesel::sql_query("INSERT INTO bench_orders VALUES ($1, 4200)")
                            .bind::<Int8, _>(order_id)
                            .execute(uow.conn())
                            .await?;
                        uow.track(&mut probe);
                        Ok::<_, UnitOfWorkError>(())
                    })
                    .await?;
                // The first 100 rounds warm up caches and prepared statements.
                if round >= 100 {
                    times[variant].push(started.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        let mut mean = [0.0; 3];
        let mut median = [0.0; 3];
        for (variant, samples) in times.iter_mut().enumerate() {
            mean[variant] = samples.iter().sum::<f64>() / samples.len() as f64;
            samples.sort_by(f64::total_cmp);
            median[variant] = samples[samples.len() / 2];
        }

        // One large unit of work, over new aggregates and then over the same ones again.
        let mut bulk_ms = [0.0; 2];
        let mut probes: Vec<Probe> = (0..BULK)
            .map(|i| Probe {
                id: format!("bulk-{i}"),
                pending_events: PendingEvents::new(),
            })
            .collect();
        for ms in &mut bulk_ms {
            for (n, probe) in probes.iter_mut().enumerate() {
                probe.record(Ticked {
                    n: n as u64,
                    pad: pad.clone(),
                });
            }
            let started = Instant::now();
            outbox
                .transaction(&mut conn, async |uow| {
                    for probe in &mut probes {
                        uow.track(probe);
                    }
                    Ok::<_, UnitOfWorkError>(())
                })
                .await?;
            *ms = started.elapsed().as_secs_f64() * 1e3;
        }
        Ok(Cost {
            mean,
            median,
            bulk_ms,
        })
    }

    /// Figure 7: claims per second (claim, roll back) over the same queued rows, first alone, then
    /// with a million published rows kept.
    async fn claim_rate(&self) -> Result<Claims, BoxError> {
        let mut conn = AsyncPgConnection::establish(&self.place.database_url).await?;
        let batch = self.place.relay_config().batch_size as i64;
        conn.batch_execute("TRUNCATE outbox_events, outbox_aggregates")
            .await?;
        self.seed(&mut conn, "Claim", CLAIM_QUEUED).await?;
        conn.batch_execute("VACUUM ANALYZE outbox_events").await?;
        let empty = claims_per_second(&mut conn, batch).await?;

        // Published rows as the relay leaves them: inserted queued, then marked.
        self.seed(&mut conn, "Old", self.args.published_rows)
            .await?;
        conn.batch_execute(
            "UPDATE outbox_events SET published_at = now() WHERE aggregate_type = 'Old'; ANALYZE outbox_events",
        )
        .await?;
        let full_before_vacuum = claims_per_second(&mut conn, batch).await?;
        conn.batch_execute("VACUUM ANALYZE outbox_events").await?;
        let full = claims_per_second(&mut conn, batch).await?;
        Ok(Claims {
            empty,
            full,
            full_before_vacuum,
        })
    }

    /// Figure 8: publishes `events` messages straight to the stream (as the relay would), then
    /// times a plain consumer and the inbox over them, each with its own durable consumer and
    /// `max_concurrency` database connections; then the inbox over a tenth as many messages
    /// that all share one partition key, so are handled one at a time.
    async fn inbox_rates(&self) -> Result<InboxRates, BoxError> {
        let js = jetstream::new(self.place.nats.clone());
        let mut conn = AsyncPgConnection::establish(&self.place.database_url).await?;
        conn.batch_execute(
            "CREATE TABLE bench_effects (key text PRIMARY KEY, handled bigint NOT NULL)",
        )
        .await?;
        let filler = self
            .args
            .payload
            .saturating_sub(r#"{"n":0,"pad":""}"#.len());
        let payload = bytes::Bytes::from(serde_json::to_string(&Ticked {
            n: 0,
            pad: "x".repeat(filler),
        })?);
        let messages = |kind: &str, count: usize, aggregates: usize| {
            (0..count)
                .map(|i| {
                    let aggregate = format!("a{}", i % aggregates);
                    let seq = (i / aggregates) as i64 + 1;
                    let subject = format!("{}.{kind}.{aggregate}.Ticked", self.place.prefix);
                    let headers = message_headers(uuid::Uuid::now_v7(), kind, &aggregate, seq);
                    (subject, headers)
                })
                .collect::<Vec<_>>()
        };
        let events = self.args.events;
        let hot_count = (events / 10).max(1);
        publish_pipelined(
            &js,
            messages("Inbox", events, self.args.aggregates.max(1)),
            payload.clone(),
        )
        .await?;
        publish_pipelined(&js, messages("Hot", hot_count, 1), payload).await?;
        let config = |consumer: &str, kind: &str| {
            let mut config = InboxConfig::new(consumer, &self.place.database_url);
            config.outbox = Outbox::with_topology(self.place.topology());
            config.topology = self.place.topology();
            config.filter_subjects = vec![format!("{}.{kind}.>", self.place.prefix)];
            config
        };

        // The plain consumer: the same write in its own transaction, then the ack.
        let plain_config = config("plain", "Inbox");
        let consumer = js
            .get_stream(&self.place.stream)
            .await?
            .create_consumer(pull::Config {
                durable_name: Some("plain".to_owned()),
                filter_subject: plain_config.filters().remove(0),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ..Default::default()
            })
            .await?;
        let pool = Pool::builder(AsyncDieselConnectionManager::<AsyncPgConnection>::new(
            &self.place.database_url,
        ))
        .max_size(plain_config.max_concurrency)
        .build()?;
        let cpu = CpuTimes::now();
        let started = Instant::now();
        consumer
            .messages()
            .await?
            .take(events)
            .map_err(BoxError::from)
            .try_for_each_concurrent(plain_config.max_concurrency, |message| {
                let pool = &pool;
                async move {
                    let _: Ticked = serde_json::from_slice(&message.payload)?;
                    let key = message
                        .headers
                        .as_ref()
                        .and_then(|headers| headers.get("ce-partitionkey"))
                        .ok_or("no ce-partitionkey")?
                        .to_string();
                    let mut conn = pool.get().await?;
                    conn.transaction(async |conn| count_effect(conn, &key).await)
                        .await?;
                    message.ack().await?;
                    Ok(())
                }
            })
            .await?;
        let plain = events as f64 / started.elapsed().as_secs_f64();
        println!("   {}", CpuTimes::per_event_since(cpu, events));
        drop(pool);

        let mut rates = Vec::new();
        for (consumer, kind, count, emit) in [
            ("inbox", "Inbox", events, false),
            ("emitting", "Inbox", events, true),
            ("hot", "Hot", hot_count, false),
        ] {
            let handled = Arc::new(AtomicUsize::new(0));
            let handler = Effects {
                handled: Arc::clone(&handled),
                emit,
            };
            let inbox =
                Inbox::connect(config(consumer, kind), self.place.nats.clone(), handler).await?;
            let cpu = CpuTimes::now();
            let started = Instant::now();
            let running = inbox.spawn();
            while AtomicUsize::load(&handled, Ordering::Relaxed) < count {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let elapsed = started.elapsed();
            println!("   {}", CpuTimes::per_event_since(cpu, count));
            running.shutdown().await?;
            rates.push(count as f64 / elapsed.as_secs_f64());
        }
        Ok(InboxRates {
            plain,
            inbox: rates[0],
            emitting: rates[1],
            hot: rates[2],
            hot_count,
        })
    }
}

/// Publishes `messages`, each with `payload`, keeping up to [`CEILING_WINDOW`] acks
/// outstanding.
async fn publish_pipelined(
    js: &jetstream::Context,
    messages: Vec<(String, HeaderMap)>,
    payload: bytes::Bytes,
) -> Result<(), BoxError> {
    let mut acks = FuturesUnordered::new();
    for (subject, headers) in messages {
        // Every unawaited ack holds one of async-nats's 5,000 in-flight permits.
        if acks.len() >= CEILING_WINDOW {
            acks.next().await.expect("a pending ack")?;
        }
        let ack = js
            .publish_with_headers(subject, headers, payload.clone())
            .await?;
        acks.push(std::future::IntoFuture::into_future(ack));
    }
    while let Some(ack) = acks.next().await {
        ack?;
    }
    Ok(())
}

/// The business write of figure 8: one upsert per message, keyed by its partition key.
async fn count_effect(conn: &mut AsyncPgConnection, key: &str) -> diesel::QueryResult<usize> {
    diesel::sql_query(
        "INSERT INTO bench_effects (key, handled) VALUES ($1, 1) \
         ON CONFLICT (key) DO UPDATE SET handled = bench_effects.handled + 1",
    )
    .bind::<Text, _>(key)
    .execute(conn)
    .await
}

/// Figure 8's handler: the business write, and when `emit` is set one event back.
#[derive(Clone)]
struct Effects {
    handled: Arc<AtomicUsize>,
    emit: bool,
}

impl Handler for Effects {
    type Event = Ticked;
    type Error = diesel::result::Error;

    async fn handle(
        &self,
        event: Ticked,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        count_effect(uow.conn(), &message.partition_key).await?;
        if self.emit {
            uow.emit("Counted", &message.partition_key, &event);
        }
        self.handled.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

async fn claims_per_second(conn: &mut AsyncPgConnection, batch: i64) -> Result<f64, BoxError> {
    let window = Duration::from_secs(3);
    let started = Instant::now();
    let mut claims = 0_u64;
    while started.elapsed() < window {
        let result = conn
            .transaction::<(), _, _>(async |conn| {
                let claimed = outbox_runtime::__private::claim_probe(conn, batch).await?;
                assert_eq!(claimed as i64, batch, "a full batch is claimed");
                Err(diesel::result::Error::RollbackTransaction)
            })
            .await;
        match result {
            Err(diesel::result::Error::RollbackTransaction) => claims += 1,
            Err(error) => return Err(error.into()),
            Ok(()) => unreachable!("the claim always rolls back"),
        }
    }
    Ok(claims as f64 / started.elapsed().as_secs_f64())
}
