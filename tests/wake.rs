//! How an idle relay is woken, against the real PostgreSQL and NATS: a unit of work notifies
//! only while a relay waits for rows (a NOTIFY serialises commits), and no commit is left
//! waiting for a poll, whatever the interleaving of commits, claims and relays.

mod support;

use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures::StreamExt;
use outbox_runtime::relay::{busy_lock, doorbell_lock, notification_channel};
use outbox_runtime::{Relay, RelayConfig, RelayHandle, UnitOfWorkError};
use support::counters::Counters;
use support::domain::Order;
use support::{TestEnv, insert_raw, wait_until};

/// The oid of the outbox table a connection to `url` finds, which keys its doorbell and
/// names its channel.
async fn outbox_table(url: &str) -> u32 {
    #[derive(diesel::QueryableByName)]
    struct Table {
        #[diesel(sql_type = diesel::sql_types::Oid)]
        oid: u32,
    }
    let mut conn = AsyncPgConnection::establish(url).await.unwrap();
    diesel::sql_query("SELECT 'outbox_events'::regclass::oid AS oid")
        .get_result::<Table>(&mut conn)
        .await
        .unwrap()
        .oid
}

/// The env's outbox table's doorbell and busy lock.
async fn locks(env: &TestEnv) -> ((i32, i32), (i32, i32)) {
    let table = outbox_table(&env.database_url).await;
    (doorbell_lock(table), busy_lock(table))
}

/// A connection to `url` listening on the channel of the outbox table it finds.
async fn listening_at(url: &str) -> AsyncPgConnection {
    let channel = notification_channel(outbox_table(url).await);
    let mut conn = AsyncPgConnection::establish(url).await.unwrap();
    conn.batch_execute(&format!("LISTEN {channel}"))
        .await
        .unwrap();
    conn
}

/// A connection listening on the env's relay channel.
async fn listening(env: &TestEnv) -> AsyncPgConnection {
    listening_at(&env.database_url).await
}

/// Whether a notification reaches `conn` within `within`.
async fn notified(conn: &mut AsyncPgConnection, within: Duration) -> bool {
    let mut notifications = std::pin::pin!(conn.notifications_stream());
    tokio::time::timeout(within, notifications.next())
        .await
        .is_ok()
}

/// `SELECT function(key)` of an advisory lock: `pg_advisory_lock` of the doorbell takes it
/// as an idle relay does, `pg_advisory_lock_shared` of the busy lock takes that as a busy
/// relay does; the `_unlock` functions release them.
fn lock_sql(function: &str, key: (i32, i32)) -> String {
    format!("SELECT {function}({}, {})", key.0, key.1)
}

