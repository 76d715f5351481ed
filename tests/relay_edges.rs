//! The relay at its edges, against the real PostgreSQL and NATS: hostile rows (subjects
//! outside the prefix, subjects the server cannot read, data that would switch JetStream's
//! dedup off, times RFC 3339 cannot write), a publish the server's permissions deny, a broker
//! that stops gracefully or stays away, a stream deleted under a running relay, and the
//! warnings an operator sees meanwhile.

mod support;

use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_runtime::outbox::schema::outbox_events;
use outbox_runtime::{PublishedRows, Relay, UnitOfWorkError, dead_letter};
use support::domain::{Order, OrderEvent};
use support::{Logs, NatsServer, TestEnv, insert_raw, sequences, wait_until};

/// The `attempts`, `last_error` and dead-letter state of the rows of `aggregate_id`, or of
/// every row.
async fn rows(
    conn: &mut AsyncPgConnection,
    aggregate_id: Option<&str>,
) -> Vec<(i32, Option<String>, bool)> {
    let mut rows = outbox_events::table
        .select((
            outbox_events::attempts,
            outbox_events::last_error,
            outbox_events::dead_lettered_at.is_not_null(),
        ))
        .into_boxed();
    if let Some(aggregate_id) = aggregate_id {
        rows = rows.filter(outbox_events::aggregate_id.eq(aggregate_id));
    }
    rows.load(conn).await.unwrap()
}

/// The state ([`rows`]) of the `Raw` row of `aggregate_id`.
async fn raw_row(conn: &mut AsyncPgConnection, aggregate_id: &str) -> (i32, Option<String>, bool) {
    let mut rows = rows(conn, Some(aggregate_id)).await;
    assert_eq!(rows.len(), 1, "{aggregate_id}: {rows:?}");
    rows.remove(0)
}

/// The error of the `Raw` row of `aggregate_id`, which must be a dead letter after one
/// attempt.
async fn dead_letter_at_once(conn: &mut AsyncPgConnection, aggregate_id: &str) -> String {
    let (attempts, error, dead) = raw_row(conn, aggregate_id).await;
    assert!(
        dead && attempts == 1,
        "{aggregate_id}: {attempts} {error:?}"
    );
    error.unwrap_or_else(|| panic!("{aggregate_id}: a dead letter without its error"))
}

/// How many times the client has connected. (In a module of its own: with diesel-async's
/// `RunQueryDsl` in scope, `.load` on the counter resolves to a query.)
mod client {
    pub fn connects(client: &async_nats::Client) -> u64 {
        client
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}
use client::connects;

#[tokio::test]
async fn a_row_cannot_publish_to_the_jetstream_api_or_another_stream() {
    let env = TestEnv::new().await;
    let other = format!("{}_OTHER", env.stream);
    let js = env.jetstream();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: other.clone(),
        subjects: vec![format!("{}other.>", env.prefix)],
        ..Default::default()
    })
    .await
    .unwrap();
    js.publish(format!("{}other.kept", env.prefix), "precious".into())
        .await
        .unwrap()
        .await
        .unwrap();

    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    let mut conn = env.conn().await;
    insert_raw(&mut conn, "purge", &format!("$JS.API.STREAM.PURGE.{other}")).await;
    insert_raw(&mut conn, "sideways", &format!("{}other.kept", env.prefix)).await;
    let report = relay.relay_batch().await.unwrap();
    assert_eq!(
        (report.rejected, report.dead_lettered, report.published),
        (2, 2, 0)
    );

    let mut other_stream = js.get_stream(&other).await.unwrap();
    assert_eq!(
        other_stream.info().await.unwrap().state.messages,
        1,
        "the other stream was neither purged nor written"
    );
    for id in ["purge", "sideways"] {
        let error = dead_letter_at_once(&mut conn, id).await;
        assert!(
            error.contains("does not start with the relay's prefix"),
            "{error}"
        );
    }
    let _ = js.delete_stream(&other).await;
}

#[tokio::test]
async fn unreadable_subjects_are_dead_lettered_at_once_and_never_cost_the_connection() {
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.ack_timeout = Duration::from_secs(2);
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let before = connects(&env.nats);
    let mut conn = env.conn().await;
    let p = &env.prefix;
    insert_raw(&mut conn, "space", &format!("{p}.Raw.a b.Written")).await;
    insert_raw(&mut conn, "empty", &format!("{p}.Raw..Written")).await;
    insert_raw(&mut conn, "blank", "").await;
    let huge = "x".repeat(10_000);
    insert_raw(&mut conn, &huge, &format!("{p}.Raw.{huge}.Written")).await;
    let started = Instant::now();
    let mut order = Order::place("o-1", "ada", 1);
    env.commit(&mut order).await;
    env.until_stream_holds(1, Duration::from_secs(10)).await;
    let dead = wait_until("four dead letters", Duration::from_secs(10), || async {
        let dead = dead_letter::list(&mut env.conn().await, 10).await.unwrap();
        (dead.len() == 4).then_some(dead)
    })
    .await;
    let flowed_after = started.elapsed();
    relay.shutdown().await.unwrap();

    for letter in &dead {
        let error = letter.last_error.as_deref().unwrap_or_default();
        let wanted = match letter.aggregate_id.as_str() {
            "space" => "contains whitespace",
            "empty" => "it is empty",
            "blank" => "does not start with the relay's prefix",
            _ => "over the limit of 1024 bytes",
        };
        assert!(
            error.contains(wanted),
            "{}: {error}",
            letter.aggregate_id.len()
        );
        assert_eq!(letter.attempts, 1);
    }
    assert_eq!(
        connects(&env.nats),
        before,
        "the server never dropped the relay's connection"
    );
    assert!(
        flowed_after < Duration::from_secs(5),
        "the other aggregate flowed at once: {flowed_after:?}"
    );
    assert_eq!(env.stream_len().await, 1);
}

