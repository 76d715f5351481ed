//! Replaying the archive against the real PostgreSQL and NATS: the events a relay archived
//! are published again to a stream of their own, each once, in per-aggregate order, as the
//! messages the relay published; and a consumer that joins after the live stream lost them
//! applies the whole history once, then the live stream.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_runtime::inbox::dead_letters;
use outbox_runtime::replay::{
    ArchivePosition, ReplayConfig, ReplayError, ReplayReport, replay_archive,
};
use outbox_runtime::{Inbox, StreamSettings, Topology};
use support::consumer::{
    Recording, applied, archive_all, assert_applied_in_order, commit_round, consumer_config,
    consumer_database, orders, run_until_settled,
};
use support::domain::Order;
use support::{Received, TestEnv, sequences};

/// Commits the rounds `rounds` of `orders` (see `commit_round`), so that the aggregates
/// interleave in the outbox and in the live stream.
async fn commit(env: &TestEnv, orders: &mut [Order], rounds: std::ops::Range<usize>) {
    let mut conn = env.conn().await;
    for round in rounds {
        commit_round(env, &mut conn, orders, round).await;
    }
}

/// Commits `rounds` rounds of `aggregates` orders to `env`'s outbox ([`commit`]) and
/// archives them all: `aggregates` times `rounds` events in the archive.
async fn archive(env: &TestEnv, aggregates: usize, rounds: usize) {
    commit(env, &mut orders(aggregates), 0..rounds).await;
    archive_all(env).await;
}

/// Asserts that `target`'s stream holds each event of an archive of `aggregates` times
/// `rounds` events ([`archive`]) once, each aggregate's in sequence order.
async fn assert_replayed_once_in_order(target: &TestEnv, aggregates: usize, rounds: usize) {
    let replayed = target.stream_messages().await;
    assert_eq!(
        replayed.len(),
        aggregates * rounds,
        "each archived event once"
    );
    let expected: Vec<u64> = (1..=rounds as u64).collect();
    for (aggregate, seqs) in sequences(&replayed) {
        assert_eq!(seqs, expected, "{aggregate}: in sequence order");
    }
}

/// A replay of `producer`'s archive into `target`'s prefix and stream, with the tests'
/// relay source and small pages, so that pages end inside aggregates.
fn replay_config(producer: &TestEnv, target: &TestEnv) -> ReplayConfig {
    let mut config = ReplayConfig::new(producer.prefix.parse().unwrap(), target.topology());
    config.source = producer.relay_config().source;
    config.batch_size = 7;
    config
}

/// Replays `producer`'s archive as `config` says.
async fn replay(producer: &TestEnv, config: &ReplayConfig) -> Result<ReplayReport, ReplayError> {
    replay_archive(
        &mut producer.conn().await,
        producer.nats.clone(),
        config,
        |_| {},
    )
    .await
}

/// The messages of `messages` by their `ce-id`.
fn by_id(messages: &[Received]) -> BTreeMap<String, &Received> {
    messages.iter().map(|m| (m.header("ce-id"), m)).collect()
}

/// Every header of `message`, each name with all of its values.
fn headers(message: &Received) -> BTreeMap<String, Vec<String>> {
    message
        .headers
        .iter()
        .map(|(name, values)| {
            (
                name.to_string(),
                values.iter().map(|v| v.as_str().to_owned()).collect(),
            )
        })
        .collect()
}

