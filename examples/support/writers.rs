//! Figure 11 of `relay_bench`: write throughput with 1, 8, 32 and 64 concurrent writers,
//! without the outbox, with it, and with it notifying at every commit (the insert trigger
//! of before the relay's doorbell), with a relay draining the outbox all along; with the
//! outbox and no relay during the run (the write path's own cost); with two relay instances;
//! the notifications per commit of each run; and commit-to-ack latency under 32 writers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_nats::jetstream::{self, consumer::DeliverPolicy, consumer::pull};
use diesel::sql_types::Int8;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures::StreamExt;
use outbox_runtime::{Outbox, PendingEvents, Relay, UnitOfWorkError};

use crate::place::{BoxError, Place};
use crate::{Probe, Ticked};

/// `outbox_events_notify()` as before the doorbell (every insert notifies, on the table's
/// channel of today), and with it.
const EVERY_INSERT_NOTIFIES: &str = "\
    CREATE OR REPLACE FUNCTION outbox_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_notify('outbox_events_' || TG_RELID, '');
        RETURN NULL;
    END
    $$";
const DOORBELL: &str =
    include_str!("../../outbox-runtime/migrations/2026-12-04-000014_doorbell_per_table/up.sql");

/// The writer counts of the figure.
pub const WRITERS: [usize; 4] = [1, 8, 32, 64];

/// How each run writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    /// The business insert alone, in a diesel transaction.
    Bare,
    /// The same insert and one event, in a unit of work.
    Outbox,
    /// The same, with the insert trigger of before the doorbell: every commit notifies.
    EveryCommitNotifies,
    /// [`Way::Outbox`] with no relay running during the run (the queue is drained after
    /// it): the write path's own cost, apart from the relay's work on the same cores.
    OutboxWithoutRelay,
    /// [`Way::Outbox`] with two relay instances draining: what a second instance, idle
    /// while the first holds the writers' aggregates, costs the writers.
    OutboxTwoRelays,
}

impl Way {
    pub const ALL: [Way; 5] = [
        Way::Bare,
        Way::Outbox,
        Way::EveryCommitNotifies,
        Way::OutboxWithoutRelay,
        Way::OutboxTwoRelays,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Way::Bare => "no outbox",
            Way::Outbox => "outbox",
            Way::EveryCommitNotifies => "outbox, every commit notifies",
            Way::OutboxWithoutRelay => "outbox, no relay running",
            Way::OutboxTwoRelays => "outbox, 2 relay instances",
        }
    }
}

/// One run's figures.
pub struct Run {
    pub commits_per_sec: f64,
    /// Notifications on the relays' channel per commit during the run (what the doorbell
    /// left the writers to send).
    pub notifications_per_commit: f64,
    /// Commit-to-ack latencies of the run's events, in ms, sorted; empty for [`Way::Bare`]
    /// and when latencies were not asked for.
    pub latencies_ms: Vec<f64>,
}

impl Run {
    pub fn percentile(&self, p: f64) -> f64 {
        let l = &self.latencies_ms;
        l[((l.len() - 1) as f64 * p).round() as usize]
    }
}

