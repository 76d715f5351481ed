//! The relay in production conditions, against the real PostgreSQL and NATS: several
//! instances racing (one of them dying mid-batch), broker rejections and dead letters, a
//! broker outage (a nats-server of the test's own), terminated database connections, and
//! graceful shutdown.

mod support;

use std::collections::HashSet;
use std::time::Duration;

use diesel::prelude::*;
use diesel::result::DatabaseErrorKind;
use diesel::result::Error::DatabaseError;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_runtime::outbox::schema::outbox_events;
use outbox_runtime::{
    DeadLetterPolicy, PublishedRows, Relay, RelayConfig, UnitOfWorkError, dead_letter,
};
use support::counters::Counters;
use support::domain::{Order, OrderEvent};
use support::{Logs, NatsServer, TestEnv, sequences, set_database_default, wait_until};

/// Commits `events` events of aggregate `id` (Placed, then Shipped), one unit of work each.
async fn commit_events(env: &TestEnv, conn: &mut AsyncPgConnection, id: &str, events: usize) {
    let mut order = Order::place(id, "ada", 1);
    for n in 0..events {
        if n > 0 {
            order.record(OrderEvent::Shipped);
        }
        env.outbox()
            .transaction(conn, async |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_racing_over_10000_events_of_100_aggregates_publish_each_once_in_order() {
    const PRODUCERS: usize = 4;
    const AGGREGATES: usize = 100;
    const PER_AGGREGATE: usize = 100;
    const TOTAL: u64 = (AGGREGATES * PER_AGGREGATE) as u64;

    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.batch_size = 200; // many batches, so the instances race for heads

    // Three instances. The first is killed mid-run, as a crash would kill it (its batch is
    // rolled back with its connection), and a fourth takes its place.
    let doomed = Relay::connect(config.clone(), env.nats.clone())
        .await
        .unwrap();
    let doomed = tokio::spawn(doomed.run(std::future::pending()));
    let second = Relay::connect(config.clone(), env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let third = Relay::connect(config.clone(), env.nats.clone())
        .await
        .unwrap()
        .spawn();

    // Producers commit while the relays run: 1 to 4 events per unit of work.
    let mut producers = Vec::new();
    for producer in 0..PRODUCERS {
        let (outbox, url) = (env.outbox(), env.database_url.clone());
        producers.push(tokio::spawn(async move {
            let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
            let per_producer = AGGREGATES / PRODUCERS;
            let mut orders: Vec<(Order, usize)> = (0..per_producer)
                .map(|i| {
                    let id = format!("agg-{}", producer * per_producer + i);
                    (Order::place(&id, "ada", 1), 0)
                })
                .collect();
            let mut round: usize = 0;
            while orders.iter().any(|(_, written)| *written < PER_AGGREGATE) {
                for (order, written) in orders.iter_mut().filter(|(_, w)| *w < PER_AGGREGATE) {
                    let pending = order.pending_events().len();
                    let more = (1 + round % 4).saturating_sub(pending);
                    for _ in 0..more.min(PER_AGGREGATE - *written - pending) {
                        order.record(OrderEvent::Shipped);
                    }
                    let count = order.pending_events().len();
                    outbox
                        .transaction(&mut conn, async |uow| {
                            uow.track(order);
                            Ok::<_, UnitOfWorkError>(())
                        })
                        .await
                        .unwrap();
                    *written += count;
                }
                round += 1;
            }
        }));
    }

    env.until_stream_holds(TOTAL / 4, Duration::from_secs(60))
        .await;
    doomed.abort();
    assert!(doomed.await.unwrap_err().is_cancelled());
    let fourth = Relay::connect(config.clone(), env.nats.clone())
        .await
        .unwrap()
        .spawn();
    for producer in producers {
        producer.await.unwrap();
    }
    env.until_stream_holds(TOTAL, Duration::from_secs(120))
        .await;
    for relay in [second, third, fourth] {
        relay.shutdown().await.unwrap();
    }

    let messages = env.stream_messages().await;
    assert_eq!(messages.len() as u64, TOTAL, "no event stored twice");
    let ids: HashSet<String> = messages.iter().map(|m| m.header("ce-id")).collect();
    assert_eq!(ids.len() as u64, TOTAL, "every event once");
    let sequences = sequences(&messages);
    assert_eq!(sequences.len(), AGGREGATES);
    let in_order: Vec<u64> = (1..=PER_AGGREGATE as u64).collect();
    for (aggregate, seqs) in &sequences {
        assert_eq!(seqs, &in_order, "aggregate {aggregate} in sequence order");
    }
    let mut conn = env.conn().await;
    let left: i64 = outbox_events::table
        .count()
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, 0, "every row published and deleted");
}

/// A database whose default isolation is stricter than READ COMMITTED (`ALTER DATABASE ...
/// SET default_transaction_isolation`, as some shops set it for every session): the relays'
/// transactions stay READ COMMITTED. Before, three relays racing under REPEATABLE READ failed
/// claims with "could not serialize access due to concurrent update", and under SERIALIZABLE
/// with "read/write dependencies among transactions", each time dropping the connection and
/// reconnecting with backoff. The units of work are the user's transactions and keep the
/// database's level: under SERIALIZABLE they may abort with a serialization failure, which
/// the writers here retry as PostgreSQL asks; any other error fails the test. Their outbox's
/// topology is registered all the same, without the warning "cannot register the outbox's
/// topology" that writers starting together each logged when their registrations met.
/// A database whose `idle_session_timeout` (PostgreSQL 14+; an operator's `ALTER DATABASE ...
/// SET`, to end sessions an application forgot) is shorter than the relay's quiet spells. The
/// relay's sessions are idle by design, its `LISTEN` connection waiting for notifications and
/// its workers for their poll, so they opt out of it. Before, the server ended the `LISTEN`
/// connection at every timeout (a warning each time, the doorbell lost and taken again) and
/// an idle worker's connection before its next claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relays_idle_sessions_outlive_the_databases_idle_session_timeout() {
    let (logs, _turn) = Logs::capture().await;
    let env = TestEnv::new().await;
    set_database_default(&env, "idle_session_timeout", "300ms").await;
    let mut config = env.relay_config();
    config.poll_interval = Duration::from_secs(60);
    config.workers = 1;
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    // A worker and the listener.
    let sessions = wait_until(
        "the relay's two sessions",
        Duration::from_secs(10),
        || async {
            let sessions = support::sessions_named(&env, "outbox-relay").await;
            (sessions.len() == 2).then_some(sessions)
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        support::sessions_named(&env, "outbox-relay").await,
        sessions,
        "the relay's sessions were ended while idle"
    );
    env.commit(&mut Order::place("o-1", "ada", 100)).await;
    env.until_stream_holds(1, Duration::from_secs(3)).await;
    relay.shutdown().await.unwrap();
    let logged = logs.text();
    assert!(!logged.contains("idle-session timeout"), "{logged}");
}

/// A database whose `idle_in_transaction_session_timeout` (an operator's) is shorter than a
/// relay batch's publishes: the batch's transaction sends nothing while it waits for its acks
/// (here one aggregate's chain of 5,000 events, published one after another, each after the
/// previous ack). A live relay's batch must not be cut for it. Before, the server ended the
/// session mid-batch, the batch's mark failed, and every batch after it was cut the same way:
/// the stream held the events, and the outbox kept them all, republished for ever.
///
/// The timeout is 1 s: the keep-alive, every third of it, leaves the other two thirds for the
/// relay's and the server's scheduling, and a CI run on two loaded cores once went past the
/// 133 ms a 200-ms timeout left (the batch cut as a stopped relay's would be).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_slower_than_the_databases_idle_transaction_timeout_commits() {
    const EVENTS: u64 = 5_000;
    const TIMEOUT: Duration = Duration::from_secs(1);
    let env = TestEnv::new().await;
    let timeout = format!("{}ms", TIMEOUT.as_millis());
    set_database_default(&env, "idle_in_transaction_session_timeout", &timeout).await;
    let mut order = Order::place("o-1", "ada", 100);
    for _ in 1..EVENTS {
        order.record(OrderEvent::Shipped);
    }
    env.commit(&mut order).await;
    let mut config = env.relay_config();
    config.batch_size = EVENTS as usize;
    let mut relay = Relay::connect(config, env.nats.clone()).await.unwrap();
    let started = std::time::Instant::now();
    let outcome = relay.relay_batch().await.unwrap();
    let took = started.elapsed();
    println!("one batch of {EVENTS} events of one aggregate: {took:?}");
    assert!(
        took > TIMEOUT,
        "the batch took {took:?}, within the timeout: it proves nothing"
    );
    assert_eq!(outcome.published, EVENTS as usize);
    assert_eq!(env.stream_len().await, EVENTS);
    let queued = outbox_runtime::outbox::stats(&mut env.conn().await)
        .await
        .unwrap()
        .queued;
    assert_eq!(queued, 0, "the batch's published rows are still queued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_run_read_committed_under_a_stricter_database_default() {
    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        count: i64,
    }
    const AGGREGATES: usize = 40;
    const PER_AGGREGATE: usize = 50;
    const TOTAL: u64 = (AGGREGATES * PER_AGGREGATE) as u64;
    let (logs, _turn) = Logs::capture().await;
    for level in ["repeatable read", "serializable"] {
        let env = TestEnv::new().await;
        set_database_default(&env, "default_transaction_isolation", level).await;
        let mut config = env.relay_config();
        config.batch_size = 20; // many small batches, so the instances race for heads
        let mut relays = Vec::new();
        for _ in 0..3 {
            let relay = Relay::connect(config.clone(), env.nats.clone()).await;
            relays.push(relay.unwrap().spawn());
        }
        let retries = write_concurrently(&env, level, AGGREGATES, PER_AGGREGATE, |error| {
            matches!(
                error,
                UnitOfWorkError::Database(DatabaseError(
                    DatabaseErrorKind::SerializationFailure,
                    _
                ))
            )
        })
        .await;
        // The figure GUARANTEES.md gives (promise 9; `-- --nocapture` prints it).
        eprintln!(
            "{level}: {retries} of {TOTAL} units of work retried after a serialization failure"
        );
        env.until_stream_holds(TOTAL, Duration::from_secs(120))
            .await;
        for relay in relays {
            relay.shutdown().await.unwrap();
        }
        let registered: i64 = diesel::sql_query(
            "SELECT count(*) AS count FROM outbox_topologies WHERE role = 'outbox'",
        )
        .get_result::<Count>(&mut env.conn().await)
        .await
        .unwrap()
        .count;
        assert_eq!(
            registered, 1,
            "{level}: the units of work's topology registered"
        );
        // The level is the last line printed above.
        support::assert_each_once_in_order(
            &env.stream_messages().await,
            AGGREGATES,
            PER_AGGREGATE as u64,
        );
    }
    let text = logs.text();
    let relay_failures: Vec<&str> = text
        .lines()
        .filter(|line| {
            line.contains("outbox_runtime::relay") && line.contains("could not serialize")
        })
        .collect();
    assert!(relay_failures.is_empty(), "{relay_failures:#?}");
    assert!(
        !text.contains("cannot register the outbox's topology"),
        "{text}"
    );
}

/// Commits `per_aggregate` events to each of `aggregates` aggregates from 4 writers at once
/// (one unit of work per event; each writer its own aggregates, `agg-{writer}-{i}`), and
/// retries each unit of work refused with an error `retryable` accepts (any other fails the
/// test, its message naming `case`); returns how many were retried.
async fn write_concurrently(
    env: &TestEnv,
    case: &str,
    aggregates: usize,
    per_aggregate: usize,
    retryable: fn(&UnitOfWorkError) -> bool,
) -> usize {
    let mut writers = Vec::new();
    for writer in 0..4 {
        let (outbox, url) = (env.outbox(), env.database_url.clone());
        let case = case.to_owned();
        writers.push(tokio::spawn(async move {
            let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
            let mut retried = 0;
            for i in 0..aggregates / 4 {
                let mut order = Order::place(&format!("agg-{writer}-{i}"), "ada", 1);
                for n in 0..per_aggregate {
                    if n > 0 {
                        order.record(OrderEvent::Shipped);
                    }
                    while let Err(error) = outbox
                        .transaction(&mut conn, async |uow| {
                            uow.track(&mut order);
                            Ok::<_, UnitOfWorkError>(())
                        })
                        .await
                    {
                        assert!(retryable(&error), "{case}: a unit of work refused: {error}");
                        retried += 1;
                    }
                }
            }
            retried
        }));
    }
    let mut retried = 0;
    for writer in writers {
        retried += writer.await.unwrap();
    }
    retried
}

/// A relay's statements wait out a lock (here an operator's `LOCK TABLE`, a DDL's, held for
/// half a second) within their `statement_timeout`, whatever the database's `lock_timeout`
/// (an operator's, meant for the applications' sessions). Before, the 50-ms database
/// default refused the relay's claim ("canceling statement due to lock timeout"), and the
/// running relay logged its database as failing and reconnected with backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_waits_out_a_lock_whatever_the_databases_lock_timeout() {
    let env = TestEnv::new().await;
    set_database_default(&env, "lock_timeout", "50ms").await;
    env.commit(&mut Order::place("o-1", "ada", 1)).await;
    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    let mut holder = env.conn().await;
    holder
        .batch_execute("BEGIN; LOCK TABLE outbox_events IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let held = std::time::Instant::now();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        holder.batch_execute("COMMIT").await.unwrap();
    });
    let report = relay.relay_batch().await.unwrap();
    assert!(
        held.elapsed() >= Duration::from_millis(500),
        "the batch did not wait for the lock: it proves nothing"
    );
    release.await.unwrap();
    assert_eq!(report.published, 1, "{report:?}");
    assert_eq!(env.stream_len().await, 1);
}