#[tokio::test]
async fn an_archive_replays_to_a_stream_of_its_own_each_event_once_in_order_as_published() {
    let producer = TestEnv::new().await;
    let target = TestEnv::new().await;
    archive(&producer, 5, 4).await;
    let live = producer.stream_messages().await;
    assert_eq!(live.len(), 20);

    let mut pages = Vec::new();
    let report = replay_archive(
        &mut producer.conn().await,
        producer.nats.clone(),
        &replay_config(&producer, &target),
        |report| pages.push(report.published),
    )
    .await
    .unwrap();
    assert_eq!((report.published, report.duplicates), (20, 0));
    assert_eq!(pages, [7, 14, 20], "a page of 7 at a time");
    let last = report.last.clone().expect("a last position");
    assert_eq!((last.aggregate_id.as_str(), last.aggregate_seq), ("o-4", 4));

    let replayed = target.stream_messages().await;
    assert_eq!(replayed.len(), 20, "each archived event once");
    let live_by_id = by_id(&live);
    for message in &replayed {
        let id = message.header("ce-id");
        let original = live_by_id[&id];
        assert_eq!(
            message.subject,
            format!(
                "{}.{}",
                target.prefix,
                original
                    .subject
                    .strip_prefix(&format!("{}.", producer.prefix))
                    .unwrap()
            ),
            "{id}: the live subject under the replay's prefix"
        );
        assert_eq!(
            headers(message),
            headers(original),
            "{id}: the same headers"
        );
        assert_eq!(
            message.payload, original.payload,
            "{id}: the same payload bytes"
        );
    }
    let expected: Vec<u64> = (1..=4).collect();
    for (aggregate, seqs) in sequences(&replayed) {
        assert_eq!(seqs, expected, "{aggregate}: in sequence order");
    }

    // Run again: the same message ids, which the stream drops inside its duplicate window.
    let again = replay_archive(
        &mut producer.conn().await,
        producer.nats.clone(),
        &replay_config(&producer, &target),
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!((again.published, again.duplicates), (20, 20));
    assert_eq!(target.stream_len().await, 20);
}

#[tokio::test]
async fn a_replay_takes_only_what_its_filters_and_position_select() {
    let producer = TestEnv::new().await;
    archive(&producer, 3, 3).await;

    // From a position: what follows it in archive order (type, id, sequence), nothing before.
    let target = TestEnv::new().await;
    let mut config = replay_config(&producer, &target);
    let all = replay(&producer, &config).await.unwrap();
    assert_eq!(all.published, 9);
    let resumed = TestEnv::new().await;
    let mut from_o1 = replay_config(&producer, &resumed);
    let all_messages = target.stream_messages().await;
    let sequence = |m: &Received| m.header("ce-sequence").parse::<i64>().unwrap();
    let o1_seq2 = all_messages
        .iter()
        .find(|m| m.header("ce-subject") == "o-1" && sequence(m) == 2)
        .unwrap();
    from_o1.after = Some(ArchivePosition {
        aggregate_type: "Order".into(),
        aggregate_id: "o-1".into(),
        aggregate_seq: 2,
        id: o1_seq2.header("ce-id").parse().unwrap(),
    });
    let rest = replay(&producer, &from_o1).await.unwrap();
    assert_eq!(rest.published, 4, "o-1's third event and o-2's three");
    let after_o1_seq2: Vec<(String, i64)> = all_messages
        .iter()
        .map(|m| (m.header("ce-subject"), sequence(m)))
        .filter(|(id, seq)| (id.as_str(), *seq) > ("o-1", 2))
        .collect();
    let mut rest_events: Vec<(String, i64)> = resumed
        .stream_messages()
        .await
        .iter()
        .map(|m| (m.header("ce-subject"), sequence(m)))
        .collect();
    rest_events.sort();
    let mut expected = after_o1_seq2;
    expected.sort();
    assert_eq!(rest_events, expected, "what comes after o-1's second event");

    // Published since a time after every event: nothing; of another aggregate type: nothing.
    config.published_since = Some(time::OffsetDateTime::now_utc() + time::Duration::hours(1));
    let none = replay_archive(
        &mut producer.conn().await,
        producer.nats.clone(),
        &config,
        |_| panic!("no page"),
    )
    .await
    .unwrap();
    assert_eq!(none, Default::default());
    config.published_since = Some(time::OffsetDateTime::now_utc() - time::Duration::hours(1));
    config.aggregate_types = vec!["Invoice".into()];
    let other_type = replay(&producer, &config).await.unwrap();
    assert_eq!(other_type.published, 0);
    config.aggregate_types = vec!["Order".into(), "Invoice".into()];
    config.published_before = Some(time::OffsetDateTime::now_utc() + time::Duration::hours(1));
    let orders_only = replay(&producer, &config).await.unwrap();
    assert_eq!((orders_only.published, orders_only.duplicates), (9, 9));
}

#[tokio::test]
async fn a_replay_into_the_live_stream_or_its_subjects_is_refused_before_it_reads() {
    let producer = TestEnv::new().await;
    archive(&producer, 1, 1).await;

    // The producer's own prefix.
    let mut config = ReplayConfig::new(producer.prefix.parse().unwrap(), producer.topology());
    let error = replay(&producer, &config).await.unwrap_err();
    assert!(
        matches!(&error, ReplayError::Settings(m) if m.contains(&producer.prefix)),
        "{error}"
    );

    // The live stream under a prefix of the replay's: it does not capture that prefix.
    let target = TestEnv::new().await;
    config.to = Topology::new(
        target.prefix.parse().unwrap(),
        StreamSettings {
            name: producer.stream.clone(),
            ..StreamSettings::default()
        },
    );
    let error = replay(&producer, &config).await.unwrap_err();
    assert!(
        matches!(&error, ReplayError::Stream(_)) && error.to_string().contains(&producer.stream),
        "{error}"
    );

    // A stream that captures the replay's prefix and some of a producer's subjects (one whose
    // own stream does not exist, or JetStream would refuse the overlap).
    let other = TestEnv::new().await;
    target
        .jetstream()
        .create_stream(async_nats::jetstream::stream::Config {
            name: target.stream.clone(),
            subjects: vec![
                format!("{}.>", target.prefix),
                format!("{}.Order.>", other.prefix),
            ],
            ..Default::default()
        })
        .await
        .unwrap();
    let config = ReplayConfig::new(other.prefix.parse().unwrap(), target.topology());
    let error = replay_archive(&mut other.conn().await, other.nats.clone(), &config, |_| {})
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("captures some of the producer's subjects")
            && error.to_string().contains(&target.stream),
        "{error}"
    );
    assert_eq!(target.stream_len().await, 0, "nothing published");
}

