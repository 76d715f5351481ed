//! Starting and stopping against servers that misbehave: a database host that accepts and
//! never answers, one that freezes under a running relay, a database without the outbox
//! tables, a NATS server that requires credentials; and no secret in any error, `Debug` or
//! log line meanwhile.

mod support;

use std::time::{Duration, Instant};

use outbox_runtime::{
    Handler, Inbox, InboxConfig, InboxError, Metadata, Relay, RelayConfig, RelayError, UnitOfWork,
};
use support::domain::{Order, OrderEvent};
use support::{BlackHole, Logs, NatsServer, Proxy, TestEnv, wait_until};

/// Does nothing with the events it gets.
struct Nothing;

impl Handler for Nothing {
    type Event = OrderEvent;
    type Error = String;

    async fn handle(
        &self,
        _event: OrderEvent,
        _message: &Metadata,
        _uow: &mut UnitOfWork<'_>,
    ) -> Result<(), String> {
        Ok(())
    }
}

#[tokio::test]
async fn connecting_to_a_database_that_never_answers_fails_in_time_naming_the_host() {
    let hole = BlackHole::start().await;
    let env = TestEnv::new().await;
    let url = format!("postgres://app:s3cret-db@127.0.0.1:{}/orders", hole.port);
    let host = format!("postgres://app@127.0.0.1:{}/orders", hole.port);

    let mut config = env.relay_config();
    config.database_url = url.clone();
    config.connect_timeout = Duration::from_millis(500);
    let started = Instant::now();
    let error = Relay::connect(config, env.nats.clone())
        .await
        .err()
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(error, RelayError::Connect(_)), "{error:?}");
    let text = error.to_string();
    assert!(
        text.contains(&host) && text.contains("connect timeout"),
        "{text}"
    );
    assert!(!text.contains("s3cret") && !format!("{error:?}").contains("s3cret"));

    // The inbox, on the relay's stream.
    env.create_stream(Duration::from_secs(120)).await;
    let mut config = InboxConfig::new("hanging", &url);
    config.topology = env.topology();
    config.connect_timeout = Duration::from_millis(500);
    let started = Instant::now();
    let error = Inbox::connect(config, env.nats.clone(), Nothing)
        .await
        .err()
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(error, InboxError::Connect(_)), "{error:?}");
    let text = error.to_string();
    assert!(
        text.starts_with(&format!(
            "inbox: cannot connect to the database at {host}: "
        )),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");

    // The migrations, within their default connect timeout (10 s).
    let started = Instant::now();
    let error = outbox_runtime::run_migrations(&url).await.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    let text = error.to_string();
    assert!(text.contains(&host) && !text.contains("s3cret"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_database_freezes_drops_the_connection_and_stops_in_bounded_time() {
    let env = TestEnv::new().await;
    let proxy = Proxy::start(support::server_of(&env.database_url)).await;
    let mut config = env.relay_config();
    config.database_url = support::through(&env.database_url, proxy.port);
    config.statement_timeout = Duration::from_secs(1);
    config.connect_timeout = Duration::from_secs(1);
    config.ack_timeout = Duration::from_secs(1);
    config.max_backoff = Duration::from_millis(200);
    let bound = config.ack_timeout + config.statement_timeout * 2 + Duration::from_secs(2);
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut first = Order::place("o-1", "ada", 1);
    env.commit(&mut first).await;
    wait_until("the first event", Duration::from_secs(10), || async {
        (env.stream_len().await == 1).then_some(())
    })
    .await;

    proxy.freeze(true);
    let mut second = Order::place("o-2", "ada", 1);
    env.commit(&mut second).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = Instant::now();
    tokio::time::timeout(bound, relay.shutdown())
        .await
        .expect("shutdown within ack_timeout + 2 x statement_timeout")
        .unwrap();
    let stopped = started.elapsed();
    proxy.freeze(false);
    eprintln!("a relay whose database froze stopped in {stopped:?} (bound {bound:?})");

    // A new relay, straight to the database, publishes what the frozen one could not.
    let mut config = env.relay_config();
    config.statement_timeout = Duration::from_secs(5);
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    wait_until("the second event", Duration::from_secs(20), || async {
        (env.stream_len().await == 2).then_some(())
    })
    .await;
    relay.shutdown().await.unwrap();
    assert!(stopped < bound, "{stopped:?}");
}

#[tokio::test]
async fn the_relay_and_the_inbox_refuse_a_database_without_the_outbox_tables() {
    let env = TestEnv::unmigrated(&support::nats_url()).await;
    let error = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .err()
        .unwrap();
    assert!(
        matches!(error, RelayError::MissingMigrations(_)),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .contains("run the outbox migrations first"),
        "{error}"
    );

    env.create_stream(Duration::from_secs(120)).await;
    let mut config = InboxConfig::new("unmigrated", &env.database_url);
    config.topology = env.topology();
    let error = Inbox::connect(config, env.nats.clone(), Nothing)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(error, InboxError::MissingMigrations(_)),
        "{error:?}"
    );

    outbox_runtime::run_migrations(&env.database_url)
        .await
        .unwrap();
    Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .expect("migrated, the relay starts");
}

/// The outbox migrated into the schema `orders` (its URL naming it), and a relay, an inbox
/// and a unit of work given the database's URL without it: each names the schema that holds
/// the outbox tables and the URL option that names it, beside what a new outbox here needs;
/// before, each said only to run the migrations, which on that URL make a second, empty
/// outbox that the service's units of work never write to, and whose relay publishes
/// nothing. Two schemas are both named; the service's own diesel migrations on the
/// `search_path` hide neither; a schema the role may not use is not offered; a relay on the
/// right URL starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_whose_search_path_misses_the_outbox_names_the_schema_that_holds_it() {
    use diesel_async::SimpleAsyncConnection;
    use outbox_runtime::{MissingMigrations, TablesElsewhere, UnitOfWorkError};

    let env = TestEnv::unmigrated(&support::nats_url()).await;
    env.create_stream(Duration::from_secs(120)).await;
    // The service's own migrations, in `public`, diesel's table beside its tables.
    env.conn()
        .await
        .batch_execute(
            "CREATE SCHEMA orders; \
             CREATE TABLE __diesel_schema_migrations (version VARCHAR(50) PRIMARY KEY, \
                 run_on TIMESTAMP NOT NULL DEFAULT now()); \
             INSERT INTO __diesel_schema_migrations (version) VALUES ('20200101000000')",
        )
        .await
        .unwrap();
    let in_orders = format!("{}?options=-csearch_path%3Dorders", env.database_url);
    outbox_runtime::run_migrations(&in_orders).await.unwrap();

    let expected = |schemas: &[&str], hint: &str| {
        (
            Some(TablesElsewhere::Schemas {
                schemas: schemas.iter().map(|s| s.to_string()).collect(),
                search_path: "\"$user\", public".to_owned(),
            }),
            format!(
                "{} outbox tables outside the search_path (\"$user\", public): to use {hint}; \
                 to make a new one here, run the outbox migrations first \
                 (outbox_runtime::run_migrations(database_url), or outbox_runtime::MIGRATIONS \
                 with your own diesel migration harness)",
                match schemas {
                    [one] => format!("schema {one} holds"),
                    many => format!("schemas {} hold", many.join(", ")),
                }
            ),
        )
    };
    let check = |missing: &MissingMigrations,
                 (elsewhere, ends): &(Option<TablesElsewhere>, String)| {
        assert_eq!(&missing.elsewhere, elsewhere, "{missing}");
        assert!(!missing.pending.is_empty(), "{missing:?}");
        let text = missing.to_string();
        assert!(
            text.starts_with("the outbox tables are not migrated: migrations 20261121000001, ")
                && text.ends_with(ends.as_str()),
            "{text}"
        );
    };
    let one = expected(
        &["orders"],
        "that outbox, name it in the URL (`?options=-csearch_path%3Dorders`) or the role's \
         search_path, as the URL its migrations ran on did",
    );
    match Relay::connect(env.relay_config(), env.nats.clone()).await {
        Err(RelayError::MissingMigrations(missing)) => check(&missing, &one),
        other => panic!("{:?}", other.err()),
    }
    let mut config = InboxConfig::new("elsewhere", &env.database_url);
    config.topology = env.topology();
    match Inbox::connect(config, env.nats.clone(), Nothing).await {
        Err(InboxError::MissingMigrations(missing)) => check(&missing, &one),
        other => panic!("{:?}", other.err()),
    }
    // A unit of work of one order on `conn`, which must fail for want of migrations.
    let missing_on = async |mut conn: diesel_async::AsyncPgConnection| {
        let mut order = Order::place("o-1", "ada", 1);
        match env
            .outbox()
            .transaction(&mut conn, async |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
        {
            Err(UnitOfWorkError::MissingMigrations(missing)) => missing,
            other => panic!("{other:?}"),
        }
    };
    check(&missing_on(env.conn().await).await, &one);

    // A second outbox, in a schema whose name needs quoting; and one the role cannot use.
    let in_billing = format!("{}?options=-csearch_path%3D%22Billing%22", env.database_url);
    env.conn()
        .await
        .batch_execute("CREATE SCHEMA \"Billing\"")
        .await
        .unwrap();
    outbox_runtime::run_migrations(&in_billing).await.unwrap();
    let two = expected(
        &["Billing", "orders"],
        "one of them, name it in the URL (`?options=-csearch_path%3D<schema>`) or the role's \
         search_path, as the URL its migrations ran on did",
    );
    match Relay::connect(env.relay_config(), env.nats.clone()).await {
        Err(RelayError::MissingMigrations(missing)) => check(&missing, &two),
        other => panic!("{:?}", other.err()),
    }
    let role = format!("{}_elsewhere", env.prefix);
    env.conn()
        .await
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA orders TO {role}; \
             GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}"
        ))
        .await
        .unwrap();
    let as_role = outbox_runtime::database::establish_postgres(
        &support::roles::as_role(&env.database_url, &role),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    check(&missing_on(as_role).await, &one);

    let mut config = env.relay_config();
    config.database_url = in_orders;
    Relay::connect(config, env.nats.clone())
        .await
        .expect("on the URL that names its schema, the relay starts");
    env.conn()
        .await
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .unwrap();
}

