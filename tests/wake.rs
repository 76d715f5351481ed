//! How an idle relay is woken, against the real PostgreSQL and NATS: a unit of work notifies
//! only while a relay waits for rows (a NOTIFY serialises commits), and no commit is left
//! waiting for a poll, whatever the interleaving of commits, claims and relays.

mod support;

use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures::StreamExt;
use outbox_runtime::relay::DOORBELL_LOCK;
use outbox_runtime::{Relay, UnitOfWorkError};
use support::domain::Order;
use support::{TestEnv, insert_raw};

/// A connection listening on the relay's channel.
async fn listening(env: &TestEnv) -> AsyncPgConnection {
    let mut conn = env.conn().await;
    conn.batch_execute("LISTEN outbox_events").await.unwrap();
    conn
}

/// Whether a notification reaches `conn` within `within`.
async fn notified(conn: &mut AsyncPgConnection, within: Duration) -> bool {
    let mut notifications = std::pin::pin!(conn.notifications_stream());
    tokio::time::timeout(within, notifications.next())
        .await
        .is_ok()
}

/// `SELECT function(DOORBELL_LOCK)`: `pg_advisory_lock` takes the doorbell as an idle relay
/// does, `pg_advisory_unlock` releases it.
fn doorbell_sql(function: &str) -> String {
    format!(
        "SELECT {function}({}, {})",
        DOORBELL_LOCK.0, DOORBELL_LOCK.1
    )
}

/// Takes the doorbell's lock as an idle relay does, on a connection of its own.
async fn hold_doorbell(env: &TestEnv) -> AsyncPgConnection {
    let mut conn = env.conn().await;
    diesel::sql_query(doorbell_sql("pg_advisory_lock"))
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
    diesel::sql_query(doorbell_sql("pg_advisory_unlock"))
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
    let arm = doorbell_sql("pg_advisory_lock");
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

/// `relays` relays of `workers` workers each, polling once a minute, and rounds of
/// concurrent commits, each round waited for in the stream: a commit that neither notified
/// a waiting relay nor was seen by a claim would wait a minute.
async fn every_commit_wakes(relays: usize, workers: usize) {
    let env = TestEnv::new().await;
    let mut handles = Vec::new();
    for _ in 0..relays {
        let mut config = env.relay_config();
        config.poll_interval = Duration::from_secs(60);
        config.workers = workers;
        let relay = Relay::connect(config, env.nats.clone()).await.unwrap();
        handles.push(relay.spawn());
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