#[tokio::test]
async fn a_consumer_that_joins_late_applies_the_replayed_history_then_the_live_stream_once() {
    let producer = TestEnv::new().await;
    let consumer = consumer_database().await;
    let mut orders = orders(4);
    commit(&producer, &mut orders, 0..5).await;
    archive_all(&producer).await;
    // The live stream's limits removed those (a max_age passed), and more came since.
    producer
        .jetstream()
        .get_stream(&producer.stream)
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    commit(&producer, &mut orders, 5..8).await;
    archive_all(&producer).await;
    assert_eq!(
        producer.stream_len().await,
        12,
        "the live stream's last 3 rounds"
    );
    // Still queued when the replay runs: not in the archive, the live stream brings it.
    commit(&producer, &mut orders, 8..9).await;

    // The replay into the consumer's own stream, and the consumer on it.
    let report = replay(&producer, &replay_config(&producer, &consumer))
        .await
        .unwrap();
    assert_eq!(report.published, 32);
    let mut config = consumer_config(&consumer, &producer, "late");
    config.topology = consumer.topology();
    let inbox = Inbox::connect(config, consumer.nats.clone(), Recording::default())
        .await
        .unwrap();
    run_until_settled(inbox, "the replay applied", Duration::from_secs(30)).await;
    assert_applied_in_order(&applied(&mut consumer.conn().await).await, 4, 8);

    // Then the live stream, by the same consumer name: what the replay applied is dropped.
    archive_all(&producer).await;
    let config = consumer_config(&consumer, &producer, "late");
    let inbox = Inbox::connect(config, consumer.nats.clone(), Recording::default())
        .await
        .unwrap();
    run_until_settled(inbox, "the live stream applied", Duration::from_secs(30)).await;
    assert_applied_in_order(&applied(&mut consumer.conn().await).await, 4, 9);
    // Each live copy of a replayed event was known as one (same source and id), not taken
    // for an event the consumer never applied and dead-lettered as late.
    let dead_letters = dead_letters(&mut consumer.conn().await, Some("late"), 100)
        .await
        .unwrap();
    assert!(dead_letters.is_empty(), "{dead_letters:?}");
}

