//! Retention at scale against the real PostgreSQL and NATS: the relay's Archive mode moves
//! each published row, whole, into the day's partition of `outbox_published`, and
//! `drop_archived` drops whole days while the relay keeps archiving into today's.

mod support;

use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Bool, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_runtime::{PublishedRows, Relay, outbox};
use support::domain::{Order, OrderEvent};
use support::{TestEnv, count};

/// A relay of `env` in Archive mode.
async fn archiving_relay(env: &TestEnv) -> Relay {
    let mut config = env.relay_config();
    config.published = PublishedRows::Archive;
    Relay::connect(config, env.nats.clone()).await.unwrap()
}

/// Every column an archived row keeps, as text, in aggregate order.
const COLUMNS: &str = "id::text || '|' || aggregate_type || '|' || aggregate_id || '|' || \
     aggregate_seq || '|' || event_type || '|' || event_version || '|' || partition_key || '|' || \
     subject || '|' || payload::text || '|' || headers::text || '|' || occurred_at::text || '|' || \
     coalesce(correlation_id, '-') || '|' || coalesce(causation_id, '-') || '|' || attempts";

#[derive(QueryableByName, Debug, PartialEq, Eq)]
struct Line {
    #[diesel(sql_type = Text)]
    line: String,
}

async fn lines(conn: &mut AsyncPgConnection, table: &str) -> Vec<String> {
    diesel::sql_query(format!(
        "SELECT {COLUMNS} AS line FROM {table} ORDER BY aggregate_id, aggregate_seq"
    ))
    .load::<Line>(conn)
    .await
    .unwrap()
    .into_iter()
    .map(|l| l.line)
    .collect()
}

/// The partitions of `outbox_published`, by name, and whether a detach of each is pending.
async fn partitions(conn: &mut AsyncPgConnection) -> Vec<(String, bool)> {
    #[derive(QueryableByName)]
    struct Partition {
        #[diesel(sql_type = Text)]
        name: String,
        #[diesel(sql_type = Bool)]
        pending: bool,
    }
    diesel::sql_query(
        "SELECT c.relname::text AS name, i.inhdetachpending AS pending FROM pg_inherits i \
         JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'outbox_published'::regclass ORDER BY 1",
    )
    .load::<Partition>(conn)
    .await
    .unwrap()
    .into_iter()
    .map(|p| (p.name, p.pending))
    .collect()
}

/// The partition name of the day `days` before today (UTC).
async fn day_name(conn: &mut AsyncPgConnection, days: i32) -> String {
    diesel::sql_query(format!(
        "SELECT 'outbox_published_p' || to_char((now() AT TIME ZONE 'UTC')::date - ({days}), \
                'YYYYMMDD') AS line"
    ))
    .get_result::<Line>(conn)
    .await
    .unwrap()
    .line
}

/// Creates the partition of the day `days` before today (UTC) and puts `rows` archived rows
/// in it, published at that day's noon.
async fn archived_day(conn: &mut AsyncPgConnection, days: i32, rows: i32) -> String {
    let name = day_name(conn, days).await;
    conn.batch_execute(&format!(
        "CREATE TABLE {name} PARTITION OF outbox_published FOR VALUES \
           FROM (((now() AT TIME ZONE 'UTC')::date - ({days}))::timestamp AT TIME ZONE 'UTC') \
           TO (((now() AT TIME ZONE 'UTC')::date - ({days}) + 1)::timestamp AT TIME ZONE 'UTC'); \
         INSERT INTO outbox_published \
           SELECT gen_random_uuid(), 'Old', 'old-' || n, 1, 'Placed', 1, 'old-' || n, 'x.Old', \
                  '{{}}', '{{}}', now(), NULL, NULL, 0, \
                  ((now() AT TIME ZONE 'UTC')::date - ({days}) + interval '12 hours') \
                    AT TIME ZONE 'UTC' \
           FROM generate_series(1, {rows}) n; \
         ANALYZE {name};"
    ))
    .await
    .unwrap();
    name
}

