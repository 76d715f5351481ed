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
//! 6. the unit of work's cost: a business transaction with 1 and 10 events against the same
//!    transaction on diesel-async without the outbox (and the unit of work with none), 64
//!    events (the most that ride on the COMMIT's query) against 65 (sent with binds) per
//!    event, and one unit of work of 10,000 events over as many aggregates, new and again;
//! 7. the claim rate with a million published rows kept against an empty table;
//! 8. the inbox: messages handled per second with a one-row business write, against a plain
//!    consumer doing the same write without an inbox, both taking a stream of their own (the
//!    inbox's default filter); with 2 and 3 instances of the consumer; with a filter narrower
//!    than the stream; with an emitted event; on one key, with 1 and 2 instances; with
//!    handlers that wait 20 ms before the write (a call to another service), with 1, 2 and 3
//!    instances;
//! 9. a three-node JetStream cluster on loopback (three nats-server processes the benchmark
//!    starts: `NATS_SERVER_BIN`, else `nats-server` on the PATH, else Debian's): the ceiling,
//!    this relay and its commit-to-ack latency, on a stream of one replica and of three.
//! 10. on nats-server 2.12 and later: atomic batch publish (ADR-50) of the same messages,
//!     several batches in flight, and on 2.14 and later batched fast publish, against
//!     figure 1's pipelined publishes, on one stream.
//! 11. write throughput with 1, 8, 32 and 64 concurrent writers: without the outbox, with it
//!     and one relay, with every commit notifying, with no relay running, and with two relay
//!     instances, each with its notifications per commit; the pgbench floor beside them.
//!
//! It works in a database and a stream of its own, removed at the end; each figure that runs
//! a relay starts from an empty outbox. `OUTBOX_BENCH_DATABASE_URL`
//! (default `postgres://postgres@127.0.0.1:5432/postgres`) and `NATS_URL` point it elsewhere.
//!
//! It allocates with mimalloc, as the `outbox` daemon does; `--features system-allocator`
//! measures the relay on glibc's malloc, as a service embedding it with the default
//! allocator runs it (a quarter more instructions per relayed event).

#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    Relay, RelayConfig, StreamSettings, Topology, UnitOfWork, UnitOfWorkError, aggregate,
};
use serde::{Deserialize, Serialize};

#[path = "../tests/support/cluster.rs"]
mod cluster;
#[path = "../tests/support/counters.rs"]
#[allow(dead_code)] // the bench reads the totals by the claims key only
mod counters;
#[path = "support/place.rs"]
mod place;
#[path = "support/writers.rs"]
mod writers;

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
    /// Length of each write-throughput run of figure 11, in seconds.
    #[arg(long, default_value_t = 3.0)]
    writer_secs: f64,
    /// Rounds of figure 3's scale-out (1, 2 and 3 relay instances), each round in another
    /// order (1-2-3, 2-3-1, 3-1-2, ...), so that no instance count always drains first or
    /// last; the ratios are those of the medians.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Counts figure 3's claims (`outbox_relay_claims_total`, rows found or nothing) and
    /// prints them after each drain. Installs a metrics recorder, which every metrics call of
    /// the relays then pays, so the drains' rates are not those of the runs without it.
    #[arg(long)]
    count_claims: bool,
    /// The measurements to run, by number (1 to 11); all by default. Ratios are printed when
    /// both their parts ran.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 3, 5, 6, 7, 8, 9, 10, 11])]
    phases: Vec<u8>,
}

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
struct Ticked {
    n: u64,
    pad: String,
}