#[tokio::test]
async fn a_replay_cut_by_the_brokers_death_resumes_where_it_says_and_loses_nothing() {
    let mut server = support::NatsServer::start().await;
    let producer = TestEnv::with_nats(&server.url()).await;
    let target = TestEnv::with_nats(&server.url()).await;
    archive(&producer, 6, 5).await;

    let mut config = replay_config(&producer, &target);
    config.batch_size = 8;
    config.ack_timeout = Duration::from_secs(1);
    let mut pages = 0;
    let error = replay_archive(
        &mut producer.conn().await,
        producer.nats.clone(),
        &config,
        |_| {
            pages += 1;
            if pages == 2 {
                server.stop();
            }
        },
    )
    .await
    .unwrap_err();
    let resume_after = error
        .resume_after()
        .cloned()
        .expect("a position to resume after");
    assert!(
        matches!(&error, ReplayError::Publish { .. })
            && error
                .to_string()
                .contains(&format!("replayed up to {resume_after}: resume after it")),
        "{error}"
    );
    assert_eq!(
        (
            resume_after.aggregate_id.as_str(),
            resume_after.aggregate_seq
        ),
        ("o-3", 1),
        "the last event of the second page of 8, in archive order"
    );

    server.restart().await;
    // The resumed run starts once the client is back and JetStream answers it (its stream
    // recovered): within the run's 1-s request timeout, a client still reconnecting failed
    // the run's first request under a loaded CI.
    support::wait_until(
        "JetStream answering the client again",
        Duration::from_secs(30),
        || async { producer.jetstream().get_stream(&target.stream).await.ok() },
    )
    .await;
    config.after = Some(resume_after);
    let rest = replay(&producer, &config).await.unwrap();
    assert_eq!(
        rest.published, 14,
        "the 30 events less the 16 of the first two pages"
    );
    assert_replayed_once_in_order(&target, 6, 5).await;
}

/// A replay whose database session ends under it (an operator's `pg_terminate_backend`, a
/// failover) fails at its next page's read with the position after the last page acked
/// whole, and a run resumed there publishes the rest, and nothing the stream held already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_database_session_ends_resumes_after_the_last_page_acked() {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    let producer = TestEnv::new().await;
    let target = TestEnv::new().await;
    archive(&producer, 6, 5).await;
    let mut config = replay_config(&producer, &target);
    config.batch_size = 8;
    let mut conn = producer.conn().await;
    let replays: Pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result(&mut conn)
        .await
        .unwrap();
    let runtime = tokio::runtime::Handle::current();
    let mut reports = Vec::new();
    let error = replay_archive(&mut conn, producer.nats.clone(), &config, |report| {
        reports.push(report.clone());
        if reports.len() == 1 {
            tokio::task::block_in_place(|| {
                runtime.block_on(async {
                    diesel::sql_query("SELECT pg_terminate_backend($1)")
                        .bind::<diesel::sql_types::Integer, _>(replays.pid)
                        .execute(&mut producer.conn().await)
                        .await
                        .unwrap();
                })
            });
        }
    })
    .await
    .unwrap_err();
    let resume_after = error
        .resume_after()
        .cloned()
        .expect("a position to resume after");
    assert!(matches!(error, ReplayError::Database { .. }), "{error}");
    let acked = reports
        .last()
        .expect("a page acked before the session ended");
    assert_eq!(
        acked.last.as_ref(),
        Some(&resume_after),
        "the position to resume after is the last page acked: {reports:?}"
    );

    config.after = Some(resume_after);
    let rest = replay(&producer, &config).await.unwrap();
    assert_eq!(
        (acked.published + rest.published, rest.duplicates),
        (30, 0),
        "each of the 30 events published once across the two runs: {acked:?} then {rest:?}"
    );
    assert_replayed_once_in_order(&target, 6, 5).await;
}