/// A unit of work's registration of its outbox's topology (before its BEGIN, once an hour per
/// process) waits out another process's registration of the same row, whatever the
/// database's `lock_timeout` (an operator's: 50 ms here, against a registration held 300 ms).
/// Before, the registration was refused ("canceling statement due to lock timeout"), the
/// outbox logged "cannot register the outbox's topology" and did not register again for an
/// hour: writers starting together under a 1-ms `lock_timeout` so logged in most runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topology_registration_waits_out_another_whatever_the_databases_lock_timeout() {
    #[derive(QueryableByName)]
    struct Registered {
        #[diesel(sql_type = diesel::sql_types::Text)]
        stream: String,
    }
    const HELD: Duration = Duration::from_millis(300);
    let (logs, _turn) = Logs::capture().await;
    let env = TestEnv::new().await;
    set_database_default(&env, "lock_timeout", "50ms").await;
    let mut holder = env.conn().await;
    holder
        .batch_execute(&format!(
            "BEGIN; INSERT INTO outbox_topologies (role, subject_prefix, stream) \
             VALUES ('outbox', '{}', 'another process''s')",
            env.prefix
        ))
        .await
        .unwrap();
    let since = std::time::Instant::now();
    let release = tokio::spawn(async move {
        tokio::time::sleep(HELD).await;
        holder.batch_execute("ROLLBACK").await.unwrap();
    });
    env.commit(&mut Order::place("o-1", "ada", 1)).await;
    let took = since.elapsed();
    release.await.unwrap();
    let registered: Vec<Registered> =
        diesel::sql_query("SELECT stream FROM outbox_topologies WHERE role = 'outbox'")
            .load(&mut env.conn().await)
            .await
            .unwrap();
    let registered: Vec<String> = registered.into_iter().map(|row| row.stream).collect();
    assert_eq!(registered, [env.stream.as_str()], "the outbox's topology");
    assert!(
        took >= HELD,
        "the unit of work did not wait for the other registration ({took:?}): it proves nothing"
    );
    let text = logs.text();
    let warned: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("cannot register the outbox's topology"))
        .collect();
    assert!(warned.is_empty(), "{warned:#?}");
}