/// Inserts by hand the row of the `Raw` aggregate `aggregate_id`, under `prefix`, with its
/// `column` (a time column of `outbox_events`) at `at` (the text of a `timestamptz`) and, when
/// given, this id.
async fn insert_at(
    conn: &mut AsyncPgConnection,
    prefix: &str,
    id: Option<&str>,
    aggregate_id: &str,
    (column, at): (&str, &str),
) -> QueryResult<usize> {
    diesel::sql_query(format!(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                    partition_key, subject, payload, {column}) \
         VALUES (coalesce($1::uuid, gen_random_uuid()), 'Raw', $2, 1, 'Written', $2, \
                 $3 || '.Raw.' || $2 || '.Written', '{{}}', $4::timestamptz)"
    ))
    .bind::<diesel::sql_types::Nullable<diesel::sql_types::Text>, _>(id)
    .bind::<diesel::sql_types::Text, _>(aggregate_id)
    .bind::<diesel::sql_types::Text, _>(prefix)
    .bind::<diesel::sql_types::Text, _>(at)
    .execute(conn)
    .await
}

/// Times RFC 3339 cannot write, and the toolkit could not read back: its years are 0000 to
/// 9999 (section 5.6). One row with such an `occurred_at` failed every relay batch's claim
/// ("Tried to deserialize a timestamp that is too large for Time"); one with such a
/// `dead_lettered_at` failed `outbox dead-letters list` ("cannot convert infinity to bigint").
const OUT_OF_RFC_3339: [&str; 4] = [
    "infinity",
    "-infinity",
    "10000-01-01 00:00:00+00",
    "0002-12-31 23:59:59.999999+00 BC",
];

/// The time columns of `outbox_events` the toolkit reads back (`available_at` is only compared,
/// and `'infinity'` there parks a row).
const READ_BACK: [&str; 4] = [
    "occurred_at",
    "published_at",
    "dead_lettered_at",
    "skipped_at",
];

/// A time RFC 3339 cannot write is refused where it is written, in each column the toolkit
/// reads back, naming the column's constraint; the first and last instants `ce-time` can
/// carry are published as RFC 3339 writes them.
#[tokio::test]
async fn a_time_rfc_3339_cannot_write_is_refused_where_it_is_written() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    for column in READ_BACK {
        for (n, at) in OUT_OF_RFC_3339.iter().enumerate() {
            let aggregate_id = format!("out-{n}");
            let written = insert_at(&mut conn, &env.prefix, None, &aggregate_id, (column, at));
            let error = written.await.expect_err(at).to_string();
            assert!(
                error.contains(&format!("outbox_events_{column}_rfc3339")),
                "{column} {at}: {error}"
            );
        }
    }
    for (aggregate_id, at) in [
        ("first", "0001-01-01 00:00:00+00 BC"),
        ("last", "9999-12-31 23:59:59.999999+00"),
    ] {
        insert_at(
            &mut conn,
            &env.prefix,
            None,
            aggregate_id,
            ("occurred_at", at),
        )
        .await
        .unwrap();
    }
    let relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap()
        .spawn();
    env.until_stream_holds(2, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();
    let mut times: Vec<(String, String)> = env
        .stream_messages()
        .await
        .iter()
        .map(|message| (message.header("ce-subject"), message.header("ce-time")))
        .collect();
    times.sort();
    assert_eq!(
        times,
        [
            ("first".to_owned(), "0000-01-01T00:00:00.000000Z".to_owned()),
            ("last".to_owned(), "9999-12-31T23:59:59.999999Z".to_owned()),
        ]
    );
}

/// Reverts the database's last outbox migration, as diesel's harness does, and returns its
/// version.
async fn revert_last_migration(env: &TestEnv) -> String {
    let conn = env.conn().await;
    tokio::task::spawn_blocking(move || {
        use diesel_migrations::MigrationHarness as _;
        let mut conn = diesel_async::async_connection_wrapper::AsyncConnectionWrapper::<
            AsyncPgConnection,
        >::from(conn);
        conn.revert_last_migration(outbox_runtime::MIGRATIONS)
            .unwrap()
            .to_string()
    })
    .await
    .unwrap()
}

/// The outbox migrations on `env`'s database, which must fail naming the row `id`, its
/// `column` and the value `at`, and how many rows hold such a value.
async fn migrations_refused_over(env: &TestEnv, id: &str, (column, at): (&str, &str), rows: usize) {
    let refused = outbox_runtime::run_migrations(&env.database_url)
        .await
        .expect_err("rows out of range")
        .to_string();
    assert!(
        refused.contains(&format!(
            "the outbox_events row {id} has {column} {at}, outside the years 0000 to 9999 of \
             RFC 3339"
        )) && refused.contains("set it to a time within them, or delete the row")
            && refused.contains(&format!("(rows out of range in {column}: {rows})")),
        "{refused}"
    );
}

/// A database that already holds times the toolkit cannot read is upgraded as far as it can
/// be: the migration that bounds them names a row, its column and how to mend it, fails, and
/// leaves new rows checked; once the rows are mended it runs, and the relay publishes them.
#[tokio::test]
async fn an_upgrade_over_unreadable_times_names_a_row_and_completes_once_they_are_mended() {
    let env = TestEnv::new().await;
    assert_eq!(revert_last_migration(&env).await, "20261205000017");
    assert_eq!(revert_last_migration(&env).await, "20261204000016");
    assert_eq!(revert_last_migration(&env).await, "20261204000015");
    assert_eq!(revert_last_migration(&env).await, "20261204000014");
    assert_eq!(revert_last_migration(&env).await, "20261203000013");
    let mut conn = env.conn().await;
    let id = |n: usize| format!("00000000-0000-4000-8000-00000000000{n}");
    for (n, at) in OUT_OF_RFC_3339.iter().enumerate() {
        insert_at(
            &mut conn,
            &env.prefix,
            Some(&id(n)),
            &format!("out-{n}"),
            ("occurred_at", at),
        )
        .await
        .unwrap();
    }
    let dead = ("dead_lettered_at", "infinity");
    insert_at(&mut conn, &env.prefix, Some(&id(9)), "dead", dead)
        .await
        .unwrap();

    migrations_refused_over(
        &env,
        &id(0),
        ("occurred_at", "infinity"),
        OUT_OF_RFC_3339.len(),
    )
    .await;
    let meanwhile = insert_at(&mut conn, &env.prefix, None, "meanwhile", dead)
        .await
        .expect_err("checked from the failed run on")
        .to_string();
    assert!(
        meanwhile.contains("outbox_events_dead_lettered_at_rfc3339"),
        "{meanwhile}"
    );
    // A NOT VALID constraint checks the rows an update writes: each is mended whole.
    conn.batch_execute("UPDATE outbox_events SET occurred_at = now() WHERE aggregate_id <> 'dead'")
        .await
        .unwrap();
    migrations_refused_over(&env, &id(9), dead, 1).await;
    conn.batch_execute(
        "UPDATE outbox_events SET dead_lettered_at = now() WHERE dead_lettered_at IS NOT NULL",
    )
    .await
    .unwrap();
    let applied = outbox_runtime::run_migrations(&env.database_url)
        .await
        .unwrap();
    assert_eq!(
        applied,
        [
            "20261203000013",
            "20261204000014",
            "20261204000015",
            "20261204000016",
            "20261205000017"
        ]
    );
    let listed = dead_letter::list(&mut conn, 10).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");

    let relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap()
        .spawn();
    env.until_stream_holds(OUT_OF_RFC_3339.len() as u64, Duration::from_secs(10))
        .await;
    relay.shutdown().await.unwrap();
}