#[tokio::test]
async fn in_archive_mode_published_rows_move_whole_to_the_days_partition() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    // A relay that starts days after the migration finds today's partition missing: the
    // archive creates it rather than failing the batch.
    let today = day_name(&mut conn, 0).await;
    conn.batch_execute(&format!("DROP TABLE {today}"))
        .await
        .unwrap();
    let mut relay = archiving_relay(&env).await;
    let mut order = Order::place("o-1", "ada", 1);
    order.record(OrderEvent::Shipped);
    env.commit(&mut order).await;
    env.commit(&mut Order::place("o-2", "bob", 2)).await;
    let queued = lines(&mut conn, "outbox_events").await;
    assert_eq!(queued.len(), 3);

    assert_eq!(relay.relay_batch().await.unwrap().published, 3);

    assert_eq!(
        count(&mut conn, "SELECT count(*) FROM outbox_events").await,
        0
    );
    assert_eq!(lines(&mut conn, "outbox_published").await, queued);
    assert_eq!(
        lines(&mut conn, &today).await,
        queued,
        "today's partition holds them"
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT count(*) FROM outbox_published \
             WHERE published_at BETWEEN now() - interval '1 minute' AND now()"
        )
        .await,
        3
    );
    assert!(partitions(&mut conn).await.contains(&(today, false)));
    assert_eq!(
        outbox::published_last_minute(&mut conn, 100).await.unwrap(),
        3
    );
    assert_eq!(relay.relay_batch().await.unwrap().claimed, 0);
    assert_eq!(env.stream_messages().await.len(), 3);
    let stats = outbox::stats(&mut conn).await.unwrap();
    assert_eq!((stats.queued, stats.dead_letters), (0, 0));
}

#[tokio::test]
async fn a_running_archive_relay_keeps_partitions_ahead() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    for days in [0, -1, -2] {
        let name = day_name(&mut conn, days).await;
        conn.batch_execute(&format!("DROP TABLE {name}"))
            .await
            .unwrap();
    }
    assert!(partitions(&mut conn).await.is_empty());
    let relay = archiving_relay(&env).await.spawn();
    let mut expected = Vec::new();
    for days in [0, -1, -2] {
        expected.push((day_name(&mut conn, days).await, false));
    }
    let found = support::wait_until("partitions ahead", Duration::from_secs(10), || async {
        let mut found = env.conn().await;
        let now = partitions(&mut found).await;
        (now.len() == 3).then_some(now)
    })
    .await;
    relay.shutdown().await.unwrap();
    assert_eq!(found, expected);
}

#[tokio::test]
async fn drop_archived_drops_whole_past_days_while_the_relay_archives_into_today() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let old = archived_day(&mut conn, 10, 5_000).await;
    let recent = archived_day(&mut conn, 3, 200).await;
    let today = day_name(&mut conn, 0).await;
    // An age no partition has (`Duration::MAX`: keep everything) drops nothing and fails
    // nothing.
    let kept = outbox::drop_archived(&mut conn, Duration::MAX)
        .await
        .unwrap();
    assert!(kept.partitions.is_empty(), "{kept:?}");

    let relay = archiving_relay(&env).await.spawn();
    // A writer commits all through the drop, so the relay archives while it runs.
    let writing = async {
        for i in 0..200 {
            let mut order = Order::place(&format!("w-{}", i % 20), "ada", i);
            order.record(OrderEvent::Shipped);
            env.commit(&mut order).await;
        }
    };
    let dropping = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        outbox::drop_archived(&mut conn, Duration::from_secs(5 * 86_400))
            .await
            .unwrap()
    };
    let ((), dropped) = tokio::join!(writing, dropping);

    assert_eq!(dropped.partitions.len(), 1, "{dropped:?}");
    assert_eq!(dropped.partitions[0].0, old);
    assert_eq!(
        dropped.partitions[0].1, 5_000,
        "the planner's estimate after ANALYZE"
    );
    let names: Vec<String> = partitions(&mut conn)
        .await
        .into_iter()
        .map(|p| p.0)
        .collect();
    assert!(!names.contains(&old), "{names:?}");
    assert!(
        names.contains(&recent) && names.contains(&today),
        "{names:?}"
    );
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT count(*) FROM pg_class WHERE relname = '{old}'")
        )
        .await,
        0,
        "dropped, not only detached"
    );

    env.until_stream_holds(400, Duration::from_secs(30)).await;
    support::wait_until("everything archived", Duration::from_secs(10), || async {
        let mut conn = env.conn().await;
        (count(&mut conn, "SELECT count(*) FROM outbox_events").await == 0).then_some(())
    })
    .await;
    relay.shutdown().await.unwrap();
    assert_eq!(
        count(&mut conn, &format!("SELECT count(*) FROM {today}")).await,
        400
    );
    assert_eq!(
        count(&mut conn, &format!("SELECT count(*) FROM {recent}")).await,
        200
    );
    assert_eq!(env.stream_len().await, 400);

    // A day that has not ended is never dropped, whatever the bound.
    let again = outbox::drop_archived(&mut conn, Duration::ZERO)
        .await
        .unwrap();
    let dropped: Vec<String> = again.partitions.into_iter().map(|p| p.0).collect();
    assert_eq!(dropped, vec![recent]);
    assert_eq!(
        count(&mut conn, &format!("SELECT count(*) FROM {today}")).await,
        400
    );
}