/// A database whose `lock_timeout` (an operator's) is shorter than a commit's flush: a unit
/// of work that notifies a waiting relay takes PostgreSQL's lock on the notification queue at
/// COMMIT and keeps it through the flush (`async.c`, `PreCommit_Notify`), so concurrent
/// notifying commits wait for each other, within the writers' `lock_timeout`. A COMMIT that
/// times out there rolls back whole: its events are neither lost nor published, and the
/// relays, whose sessions turn `lock_timeout` off, publish every unit of work that committed
/// once, in order, none of their statements refused. The writers here retry each refused
/// unit of work, and nothing but a lock timeout; the count of refused ones is printed
/// (`-- --nocapture`) for README's "The doorbell", with the doorbell on and off (`listen =
/// false`: no COMMIT notifies; a few were refused all the same on a slower host, at a lock
/// wait not traced). The writers' topology registrations, which met at their start and were
/// refused in most runs, wait for each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_short_lock_timeout_what_commits_is_published_once_in_order() {
    const AGGREGATES: usize = 40;
    const PER_AGGREGATE: usize = 50;
    const TOTAL: u64 = (AGGREGATES * PER_AGGREGATE) as u64;
    let (logs, _turn) = Logs::capture().await;
    for (published, listen) in [
        (PublishedRows::Delete, true),
        (PublishedRows::Archive, true),
        (PublishedRows::Delete, false),
    ] {
        let env = TestEnv::new().await;
        set_database_default(&env, "lock_timeout", "1ms").await;
        let mut config = env.relay_config();
        config.batch_size = 20;
        config.published = published;
        config.listen = listen;
        config.poll_interval = Duration::from_millis(20);
        let mut relays = Vec::new();
        for _ in 0..3 {
            let relay = Relay::connect(config.clone(), env.nats.clone()).await;
            relays.push(relay.unwrap().spawn());
        }
        let case = format!("{published:?}, listen {listen}");
        let refused = write_concurrently(&env, &case, AGGREGATES, PER_AGGREGATE, |error| {
            error.to_string().contains("lock timeout")
        })
        .await;
        eprintln!(
            "{published:?}, listen {listen}: {refused} of {TOTAL} units of work refused at a \
             1-ms lock_timeout, each retried"
        );
        env.until_stream_holds(TOTAL, Duration::from_secs(120))
            .await;
        for relay in relays {
            relay.shutdown().await.unwrap();
        }
        // The case is the last line printed above.
        support::assert_each_once_in_order(
            &env.stream_messages().await,
            AGGREGATES,
            PER_AGGREGATE as u64,
        );
        let queued = outbox_runtime::outbox::stats(&mut env.conn().await)
            .await
            .unwrap()
            .queued;
        assert_eq!(queued, 0, "{published:?}: rows left queued");
    }
    let text = logs.text();
    let relay_failures: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("outbox_runtime::relay") && line.contains("lock timeout"))
        .collect();
    assert!(relay_failures.is_empty(), "{relay_failures:#?}");
    let unregistered: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("cannot register the outbox's topology"))
        .collect();
    assert!(unregistered.is_empty(), "{unregistered:#?}");
}