/// A `Ticked` with a producer dedup key, for figure 6's cost of the key.
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[event(name = "KeyedTick")]
struct KeyedTick {
    #[event(dedup_key)]
    key: String,
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
    /// The metrics recorder's counters, with `--count-claims`.
    counters: Option<&'static counters::Counters>,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let place = Place::new("bench").await?;
    let payload = place::payload(args.payload);
    let counters = args.count_claims.then(counters::Counters::installed);
    let bench = Bench {
        args,
        place,
        payload,
        counters,
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
            let ceiling = self.ceiling(&self.place.nats).await?;
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
            // rates[n - 1]: the drains of n instances, one per round.
            let mut rates: [Vec<f64>; 3] = Default::default();
            let rounds = self.args.rounds.max(1);
            for round in 0..rounds {
                if rounds > 1 {
                    println!("   round {} of {rounds}", round + 1);
                }
                for k in 0..3 {
                    let instances = (round + k) % 3 + 1;
                    let rate = self
                        .drain(
                            &self.place.nats,
                            &format!("Relay{instances}x{round}"),
                            instances,
                            self.place.relay_config(),
                        )
                        .await?;
                    let label = match instances {
                        1 => "3. this relay, defaults".to_owned(),
                        n => format!("3. this relay, {n} instances"),
                    };
                    report(&label, rate, "events/s");
                    rates[instances - 1].push(rate);
                }
            }
            let [relay, relay2, relay3] = rates.map(|mut runs| median(&mut runs));
            if rounds > 1 {
                println!(
                    "   medians of {rounds} rounds: 1 / 2 / 3 instances {relay:.0} / {relay2:.0} / {relay3:.0} events/s"
                );
            }
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
                let other_rate = self
                    .drain(&self.place.nats, &format!("Relay{}", i + 3), 1, other)
                    .await?;
                report(
                    &format!("3. this relay, published rows: {mode:?}"),
                    other_rate,
                    "events/s",
                );
            }
            println!();
            if let Some(ceiling) = ceiling {
                let r = relay / ceiling;
                ratio("4. ratio 3/1 (this relay / ceiling)", r, ">= 0.7", r >= 0.7);
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
                .latency(&self.place.nats, "LatencyNotify", self.place.relay_config())
                .await?;
            let mut polling = self.place.relay_config();
            polling.listen = false;
            let polled = self
                .latency(&self.place.nats, "LatencyPoll", polling.clone())
                .await?;
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
                "<= 10",
                notified.p99_ms <= 10.0,
            );
            println!();
        }

        if phase(6) {
            let cost = self.unit_of_work_cost().await?;
            println!(
                "6. mean per transaction: bare (diesel-async, no outbox) {:.3} ms; unit of work with no event {:.3} ms, 1 event {:.3} ms, 10 events {:.3} ms, 1 event with a dedup key {:.3} ms (medians {:.3}; {:.3} / {:.3} / {:.3} / {:.3} ms)",
                cost.mean[BARE],
                cost.mean[0],
                cost.mean[1],
                cost.mean[2],
                cost.mean[3],
                cost.median[BARE],
                cost.median[0],
                cost.median[1],
                cost.median[2],
                cost.median[3]
            );
            let one = cost.mean[1] / cost.mean[BARE];
            ratio("6. 1 event / bare", one, "<= 1.15", one <= 1.15);
            untargeted_ratio("6. no event / bare", cost.mean[0] / cost.mean[BARE]);
            untargeted_ratio("6. 1 event / no event", cost.mean[1] / cost.mean[0]);
            untargeted_ratio("6. 10 events / bare", cost.mean[2] / cost.mean[BARE]);
            println!(
                "6. 1 event with the transaction's id asked for (report_transaction_ids): mean {:.3} ms, median {:.3} ms",
                cost.mean[IDENTIFIED], cost.median[IDENTIFIED]
            );
            untargeted_ratio(
                "6. 1 event with the id / bare",
                cost.mean[IDENTIFIED] / cost.mean[BARE],
            );
            untargeted_ratio("6. 1 keyed event / 1 event", cost.mean[3] / cost.mean[1]);
            // The largest unit of work whose events ride on the COMMIT's query against the
            // smallest that sends them with binds in a round trip of their own, per event: 1
            // where the limit sits at the two ways' crossover, above 1 where the text is
            // cheaper (the COMMIT's round trip saved outweighs parsing the constants).
            println!(
                "6. unit of work, mean per transaction: {AT_COMMIT} events on as many aggregates (with the COMMIT) {:.3} ms, {} (with binds) {:.3} ms",
                cost.mean[4],
                AT_COMMIT + 1,
                cost.mean[5]
            );
            untargeted_ratio(
                "6. per event, with binds / with the COMMIT",
                (cost.mean[5] / (AT_COMMIT + 1) as f64) / (cost.mean[4] / AT_COMMIT as f64),
            );
            for (events, [new, again]) in BULK.iter().zip(cost.bulk_ms) {
                println!(
                    "6. one unit of work of {events} events over as many aggregates: new {new:.0} ms, again {again:.0} ms"
                );
            }
            // Per event, the large against the small: 1 where the cost grows with the events,
            // 10 where it grows with their square.
            untargeted_ratio(
                &format!(
                    "6. per event, {} events / {} events (1 is linear)",
                    BULK[1], BULK[0]
                ),
                (cost.bulk_ms[1][0] / BULK[1] as f64) / (cost.bulk_ms[0][0] / BULK[0] as f64),
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
                "8. inbox: the same write, 2 instances",
                inbox.inbox2,
                "messages/s",
            );
            report(
                "8. inbox: the same write, 3 instances",
                inbox.inbox3,
                "messages/s",
            );
            println!(
                "   scale-out: 2 instances / 1 = {:.2}x, 3 instances / 1 = {:.2}x",
                inbox.inbox2 / inbox.inbox,
                inbox.inbox3 / inbox.inbox
            );
            report(
                "8. inbox: the same write, a filter narrower than the stream",
                inbox.narrow,
                "messages/s",
            );
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
            report(
                &format!(
                    "8. inbox: every message on one partition key, 2 instances ({} messages)",
                    inbox.hot_count
                ),
                inbox.hot2,
                "messages/s",
            );
            for (n, rate) in inbox.waiting.iter().enumerate() {
                report(
                    &format!(
                        "8. inbox: a {HANDLER_WAIT_MS} ms wait, then the write, {} instance(s) ({} messages)",
                        n + 1,
                        inbox.hot_count
                    ),
                    *rate,
                    "messages/s",
                );
            }
            println!(
                "   scale-out with waiting handlers: 2 instances / 1 = {:.2}x, 3 instances / 1 = {:.2}x",
                inbox.waiting[1] / inbox.waiting[0],
                inbox.waiting[2] / inbox.waiting[0]
            );
            untargeted_ratio("8. inbox / plain consumer", inbox.inbox / inbox.plain);
        }
        if phase(9) {
            self.cluster_figures().await?;
            println!();
        }
        if phase(10) {
            self.atomic_batch_figures().await?;
        }
        if phase(11) {
            self.writer_figures().await?;
        }
        Ok(())
    }

    /// Figure 11: write throughput under 1, 8, 32 and 64 writers, with and without the
    /// outbox, and commit-to-ack latency under 32 writers.
    async fn writer_figures(&self) -> Result<(), BoxError> {
        self.empty_outbox().await?;
        let secs = self.args.writer_secs;
        println!(
            "11. write throughput, {secs} s per run, one business insert per transaction (and one event with the outbox), a relay draining"
        );
        for writers in writers::WRITERS {
            let mut rates = Vec::new();
            for way in writers::Way::ALL {
                let run = writers::run(
                    &self.place,
                    way,
                    writers,
                    secs,
                    self.args.payload,
                    writers == 32 && way != writers::Way::OutboxWithoutRelay,
                )
                .await?;
                if !run.latencies_ms.is_empty() {
                    println!(
                        "11. {writers} writers, {}: commit-to-ack p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} events)",
                        way.label(),
                        run.percentile(0.5),
                        run.percentile(0.99),
                        run.percentile(1.0),
                        run.latencies_ms.len()
                    );
                }
                rates.push((way, run.commits_per_sec, run.notifications_per_commit));
            }
            let bare = rates[0].1;
            let line: Vec<String> = rates
                .iter()
                .map(|(way, rate, notified)| match way {
                    writers::Way::Bare => format!("{} {rate:.0}/s", way.label()),
                    _ => format!(
                        "{} {rate:.0}/s ({:.2}x; {notified:.2} notifications per commit)",
                        way.label(),
                        rate / bare
                    ),
                })
                .collect();
            println!("11. {writers} writers: {}", line.join(", "));
            match writers::pgbench_floor(&self.place, writers, secs).await {
                Ok((bare, extra)) => println!(
                    "11. {writers} writers, pgbench floor: bare {bare:.0}/s, one more insert {extra:.0}/s ({:.2}x)",
                    extra / bare
                ),
                Err(reason) => println!("11. {writers} writers, pgbench floor: none ({reason})"),
            }
            if writers == 32 {
                let r = rates[1].1 / bare;
                ratio("11. 32 writers, outbox / no outbox", r, ">= 0.8", r >= 0.8);
            }
        }
        println!();
        Ok(())
    }

    /// Figure 10: the same messages published in atomic batches (nats-server 2.12+, ADR-50:
    /// `Nats-Batch-Id`, `Nats-Batch-Sequence`, `Nats-Batch-Commit`; a request opens the
    /// batch, the middle messages go without a reply, the commit's reply is the pub ack),
    /// [`BATCHES_IN_FLIGHT`] batches at a time, against pipelined publishes to the same
    /// stream (its own, allowing atomic publish).
    async fn atomic_batch_figures(&self) -> Result<(), BoxError> {
        let version = self.place.nats.server_info().version;
        if !outbox_runtime::nats::server_at_least(&version, 2, 12) {
            println!(
                "10. atomic batch publish: skipped, nats-server {version} is older than 2.12 \
                 (set NATS_URL to a current server)"
            );
            return Ok(());
        }
        let js = jetstream::new(self.place.nats.clone());
        let prefix = format!("{}atomic", self.place.prefix);
        let stream = format!("{}_ATOMIC", self.place.stream);
        js.create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            allow_atomic_publish: true,
            allow_batch_publish: outbox_runtime::nats::server_at_least(&version, 2, 14),
            ..Default::default()
        })
        .await?;
        let result = self.atomic_batch_runs(&js, &prefix, &version).await;
        js.delete_stream(&stream).await?;
        result
    }

    async fn atomic_batch_runs(
        &self,
        js: &jetstream::Context,
        prefix: &str,
        version: &str,
    ) -> Result<(), BoxError> {
        let aggregates = self.args.aggregates.max(1);
        let messages = |kind: &str| -> Vec<(String, HeaderMap)> {
            (0..self.args.events)
                .map(|i| {
                    let aggregate = format!("a{}", i % aggregates);
                    let seq = (i / aggregates) as i64 + 1;
                    let headers = message_headers(uuid::Uuid::now_v7(), kind, &aggregate, seq);
                    (format!("{prefix}.{kind}.{aggregate}.Ticked"), headers)
                })
                .collect()
        };
        let payload = bytes::Bytes::from(self.payload.clone());
        println!("10. atomic batch publish, nats-server {version}, one stream");
        let started = Instant::now();
        publish_pipelined(js, messages("Pipelined"), payload.clone()).await?;
        let pipelined = self.args.events as f64 / started.elapsed().as_secs_f64();
        report(
            "10. pipelined publishes (figure 1's way)",
            pipelined,
            "events/s",
        );
        for size in [10, 100, 1000] {
            let kind = format!("Atomic{size}");
            let started = Instant::now();
            publish_atomic_batches(&self.place.nats, messages(&kind), payload.clone(), size)
                .await?;
            let rate = self.args.events as f64 / started.elapsed().as_secs_f64();
            report(
                &format!("10. atomic batches of {size}, {BATCHES_IN_FLIGHT} in flight"),
                rate,
                "events/s",
            );
            untargeted_ratio(
                &format!("10. atomic batches of {size} / pipelined"),
                rate / pipelined,
            );
        }
        if !outbox_runtime::nats::server_at_least(version, 2, 14) {
            println!("10. batched fast publish: skipped, nats-server {version} is older than 2.14");
            return Ok(());
        }
        for batches in [1, 4] {
            let kind = format!("Fast{batches}");
            let started = Instant::now();
            publish_fast_batches(&self.place.nats, messages(&kind), payload.clone(), batches)
                .await?;
            let rate = self.args.events as f64 / started.elapsed().as_secs_f64();
            report(
                &format!("10. batched fast publish, {batches} batch(es) at once"),
                rate,
                "events/s",
            );
            untargeted_ratio(
                &format!("10. batched fast publish, {batches} at once / pipelined"),
                rate / pipelined,
            );
        }
        Ok(())
    }

    /// Figure 9: the ceiling, the relay and its latency on a three-node cluster, with one
    /// replica and with three.
    async fn cluster_figures(&self) -> Result<(), BoxError> {
        let cluster = cluster::NatsCluster::start().await;
        let nats = outbox_runtime::nats::connect(&cluster.urls()).await?;
        let js = jetstream::new(nats.clone());
        println!(
            "9. a three-node cluster on loopback, nats-server {}",
            nats.server_info().version
        );
        let mut relayed = Vec::new();
        for replicas in [1, 3] {
            js.create_stream(jetstream::stream::Config {
                name: self.place.stream.clone(),
                subjects: vec![format!("{}.>", self.place.prefix)],
                num_replicas: replicas,
                ..Default::default()
            })
            .await?;
            // Where the stream's leader is against the server the client publishes through:
            // a publish to a leader on another node crosses a route each way.
            let leader = js
                .get_stream(&self.place.stream)
                .await?
                .info()
                .await?
                .cluster
                .clone()
                .and_then(|c| c.leader)
                .unwrap_or_default();
            println!(
                "9. R{replicas}: the stream's leader {leader}, the client's server {}",
                nats.server_info().server_name
            );
            let ceiling = self.ceiling(&nats).await?;
            let relay = self
                .drain(
                    &nats,
                    &format!("ClusterR{replicas}"),
                    1,
                    self.place.relay_config(),
                )
                .await?;
            let l = self
                .latency(
                    &nats,
                    &format!("ClusterLatencyR{replicas}"),
                    self.place.relay_config(),
                )
                .await?;
            js.delete_stream(&self.place.stream).await?;
            report(
                &format!("9. R{replicas}: ceiling, raw async JetStream publishes"),
                ceiling,
                "events/s",
            );
            report(&format!("9. R{replicas}: this relay"), relay, "events/s");
            println!(
                "9. R{replicas}: this relay / ceiling {:.2}; commit-to-ack latency, offered {:.0} events/s: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} events)",
                relay / ceiling,
                l.offered_rate,
                l.p50_ms,
                l.p99_ms,
                l.max_ms,
                l.count
            );
            relayed.push(relay);
        }
        untargeted_ratio("9. this relay, R3 / R1", relayed[1] / relayed[0]);
        Ok(())
    }
}