/// A replay refuses a connection inside a transaction before it reads or publishes anything:
/// each page reads in a transaction of its own, and on PostgreSQL the planner settings of a
/// page (`SET LOCAL`), inside the caller's transaction, lasted until that transaction ended,
/// and its own statements after the replay ran with sorts and sequential scans disabled.
#[tokio::test]
async fn a_replay_refuses_a_connection_inside_a_transaction() {
    use diesel_async::{AsyncConnection, RunQueryDsl};
    #[derive(diesel::QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        enable_sort: String,
    }
    let producer = TestEnv::new().await;
    let target = TestEnv::new().await;
    archive(&producer, 2, 2).await;
    let config = replay_config(&producer, &target);
    let nats = producer.nats.clone();
    let (replayed, setting) = producer
        .conn()
        .await
        .transaction(async |conn| {
            let replayed = replay_archive(conn, nats, &config, |_| {}).await;
            let setting: Setting = diesel::sql_query("SHOW enable_sort")
                .get_result(conn)
                .await?;
            Ok::<_, diesel::result::Error>((replayed, setting.enable_sort))
        })
        .await
        .unwrap();
    match replayed {
        Err(ReplayError::Settings(message)) => assert!(
            message.contains("its connection is inside a transaction"),
            "{message}"
        ),
        other => panic!("a replay inside a transaction: {other:?}"),
    }
    assert_eq!(
        setting, "on",
        "the caller's transaction kept the page's settings"
    );
    assert!(
        target.jetstream().get_stream(&target.stream).await.is_err(),
        "the replay's stream was created"
    );
}

/// The `seq_scan` and `idx_scan` counters of today's archive partition.
async fn scans(conn: &mut diesel_async::AsyncPgConnection) -> (i64, i64) {
    #[derive(diesel::QueryableByName)]
    struct Scans {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        seq_scan: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        idx_scan: i64,
    }
    use diesel_async::RunQueryDsl;
    // Counters flushed by other sessions since this transaction's first read are seen.
    diesel::sql_query("SELECT pg_stat_clear_snapshot()")
        .execute(conn)
        .await
        .unwrap();
    let scans: Scans = diesel::sql_query(
        "SELECT coalesce(seq_scan, 0) AS seq_scan, coalesce(idx_scan, 0) AS idx_scan \
         FROM pg_stat_user_tables WHERE relname = 'outbox_published_p' \
         || to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD')",
    )
    .get_result(conn)
    .await
    .unwrap();
    (scans.seq_scan, scans.idx_scan)
}

/// Each page is read by the archive's index from where the last ended: PostgreSQL estimated
/// the keyset's row comparison by its first column alone and read, and sorted, the whole
/// archive for each page of 1,000 (132 ms a page at 300,000 rows, against 1.4 ms), which made
/// a replay's time grow with the square of the archive.
#[tokio::test]
async fn each_page_is_read_by_the_archives_index_not_by_a_scan_of_the_archive() {
    use diesel_async::SimpleAsyncConnection;
    let producer = TestEnv::new().await;
    let target = TestEnv::new().await;
    let mut conn = producer.conn().await;
    conn.batch_execute(&format!(
        "SELECT outbox_published_partitions(0); \
         INSERT INTO outbox_published SELECT gen_random_uuid(), 'Order', 'o-' || (n % 1000), \
             n / 1000 + 1, 'Shipped', 1, 'o-' || (n % 1000), '{p}.Order.o-' || (n % 1000) \
             || '.Shipped', '{{}}', '{{}}', now(), NULL, NULL, 1, now() \
         FROM generate_series(0, 19999) n; \
         ANALYZE outbox_published",
        p = producer.prefix
    ))
    .await
    .unwrap();
    let (seq_before, idx_before) = scans(&mut conn).await;
    let mut config = replay_config(&producer, &target);
    config.batch_size = 1_000;
    let mut replaying = producer.conn().await;
    let report = replay_archive(&mut replaying, producer.nats.clone(), &config, |_| {})
        .await
        .unwrap();
    assert_eq!(report.published, 20_000);
    // A session's counters reach the shared statistics at the latest when it ends.
    drop(replaying);
    let (seq_after, idx_after) = support::wait_until(
        "the replay's scans counted",
        Duration::from_secs(10),
        || async {
            let (seq, idx) = scans(&mut producer.conn().await).await;
            (idx > idx_before || seq > seq_before).then_some((seq, idx))
        },
    )
    .await;
    assert_eq!(
        seq_after,
        seq_before,
        "pages read by scanning the archive ({} index scans)",
        idx_after - idx_before
    );
    assert!(idx_after >= idx_before + 20, "{idx_before} -> {idx_after}");
}