/// Takes the doorbell's lock as an idle relay does, on a connection of its own.
async fn hold_doorbell(env: &TestEnv) -> AsyncPgConnection {
    let (doorbell, _) = locks(env).await;
    let mut conn = env.conn().await;
    diesel::sql_query(lock_sql("pg_advisory_lock", doorbell))
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

#[tokio::test]
async fn a_unit_of_work_notifies_only_while_a_relay_waits_for_rows() {
    let env = TestEnv::new().await;
    let mut listener = listening(&env).await;

    // No relay waits: the commit takes no notification lock.
    env.commit(&mut Order::place("o-1", "ada", 100)).await;
    assert!(
        !notified(&mut listener, Duration::from_millis(300)).await,
        "a unit of work notified while no relay waited"
    );

    // A relay waits (holds the doorbell): the commit notifies it.
    let mut relay = hold_doorbell(&env).await;
    env.commit(&mut Order::place("o-2", "ada", 100)).await;
    assert!(
        notified(&mut listener, Duration::from_secs(5)).await,
        "a unit of work did not notify the waiting relay"
    );
    // A row inserted by plain SQL too.
    insert_raw(&mut env.conn().await, "r-1", "x.Raw.r-1.Written").await;
    assert!(
        notified(&mut listener, Duration::from_secs(5)).await,
        "a plain INSERT did not notify the waiting relay"
    );

    // The relay went back to work: it released the doorbell.
    diesel::sql_query(lock_sql("pg_advisory_unlock", locks(&env).await.0))
        .execute(&mut relay)
        .await
        .unwrap();
    env.commit(&mut Order::place("o-3", "ada", 100)).await;
    assert!(
        !notified(&mut listener, Duration::from_millis(300)).await,
        "a unit of work notified after the relay released the doorbell"
    );
}

#[tokio::test]
async fn a_relay_arming_the_doorbell_waits_for_the_commits_that_did_not_notify() {
    let env = TestEnv::new().await;
    // A transaction inserts while no relay waits, and stays open.
    let mut writer = env.conn().await;
    writer.batch_execute("BEGIN").await.unwrap();
    insert_raw(&mut writer, "r-1", "x.Raw.r-1.Written").await;
    // A relay going to sleep cannot take the doorbell until that transaction ends.
    let mut relay = env.conn().await;
    relay.batch_execute("SET lock_timeout = 200").await.unwrap();
    let arm = lock_sql("pg_advisory_lock", locks(&env).await.0);
    let error = diesel::sql_query(&arm)
        .execute(&mut relay)
        .await
        .expect_err("the doorbell was armed under an uncommitted, unnotified insert");
    assert!(error.to_string().contains("lock timeout"), "{error}");
    writer.batch_execute("COMMIT").await.unwrap();
    diesel::sql_query(&arm).execute(&mut relay).await.unwrap();
}

/// One round: up to `conns.len()` concurrent units of work, one event each, spread over a
/// few random milliseconds. Returns how many committed.
async fn commit_round(env: &TestEnv, conns: &mut [AsyncPgConnection], round: usize) -> usize {
    let outbox = env.outbox();
    let writers = fastrand::usize(1..=conns.len());
    let commits = conns[..writers]
        .iter_mut()
        .enumerate()
        .map(|(writer, conn)| {
            let outbox = &outbox;
            async move {
                tokio::time::sleep(Duration::from_micros(fastrand::u64(0..8_000))).await;
                let mut order = Order::place(&format!("o-{round}-{writer}"), "ada", 100);
                outbox
                    .transaction(conn, async |uow| {
                        uow.track(&mut order);
                        Ok::<_, UnitOfWorkError>(())
                    })
                    .await
                    .unwrap();
            }
        });
    futures::future::join_all(commits).await;
    writers
}

/// The env's relay config with `workers` workers, polling once a minute: what a test waits
/// for must come from a notification or a claim of the relay's own.
fn polling_once_a_minute(env: &TestEnv, workers: usize) -> RelayConfig {
    let mut config = env.relay_config();
    config.poll_interval = Duration::from_secs(60);
    config.workers = workers;
    config
}

async fn spawned(config: RelayConfig, nats: &async_nats::Client) -> RelayHandle {
    Relay::connect(config, nats.clone()).await.unwrap().spawn()
}

/// `relays` relays of `workers` workers each, polling once a minute, and rounds of
/// concurrent commits, each round waited for in the stream: a commit that neither notified
/// a waiting relay nor was seen by a claim would wait a minute.
async fn every_commit_wakes(relays: usize, workers: usize) {
    let env = TestEnv::new().await;
    let mut handles = Vec::new();
    for _ in 0..relays {
        handles.push(spawned(polling_once_a_minute(&env, workers), &env.nats).await);
    }
    let mut conns = Vec::new();
    for _ in 0..6 {
        conns.push(
            AsyncPgConnection::establish(&env.database_url)
                .await
                .unwrap(),
        );
    }
    let rounds = 250;
    let mut committed = 0;
    let mut slowest = Duration::ZERO;
    for round in 0..rounds {
        let started = std::time::Instant::now();
        committed += commit_round(&env, &mut conns, round).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        while env.stream_len().await < committed as u64 {
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: {committed} commits, {} in the stream after 3 s",
                env.stream_len().await
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        slowest = slowest.max(started.elapsed());
        // Now and then, let the relays fall idle for longer.
        if fastrand::u8(0..4) == 0 {
            tokio::time::sleep(Duration::from_millis(fastrand::u64(0..20))).await;
        }
    }
    println!(
        "{relays} relays x {workers} workers: {committed} commits in {rounds} rounds; \
         slowest round to the stream: {slowest:?}"
    );
    for handle in handles {
        handle.shutdown().await.unwrap();
    }
    assert_eq!(env.stream_messages().await.len(), committed);
}

#[tokio::test]
async fn an_idle_relay_is_woken_for_every_commit_without_polling() {
    every_commit_wakes(1, 1).await;
}

#[tokio::test]
async fn idle_relays_are_woken_for_every_commit_without_polling() {
    every_commit_wakes(2, 2).await;
}

/// Of two idle relays, a notification wakes only the one that holds the doorbell; the other
/// waits for the doorbell (or its poll). Woken too, it would claim at every commit beside
/// the holder, and one of the two would find nothing: half the claims of an idle pair
/// wasted. Counted with `outbox_relay_claims_total`: per commit, the holder claims the row,
/// then once more and finds nothing (10 claims that found nothing for 10 commits; 20 when
/// both relays were woken).
#[tokio::test]
async fn a_notification_wakes_only_the_relay_holding_the_doorbell() {
    const COMMITS: u64 = 10;
    let counters = Counters::installed();
    let env = TestEnv::new().await;
    let mut handles = Vec::new();
    let mut stream = String::new();
    for _ in 0..2 {
        let config = polling_once_a_minute(&env, 1);
        stream.clone_from(&config.topology.stream.name);
        handles.push(spawned(config, &env.nats).await);
    }
    let claims = |found: &str| counters.get(&Counters::claims_key(&stream, found));
    // Both relays idle, one of them holding the doorbell.
    until_a_relay_holds_the_doorbell(&env).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (rows_before, nothing_before) = (claims("rows"), claims("nothing"));

    for n in 0..COMMITS {
        env.commit(&mut Order::place(&format!("o-{n}"), "ada", 100))
            .await;
        env.until_stream_holds(n + 1, Duration::from_secs(3)).await;
        // The holder's claim after its batch.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (rows, nothing) = (
        claims("rows") - rows_before,
        claims("nothing") - nothing_before,
    );
    for handle in handles {
        handle.shutdown().await.unwrap();
    }
    assert_eq!(rows, COMMITS, "one claim found each commit's row");
    assert!(
        nothing <= COMMITS,
        "{nothing} claims found nothing for {COMMITS} commits: a relay that does not hold the \
         doorbell was woken to claim"
    );
    assert_eq!(env.stream_messages().await.len() as u64, COMMITS);
}

/// A relay that starts on an empty outbox claims once per worker, and once more after it
/// arms the doorbell; then it waits for a notification. (Its listener woke every worker when
/// it first listened: each claimed a second time, for nothing, 7 claims for 3 workers.) A
/// commit after that still reaches the stream at once, through the doorbell.
#[tokio::test]
async fn a_relay_starting_idle_claims_once_per_worker_and_once_after_arming() {
    const WORKERS: usize = 3;
    let counters = Counters::installed();
    let env = TestEnv::new().await;
    let config = polling_once_a_minute(&env, WORKERS);
    let key = Counters::claims_key(&config.topology.stream.name, "nothing");
    let relay = spawned(config, &env.nats).await;
    until_a_relay_holds_the_doorbell(&env).await;
    // The claim after arming, however slow the host; then time for any claim more.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while counters.get(&key) <= WORKERS as u64 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let claims = counters.get(&key);

    env.commit(&mut Order::place("o-1", "ada", 100)).await;
    env.until_stream_holds(1, Duration::from_secs(3)).await;
    relay.shutdown().await.unwrap();
    assert_eq!(
        claims,
        WORKERS as u64 + 1,
        "a relay of {WORKERS} workers starting idle claimed {claims} times"
    );
}

/// Whether a session of the env's database holds the advisory lock `key` (`mode`:
/// `ExclusiveLock` or `ShareLock`).
async fn holds(conn: &mut AsyncPgConnection, key: (i32, i32), mode: &str) -> bool {
    #[derive(diesel::QueryableByName)]
    struct Held {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        held: bool,
    }
    diesel::sql_query(format!(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
            AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
            AND classid = {} AND objid = {} AND mode = '{mode}') AS held",
        key.0, key.1
    ))
    .get_result::<Held>(conn)
    .await
    .unwrap()
    .held
}

/// Waits until a relay holds the doorbell (its lock granted in the env's database).
async fn until_a_relay_holds_the_doorbell(env: &TestEnv) {
    let (doorbell, _) = locks(env).await;
    let mut conn = env.conn().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !holds(&mut conn, doorbell, "ExclusiveLock").await {
        assert!(
            std::time::Instant::now() < deadline,
            "no relay took the doorbell"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An idle relay takes the doorbell only while no relay is busy (holds the busy lock in
/// shared mode, as a relay claiming batch after batch does): the busy relay claims what
/// commits. Once no relay is busy, the idle one takes the doorbell, and claims what
/// committed meanwhile without waiting for its poll.
#[tokio::test]
async fn an_idle_relay_leaves_the_doorbell_while_another_is_busy() {
    let env = TestEnv::new().await;
    let (doorbell, busy_lock) = locks(&env).await;
    let mut busy = env.conn().await;
    diesel::sql_query(lock_sql("pg_advisory_lock_shared", busy_lock))
        .execute(&mut busy)
        .await
        .unwrap();
    let relay = spawned(polling_once_a_minute(&env, 1), &env.nats).await;
    let mut listener = listening(&env).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut conn = env.conn().await;
    assert!(
        !holds(&mut conn, doorbell, "ExclusiveLock").await,
        "an idle relay took the doorbell while another relay was busy"
    );
    env.commit(&mut Order::place("o-1", "ada", 100)).await;
    assert!(
        !notified(&mut listener, Duration::from_millis(300)).await,
        "a unit of work notified while the only idle relay left the doorbell"
    );

    diesel::sql_query(lock_sql("pg_advisory_unlock_shared", busy_lock))
        .execute(&mut busy)
        .await
        .unwrap();
    until_a_relay_holds_the_doorbell(&env).await;
    // Not the poll: it comes in a minute.
    env.until_stream_holds(1, Duration::from_secs(3)).await;
    relay.shutdown().await.unwrap();
}

/// A relay that claims batch after batch holds the busy lock in shared mode meanwhile, and
/// gives it back once it has drained the outbox (then it holds the doorbell).
#[tokio::test]
async fn a_busy_relay_holds_the_busy_lock_until_it_is_idle() {
    const ORDERS: usize = 200;
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let mut orders: Vec<Order> = (0..ORDERS)
        .map(|n| Order::place(&format!("o-{n}"), "ada", 1))
        .collect();
    env.outbox()
        .transaction(&mut conn, async |uow| {
            for order in &mut orders {
                uow.track(order);
            }
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
    let (_, busy_lock) = locks(&env).await;
    let mut config = polling_once_a_minute(&env, env.relay_config().workers);
    config.batch_size = 5;
    let relay = spawned(config, &env.nats).await;
    let mut seen_busy = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while env.stream_len().await < ORDERS as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "the drain did not end"
        );
        seen_busy |= holds(&mut conn, busy_lock, "ShareLock").await;
    }
    until_a_relay_holds_the_doorbell(&env).await;
    let busy_after = holds(&mut conn, busy_lock, "ShareLock").await;
    relay.shutdown().await.unwrap();
    assert!(
        seen_busy,
        "the busy lock was never held during a drain of 40 batches"
    );
    assert!(!busy_after, "the busy lock is still held by an idle relay");
}

/// A relay holding the doorbell that cannot publish (its broker stopped answering) lets the
/// doorbell go once its workers back off, and another relay takes it and publishes what
/// commits meanwhile, without waiting for its poll. Kept, the doorbell would ring only the
/// relay that cannot publish.
#[tokio::test]
async fn a_relay_that_cannot_publish_lets_another_take_the_doorbell() {
    let env = TestEnv::new().await;
    let mut config = polling_once_a_minute(&env, 1);
    config.ack_timeout = Duration::from_millis(500);
    // Relay A, the first to hold the doorbell, reaches the broker through a proxy.
    let proxy = support::Proxy::start(
        tokio::net::lookup_host(env.nats_url().trim_start_matches("nats://"))
            .await
            .unwrap()
            .next()
            .unwrap(),
    )
    .await;
    let unanswered = outbox_runtime::nats::connect(&format!("nats://127.0.0.1:{}", proxy.port))
        .await
        .unwrap();
    let a = spawned(config.clone(), &unanswered).await;
    until_a_relay_holds_the_doorbell(&env).await;
    let b = spawned(config, &env.nats).await;
    // B has claimed once and waits for the doorbell A holds.
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.freeze(true);

    env.commit(&mut Order::place("o-1", "ada", 100)).await;
    // A claims the row, its publish times out (0.5 s), it rolls back and backs off; B must
    // take the doorbell and publish the row long before its poll (60 s).
    env.until_stream_holds(1, Duration::from_secs(10)).await;
    b.shutdown().await.unwrap();
    proxy.freeze(false);
    a.shutdown().await.unwrap();
    assert_eq!(env.stream_messages().await.len(), 1);
}

/// A transaction that inserted into the outbox while no relay waited holds the doorbell's
/// lock in shared mode until it ends (a hand insert in a long transaction; any commit that
/// the disk holds up longer than an arming attempt waits), so an idle relay cannot arm the
/// doorbell meanwhile. The commits of other writers in that time must still wake it: before,
/// none did, and each waited for the relay's poll (here a minute; 500 ms by default).
#[tokio::test]
async fn commits_beside_an_open_insert_wake_the_relay_that_cannot_arm() {
    let env = TestEnv::new().await;
    let mut writer = env.conn().await;
    writer.batch_execute("BEGIN").await.unwrap();
    insert_raw(
        &mut writer,
        "r-1",
        &format!("{}.Raw.r-1.Written", env.prefix),
    )
    .await;
    let relay = spawned(polling_once_a_minute(&env, 2), &env.nats).await;
    // The relay starts, finds nothing and tries to arm the doorbell, in vain.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut slowest = Duration::ZERO;
    for i in 0..5 {
        let started = std::time::Instant::now();
        env.commit(&mut Order::place(&format!("o-{i}"), "ada", 100))
            .await;
        env.until_stream_holds(i + 1, Duration::from_secs(3)).await;
        slowest = slowest.max(started.elapsed());
    }
    println!("slowest commit to the stream beside the open insert: {slowest:?}");
    writer.batch_execute("COMMIT").await.unwrap();
    env.until_stream_holds(6, Duration::from_secs(3)).await;
    relay.shutdown().await.unwrap();
}

/// Commits `order`'s events through `outbox` on `conn`.
async fn commit_on(
    outbox: &outbox_runtime::Outbox,
    conn: &mut AsyncPgConnection,
    order: &mut Order,
) {
    outbox
        .transaction(conn, async |uow| {
            uow.track(order);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
}

/// Two services keep their outboxes in one database, each in a schema of its own (here
/// `public` and `second`, chosen by `search_path`), each with its relay. Each relay holds its
/// own outbox's doorbell and is woken by its own outbox's commits alone, whichever relay is
/// idle or busy. The doorbell, the busy lock and the channel were the database's, not the
/// table's: the second relay waited for its poll (here a minute; 500 ms by default) while the
/// first held the doorbell or was busy, and the first was woken by the second's commits (16
/// claims that found nothing for its 8 commits).
#[tokio::test]
async fn two_outboxes_in_one_database_each_wake_their_own_relay() {
    const COMMITS: u64 = 8;
    let counters = Counters::installed();
    let first = TestEnv::new().await;
    // The second service's prefix and stream; its outbox lives in the first one's database.
    let second = TestEnv::unmigrated(first.nats_url()).await;
    first
        .conn()
        .await
        .batch_execute("CREATE SCHEMA second")
        .await
        .unwrap();
    let second_url = format!("{}?options=-csearch_path%3Dsecond", first.database_url);
    outbox_runtime::run_migrations(&second_url).await.unwrap();

    let mut first_config = polling_once_a_minute(&first, 1);
    first_config.batch_size = 10;
    let mut second_config = polling_once_a_minute(&second, 1);
    second_config.database_url.clone_from(&second_url);
    let relays = [
        spawned(first_config, &first.nats).await,
        spawned(second_config, &second.nats).await,
    ];
    let claims =
        |env: &TestEnv, found: &str| counters.get(&Counters::claims_key(&env.stream, found));
    println!(
        "first stream {}, second stream {}",
        first.stream, second.stream
    );
    let mut first_conn = first.conn().await;
    let mut second_conn = AsyncPgConnection::establish(&second_url).await.unwrap();
    // Both idle, each holds the doorbell of its own outbox.
    let doorbells = [
        locks(&first).await.0,
        doorbell_lock(outbox_table(&second_url).await),
    ];
    assert_ne!(doorbells[0], doorbells[1]);
    wait_until(
        "both relays hold their doorbells",
        Duration::from_secs(10),
        || async {
            let mut conn = first.conn().await;
            (holds(&mut conn, doorbells[0], "ExclusiveLock").await
                && holds(&mut conn, doorbells[1], "ExclusiveLock").await)
                .then_some(())
        },
    )
    .await;

    // Both idle: commits to each, in turn, each waited for in its stream.
    let nothing_before = [claims(&first, "nothing"), claims(&second, "nothing")];
    let mut slowest = Duration::ZERO;
    for n in 0..COMMITS {
        for (env, conn) in [(&first, &mut first_conn), (&second, &mut second_conn)] {
            let started = std::time::Instant::now();
            commit_on(
                &env.outbox(),
                conn,
                &mut Order::place(&format!("o-{n}"), "ada", 100),
            )
            .await;
            env.until_stream_holds(n + 1, Duration::from_secs(3)).await;
            slowest = slowest.max(started.elapsed());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let woken_for_nothing = [
        claims(&first, "nothing") - nothing_before[0],
        claims(&second, "nothing") - nothing_before[1],
    ];
    println!(
        "idle: slowest commit to its stream {slowest:?}; claims that found nothing {woken_for_nothing:?}"
    );
    for (relay, nothing) in ["first", "second"].iter().zip(woken_for_nothing) {
        assert!(
            nothing <= COMMITS + 1,
            "the {relay} relay claimed {nothing} times for nothing over {COMMITS} commits of \
             its own: it was woken by the other outbox's"
        );
    }

    // The first relay busy with a burst (claiming batch after batch): the second one's
    // commits still wake it.
    let mut burst = Order::place("burst", "ada", 100);
    for _ in 0..1_999 {
        burst.record(support::domain::OrderEvent::Shipped);
    }
    commit_on(&first.outbox(), &mut first_conn, &mut burst).await;
    let first_busy = locks(&first).await.1;
    wait_until("the first relay busy", Duration::from_secs(10), || async {
        holds(&mut first.conn().await, first_busy, "ShareLock")
            .await
            .then_some(())
    })
    .await;
    let mut slowest = Duration::ZERO;
    for n in COMMITS..COMMITS + 5 {
        let started = std::time::Instant::now();
        commit_on(
            &second.outbox(),
            &mut second_conn,
            &mut Order::place(&format!("o-{n}"), "ada", 100),
        )
        .await;
        second
            .until_stream_holds(n + 1, Duration::from_secs(3))
            .await;
        slowest = slowest.max(started.elapsed());
    }
    println!("beside a busy relay: slowest commit to its stream {slowest:?}");
    first
        .until_stream_holds(COMMITS + 2_000, Duration::from_secs(60))
        .await;
    for relay in relays {
        relay.shutdown().await.unwrap();
    }
    assert_eq!(first.stream_messages().await.len() as u64, COMMITS + 2_000);
    assert_eq!(second.stream_messages().await.len() as u64, COMMITS + 5);
}