/// The median of `runs` (the mean of the middle two of an even count); NaN when empty.
fn median(runs: &mut [f64]) -> f64 {
    runs.sort_by(f64::total_cmp);
    match runs.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => runs[n / 2],
        n => (runs[n / 2 - 1] + runs[n / 2]) / 2.0,
    }
}

fn report(label: &str, value: f64, unit: &str) {
    println!("{label:<78} {value:>10.0} {unit}");
}

/// A ratio against its target, to three places: at two, 0.897 would read "0.90 NOT MET"
/// beside a target of 0.9.
fn ratio(label: &str, value: f64, target: &str, met: bool) {
    let verdict = if met { "met" } else { "NOT MET" };
    println!("{label:<78} {value:>10.3}   target {target}: {verdict}");
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
    /// Per variant of [`COST_VARIANTS`], in its order.
    mean: [f64; COST_VARIANT_COUNT],
    median: [f64; COST_VARIANT_COUNT],
    /// Per size of [`BULK`], milliseconds for one unit of work of that many events over as
    /// many new aggregates, then over the same aggregates again.
    bulk_ms: [[f64; 2]; 2],
}

/// One of figure 6's transactions: the same business insert, with `events` events (one
/// with a dedup key when `keyed`), over as many aggregates when `spread` (every tenth round
/// only), by way of `outbox`.
struct CostVariant {
    events: usize,
    keyed: bool,
    spread: bool,
    outbox: Via,
}