/// The calls of the statements whose text is like `pattern`, and the functions PostgreSQL
/// compiled for them, as `pg_stat_statements` counted them.
async fn compiled(conn: &mut diesel_async::AsyncPgConnection, pattern: &str) -> (i64, i64) {
    #[derive(diesel::QueryableByName)]
    struct Compiled {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        calls: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        functions: i64,
    }
    use diesel_async::RunQueryDsl;
    let counted: Compiled = diesel::sql_query(
        "SELECT coalesce(sum(calls), 0)::int8 AS calls, \
                coalesce(sum(jit_functions), 0)::int8 AS functions \
         FROM pg_stat_statements WHERE query LIKE $1",
    )
    .bind::<diesel::sql_types::Text, _>(pattern)
    .get_result(conn)
    .await
    .unwrap();
    (counted.calls, counted.functions)
}

/// A page of the archive is read without compiling its plan: the settings that keep the read
/// on the archive's index (`enable_sort = off` among them) put PostgreSQL's cost of a disabled
/// plan node on the sort by event id within a sequence, far over `jit_above_cost`, and each
/// page was compiled (79 functions, 120 ms) to run in 8 ms: a replay of a multi-day archive
/// ran at 5,400 events/s. Counted by `pg_stat_statements` on a PostgreSQL server of the
/// test's own (the module is loaded at a server's start), every statement of the replay's
/// session over its `jit_above_cost`, as that page was.
#[tokio::test]
async fn a_page_of_the_archive_is_read_without_compiling_its_plan() {
    use diesel_async::SimpleAsyncConnection;
    let server = support::postgres::PostgresServer::start_with(&[
        "shared_preload_libraries=pg_stat_statements",
    ])
    .await;
    let mut producer = TestEnv::new().await;
    producer.database_url = server.url("postgres");
    outbox_runtime::run_migrations(&producer.database_url)
        .await
        .unwrap();
    let target = TestEnv::new().await;
    archive(&producer, 3, 2).await;

    // What the test needs: a server that compiles a statement over `jit_above_cost`.
    let mut conn = producer.conn().await;
    conn.batch_execute(
        "CREATE EXTENSION pg_stat_statements; \
         SET jit_above_cost = 0; SELECT count(*) FROM outbox_published",
    )
    .await
    .unwrap();
    let (calls, functions) = compiled(&mut conn, "%count(*) FROM outbox_published%").await;
    assert!(
        calls == 1 && functions > 0,
        "this PostgreSQL compiled no statement ({calls} calls, {functions} functions; jit off, \
         or no llvmjit): the test needs it to"
    );

    let mut replaying = producer.conn().await;
    replaying
        .batch_execute("SET jit_above_cost = 0")
        .await
        .unwrap();
    let report = replay_archive(
        &mut replaying,
        producer.nats.clone(),
        &replay_config(&producer, &target),
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(report.published, 6);
    let (pages, functions) = compiled(&mut conn, "%FROM outbox_published WHERE starts_with%").await;
    assert!(pages >= 1, "no page counted");
    assert_eq!(
        functions, 0,
        "the replay's pages were compiled ({pages} calls)"
    );
}