/// A role whose `search_path` names no schema that exists (PostgreSQL's secure schema usage
/// pattern, `ALTER ROLE ... SET search_path = "$user"`, for a role without a schema of its
/// name): the migrations refuse at once, naming the search_path and the URL option that
/// names a schema, where diesel failed "no schema has been selected to create in"; with a
/// schema named in the URL they apply there, and the relay, given the same URL, starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_under_a_search_path_of_no_schema_say_how_to_name_one() {
    use diesel_async::SimpleAsyncConnection;

    let env = TestEnv::unmigrated(&support::nats_url()).await;
    let role = format!("{}_nowhere", env.prefix);
    env.conn()
        .await
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN PASSWORD 'pw'; \
             GRANT CREATE ON DATABASE \"{database}\" TO {role}; \
             ALTER ROLE {role} IN DATABASE \"{database}\" SET search_path = \"$user\"",
            database = env.database_url.rsplit('/').next().unwrap(),
        ))
        .await
        .unwrap();
    let url = support::roles::as_role(&env.database_url, &role);
    let error = outbox_runtime::run_migrations(&url).await.unwrap_err();
    assert!(
        matches!(error, outbox_runtime::MigrationError::NoSchema(_)),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "cannot run the outbox migrations: the search_path (\"$user\") names no schema that \
         exists in this database, so the outbox's tables have nowhere to go; name one that \
         exists in the URL (`?options=-csearch_path%3D<schema>`), as the relay's, the inbox's \
         and the service's URLs will, or in the role's search_path (`ALTER ROLE ... SET \
         search_path`)"
    );

    // The schema named in the URL, made by the role.
    let mut conn = outbox_runtime::database::establish_postgres(&url, Duration::from_secs(10))
        .await
        .unwrap();
    conn.batch_execute("CREATE SCHEMA orders").await.unwrap();
    let in_orders = format!("{url}?options=-csearch_path%3Dorders");
    let applied = outbox_runtime::run_migrations(&in_orders).await.unwrap();
    assert!(!applied.is_empty());
    let mut config = env.relay_config();
    config.database_url = in_orders;
    Relay::connect(config, env.nats.clone())
        .await
        .expect("migrated in the schema its URL names, the relay starts");
    drop(conn);
    env.conn()
        .await
        .batch_execute(&format!(
            "DROP SCHEMA orders CASCADE; DROP OWNED BY {role}; DROP ROLE {role}"
        ))
        .await
        .unwrap();
}