/// A row the broker refuses: its message is over the server's `max_payload` (1 MiB by
/// default), checked by async-nats before sending.
async fn insert_oversized(conn: &mut AsyncPgConnection, prefix: &str, aggregate: &str) {
    conn.batch_execute(&format!(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                    partition_key, subject, payload) \
         VALUES ('Big', '{aggregate}', 1, 'Uploaded', '{aggregate}', \
                 '{prefix}.Big.{aggregate}.Uploaded', \
                 jsonb_build_object('blob', repeat('x', 1100000))), \
                ('Big', '{aggregate}', 2, 'Labelled', '{aggregate}', \
                 '{prefix}.Big.{aggregate}.Labelled', '{{\"label\": \"after\"}}')"
    ))
    .await
    .unwrap();
}

fn fast_retries(mut config: RelayConfig) -> RelayConfig {
    config.max_attempts = 3;
    config.retry_delay = Duration::from_millis(20);
    config.max_retry_delay = Duration::from_millis(60);
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_message_is_dead_lettered_after_max_attempts_while_others_flow() {
    let env = TestEnv::new().await;
    let relay = Relay::connect(fast_retries(env.relay_config()), env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut conn = env.conn().await;
    insert_oversized(&mut conn, &env.prefix, "b-1").await;
    insert_oversized(&mut conn, &env.prefix, "b-2").await;
    for n in 0..5 {
        commit_events(&env, &mut conn, &format!("o-{n}"), 2).await;
    }

    let dead = wait_until("two dead letters", Duration::from_secs(20), || async {
        let mut conn = env.conn().await;
        let dead = dead_letter::list(&mut conn, 10).await.unwrap();
        (dead.len() == 2).then_some(dead)
    })
    .await;
    for letter in &dead {
        assert_eq!(
            (letter.aggregate_seq, letter.attempts, letter.waiting),
            (1, 3, 1),
            "{letter:?}"
        );
        let error = letter.last_error.as_deref().unwrap_or_default();
        assert!(error.contains("max payload"), "{error}");
    }
    env.until_stream_holds(10, Duration::from_secs(10)).await;
    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), 10, "the orders flowed; nothing of Big did");
    assert!(messages.iter().all(|m| !m.subject.contains(".Big.")));

    // The operator trims the first one and retries it: it goes out, then the row behind it.
    let first = dead.iter().find(|d| d.aggregate_id == "b-1").unwrap();
    conn.batch_execute(&format!(
        "UPDATE outbox_events SET payload = '{{\"blob\": \"trimmed\"}}' WHERE id = '{}'",
        first.id
    ))
    .await
    .unwrap();
    assert!(dead_letter::retry(&mut conn, first.id).await.unwrap());
    // The second is skipped: the row behind it goes out alone.
    let second = dead.iter().find(|d| d.aggregate_id == "b-2").unwrap();
    assert!(dead_letter::skip(&mut conn, second.id).await.unwrap());
    assert!(
        !dead_letter::skip(&mut conn, second.id).await.unwrap(),
        "once"
    );

    env.until_stream_holds(13, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();
    let sequences = sequences(&env.stream_messages().await);
    assert_eq!(sequences["b-1"], [1, 2], "retried in order");
    assert_eq!(sequences["b-2"], [2], "skipped, the gap shows");
    let left = dead_letter::list(&mut conn, 10).await.unwrap();
    assert_eq!(left.len(), 1, "only the skipped one is left: {left:?}");
    assert_eq!((left[0].id, left[0].waiting), (second.id, 0));
    assert!(left[0].skipped_at.is_some(), "listed as skipped");
}

#[tokio::test]
async fn with_the_skip_policy_a_dead_letter_does_not_hold_its_aggregate_back() {
    let env = TestEnv::new().await;
    let mut config = fast_retries(env.relay_config());
    config.dead_letters = DeadLetterPolicy::Skip;
    config.max_attempts = 1;
    let mut relay = Relay::connect(config, env.nats.clone()).await.unwrap();
    let mut conn = env.conn().await;
    insert_oversized(&mut conn, &env.prefix, "b-1").await;

    let first = relay.relay_batch().await.unwrap();
    assert_eq!((first.rejected, first.dead_lettered), (1, 1), "{first:?}");
    let second = relay.relay_batch().await.unwrap();
    assert_eq!(second.published, 1, "{second:?}");
    assert_eq!(sequences(&env.stream_messages().await)["b-1"], [2]);

    // Skipped, not lost: listed, counted, and retried once the cause is fixed.
    let listed = dead_letter::list(&mut conn, 10).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    let letter = &listed[0];
    assert_eq!((letter.aggregate_seq, letter.waiting), (1, 0));
    assert!(letter.skipped_at.is_some());
    let stats = outbox_runtime::outbox::stats(&mut conn).await.unwrap();
    assert_eq!(
        (stats.queued, stats.dead_letters, stats.skipped_dead_letters),
        (0, 0, 1)
    );
    let purged = outbox_runtime::outbox::purge_published(&mut conn, Duration::ZERO, 100, |_| {})
        .await
        .unwrap();
    assert_eq!(purged, 0, "a skipped dead letter is not purged");
    conn.batch_execute(&format!(
        "UPDATE outbox_events SET payload = '{{\"blob\": \"trimmed\"}}' WHERE id = '{}'",
        letter.id
    ))
    .await
    .unwrap();
    assert!(
        dead_letter::retry(&mut conn, letter.id).await.unwrap(),
        "a skipped dead letter can be retried"
    );
    let third = relay.relay_batch().await.unwrap();
    assert_eq!(third.published, 1, "{third:?}");
    assert_eq!(
        sequences(&env.stream_messages().await)["b-1"],
        [2, 1],
        "published late, after the event that went on without it"
    );
    assert!(dead_letter::list(&mut conn, 10).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_loses_nothing_and_dead_letters_nothing() {
    let mut server = NatsServer::start().await;
    let env = TestEnv::with_nats(&server.url()).await;
    let mut config = env.relay_config();
    config.published = PublishedRows::Mark; // keep the rows, to read their attempts
    config.ack_timeout = Duration::from_millis(500);
    config.max_backoff = Duration::from_millis(200);
    config.max_attempts = 1; // one counted attempt would dead-letter a row at once
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut conn = env.conn().await;
    for n in 0..4 {
        commit_events(&env, &mut conn, &format!("o-{n}"), 5).await;
    }
    env.until_stream_holds(20, Duration::from_secs(10)).await;

    server.stop();
    for n in 0..4 {
        commit_events(&env, &mut conn, &format!("late-{n}"), 5).await;
    }
    // The relay meets the outage for a while: claims fail in transport, or it waits.
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.restart().await;

    env.until_stream_holds(40, Duration::from_secs(30)).await;
    relay.shutdown().await.unwrap();
    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), 40, "nothing lost, nothing stored twice");
    for (aggregate, seqs) in sequences(&messages) {
        assert_eq!(seqs, [1, 2, 3, 4, 5], "aggregate {aggregate}");
    }
    let rows: Vec<(i32, bool, bool)> = outbox_events::table
        .select((
            outbox_events::attempts,
            outbox_events::published_at.is_not_null(),
            diesel::dsl::sql::<diesel::sql_types::Bool>("dead_lettered_at IS NOT NULL"),
        ))
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(rows.len(), 40);
    assert!(
        rows.iter().all(|row| *row == (0, true, false)),
        "no attempt counted, all published, none dead-lettered: {rows:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_recovers_when_its_database_connections_are_terminated() {
    let counters = Counters::installed();
    let env = TestEnv::new().await;
    let failures = || {
        counters.get(&format!(
            "outbox_relay_database_failures_total{{stream={},kind=batch}}",
            env.stream
        ))
    };
    let mut config = env.relay_config();
    // Only a notification can get an event out within the test's deadline.
    config.poll_interval = Duration::from_secs(120);
    config.max_backoff = Duration::from_millis(200);
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut conn = env.conn().await;
    commit_events(&env, &mut conn, "o-1", 1).await;
    env.until_stream_holds(1, Duration::from_secs(5)).await;

    let terminated = support::terminate_sessions(&env, "outbox-relay").await;
    assert!(
        terminated >= 3,
        "two workers and the listener: {terminated}"
    );

    // The listener reconnects and LISTENs again; the workers reopen their connections.
    let before = failures();
    commit_events(&env, &mut conn, "o-2", 1).await;
    env.until_stream_holds(2, Duration::from_secs(10)).await;
    // A worker woken on its terminated connection failed its batch, and counted it for the
    // operator's alert.
    assert!(failures() > before, "a database failure counted");
    tokio::time::sleep(Duration::from_millis(500)).await;
    commit_events(&env, &mut conn, "o-3", 1).await;
    env.until_stream_holds(3, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();
}

/// A primary demoted under the relay's address (here: its sessions ended, and the database
/// taking no writes from new ones, as a hot standby): the relay logs at once that the
/// database takes no writes and that it needs the primary, though its run of failures began
/// with the lost connections; and once the database takes writes again, it publishes what
/// waited, nothing lost. Before, the run's first line named only the lost connection, the
/// read-only refusals came 30 s later (the run's reminder), and said nothing of a primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_database_stops_taking_writes_says_so_and_publishes_when_it_takes_them() {
    let (logs, _turn) = Logs::capture().await;
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.max_backoff = Duration::from_millis(200);
    config.poll_interval = Duration::from_millis(200);
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut conn = env.conn().await;
    commit_events(&env, &mut conn, "o-1", 1).await;
    env.until_stream_holds(1, Duration::from_secs(5)).await;

    set_database_default(&env, "default_transaction_read_only", "on").await;
    assert!(support::terminate_sessions(&env, "outbox-relay").await >= 1);
    // Committed on the test's own session, which takes writes still: rows that wait.
    commit_events(&env, &mut conn, "o-2", 2).await;
    let hint = "the database takes no writes (a hot standby, or default_transaction_read_only \
                on for the database or the role), and the relay writes the outbox's tables; \
                give it the primary's URL";
    logs.until_contains(
        "the relay's log names a database that takes no writes",
        hint,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(
        env.stream_messages().await.len(),
        1,
        "nothing published meanwhile"
    );

    set_database_default(&env, "default_transaction_read_only", "off").await;
    support::terminate_sessions(&env, "outbox-relay").await;
    env.until_stream_holds(3, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();
    assert_eq!(sequences(&env.stream_messages().await)["o-2"], [1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_marks_exactly_what_was_acked() {
    const ROWS: i64 = 20_000;
    let env = TestEnv::new().await;
    let relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut conn = env.conn().await;
    conn.batch_execute(&format!(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                    partition_key, subject, payload) \
         SELECT 'Load', 'l-' || (g % 500), g / 500 + 1, 'Ticked', 'l-' || (g % 500), \
                '{}.Load.l-' || (g % 500) || '.Ticked', '{{}}' \
         FROM generate_series(0, {}) g",
        env.prefix,
        ROWS - 1
    ))
    .await
    .unwrap();
    env.until_stream_holds(2_000, Duration::from_secs(20)).await;
    relay.shutdown().await.unwrap();

    let published: HashSet<String> = env
        .stream_messages()
        .await
        .iter()
        .map(|m| m.header("ce-id"))
        .collect();
    let left: Vec<uuid::Uuid> = outbox_events::table
        .select(outbox_events::id)
        .load(&mut conn)
        .await
        .unwrap();
    assert!(
        left.iter()
            .all(|id| !published.contains(&id.hyphenated().to_string())),
        "an acked row was left queued"
    );
    assert_eq!(published.len() as i64 + left.len() as i64, ROWS);
    assert!(
        !left.is_empty(),
        "the shutdown came before the end, as intended"
    );
}

#[tokio::test]
async fn the_relay_reads_the_duplicate_window_and_warns_when_it_is_shorter_than_its_horizon() {
    let (logs, _guard) = support::Logs::capture().await;

    let env = TestEnv::new().await;
    env.create_stream(Duration::from_secs(1)).await;
    let config = env.relay_config();
    let relay = Relay::connect(config.clone(), env.nats.clone())
        .await
        .unwrap();

    assert_eq!(relay.duplicate_window(), Duration::from_secs(1));
    let logged = logs.text();
    assert!(
        logged.contains("WARN") && logged.contains("duplicate window is shorter"),
        "{logged}"
    );
    assert!(config.redelivery_horizon() > relay.duplicate_window());
}

/// A relay whose host vanishes mid-batch (no FIN, no RST: a node lost, a network cut) holds
/// its claimed heads in an open transaction until PostgreSQL notices it is gone. The
/// toolkit's sessions set server-side TCP keepalives, so another relay publishes those
/// aggregates within about half a minute, not after the operating system's two hours (when
/// the copies would also fall outside the stream's duplicate window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root and nftables to cut a connection; CI runs it"]
async fn a_relay_whose_host_vanished_gives_its_heads_back_within_half_a_minute() {
    let server = NatsServer::start().await;
    let env = TestEnv::with_nats(&server.url()).await;
    let mut conn = env.conn().await;
    for id in ["o-1", "o-2", "o-3"] {
        commit_events(&env, &mut conn, id, 1).await;
    }

    // Relay A claims the three heads and publishes them to a broker that never answers (a
    // proxy the test freezes): its transaction stays open, the heads locked.
    let proxy = support::Proxy::start(([127, 0, 0, 1], server.port).into()).await;
    let unanswered = outbox_runtime::nats::connect(&format!("nats://127.0.0.1:{}", proxy.port))
        .await
        .unwrap();
    let mut config = env.relay_config();
    config.workers = 1;
    config.listen = false;
    config.poll_interval = Duration::from_millis(200);
    config.ack_timeout = Duration::from_secs(300);
    let a = Relay::connect(config.clone(), unanswered).await.unwrap();
    proxy.freeze(true);
    let a = a.spawn();

    #[derive(QueryableByName)]
    struct Session {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        client_port: i32,
        #[diesel(sql_type = diesel::sql_types::Integer)]
        server_port: i32,
    }
    let session = wait_until(
        "relay A's claim, idle in its transaction",
        Duration::from_secs(10),
        || async {
            diesel::sql_query(
                "SELECT client_port, inet_server_port() AS server_port FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name = 'outbox-relay' \
                 AND state = 'idle in transaction'",
            )
            .get_result::<Session>(&mut env.conn().await)
            .await
            .ok()
        },
    )
    .await;

    // A's host vanishes; relay B takes over once PostgreSQL has closed A's session.
    let cut = support::Cut::new(
        u16::try_from(session.server_port).unwrap(),
        u16::try_from(session.client_port).unwrap(),
    );
    let cut_at = std::time::Instant::now();
    config.ack_timeout = Duration::from_secs(5);
    let b = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let took = support::taken_over(&env, (cut, cut_at), &proxy, (a, b), 3).await;
    assert!(
        took < Duration::from_secs(45),
        "the heads came back {took:?} after the cut"
    );
}