/// Writes with `writers` concurrent connections for `secs` seconds, each writer on
/// aggregates of its own, while a relay (started before, running after) drains the outbox;
/// for [`Way::OutboxWithoutRelay`], the relay starts after the run and drains it then.
pub async fn run(
    place: &Place,
    way: Way,
    writers: usize,
    secs: f64,
    payload: usize,
    latencies: bool,
) -> Result<Run, BoxError> {
    let mut admin = AsyncPgConnection::establish(&place.database_url).await?;
    admin
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS bench_writes (id bigint PRIMARY KEY, total_cents bigint NOT NULL)",
        )
        .await?;
    // The trigger as it was before the doorbell: every insert notifies. Put back after the
    // run (the latest doorbell migration's up.sql).
    if way == Way::EveryCommitNotifies {
        admin.batch_execute(EVERY_INSERT_NOTIFIES).await?;
    }
    let mut stream = jetstream::new(place.nats.clone())
        .get_stream(&place.stream)
        .await?;
    let first_new = stream.info().await?.state.last_sequence + 1;
    let tag = format!("W{}{writers}", way as u8);
    let mut relays = Vec::new();
    let instances = match way {
        Way::OutboxWithoutRelay => 0,
        Way::OutboxTwoRelays => 2,
        _ => 1,
    };
    for _ in 0..instances {
        relays.push(
            Relay::connect(place.relay_config(), place.nats.clone())
                .await?
                .spawn(),
        );
    }
    // Counts the notifications the writers send (this connection only listens: it does not
    // hold the doorbell, so it makes no one notify).
    let notifications = Arc::new(AtomicU64::new(0));
    let mut listener = AsyncPgConnection::establish(&place.database_url).await?;
    #[derive(diesel::QueryableByName)]
    struct Table {
        #[diesel(sql_type = diesel::sql_types::Oid)]
        oid: u32,
    }
    let table = diesel::sql_query("SELECT 'outbox_events'::regclass::oid AS oid")
        .get_result::<Table>(&mut listener)
        .await?;
    let channel = outbox_runtime::relay::notification_channel(table.oid);
    listener.batch_execute(&format!("LISTEN {channel}")).await?;
    let listening = {
        let notifications = Arc::clone(&notifications);
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(listener.notifications_stream());
            while let Some(Ok(_)) = stream.next().await {
                notifications.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    static NEXT_ID: AtomicI64 = AtomicI64::new(0);
    let committed: Arc<Mutex<HashMap<u64, SystemTime>>> = Arc::default();
    let commits = Arc::new(AtomicU64::new(0));
    let pad = "x".repeat(payload.saturating_sub(30));
    let outbox = Outbox::with_topology(place.topology());
    let mut conns = Vec::with_capacity(writers);
    for _ in 0..writers {
        conns.push(AsyncPgConnection::establish(&place.database_url).await?);
    }
    let go = Arc::new(tokio::sync::Barrier::new(writers + 1));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (writer, mut conn) in conns.into_iter().enumerate() {
        let (outbox, committed, commits, pad, go, stop, tag) = (
            outbox.clone(),
            Arc::clone(&committed),
            Arc::clone(&commits),
            pad.clone(),
            Arc::clone(&go),
            Arc::clone(&stop),
            tag.clone(),
        );
        tasks.push(tokio::spawn(async move {
            go.wait().await;
            let mut n = 0_u64;
            while !std::sync::atomic::AtomicBool::load(&stop, Ordering::Relaxed) {
                let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
                let insert = diesel::sql_query("INSERT INTO bench_writes VALUES ($1, 4200)")
                    .bind::<Int8, _>(id);
                if way == Way::Bare {
                    conn.transaction(async |conn| {
                        insert.execute(conn).await?;
                        Ok::<_, diesel::result::Error>(())
                    })
                    .await?;
                } else {
                    let key = (writer as u64) << 32 | n;
                    let mut probe = Probe {
                        id: format!("{tag}-{writer}-{}", n % 16),
                        pending_events: PendingEvents::new(),
                    };
                    probe.record(Ticked {
                        n: key,
                        pad: pad.clone(),
                    });
                    outbox
                        .transaction(&mut conn, async |uow| {
                            insert.execute(uow.conn()).await?;
                            uow.track(&mut probe);
                            Ok::<_, UnitOfWorkError>(())
                        })
                        .await?;
                    if latencies {
                        committed
                            .lock()
                            .expect("not poisoned")
                            .insert(key, SystemTime::now());
                    }
                }
                commits.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
            Ok::<_, BoxError>(())
        }));
    }
    go.wait().await;
    let started = Instant::now();
    let before = AtomicU64::load(&commits, Ordering::Relaxed);
    let notified_before = AtomicU64::load(&notifications, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let done = AtomicU64::load(&commits, Ordering::Relaxed) - before;
    let notified = AtomicU64::load(&notifications, Ordering::Relaxed) - notified_before;
    listening.abort();
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await??;
    }
    let total = AtomicU64::load(&commits, Ordering::Relaxed);
    let committed = std::mem::take(&mut *committed.lock().expect("not poisoned"));

    // Without a relay during the run, one drains the queue now, before the next run.
    if relays.is_empty() {
        relays.push(
            Relay::connect(place.relay_config(), place.nats.clone())
                .await?
                .spawn(),
        );
    }
    let mut latencies_ms = Vec::new();
    if way != Way::Bare {
        // Every event of the run reaches the stream (the relay drains it): read them all.
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: format!("{}.Probe.*.Ticked", place.prefix),
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: first_new,
                },
                ..Default::default()
            })
            .await?;
        let mut messages = consumer.messages().await?;
        let mut seen = 0_u64;
        while seen < total {
            let message = tokio::time::timeout(Duration::from_secs(60), messages.next())
                .await?
                .ok_or("the consumer ended")??;
            seen += 1;
            if let Some(commit) =
                committed.get(&serde_json::from_slice::<Ticked>(&message.payload)?.n)
            {
                let stored = message.info()?.published;
                let commit = time::OffsetDateTime::from(*commit);
                latencies_ms.push((stored - commit).as_seconds_f64() * 1e3);
            }
        }
        latencies_ms.sort_by(f64::total_cmp);
    }
    for relay in relays {
        relay.shutdown().await?;
    }
    if way == Way::EveryCommitNotifies {
        admin.batch_execute(DOORBELL).await?;
    }
    Ok(Run {
        commits_per_sec: done as f64 / elapsed.as_secs_f64(),
        notifications_per_commit: notified as f64 / done.max(1) as f64,
        latencies_ms,
    })
}