/// How a figure 6 transaction runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Via {
    /// diesel-async's own transaction, without the outbox: the bare transaction the unit of
    /// work's cost is measured against.
    Bare,
    /// A unit of work.
    Outbox,
    /// A unit of work of an outbox that reports transaction ids
    /// (`Outbox::report_transaction_ids`): what asking for the id with the BEGIN costs.
    Identified,
}

/// How many transactions figure 6 interleaves (a literal: the length of a constant built by
/// a `const fn` cannot size the arrays of an async function that reads it, rustc's query
/// cycle E0391).
const COST_VARIANT_COUNT: usize = 8;

/// Figure 6's transactions, interleaved in this order; `Cost` holds their times in it.
const COST_VARIANTS: [CostVariant; COST_VARIANT_COUNT] = [
    CostVariant::by(Via::Outbox, 0, false, false),
    CostVariant::by(Via::Outbox, 1, false, false),
    CostVariant::by(Via::Outbox, 10, false, false),
    CostVariant::by(Via::Outbox, 1, true, false),
    CostVariant::by(Via::Outbox, AT_COMMIT, false, true),
    CostVariant::by(Via::Outbox, AT_COMMIT + 1, false, true),
    CostVariant::by(Via::Bare, 0, false, false),
    CostVariant::by(Via::Identified, 1, false, false),
];