/// Rows whose `headers` column holds a header that readers would see differently (an empty
/// name, which nats.go's reader skips and async-nats's keeps; a name that is not an HTTP token,
/// which an HTTP reader refuses) or that is not field content (a control character in a
/// value) are dead-lettered at once, naming the key, while a row with token names and a
/// tab and non-ASCII letters in its value is published with them.
#[tokio::test]
async fn headers_that_are_not_http_fields_are_dead_lettered_at_once_naming_the_key() {
    let env = TestEnv::new().await;
    let relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut conn = env.conn().await;
    let rows = [
        ("empty-name", r#"{"": "v"}"#, r#"key "": a header name is"#),
        ("paren", r#"{"a(b": "v"}"#, r#"key "a(b": a header name is"#),
        ("slash", r#"{"x/y": "v"}"#, r#"key "x/y": a header name is"#),
        (
            "at",
            r#"{"ok": "v", "a@b": "v"}"#,
            r#"key "a@b": a header name is"#,
        ),
        (
            "soh",
            r#"{"x": "a\u0001b"}"#,
            r#"key "x": value "a\u{1}b" contains a control"#,
        ),
        (
            "del",
            r#"{"x": ["ok", "\u007f"]}"#,
            r#"key "x": value "\u{7f}" contains a control"#,
        ),
        (
            "fine",
            r#"{"x.tag_1": "a\tb h\u00e9llo", "A~z": ["1", "2"]}"#,
            "",
        ),
    ];
    for (aggregate_id, headers, _) in rows {
        diesel::sql_query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                        partition_key, subject, payload, headers) \
             VALUES ('Raw', $1, 1, 'Written', $1, $2, '{}', $3::jsonb)",
        )
        .bind::<diesel::sql_types::Text, _>(aggregate_id)
        .bind::<diesel::sql_types::Text, _>(format!("{}.Raw.{aggregate_id}.Written", env.prefix))
        .bind::<diesel::sql_types::Text, _>(headers)
        .execute(&mut conn)
        .await
        .unwrap();
    }
    let mut order = Order::place("o-1", "ada", 1);
    env.commit(&mut order).await;
    let dead = wait_until("six dead letters", Duration::from_secs(10), || async {
        let dead = dead_letter::list(&mut env.conn().await, 10).await.unwrap();
        (dead.len() == 6).then_some(dead)
    })
    .await;
    env.until_stream_holds(2, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();

    for (aggregate_id, _, wanted) in rows.iter().filter(|row| !row.2.is_empty()) {
        let letter = dead
            .iter()
            .find(|letter| letter.aggregate_id == *aggregate_id)
            .unwrap_or_else(|| panic!("{aggregate_id} is not a dead letter: {dead:?}"));
        let error = letter.last_error.as_deref().unwrap_or_default();
        assert!(
            error.starts_with(&format!("headers column: {wanted}")),
            "{aggregate_id}: {error}"
        );
        assert_eq!(letter.attempts, 1, "{aggregate_id}: no retry");
    }
    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), 2, "the order's event and the fine row");
    let fine = messages
        .iter()
        .find(|message| message.header("ce-subject") == "fine")
        .expect("the fine row was published");
    assert_eq!(fine.header("x.tag_1"), "a\tb h\u{e9}llo");
    let values: Vec<&str> = fine
        .headers
        .get_all("A~z")
        .map(|value| value.as_str())
        .collect();
    assert_eq!(values, ["1", "2"]);
}

/// The length of the header block async-nats sends for `headers` (`NATS/1.0`, a line per
/// value, the closing blank line).
fn header_block_len(headers: &async_nats::HeaderMap) -> usize {
    let lines: usize = headers
        .iter()
        .map(|(name, values)| {
            let name: &str = name.as_ref();
            values
                .iter()
                .map(|v| name.len() + 4 + v.as_str().len())
                .sum::<usize>()
        })
        .sum();
    10 + lines + 2
}