#[tokio::test]
async fn credentials_in_a_nats_url_work_and_no_secret_reaches_a_log_an_error_or_a_debug() {
    const SECRET: &str = "n4ts-s3cret";
    let server = NatsServer::start_with(&["--user", "relay", "--pass", SECRET]).await;
    let url = format!("nats://relay:{SECRET}@127.0.0.1:{}", server.port);

    // async-nats alone ignores the URL's credentials (and logs the URL at DEBUG).
    let plain = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(2))
        .connect(url.as_str())
        .await;
    assert!(plain.is_err(), "the server requires credentials");

    let (logs, _guard) = Logs::capture().await;
    let env = TestEnv::with_nats(&url).await;
    let relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut order = Order::place("o-1", "ada", 1);
    env.commit(&mut order).await;
    wait_until("the event", Duration::from_secs(10), || async {
        (env.stream_len().await == 1).then_some(())
    })
    .await;
    relay.shutdown().await.unwrap();

    let wrong = format!("nats://relay:wrong-{SECRET}@127.0.0.1:{}", server.port);
    let error = outbox_runtime::nats::connect(&wrong).await.unwrap_err();
    let db_url = env
        .database_url
        .replace("postgres@", &format!("postgres:{SECRET}@"));
    let shown = [
        error.to_string(),
        format!("{error:?}"),
        format!("{:?}", RelayConfig::new(&db_url)),
        format!("{:?}", InboxConfig::new("c", &db_url)),
        outbox_runtime::nats::redacted(&url),
    ];
    for text in shown {
        assert!(!text.contains(SECRET), "{text}");
    }
    assert!(error.to_string().contains("authorization"), "{error}");
    let logged = logs.text();
    assert!(
        logged.contains("connected successfully"),
        "async-nats logged its connect"
    );
    let leaks: Vec<&str> = logged
        .lines()
        .filter(|line| line.contains(SECRET))
        .collect();
    assert!(leaks.is_empty(), "a secret in the logs: {leaks:?}");
}

/// A JetStream API request the server drops (here: a user who may not publish to
/// `$JS.API.>`, which nats-server answers only with an asynchronous permissions error) fails
/// the relay's start after `ack_timeout`, and the error says that this is what bounded it.
#[tokio::test]
async fn a_stream_lookup_the_server_never_answers_names_the_ack_timeout_that_bounded_it() {
    let server = NatsServer::start_with_config(
        "authorization {\n  users = [\n    { user: relay, password: relay-pw, permissions: {\n      \
         publish: { allow: [\"_INBOX.>\", \"events.>\"] }\n      \
         subscribe: { allow: [\">\"] }\n    } }\n  ]\n}\n",
    )
    .await;
    let nats =
        outbox_runtime::nats::connect(&format!("nats://relay:relay-pw@127.0.0.1:{}", server.port))
            .await
            .unwrap();
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.ack_timeout = Duration::from_millis(300);
    let started = Instant::now();
    let error = Relay::connect(config, nats).await.err().unwrap();
    let waited = started.elapsed();
    assert!(matches!(error, RelayError::Stream(_)), "{error:?}");
    let text = error.to_string();
    assert!(
        text.contains("no answer within 300ms, the relay's ack_timeout"),
        "{text}"
    );
    assert!(waited < Duration::from_secs(5), "{waited:?}");
}

/// A nats-server started without JetStream (`nats-server` without `-js`, a newcomer's first
/// mistake) answers no request of JetStream's API: the relay and the inbox refuse to start
/// saying so and how to start one. async-nats's own words for it, "requested JetStream
/// resource does not exist", read as a missing stream.
#[tokio::test]
async fn a_nats_server_without_jetstream_is_named_as_such_by_the_relay_and_the_inbox() {
    use outbox_runtime::nats::NO_JETSTREAM;
    let server = NatsServer::start_without_jetstream().await;
    let nats = outbox_runtime::nats::connect(&server.url()).await.unwrap();
    let env = TestEnv::new().await;
    let error = Relay::connect(env.relay_config(), nats.clone())
        .await
        .err()
        .expect("a relay without JetStream is refused");
    assert!(matches!(error, RelayError::Stream(_)), "{error:?}");
    let text = error.to_string();
    assert!(
        text.contains(&format!("\"{}\"", env.stream)) && text.contains(NO_JETSTREAM),
        "{text}"
    );
    assert!(NO_JETSTREAM.contains("start nats-server with -js"));

    let mut config = InboxConfig::new("no-jetstream", &env.database_url);
    config.topology = env.topology();
    let error = Inbox::connect(config, nats, Nothing)
        .await
        .err()
        .expect("an inbox without JetStream is refused");
    let text = error.to_string();
    assert!(matches!(error, InboxError::Consumer { .. }), "{error:?}");
    assert!(
        text.contains("no-jetstream") && text.contains(NO_JETSTREAM),
        "{text}"
    );
}