impl CostVariant {
    const fn by(outbox: Via, events: usize, keyed: bool, spread: bool) -> Self {
        Self {
            events,
            keyed,
            spread,
            outbox,
        }
    }
}

/// Figure 6's bare transaction, in [`COST_VARIANTS`].
const BARE: usize = 6;

/// Figure 6's unit of work of 1 event with the transaction's id, in [`COST_VARIANTS`].
const IDENTIFIED: usize = 7;

// The positions above name the transactions they say they do.
const _: () = assert!(
    matches!(COST_VARIANTS[BARE].outbox, Via::Bare)
        && matches!(COST_VARIANTS[IDENTIFIED].outbox, Via::Identified)
        && COST_VARIANTS[IDENTIFIED].events == 1
);

/// The most events a unit of work sends with its COMMIT (the runtime's limit, 64, which
/// `unit_of_work::a_unit_of_work_writes_its_events_in_the_commits_round_trip` pins): figure 6
/// compares it with one more.
const AT_COMMIT: usize = 64;

/// Events (one per aggregate) of the large units of work in figure 6. A unit of work that
/// searched its tracked aggregates on each `track` took 9.3-9.7 s for the second, 2.5-2.9 s
/// after.
const BULK: [usize; 2] = [10_000, 100_000];

struct Claims {
    empty: f64,
    full: f64,
    full_before_vacuum: f64,
}

struct InboxRates {
    plain: f64,
    inbox: f64,
    inbox2: f64,
    inbox3: f64,
    /// One instance, its filter narrower than its stream (`{prefix}.Inbox.>`).
    narrow: f64,
    emitting: f64,
    hot: f64,
    hot2: f64,
    /// Handlers that wait [`HANDLER_WAIT_MS`] first, with 1, 2 and 3 instances.
    waiting: [f64; 3],
    hot_count: usize,
}

impl Bench {
    /// Empties the outbox before a figure that claims or relays rows: what earlier figures left
    /// queued (figure 6's units of work, figure 7's claimed and rolled back rows, figure 8's
    /// emitted events) would otherwise be claimed or relayed inside this figure's measurement.
    async fn empty_outbox(&self) -> Result<(), BoxError> {
        let mut conn = AsyncPgConnection::establish(&self.place.database_url).await?;
        conn.batch_execute("TRUNCATE outbox_events, outbox_aggregates")
            .await?;
        Ok(())
    }

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
        // Each drain starts from a table without the dead rows of the drains before it: else
        // the later drains would walk them in the claim's index and pay for their order.
        conn.batch_execute("VACUUM ANALYZE outbox_events").await?;
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
    async fn ceiling(&self, nats: &async_nats::Client) -> Result<f64, BoxError> {
        let js = jetstream::new(nats.clone());
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
        self.empty_outbox().await?;
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
        nats: &async_nats::Client,
        kind: &str,
        instances: usize,
        config: RelayConfig,
    ) -> Result<f64, BoxError> {
        self.empty_outbox().await?;
        let mut conn = AsyncPgConnection::establish(&self.place.database_url).await?;
        self.seed(&mut conn, kind, self.args.events).await?;
        let mut relays = Vec::new();
        for _ in 0..instances {
            relays.push(Relay::connect(config.clone(), nats.clone()).await?);
        }
        // Progress is watched on the stream (cheap for NATS), then the last marks in the
        // database: polling the table would load the PostgreSQL being measured.
        let mut stream = jetstream::new(nats.clone())
            .get_stream(&self.place.stream)
            .await?;
        let done = stream.info().await?.state.messages + self.args.events as u64;
        let claims_before = self.claims();
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
        if let (Some((rows_before, nothing_before)), Some((rows, nothing))) =
            (claims_before, self.claims())
        {
            println!(
                "   claims of the drain: {} found rows, {} found nothing",
                rows - rows_before,
                nothing - nothing_before
            );
        }
        for handle in handles {
            handle.shutdown().await?;
        }
        Ok(self.args.events as f64 / elapsed.as_secs_f64())
    }

    /// With `--count-claims`: the relays' claims on the bench's stream so far that found rows
    /// and that found nothing.
    fn claims(&self) -> Option<(u64, u64)> {
        let all = self.counters?.all();
        let stream = &self.place.stream;
        let count = |found| {
            all.get(&counters::Counters::claims_key(stream, found))
                .copied()
                .unwrap_or(0)
        };
        Some((count("rows"), count("nothing")))
    }