/// JetStream refuses a message whose header block is over 65,535 bytes (it stores the length
/// in 16 bits), which no retry changes: a row whose own headers, or whose correlation id
/// inserted by hand, take its message over is a dead letter at once, naming the limit, and a
/// row whose message is exactly at the limit is published. The server's limit is checked
/// first, by publishing blocks of 65,535 and 65,536 bytes to the stream directly.
#[tokio::test]
async fn headers_over_jetstreams_limit_are_a_dead_letter_at_once_and_at_the_limit_are_published() {
    let env = TestEnv::new().await;
    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    let jetstream = async_nats::jetstream::new(env.nats.clone());
    for (value_len, stored) in [(65_514, true), (65_515, false)] {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("x-big", "v".repeat(value_len).as_str());
        assert_eq!(header_block_len(&headers), value_len + 21);
        let subject = format!("{}.Direct.d-{value_len}.Written", env.prefix);
        let ack = match jetstream
            .publish_with_headers(subject, headers, "{}".into())
            .await
        {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(
            ack.is_ok(),
            stored,
            "a block of {} bytes: {ack:?}",
            value_len + 21
        );
        if let Err(error) = ack {
            assert!(error.contains("10097"), "{error}");
        }
    }

    let mut conn = env.conn().await;
    let insert = |aggregate_id: &'static str, value_len: usize| {
        diesel::sql_query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                        partition_key, subject, payload, headers) \
             VALUES ('Raw', $1, 1, 'Written', $1, $2, '{}', jsonb_build_object('x-big', $3))",
        )
        .bind::<diesel::sql_types::Text, _>(aggregate_id)
        .bind::<diesel::sql_types::Text, _>(format!("{}.Raw.{aggregate_id}.Written", env.prefix))
        .bind::<diesel::sql_types::Text, _>("v".repeat(value_len))
    };
    // The relay's own headers for a row of these lengths: those of a row with one byte of its
    // own, as the server stored them.
    insert("hdr-a", 1).execute(&mut conn).await.unwrap();
    assert_eq!(relay.relay_batch().await.unwrap().published, 1);
    let messages = env.stream_messages().await;
    let base = header_block_len(&messages.last().unwrap().headers);
    let at_limit = 1 + 65_535 - base;
    insert("hdr-c", at_limit).execute(&mut conn).await.unwrap();
    insert("hdr-d", at_limit + 1)
        .execute(&mut conn)
        .await
        .unwrap();
    let report = relay.relay_batch().await.unwrap();
    assert_eq!((report.claimed, report.published), (2, 1), "{report:?}");

    let error = dead_letter_at_once(&mut conn, "hdr-d").await;
    assert!(
        error.contains("would be 65536 bytes, over JetStream's limit of 65535"),
        "{error}"
    );
    let messages = env.stream_messages().await;
    let published = messages.last().unwrap();
    assert_eq!(published.header("ce-subject"), "hdr-c");
    assert_eq!(header_block_len(&published.headers), 65_535);

    // A row inserted by hand without headers of its own, whose correlation id alone (the
    // unit of work bounds it to 512 bytes) takes the block over.
    conn.batch_execute(&format!(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                    partition_key, subject, payload, correlation_id) \
         VALUES ('Raw', 'hdr-e', 1, 'Written', 'hdr-e', '{}.Raw.hdr-e.Written', '{{}}', \
                 repeat('x', 70000))",
        env.prefix
    ))
    .await
    .unwrap();
    let report = relay.relay_batch().await.unwrap();
    assert_eq!((report.claimed, report.published), (1, 0), "{report:?}");
    let error = dead_letter_at_once(&mut conn, "hdr-e").await;
    assert!(error.contains("over JetStream's limit of 65535"), "{error}");
}