#[tokio::test]
async fn an_interrupted_detach_is_finished_by_the_next_drop() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let old = archived_day(&mut conn, 10, 10).await;
    let older = archived_day(&mut conn, 12, 10).await;

    // A transaction that read the archive makes the concurrent detach wait in its second
    // phase; cancelling it there leaves the partition "detach pending".
    let mut reader = env.conn().await;
    reader
        .batch_execute("BEGIN; SELECT count(*) FROM outbox_published")
        .await
        .unwrap();
    let mut detacher = env.conn().await;
    let pid = count(&mut detacher, "SELECT pg_backend_pid()::int8 AS count").await;
    let detach = tokio::spawn(async move {
        detacher
            .batch_execute(&format!(
                "ALTER TABLE outbox_published DETACH PARTITION {old} CONCURRENTLY"
            ))
            .await
    });
    support::wait_until("the detach waits", Duration::from_secs(10), || async {
        let mut conn = env.conn().await;
        let pending = partitions(&mut conn).await.iter().any(|p| p.1);
        pending.then_some(())
    })
    .await;
    count(
        &mut conn,
        &format!("SELECT pg_cancel_backend({pid})::int::int8 AS count"),
    )
    .await;
    let error = detach.await.unwrap().unwrap_err();
    assert!(error.to_string().contains("cancel"), "{error}");
    reader.batch_execute("ROLLBACK").await.unwrap();
    let old = day_name(&mut conn, 10).await;
    assert!(partitions(&mut conn).await.contains(&(old.clone(), true)));

    let dropped = outbox::drop_archived(&mut conn, Duration::from_secs(86_400))
        .await
        .unwrap();
    // The pending detach first: PostgreSQL refuses another while one is pending.
    let names: Vec<String> = dropped.partitions.into_iter().map(|p| p.0).collect();
    assert_eq!(names, vec![old, older]);
    let left: Vec<String> = partitions(&mut conn)
        .await
        .into_iter()
        .map(|p| p.0)
        .collect();
    assert_eq!(left.len(), 3, "today and two days ahead: {left:?}");
}

#[tokio::test]
async fn partitions_are_created_ahead_without_waiting_for_open_archives() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let ahead = day_name(&mut conn, -2).await;
    conn.batch_execute(&format!("DROP TABLE {ahead}"))
        .await
        .unwrap();
    // A relay's batch that archived and has not committed, and a long reader.
    let mut archiving = env.conn().await;
    archiving
        .batch_execute(
            "BEGIN; INSERT INTO outbox_published \
             SELECT gen_random_uuid(), 'A', 'a', 1, 'Placed', 1, 'a', 'x.A', '{}', '{}', now(), \
                    NULL, NULL, 0, now()",
        )
        .await
        .unwrap();
    let mut reading = env.conn().await;
    reading
        .batch_execute("BEGIN; SELECT count(*) FROM outbox_published")
        .await
        .unwrap();

    let created = outbox::create_archive_partitions(&mut conn, 2)
        .await
        .unwrap();
    assert_eq!(created, 1);
    assert!(partitions(&mut conn).await.contains(&(ahead, false)));
    archiving.batch_execute("COMMIT").await.unwrap();
    reading.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        count(&mut conn, "SELECT count(*) FROM outbox_published").await,
        1
    );
}