/// The floor of figure 11, from pgbench on the same server: transactions per second of the
/// bare business insert, and of the same with one more trivial insert (what any outbox
/// writes at least: one more row, one more statement), with `clients` connections for
/// `secs` seconds each.
///
/// # Errors
/// Why there is no figure: pgbench is not installed, or what it said when it failed.
pub async fn pgbench_floor(place: &Place, clients: usize, secs: f64) -> Result<(f64, f64), String> {
    place
        .conn()
        .await
        .map_err(|e| e.to_string())?
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS bench_floor_orders (id bigint PRIMARY KEY, total_cents bigint NOT NULL); \
             CREATE TABLE IF NOT EXISTS bench_floor_events (id bigint PRIMARY KEY, kind text NOT NULL, payload jsonb NOT NULL)",
        )
        .await
        .map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("relay-bench-pgbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let order = "\\set id random(1, 1000000000000)\nBEGIN;\nINSERT INTO bench_floor_orders VALUES (:id, 4200);\n";
    let bare = format!("{order}COMMIT;\n");
    let extra = format!(
        "{order}INSERT INTO bench_floor_events VALUES (:id, 'Order', '{{\"total_cents\": 4200}}');\nCOMMIT;\n"
    );
    let mut rates = Vec::new();
    for (name, script) in [("bare.sql", bare), ("extra.sql", extra)] {
        let path = dir.join(name);
        std::fs::write(&path, script).map_err(|e| format!("{}: {e}", path.display()))?;
        let output = std::process::Command::new("pgbench")
            .args(["-n", "-M", "prepared", "-j", "2"])
            .arg(format!("-c{clients}"))
            .arg(format!("-T{}", secs.ceil() as u64))
            .arg("-f")
            .arg(&path)
            .arg(&place.database_url)
            .output()
            .map_err(|e| format!("pgbench: {e}"))?;
        let text = String::from_utf8_lossy(&output.stdout);
        let tps = text
            .lines()
            .find_map(|line| line.strip_prefix("tps = "))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<f64>().ok())
            .ok_or_else(|| {
                format!(
                    "pgbench ({}) printed no tps: {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim()
                )
            })?;
        rates.push(tps);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok((rates[0], rates[1]))
}