    /// Figure 5: commits one event per unit of work at `rate` for `latency_secs`, with the relay
    /// running; the latency of an event is its stream store time minus its commit time.
    async fn latency(
        &self,
        nats: &async_nats::Client,
        kind: &str,
        config: RelayConfig,
    ) -> Result<Latency, BoxError> {
        const PRODUCERS: u64 = 4;
        self.empty_outbox().await?;
        let mut stream = jetstream::new(nats.clone())
            .get_stream(&self.place.stream)
            .await?;
        let first_new = stream.info().await?.state.last_sequence + 1;
        let relay = Relay::connect(config, nats.clone()).await?.spawn();
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
        let identified = outbox.clone().report_transaction_ids(true);
        let mut times: [Vec<f64>; COST_VARIANT_COUNT] = Default::default();
        let mut order_id = 0_i64;
        for round in 0..self.args.transactions + 100 {
            for (variant, v) in COST_VARIANTS.iter().enumerate() {
                // The largest, every tenth round: they would grow the table ten times over.
                if v.spread && round % 10 != 0 {
                    continue;
                }
                order_id += 1;
                let insert = diesel::sql_query("INSERT INTO bench_orders VALUES ($1, 4200)")
                    .bind::<Int8, _>(order_id);
                let started;
                match v.outbox {
                    Via::Bare => {
                        started = Instant::now();
                        conn.transaction::<_, diesel::result::Error, _>(async |conn| {
                            insert.execute(conn).await
                        })
                        .await?;
                    }
                    Via::Outbox | Via::Identified => {
                        // One aggregate, or one per event for the largest.
                        let aggregates = if v.spread { v.events } else { 1 };
                        let mut probes: Vec<Probe> = (0..aggregates)
                            .map(|k| Probe {
                                id: format!("cost-{}-{k}", order_id % 1000),
                                pending_events: PendingEvents::new(),
                            })
                            .collect();
                        if !v.keyed {
                            for n in 0..v.events {
                                probes[n % aggregates].record(Ticked {
                                    n: n as u64,
                                    pad: pad.clone(),
                                });
                            }
                        }
                        let key = v.keyed.then(|| KeyedTick {
                            key: format!("{}-{order_id}", self.place.prefix),
                            pad: pad.clone(),
                        });
                        let probe_id = probes[0].id.clone();
                        let outbox = if v.outbox == Via::Identified {
                            &identified
                        } else {
                            &outbox
                        };
                        started = Instant::now();
                        outbox
                            .transaction(&mut conn, async |uow| {
                                insert.execute(uow.conn()).await?;
                                for probe in &mut probes {
                                    uow.track(probe);
                                }
                                if let Some(keyed) = &key {
                                    uow.emit("Probe", &probe_id, keyed);
                                }
                                Ok::<_, UnitOfWorkError>(())
                            })
                            .await?;
                    }
                }
                // The first 100 rounds warm up caches and prepared statements.
                if round >= 100 {
                    times[variant].push(started.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        let mut mean = [0.0; COST_VARIANT_COUNT];
        let mut median = [0.0; COST_VARIANT_COUNT];
        for (variant, samples) in times.iter_mut().enumerate() {
            mean[variant] = samples.iter().sum::<f64>() / samples.len() as f64;
            samples.sort_by(f64::total_cmp);
            median[variant] = samples[samples.len() / 2];
        }

        // Large units of work, over new aggregates and then over the same ones again.
        let mut bulk_ms = [[0.0; 2]; 2];
        for (size, timings) in BULK.into_iter().zip(&mut bulk_ms) {
            let mut probes: Vec<Probe> = (0..size)
                .map(|i| Probe {
                    id: format!("bulk{size}-{i}"),
                    pending_events: PendingEvents::new(),
                })
                .collect();
            for ms in timings {
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
        self.empty_outbox().await?;
        let mut conn = AsyncPgConnection::establish(&self.place.database_url).await?;
        let batch = self.place.relay_config().batch_size as i64;
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

    /// Figure 8: publishes `events` messages straight to the run's stream (as the relay
    /// would), then times a plain consumer and the inbox over them, each with its own durable
    /// consumer and `max_concurrency` database connections; then the inbox over a tenth as
    /// many messages that all share one partition key, so are handled one at a time, on a
    /// stream of their own (so that the first consumers take their whole stream).
    async fn inbox_rates(&self) -> Result<InboxRates, BoxError> {
        let js = jetstream::new(self.place.nats.clone());
        let mut conn = AsyncPgConnection::establish(&self.place.database_url).await?;
        conn.batch_execute(
            "CREATE TABLE bench_effects (key text PRIMARY KEY, handled bigint NOT NULL)",
        )
        .await?;
        // The run's stream holds the "Inbox" messages only, so that a consumer of them takes
        // the whole stream, as one with the inbox's default filter does: what the figures
        // before left in it goes first (a full run's consumers took figure 1's messages, and
        // failed to decode them). The one-key messages go to a stream of their own.
        js.get_stream(&self.place.stream).await?.purge().await?;
        let hot = Topology::new(
            format!("{}hot", self.place.prefix).parse()?,
            StreamSettings {
                name: format!("{}_HOT", self.place.stream),
                create: false,
                ..StreamSettings::default()
            },
        );
        js.create_stream(jetstream::stream::Config {
            name: hot.stream.name.clone(),
            subjects: vec![hot.subject_prefix.all_subjects()],
            ..Default::default()
        })
        .await?;
        let result = self.inbox_rates_on(&js, &hot).await;
        js.delete_stream(&hot.stream.name).await?;
        result
    }

    /// [`Self::inbox_rates`] once its streams are there: `hot`, the one-key messages'.
    async fn inbox_rates_on(
        &self,
        js: &jetstream::Context,
        hot: &Topology,
    ) -> Result<InboxRates, BoxError> {
        let filler = self
            .args
            .payload
            .saturating_sub(r#"{"n":0,"pad":""}"#.len());
        let payload = bytes::Bytes::from(serde_json::to_string(&Ticked {
            n: 0,
            pad: "x".repeat(filler),
        })?);
        let messages = |topology: &Topology, kind: &str, count: usize, aggregates: usize| {
            (0..count)
                .map(|i| {
                    let aggregate = format!("a{}", i % aggregates);
                    let seq = (i / aggregates) as i64 + 1;
                    let subject = format!("{}.{kind}.{aggregate}.Ticked", topology.subject_prefix);
                    let headers = message_headers(uuid::Uuid::now_v7(), kind, &aggregate, seq);
                    (subject, headers)
                })
                .collect::<Vec<_>>()
        };
        let events = self.args.events;
        let hot_count = (events / 10).max(1);
        let main = self.place.topology();
        publish_pipelined(
            js,
            messages(&main, "Inbox", events, self.args.aggregates.max(1)),
            payload.clone(),
        )
        .await?;
        publish_pipelined(js, messages(hot, "Hot", hot_count, 1), payload).await?;
        // A consumer of all its topology's subjects, or with `filter` (narrower than its
        // stream).
        let config = |consumer: &str, topology: &Topology, filter: Option<String>| {
            let mut config = InboxConfig::new(consumer, &self.place.database_url);
            config.outbox = Outbox::with_topology(self.place.topology());
            config.topology = topology.clone();
            config.filter_subjects = filter.into_iter().collect();
            config
        };

        // The plain consumer: the same write in its own transaction, then the ack. It takes
        // the whole stream without a filter, as the inbox's consumer does.
        let plain_config = config("plain", &main, None);
        let consumer = js
            .get_stream(&self.place.stream)
            .await?
            .create_consumer(pull::Config {
                durable_name: Some("plain".to_owned()),
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
        let waiting = Duration::from_millis(HANDLER_WAIT_MS);
        let narrow = Some(format!("{}.Inbox.>", main.subject_prefix));
        for (consumer, topology, filter, count, emit, instances, wait) in [
            ("inbox", &main, None, events, false, 1, Duration::ZERO),
            ("inbox2", &main, None, events, false, 2, Duration::ZERO),
            ("inbox3", &main, None, events, false, 3, Duration::ZERO),
            ("narrow", &main, narrow, events, false, 1, Duration::ZERO),
            ("emitting", &main, None, events, true, 1, Duration::ZERO),
            ("hot", hot, None, hot_count, false, 1, Duration::ZERO),
            ("hot2", hot, None, hot_count, false, 2, Duration::ZERO),
            ("waiting1", &main, None, hot_count, false, 1, waiting),
            ("waiting2", &main, None, hot_count, false, 2, waiting),
            ("waiting3", &main, None, hot_count, false, 3, waiting),
        ] {
            let handled = Arc::new(AtomicUsize::new(0));
            let handler = Effects {
                handled: Arc::clone(&handled),
                emit,
                wait,
            };
            // Each instance on a client of its own, as separate processes would be.
            let mut inboxes = Vec::new();
            for _ in 0..instances {
                let nats = outbox_runtime::nats::connect(&self.place.nats_url).await?;
                let config = config(consumer, topology, filter.clone());
                inboxes.push(Inbox::connect(config, nats, handler.clone()).await?);
            }
            let cpu = CpuTimes::now();
            let started = Instant::now();
            let running: Vec<_> = inboxes.into_iter().map(Inbox::spawn).collect();
            while AtomicUsize::load(&handled, Ordering::Relaxed) < count {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let elapsed = started.elapsed();
            println!("   {}", CpuTimes::per_event_since(cpu, count));
            for running in running {
                running.shutdown().await?;
            }
            rates.push(count as f64 / elapsed.as_secs_f64());
        }
        Ok(InboxRates {
            plain,
            inbox: rates[0],
            inbox2: rates[1],
            inbox3: rates[2],
            narrow: rates[3],
            emitting: rates[4],
            hot: rates[5],
            hot2: rates[6],
            waiting: [rates[7], rates[8], rates[9]],
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

/// Atomic batches open at once in figure 10 (the server allows 50 per stream).
const BATCHES_IN_FLIGHT: usize = 16;

/// Publishes `messages` in atomic batches of `size` (ADR-50), [`BATCHES_IN_FLIGHT`] at a
/// time: the first message of a batch is a request (the server answers it empty, or with an
/// error), the middle ones go without a reply, the last carries `Nats-Batch-Commit: 1` and
/// its reply is the batch's pub ack.
async fn publish_atomic_batches(
    nats: &async_nats::Client,
    messages: Vec<(String, HeaderMap)>,
    payload: bytes::Bytes,
    size: usize,
) -> Result<(), BoxError> {
    use async_nats::header::{NATS_BATCH_COMMIT, NATS_BATCH_ID, NATS_BATCH_SEQUENCE};
    let failed = |reply: &async_nats::Message| -> Option<String> {
        let answer: serde_json::Value = serde_json::from_slice(&reply.payload).ok()?;
        answer.get("error").map(|error| error.to_string())
    };
    let batches: Vec<Vec<(String, HeaderMap)>> =
        messages.chunks(size).map(|chunk| chunk.to_vec()).collect();
    futures::stream::iter(batches)
        .map(|batch| {
            let payload = payload.clone();
            async move {
                let id = uuid::Uuid::new_v4().simple().to_string();
                let last = batch.len();
                for (n, (subject, mut headers)) in batch.into_iter().enumerate() {
                    headers.insert(NATS_BATCH_ID, id.as_str());
                    headers.insert(NATS_BATCH_SEQUENCE, (n + 1).to_string().as_str());
                    if n + 1 == last {
                        headers.insert(NATS_BATCH_COMMIT, "1");
                    }
                    if n == 0 || n + 1 == last {
                        let reply = nats
                            .request_with_headers(subject, headers, payload.clone())
                            .await?;
                        if let Some(error) = failed(&reply) {
                            return Err(BoxError::from(format!("batch {id}: {error}")));
                        }
                    } else {
                        nats.publish_with_headers(subject, headers, payload.clone())
                            .await?;
                    }
                }
                Ok(())
            }
        })
        .buffer_unordered(BATCHES_IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// The most messages a fast batch asks the server to ack at once (it ramps up to it).
const FAST_BATCH_FLOW: u64 = 500;

/// Publishes `messages` as `batches` batched fast publishes (nats-server 2.14+, ADR-50
/// revision 5, as nats-server's `server/stream.go` parses it): each message goes without
/// waiting, its reply subject `<inbox>.<batch id>.<flow>.<gap mode>.<batch seq>.<op>.$FI`
/// carrying the batch; the server answers on it with a flow ack (`{"type":"ack","seq",
/// "msgs"}`) every `msgs` messages, which this keeps within two of, and the last message
/// (op commit) with the batch's pub ack once everything is stored.
async fn publish_fast_batches(
    nats: &async_nats::Client,
    messages: Vec<(String, HeaderMap)>,
    payload: bytes::Bytes,
    batches: usize,
) -> Result<(), BoxError> {
    let per_batch = messages.len().div_ceil(batches.max(1));
    let chunks: Vec<Vec<(String, HeaderMap)>> = messages
        .chunks(per_batch.max(1))
        .map(|chunk| chunk.to_vec())
        .collect();
    futures::future::try_join_all(
        chunks
            .into_iter()
            .map(|chunk| publish_fast_batch(nats, chunk, payload.clone())),
    )
    .await?;
    Ok(())
}

async fn publish_fast_batch(
    nats: &async_nats::Client,
    messages: Vec<(String, HeaderMap)>,
    payload: bytes::Bytes,
) -> Result<(), BoxError> {
    const START: u8 = 0;
    const APPEND: u8 = 1;
    const COMMIT: u8 = 2;
    let inbox = nats.new_inbox();
    let mut replies = nats.subscribe(format!("{inbox}.>")).await?;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let last = messages.len() as u64;
    let (mut acked, mut every) = (0_u64, FAST_BATCH_FLOW);
    // Reads one answer of the server: a flow ack moves `acked`; anything else is the end.
    let mut next = async |acked: &mut u64, every: &mut u64| -> Result<bool, BoxError> {
        let reply = tokio::time::timeout(Duration::from_secs(10), replies.next())
            .await
            .map_err(|_| "no answer to a fast batch within 10 s")?
            .ok_or("the reply subscription ended")?;
        let answer: serde_json::Value = serde_json::from_slice(&reply.payload)?;
        match answer.get("type").and_then(|kind| kind.as_str()) {
            Some("ack") => {
                *acked = (*acked).max(answer["seq"].as_u64().unwrap_or(0));
                *every = answer["msgs"].as_u64().unwrap_or(*every).max(1);
                Ok(false)
            }
            None if answer.get("error").is_none() => Ok(true), // the pub ack
            _ => Err(format!("fast batch {id}: {answer}").into()),
        }
    };
    for (n, (subject, headers)) in messages.into_iter().enumerate() {
        let seq = n as u64 + 1;
        let op = match seq {
            _ if seq == last => COMMIT,
            1 => START,
            _ => APPEND,
        };
        let reply = format!("{inbox}.{id}.{FAST_BATCH_FLOW}.fail.{seq}.{op}.$FI");
        nats.publish_with_reply_and_headers(subject, reply, headers, payload.clone())
            .await?;
        while seq != last && seq - acked >= 2 * every {
            if next(&mut acked, &mut every).await? {
                return Err("a fast batch ended before its commit".into());
            }
        }
    }
    while !next(&mut acked, &mut every).await? {}
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

/// How long figure 8's waiting handlers wait before their write: a call to another service.
const HANDLER_WAIT_MS: u64 = 20;

/// Figure 8's handler: waits `wait` (a call to another service), does the business write,
/// and when `emit` is set emits one event back.
#[derive(Clone)]
struct Effects {
    handled: Arc<AtomicUsize>,
    emit: bool,
    wait: Duration,
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
        if !self.wait.is_zero() {
            tokio::time::sleep(self.wait).await;
        }
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
                conn.batch_execute("SET LOCAL outbox.relay_batch = 'on'")
                    .await?;
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