#[tokio::test]
async fn purge_published_deletes_in_batches_every_old_row_and_nothing_else() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    // 25 rows published in one instant (one relay batch) straddle the batches of 10; then
    // 5 more old ones, 3 recent ones, 2 queued, a dead letter and a skipped one.
    conn.batch_execute(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
           partition_key, subject, payload, published_at, dead_lettered_at, skipped_at) \
         SELECT 'A', 'a', n, 'E', 'a', 'x.A', '{}', \
                CASE WHEN n <= 25 THEN timestamptz '2020-01-01 00:00Z' \
                     WHEN n <= 30 THEN timestamptz '2020-01-02 00:00Z' + n * interval '1 s' \
                     WHEN n <= 33 THEN now() END, \
                CASE WHEN n >= 36 THEN now() - interval '3 days' END, \
                CASE WHEN n = 37 THEN now() - interval '3 days' END \
         FROM generate_series(1, 37) n",
    )
    .await
    .unwrap();
    let mut seen = Vec::new();
    let deleted = outbox::purge_published(&mut conn, Duration::from_secs(86_400), 10, |n| {
        seen.push(n);
    })
    .await
    .unwrap();
    assert_eq!(deleted, 30);
    assert_eq!(seen, [10, 20, 30, 30]);
    #[derive(QueryableByName)]
    struct Seq {
        #[diesel(sql_type = BigInt)]
        aggregate_seq: i64,
    }
    let left: Vec<i64> =
        diesel::sql_query("SELECT aggregate_seq FROM outbox_events ORDER BY aggregate_seq")
            .load::<Seq>(&mut conn)
            .await
            .unwrap()
            .into_iter()
            .map(|s| s.aggregate_seq)
            .collect();
    assert_eq!(left, (31..=37).collect::<Vec<_>>());
}

/// Two services keep their outboxes in schemas of one database, the second with a
/// `search_path` of `second, public` (to reach extensions in `public`, say). The second
/// outbox's archive must go to its own daily partitions: they were looked up by name along
/// the `search_path`, so the first outbox's partitions in `public` were taken for the
/// second's, none was created in `second` (by the migrations, the relay's start or its
/// archive), and every archive failed with no partition of `outbox_published` for its rows.
#[tokio::test]
async fn an_outbox_in_a_second_schema_archives_into_its_own_partitions() {
    let first = TestEnv::new().await;
    // The second service's prefix and stream; its outbox lives in the first one's database.
    let second = TestEnv::unmigrated(first.nats_url()).await;
    let mut conn = first.conn().await;
    conn.batch_execute("CREATE SCHEMA second").await.unwrap();
    let second_url = format!(
        "{}?options=-csearch_path%3Dsecond%2Cpublic",
        first.database_url
    );
    outbox_runtime::run_migrations(&second_url).await.unwrap();
    let mut second_conn = AsyncPgConnection::establish(&second_url).await.unwrap();
    let today = day_name(&mut conn, 0).await;
    for schema in ["public", "second"] {
        assert_eq!(
            count(
                &mut conn,
                &format!(
                    "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                     WHERE i.inhparent = '{schema}.outbox_published'::regclass \
                       AND c.relname = '{today}' \
                       AND c.relnamespace = '{schema}'::regnamespace"
                )
            )
            .await,
            1,
            "today's partition of {schema}.outbox_published, in {schema}"
        );
    }

    let mut config = second.relay_config();
    config.database_url.clone_from(&second_url);
    config.published = PublishedRows::Archive;
    let mut relay = Relay::connect(config, second.nats.clone()).await.unwrap();
    second
        .outbox()
        .transaction(&mut second_conn, async |uow| {
            uow.track(&mut Order::place("o-1", "ada", 1));
            Ok::<_, outbox_runtime::UnitOfWorkError>(())
        })
        .await
        .unwrap();
    assert_eq!(relay.relay_batch().await.unwrap().published, 1);
    assert_eq!(
        count(&mut conn, &format!("SELECT count(*) FROM second.{today}")).await,
        1
    );
    assert_eq!(
        count(&mut conn, "SELECT count(*) FROM public.outbox_published").await,
        0
    );
    assert_eq!(second.stream_messages().await.len(), 1);

    // Retention drops the second outbox's past days, not the first one's of the same name.
    let old = archived_day(&mut conn, 3, 4).await;
    assert_eq!(archived_day(&mut second_conn, 3, 5).await, old);
    let dropped = outbox::drop_archived(&mut second_conn, Duration::from_secs(86_400))
        .await
        .unwrap();
    assert_eq!(dropped.partitions, [(old.clone(), 5)]);
    assert_eq!(
        count(&mut conn, &format!("SELECT count(*) FROM public.{old}")).await,
        4
    );
    assert!(partitions(&mut conn).await.contains(&(old, false)));
}