/// A NATS URL where something accepts the connection and never speaks (a host that hangs,
/// a process that is not a NATS server): connecting fails after the connection timeout, and
/// says that the handshake did not come and what bounded the wait, not only "timed out".
#[tokio::test]
async fn a_nats_server_that_never_greets_fails_in_time_naming_the_bound() {
    use outbox_runtime::nats::CONNECT_TIMEOUT;
    let hole = BlackHole::start().await;
    let started = Instant::now();
    let error =
        outbox_runtime::nats::connect(&format!("nats://relay:s3cret@127.0.0.1:{}", hole.port))
            .await
            .expect_err("a server that never greets is refused");
    let waited = started.elapsed();
    assert!(
        waited >= CONNECT_TIMEOUT && waited < CONNECT_TIMEOUT + Duration::from_secs(5),
        "{waited:?}"
    );
    let text = error.to_string();
    assert!(
        text.contains(&format!("nats://127.0.0.1:{}", hole.port))
            && text
                .contains("no NATS handshake within 10s, the connection timeout of each attempt"),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");
}

/// An inbox that connects before any relay created its stream (a service started before its
/// producer) is refused saying that the producer's relay creates the stream, rather than with
/// JetStream's "stream not found (code 404, error code 10059)".
#[tokio::test]
async fn an_inbox_before_its_stream_exists_is_told_who_creates_it() {
    let env = TestEnv::new().await;
    let mut config = InboxConfig::new("early", &env.database_url);
    config.topology = env.topology();
    let error = Inbox::connect(config, env.nats.clone(), Nothing)
        .await
        .err()
        .expect("an inbox without its stream is refused");
    assert!(matches!(error, InboxError::Consumer { .. }), "{error:?}");
    let text = error.to_string();
    assert!(
        text.contains(&format!("{:?}", env.stream))
            && text.contains("the stream does not exist (yet): the producer's relay creates it"),
        "{text}"
    );
}

/// Each handler of an inbox holds a database connection, and its pool is sized for them:
/// a `max_concurrency` beyond what a database serves is refused at `connect`, naming it
/// (before: `usize::MAX` panicked with "capacity overflow" in the pool, a million allocated
/// room for as many connections).
#[tokio::test]
async fn an_inbox_asked_for_more_handlers_than_a_database_serves_is_refused_naming_it() {
    let env = TestEnv::new().await;
    support::consumer::relay_all(&env).await; // creates the stream
    let config = |max_concurrency| {
        let mut config = InboxConfig::new("many", &env.database_url);
        config.topology = env.topology();
        config.max_concurrency = max_concurrency;
        config
    };
    let most = outbox_runtime::inbox::MAX_CONCURRENCY;
    for refused in [most + 1, 1_000_000, usize::MAX] {
        let error = Inbox::connect(config(refused), env.nats.clone(), Nothing)
            .await
            .err()
            .unwrap_or_else(|| panic!("max_concurrency {refused} taken"));
        assert_eq!(
            error.to_string(),
            format!(
                "inbox configuration: max_concurrency {refused} is more than an inbox runs \
                 ({most}): each handler holds a database connection, its transaction open"
            )
        );
    }
    Inbox::connect(config(most), env.nats.clone(), Nothing)
        .await
        .unwrap();
}

#[tokio::test]
async fn an_empty_source_is_refused() {
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.source = String::new();
    let error = Relay::connect(config, env.nats.clone())
        .await
        .err()
        .unwrap();
    assert!(
        error
            .to_string()
            .contains("CloudEvents requires a non-empty source"),
        "{error}"
    );
}

#[tokio::test]
async fn a_created_stream_gets_the_settings_and_an_existing_one_that_differs_is_reported() {
    use outbox_runtime::publisher::StorageType;

    // Created by the relay: every setting is the stream's.
    let env = TestEnv::new().await;
    let mut config = env.relay_config();
    config.topology.stream.duplicate_window = Duration::from_secs(30);
    config.topology.stream.storage = StorageType::Memory;
    config.topology.stream.max_age = Duration::from_secs(3600);
    config.topology.stream.max_bytes = 1 << 20;
    let (logs, _guard) = Logs::capture().await;
    Relay::connect(config.clone(), env.nats.clone())
        .await
        .unwrap();
    let created = support::stream_config(&env).await;
    assert_eq!(
        (
            created.duplicate_window,
            created.storage,
            created.max_age,
            created.max_bytes,
            created.num_replicas
        ),
        (
            Duration::from_secs(30),
            StorageType::Memory,
            Duration::from_secs(3600),
            1 << 20,
            1
        )
    );
    assert!(config.topology.stream.differences(&created).is_empty());

    // An existing stream keeps its own values; each difference is logged, by name.
    let other = TestEnv::new().await;
    other.create_stream(Duration::from_secs(10)).await;
    let mut config = other.relay_config();
    // (Longer than the settings' duplicate window, 2 min: a shorter one is refused.)
    config.topology.stream.max_age = Duration::from_secs(3600);
    Relay::connect(config, other.nats.clone()).await.unwrap();
    let text = logs.text();
    let reports = |stream: &str| -> Vec<String> {
        text.lines()
            .filter(|line| line.contains(" WARN ") && line.contains("differs from the relay's"))
            .filter(|line| line.contains(&format!("stream={stream} ")))
            .map(str::to_owned)
            .collect()
    };
    let reported = reports(&other.stream);
    assert_eq!(reported.len(), 2, "{reported:?}");
    assert!(
        reported[0].contains("setting=\"duplicate_window\"")
            && reported[0].contains("stream_has=10s")
            && reported[0].contains("settings_say=120s"),
        "{}",
        reported[0]
    );
    assert!(
        reported[1].contains("setting=\"max_age\"") && reported[1].contains("settings_say=3600s"),
        "{}",
        reported[1]
    );
    assert!(
        reports(&env.stream).is_empty(),
        "no report for the created stream"
    );
}

/// A relay that would create its stream where another stream already captures some of its
/// subjects names that stream, what it captures and the ways out, where it said only
/// "subjects overlap with an existing stream" (JetStream's 10065: a subject is stored by one
/// stream of an account), which leaves a newcomer to find the other stream.
#[tokio::test]
async fn a_stream_whose_subjects_another_stream_captures_is_refused_naming_that_stream() {
    let env = TestEnv::new().await;
    // The other stream is `owner`'s by name, so that its cleanup deletes it.
    let owner = TestEnv::new().await;
    let captured = format!("{}.Order.>", env.prefix);
    env.jetstream()
        .create_stream(async_nats::jetstream::stream::Config {
            name: owner.stream.clone(),
            subjects: vec![captured.clone()],
            storage: async_nats::jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .unwrap();
    let refused = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .err()
        .expect("the stream cannot be created")
        .to_string();
    assert!(
        refused.contains(&format!(
            "JetStream stream \"{}\" cannot be created to capture \"{}.>\": the stream \"{}\" \
             captures [\"{captured}\"], which overlap it",
            env.stream, env.prefix, owner.stream
        )) && refused.contains(&format!("point the relay at \"{}\"", owner.stream))
            && refused.contains("or give this topology another prefix"),
        "{refused}"
    );
}

/// A relay whose broker takes smaller messages than units of work write by default (the
/// server's `max_payload`, or the stream's `max_msg_size`, under nats-server's default 1 MiB)
/// warns, naming the bound and the `Outbox::with_max_payload` that fits it: an event between
/// the two would commit, and the broker would refuse its message. At the defaults, nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_takes_smaller_messages_than_units_of_work_write_is_reported() {
    let (logs, _guard) = Logs::capture().await;
    let small_server = NatsServer::start_with_config("max_payload: 262144").await;
    let on_small_server = TestEnv::new().await;
    let client = async_nats::connect(small_server.url()).await.unwrap();
    let relay = Relay::connect(on_small_server.relay_config(), client)
        .await
        .unwrap()
        .spawn();
    relay.shutdown().await.unwrap();

    let small_stream = TestEnv::new().await;
    small_stream
        .jetstream()
        .create_stream(async_nats::jetstream::stream::Config {
            name: small_stream.stream.clone(),
            subjects: vec![format!("{}.>", small_stream.prefix)],
            duplicate_window: Duration::from_secs(120),
            max_message_size: 65_536,
            ..Default::default()
        })
        .await
        .unwrap();
    let relay = Relay::connect(small_stream.relay_config(), small_stream.nats.clone())
        .await
        .unwrap()
        .spawn();
    relay.shutdown().await.unwrap();

    let at_defaults = TestEnv::new().await;
    let relay = Relay::connect(at_defaults.relay_config(), at_defaults.nats.clone())
        .await
        .unwrap()
        .spawn();
    relay.shutdown().await.unwrap();

    let text = logs.text();
    let reports = |env: &TestEnv| -> Vec<String> {
        text.lines()
            .filter(|line| line.contains(" WARN ") && line.contains("bytes, under the 1 MiB"))
            .filter(|line| line.contains(&format!("stream={} ", env.stream)))
            .map(str::to_owned)
            .collect()
    };
    let server = reports(&on_small_server);
    assert_eq!(server.len(), 1, "{server:?}");
    assert!(
        server[0].contains("the NATS server's max_payload is 262144 bytes")
            && server[0].contains("Outbox::with_max_payload(245760)"),
        "{}",
        server[0]
    );
    let stream = reports(&small_stream);
    assert_eq!(stream.len(), 1, "{stream:?}");
    assert!(
        stream[0].contains("the stream's max_msg_size is 65536 bytes")
            && stream[0].contains("Outbox::with_max_payload(49152)"),
        "{}",
        stream[0]
    );
    assert!(reports(&at_defaults).is_empty(), "{text}");
}

/// TLS asked of a server without TLS (a CA file, `require_tls`, a `tls://` URL) fails saying
/// that the server answered in plain text and the ways out, where rustls's words were all of
/// it ("received corrupt message of type InvalidContentType").
#[tokio::test]
async fn tls_asked_of_a_server_without_tls_is_named_as_such() {
    let url = support::nats_url();
    let tls_url = url.replacen("nats://", "tls://", 1);
    for settings in [
        outbox_runtime::nats::NatsSettings {
            require_tls: true,
            ..outbox_runtime::nats::NatsSettings::new(&url)
        },
        outbox_runtime::nats::NatsSettings::new(&tls_url),
    ] {
        let error = settings.connect().await.unwrap_err().to_string();
        assert!(
            error.contains(
                "the server answered the TLS handshake in plain text: it runs without TLS"
            ),
            "{error}"
        );
    }
}

/// The warnings `Logs` captured that report a topology mismatch naming `own` and `other`.
fn mismatch_reports(logs: &support::Captured, own: &str, other: &str) -> Vec<String> {
    logs.text()
        .lines()
        .filter(|line| line.contains(" WARN ") && line.contains("topology mismatch"))
        .filter(|line| {
            line.contains(&format!("own_prefix={own} "))
                && line.contains(&format!("other_prefix={other} "))
        })
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn a_relay_and_units_of_work_with_different_prefixes_are_reported_by_whichever_starts_second()
{
    let (logs, _guard) = Logs::capture().await;

    // Units of work first, under the test's prefix; then a relay told another prefix.
    let env = TestEnv::new().await;
    let mut order = Order::place("o-1", "ada", 1);
    env.commit(&mut order).await;
    let other_prefix = format!("{}x", env.prefix);
    let mut config = env.relay_config();
    config.topology.subject_prefix = other_prefix.parse().unwrap();
    Relay::connect(config, env.nats.clone()).await.unwrap();
    let reported = mismatch_reports(&logs, &other_prefix, &env.prefix);
    assert_eq!(
        reported.len(),
        1,
        "the relay reports the outbox: {reported:?}"
    );
    assert!(reported[0].contains("other_role=outbox"), "{}", reported[0]);

    // A relay first, then units of work under another prefix: the first one reports it.
    let env = TestEnv::new().await;
    Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    let other_prefix = format!("{}y", env.prefix);
    let outbox = outbox_runtime::Outbox::with_topology(outbox_runtime::Topology {
        subject_prefix: other_prefix.parse().unwrap(),
        ..env.topology()
    });
    for id in ["o-1", "o-2"] {
        let mut order = Order::place(id, "ada", 1);
        outbox
            .transaction(&mut env.conn().await, async |uow| {
                uow.track(&mut order);
                Ok::<_, outbox_runtime::UnitOfWorkError>(())
            })
            .await
            .unwrap();
    }
    let reported = mismatch_reports(&logs, &other_prefix, &env.prefix);
    assert_eq!(
        reported.len(),
        1,
        "the first unit of work reports the relay, the next does not ask again: {reported:?}"
    );
    assert!(reported[0].contains("other_role=relay"), "{}", reported[0]);

    // The same topology on both sides: nothing to report.
    let env = TestEnv::new().await;
    env.commit(&mut Order::place("o-1", "ada", 1)).await;
    Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    env.commit(&mut Order::place("o-2", "ada", 1)).await;
    let text = logs.text();
    assert!(
        !text
            .lines()
            .any(|l| l.contains("topology mismatch") && l.contains(&format!("={} ", env.prefix))),
        "no report for one shared topology"
    );
}

#[tokio::test]
async fn a_consumer_whose_filter_lies_outside_its_topology_is_refused_naming_both() {
    let env = TestEnv::new().await;
    env.create_stream(Duration::from_secs(120)).await;
    let mut config = InboxConfig::new("astray", &env.database_url);
    config.topology = env.topology();
    config.filter_subjects = vec!["events.Order.>".to_owned()];
    let error = Inbox::connect(config, env.nats.clone(), Nothing)
        .await
        .err()
        .expect("a filter outside the prefix is refused");
    let text = error.to_string();
    assert!(matches!(error, InboxError::Config(_)), "{error:?}");
    assert!(
        text.contains("\"events.Order.>\"") && text.contains(&format!("\"{}\"", env.prefix)),
        "{text}"
    );
}

/// A durable consumer that exists with other filter subjects is refused at `connect`, naming
/// both and what each way out costs, rather than changed in place (nats-server 2.9 records a
/// new filter without applying it); once the operator deleted it, `connect` creates it anew.
#[tokio::test]
async fn a_consumer_that_exists_with_other_filters_is_refused_naming_both_and_the_ways_out() {
    let env = TestEnv::new().await;
    env.create_stream(Duration::from_secs(120)).await;
    let prefix = &env.prefix;
    let config = |filter: String| {
        let mut config = InboxConfig::new("refiltered", &env.database_url);
        config.topology = env.topology();
        config.filter_subjects = vec![filter];
        config
    };
    let (first, second) = (
        format!("{prefix}.Order.>"),
        format!("{prefix}.Order.*.Placed"),
    );
    let inbox: Inbox<Nothing> = Inbox::connect(config(first.clone()), env.nats.clone(), Nothing)
        .await
        .unwrap();
    drop(inbox);
    let error = Inbox::connect(config(second.clone()), env.nats.clone(), Nothing)
        .await
        .err()
        .expect("other filters are refused");
    assert!(matches!(error, InboxError::Consumer { .. }), "{error:?}");
    let text = error.to_string();
    for says in [
        format!("filter subjects [{first:?}], not [{second:?}]"),
        "delete it (`nats consumer rm`) once every instance with the old filters has stopped \
         (a running one creates it again with them)"
            .to_owned(),
        "any other event of an aggregate up to the position the consumer reached in it, of a \
         newly taken subject too, is dead-lettered as late"
            .to_owned(),
        "or choose another consumer name, which handles the whole stream as new".to_owned(),
    ] {
        assert!(text.contains(&says), "{says:?} in {text}");
    }
    support::delete_consumer(&env, "refiltered").await;
    let inbox: Inbox<Nothing> = Inbox::connect(config(second.clone()), env.nats.clone(), Nothing)
        .await
        .unwrap();
    let filter = &inbox.consumer().cached_info().config.filter_subject;
    assert_eq!(filter, &second);
}

/// A filter NATS would not take (an empty token, a wildcard inside a token, `>` before the
/// end, whitespace) is refused by `connect`, naming the filter and what is wrong with it,
/// rather than by JetStream's "consumer filter subject is not a valid subset of the interest
/// subjects" when the consumer is created.
#[tokio::test]
async fn a_consumer_whose_filter_is_not_a_subject_filter_is_refused_naming_its_fault() {
    let env = TestEnv::new().await;
    env.create_stream(Duration::from_secs(120)).await;
    let prefix = &env.prefix;
    for (filter, says) in [
        (
            format!("{prefix}.Order..Placed"),
            "token 3 (\"\"): it is empty",
        ),
        (
            format!("{prefix}.Order.>.Placed"),
            "token 3 is '>', which stands only as the last token",
        ),
        (
            format!("{prefix}.Order.o*.Placed"),
            "token 3 (\"o*\"): it contains the NATS wildcard '*'",
        ),
        (
            format!("{prefix}.Order.*.Placed "),
            "token 4 (\"Placed \"): it contains whitespace",
        ),
        (format!("{prefix}.Order."), "token 3 (\"\"): it is empty"),
    ] {
        let mut config = InboxConfig::new("malformed", &env.database_url);
        config.topology = env.topology();
        config.filter_subjects = vec![filter.clone()];
        assert!(
            matches!(config.validate(), Err(InboxError::Config(_))),
            "{filter:?} passed validate"
        );
        let error = Inbox::connect(config, env.nats.clone(), Nothing)
            .await
            .err()
            .expect("a malformed filter is refused");
        let text = error.to_string();
        assert!(
            matches!(error, InboxError::Config(_)),
            "{filter:?}: {error:?}"
        );
        assert!(
            text.contains(&format!("subject filter {filter:?} is not valid"))
                && text.contains(says),
            "{filter:?}: {text}"
        );
    }
}

/// The PostgreSQL entry points given another database's URL say which module serves it,
/// instead of the driver's "invalid connection string"; nothing is opened.
#[tokio::test]
async fn the_postgresql_migrations_given_a_mysql_or_sqlite_url_name_the_module_to_use() {
    let error = outbox_runtime::run_migrations("mysql://root:s3cret@127.0.0.1:3306/test")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("this is a MySQL URL: its outbox is outbox_runtime::mysql"),
        "{error}"
    );
    assert!(
        error.contains("mysql://root@127.0.0.1:3306/test") && !error.contains("s3cret"),
        "{error}"
    );
    let error = outbox_runtime::run_migrations("orders.db")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("this is a SQLite file: its outbox is outbox_runtime::sqlite"),
        "{error}"
    );
}

/// A database URL whose scheme names no database (a typo, `postgress://`; another program's,
/// `redis://`) is refused as such by the migrations, the relay and the inbox, where it was
/// taken for a SQLite file's path ("this is a SQLite file: its outbox is
/// outbox_runtime::sqlite"); the password in it is not shown.
#[tokio::test]
async fn a_database_url_of_no_known_scheme_is_refused_naming_its_scheme() {
    let env = TestEnv::new().await;
    for (url, scheme) in [
        ("postgress://app:s3cret@127.0.0.1/orders", "postgress"),
        ("redis://:s3cret@127.0.0.1:6379", "redis"),
    ] {
        let says = format!("a {scheme}:// URL names no database the outbox runs on");
        let migrations = outbox_runtime::run_migrations(url)
            .await
            .unwrap_err()
            .to_string();
        let relay = Relay::connect(RelayConfig::new(url), env.nats.clone())
            .await
            .err()
            .expect("the relay refuses the URL")
            .to_string();
        let inbox = Inbox::connect(InboxConfig::new("typo", url), env.nats.clone(), Nothing)
            .await
            .err()
            .expect("the inbox refuses the URL")
            .to_string();
        for error in [migrations, relay, inbox] {
            assert!(error.contains(&says), "{says:?} not said: {error}");
            assert!(!error.contains("s3cret"), "{error}");
        }
    }
}

/// An `application_name` in the URL names the relay's and the inbox's sessions in
/// `pg_stat_activity`, as an operator labels each service's sessions; without one they are
/// `outbox-relay` and `outbox-inbox` (libpq's `fallback_application_name`). Before, the
/// toolkit's names replaced the URL's, and every service's relay read `outbox-relay`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_and_the_inbox_keep_the_application_name_of_their_url() {
    let env = TestEnv::new().await;
    let named = |name: &str| format!("{}?application_name={name}", env.database_url);
    let mut relay_config = env.relay_config();
    relay_config.database_url = named("orders-relay");
    let relay = Relay::connect(relay_config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut inbox_config = InboxConfig::new("billing", named("orders-billing"));
    inbox_config.topology = env.topology();
    let inbox = Inbox::connect(inbox_config, env.nats.clone(), Nothing)
        .await
        .unwrap()
        .spawn();
    let mut conn = env.conn().await;
    for name in ["orders-relay", "orders-billing"] {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while sessions_with_tls(&mut conn, name).await.0 == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no session named {name}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for name in ["outbox-relay", "outbox-inbox"] {
        assert_eq!(sessions_with_tls(&mut conn, name).await.0, 0, "{name}");
    }
    relay.shutdown().await.unwrap();
    inbox.shutdown().await.unwrap();
}

/// The number of sessions named `application_name` on the database at the other end of
/// `conn`, and how many of them use TLS (`pg_stat_ssl`).
async fn sessions_with_tls(
    conn: &mut diesel_async::AsyncPgConnection,
    application_name: &str,
) -> (i64, i64) {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Counts {
        #[diesel(sql_type = diesel::sql_types::Int8)]
        sessions: i64,
        #[diesel(sql_type = diesel::sql_types::Int8)]
        with_tls: i64,
    }
    let counts: Counts = diesel::sql_query(
        "SELECT count(*) AS sessions, count(*) FILTER (WHERE s.ssl) AS with_tls \
         FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.datname = current_database() AND a.application_name = $1",
    )
    .bind::<diesel::sql_types::Text, _>(application_name)
    .get_result(conn)
    .await
    .unwrap();
    (counts.sessions, counts.with_tls)
}

/// A database that takes TLS sessions only (`hostssl`, as a managed PostgreSQL that forces
/// TLS does): the toolkit connected to it without TLS whatever the URL said, so neither the
/// migrations, nor the relay, nor the inbox, nor the `outbox` command could reach it
/// (`sslmode=require`: "no TLS implementation configured"). With `sslmode=require`,
/// `verify-ca` or `verify-full` they connect with TLS; `verify-full` refuses a certificate
/// that does not name the host or that another authority signed, `verify-ca` takes the
/// former; and the URL's password stays out of every error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_and_the_inbox_reach_a_database_that_requires_tls() {
    let certificates = support::postgres::TestCertificates::new();
    let server = support::postgres::PostgresServer::start_with_tls(&certificates).await;
    server.create_database("orders").await;
    let ca = certificates.path("ca.pem");
    let at = |host: &str, options: &str| {
        format!(
            "postgres://postgres:s3cret-pw@{host}:{}/orders?{options}",
            server.port
        )
    };
    let connect = |url: String| async move {
        outbox_runtime::database::establish_postgres(&url, Duration::from_secs(10)).await
    };

    // With sslmode=disable the server refuses the session, and the error says what asks for
    // TLS (before, it gave only the server's words, which name the server's file).
    let refused = connect(at("127.0.0.1", "sslmode=disable"))
        .await
        .err()
        .unwrap();
    assert!(
        refused.to_string().contains(
            "no encryption (the server takes this session only over TLS, and \
             sslmode=disable asks for none: sslmode=require, or verify-full with sslrootcert, \
             asks for it)"
        ),
        "{refused}"
    );
    // With prefer, or no sslmode (libpq's default, a URL that works for psql), the session
    // the server refused without TLS is opened with it, as libpq's prefer opens it; before,
    // it was refused.
    for options in ["", "sslmode=prefer"] {
        let mut conn = connect(at("127.0.0.1", options))
            .await
            .unwrap_or_else(|e| panic!("{options:?}: {e}"));
        let (sessions, with_tls) = sessions_with_tls(&mut conn, "").await;
        assert!(
            sessions >= 1 && with_tls == sessions,
            "{options:?}: {with_tls} of {sessions}"
        );
    }

    let verify_full = at(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={}", ca.display()),
    );
    let applied = outbox_runtime::run_migrations(&verify_full).await.unwrap();
    assert!(!applied.is_empty());
    for (url, why) in [
        (
            at("127.0.0.1", "sslmode=require"),
            "require: any certificate",
        ),
        (
            at(
                "127.0.0.1",
                &format!("sslmode=verify-ca&sslrootcert={}", ca.display()),
            ),
            "verify-ca: the authority's, whatever host it names",
        ),
        (
            at(
                "127.0.0.1",
                &format!("sslmode=require&sslrootcert={}", ca.display()),
            ),
            "require with sslrootcert: as verify-ca",
        ),
    ] {
        let mut conn = connect(url).await.unwrap_or_else(|e| panic!("{why}: {e}"));
        let (sessions, with_tls) = sessions_with_tls(&mut conn, "").await;
        assert!(
            sessions >= 1 && with_tls == sessions,
            "{why}: {with_tls} of {sessions}"
        );
    }
    for (url, says) in [
        (
            at(
                "127.0.0.1",
                &format!("sslmode=verify-full&sslrootcert={}", ca.display()),
            ),
            "certificate not valid for name",
        ),
        (
            at(
                "localhost",
                &format!(
                    "sslmode=verify-full&sslrootcert={}",
                    certificates.path("other-ca.pem").display()
                ),
            ),
            "UnknownIssuer",
        ),
        (
            at(
                "localhost",
                &format!(
                    "sslmode=verify-ca&sslrootcert={}",
                    certificates.path("other-ca.pem").display()
                ),
            ),
            "UnknownIssuer",
        ),
    ] {
        let error = connect(url.clone()).await.err().unwrap().to_string();
        assert!(
            error.contains(says) && (error.contains("127.0.0.1") || error.contains("localhost")),
            "{url}: {error}"
        );
        assert!(!error.contains("s3cret-pw"), "{error}");
    }

    relay_and_inbox_over_tls(&verify_full, "tls").await;
}

/// On the migrated database of `database_url` (over TLS): units of work on the service's own
/// connection, then a relay and an inbox `consumer` on theirs, every event relayed and
/// handled, each of their sessions TLS.
async fn relay_and_inbox_over_tls(database_url: &str, consumer: &str) {
    use support::consumer::{commit_round, orders};
    let env = TestEnv::new().await;
    let mut conn =
        outbox_runtime::database::establish_postgres(database_url, Duration::from_secs(10))
            .await
            .unwrap();
    let mut orders = orders(3);
    for round in 0..2 {
        commit_round(&env, &mut conn, &mut orders, round).await;
    }
    let mut relay_config = env.relay_config();
    relay_config.database_url = database_url.to_owned();
    let relay = Relay::connect(relay_config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    env.until_stream_holds(6, Duration::from_secs(30)).await;
    let mut inbox_config = InboxConfig::new(consumer, database_url);
    inbox_config.topology = env.topology();
    let inbox = Inbox::connect(inbox_config, env.nats.clone(), Nothing)
        .await
        .unwrap();
    let probe = inbox.clone();
    let inbox = inbox.spawn();
    support::consumer::wait_until_settled(&probe, "every message handled", Duration::from_secs(30))
        .await;
    for application in ["outbox-relay", "outbox-inbox"] {
        let (sessions, with_tls) = sessions_with_tls(&mut conn, application).await;
        assert!(
            sessions >= 1 && with_tls == sessions,
            "{application}: {with_tls} of {sessions} sessions use TLS"
        );
    }
    relay.shutdown().await.unwrap();
    inbox.shutdown().await.unwrap();
}

/// A database whose sessions must show a client certificate (`cert` authentication, as a
/// managed PostgreSQL with mutual TLS asks): the URL's `sslcert` and `sslkey` are sent, and
/// the relay publishes and the inbox applies on it. Before, tokio-postgres refused the URL
/// ("unknown option `sslcert`"), and nothing connected. Without a certificate, or with one
/// of another authority, the server refuses, and the error says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_and_the_inbox_reach_a_database_that_requires_a_client_certificate() {
    let certificates = support::postgres::TestCertificates::new();
    let server =
        support::postgres::PostgresServer::start_with_client_certificates(&certificates).await;
    server.create_database("orders").await;
    let file = |name: &str| certificates.path(name).display().to_string();
    let url = |client: Option<&str>| {
        let mut url = format!(
            "postgres://postgres@localhost:{}/orders?sslmode=verify-full&sslrootcert={}",
            server.port,
            file("ca.pem")
        );
        if let Some(client) = client {
            url += &format!(
                "&sslcert={}&sslkey={}",
                file(&format!("{client}.pem")),
                file(&format!("{client}.key"))
            );
        }
        url
    };
    let connect = |url: String| async move {
        outbox_runtime::database::establish_postgres(&url, Duration::from_secs(10)).await
    };
    for (client, says) in [
        (None, "connection requires a valid client certificate"),
        (
            Some("stranger"),
            "received fatal alert: UnknownCA (the server refused the TLS handshake, where the \
             client certificate sslcert",
        ),
    ] {
        let error = connect(url(client)).await.err().unwrap().to_string();
        assert!(error.contains(says), "{client:?}: {error}");
    }
    // Without sslmode: refused without TLS, then with TLS (as libpq's prefer), where no
    // certificate is sent; the error says both.
    let plain = format!("postgres://postgres@127.0.0.1:{}/orders", server.port);
    let error = connect(plain).await.err().unwrap().to_string();
    assert!(
        error.contains("connection requires a valid client certificate")
            && error.contains("(with TLS, after the server refused a session without: ")
            && error.contains("no encryption"),
        "{error}"
    );
    let with_certificate = url(Some("client"));
    let applied = outbox_runtime::run_migrations(&with_certificate)
        .await
        .unwrap();
    assert!(!applied.is_empty());

    relay_and_inbox_over_tls(&with_certificate, "mutual-tls").await;
}

/// A relay given a database that takes no writes (`default_transaction_read_only` on for it,
/// as on a hot standby, or a reader endpoint's URL given by mistake) stops at start naming the
/// database and why, and what to give it. Before, it said only "relay database error: cannot
/// execute SELECT in a read-only transaction", neither where nor what to do.
#[tokio::test]
async fn a_relay_given_a_read_only_database_names_it_and_asks_for_the_primary() {
    let env = TestEnv::new().await;
    support::set_database_default(&env, "default_transaction_read_only", "on").await;
    let error = match Relay::connect(env.relay_config(), env.nats.clone()).await {
        Ok(_) => panic!("a relay started on a read-only database"),
        Err(error) => error.to_string(),
    };
    let target = outbox_runtime::database::redacted(&env.database_url);
    assert!(
        error.starts_with(&format!(
            "relay: cannot connect to the database at {target}: registering the relay's \
             topology: cannot execute"
        )) && error.contains(
            "read-only transaction: the database takes no writes (a hot standby, or \
             default_transaction_read_only on for the database or the role), and the relay \
             writes the outbox's tables; give it the primary's URL"
        ),
        "{error}"
    );
}

/// An inbox given a database that takes no writes (as on a hot standby, or a replica's URL
/// given where the primary's belongs) stops at start naming the database and why, and what
/// to give it. Before, it started, and every message failed with "cannot execute INSERT in a
/// read-only transaction" and came again, unhandled, for as long as the inbox ran.
#[tokio::test]
async fn an_inbox_given_a_read_only_database_names_it_and_asks_for_the_primary() {
    let env = TestEnv::new().await;
    // The stream, as a producer's relay leaves it; then the database takes no more writes.
    drop(
        Relay::connect(env.relay_config(), env.nats.clone())
            .await
            .unwrap(),
    );
    support::set_database_default(&env, "default_transaction_read_only", "on").await;
    let mut config = InboxConfig::new("read-only", &env.database_url);
    config.topology = env.topology();
    let error = match Inbox::connect(config, env.nats.clone(), Nothing).await {
        Ok(_) => panic!("an inbox started on a read-only database"),
        Err(error) => error.to_string(),
    };
    let target = outbox_runtime::database::redacted(&env.database_url);
    assert!(
        error.starts_with(&format!(
            "inbox: cannot connect to the database at {target}: checking that the inbox can \
             write its tables: cannot execute UPDATE in a read-only transaction: the database \
             takes no writes (a hot standby, or default_transaction_read_only on for the \
             database or the role), and the inbox writes the outbox's tables; give it the \
             primary's URL"
        )),
        "{error}"
    );
}