#[tokio::test]
async fn data_cannot_switch_off_jetstream_dedup() {
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.published = PublishedRows::Mark;
    let mut relay = Relay::connect(config, env.nats.clone()).await.unwrap();
    let mut conn = env.conn().await;
    const AGGREGATES: u64 = 8;
    for n in 0..AGGREGATES {
        let mut order = Order::place(&format!("Nats-Msg-Id-{n}"), "ada", 1);
        env.outbox()
            .transaction(&mut conn, async |uow| {
                uow.set_correlation(format!("Nats-Msg-Id:{n}"), "Nats-Msg-Id");
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap();
    }
    while relay.relay_batch().await.unwrap().claimed > 0 {}
    assert_eq!(env.stream_len().await, AGGREGATES);

    // Every mark lost: the relay publishes every row again, inside the duplicate window.
    conn.batch_execute("UPDATE outbox_events SET published_at = NULL")
        .await
        .unwrap();
    let mut duplicates = 0;
    loop {
        let report = relay.relay_batch().await.unwrap();
        if report.claimed == 0 {
            break;
        }
        duplicates += report.duplicates;
    }
    assert_eq!(env.stream_len().await, AGGREGATES, "stored once each");
    assert_eq!(
        duplicates as u64, AGGREGATES,
        "JetStream found each a duplicate"
    );

    let messages = env.stream_messages().await;
    let first = &messages[0];
    let decode = |name: &str| {
        percent_encoding::percent_decode_str(&first.header(name))
            .decode_utf8()
            .unwrap()
            .into_owned()
    };
    assert!(
        decode("ce-subject").starts_with("Nats-Msg-Id-"),
        "decodes back"
    );
    assert!(decode("ce-correlationid").starts_with("Nats-Msg-Id:"));
    assert_eq!(first.header("Nats-Msg-Id"), first.header("ce-id"));
}

/// A nats-server whose user `relay` may publish the test's events except `Secret` ones, and
/// with `deny_lookups` may not get a stream's messages either.
async fn server_denying_secrets(prefix: &str, deny_lookups: bool) -> NatsServer {
    let lookups = if deny_lookups {
        ", \"$JS.API.STREAM.MSG.GET.>\", \"$JS.API.DIRECT.GET.>\""
    } else {
        ""
    };
    NatsServer::start_with_config(&format!(
        "authorization {{\n  users = [\n    {{ user: relay, password: relay-pw, permissions: {{\n      \
         publish: {{ allow: [\"$JS.API.>\", \"_INBOX.>\", \"{prefix}.>\"], deny: [\"{prefix}.Secret.>\"{lookups}] }}\n      \
         subscribe: {{ allow: [\">\"] }}\n    }} }}\n  ]\n}}\n"
    ))
    .await
}

/// Queues, under `prefix`, a `Secret` row ([`server_denying_secrets`] denies its subject,
/// aggregate `s-1`) and an order's event it permits (`o-1`).
async fn queue_a_denied_and_a_permitted_event(
    conn: &mut AsyncPgConnection,
    outbox: &outbox_runtime::Outbox,
    prefix: &str,
) {
    insert_raw(conn, "s-1", &format!("{prefix}.Secret.s-1.Leaked")).await;
    let mut order = Order::place("o-1", "ada", 1);
    outbox
        .transaction(conn, async |uow| {
            uow.track(&mut order);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
}

/// A publish the server's permissions deny goes unacknowledged while the stream answers and
/// does not hold the message: a rejection, with its error. So it is also for a relay's user
/// not permitted to look the message up: the look goes unanswered, and the relay decides as
/// without it (before, it took that for a stream that stopped answering, and the denied row
/// waited, its attempts never counted, for ever).
#[tokio::test]
async fn a_publish_the_servers_permissions_deny_is_a_rejection_with_its_error() {
    for deny_lookups in [false, true] {
        a_denied_publish_is_rejected(deny_lookups).await;
    }
}

async fn a_denied_publish_is_rejected(deny_lookups: bool) {
    let prefix = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let server = server_denying_secrets(&prefix, deny_lookups).await;
    let url = format!("nats://relay:relay-pw@127.0.0.1:{}", server.port);
    let env = TestEnv::with_nats(&url).await;
    let nats = env.nats.clone();
    let mut config = env.relay_config();
    config.topology.subject_prefix = prefix.parse().unwrap();
    config.ack_timeout = Duration::from_millis(500);
    let outbox = outbox_runtime::Outbox::with_topology(config.topology.clone());
    let mut relay = Relay::connect(config, nats.clone()).await.unwrap();
    let mut conn = env.conn().await;
    queue_a_denied_and_a_permitted_event(&mut conn, &outbox, &prefix).await;

    let report = relay.relay_batch().await.unwrap();
    assert_eq!(
        (report.published, report.rejected, report.transport_failures),
        (1, 1, 0),
        "deny_lookups {deny_lookups}: {report:?}"
    );
    let (attempts, error, dead) = raw_row(&mut conn, "s-1").await;
    assert_eq!(
        (attempts, dead),
        (1, false),
        "an attempt, then a retry later"
    );
    let error = error.unwrap();
    assert!(error.contains("publish permission"), "{error}");
    assert_eq!(
        error.contains("does not hold the message"),
        !deny_lookups,
        "{error}"
    );
    assert_eq!(connects(&nats), 1);
}

/// After a publish goes unacknowledged, the batch asks the stream whether it holds the
/// message, each look bounded by the ack timeout, its transaction open meanwhile. Where the
/// database ends transactions idle for less (an operator's
/// `idle_in_transaction_session_timeout`), the batch's keep-alive must go on through those
/// looks as through its publishes. Before, it stopped with the publishes: a look left
/// unanswered (a relay's user not permitted to get messages) held the transaction idle for
/// the whole ack timeout, the server ended the session, and the batch failed: the good row
/// published but not recorded, the denied row's attempt never counted, the same again at
/// every batch.
#[tokio::test]
async fn looks_at_the_stream_after_a_missing_ack_keep_the_batchs_session_alive() {
    let prefix = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let server = server_denying_secrets(&prefix, true).await;
    let url = format!("nats://relay:relay-pw@127.0.0.1:{}", server.port);
    let env = TestEnv::with_nats(&url).await;
    // Over the 133 ms a 200-ms timeout leaves a keep-alive every third of it, a loaded CI's
    // scheduling cut a batch (`relay_faults::a_batch_slower_than_the_databases_idle_transaction_timeout_commits`).
    support::set_database_default(&env, "idle_in_transaction_session_timeout", "1s").await;
    let mut config = env.relay_config();
    config.topology.subject_prefix = prefix.parse().unwrap();
    config.ack_timeout = Duration::from_secs(2);
    let outbox = outbox_runtime::Outbox::with_topology(config.topology.clone());
    let mut relay = Relay::connect(config.clone(), env.nats.clone())
        .await
        .unwrap();
    let mut conn = env.conn().await;
    queue_a_denied_and_a_permitted_event(&mut conn, &outbox, &prefix).await;

    let started = Instant::now();
    let report = relay.relay_batch().await.unwrap();
    let took = started.elapsed();
    assert!(
        took > 2 * config.ack_timeout,
        "the batch took {took:?}: less than its publish's and its look's ack timeouts, it \
         proves nothing"
    );
    assert_eq!(
        (report.published, report.rejected, report.transport_failures),
        (1, 1, 0),
        "{report:?}"
    );
    let (attempts, error, dead) = raw_row(&mut conn, "s-1").await;
    assert_eq!((attempts, dead), (1, false), "{error:?}");
    let queued = outbox_runtime::outbox::stats(&mut conn)
        .await
        .unwrap()
        .queued;
    assert_eq!(
        queued, 1,
        "the denied row alone waits for its retry; more: the published row is still queued"
    );
}

#[tokio::test]
async fn a_broker_back_from_a_long_outage_is_used_at_once_and_the_outage_is_logged() {
    let (logs, _guard) = Logs::capture().await;
    let mut server = NatsServer::start().await;
    let env = TestEnv::with_nats(&server.url()).await;
    // The defaults: backoff up to 30 s.
    let relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut conn = env.conn().await;
    let mut first = Order::place("o-1", "ada", 1);
    env.commit(&mut first).await;
    env.until_stream_holds(1, Duration::from_secs(10)).await;

    server.stop();
    let mut second = Order::place("o-2", "ada", 1);
    env.outbox()
        .transaction(&mut conn, async |uow| {
            uow.track(&mut second);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
    // Long enough that a doubling backoff would be in a pause of 12.8 s.
    tokio::time::sleep(Duration::from_secs(14)).await;
    server.restart().await;
    let restarted = Instant::now();
    wait_until(
        "the client to reconnect",
        Duration::from_secs(15),
        || async {
            (env.nats.connection_state() == async_nats::connection::State::Connected).then_some(())
        },
    )
    .await;
    let reconnected = restarted.elapsed();
    env.until_stream_holds(2, Duration::from_secs(30)).await;
    let resumed = restarted.elapsed() - reconnected;
    relay.shutdown().await.unwrap();
    eprintln!(
        "after a 14 s outage: the client reconnected {reconnected:?} after the server restarted, \
         and the relay published {resumed:?} after that"
    );

    assert!(
        resumed < Duration::from_secs(2),
        "published {resumed:?} after the client reconnected"
    );
    let text = logs.text();
    assert!(
        text.contains("WARN") && text.contains("the NATS client is disconnected"),
        "the outage was logged as a warning"
    );
    assert!(
        text.contains("the NATS client is connected again"),
        "and its end: {}",
        text.lines()
            .filter(|line| !line.contains("TRACE"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_broker_shutdown_counts_no_attempt_and_dead_letters_nothing() {
    let mut server = NatsServer::start().await;
    let env = TestEnv::with_nats(&server.url()).await;
    let mut config = env.relay_config();
    config.published = PublishedRows::Mark; // keep the rows, to read their attempts
    config.max_attempts = 1; // one counted attempt would dead-letter a row at once
    config.ack_timeout = Duration::from_millis(500);
    config.max_backoff = Duration::from_millis(200);
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();

    // Writers commit all along, so publishes are in flight when JetStream stops.
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = {
        let (outbox, url, stop) = (env.outbox(), env.database_url.clone(), stop.clone());
        tokio::spawn(async move {
            use diesel_async::AsyncConnection;
            let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
            let mut orders: Vec<Order> = (0..20)
                .map(|n| Order::place(&format!("o-{n}"), "ada", 1))
                .collect();
            let mut committed = 0_u64;
            while !stop.is_cancelled() {
                for order in &mut orders {
                    if order.pending_events().is_empty() {
                        order.record(OrderEvent::Shipped);
                    }
                    outbox
                        .transaction(&mut conn, async |uow| {
                            uow.track(order);
                            Ok::<_, UnitOfWorkError>(())
                        })
                        .await
                        .unwrap();
                    committed += 1;
                }
            }
            committed
        })
    };
    // Three graceful stops, each while publishes flow.
    for _ in 0..3 {
        env.until_stream_holds(env.stream_len().await + 200, Duration::from_secs(30))
            .await;
        server.terminate().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        server.restart().await;
    }
    env.until_stream_holds(env.stream_len().await + 200, Duration::from_secs(30))
        .await;
    stop.cancel();
    let committed = writer.await.unwrap();
    env.until_stream_holds(committed, Duration::from_secs(30))
        .await;
    relay.shutdown().await.unwrap();

    let mut conn = env.conn().await;
    let counted: Vec<(String, i32, Option<String>)> = outbox_events::table
        .filter(outbox_events::attempts.gt(0))
        .select((
            outbox_events::aggregate_id,
            outbox_events::attempts,
            outbox_events::last_error,
        ))
        .load(&mut conn)
        .await
        .unwrap();
    assert!(counted.is_empty(), "attempts counted: {counted:?}");
    let messages = env.stream_messages().await;
    assert_eq!(
        messages.len() as u64,
        committed,
        "nothing lost, nothing twice"
    );
    for (aggregate, seqs) in sequences(&messages) {
        let expected: Vec<u64> = (1..=seqs.len() as u64).collect();
        assert_eq!(seqs, expected, "{aggregate} in order");
    }
}

/// Deletes `env`'s stream, then commits one order placed for each of `orders` (`o-N`);
/// returns the deleted stream's configuration, to create it again.
async fn delete_stream_and_commit(
    env: &TestEnv,
    orders: std::ops::Range<usize>,
) -> async_nats::jetstream::stream::Config {
    let info = env
        .jetstream()
        .get_stream(&env.stream)
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    env.jetstream().delete_stream(&env.stream).await.unwrap();
    for n in orders {
        env.commit(&mut Order::place(&format!("o-{n}"), "ada", 1))
            .await;
    }
    info
}

/// An operator edits the stream's subjects under a running relay so that they no longer
/// capture its prefix: publishes find no stream. The relay says so, naming the subjects,
/// counts no attempt and changes nothing; the events flow once the subjects are put back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_edited_to_miss_the_relays_subjects_is_reported_naming_them() {
    let (logs, _guard) = Logs::capture().await;
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.published = PublishedRows::Mark;
    config.max_backoff = Duration::from_millis(300);
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    env.commit(&mut Order::place("o-1", "ada", 1)).await;
    env.until_stream_holds(1, Duration::from_secs(10)).await;

    let mut stream = env.jetstream().get_stream(&env.stream).await.unwrap();
    let original = stream.info().await.unwrap().config.clone();
    let elsewhere = format!("{}-elsewhere.>", env.prefix);
    let mut edited = original.clone();
    edited.subjects = vec![elsewhere.clone()];
    env.jetstream().update_stream(edited).await.unwrap();
    env.commit(&mut Order::place("o-2", "ada", 1)).await;
    let wanted = format!("no longer capture all of \"{}.>\"", env.prefix);
    wait_until(
        "the relay reports the stream's subjects",
        Duration::from_secs(10),
        || {
            let text = logs.text();
            std::future::ready((text.contains(&wanted) && text.contains(&elsewhere)).then_some(()))
        },
    )
    .await;
    let mut conn = env.conn().await;
    let waiting: (i32, bool) = outbox_events::table
        .filter(outbox_events::aggregate_id.eq("o-2"))
        .select((
            outbox_events::attempts,
            outbox_events::published_at.is_not_null(),
        ))
        .first(&mut conn)
        .await
        .unwrap();
    assert_eq!(waiting, (0, false), "no attempt counted, not published");
    assert_eq!(
        stream.info().await.unwrap().config.subjects,
        [elsewhere],
        "the relay changed the operator's stream"
    );

    env.jetstream().update_stream(original).await.unwrap();
    env.until_stream_holds(2, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_stops_answering_counts_no_attempt() {
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.published = PublishedRows::Mark;
    config.max_attempts = 1;
    config.max_backoff = Duration::from_millis(200);
    let mut relay = Relay::connect(config.clone(), env.nats.clone())
        .await
        .unwrap();
    // JetStream stops serving the stream (what a graceful server shutdown does first, for
    // the moment before it closes the connections): "no responders" to every publish.
    let info = delete_stream_and_commit(&env, 0..5).await;
    let report = relay.relay_batch().await.unwrap();
    assert_eq!(
        (report.published, report.rejected, report.transport_failures),
        (0, 0, 5),
        "{report:?}"
    );
    env.jetstream().create_stream(info).await.unwrap();
    while relay.relay_batch().await.unwrap().claimed > 0 {}

    let mut conn = env.conn().await;
    let rows: Vec<(i32, bool, bool)> = outbox_events::table
        .select((
            outbox_events::attempts,
            outbox_events::published_at.is_not_null(),
            outbox_events::dead_lettered_at.is_not_null(),
        ))
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(rows, vec![(0, true, false); 5], "no attempt, all published");
    assert_eq!(env.stream_len().await, 5);
}

/// A stream deleted under a running relay (an operator's slip, or a server back without its
/// store) is created again, as at start-up, and the events that waited for it are published
/// there, none lost and no attempt counted; with `create` off the relay says the stream is
/// missing, creates nothing, and the events wait until an operator creates it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_deleted_under_a_running_relay_is_created_again_or_reported_missing() {
    let (logs, _guard) = Logs::capture().await;
    for create in [true, false] {
        let env = TestEnv::new().await;
        let mut config = env.relay_config();
        config.published = PublishedRows::Mark;
        config.max_backoff = Duration::from_millis(300);
        config.topology.stream.create = create;
        if !create {
            // A relay that may create the stream makes it: one with `create` off refuses to
            // start without it.
            Relay::connect(env.relay_config(), env.nats.clone())
                .await
                .unwrap();
        }
        let relay = Relay::connect(config, env.nats.clone())
            .await
            .unwrap()
            .spawn();
        let mut first = Order::place("o-1", "ada", 1);
        env.commit(&mut first).await;
        env.until_stream_holds(1, Duration::from_secs(10)).await;
        let info = delete_stream_and_commit(&env, 2..5).await;
        if create {
            env.until_stream_holds(3, Duration::from_secs(20)).await;
        } else {
            // A few backoffs' worth: nothing is created, nothing published or attempted.
            tokio::time::sleep(Duration::from_secs(3)).await;
            let missing = env.jetstream().get_stream(&env.stream).await;
            assert!(
                missing.is_err(),
                "the relay created the stream with create off"
            );
            env.jetstream().create_stream(info).await.unwrap();
            env.until_stream_holds(3, Duration::from_secs(20)).await;
        }
        relay.shutdown().await.unwrap();

        // Three aggregates: no order between them.
        let mut subjects: Vec<String> = env
            .stream_messages()
            .await
            .into_iter()
            .map(|message| message.subject.to_string())
            .collect();
        subjects.sort();
        let wanted: Vec<String> = (2..5)
            .map(|n| format!("{}.Order.o-{n}.Placed", env.prefix))
            .collect();
        assert_eq!(subjects, wanted, "create {create}");
        let mut conn = env.conn().await;
        let rows: Vec<(i32, bool)> = outbox_events::table
            .select((
                outbox_events::attempts,
                outbox_events::published_at.is_not_null(),
            ))
            .load(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            rows,
            vec![(0, true); 4],
            "create {create}: no attempt, all published"
        );
    }
    let text = logs.text();
    assert!(
        text.contains("the relay created it again"),
        "the stream's return is logged"
    );
    assert!(
        text.contains("StreamSettings::create is off"),
        "and, with create off, that it is missing"
    );
}

/// With the `opentelemetry` feature on (as in every test here) and no OpenTelemetry layer,
/// no trace context is invented: rows and messages carry a `traceparent` only when the caller
/// set one.
#[tokio::test]
async fn without_a_layer_no_trace_context_is_invented() {
    let producer = TestEnv::new().await;
    let mut order = Order::place("o-1", "ada", 990);
    producer.commit(&mut order).await;
    support::consumer::relay_all(&producer).await;
    let messages = producer.stream_messages().await;
    assert_eq!(messages.len(), 1);
    assert!(messages[0].headers.get("traceparent").is_none());
}

/// A relay whose `run` future is dropped (a `tokio::select!` whose other branch won) stops
/// whole: its workers, its listener, its housekeeping and its gauges end with it, and none of
/// its connections stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_run_is_dropped_leaves_no_session_open() {
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.stats_interval = Duration::from_millis(100);
    let relay = Relay::connect(config, env.nats.clone()).await.unwrap();
    let run = relay.run(std::future::pending());
    assert!(
        tokio::time::timeout(Duration::from_millis(500), run)
            .await
            .is_err(),
        "it runs until its shutdown"
    );
    support::until_no_session_named(&env, "outbox-relay").await;
}

/// A relay that makes a row a dead letter at its first rejection and backs off at most
/// 200 ms after a transport failure: a refusal that counted an attempt shows at once, and
/// one that did not is retried several times a second. `ack_timeout` as the test needs it.
async fn dead_letter_at_first_rejection(
    env: &TestEnv,
    ack_timeout: Duration,
) -> outbox_runtime::RelayHandle {
    let mut config = env.relay_config();
    config.max_attempts = 1;
    config.max_backoff = Duration::from_millis(200);
    config.ack_timeout = ack_timeout;
    Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn()
}

/// A stream full by its own limits (`max_msgs`, `max_bytes` with the discard-new policy)
/// refuses every message until it has room: the relay backs off and retries without counting
/// attempts, so no row becomes a dead letter, and once the stream has room every event is
/// published, each aggregate in order. Before, each refusal counted an attempt: after
/// `max_attempts` (about 8.5 min with the defaults) every aggregate's head was a dead letter
/// blocking its aggregate, or with the Skip policy skipped, until an operator retried them.
#[tokio::test]
async fn a_full_stream_is_waited_for_without_counting_attempts() {
    use async_nats::jetstream::stream::{Config, DiscardPolicy};
    let env = TestEnv::new().await;
    let js = env.jetstream();
    let config = |max_messages| Config {
        name: env.stream.clone(),
        subjects: vec![format!("{}.>", env.prefix)],
        max_messages,
        discard: DiscardPolicy::New,
        ..Default::default()
    };
    js.create_stream(config(3)).await.unwrap();
    let relay = dead_letter_at_first_rejection(&env, env.relay_config().ack_timeout).await;
    for i in 0..4 {
        let mut order = Order::place(&format!("o-{i}"), "ada", i);
        order.record(OrderEvent::Shipped);
        env.commit(&mut order).await;
    }
    env.until_stream_holds(3, Duration::from_secs(10)).await;
    // Several rounds of refusals.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut conn = env.conn().await;
    let rows = rows(&mut conn, None).await;
    assert_eq!(rows.len(), 5, "8 events, 3 stored: {rows:?}");
    assert!(
        rows.iter().all(|row| *row == (0, None, false)),
        "refusals of a full stream counted attempts: {rows:?}"
    );
    assert_eq!(env.stream_len().await, 3);

    // Room again: everything flows, in order.
    js.update_stream(config(-1)).await.unwrap();
    let lifted = Instant::now();
    env.until_stream_holds(8, Duration::from_secs(10)).await;
    eprintln!(
        "the 5 waiting events were published {:?} after the limit was lifted",
        lifted.elapsed()
    );
    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), 8);
    let sequences = sequences(&messages);
    assert_eq!(sequences.len(), 4);
    assert!(
        sequences.values().all(|seqs| seqs == &[1, 2]),
        "{sequences:?}"
    );
    relay.shutdown().await.unwrap();
}

/// A stream that does not acknowledge publishes (`no_ack`) or refuses them all (`sealed`) is
/// refused when the relay connects, naming the stream and the setting. Before, a relay on a
/// `no_ack` stream waited out `ack_timeout` for every event, counted each as a rejection
/// though the stream had stored it, and after `max_attempts` made it a dead letter blocking
/// its aggregate; on a sealed stream every event became a dead letter.
#[tokio::test]
async fn a_stream_that_cannot_acknowledge_publishes_is_refused_at_connect() {
    use async_nats::jetstream::stream::Config;
    for (setting, says) in [
        ("no_ack", "does not acknowledge publishes (no_ack)"),
        ("sealed", "is sealed"),
    ] {
        let env = TestEnv::new().await;
        let js = env.jetstream();
        let mut config = Config {
            name: env.stream.clone(),
            subjects: vec![format!("{}.>", env.prefix)],
            no_ack: setting == "no_ack",
            ..Default::default()
        };
        js.create_stream(config.clone()).await.unwrap();
        if setting == "sealed" {
            // A stream is sealed by an update, not at its creation.
            config.sealed = true;
            js.update_stream(config).await.unwrap();
        }
        let mut relay_config = env.relay_config();
        relay_config.ack_timeout = Duration::from_secs(1);
        relay_config.max_attempts = 1;
        let error = match Relay::connect(relay_config, env.nats.clone()).await {
            Ok(relay) => {
                // What such a relay did: the event is in the stream, and its row a dead
                // letter.
                let relay = relay.spawn();
                let mut order = Order::place("o-1", "ada", 1);
                env.commit(&mut order).await;
                tokio::time::sleep(Duration::from_secs(3)).await;
                let mut conn = env.conn().await;
                let rows = rows(&mut conn, None).await;
                let stored = env.stream_len().await;
                let _ = relay.shutdown().await;
                panic!("{setting}: the relay connected; the stream holds {stored}, rows {rows:?}");
            }
            Err(error) => error.to_string(),
        };
        assert!(
            error.contains(&env.stream) && error.contains(says),
            "{setting}: {error}"
        );
    }
}

/// A stream sealed under a running relay refuses every publish for good ("invalid operation
/// on sealed stream", error code 10109): the rows wait in order, without counting attempts,
/// for the relay to be pointed at another stream, where each became a dead letter.
#[tokio::test]
async fn a_stream_sealed_under_a_running_relay_leaves_the_rows_waiting() {
    let env = TestEnv::new().await;
    let relay = dead_letter_at_first_rejection(&env, env.relay_config().ack_timeout).await;
    let mut config = support::stream_config(&env).await;
    config.sealed = true;
    env.jetstream().update_stream(config).await.unwrap();
    let mut order = Order::place("o-1", "ada", 1);
    order.record(OrderEvent::Shipped);
    env.commit(&mut order).await;
    // Several rounds of refusals.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut conn = env.conn().await;
    let rows = rows(&mut conn, None).await;
    assert_eq!(
        rows,
        vec![(0, None, false); 2],
        "the sealed stream's refusals counted attempts"
    );
    assert_eq!(env.stream_len().await, 0);
    relay.shutdown().await.unwrap();
}

/// A stream edited to `no_ack` under a running relay stores each publish and answers none:
/// the rows wait, without counting attempts, and once acks are back each is published once
/// (its republish a duplicate the stream acks), each aggregate in order. That holds also
/// for the publishes sent while `no_ack` was set whose ack timeout ends after it was lifted:
/// the stream then answers with acks on, but holds their messages. Before, every missing
/// ack was counted as a message the server dropped, so with `max_attempts` 1 each event the
/// stream held became a dead letter at once, blocking its aggregate.
#[tokio::test]
async fn a_stream_edited_to_no_ack_under_a_running_relay_leaves_the_rows_waiting() {
    // How long the stream keeps no_ack once it holds the heads: lifted while their acks
    // are awaited, or after several ack timeouts.
    for no_ack_for in [Duration::ZERO, Duration::from_secs(3)] {
        let env = TestEnv::new().await;
        let relay = dead_letter_at_first_rejection(&env, Duration::from_secs(1)).await;
        let mut stream = support::stream_config(&env).await;
        stream.no_ack = true;
        env.jetstream().update_stream(stream.clone()).await.unwrap();
        for i in 0..3 {
            let mut order = Order::place(&format!("o-{i}"), "ada", i);
            order.record(OrderEvent::Shipped);
            env.commit(&mut order).await;
        }
        env.until_stream_holds(3, Duration::from_secs(10)).await;
        tokio::time::sleep(no_ack_for).await;
        let mut conn = env.conn().await;
        let waiting = rows(&mut conn, None).await;
        assert_eq!(waiting.len(), 6, "{no_ack_for:?}: {waiting:?}");
        assert!(
            waiting.iter().all(|row| *row == (0, None, false)),
            "{no_ack_for:?}: missing acks of a no_ack stream counted attempts: {waiting:?}"
        );

        // Acks again: everything flows, once each, in order.
        stream.no_ack = false;
        env.jetstream().update_stream(stream).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = rows(&mut conn, None).await;
            if left.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{no_ack_for:?}: rows left after acks came back: {left:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let messages = env.stream_messages().await;
        assert_eq!(messages.len(), 6, "{no_ack_for:?}");
        let sequences = sequences(&messages);
        assert!(
            sequences.values().all(|seqs| seqs == &[1, 2]),
            "{no_ack_for:?}: {sequences:?}"
        );
        relay.shutdown().await.unwrap();
    }
}
