//! The outbox's contract, one set of test bodies run against every backend this build has:
//! diesel-async's `AsyncPgConnection`; sync diesel's `PgConnection` with the feature
//! `postgres-sync` (libpq needed); MariaDB / MySQL through diesel-async's
//! `AsyncMysqlConnection` with the feature `mysql` (`OUTBOX_TEST_MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`, is the server to create databases on), and through
//! sync diesel's `MysqlConnection` with `mysql-sync` (libmysqlclient needed); SQLite through
//! diesel's `SqliteConnection`, sync and behind diesel-async's `SyncConnectionWrapper`, with
//! the feature `sqlite` (a database file per test in the temporary directory). All of them:
//! `cargo test --features postgres-sync,mysql-sync,sqlite --test contract`.
//!
//! A rollback leaves nothing, and a transaction ended inside the closure writes no event; a
//! connection lost during COMMIT is reported as an unknown outcome (not on SQLite), and a
//! relay whose sessions are killed mid-batch publishes each event once, in order (and on
//! MariaDB, a server of the test's own crashed under writers and the relay loses nothing);
//! committed units of work become exactly the expected messages;
//! sequences stay contiguous under concurrent units of work and continue after rows
//! inserted by hand; a unit of work of thousands of events is written whole; a row written
//! by plain SQL is relayed, and one the relay could not read is refused; three relays racing
//! keep each aggregate in order; a relay that dies before its delete is followed without
//! duplicates; a rejected message is dead-lettered while the others flow; dedup keys hold
//! across backends that share a table; a unit of work dropped part-way on a connection from
//! `Pooled::get` leaves nothing locked (async backends). The operator's functions (dead
//! letters, purges, the archive) and the inbox (each event applied once and in order by two
//! instances and after a second delivery of every message; a failing handler's event
//! dead-lettered while its aggregate moves on; a handler that ends the transaction never
//! acked as handled; an event after a gap in the stream applied and the gap recorded;
//! retention) run on each database.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

#[cfg(feature = "postgres-sync")]
use diesel::Connection as _;
use diesel_async::SimpleAsyncConnection;
use outbox_runtime::database::OperatorConnection;
use outbox_runtime::dead_letter::{self, DeadLetter};
use outbox_runtime::outbox::{QueuedByType, schema::outbox_events};
use outbox_runtime::{
    DomainEvent, Handler, Inbox, InboxConfig, InboxConnection, Metadata, OutboxStats, Relay,
    RelayConfig, RelayHandle, UnitOfWork, UnitOfWorkError, inbox,
};
use serde::{Deserialize, Serialize};
use support::domain::{Order, OrderEvent};
use support::{TestEnv, server_of, through};

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
struct Invoiced {
    #[event(dedup_key)]
    request: String,
}

/// A test's environment: its stream and prefix (and a PostgreSQL database) from the test
/// kit, and its own MySQL database for the MySQL backend.
struct Env {
    env: TestEnv,
    #[cfg(feature = "mysql")]
    mysql: Option<mysql::Database>,
    #[cfg(feature = "sqlite")]
    sqlite: Option<sqlite::Database>,
    /// Whether [`Env::outbox`]'s units of work ask for their transaction's id.
    transaction_ids: bool,
    /// [`Env::outbox`]'s payload bound (`Outbox::with_max_payload`).
    max_payload: usize,
}

impl Env {
    /// The test kit's outbox, reporting transaction ids when `transaction_ids` says so, and
    /// bounding payloads at `max_payload`.
    fn outbox(&self) -> outbox_runtime::Outbox {
        self.env
            .outbox()
            .report_transaction_ids(self.transaction_ids)
            .with_max_payload(self.max_payload)
    }
}

impl std::ops::Deref for Env {
    type Target = TestEnv;

    fn deref(&self) -> &TestEnv {
        &self.env
    }
}

/// One way to run units of work, and to read and relay what they wrote. The defaults are
/// PostgreSQL's.
trait Backend {
    /// Whether a unit of work reports its transaction's id when the outbox asks
    /// (`Outbox::report_transaction_ids`): on PostgreSQL.
    const TRANSACTION_IDS: bool = false;

    /// What became of transaction `id`, asked on a new connection the way this backend's
    /// service would ask (`transaction_status`; sync diesel's `sync::transaction_status`).
    fn transaction_status(
        env: &Env,
        id: outbox_runtime::TransactionId,
    ) -> impl Future<Output = outbox_runtime::TransactionStatus> + Send {
        async move {
            outbox_runtime::transaction_status(&mut env.conn().await, id)
                .await
                .unwrap()
        }
    }

    /// A fresh environment with an `orders` table.
    fn setup() -> impl Future<Output = Env> + Send {
        async {
            let env = TestEnv::new().await;
            env.conn()
                .await
                .batch_execute("CREATE TABLE orders (id text)")
                .await
                .unwrap();
            Env {
                env,
                #[cfg(feature = "mysql")]
                mysql: None,
                #[cfg(feature = "sqlite")]
                sqlite: None,
                transaction_ids: false,
                max_payload: outbox_runtime::DEFAULT_MAX_PAYLOAD_BYTES,
            }
        }
    }

    /// Commits, in one unit of work, the events of `orders` (tracked), a business row per
    /// order, and one `Invoiced` with `dedup_key` when given; the closure ends as `end`
    /// says. Returns the orders as the unit of work left them.
    fn commit(
        env: &Env,
        orders: Vec<Order>,
        dedup_key: Option<String>,
        end: End,
    ) -> impl Future<Output = (Vec<Order>, Result<(), UnitOfWorkError>)> + Send;

    /// `(aggregate_id, aggregate_seq)` of every outbox row of `Order`s, in that order.
    fn rows(env: &Env) -> impl Future<Output = Vec<(String, i64)>> + Send {
        async {
            use diesel::prelude::*;
            use diesel_async::RunQueryDsl;
            outbox_events::table
                .filter(outbox_events::aggregate_type.eq("Order"))
                .select((outbox_events::aggregate_id, outbox_events::aggregate_seq))
                .order((outbox_events::aggregate_id, outbox_events::aggregate_seq))
                .load(&mut env.conn().await)
                .await
                .unwrap()
        }
    }

    /// What waits in the outbox, as the relay's gauges read it.
    fn stats(env: &Env) -> impl Future<Output = OutboxStats> + Send {
        async {
            outbox_runtime::outbox::stats(&mut env.conn().await)
                .await
                .unwrap()
        }
    }

    /// How many rows `orders` holds.
    fn business_rows(env: &Env) -> impl Future<Output = i64> + Send {
        async {
            use diesel_async::RunQueryDsl;
            diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM orders")
                .get_result(&mut env.conn().await)
                .await
                .unwrap()
        }
    }

    /// Runs `statement` (plain SQL, `{prefix}` replaced by the environment's prefix).
    fn execute(env: &Env, statement: &str) -> impl Future<Output = ()> + Send {
        let statement = statement.replace("{prefix}", &env.prefix);
        async move {
            env.conn().await.batch_execute(&statement).await.unwrap();
        }
    }

    /// Runs `statement` as [`execute`](Self::execute) does, and returns the database's error.
    fn try_execute(env: &Env, statement: &str) -> impl Future<Output = Result<(), String>> + Send {
        let statement = statement.replace("{prefix}", &env.prefix);
        async move {
            env.conn()
                .await
                .batch_execute(&statement)
                .await
                .map_err(|e| e.to_string())
        }
    }

    /// `(aggregate_id, aggregate_seq, attempts)` of every dead letter.
    fn dead_letters(env: &Env) -> impl Future<Output = Vec<(String, i64, i32)>> + Send {
        async {
            use diesel::prelude::*;
            use diesel_async::RunQueryDsl;
            outbox_events::table
                .filter(outbox_events::dead_lettered_at.is_not_null())
                .select((
                    outbox_events::aggregate_id,
                    outbox_events::aggregate_seq,
                    outbox_events::attempts,
                ))
                .order(outbox_events::aggregate_id)
                .load(&mut env.conn().await)
                .await
                .unwrap()
        }
    }

    /// A relay configuration for the environment's database, prefix and stream.
    fn relay_config(env: &Env) -> RelayConfig {
        env.relay_config()
    }

    /// Relays until a batch claims nothing.
    fn relay_all(env: &Env) -> impl Future<Output = ()> + Send {
        async {
            let mut relay = Relay::connect(Self::relay_config(env), env.nats.clone())
                .await
                .unwrap();
            while relay.relay_batch().await.unwrap().claimed > 0 {}
        }
    }

    /// One batch of a fresh relay: how many rows it claimed, or its error.
    fn relay_once(env: &Env) -> impl Future<Output = Result<usize, String>> + Send {
        async {
            let mut relay = Relay::connect(Self::relay_config(env), env.nats.clone())
                .await
                .unwrap();
            relay
                .relay_batch()
                .await
                .map(|report| report.claimed)
                .map_err(|e| e.to_string())
        }
    }

    /// SQL that makes every delete from `outbox_events` fail, and SQL that undoes it.
    const BLOCK_DELETES: [&str; 2] = [
        "CREATE FUNCTION outbox_test_no_delete() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'deletes blocked by the test'; END $$; \
         CREATE TRIGGER outbox_test_no_delete BEFORE DELETE ON outbox_events \
             FOR EACH ROW EXECUTE FUNCTION outbox_test_no_delete()",
        "DROP TRIGGER outbox_test_no_delete ON outbox_events",
    ];

    /// What a relay that died leaves for the next one to wait out (SQLite's lease): made to
    /// run out now.
    fn relay_died(_env: &Env) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// The address the environment's database server listens on.
    fn server(env: &Env) -> std::net::SocketAddr {
        server_of(&env.database_url)
    }

    /// Points the connections the environment opens from now on at port `port` on loopback
    /// (a [`support::Proxy`] to [`server`](Self::server)).
    fn connect_through(env: &mut Env, port: u16) {
        env.env.database_url = through(&env.database_url, port);
    }

    /// Kills every session of the environment's database but its own; returns how many.
    fn kill_other_sessions(env: &Env) -> impl Future<Output = usize> + Send {
        async {
            use diesel_async::RunQueryDsl;
            diesel::dsl::sql::<diesel::sql_types::BigInt>(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .get_result::<i64>(&mut env.conn().await)
            .await
            .unwrap() as usize
        }
    }

    /// Starts a relay with `config`.
    fn spawn_relay(env: &Env, config: RelayConfig) -> impl Future<Output = RelayHandle> + Send {
        async move {
            Relay::connect(config, env.nats.clone())
                .await
                .unwrap()
                .spawn()
        }
    }
}

struct AsyncPg;

impl Backend for AsyncPg {
    const TRANSACTION_IDS: bool = true;

    async fn commit(
        env: &Env,
        mut orders: Vec<Order>,
        dedup_key: Option<String>,
        end: End,
    ) -> (Vec<Order>, Result<(), UnitOfWorkError>) {
        use diesel_async::RunQueryDsl;
        let mut conn = env.conn().await;
        let result = env
            .outbox()
            .transaction(&mut conn, async |uow| {
                for order in &mut orders {
                    diesel::sql_query("INSERT INTO orders VALUES ($1)")
                        .bind::<diesel::sql_types::Text, _>(&order.id)
                        .execute(uow.conn())
                        .await?;
                    uow.track(order);
                }
                if let Some(request) = dedup_key {
                    uow.emit("Invoice", "i-1", &Invoiced { request });
                }
                match end {
                    End::Fail => return Err(diesel::result::Error::RollbackTransaction.into()),
                    End::Send(statement) => uow.conn().batch_execute(statement).await?,
                    End::Ok => {}
                }
                Ok(())
            })
            .await;
        (orders, result)
    }
}

#[cfg(feature = "postgres-sync")]
struct SyncPg;

#[cfg(feature = "postgres-sync")]
impl Backend for SyncPg {
    const TRANSACTION_IDS: bool = true;

    async fn transaction_status(
        env: &Env,
        id: outbox_runtime::TransactionId,
    ) -> outbox_runtime::TransactionStatus {
        let url = env.database_url.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = diesel::PgConnection::establish(&url).expect("a sync connection");
            outbox_runtime::sync::transaction_status(&mut conn, id).unwrap()
        })
        .await
        .unwrap()
    }

    async fn commit(
        env: &Env,
        mut orders: Vec<Order>,
        dedup_key: Option<String>,
        end: End,
    ) -> (Vec<Order>, Result<(), UnitOfWorkError>) {
        let (url, outbox) = (env.database_url.clone(), env.outbox());
        tokio::task::spawn_blocking(move || {
            use diesel::RunQueryDsl;
            let mut conn = diesel::PgConnection::establish(&url).expect("a sync connection");
            let result = outbox.sync_transaction(&mut conn, |uow| {
                for order in &mut orders {
                    diesel::sql_query("INSERT INTO orders VALUES ($1)")
                        .bind::<diesel::sql_types::Text, _>(&order.id)
                        .execute(uow.conn())?;
                    uow.track(order);
                }
                if let Some(request) = dedup_key {
                    uow.emit("Invoice", "i-1", &Invoiced { request });
                }
                match end {
                    End::Fail => return Err(diesel::result::Error::RollbackTransaction.into()),
                    End::Send(statement) => {
                        diesel::connection::SimpleConnection::batch_execute(uow.conn(), statement)?
                    }
                    End::Ok => {}
                }
                Ok(())
            });
            (orders, result)
        })
        .await
        .expect("the sync unit of work ran")
    }
}

/// How a test unit of work's closure ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// It returns `Ok`: the unit of work commits.
    Ok,
    /// It returns an error: the unit of work rolls back.
    Fail,
    /// It sends this statement (a COMMIT or a ROLLBACK) on the unit of work's connection
    /// by hand, then returns `Ok`.
    Send(&'static str),
}

fn shipped(id: &str) -> Order {
    let mut order = Order::place(id, "ada", 990);
    order.record(OrderEvent::Shipped);
    order
}

/// A connection lost while the unit of work's COMMIT is in flight: the client cannot know
/// whether the server committed, and the unit of work says so
/// ([`UnitOfWorkError::CommitOutcomeUnknown`]) instead of a plain database error, which
/// promises a rollback. Once where the server ran the COMMIT (the business row and the events
/// are written, and will be published) and once where it never received it (nothing is
/// written); each with the events' INSERT sent with the COMMIT (no dedup key, on PostgreSQL)
/// and written before it (a dedup key). The aggregate keeps its events either way. With
/// `report_transaction_ids` the error carries the transaction's id on PostgreSQL (async and
/// sync; MySQL has none), and `transaction_status`, asked on a new connection, answers
/// committed or aborted as the server did.
async fn a_connection_lost_during_commit_reports_the_outcome_unknown<B: Backend>() {
    use outbox_runtime::TransactionStatus;
    use support::{Proxy, Severed};
    for cut in [Severed::AfterForwarding, Severed::BeforeForwarding] {
        for dedup_key in [None, Some("r-1".to_owned())] {
            for transaction_ids in [false, true] {
                let case = format!("{cut:?}, dedup key {dedup_key:?}, ids {transaction_ids}");
                let mut env = B::setup().await;
                env.transaction_ids = transaction_ids;
                let proxy = Proxy::start(B::server(&env)).await;
                B::connect_through(&mut env, proxy.port);
                proxy.cut_at(b"COMMIT", cut);
                let (orders, result) =
                    B::commit(&env, vec![shipped("o-1")], dedup_key.clone(), End::Ok).await;
                let transaction = match &result {
                    Err(UnitOfWorkError::CommitOutcomeUnknown { transaction, .. }) => *transaction,
                    other => panic!("{case}: {other:?}"),
                };
                assert_eq!(
                    transaction.is_some(),
                    transaction_ids && B::TRANSACTION_IDS,
                    "{case}: {transaction:?}"
                );
                assert_eq!(orders[0].pending_events().len(), 2, "{case}");
                let committed = matches!(cut, Severed::AfterForwarding);
                if let Some(id) = transaction {
                    let message = result.unwrap_err().to_string();
                    assert!(
                        message.contains(&format!("transaction_status` for transaction {id}")),
                        "{case}: {message}"
                    );
                    // In progress until the server has seen its connection go.
                    let status = support::wait_until(&case, Duration::from_secs(10), || async {
                        let status = B::transaction_status(&env, id).await;
                        (status != TransactionStatus::InProgress).then_some(status)
                    })
                    .await;
                    let expected = if committed {
                        TransactionStatus::Committed
                    } else {
                        TransactionStatus::Aborted
                    };
                    assert_eq!(status, expected, "{case}");
                }
                if committed {
                    // The server completes the COMMIT on its own, after the client heard the end
                    // of its connection.
                    support::wait_until(&case, Duration::from_secs(10), || async {
                        (B::business_rows(&env).await == 1).then_some(())
                    })
                    .await;
                } else {
                    assert_eq!(B::business_rows(&env).await, 0, "{case}");
                }
                let rows = if committed {
                    vec![("o-1".to_owned(), 1), ("o-1".to_owned(), 2)]
                } else {
                    Vec::new()
                };
                assert_eq!(B::rows(&env).await, rows, "{case}");
            }
        }
    }
}

/// A relay whose database sessions are killed again and again, mid-batch (between its
/// claim, its publishes, its delete and its COMMIT): each kill rolls its batch back, the
/// relay reconnects with backoff, and the rows are claimed and published again, the copies
/// dropped by JetStream's duplicate window. Every event is in the stream once, each
/// aggregate's in order, and the queue ends empty.
async fn a_relay_whose_sessions_are_killed_publishes_each_event_once_in_order<B: Backend>() {
    const AGGREGATES: usize = 8;
    const ROUNDS: usize = 12;
    let env = B::setup().await;
    for _ in 0..ROUNDS {
        let orders = (0..AGGREGATES)
            .map(|n| shipped(&format!("o-{n}")))
            .collect();
        B::commit(&env, orders, None, End::Ok).await.1.unwrap();
    }
    let expected = AGGREGATES * ROUNDS * 2;
    let mut config = B::relay_config(&env);
    config.workers = 2;
    config.batch_size = 5;
    config.max_backoff = Duration::from_millis(100);
    let relay = B::spawn_relay(&env, config).await;
    let mut killed = 0;
    let started = std::time::Instant::now();
    let deadline = started + Duration::from_secs(60);
    while !(env.stream_len().await as usize == expected && B::rows(&env).await.is_empty()) {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {expected} events in the stream, {} rows queued after 60 s",
            env.stream_len().await,
            B::rows(&env).await.len()
        );
        killed += B::kill_other_sessions(&env).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    relay.shutdown().await.unwrap();
    assert!(killed >= 3, "{killed} sessions killed");
    support::assert_each_once_in_order(
        &env.stream_messages().await,
        AGGREGATES,
        (ROUNDS * 2) as u64,
    );
    println!(
        "{killed} sessions killed while the relay published {expected} events in {:.1?}",
        started.elapsed()
    );
}

/// A test body, once per backend listed: `$test::$module`.
macro_rules! on_backends {
    ($test:ident: $($(#[$cfg:meta])* $module:ident => $backend:ty),* $(,)?) => {
        mod $test {
            use super::*;
            $(
                $(#[$cfg])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $module() {
                    super::$test::<$backend>().await;
                }
            )*
        }
    };
}

// Where a connection can be lost: not SQLite's, in the process.
on_backends!(a_connection_lost_during_commit_reports_the_outcome_unknown:
    async_pg => AsyncPg,
    #[cfg(feature = "postgres-sync")]
    sync_pg => SyncPg,
    #[cfg(feature = "mysql")]
    async_mysql => mysql::AsyncMysql,
    #[cfg(feature = "mysql-sync")]
    sync_mysql => mysql::SyncMysql,
);
// The relay is one for the async and the sync backends.
on_backends!(a_relay_whose_sessions_are_killed_publishes_each_event_once_in_order:
    async_pg => AsyncPg,
    #[cfg(feature = "mysql")]
    async_mysql => mysql::AsyncMysql,
);

async fn a_rollback_leaves_nothing<B: Backend>() {
    let env = B::setup().await;
    let (orders, result) =
        B::commit(&env, vec![shipped("o-1")], Some("r-1".into()), End::Fail).await;
    assert!(result.is_err());
    assert!(B::rows(&env).await.is_empty(), "no outbox row");
    assert_eq!(B::business_rows(&env).await, 0, "no business row");
    assert_eq!(
        orders[0].pending_events().len(),
        2,
        "the events stay pending"
    );
    // Nor did it take its dedup key.
    let (_, again) = B::commit(&env, vec![], Some("r-1".into()), End::Ok).await;
    again.unwrap();
}

/// An event whose payload is over the outbox's bound fails its unit of work at commit,
/// naming the event, its length and the bound, and nothing is written: the broker would
/// refuse its message (nats-server holds headers and payload to its `max_payload`, 1 MiB by
/// default), which the relay retried for minutes and then dead-lettered, the aggregate's later
/// events waiting behind it. At the bound, the event is written.
async fn a_payload_over_the_outbox_bound_is_refused_at_commit<B: Backend>() {
    let mut env = B::setup().await;
    let big = Order::place("o-big", &"x".repeat(2 * 1024 * 1024), 990);
    let (orders, result) = B::commit(&env, vec![big], None, End::Ok).await;
    let error = result.unwrap_err();
    assert!(
        matches!(
            error,
            UnitOfWorkError::PayloadTooLarge {
                len: 2_097_185,
                max: 1_032_192,
                ..
            }
        ),
        "{error:?}"
    );
    assert!(
        error.to_string().starts_with(
            "the payload of Order \"o-big\" (event Placed) is 2097185 bytes long, over the \
             limit of 1032192 bytes this outbox writes"
        ),
        "{error}"
    );
    assert!(B::rows(&env).await.is_empty(), "no outbox row");
    assert_eq!(B::business_rows(&env).await, 0, "no business row");
    assert_eq!(
        orders[0].pending_events().len(),
        1,
        "the event stays pending"
    );

    let placed = shipped("o-1").pending_events()[0].to_payload().unwrap();
    env.max_payload = placed.len() - 1;
    let (_, result) = B::commit(&env, vec![shipped("o-1")], None, End::Ok).await;
    assert!(
        matches!(result, Err(UnitOfWorkError::PayloadTooLarge { len, max, .. })
            if len == placed.len() && max == placed.len() - 1),
        "{result:?}"
    );
    assert!(B::rows(&env).await.is_empty(), "no outbox row");
    env.max_payload = placed.len();
    let (_, result) = B::commit(&env, vec![shipped("o-1")], None, End::Ok).await;
    result.unwrap();
    assert_eq!(
        B::rows(&env).await,
        [("o-1".to_owned(), 1), ("o-1".to_owned(), 2)]
    );
}

/// A COMMIT or ROLLBACK sent by hand inside the closure ends the transaction the events were
/// to join: they are not written (on their own they would be ghosts of a rolled-back
/// transaction, or events outside the business rows' transaction), the unit of work says
/// so, and the events stay pending. The connection serves the next unit of work.
async fn a_transaction_ended_inside_the_closure_writes_no_ghost_event<B: Backend>() {
    let env = B::setup().await;
    for statement in ["ROLLBACK", "COMMIT"] {
        let (orders, result) = B::commit(
            &env,
            vec![shipped(&format!("o-{statement}"))],
            Some(format!("r-{statement}")),
            End::Send(statement),
        )
        .await;
        let error = result.expect_err(statement);
        assert!(
            matches!(error, UnitOfWorkError::TransactionEnded),
            "{statement}: {error:?}"
        );
        assert!(B::rows(&env).await.is_empty(), "{statement}: no event");
        assert_eq!(
            orders[0].pending_events().len(),
            2,
            "the events stay pending"
        );
    }
    // The ROLLBACK undid its business row; the COMMIT was the closure's own.
    assert_eq!(B::business_rows(&env).await, 1);
    // No dedup key was taken, and the next unit of work commits.
    let (_, result) = B::commit(
        &env,
        vec![shipped("o-next")],
        Some("r-COMMIT".into()),
        End::Ok,
    )
    .await;
    result.unwrap();
    assert_eq!(
        B::rows(&env).await,
        [("o-next".to_owned(), 1), ("o-next".to_owned(), 2)]
    );
    assert_eq!(
        B::stats(&env).await.queued,
        3,
        "the order's two events and the invoice: its dedup key was still free"
    );
}

async fn committed_units_of_work_become_exactly_the_expected_messages<B: Backend>() {
    let env = B::setup().await;
    // The database's clock may store a millisecond less than this one read.
    let before = time::OffsetDateTime::now_utc() - Duration::from_millis(5);
    let (orders, result) =
        B::commit(&env, vec![shipped("o-1"), shipped("o-2")], None, End::Ok).await;
    result.unwrap();
    assert!(
        orders.iter().all(|o| o.pending_events().is_empty()),
        "drained"
    );
    let (_, result) = B::commit(&env, vec![shipped("o-1")], None, End::Ok).await;
    result.unwrap();
    // The gauges' view: six waiting rows, the oldest the first unit of work's.
    let waiting = B::stats(&env).await;
    assert_eq!(
        (waiting.queued, waiting.dead_letters, waiting.blocked),
        (6, 0, 0)
    );
    let oldest = waiting.oldest_queued_at.expect("an oldest queued row");
    let now = time::OffsetDateTime::now_utc();
    assert!(
        before <= oldest && oldest <= now,
        "{before} <= {oldest} <= {now}"
    );
    B::relay_all(&env).await;
    let drained = B::stats(&env).await;
    assert_eq!((drained.queued, drained.oldest_queued_at), (0, None));
    let messages = env.stream_messages().await;
    let prefix = &env.prefix;
    let subjects: Vec<&str> = messages.iter().map(|m| m.subject.as_str()).collect();
    assert_eq!(subjects.len(), 6);
    for event in ["Placed", "Shipped"] {
        for order in ["o-1", "o-2"] {
            let subject = format!("{prefix}.Order.{order}.{event}");
            assert!(
                subjects.contains(&subject.as_str()),
                "{subject} in {subjects:?}"
            );
        }
    }
    let expected: BTreeMap<String, Vec<u64>> = [
        ("o-1".to_owned(), vec![1, 2, 3, 4]),
        ("o-2".to_owned(), vec![1, 2]),
    ]
    .into();
    assert_eq!(support::sequences(&messages), expected);
}

/// Writers race on two aggregates with units of work of one aggregate (`hot`, then `warm`)
/// and of both: each aggregate's sequences are 1, 2, 3, ... without a gap or a repeat, and
/// no two units of work deadlock (a unit of work of both takes their counters in one order).
async fn sequences_stay_contiguous_under_concurrent_units_of_work<B: Backend + 'static>() {
    const WRITERS: usize = 6;
    const UNITS: usize = 9;
    let env = std::sync::Arc::new(B::setup().await);
    let writers: Vec<_> = (0..WRITERS)
        .map(|_| {
            let env = std::sync::Arc::clone(&env);
            tokio::spawn(async move {
                for unit in 0..UNITS {
                    let aggregates = match unit % 3 {
                        0 => vec![shipped("hot")],
                        1 => vec![shipped("hot"), shipped("warm")],
                        _ => vec![shipped("warm")],
                    };
                    let (_, result) = B::commit(&env, aggregates, None, End::Ok).await;
                    result.unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    // Two units of work in three track each aggregate, and write two events (Placed,
    // Shipped) for each aggregate they track.
    let per_aggregate = (WRITERS * UNITS * 2 / 3 * 2) as i64;
    let expected: BTreeMap<String, Vec<i64>> = [
        ("hot".to_owned(), (1..=per_aggregate).collect()),
        ("warm".to_owned(), (1..=per_aggregate).collect()),
    ]
    .into();
    let rows = B::rows(&env).await.into_iter();
    let rows = rows.map(|(aggregate, seq)| AppliedRow { aggregate, seq });
    assert_eq!(by_aggregate(rows.collect()), expected);
}

/// The dedup keys of units of work on different backends share one table.
#[cfg(feature = "postgres-sync")]
async fn a_dedup_key_taken_on_one_backend_holds_on_the_other<A: Backend, B: Backend>() {
    let env = B::setup().await;
    let (_, first) = A::commit(&env, vec![], Some("r-1".into()), End::Ok).await;
    first.unwrap();
    let (_, second) = B::commit(&env, vec![shipped("o-1")], Some("r-1".into()), End::Ok).await;
    second.unwrap();
    use diesel_async::RunQueryDsl;
    let invoices: i64 = diesel::dsl::sql::<diesel::sql_types::BigInt>(
        "SELECT count(*) FROM outbox_events WHERE aggregate_type = 'Invoice'",
    )
    .get_result(&mut env.conn().await)
    .await
    .unwrap();
    assert_eq!(invoices, 1);
    assert_eq!(
        B::rows(&env).await.len(),
        2,
        "the other events of the second were written"
    );
}

async fn a_row_written_by_plain_sql_is_relayed<B: Backend>() {
    let env = B::setup().await;
    B::execute(
        &env,
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                    partition_key, subject, payload) \
         VALUES ('Raw', 'r-1', 1, 'Written', 'r-1', '{prefix}.Raw.r-1.Written', '{\"by\": \"hand\"}')",
    )
    .await;
    B::relay_all(&env).await;
    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), 1);
    assert_eq!(
        messages[0].subject,
        format!("{}.Raw.r-1.Written", env.prefix)
    );
    assert_eq!(messages[0].payload, br#"{"by": "hand"}"#);
    assert_eq!(messages[0].header("ce-sequence").parse::<u64>(), Ok(1));
    assert_eq!(
        messages[0].header("Nats-Msg-Id"),
        messages[0].header("ce-id"),
        "the row's id is the message id"
    );
}

async fn three_relays_racing_keep_each_aggregate_in_order<B: Backend + 'static>() {
    const AGGREGATES: usize = 8;
    const ROUNDS: usize = 12;
    let env = std::sync::Arc::new(B::setup().await);
    let mut relays = Vec::new();
    for _ in 0..3 {
        let mut config = B::relay_config(&env);
        config.workers = 2;
        config.batch_size = 5;
        relays.push(B::spawn_relay(&env, config).await);
    }
    // Writers commit while the relays publish: each round one unit of work per aggregate.
    let writers: Vec<_> = (0..AGGREGATES)
        .map(|n| {
            let env = std::sync::Arc::clone(&env);
            tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    let (_, result) =
                        B::commit(&env, vec![shipped(&format!("o-{n}"))], None, End::Ok).await;
                    result.unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    let expected = AGGREGATES * ROUNDS * 2;
    env.until_stream_holds(expected as u64, Duration::from_secs(30))
        .await;
    for relay in relays {
        relay.shutdown().await.unwrap();
    }
    support::assert_each_once_in_order(
        &env.stream_messages().await,
        AGGREGATES,
        (ROUNDS * 2) as u64,
    );
}

async fn a_rejected_message_is_dead_lettered_while_the_others_flow<B: Backend>() {
    let env = B::setup().await;
    let mut config = B::relay_config(&env);
    config.max_attempts = 3;
    config.retry_delay = Duration::from_millis(20);
    config.max_retry_delay = Duration::from_millis(60);
    let relay = B::spawn_relay(&env, config).await;
    // Over the server's max payload (1 MiB): JetStream refuses it at every attempt. The row
    // behind it waits; other aggregates flow.
    let blob = "x".repeat(1_100_000);
    B::execute(
        &env,
        &format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                        partition_key, subject, payload) \
             VALUES ('Big', 'b-1', 1, 'Uploaded', 'b-1', '{{prefix}}.Big.b-1.Uploaded', \
                     '{{\"blob\": \"{blob}\"}}'), \
                    ('Big', 'b-1', 2, 'Labelled', 'b-1', '{{prefix}}.Big.b-1.Labelled', '{{}}')"
        ),
    )
    .await;
    for n in 0..3 {
        let (_, result) = B::commit(&env, vec![shipped(&format!("o-{n}"))], None, End::Ok).await;
        result.unwrap();
    }
    let dead = support::wait_until("a dead letter", Duration::from_secs(20), || async {
        let dead = B::dead_letters(&env).await;
        (!dead.is_empty()).then_some(dead)
    })
    .await;
    assert_eq!(
        dead,
        [("b-1".to_owned(), 1, 3)],
        "the head, after three attempts"
    );
    env.until_stream_holds(6, Duration::from_secs(10)).await;
    // Another batch or two: the row behind the dead letter must stay queued.
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.shutdown().await.unwrap();
    let stats = B::stats(&env).await;
    assert_eq!(
        (stats.queued, stats.dead_letters, stats.blocked),
        (1, 1, 1),
        "the row behind the dead letter waits, parked"
    );
    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), 6, "the orders flowed");
    assert!(
        messages.iter().all(|m| !m.subject.contains(".Big.")),
        "nothing of the blocked aggregate overtook its dead letter"
    );
}

/// Rows inserted by hand, before an aggregate's first unit of work and above its counter,
/// are numbered after: by units of work of one aggregate and of several, the aggregate new
/// to the counters or already there.
async fn a_unit_of_work_numbers_after_rows_inserted_by_hand<B: Backend>() {
    let env = B::setup().await;
    let by_hand = |id: &str, seq: i64| {
        format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                        partition_key, subject, payload) \
             VALUES ('Order', '{id}', {seq}, 'Noted', '{id}', '{{prefix}}.Order.{id}.Noted', '{{}}')"
        )
    };
    // Before the aggregate's first unit of work, and again above its counter.
    B::execute(&env, &by_hand("o-1", 1)).await;
    let (_, result) = B::commit(&env, vec![shipped("o-1")], None, End::Ok).await;
    result.unwrap();
    B::execute(&env, &by_hand("o-1", 4)).await;
    let (_, result) = B::commit(&env, vec![shipped("o-1")], None, End::Ok).await;
    result.unwrap();
    // Both again, in units of work of two aggregates: `o-2` before its first, `o-1` above
    // its counter; then `o-2` above its counter.
    B::execute(&env, &by_hand("o-2", 1)).await;
    B::execute(&env, &by_hand("o-1", 7)).await;
    let (_, result) = B::commit(&env, vec![shipped("o-1"), shipped("o-2")], None, End::Ok).await;
    result.unwrap();
    B::execute(&env, &by_hand("o-2", 4)).await;
    let (_, result) = B::commit(&env, vec![shipped("o-2"), shipped("o-3")], None, End::Ok).await;
    result.unwrap();
    let expected: BTreeMap<String, Vec<i64>> = [
        ("o-1".to_owned(), (1..=9).collect()),
        ("o-2".to_owned(), (1..=6).collect()),
        ("o-3".to_owned(), vec![1, 2]),
    ]
    .into();
    let rows = B::rows(&env).await.into_iter();
    let rows = rows.map(|(aggregate, seq)| AppliedRow { aggregate, seq });
    assert_eq!(by_aggregate(rows.collect()), expected);
}

/// On a database without LISTEN/NOTIFY (MySQL, SQLite), a relay that found nothing is woken
/// by a unit of work that commits in its process, not by its poll (a minute here).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
async fn an_idle_relay_is_woken_by_each_commit_of_its_process<B: Backend>() {
    let env = B::setup().await;
    let mut config = B::relay_config(&env);
    config.poll_interval = Duration::from_secs(60);
    let relay = B::spawn_relay(&env, config).await;
    for round in 1..=5_u64 {
        // Long enough for every worker to find nothing and wait.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (_, result) =
            B::commit(&env, vec![shipped(&format!("o-{round}"))], None, End::Ok).await;
        result.unwrap();
        env.until_stream_holds(round * 2, Duration::from_secs(3))
            .await;
    }
    relay.shutdown().await.unwrap();
}

/// A row the relay could not read (its id not a UUID, its payload not JSON, its headers not
/// a JSON object, its time not a time, its sequence not a number) is refused where it is
/// written: met by the relay's claim, it would stop every batch. So is a row whose
/// `published_at`, `dead_lettered_at` or `skipped_at` the toolkit could not read back (before:
/// `'infinity'` on PostgreSQL, a zero date on MariaDB and text on SQLite were written, and one
/// such dead letter failed every listing of the dead letters). A row that passes is relayed.
async fn a_row_the_relay_could_not_read_is_refused_where_it_is_written<B: Backend>() {
    let env = B::setup().await;
    let row = |id: &str, payload: &str, headers: &str, occurred_at: &str| {
        format!(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, \
                 event_type, partition_key, subject, payload, headers, occurred_at) \
             VALUES ('{id}', 'Raw', 'r-1', 1, 'Written', 'r-1', '{{prefix}}.Raw.r-1.Written', \
                     '{payload}', '{headers}', '{occurred_at}')"
        )
    };
    let (id, now) = (
        "0196f3a0-0000-7000-8000-000000000001",
        "2026-11-25 10:00:00",
    );
    for (what, statement) in [
        (
            "an id that is not a UUID",
            row("not-a-uuid", "{}", "{}", now),
        ),
        ("a payload that is not JSON", row(id, "{nope", "{}", now)),
        ("headers that are not an object", row(id, "{}", "[]", now)),
        (
            "a time that is not a time",
            row(id, "{}", "{}", "not a time"),
        ),
    ] {
        assert!(
            B::try_execute(&env, &statement).await.is_err(),
            "{what} was written"
        );
    }
    // Refused on every backend: PostgreSQL parses none of them but 'infinity', which its
    // CHECK refuses; MariaDB in strict mode parses only the zero date, which its CHECK
    // refuses; SQLite's triggers refuse each.
    let state_row = |column: &str, at: &str| {
        format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                 partition_key, subject, payload, {column}) \
             VALUES ('Raw', 's-{column}', 1, 'Written', 's-{column}', \
                     '{{prefix}}.Raw.s-{column}.Written', '{{}}', '{at}')"
        )
    };
    for column in ["published_at", "dead_lettered_at", "skipped_at"] {
        for at in ["infinity", "0000-00-00 00:00:00", "not a time"] {
            assert!(
                B::try_execute(&env, &state_row(column, at)).await.is_err(),
                "{column} {at} was written"
            );
        }
        // The same statement with a time in it is written (and never relayed: published,
        // a dead letter, or skipped).
        B::execute(&env, &state_row(column, now)).await;
    }
    B::execute(&env, &row(id, r#"{"ok": true}"#, "{}", now)).await;
    B::relay_all(&env).await;
    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].header("Nats-Msg-Id"), id);
}

/// A relay that dies after its publishes were acked, before it deleted the rows: the next
/// relay publishes them again, and JetStream stores each once (its `Nats-Msg-Id`), in order.
async fn a_relay_that_dies_before_its_delete_is_followed_without_duplicates<B: Backend>() {
    let env = B::setup().await;
    let (_, result) = B::commit(&env, vec![shipped("o-1"), shipped("o-2")], None, End::Ok).await;
    result.unwrap();
    B::execute(&env, B::BLOCK_DELETES[0]).await;
    let died = B::relay_once(&env).await;
    assert!(
        died.as_ref().is_err_and(|e| e.contains("deletes blocked")),
        "{died:?}"
    );
    env.until_stream_holds(4, Duration::from_secs(5)).await;
    B::execute(&env, B::BLOCK_DELETES[1]).await;
    B::relay_died(&env).await;
    B::relay_all(&env).await;
    assert!(B::rows(&env).await.is_empty(), "the rows are gone");
    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), 4, "each message stored once");
    let expected: BTreeMap<String, Vec<u64>> = [
        ("o-1".to_owned(), vec![1, 2]),
        ("o-2".to_owned(), vec![1, 2]),
    ]
    .into();
    assert_eq!(support::sequences(&messages), expected);
}

/// A unit of work of 6,000 events over three aggregates (more bound values than one MySQL
/// or SQLite statement takes) is written whole, each aggregate numbered after its rows, one
/// of them inserted by hand.
async fn a_unit_of_work_of_thousands_of_events_is_written_whole<B: Backend>() {
    let env = B::setup().await;
    B::execute(
        &env,
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                    partition_key, subject, payload) \
         VALUES ('Order', 'o-0', 1, 'Noted', 'o-0', '{prefix}.Order.o-0.Noted', '{}')",
    )
    .await;
    let orders: Vec<Order> = (0..3)
        .map(|n| {
            let mut order = Order::place(&format!("o-{n}"), "ada", 990);
            for _ in 1..2_000 {
                order.record(OrderEvent::Shipped);
            }
            order
        })
        .collect();
    let (orders, result) = B::commit(&env, orders, Some("r-big".into()), End::Ok).await;
    result.unwrap();
    assert!(orders.iter().all(|o| o.pending_events().is_empty()));
    let rows = B::rows(&env).await;
    assert_eq!(rows.len(), 6_001);
    for n in 0..3 {
        let seqs: Vec<i64> = rows
            .iter()
            .filter(|(id, _)| *id == format!("o-{n}"))
            .map(|(_, seq)| *seq)
            .collect();
        let last = if n == 0 { 2_001 } else { 2_000 };
        assert_eq!(seqs, (1..=last).collect::<Vec<i64>>(), "o-{n}");
    }
}

/// A backend whose database an operator works on: `outbox_runtime::dead_letter`, the purges.
trait Operated: Backend {
    /// The connection the dead-letter functions take.
    type Conn: OperatorConnection;

    /// A connection to the environment's database.
    fn operator_conn(env: &Env) -> impl Future<Output = Self::Conn> + Send;

    /// Every row of the archive, by aggregate and sequence.
    fn archived(env: &Env) -> impl Future<Output = Vec<Archived>> + Send;
}

impl Operated for AsyncPg {
    type Conn = diesel_async::AsyncPgConnection;

    async fn operator_conn(env: &Env) -> Self::Conn {
        env.conn().await
    }

    async fn archived(env: &Env) -> Vec<Archived> {
        use diesel_async::RunQueryDsl;
        diesel::sql_query(archived_sql("id::text", "payload::text"))
            .load(&mut env.conn().await)
            .await
            .unwrap()
    }
}

/// A row of the archive (`outbox_published`, `PublishedRows::Archive`), as the tests read it.
#[derive(Debug, diesel::QueryableByName)]
struct Archived {
    #[diesel(sql_type = diesel::sql_types::Text)]
    id: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    aggregate_id: String,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    aggregate_seq: i64,
    #[diesel(sql_type = diesel::sql_types::Text)]
    event_type: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    subject: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    payload: String,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    attempts: i32,
}

/// The query of every archived row, by aggregate and sequence, with the backend's
/// expressions of the id and the payload as text.
fn archived_sql(id: &str, payload: &str) -> String {
    format!(
        "SELECT {id} AS id, aggregate_id, aggregate_seq, event_type, subject, \
                {payload} AS payload, attempts \
         FROM outbox_published ORDER BY aggregate_id, aggregate_seq"
    )
}

/// A backend whose archive is one table that retention deletes row by row (MySQL, SQLite;
/// PostgreSQL drops its daily partitions whole: `tests/retention.rs`).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
trait PurgedByRow: Operated {
    /// The backend's `purge_archived`.
    fn purge_archived(
        conn: &mut Self::Conn,
        older_than: Duration,
        batch: i64,
        progress: impl FnMut(usize) + Send,
    ) -> impl Future<Output = diesel::QueryResult<usize>> + Send;
}

/// With `PublishedRows::Archive`, the relay moves each published row, whole, out of
/// `outbox_events` into `outbox_published`: every message on the stream has its archived
/// row (same id, subject and payload bytes), the queue is empty, and `outbox status` counts
/// the archived rows among the last minute's publishes.
async fn the_archive_keeps_each_published_row_whole<B: Operated>() {
    let env = B::setup().await;
    let (_, result) = B::commit(
        &env,
        vec![shipped("o-1"), shipped("o-2")],
        Some("r-1".to_owned()),
        End::Ok,
    )
    .await;
    result.unwrap();
    let mut config = B::relay_config(&env);
    config.published = outbox_runtime::PublishedRows::Archive;
    let relay = B::spawn_relay(&env, config).await;
    env.until_stream_holds(5, Duration::from_secs(10)).await;
    // A few more batches: a row left in the queue would be published again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    relay.shutdown().await.unwrap();

    assert!(B::rows(&env).await.is_empty(), "moved out of the queue");
    let stats = B::stats(&env).await;
    assert_eq!((stats.queued, stats.dead_letters), (0, 0));
    let archived = B::archived(&env).await;
    assert_eq!(
        archived
            .iter()
            .map(|row| (
                row.aggregate_id.as_str(),
                row.aggregate_seq,
                row.event_type.as_str()
            ))
            .collect::<Vec<_>>(),
        [
            ("i-1", 1, "Invoiced"),
            ("o-1", 1, "Placed"),
            ("o-1", 2, "Shipped"),
            ("o-2", 1, "Placed"),
            ("o-2", 2, "Shipped"),
        ]
    );
    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), 5, "each published once");
    for message in &messages {
        let id = message.header("Nats-Msg-Id");
        let row = archived
            .iter()
            .find(|row| row.id == id)
            .unwrap_or_else(|| panic!("no archived row {id}: {archived:?}"));
        assert_eq!(row.subject, message.subject);
        assert_eq!(row.payload.as_bytes(), message.payload.as_slice(), "{id}");
        assert_eq!(row.attempts, 0);
    }
    let mut conn = B::operator_conn(&env).await;
    for (window, counted) in [(100, 5), (3, 3)] {
        let recent = outbox_runtime::outbox::published_last_minute(&mut conn, window);
        assert_eq!(recent.await.unwrap(), counted, "window {window}");
    }
}

/// The archive replayed (`replay::replay_archive`) to a stream of its own: each archived
/// event once, as the relay published it (headers and payload bytes), each aggregate's in
/// order, in pages that end inside aggregates; from a position, only what follows it; and
/// the time filters read the database's own times.
async fn the_archive_replays_each_event_once_in_order_as_published<B: Operated>()
where
    B::Conn: outbox_runtime::replay::ArchiveConnection,
{
    use outbox_runtime::replay::{ArchivePosition, ReplayConfig, replay_archive};
    let env = B::setup().await;
    let orders = vec![shipped("o-1"), shipped("o-2"), shipped("o-3")];
    let (_, result) = B::commit(&env, orders, Some("r-1".to_owned()), End::Ok).await;
    result.unwrap();
    let mut config = B::relay_config(&env);
    config.published = outbox_runtime::PublishedRows::Archive;
    let source = config.source.clone();
    let relay = B::spawn_relay(&env, config).await;
    env.until_stream_holds(7, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();
    let live = env.stream_messages().await;

    let target = TestEnv::new().await;
    let mut replay = ReplayConfig::new(env.prefix.parse().unwrap(), target.topology());
    replay.source = source;
    replay.batch_size = 2;
    let mut conn = B::operator_conn(&env).await;
    let report = replay_archive(&mut conn, env.nats.clone(), &replay, |_| {})
        .await
        .unwrap();
    assert_eq!((report.published, report.duplicates), (7, 0));
    let replayed = target.stream_messages().await;
    assert_eq!(replayed.len(), 7, "each archived event once");
    for message in &replayed {
        let id = message.header("ce-id");
        let original = live
            .iter()
            .find(|m| m.header("ce-id") == id)
            .unwrap_or_else(|| panic!("{id} was not published live"));
        let rest = original.subject.strip_prefix(&env.prefix).unwrap();
        assert_eq!(message.subject, format!("{}{rest}", target.prefix));
        for (name, values) in original.headers.iter() {
            assert_eq!(
                message.headers.get_all(name.clone()).collect::<Vec<_>>(),
                values.iter().collect::<Vec<_>>(),
                "{id}: {name}"
            );
        }
        assert_eq!(
            message.headers.iter().count(),
            original.headers.iter().count(),
            "{id}"
        );
        assert_eq!(message.payload, original.payload, "{id}");
    }
    let sequences = support::sequences(&replayed);
    for aggregate in ["o-1", "o-2", "o-3"] {
        assert_eq!(sequences[aggregate], [1, 2], "{aggregate}: in order");
    }

    // After o-2's first event: its second and o-3's two, which the stream holds already.
    let archived = B::archived(&env).await;
    let o2 = archived
        .iter()
        .find(|row| row.aggregate_id == "o-2" && row.aggregate_seq == 1)
        .unwrap();
    replay.after = Some(ArchivePosition {
        aggregate_type: "Order".into(),
        aggregate_id: "o-2".into(),
        aggregate_seq: 1,
        id: o2.id.parse().unwrap(),
    });
    let rest = replay_archive(&mut conn, env.nats.clone(), &replay, |_| {})
        .await
        .unwrap();
    assert_eq!((rest.published, rest.duplicates), (3, 3));
    assert_eq!(
        rest.last.map(|p| (p.aggregate_id, p.aggregate_seq)),
        Some(("o-3".to_owned(), 2))
    );

    // The database's times: an hour around now takes all, from an hour ahead nothing.
    replay.after = None;
    let now = time::OffsetDateTime::now_utc();
    replay.published_since = Some(now - time::Duration::hours(1));
    replay.published_before = Some(now + time::Duration::hours(1));
    let around = replay_archive(&mut conn, env.nats.clone(), &replay, |_| {})
        .await
        .unwrap();
    assert_eq!(around.published, 7);
    replay.published_since = Some(now + time::Duration::hours(1));
    replay.published_before = None;
    let ahead = replay_archive(&mut conn, env.nats.clone(), &replay, |_| {})
        .await
        .unwrap();
    assert_eq!(ahead.published, 0);
}

on_backends!(the_archive_replays_each_event_once_in_order_as_published:
    async_pg => AsyncPg,
    #[cfg(feature = "mysql")]
    async_mysql => mysql::AsyncMysql,
    #[cfg(feature = "sqlite")]
    async_sqlite => sqlite::AsyncSqlite,
);

/// The archive's retention deletes the rows published longer ago than asked, oldest first
/// and in batches, and keeps the newer ones; an age no row has deletes nothing.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
async fn a_purge_of_the_archive_deletes_only_old_rows<B: PurgedByRow>() {
    let env = B::setup().await;
    let orders = vec![shipped("o-0"), shipped("o-1"), shipped("o-2")];
    let (_, result) = B::commit(&env, orders, None, End::Ok).await;
    result.unwrap();
    let mut config = B::relay_config(&env);
    config.published = outbox_runtime::PublishedRows::Archive;
    let relay = B::spawn_relay(&env, config).await;
    env.until_stream_holds(6, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();
    B::execute(
        &env,
        "UPDATE outbox_published SET published_at = '2000-01-01 00:00:00.000' \
         WHERE aggregate_id IN ('o-0', 'o-1')",
    )
    .await;

    let mut conn = B::operator_conn(&env).await;
    for older_than in [Duration::MAX, Duration::from_secs(1_001 * 31_557_600)] {
        let purged = B::purge_archived(&mut conn, older_than, 3, |_| {}).await;
        assert_eq!(purged.unwrap(), 0, "{older_than:?}");
    }
    let day = Duration::from_secs(86_400);
    let mut totals = Vec::new();
    let purged = B::purge_archived(&mut conn, day, 3, |total| totals.push(total))
        .await
        .unwrap();
    assert_eq!(
        (purged, totals),
        (4, vec![3, 4]),
        "two batches, the second short"
    );
    let kept: Vec<_> = B::archived(&env)
        .await
        .into_iter()
        .map(|row| (row.aggregate_id, row.aggregate_seq))
        .collect();
    assert_eq!(kept, [("o-2".to_owned(), 1), ("o-2".to_owned(), 2)]);
    let again = B::purge_archived(&mut conn, day, 3, |_| {}).await;
    assert_eq!(again.unwrap(), 0);
}

/// `(aggregate_id, aggregate_seq, attempts, waiting, skipped)` of each dead letter listed,
/// by aggregate.
fn letters(listed: &[DeadLetter]) -> Vec<(String, i64, i32, i64, bool)> {
    let mut letters: Vec<_> = listed
        .iter()
        .map(|l| {
            let id = l.aggregate_id.clone();
            (
                id,
                l.aggregate_seq,
                l.attempts,
                l.waiting,
                l.skipped_at.is_some(),
            )
        })
        .collect();
    letters.sort();
    letters
}

/// Two aggregates blocked behind a dead letter each: the operator lists and shows them,
/// fixes one row and retries it (its aggregate then flows in order), skips the other (its
/// later event flows), and retries the skipped one too (published after that later event).
/// Each retry and skip wakes a relay that would otherwise sleep 30 s.
async fn an_operator_retries_and_skips_dead_letters<B: Operated>() {
    let env = B::setup().await;
    let mut config = B::relay_config(&env);
    config.max_attempts = 2;
    config.retry_delay = Duration::from_millis(20);
    config.max_retry_delay = Duration::from_millis(40);
    config.poll_interval = Duration::from_millis(100);
    let relay = B::spawn_relay(&env, config.clone()).await;
    // Over the server's max payload (1 MiB): refused at every attempt.
    let blob = format!("{{\"blob\": \"{}\"}}", "x".repeat(1_100_000));
    let row = |aggregate: &str, seq: i64, event: &str, payload: &str| {
        format!(
            "('Big', '{aggregate}', {seq}, '{event}', '{aggregate}', \
              '{{prefix}}.Big.{aggregate}.{event}', '{payload}')"
        )
    };
    B::execute(
        &env,
        &format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                        partition_key, subject, payload) VALUES {}, {}, {}, {}",
            row("b-1", 1, "Uploaded", &blob),
            row("b-1", 2, "Labelled", "{}"),
            row("b-2", 1, "Uploaded", &blob),
            row("b-2", 2, "Labelled", "{}"),
        ),
    )
    .await;
    support::wait_until("two dead letters", Duration::from_secs(20), || async {
        (B::dead_letters(&env).await.len() == 2).then_some(())
    })
    .await;
    relay.shutdown().await.unwrap();

    let mut conn = B::operator_conn(&env).await;
    let listed = dead_letter::list(&mut conn, 10).await.unwrap();
    assert_eq!(
        letters(&listed),
        [
            ("b-1".to_owned(), 1, 2, 1, false),
            ("b-2".to_owned(), 1, 2, 1, false)
        ],
        "each blocks the event behind it"
    );
    let now = time::OffsetDateTime::now_utc();
    for letter in &listed {
        assert!(
            letter.last_error.as_deref().is_some_and(|e| !e.is_empty()),
            "{letter:?}"
        );
        let age = now - letter.dead_lettered_at;
        assert!(
            age >= -time::Duration::SECOND && age < time::Duration::minutes(1),
            "dead-lettered just now, in UTC: {letter:?}"
        );
        assert_eq!(
            letter.subject,
            format!("{}.Big.{}.Uploaded", env.prefix, letter.aggregate_id)
        );
    }
    assert_eq!(
        dead_letter::list(&mut conn, 1).await.unwrap().len(),
        1,
        "the limit"
    );
    assert!(
        dead_letter::list(&mut conn, -1).await.unwrap().is_empty(),
        "a negative limit lists none"
    );
    let first = listed
        .iter()
        .find(|l| l.aggregate_id == "b-1")
        .unwrap()
        .clone();
    let second = listed
        .iter()
        .find(|l| l.aggregate_id == "b-2")
        .unwrap()
        .clone();
    let detail = dead_letter::show(&mut conn, first.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(detail.letter, first);
    assert_eq!(
        (
            detail.event_version,
            detail.partition_key.as_str(),
            detail.payload.len()
        ),
        (1, "b-1", blob.len())
    );
    assert_eq!(detail.correlation_id, None);
    let headers: serde_json::Value = serde_json::from_str(&detail.headers).unwrap();
    assert_eq!(headers, serde_json::json!({}));
    assert!(
        now - detail.occurred_at < time::Duration::minutes(1),
        "{detail:?}"
    );
    assert_eq!(
        dead_letter::show(&mut conn, uuid::Uuid::now_v7())
            .await
            .unwrap(),
        None
    );

    // A relay that would sleep 30 s between polls: only the operator's wake moves it.
    config.poll_interval = Duration::from_secs(30);
    let relay = B::spawn_relay(&env, config).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    B::execute(
        &env,
        "UPDATE outbox_events SET payload = '{\"blob\": \"fixed\"}' \
         WHERE aggregate_id = 'b-1' AND aggregate_seq = 1",
    )
    .await;
    assert!(dead_letter::retry(&mut conn, first.id).await.unwrap());
    assert!(
        !dead_letter::retry(&mut conn, first.id).await.unwrap(),
        "no longer a dead letter"
    );
    assert!(dead_letter::skip(&mut conn, second.id).await.unwrap());
    assert!(
        !dead_letter::skip(&mut conn, second.id).await.unwrap(),
        "skipped already"
    );
    env.until_stream_holds(3, Duration::from_secs(10)).await;
    let listed = dead_letter::list(&mut conn, 10).await.unwrap();
    assert_eq!(
        letters(&listed),
        [("b-2".to_owned(), 1, 2, 0, true)],
        "the skipped one is kept, blocking nothing"
    );

    assert!(
        dead_letter::retry_all(&mut conn, Some("Other"))
            .await
            .unwrap()
            .is_empty(),
        "only the aggregate type asked for"
    );
    B::execute(
        &env,
        "UPDATE outbox_events SET payload = '{}' WHERE aggregate_id = 'b-2' AND aggregate_seq = 1",
    )
    .await;
    assert_eq!(
        dead_letter::retry_all(&mut conn, None).await.unwrap(),
        [second.id]
    );
    env.until_stream_holds(4, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();
    let subjects: Vec<String> = env
        .stream_messages()
        .await
        .into_iter()
        .map(|m| m.subject.replace(&format!("{}.", env.prefix), ""))
        .collect();
    // Each aggregate in its order; the two aggregates' batches may interleave.
    let of = |aggregate: &str| -> Vec<&str> {
        subjects
            .iter()
            .filter_map(|s| s.strip_prefix(&format!("Big.{aggregate}.")))
            .collect()
    };
    assert_eq!(subjects.len(), 4, "{subjects:?}");
    assert_eq!(
        of("b-1"),
        ["Uploaded", "Labelled"],
        "the retried one before the row behind it: {subjects:?}"
    );
    assert_eq!(
        of("b-2"),
        ["Labelled", "Uploaded"],
        "the skipped one after its later event: {subjects:?}"
    );
    assert!(dead_letter::list(&mut conn, 10).await.unwrap().is_empty());
    let stats = B::stats(&env).await;
    assert_eq!((stats.queued, stats.dead_letters, stats.blocked), (0, 0, 0));
}

/// With `PublishedRows::Mark`, the purges delete the published rows and the dedup keys older
/// than asked, in batches, and nothing else: not the newer ones, not a queued row, not a
/// dead letter, however old.
async fn a_purge_deletes_only_old_published_rows_and_dedup_keys<B: Operated>() {
    let env = B::setup().await;
    for (order, key) in [("o-0", Some("r-0")), ("o-1", Some("r-1")), ("o-2", None)] {
        let (_, result) =
            B::commit(&env, vec![shipped(order)], key.map(str::to_owned), End::Ok).await;
        result.unwrap();
    }
    let mut config = B::relay_config(&env);
    config.published = outbox_runtime::PublishedRows::Mark;
    let relay = B::spawn_relay(&env, config).await;
    env.until_stream_holds(8, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();
    let long_ago = "'2000-01-01 00:00:00.000'";
    B::execute(
        &env,
        &format!(
            "UPDATE outbox_events SET available_at = {long_ago}, published_at = {long_ago} \
             WHERE aggregate_id IN ('o-0', 'o-1')"
        ),
    )
    .await;
    B::execute(
        &env,
        &format!("UPDATE outbox_dedup_keys SET created_at = {long_ago} WHERE dedup_key = 'r-0'"),
    )
    .await;
    B::execute(
        &env,
        &format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                        partition_key, subject, payload, available_at, \
                                        attempts, dead_lettered_at) \
             VALUES ('Big', 'b-1', 1, 'Uploaded', 'b-1', '{{prefix}}.Big.b-1.Uploaded', '{{}}', \
                     {long_ago}, 3, {long_ago}), \
                    ('Late', 'l-1', 1, 'Noted', 'l-1', '{{prefix}}.Late.l-1.Noted', '{{}}', \
                     {long_ago}, 0, NULL)"
        ),
    )
    .await;

    let mut conn = B::operator_conn(&env).await;
    // What `outbox status` reads: the queue by type, the most queued first, and the rows
    // published in the last minute (o-2's and the two invoices; o-0's and o-1's "in 2000"),
    // counted up to the window.
    let by_type = outbox_runtime::outbox::queued_by_type(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        by_type
            .iter()
            .map(|row| {
                let QueuedByType {
                    aggregate_type,
                    event_type,
                    queued,
                    dead_letters,
                } = row;
                (
                    aggregate_type.as_str(),
                    event_type.as_str(),
                    *queued,
                    *dead_letters,
                )
            })
            .collect::<Vec<_>>(),
        [("Late", "Noted", 1, 0), ("Big", "Uploaded", 0, 1)]
    );
    for (window, counted) in [(100, 4), (3, 3)] {
        let recent = outbox_runtime::outbox::published_last_minute(&mut conn, window);
        assert_eq!(recent.await.unwrap(), counted, "window {window}");
    }
    // An age no row has (`Duration::MAX`: keep everything) deletes nothing and fails nothing.
    for older_than in [Duration::MAX, Duration::from_secs(1_001 * 31_557_600)] {
        let published = outbox_runtime::outbox::purge_published(&mut conn, older_than, 3, |_| {});
        assert_eq!(published.await.unwrap(), 0, "{older_than:?}");
        let keys = outbox_runtime::outbox::purge_dedup_keys(&mut conn, older_than, 3);
        assert_eq!(keys.await.unwrap(), 0, "{older_than:?}");
    }
    let day = Duration::from_secs(86_400);
    let mut totals = Vec::new();
    let purged = outbox_runtime::outbox::purge_published(&mut conn, day, 3, |total| {
        totals.push(total);
    })
    .await
    .unwrap();
    assert_eq!(
        (purged, totals),
        (4, vec![3, 4]),
        "two batches, the second short"
    );
    assert_eq!(
        B::rows(&env).await,
        [("o-2".to_owned(), 1), ("o-2".to_owned(), 2)],
        "the rows published within the day are kept"
    );
    let stats = B::stats(&env).await;
    assert_eq!(
        (stats.queued, stats.dead_letters),
        (1, 1),
        "the old queued row and the old dead letter are kept"
    );
    let again = outbox_runtime::outbox::purge_published(&mut conn, day, 3, |_| {});
    assert_eq!(again.await.unwrap(), 0);

    let keys = outbox_runtime::outbox::purge_dedup_keys(&mut conn, day, 1);
    assert_eq!(keys.await.unwrap(), 1);
    let keys = outbox_runtime::outbox::purge_dedup_keys(&mut conn, day, 1);
    assert_eq!(keys.await.unwrap(), 0);
    // The purged key no longer holds; the kept one does.
    for key in ["r-0", "r-1"] {
        let (_, result) = B::commit(&env, vec![], Some(key.to_owned()), End::Ok).await;
        result.unwrap();
    }
    assert_eq!(
        B::stats(&env).await.queued,
        2,
        "r-0's event written again, r-1's a duplicate"
    );
}

/// A row inserted by hand with an upper-case id (a UUID all the same) is published once and
/// then deleted, like any other: the relay finds it again by the id it published.
async fn a_row_with_an_upper_case_id_is_published_once<B: Backend>() {
    let env = B::setup().await;
    let id = uuid::Uuid::now_v7();
    B::execute(
        &env,
        &format!(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, \
                                        event_type, partition_key, subject, payload) \
             VALUES ('{}', 'Order', 'o-1', 1, 'Noted', 'o-1', '{{prefix}}.Order.o-1.Noted', \
                     '{{}}')",
            id.to_string().to_uppercase()
        ),
    )
    .await;
    let relay = B::spawn_relay(&env, B::relay_config(&env)).await;
    env.until_stream_holds(1, Duration::from_secs(10)).await;
    // A few more batches: a row the relay could not find to delete would be claimed again.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    relay.shutdown().await.unwrap();
    assert!(B::rows(&env).await.is_empty(), "deleted once published");
    let messages = env.stream_messages().await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].header("Nats-Msg-Id"), id.to_string());
}

macro_rules! contract {
    ($($module:ident => $backend:ty),* $(,)?) => {$(
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_rollback_leaves_nothing() {
                super::a_rollback_leaves_nothing::<$backend>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_payload_over_the_outbox_bound_is_refused_at_commit() {
                super::a_payload_over_the_outbox_bound_is_refused_at_commit::<$backend>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_transaction_ended_inside_the_closure_writes_no_ghost_event() {
                super::a_transaction_ended_inside_the_closure_writes_no_ghost_event::<$backend>()
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn committed_units_of_work_become_exactly_the_expected_messages() {
                super::committed_units_of_work_become_exactly_the_expected_messages::<$backend>()
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sequences_stay_contiguous_under_concurrent_units_of_work() {
                super::sequences_stay_contiguous_under_concurrent_units_of_work::<$backend>()
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_unit_of_work_numbers_after_rows_inserted_by_hand() {
                super::a_unit_of_work_numbers_after_rows_inserted_by_hand::<$backend>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_row_written_by_plain_sql_is_relayed() {
                super::a_row_written_by_plain_sql_is_relayed::<$backend>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn three_relays_racing_keep_each_aggregate_in_order() {
                super::three_relays_racing_keep_each_aggregate_in_order::<$backend>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_row_the_relay_could_not_read_is_refused_where_it_is_written() {
                super::a_row_the_relay_could_not_read_is_refused_where_it_is_written::<$backend>()
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_relay_that_dies_before_its_delete_is_followed_without_duplicates() {
                super::a_relay_that_dies_before_its_delete_is_followed_without_duplicates::<
                    $backend,
                >()
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_unit_of_work_of_thousands_of_events_is_written_whole() {
                super::a_unit_of_work_of_thousands_of_events_is_written_whole::<$backend>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_row_with_an_upper_case_id_is_published_once() {
                super::a_row_with_an_upper_case_id_is_published_once::<$backend>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_rejected_message_is_dead_lettered_while_the_others_flow() {
                super::a_rejected_message_is_dead_lettered_while_the_others_flow::<$backend>()
                    .await;
            }
        }
    )*};
}

contract!(async_pg => AsyncPg);
#[cfg(feature = "postgres-sync")]
contract!(sync_pg => SyncPg);
#[cfg(feature = "mysql")]
contract!(async_mysql => mysql::AsyncMysql);
#[cfg(feature = "mysql-sync")]
contract!(sync_mysql => mysql::SyncMysql);
#[cfg(feature = "sqlite")]
contract!(async_sqlite => sqlite::AsyncSqlite, sync_sqlite => sqlite::SyncSqlite);

/// The operator's tests, once per database: the bodies are one, the connections' types not.
macro_rules! operated {
    ($($test:ident),* $(,)?) => {$(
        mod $test {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_postgres() {
                super::$test::<AsyncPg>().await;
            }

            #[cfg(feature = "mysql")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_mysql() {
                super::$test::<mysql::AsyncMysql>().await;
            }

            #[cfg(feature = "sqlite")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_sqlite() {
                super::$test::<sqlite::AsyncSqlite>().await;
            }
        }
    )*};
}

operated!(
    an_operator_retries_and_skips_dead_letters,
    a_purge_deletes_only_old_published_rows_and_dedup_keys,
    the_archive_keeps_each_published_row_whole,
);

/// A backend an inbox runs on: the consumer's database is the environment's own, with a
/// table `applied` where [`Applier`] writes each event it applies, numbered in commit order
/// (the inbox applies one aggregate's events one transaction after another).
trait Consumed: Operated<Conn: InboxConnection> + 'static {
    /// The statement that creates `applied (n, aggregate, seq)`, `n` counting up.
    const APPLIED_TABLE: &'static str;

    /// Writes one applied event, on the handler's connection.
    fn apply(
        conn: &mut Self::Conn,
        aggregate: &str,
        seq: i64,
    ) -> impl Future<Output = diesel::QueryResult<usize>> + Send;

    /// Each aggregate's applied sequences, in the order they were applied.
    fn applied(env: &Env) -> impl Future<Output = BTreeMap<String, Vec<i64>>> + Send;

    /// The rows of a table of the environment's database.
    fn count(env: &Env, table: &str) -> impl Future<Output = i64> + Send;

    /// `(message_id, error)` of each of the inbox's dead letters.
    fn inbox_dead_letters(env: &Env) -> impl Future<Output = Vec<(String, String)>> + Send;
}

/// A row of `(aggregate, seq)`, read from `applied` (or the outbox's, from [`Backend::rows`]).
#[derive(diesel::QueryableByName)]
struct AppliedRow {
    #[diesel(sql_type = diesel::sql_types::Text)]
    aggregate: String,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    seq: i64,
}

fn by_aggregate(rows: Vec<AppliedRow>) -> BTreeMap<String, Vec<i64>> {
    let mut applied: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for row in rows {
        applied.entry(row.aggregate).or_default().push(row.seq);
    }
    applied
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

#[derive(diesel::QueryableByName)]
struct InboxDeadLetter {
    #[diesel(sql_type = diesel::sql_types::Text)]
    message_id: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    error: String,
}

const INBOX_DEAD_LETTERS: &str =
    "SELECT message_id, error FROM outbox_inbox_dead_letters ORDER BY message_id";

impl Consumed for AsyncPg {
    const APPLIED_TABLE: &'static str = "CREATE TABLE applied (n bigserial PRIMARY KEY, \
         aggregate text NOT NULL, seq bigint NOT NULL)";

    async fn apply(
        conn: &mut diesel_async::AsyncPgConnection,
        aggregate: &str,
        seq: i64,
    ) -> diesel::QueryResult<usize> {
        use diesel_async::RunQueryDsl;
        diesel::sql_query("INSERT INTO applied (aggregate, seq) VALUES ($1, $2)")
            .bind::<diesel::sql_types::Text, _>(aggregate)
            .bind::<diesel::sql_types::BigInt, _>(seq)
            .execute(conn)
            .await
    }

    async fn applied(env: &Env) -> BTreeMap<String, Vec<i64>> {
        use diesel_async::RunQueryDsl;
        let rows = diesel::sql_query("SELECT aggregate, seq FROM applied ORDER BY n")
            .load(&mut env.conn().await)
            .await
            .unwrap();
        by_aggregate(rows)
    }

    async fn count(env: &Env, table: &str) -> i64 {
        use diesel_async::RunQueryDsl;
        let row: Count = diesel::sql_query(format!("SELECT count(*) AS n FROM {table}"))
            .get_result(&mut env.conn().await)
            .await
            .unwrap();
        row.n
    }

    async fn inbox_dead_letters(env: &Env) -> Vec<(String, String)> {
        use diesel_async::RunQueryDsl;
        let rows: Vec<InboxDeadLetter> = diesel::sql_query(INBOX_DEAD_LETTERS)
            .load(&mut env.conn().await)
            .await
            .unwrap();
        rows.into_iter().map(|r| (r.message_id, r.error)).collect()
    }
}

/// Writes each event it applies into `applied`, in the inbox's transaction; fails every
/// time on the first event of the aggregate `refused`, and sends `end` (a ROLLBACK) on the
/// unit of work's connection after the write, when given; takes `slow_first` over each
/// aggregate's first event (so that another instance meets the later ones while it works).
struct Applier<B> {
    /// Aggregates whose first event it refuses.
    refused: Vec<String>,
    end: Option<&'static str>,
    slow_first: Duration,
    backend: std::marker::PhantomData<fn() -> B>,
}

impl<B> Applier<B> {
    fn new() -> Self {
        Self {
            refused: Vec::new(),
            end: None,
            slow_first: Duration::ZERO,
            backend: std::marker::PhantomData,
        }
    }
}

impl<B: Consumed> Handler<B::Conn> for Applier<B> {
    type Event = OrderEvent;
    type Error = String;

    async fn handle(
        &self,
        _event: OrderEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_, B::Conn>,
    ) -> Result<(), String> {
        if self.refused.contains(&message.aggregate_id) && message.sequence == 1 {
            return Err("refused by the test".to_owned());
        }
        if message.sequence == 1 {
            tokio::time::sleep(self.slow_first).await;
        }
        B::apply(uow.conn(), &message.aggregate_id, message.sequence)
            .await
            .map_err(|e| e.to_string())?;
        if let Some(end) = self.end {
            uow.conn()
                .batch_execute(end)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// The configuration of consumer `name` on the environment's database and stream: fast
/// redeliveries, for tests.
fn inbox_config<B: Consumed>(env: &Env, name: &str) -> InboxConfig {
    let mut config = InboxConfig::new(name, B::relay_config(env).database_url);
    config.outbox = env.outbox();
    config.topology = env.topology();
    config.ack_wait = Duration::from_secs(1);
    config.retry_delay = Duration::from_millis(50);
    config.max_retry_delay = Duration::from_millis(200);
    config
}

/// The error of an inbox of consumer `name` on the environment's stream and the database at
/// `database_url` (default the environment's), which must refuse to start.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
async fn inbox_refusal<B: Consumed>(env: &Env, name: &str, database_url: Option<&str>) -> String {
    let mut config = inbox_config::<B>(env, name);
    if let Some(url) = database_url {
        config.database_url = url.to_owned();
    }
    let shown = outbox_runtime::database::redacted(&config.database_url);
    match Inbox::<Applier<B>, B::Conn>::connect(config, env.nats.clone(), Applier::new()).await {
        Ok(_) => panic!("an inbox of {name} started on {shown}"),
        Err(error) => error.to_string(),
    }
}

/// Runs `instances` instances of the inbox of `config` until JetStream has nothing left for
/// the consumer (every message delivered and settled), then shuts them down.
async fn consume<B: Consumed>(
    env: &Env,
    config: &InboxConfig,
    instances: usize,
    handler: fn() -> Applier<B>,
) {
    let mut running = Vec::new();
    let mut probe = None;
    for _ in 0..instances {
        let inbox: Inbox<Applier<B>, B::Conn> =
            Inbox::connect(config.clone(), env.nats.clone(), handler())
                .await
                .unwrap();
        probe.get_or_insert_with(|| inbox.clone());
        running.push(inbox.spawn());
    }
    let probe = probe.expect("an instance");
    support::consumer::wait_until_settled(&probe, "every message settled", Duration::from_secs(60))
        .await;
    for instance in running {
        instance.shutdown().await.unwrap();
    }
}

/// Commits four events for each of `ids` in three units of work, and relays them.
async fn four_events_each<B: Consumed>(env: &Env, ids: &[&str]) {
    let mut orders: Vec<Order> = ids.iter().map(|id| shipped(id)).collect();
    for round in 0..3 {
        if round > 0 {
            for order in &mut orders {
                order.record(OrderEvent::ItemAdded {
                    sku: format!("sku-{round}"),
                    quantity: 1,
                });
            }
        }
        let (committed, result) = B::commit(env, orders, None, End::Ok).await;
        result.unwrap();
        orders = committed;
    }
    B::relay_all(env).await;
}

/// Two instances of one consumer apply every event once, each aggregate's in sequence order;
/// a second delivery of every message (a new durable consumer of the same name, from the
/// stream's start) changes nothing; the consumer is listed, and retention deletes its rows;
/// a third delivery past retention applies nothing again, each event dead-lettered as late.
async fn an_inbox_applies_each_event_once_in_order<B: Consumed>() {
    let env = B::setup().await;
    B::execute(&env, B::APPLIED_TABLE).await;
    let ids: Vec<String> = (0..8).map(|i| format!("o-{i}")).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    four_events_each::<B>(&env, &ids).await;
    let mut config = inbox_config::<B>(&env, "applier");
    config.max_concurrency = 2;
    consume(&env, &config, 2, || Applier::<B> {
        slow_first: Duration::from_millis(400),
        ..Applier::new()
    })
    .await;
    let expected: BTreeMap<String, Vec<i64>> = ids
        .iter()
        .map(|id| ((*id).to_owned(), vec![1, 2, 3, 4]))
        .collect();
    assert_eq!(
        B::applied(&env).await,
        expected,
        "each event once, in order"
    );

    support::delete_consumer(&env, "applier").await;
    consume(&env, &config, 1, Applier::<B>::new).await;
    assert_eq!(
        B::applied(&env).await,
        expected,
        "the redeliveries changed nothing"
    );
    let letters = B::inbox_dead_letters(&env).await;
    assert!(
        letters.is_empty(),
        "each was a duplicate, not late: {letters:?}"
    );
    assert_eq!(B::count(&env, "outbox_inbox").await, 32);

    let mut conn = B::operator_conn(&env).await;
    assert_eq!(inbox::consumers(&mut conn).await.unwrap(), ["applier"]);
    let kept = inbox::purge(&mut conn, "applier", Duration::MAX, 100).await;
    assert_eq!(kept.unwrap(), 0, "nothing is a thousand years old");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let first = inbox::purge(&mut conn, "applier", Duration::ZERO, 20).await;
    assert_eq!(first.unwrap(), 20, "a batch of 20, the oldest");
    let rest = inbox::purge(&mut conn, "applier", Duration::ZERO, 20).await;
    assert_eq!(rest.unwrap(), 12);
    assert_eq!(B::count(&env, "outbox_inbox").await, 0);
    assert_eq!(
        B::count(&env, "outbox_inbox_positions").await,
        8,
        "positions are kept"
    );

    // Past retention (the ids forgotten), the whole stream delivered once more: the positions
    // keep every event from being applied again. The inbox cannot tell an applied event whose
    // id it forgot from one of its aggregate it never applied (a skipped dead letter retried
    // late, another event numbered the same by a producer whose database was restored), so
    // each is dead-lettered as late, for an operator to discard, rather than dropped.
    support::delete_consumer(&env, "applier").await;
    let (logs, turn) = support::Logs::capture().await;
    consume(&env, &config, 1, Applier::<B>::new).await;
    let text = logs.text();
    let stream = format!("stream={}", env.stream);
    assert!(
        text.lines().any(|line| {
            line.contains("the durable consumer is new, and this consumer applied events before")
                && line.contains(&stream)
                && line.contains("pending=32")
        }),
        "the consumer created anew was not reported: {text}"
    );
    drop(turn);
    assert_eq!(
        B::applied(&env).await,
        expected,
        "nothing applied again past retention"
    );
    let letters = B::inbox_dead_letters(&env).await;
    assert_eq!(letters.len(), 32, "{letters:?}");
    for (message_id, error) in &letters {
        assert!(
            error.contains("arrived after event 4 of its aggregate was applied"),
            "{message_id}: {error}"
        );
    }
    let mut conn = B::operator_conn(&env).await;
    assert_eq!(
        inbox::discard_dead_letters(&mut conn, Some("applier"))
            .await
            .unwrap(),
        32
    );
}

/// A handler that fails on one event is retried, then the event is dead-lettered with its
/// error and its aggregate moves on; the other aggregates flow meanwhile. A handler that
/// ends the transaction itself (a ROLLBACK on the unit of work's connection) fails its
/// message as the handler's failure: it is never acked as handled.
async fn an_inbox_dead_letters_a_failing_handlers_event_and_its_aggregate_moves_on<B: Consumed>() {
    let env = B::setup().await;
    B::execute(&env, B::APPLIED_TABLE).await;
    four_events_each::<B>(&env, &["o-bad", "o-good"]).await;
    let mut config = inbox_config::<B>(&env, "refuser");
    config.max_attempts = 2;
    consume(&env, &config, 1, || Applier::<B> {
        refused: vec!["o-bad".to_owned()],
        ..Applier::new()
    })
    .await;
    let applied = B::applied(&env).await;
    assert_eq!(applied["o-good"], [1, 2, 3, 4]);
    assert_eq!(
        applied["o-bad"],
        [2, 3, 4],
        "the aggregate moved past its dead letter"
    );
    let letters = B::inbox_dead_letters(&env).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert!(
        letters[0].1.contains("refused by the test") && letters[0].1.contains("failed 2 times"),
        "{letters:?}"
    );

    // An operator lists the dead letter and reads it whole: the message as delivered.
    let mut conn = B::operator_conn(&env).await;
    let listed = inbox::dead_letters(&mut conn, None, 100).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    let letter = listed[0].clone();
    assert_eq!(
        (letter.consumer.as_str(), &letter.message_id, &letter.error),
        ("refuser", &letters[0].0, &letters[0].1)
    );
    assert!(letter.deliveries >= 2, "{letter:?}");
    assert!(letter.stream_sequence >= 1, "{letter:?}");
    let age = time::OffsetDateTime::now_utc() - letter.dead_lettered_at;
    assert!(age.whole_seconds().abs() < 300, "{letter:?}");
    let sources = inbox::dead_letter_sources(&mut conn, "refuser", &letter.message_id).await;
    assert_eq!(sources.unwrap(), [letter.source.as_str()]);
    let (consumer, source, id) = ("refuser", letter.source.as_str(), &letter.message_id);
    let detail = inbox::dead_letter(&mut conn, consumer, source, id)
        .await
        .unwrap();
    let detail = detail.expect("the dead letter, by its key");
    assert_eq!(detail.letter, letter);
    assert_eq!(detail.headers["ce-subject"], serde_json::json!(["o-bad"]));
    let sequence = detail.headers["ce-sequence"][0]
        .as_str()
        .map(str::parse::<i64>);
    assert_eq!(sequence, Some(Ok(1)), "{:?}", detail.headers);
    assert_eq!(detail.headers["ce-id"], serde_json::json!([id]));
    let payload: serde_json::Value = serde_json::from_slice(&detail.payload).unwrap();
    let placed = serde_json::json!({"customer": "ada", "total_cents": 990});
    assert_eq!(payload, placed, "the payload as published");
    for (consumer, source) in [("refuser", "/elsewhere"), ("nobody", source)] {
        let none = inbox::dead_letter(&mut conn, consumer, source, id).await;
        assert_eq!(none.unwrap(), None, "{consumer} {source}");
    }
    let none = inbox::dead_letters(&mut conn, Some("nobody"), 100).await;
    assert_eq!(none.unwrap(), []);
    assert_eq!(inbox::dead_letters(&mut conn, None, 0).await.unwrap(), []);

    // A second consumer whose handler rolls back by hand, then writes in a transaction of
    // its own: each message fails, and is dead-lettered at its one attempt; nothing the
    // handler wrote stays.
    let mut config = inbox_config::<B>(&env, "rollbacker");
    config.max_attempts = 1;
    consume(&env, &config, 1, || Applier::<B> {
        end: Some("ROLLBACK; BEGIN; INSERT INTO applied (aggregate, seq) VALUES ('reopened', 0)"),
        ..Applier::new()
    })
    .await;
    let letters = B::inbox_dead_letters(&env).await;
    let ended = letters
        .iter()
        .filter(|(_, error)| error.contains("ended inside its closure"))
        .count();
    assert_eq!(
        ended, 8,
        "every message of the second consumer: {letters:?}"
    );
    assert_eq!(B::applied(&env).await, applied, "nothing it wrote stayed");

    // Counted per consumer; listed oldest first, of one consumer or of all.
    let counts = inbox::dead_letter_counts(&mut conn).await.unwrap();
    assert_eq!(
        counts,
        [("refuser".to_owned(), 1), ("rollbacker".to_owned(), 8)]
    );
    let first_three = inbox::dead_letters(&mut conn, None, 3).await.unwrap();
    assert_eq!(first_three.len(), 3);
    assert_eq!(first_three[0], letter, "the oldest first");
    let rolled_back = inbox::dead_letters(&mut conn, Some("rollbacker"), 100).await;
    let rolled_back = rolled_back.unwrap();
    assert_eq!(rolled_back.len(), 8);
    assert!(rolled_back.iter().all(|l| l.consumer == "rollbacker"));
    assert!(
        rolled_back
            .windows(2)
            .all(|w| w[0].dead_lettered_at <= w[1].dead_lettered_at),
        "{rolled_back:?}"
    );

    // Discarded once dealt with: the row goes, the inbox's record of the message stays.
    let recorded = B::count(&env, "outbox_inbox").await;
    let discarded = inbox::discard_dead_letter(&mut conn, consumer, source, id).await;
    assert!(discarded.unwrap());
    let again = inbox::discard_dead_letter(&mut conn, consumer, source, id).await;
    assert!(!again.unwrap(), "discarded already");
    let counts = inbox::dead_letter_counts(&mut conn).await.unwrap();
    assert_eq!(counts, [("rollbacker".to_owned(), 8)]);
    let none = inbox::discard_dead_letters(&mut conn, Some("nobody")).await;
    assert_eq!(none.unwrap(), 0);
    let all = inbox::discard_dead_letters(&mut conn, Some("rollbacker")).await;
    assert_eq!(all.unwrap(), 8);
    assert_eq!(inbox::dead_letter_counts(&mut conn).await.unwrap(), []);
    assert_eq!(B::count(&env, "outbox_inbox").await, recorded);
}

/// A dead letter replayed once its handler is fixed: a handler that still fails leaves it
/// (and nothing it wrote); a fixed one applies the event where it stands (after the events
/// applied since), deletes the dead letter and the message's failed attempts in the same
/// transaction, and two replays at once apply it once.
async fn an_inbox_replays_a_dead_letter_once_its_handler_is_fixed<B: Consumed>() {
    let env = B::setup().await;
    B::execute(&env, B::APPLIED_TABLE).await;
    four_events_each::<B>(&env, &["o-bad", "o-good"]).await;
    let mut config = inbox_config::<B>(&env, "replayer");
    config.max_attempts = 2;
    let refusing = || Applier::<B> {
        refused: vec!["o-bad".to_owned()],
        ..Applier::new()
    };
    consume(&env, &config, 1, refusing).await;
    assert_eq!(B::applied(&env).await["o-bad"], [2, 3, 4]);
    assert_eq!(B::count(&env, "outbox_inbox_attempts").await, 1);
    let mut conn = B::operator_conn(&env).await;
    let letters = inbox::dead_letters(&mut conn, Some("replayer"), 10).await;
    let [letter] = <[_; 1]>::try_from(letters.unwrap()).expect("one dead letter");
    let (source, id) = (letter.source.as_str(), letter.message_id.as_str());

    let still_failing: Inbox<Applier<B>, B::Conn> =
        Inbox::connect(config.clone(), env.nats.clone(), refusing())
            .await
            .unwrap();
    match still_failing.replay_dead_letter(source, id).await.unwrap() {
        inbox::Replayed::Failed { error } => {
            assert!(error.contains("refused by the test"), "{error}");
        }
        other => panic!("the handler still refuses it: {other:?}"),
    }
    assert_eq!(B::applied(&env).await["o-bad"], [2, 3, 4]);
    let kept = inbox::dead_letters(&mut conn, Some("replayer"), 10).await;
    assert_eq!(
        kept.unwrap(),
        std::slice::from_ref(&letter),
        "the dead letter stays"
    );

    let fixed: Inbox<Applier<B>, B::Conn> =
        Inbox::connect(config.clone(), env.nats.clone(), Applier::new())
            .await
            .unwrap();
    let twice = fixed.clone();
    let (first, second) = tokio::join!(
        fixed.replay_dead_letter(source, id),
        twice.replay_dead_letter(source, id)
    );
    let mut outcomes = [first.unwrap(), second.unwrap()];
    outcomes.sort_by_key(|outcome| format!("{outcome:?}"));
    assert_eq!(
        outcomes,
        [inbox::Replayed::Handled, inbox::Replayed::NotFound],
        "applied once"
    );
    let applied = B::applied(&env).await;
    assert_eq!(applied["o-bad"], [2, 3, 4, 1], "applied where it stands");
    assert_eq!(applied["o-good"], [1, 2, 3, 4]);
    assert_eq!(inbox::dead_letter_counts(&mut conn).await.unwrap(), []);
    assert_eq!(B::count(&env, "outbox_inbox_attempts").await, 0);
    let again = fixed.replay_dead_letter(source, id).await.unwrap();
    assert_eq!(again, inbox::Replayed::NotFound);
}

/// A redrive: `replay_dead_letters` takes the consumer's oldest dead letters, up to its
/// limit, and replays each in its own transaction; one that fails again stays and is
/// reported without stopping the others, and another consumer's are left alone.
async fn an_inbox_replays_its_consumers_dead_letters_oldest_first<B: Consumed>() {
    let env = B::setup().await;
    B::execute(&env, B::APPLIED_TABLE).await;
    four_events_each::<B>(&env, &["o-a", "o-b", "o-c", "o-ok"]).await;
    let mut config = inbox_config::<B>(&env, "redriver");
    config.max_attempts = 1;
    let refusing = || Applier::<B> {
        refused: ["o-a", "o-b", "o-c"].map(str::to_owned).to_vec(),
        ..Applier::new()
    };
    consume(&env, &config, 1, refusing).await;
    // Another consumer whose every message fails (its handler ends the transaction by hand),
    // leaving nothing written.
    let mut other = inbox_config::<B>(&env, "bystander");
    other.max_attempts = 1;
    consume(&env, &other, 1, || Applier::<B> {
        end: Some("ROLLBACK; BEGIN; INSERT INTO applied (aggregate, seq) VALUES ('reopened', 0)"),
        ..Applier::new()
    })
    .await;
    let mut conn = B::operator_conn(&env).await;
    let letters = inbox::dead_letters(&mut conn, Some("redriver"), 10).await;
    let letters = letters.unwrap();
    assert_eq!(letters.len(), 3, "{letters:?}");
    let order: Vec<String> = letters.iter().map(|l| l.message_id.clone()).collect();
    let mut aggregates = Vec::new();
    for letter in &letters {
        let (source, id) = (&letter.source, &letter.message_id);
        let detail = inbox::dead_letter(&mut conn, "redriver", source, id).await;
        let detail = detail.unwrap().expect("the dead letter, by its key");
        let subject = detail.headers["ce-subject"][0].as_str().unwrap().to_owned();
        aggregates.push(subject);
    }

    // Fixed for all but the second oldest's aggregate; a limit of 1 takes the oldest alone.
    let partly_fixed = Applier::<B> {
        refused: vec![aggregates[1].clone()],
        ..Applier::new()
    };
    let inbox: Inbox<Applier<B>, B::Conn> =
        Inbox::connect(config.clone(), env.nats.clone(), partly_fixed)
            .await
            .unwrap();
    let first = inbox.replay_dead_letters(1).await.unwrap();
    assert_eq!(
        first,
        inbox::ReplayReport {
            handled: 1,
            ..Default::default()
        }
    );
    let left = inbox::dead_letters(&mut conn, Some("redriver"), 10).await;
    let left: Vec<String> = left.unwrap().into_iter().map(|l| l.message_id).collect();
    assert_eq!(left, order[1..], "the oldest went first");
    let rest = inbox.replay_dead_letters(10).await.unwrap();
    assert_eq!((rest.handled, rest.not_found), (1, 0), "{rest:?}");
    let [failed] = <[_; 1]>::try_from(rest.failed).expect("one failed again");
    assert_eq!(failed.message_id, order[1]);
    assert!(failed.error.contains("refused by the test"), "{failed:?}");
    let left = inbox::dead_letters(&mut conn, Some("redriver"), 10).await;
    let left: Vec<String> = left.unwrap().into_iter().map(|l| l.message_id).collect();
    assert_eq!(left, [order[1].clone()], "the one that failed stays");
    let applied = B::applied(&env).await;
    for (i, aggregate) in aggregates.iter().enumerate() {
        let expected: &[i64] = if i == 1 { &[2, 3, 4] } else { &[2, 3, 4, 1] };
        assert_eq!(applied[aggregate], expected, "{aggregate}: {applied:?}");
    }
    assert_eq!(applied["o-ok"], [1, 2, 3, 4]);

    let fixed: Inbox<Applier<B>, B::Conn> =
        Inbox::connect(config.clone(), env.nats.clone(), Applier::new())
            .await
            .unwrap();
    let last = fixed.replay_dead_letters(10).await.unwrap();
    assert_eq!((last.handled, last.failed.len()), (1, 0), "{last:?}");
    assert_eq!(B::applied(&env).await[&aggregates[1]], [2, 3, 4, 1]);
    let none = fixed.replay_dead_letters(10).await.unwrap();
    assert_eq!(none, inbox::ReplayReport::default());
    assert_eq!(
        inbox::dead_letter_counts(&mut conn).await.unwrap(),
        [("bystander".to_owned(), 16)],
        "another consumer's dead letters stay"
    );
}

/// An event whose predecessor is not in the stream (removed from it) is applied over the
/// gap, which is recorded; the events after it follow in order.
async fn an_inbox_applies_an_event_after_a_gap_in_the_stream_and_records_the_gap<B: Consumed>() {
    let env = B::setup().await;
    B::execute(&env, B::APPLIED_TABLE).await;
    four_events_each::<B>(&env, &["o-gap"]).await;
    let stream = async_nats::jetstream::new(env.nats.clone())
        .get_stream(&env.stream)
        .await
        .unwrap();
    // One aggregate on a fresh stream: its event 2 is the stream's message 2.
    assert!(stream.delete_message(2).await.unwrap());
    consume(
        &env,
        &inbox_config::<B>(&env, "gapped"),
        1,
        Applier::<B>::new,
    )
    .await;
    assert_eq!(B::applied(&env).await["o-gap"], [1, 3, 4]);
    assert_eq!(B::count(&env, "outbox_inbox_gaps").await, 1);
}

/// The inbox's tests, once per database.
macro_rules! consumed {
    ($($test:ident),* $(,)?) => {$(
        mod $test {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_postgres() {
                super::$test::<AsyncPg>().await;
            }

            #[cfg(feature = "mysql")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_mysql() {
                super::$test::<mysql::AsyncMysql>().await;
            }

            #[cfg(feature = "sqlite")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_sqlite() {
                super::$test::<sqlite::AsyncSqlite>().await;
            }
        }
    )*};
}

consumed!(
    an_inbox_applies_each_event_once_in_order,
    an_inbox_dead_letters_a_failing_handlers_event_and_its_aggregate_moves_on,
    an_inbox_replays_a_dead_letter_once_its_handler_is_fixed,
    an_inbox_replays_its_consumers_dead_letters_oldest_first,
    an_inbox_applies_an_event_after_a_gap_in_the_stream_and_records_the_gap,
);

/// A unit of work whose future is dropped part-way (a request's timeout, a client gone, a
/// `select!`) on a connection from `Pooled::get` (`get`) leaves nothing locked: the
/// connection is closed rather than given back to the pool inside the transaction, the
/// database rolls the transaction back, and the next unit of work on the same row goes
/// through within 5 s; the dropped one wrote nothing, and its event went with the next.
/// deadpool's own guard would sit in the pool holding the row (on SQLite, the database's
/// write lock) until the pool handed it out again (on PostgreSQL and MariaDB, the next unit of
/// work waited past the 5 s; on SQLite it failed with "database is locked").
async fn dropped_part_way_on_a_pooled_connection<B, P, F>(env: &Env, get: F)
where
    B: Backend,
    P: outbox_runtime::OutboxConnection,
    F: AsyncFn() -> Result<P, diesel_async::pooled_connection::deadpool::PoolError>,
{
    const LOCK: &str = "UPDATE orders SET id = 'o-1' WHERE id = 'o-1'";
    let outbox = env.outbox();
    // Two idle connections, so that the unit of work after the dropped one is handed another
    // (deadpool hands out the longest idle first).
    let warm = (get().await.unwrap(), get().await.unwrap());
    drop(warm);
    let mut order = Order::place("o-1", "ada", 1);
    let mut conn = get().await.unwrap();
    outbox
        .transaction(&mut conn, async |uow| {
            uow.conn()
                .batch_execute("INSERT INTO orders VALUES ('o-1')")
                .await?;
            uow.track(&mut order);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
    drop(conn);

    order.record(OrderEvent::Shipped);
    let locked = tokio::sync::Notify::new();
    tokio::select! {
        outcome = async {
            let mut conn = get().await.unwrap();
            outbox
                .transaction(&mut conn, async |uow| {
                    uow.conn().batch_execute(LOCK).await?;
                    uow.track(&mut order);
                    locked.notify_one();
                    // The request hangs here, holding the row, until it is dropped.
                    std::future::pending::<()>().await;
                    Ok::<_, UnitOfWorkError>(())
                })
                .await
        } => panic!("the hanging unit of work ended: {outcome:?}"),
        () = locked.notified() => {}
    }

    let mut conn = get().await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(5),
        outbox.transaction(&mut conn, async |uow| {
            uow.conn().batch_execute(LOCK).await?;
            uow.track(&mut order);
            Ok::<_, UnitOfWorkError>(())
        }),
    )
    .await
    .expect("the row stayed locked by the dropped unit of work")
    .unwrap();
    assert_eq!(
        B::rows(env).await,
        [("o-1".to_owned(), 1), ("o-1".to_owned(), 2)],
        "the dropped unit of work wrote nothing, and its event went with the next"
    );
    assert!(order.pending_events().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_of_work_dropped_part_way_on_a_pooled_postgres_connection_leaves_nothing_locked() {
    use diesel_async::AsyncPgConnection;
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use diesel_async::pooled_connection::deadpool::Pool;

    let env = AsyncPg::setup().await;
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(&env.database_url);
    let pool = Pool::builder(manager).max_size(2).build().unwrap();
    dropped_part_way_on_a_pooled_connection::<AsyncPg, _, _>(&env, async || {
        outbox_runtime::Pooled::get(&pool).await
    })
    .await;
}

#[cfg(feature = "postgres-sync")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedup_key_taken_by_an_async_unit_of_work_holds_for_a_sync_one() {
    a_dedup_key_taken_on_one_backend_holds_on_the_other::<AsyncPg, SyncPg>().await;
}

#[cfg(feature = "postgres-sync")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedup_key_taken_by_a_sync_unit_of_work_holds_for_an_async_one() {
    a_dedup_key_taken_on_one_backend_holds_on_the_other::<SyncPg, AsyncPg>().await;
}

#[cfg(feature = "postgres-sync")]
/// `sync_transaction` takes an r2d2-pooled connection (`&mut PooledConnection` derefs to
/// `&mut PgConnection`), and says what is missing on a database without the outbox tables;
/// on one whose outbox is in a schema off the `search_path`, it names that schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_unit_of_work_runs_on_a_pooled_connection_and_names_missing_migrations() {
    let env = SyncPg::setup().await;
    let unmigrated = TestEnv::unmigrated(&support::nats_url()).await;
    let (url, bare_url, elsewhere_url, outbox) = (
        env.database_url.clone(),
        unmigrated.database_url.clone(),
        format!("{}?options=-csearch_path%3Dorders", unmigrated.database_url),
        env.outbox(),
    );
    tokio::task::spawn_blocking(move || {
        use diesel::r2d2::{ConnectionManager, Pool};
        let pool = Pool::builder()
            .max_size(2)
            .build(ConnectionManager::<diesel::PgConnection>::new(url))
            .expect("an r2d2 pool");
        let mut order = shipped("o-1");
        outbox
            .sync_transaction(&mut pool.get().unwrap(), |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .unwrap();
        assert!(order.pending_events().is_empty());

        let mut bare = diesel::PgConnection::establish(&bare_url).unwrap();
        let mut order = shipped("o-2");
        let error = outbox
            .sync_transaction(&mut bare, |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .unwrap_err();
        assert!(
            matches!(&error, UnitOfWorkError::MissingMigrations(missing) if !missing.pending.is_empty() && missing.elsewhere.is_none()),
            "{error:?}"
        );
        assert_eq!(order.pending_events().len(), 2);

        diesel::connection::SimpleConnection::batch_execute(&mut bare, "CREATE SCHEMA orders")
            .unwrap();
        tokio::runtime::Handle::current()
            .block_on(outbox_runtime::run_migrations(&elsewhere_url))
            .unwrap();
        let error = outbox
            .sync_transaction(&mut bare, |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .unwrap_err();
        assert!(
            matches!(
                &error,
                UnitOfWorkError::MissingMigrations(missing)
                    if missing.elsewhere == Some(outbox_runtime::TablesElsewhere::Schemas {
                        schemas: vec!["orders".to_owned()],
                        search_path: "\"$user\", public".to_owned(),
                    })
            ),
            "{error:?}"
        );
        assert_eq!(order.pending_events().len(), 2);
    })
    .await
    .unwrap();
    assert_eq!(SyncPg::rows(&env).await.len(), 2);
}

#[cfg(feature = "postgres-sync")]
/// A sync unit of work of up to 64 events writes them with its COMMIT, in one round trip,
/// and values that look like SQL are stored as they are either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_unit_of_work_writes_its_events_in_the_commits_round_trip() {
    const LOOKALIKES: [&str; 11] = [
        "it's",
        r"back\slash",
        r"\'",
        "''",
        "$$",
        "E'x'",
        "--",
        ";COMMIT;",
        "NULL",
        "{a,b}",
        r#"\""#,
    ];
    let env = SyncPg::setup().await;
    let (url, outbox) = (env.database_url.clone(), env.outbox());
    tokio::task::spawn_blocking(move || {
        use diesel::prelude::*;
        let mut conn = diesel::PgConnection::establish(&url).expect("a sync connection");
        let sent = support::SentStatements::default();
        conn.set_instrumentation(sent.clone());
        // 11 events with the COMMIT; then 11 x 13 = 143, in a statement of their own.
        for (n, events_per_order) in [(0, 1), (1, 13)] {
            let mut orders: Vec<Order> = LOOKALIKES
                .iter()
                .map(|lookalike| {
                    let mut order = Order::place(&format!("o{n}{lookalike}"), lookalike, 1);
                    for _ in 1..events_per_order {
                        order.record(OrderEvent::Shipped);
                    }
                    order
                })
                .collect();
            outbox
                .sync_transaction(&mut conn, |uow| {
                    for order in &mut orders {
                        uow.track(order);
                    }
                    Ok::<_, UnitOfWorkError>(())
                })
                .unwrap();
            let shapes = sent.take_shapes();
            let expected: &[&str] = if n == 0 {
                &["BEGIN", "the events with COMMIT"]
            } else {
                &["BEGIN", "the events", "COMMIT"]
            };
            assert_eq!(
                shapes,
                expected,
                "{} events",
                orders.len() * events_per_order
            );
        }
        let stored: Vec<(String, String)> = outbox_events::table
            .filter(outbox_events::event_type.eq("Placed"))
            .select((
                outbox_events::aggregate_id,
                diesel::dsl::sql::<diesel::sql_types::Text>("payload::text"),
            ))
            .order(outbox_events::aggregate_id)
            .load(&mut conn)
            .unwrap();
        let mut expected: Vec<(String, String)> = (0..2)
            .flat_map(|n| {
                LOOKALIKES.iter().map(move |lookalike| {
                    (
                        format!("o{n}{lookalike}"),
                        format!(
                            r#"{{"customer":{},"total_cents":1}}"#,
                            serde_json::to_string(lookalike).unwrap()
                        ),
                    )
                })
            })
            .collect();
        expected.sort();
        assert_eq!(stored, expected);
    })
    .await
    .unwrap();
    assert_eq!(SyncPg::rows(&env).await.len(), 11 + 11 * 13);
}

/// The MySQL / MariaDB backend: a database of its own per test, migrated with
/// `outbox_runtime::mysql::run_migrations`; the stream and prefix come from the test kit.
#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use diesel::QueryableByName;
    use diesel::sql_types::{BigInt, Integer, Text};
    use outbox_runtime::diesel_async::{AsyncConnection, AsyncMysqlConnection, RunQueryDsl};
    use outbox_runtime::mysql::MysqlRelay;
    use outbox_runtime::privileges::{self, Component};

    tokio::task_local! {
        /// The server a test body's environments are made on, where a test runs bodies on a
        /// server of its own ([`on_a_server_of_its_own`]).
        static SERVER_URL: String;
    }

    /// The server's URL in [`SERVER_URL`]'s scope; else `OUTBOX_TEST_MYSQL_URL`, or the local
    /// server's `test` database.
    fn admin_url() -> String {
        SERVER_URL.try_with(Clone::clone).unwrap_or_else(|_| {
            std::env::var("OUTBOX_TEST_MYSQL_URL")
                .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
        })
    }

    /// Runs `bodies` one after another, their environments made on `server` (`setup` of
    /// [`AsyncMysql`] and [`SyncMysql`]).
    async fn on_a_server_of_its_own(
        server: &support::mariadb::MariadbServer,
        bodies: impl Future<Output = ()>,
    ) {
        SERVER_URL.scope(server.url("mysql"), bodies).await;
    }

    /// A throwaway MySQL database, dropped with the value.
    pub struct Database {
        pub url: String,
        name: String,
        /// The URL of the server's database to drop it from.
        admin_url: String,
    }

    impl Database {
        async fn create() -> Self {
            Self::create_on(admin_url()).await
        }

        /// A database on the server of `admin_url`, migrated.
        async fn create_on(admin_url: String) -> Self {
            let database = Self::unmigrated_on(admin_url).await;
            outbox_runtime::mysql::run_migrations(&database.url)
                .await
                .unwrap_or_else(|e| panic!("the MySQL migrations on {}: {e}", database.name));
            database
        }

        /// A database on the server of `admin_url`, without the outbox tables.
        async fn unmigrated_on(admin_url: String) -> Self {
            let name = format!(
                "outbox_test_{}",
                &uuid::Uuid::new_v4().simple().to_string()[..16]
            );
            let mut admin = outbox_runtime::mysql::establish(&admin_url)
                .await
                .unwrap_or_else(|e| panic!("MySQL at {admin_url} is not reachable: {e}"));
            admin
                .batch_execute(&format!("CREATE DATABASE {name}"))
                .await
                .unwrap();
            let (path, query) = admin_url.split_once('?').unwrap_or((&admin_url, ""));
            let Some((server, _)) = path.rsplit_once('/') else {
                panic!("OUTBOX_TEST_MYSQL_URL has no database part: {admin_url}");
            };
            let url = if query.is_empty() {
                format!("{server}/{name}")
            } else {
                format!("{server}/{name}?{query}")
            };
            Self {
                url,
                name,
                admin_url,
            }
        }

        /// A connection as a service's own: see [`services_connection`].
        pub async fn conn(&self) -> AsyncMysqlConnection {
            services_connection(&self.url)
                .await
                .unwrap_or_else(|e| panic!("connect to {}: {e}", self.name))
        }
    }

    /// A connection to `url` as a service opens its own, for its units of work and the
    /// tests' fixtures: the toolkit's `mysql::establish` (whose `autocommit = 1` the fixtures'
    /// statements take as given), in the server's own error language (`lc_messages`), which
    /// the toolkit's sessions set to English and a service's keeps.
    async fn services_connection(url: &str) -> diesel::ConnectionResult<AsyncMysqlConnection> {
        let mut conn = outbox_runtime::mysql::establish(url).await?;
        conn.batch_execute("SET SESSION lc_messages = @@GLOBAL.lc_messages")
            .await
            .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
        Ok(conn)
    }

    impl Drop for Database {
        fn drop(&mut self) {
            clean_up(
                &self.admin_url,
                format!("DROP DATABASE IF EXISTS {}", self.name),
            );
        }
    }

    /// Runs `statement` on the server of `admin_url`, on a runtime of its own (a test's may be
    /// blocked in the drop that calls it), ignoring its failure: a clean-up.
    fn clean_up(admin_url: &str, statement: String) {
        let admin_url = admin_url.to_owned();
        let cleanup = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                if let Ok(mut admin) = outbox_runtime::mysql::establish(&admin_url).await {
                    let _ = admin.batch_execute(&statement).await;
                }
            });
        });
        let _ = cleanup.join();
    }

    fn database(env: &Env) -> &Database {
        env.mysql.as_ref().expect("a MySQL environment")
    }

    pub struct AsyncMysql;

    impl Consumed for AsyncMysql {
        const APPLIED_TABLE: &'static str = "CREATE TABLE applied (n BIGINT AUTO_INCREMENT \
             PRIMARY KEY, aggregate VARCHAR(64) NOT NULL, seq BIGINT NOT NULL)";

        async fn apply(
            conn: &mut AsyncMysqlConnection,
            aggregate: &str,
            seq: i64,
        ) -> diesel::QueryResult<usize> {
            diesel::sql_query("INSERT INTO applied (aggregate, seq) VALUES (?, ?)")
                .bind::<Text, _>(aggregate)
                .bind::<BigInt, _>(seq)
                .execute(conn)
                .await
        }

        async fn applied(env: &Env) -> BTreeMap<String, Vec<i64>> {
            let rows = diesel::sql_query("SELECT aggregate, seq FROM applied ORDER BY n")
                .load(&mut database(env).conn().await)
                .await
                .unwrap();
            by_aggregate(rows)
        }

        async fn count(env: &Env, table: &str) -> i64 {
            let row: Count = diesel::sql_query(format!("SELECT COUNT(*) AS n FROM {table}"))
                .get_result(&mut database(env).conn().await)
                .await
                .unwrap();
            row.n
        }

        async fn inbox_dead_letters(env: &Env) -> Vec<(String, String)> {
            let rows: Vec<InboxDeadLetter> = diesel::sql_query(
                "SELECT CAST(message_id AS CHAR) AS message_id, error \
                 FROM outbox_inbox_dead_letters ORDER BY message_id",
            )
            .load(&mut database(env).conn().await)
            .await
            .unwrap();
            rows.into_iter().map(|r| (r.message_id, r.error)).collect()
        }
    }

    impl Operated for AsyncMysql {
        type Conn = AsyncMysqlConnection;

        async fn operator_conn(env: &Env) -> AsyncMysqlConnection {
            database(env).conn().await
        }

        async fn archived(env: &Env) -> Vec<Archived> {
            diesel::sql_query(archived_sql("id", "payload"))
                .load(&mut database(env).conn().await)
                .await
                .unwrap()
        }
    }

    impl PurgedByRow for AsyncMysql {
        async fn purge_archived(
            conn: &mut AsyncMysqlConnection,
            older_than: Duration,
            batch: i64,
            progress: impl FnMut(usize) + Send,
        ) -> diesel::QueryResult<usize> {
            outbox_runtime::mysql::purge_archived(conn, older_than, batch, progress).await
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_purge_of_the_archive_deletes_only_old_rows() {
        super::a_purge_of_the_archive_deletes_only_old_rows::<AsyncMysql>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_unit_of_work_dropped_part_way_on_a_pooled_connection_leaves_nothing_locked() {
        use diesel_async::pooled_connection::AsyncDieselConnectionManager;
        use diesel_async::pooled_connection::deadpool::Pool;

        let env = AsyncMysql::setup().await;
        let manager =
            AsyncDieselConnectionManager::<AsyncMysqlConnection>::new(&database(&env).url);
        let pool = Pool::builder(manager).max_size(2).build().unwrap();
        super::dropped_part_way_on_a_pooled_connection::<AsyncMysql, _, _>(&env, async || {
            outbox_runtime::Pooled::get(&pool).await
        })
        .await;
    }

    impl AsyncMysql {
        /// A fresh environment with an `orders` table, its stream on the broker at `nats_url`.
        async fn setup_on(nats_url: &str) -> Env {
            Self::setup_with(nats_url, Database::create().await).await
        }

        /// The same, on the MySQL database `mysql`.
        async fn setup_with(nats_url: &str, mysql: Database) -> Env {
            let env = TestEnv::unmigrated(nats_url).await;
            mysql
                .conn()
                .await
                .batch_execute("CREATE TABLE orders (id VARCHAR(64))")
                .await
                .unwrap();
            Env {
                env,
                mysql: Some(mysql),
                #[cfg(feature = "sqlite")]
                sqlite: None,
                transaction_ids: false,
                max_payload: outbox_runtime::DEFAULT_MAX_PAYLOAD_BYTES,
            }
        }
    }

    impl Backend for AsyncMysql {
        async fn setup() -> Env {
            Self::setup_on(&support::nats_url()).await
        }

        fn server(env: &Env) -> std::net::SocketAddr {
            server_of(&database(env).url)
        }

        fn connect_through(env: &mut Env, port: u16) {
            let database = env.mysql.as_mut().expect("a MySQL environment");
            database.url = through(&database.url, port);
        }

        async fn kill_other_sessions(env: &Env) -> usize {
            #[derive(QueryableByName)]
            struct Session {
                #[diesel(sql_type = BigInt)]
                id: i64,
            }
            let mut conn = database(env).conn().await;
            let sessions: Vec<Session> = diesel::sql_query(
                "SELECT CAST(ID AS SIGNED) AS id FROM information_schema.PROCESSLIST \
                 WHERE DB = DATABASE() AND ID <> CONNECTION_ID()",
            )
            .load(&mut conn)
            .await
            .unwrap();
            let mut killed = 0;
            for session in sessions {
                // A session may have ended since the listing.
                if conn
                    .batch_execute(&format!("KILL CONNECTION {}", session.id))
                    .await
                    .is_ok()
                {
                    killed += 1;
                }
            }
            killed
        }

        async fn commit(
            env: &Env,
            mut orders: Vec<Order>,
            dedup_key: Option<String>,
            end: End,
        ) -> (Vec<Order>, Result<(), UnitOfWorkError>) {
            let mut conn = database(env).conn().await;
            let result = env
                .outbox()
                .transaction(&mut conn, async |uow| {
                    // A read first, as business code does: under REPEATABLE READ it fixes the
                    // transaction's snapshot before the outbox numbers the events. Of a table
                    // no unit of work writes: under SERIALIZABLE, whose reads take shared
                    // locks, one of `orders` would deadlock the fixture's own inserts there
                    // (`the_contract_holds_under_an_operators_isolation_levels`).
                    diesel::sql_query("SELECT COUNT(*) AS n FROM __diesel_schema_migrations")
                        .execute(uow.conn())
                        .await?;
                    for order in &mut orders {
                        diesel::sql_query("INSERT INTO orders VALUES (?)")
                            .bind::<Text, _>(&order.id)
                            .execute(uow.conn())
                            .await?;
                        uow.track(order);
                    }
                    if let Some(request) = dedup_key {
                        uow.emit("Invoice", "i-1", &Invoiced { request });
                    }
                    match end {
                        End::Fail => return Err(diesel::result::Error::RollbackTransaction.into()),
                        End::Send(statement) => uow.conn().batch_execute(statement).await?,
                        End::Ok => {}
                    }
                    Ok(())
                })
                .await;
            (orders, result)
        }

        async fn rows(env: &Env) -> Vec<(String, i64)> {
            #[derive(QueryableByName)]
            struct Row {
                #[diesel(sql_type = Text)]
                aggregate_id: String,
                #[diesel(sql_type = BigInt)]
                aggregate_seq: i64,
            }
            diesel::sql_query(
                "SELECT aggregate_id, aggregate_seq FROM outbox_events \
                 WHERE aggregate_type = 'Order' ORDER BY aggregate_id, aggregate_seq",
            )
            .load::<Row>(&mut database(env).conn().await)
            .await
            .unwrap()
            .into_iter()
            .map(|row| (row.aggregate_id, row.aggregate_seq))
            .collect()
        }

        async fn stats(env: &Env) -> OutboxStats {
            outbox_runtime::mysql::stats(&mut database(env).conn().await)
                .await
                .unwrap()
        }

        async fn business_rows(env: &Env) -> i64 {
            #[derive(QueryableByName)]
            struct Count {
                #[diesel(sql_type = BigInt)]
                n: i64,
            }
            diesel::sql_query("SELECT COUNT(*) AS n FROM orders")
                .get_result::<Count>(&mut database(env).conn().await)
                .await
                .unwrap()
                .n
        }

        async fn execute(env: &Env, statement: &str) {
            let statement = statement.replace("{prefix}", &env.prefix);
            database(env)
                .conn()
                .await
                .batch_execute(&statement)
                .await
                .unwrap();
        }

        async fn try_execute(env: &Env, statement: &str) -> Result<(), String> {
            let statement = statement.replace("{prefix}", &env.prefix);
            database(env)
                .conn()
                .await
                .batch_execute(&statement)
                .await
                .map_err(|e| e.to_string())
        }

        async fn dead_letters(env: &Env) -> Vec<(String, i64, i32)> {
            #[derive(QueryableByName)]
            struct Dead {
                #[diesel(sql_type = Text)]
                aggregate_id: String,
                #[diesel(sql_type = BigInt)]
                aggregate_seq: i64,
                #[diesel(sql_type = Integer)]
                attempts: i32,
            }
            diesel::sql_query(
                "SELECT aggregate_id, aggregate_seq, attempts FROM outbox_events \
                 WHERE dead_lettered_at IS NOT NULL ORDER BY aggregate_id",
            )
            .load::<Dead>(&mut database(env).conn().await)
            .await
            .unwrap()
            .into_iter()
            .map(|d| (d.aggregate_id, d.aggregate_seq, d.attempts))
            .collect()
        }

        fn relay_config(env: &Env) -> RelayConfig {
            let mut config = env.relay_config();
            config.database_url = database(env).url.clone();
            config
        }

        async fn relay_all(env: &Env) {
            let mut relay = MysqlRelay::connect(Self::relay_config(env), env.nats.clone())
                .await
                .unwrap();
            while relay.relay_batch().await.unwrap().claimed > 0 {}
        }

        async fn relay_once(env: &Env) -> Result<usize, String> {
            let mut relay = MysqlRelay::connect(Self::relay_config(env), env.nats.clone())
                .await
                .unwrap();
            relay
                .relay_batch()
                .await
                .map(|report| report.claimed)
                .map_err(|e| e.to_string())
        }

        const BLOCK_DELETES: [&str; 2] = [
            "CREATE TRIGGER outbox_test_no_delete BEFORE DELETE ON outbox_events FOR EACH ROW \
                 SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'deletes blocked by the test'",
            "DROP TRIGGER outbox_test_no_delete",
        ];

        async fn spawn_relay(env: &Env, config: RelayConfig) -> RelayHandle {
            MysqlRelay::connect(config, env.nats.clone())
                .await
                .unwrap()
                .spawn()
        }
    }

    /// What writers were told of their units of work.
    #[derive(Default)]
    struct Told {
        committed: Vec<String>,
        rolled_back: Vec<String>,
        unknown: Vec<String>,
    }

    /// A MariaDB crash under writers and a relay (a server of the test's own, SIGKILLed;
    /// InnoDB recovers from its redo log): every unit of work told "committed" keeps its row
    /// and its events, none told "rolled back" left either, and one whose COMMIT the crash
    /// cut off (`CommitOutcomeUnknown`) went one way with both; the relay reconnects, and the
    /// stream ends holding exactly the events of the rows, each once, each aggregate's in
    /// order, with the queue empty.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_mariadb_crash_loses_no_committed_event_and_publishes_each_once_in_order() {
        use std::collections::BTreeSet;
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::Instant;
        const WRITERS: usize = 3;
        let mut server = support::mariadb::MariadbServer::start().await;
        let mysql = Database::create_on(server.url("mysql")).await;
        let env = Arc::new(AsyncMysql::setup_with(&support::nats_url(), mysql).await);
        let mut config = AsyncMysql::relay_config(&env);
        config.max_backoff = Duration::from_millis(200);
        let relay = AsyncMysql::spawn_relay(&env, config).await;
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..WRITERS)
            .map(|writer| {
                let (env, stop) = (Arc::clone(&env), Arc::clone(&stop));
                tokio::spawn(async move {
                    let mut told = Told::default();
                    let mut n = 0;
                    while !AtomicBool::load(&stop, Ordering::SeqCst) {
                        let Ok(mut conn) =
                            AsyncMysqlConnection::establish(&database(&env).url).await
                        else {
                            // The server is down.
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        };
                        let id = format!("w{writer}-{n}");
                        n += 1;
                        let mut order = shipped(&id);
                        let result = env
                            .outbox()
                            .transaction(&mut conn, async |uow| {
                                diesel::sql_query("INSERT INTO orders VALUES (?)")
                                    .bind::<Text, _>(&id)
                                    .execute(uow.conn())
                                    .await?;
                                uow.track(&mut order);
                                Ok::<_, UnitOfWorkError>(())
                            })
                            .await;
                        match result {
                            Ok(()) => told.committed.push(id),
                            Err(UnitOfWorkError::CommitOutcomeUnknown { .. }) => {
                                told.unknown.push(id);
                            }
                            Err(_) => told.rolled_back.push(id),
                        }
                    }
                    told
                })
            })
            .collect();

        support::wait_until(
            "100 events in the stream before the crash",
            Duration::from_secs(30),
            || async { (env.stream_len().await >= 100).then_some(()) },
        )
        .await;
        server.crash();
        let at_crash = env.stream_len().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        server.restart().await;
        let restarted = Instant::now();
        support::poll_until(
            "the relay publishing again after the restart",
            Duration::from_secs(30),
            Duration::from_millis(5),
            || async { (env.stream_len().await > at_crash).then_some(()) },
        )
        .await;
        let published_again = restarted.elapsed();
        support::wait_until(
            "100 more events in the stream after the restart",
            Duration::from_secs(30),
            || async { (env.stream_len().await >= at_crash + 100).then_some(()) },
        )
        .await;
        stop.store(true, Ordering::SeqCst);
        let mut told = Told::default();
        for writer in writers {
            let writer = writer.await.unwrap();
            told.committed.extend(writer.committed);
            told.rolled_back.extend(writer.rolled_back);
            told.unknown.extend(writer.unknown);
        }
        support::wait_until("the queue empty", Duration::from_secs(60), || async {
            AsyncMysql::rows(&env).await.is_empty().then_some(())
        })
        .await;
        relay.shutdown().await.unwrap();

        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = Text)]
            id: String,
        }
        let rows: BTreeSet<String> = diesel::sql_query("SELECT id FROM orders")
            .load::<Row>(&mut database(&env).conn().await)
            .await
            .unwrap()
            .into_iter()
            .map(|row| row.id)
            .collect();
        let lost: Vec<&String> = told
            .committed
            .iter()
            .filter(|id| !rows.contains(*id))
            .collect();
        assert!(
            lost.is_empty(),
            "committed, then lost by the crash: {lost:?}"
        );
        let ghosts: Vec<&String> = told
            .rolled_back
            .iter()
            .filter(|id| rows.contains(*id))
            .collect();
        assert!(
            ghosts.is_empty(),
            "told rolled back, yet written: {ghosts:?}"
        );
        let sequences = support::sequences(&env.stream_messages().await);
        assert_eq!(
            sequences.keys().cloned().collect::<BTreeSet<_>>(),
            rows,
            "the stream holds the events of exactly the committed rows"
        );
        for (aggregate, seqs) in &sequences {
            assert_eq!(
                seqs,
                &[1, 2],
                "aggregate {aggregate}: each event once, in order"
            );
        }
        println!(
            "MariaDB crashed with {at_crash} events in the stream; the relay published again \
             {published_again:.2?} after the restart; units of work: {} committed, {} rolled \
             back, {} of unknown outcome ({} of those committed)",
            told.committed.len(),
            told.rolled_back.len(),
            told.unknown.len(),
            told.unknown.iter().filter(|id| rows.contains(*id)).count()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_relay_is_woken_by_each_commit_of_its_process() {
        super::an_idle_relay_is_woken_by_each_commit_of_its_process::<AsyncMysql>().await;
    }

    /// Commits one event (two rows) on `env`, then relays one batch through the NATS server
    /// on `nats_port` frozen for `frozen` (a proxy; `ack_timeout` a minute), and checks that
    /// its publishes waited and the batch committed.
    async fn one_batch_through_a_frozen_broker(env: &Env, nats_port: u16, frozen: Duration) {
        AsyncMysql::commit(env, vec![shipped("o-1")], None, End::Ok)
            .await
            .1
            .unwrap();
        let proxy = support::Proxy::start(([127, 0, 0, 1], nats_port).into()).await;
        let slow = outbox_runtime::nats::connect(&format!("nats://127.0.0.1:{}", proxy.port))
            .await
            .unwrap();
        let mut config = AsyncMysql::relay_config(env);
        config.ack_timeout = Duration::from_secs(60);
        let mut relay = MysqlRelay::connect(config, slow).await.unwrap();
        proxy.freeze(true);
        let thaw = tokio::spawn(async move {
            tokio::time::sleep(frozen).await;
            proxy.freeze(false);
            proxy
        });
        let started = std::time::Instant::now();
        let report = relay.relay_batch().await.unwrap();
        let took = started.elapsed();
        let _proxy = thaw.await.unwrap();
        assert!(
            took > frozen - Duration::from_secs(1),
            "the publishes waited: {took:?}"
        );
        assert_eq!((report.claimed, report.published), (2, 2), "{report:?}");
        assert_eq!(
            AsyncMysql::stats(env).await.queued,
            0,
            "the batch committed"
        );
    }

    /// A batch whose publishes take longer than its session's `wait_timeout` (a broker slow to
    /// ack: 25 s here, against 21 s) keeps its session: the relay sends it a statement
    /// meanwhile, and the batch commits what was acked.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_slower_than_its_sessions_wait_timeout_keeps_its_session() {
        let server = support::NatsServer::start().await;
        let env = AsyncMysql::setup_on(&server.url()).await;
        one_batch_through_a_frozen_broker(&env, server.port, Duration::from_secs(25)).await;
    }

    /// A MariaDB server of the test's own (dropped, it stops: after the environment, so
    /// bind it first) whose operator ran `settings` (`SET GLOBAL ...`), and an environment
    /// on it, with NATS at `nats_url`.
    async fn a_server_whose_operator_set(
        settings: &str,
        nats_url: &str,
    ) -> (support::mariadb::MariadbServer, Env) {
        let server = a_server_set(settings).await;
        let mysql = Database::create_on(server.url("mysql")).await;
        (server, AsyncMysql::setup_with(nats_url, mysql).await)
    }

    /// A MariaDB server of the test's own whose operator ran `settings`.
    async fn a_server_set(settings: &str) -> support::mariadb::MariadbServer {
        let server = support::mariadb::MariadbServer::start().await;
        AsyncMysqlConnection::establish(&server.url("mysql"))
            .await
            .unwrap()
            .batch_execute(settings)
            .await
            .unwrap();
        server
    }

    /// As [`a_server_whose_operator_set`], `idle_transaction_timeout` set to `seconds`.
    async fn idle_transactions_cut_after(
        seconds: u32,
        nats_url: &str,
    ) -> (support::mariadb::MariadbServer, Env) {
        let settings = format!("SET GLOBAL idle_transaction_timeout = {seconds}");
        a_server_whose_operator_set(&settings, nats_url).await
    }

    /// Runs `hold` on a session of its own, then one relay batch, and ends the hold (`end`)
    /// after `held` from another task: the batch's report, once it checked that the batch
    /// waited for the hold.
    async fn one_batch_behind(
        env: &Env,
        relay: &mut MysqlRelay,
        (hold, end): (&str, &'static str),
        held: Duration,
    ) -> outbox_runtime::BatchReport {
        let mut holder = database(env).conn().await;
        holder.batch_execute(hold).await.unwrap();
        let since = std::time::Instant::now();
        let release = tokio::spawn(async move {
            tokio::time::sleep(held).await;
            holder.batch_execute(end).await.unwrap();
        });
        let report = relay.relay_batch().await;
        release.await.unwrap();
        let report = report.unwrap_or_else(|e| panic!("the batch behind `{hold}` failed: {e}"));
        assert!(
            since.elapsed() >= held,
            "the batch did not wait for `{hold}`: it proves nothing"
        );
        report
    }

    /// The server's `sql_mode` an operator may set: MySQL 8.0's default (`ONLY_FULL_GROUP_BY`,
    /// strict, no zero dates; MySQL 8.0 docs, "Server SQL Modes"; MariaDB's default has no
    /// `ONLY_FULL_GROUP_BY`), with `STRICT_ALL_TABLES`, and the modes that change how a
    /// statement reads: `ANSI_QUOTES` (a double-quoted string is a name),
    /// `NO_BACKSLASH_ESCAPES` and `PIPES_AS_CONCAT`.
    const STRICTEST_SQL_MODE: &str = "ONLY_FULL_GROUP_BY,STRICT_TRANS_TABLES,STRICT_ALL_TABLES,\
        NO_ZERO_IN_DATE,NO_ZERO_DATE,ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION,\
        ANSI_QUOTES,NO_BACKSLASH_ESCAPES,PIPES_AS_CONCAT";

    /// The toolkit's MySQL statements under [`STRICTEST_SQL_MODE`], set globally on a server of
    /// the test's own: the contract's bodies that run each kind of them (units of work, async
    /// and sync, their dedup keys and rows inserted by hand; the relay's claim, rejection,
    /// dead letter, archive and stats; the operator's retry, skip and purges; the inbox's
    /// record, position, gap and dead letters) hold as on the server's default.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_contract_holds_under_an_operators_strictest_sql_mode() {
        let server = a_server_set(&format!("SET GLOBAL sql_mode = '{STRICTEST_SQL_MODE}'")).await;
        #[derive(QueryableByName)]
        struct Mode {
            #[diesel(sql_type = Text)]
            mode: String,
        }
        on_a_server_of_its_own(&server, async {
            let env = AsyncMysql::setup().await;
            let Mode { mode } = diesel::sql_query("SELECT @@SESSION.sql_mode AS mode")
                .get_result(&mut database(&env).conn().await)
                .await
                .unwrap();
            assert!(
                mode.contains("ANSI_QUOTES") && mode.contains("ONLY_FULL_GROUP_BY"),
                "the environments' sessions run under the mode: {mode}"
            );
            super::committed_units_of_work_become_exactly_the_expected_messages::<AsyncMysql>()
                .await;
            super::committed_units_of_work_become_exactly_the_expected_messages::<SyncMysql>()
                .await;
            super::a_unit_of_work_numbers_after_rows_inserted_by_hand::<AsyncMysql>().await;
            super::a_rejected_message_is_dead_lettered_while_the_others_flow::<AsyncMysql>().await;
            super::a_row_the_relay_could_not_read_is_refused_where_it_is_written::<AsyncMysql>()
                .await;
            super::an_operator_retries_and_skips_dead_letters::<AsyncMysql>().await;
            super::a_purge_deletes_only_old_published_rows_and_dedup_keys::<AsyncMysql>().await;
            super::the_archive_keeps_each_published_row_whole::<AsyncMysql>().await;
            super::an_inbox_applies_each_event_once_in_order::<AsyncMysql>().await;
            super::an_inbox_dead_letters_a_failing_handlers_event_and_its_aggregate_moves_on::<
                AsyncMysql,
            >()
            .await;
            super::an_inbox_applies_an_event_after_a_gap_in_the_stream_and_records_the_gap::<
                AsyncMysql,
            >()
            .await;
        })
        .await;
    }

    /// A server whose operator turned `autocommit` off (global, on a server of the test's
    /// own; MySQL docs, "autocommit, Commit, and Rollback"): the toolkit's sessions commit
    /// each statement they run outside a transaction all the same. While a relay (its gauges
    /// read every 50 ms) and an inbox run, a migration's DDL on the outbox's tables goes
    /// through (an `ALTER TABLE` each, within 5 s), and a purge's deletes are there for every
    /// other session. Before, a session's first statement outside a transaction opened one
    /// that nothing ended: the relay's gauges session held its tables' metadata locks for
    /// ever, so the DDL waited out its `lock_wait_timeout` ("Lock wait timeout exceeded"),
    /// and the purge's deletes were rolled back when its session closed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_toolkits_sessions_commit_under_an_operators_autocommit_off() {
        let (_server, env) =
            a_server_whose_operator_set("SET GLOBAL autocommit = 0", &support::nats_url()).await;
        <AsyncMysql as Backend>::execute(&env, <AsyncMysql as Consumed>::APPLIED_TABLE).await;
        let (_, result) =
            AsyncMysql::commit(&env, vec![shipped("o-1")], Some("r-1".into()), End::Ok).await;
        result.unwrap();
        let mut config = AsyncMysql::relay_config(&env);
        config.stats_interval = Duration::from_millis(50);
        let relay = AsyncMysql::spawn_relay(&env, config).await;
        env.until_stream_holds(2, Duration::from_secs(10)).await;
        let inbox: Inbox<Applier<AsyncMysql>, AsyncMysqlConnection> = Inbox::connect(
            super::inbox_config::<AsyncMysql>(&env, "autocommit"),
            env.nats.clone(),
            Applier::new(),
        )
        .await
        .unwrap();
        let probe = inbox.clone();
        let inbox = inbox.spawn();
        support::consumer::wait_until_settled(
            &probe,
            "the events applied",
            Duration::from_secs(10),
        )
        .await;
        // The gauges read a few times more.
        tokio::time::sleep(Duration::from_millis(300)).await;

        // Checked once the relay and the inbox stopped: a failure must not leave their
        // sessions holding the database that the environment drops.
        let mut operator = database(&env).conn().await;
        operator
            .batch_execute("SET SESSION lock_wait_timeout = 5")
            .await
            .unwrap();
        let mut refused = Vec::new();
        for table in ["outbox_events", "outbox_aggregates", "outbox_inbox"] {
            let ddl = format!("ALTER TABLE {table} COMMENT = 'migrated'");
            if let Err(error) = operator.batch_execute(&ddl).await {
                refused.push(format!("a migration's DDL on {table}: {error}"));
            }
        }
        drop(operator);
        let mut purging = database(&env).conn().await;
        let purged =
            outbox_runtime::outbox::purge_dedup_keys(&mut purging, Duration::ZERO, 100).await;
        drop(purging);
        inbox.shutdown().await.unwrap();
        relay.shutdown().await.unwrap();
        assert_eq!(purged.unwrap(), 1, "the unit of work's dedup key");
        let kept = <AsyncMysql as Consumed>::count(&env, "outbox_dedup_keys").await;
        if kept != 0 {
            refused.push(format!("the purge's deletes, rolled back: {kept} key kept"));
        }
        assert!(refused.is_empty(), "{refused:#?}");
        assert_eq!(<AsyncMysql as Consumed>::applied(&env).await.len(), 1);
    }

    /// A server that words its errors in another language (an operator's `lc_messages`,
    /// German here, on a server of the test's own): a unit of work whose closure ends its
    /// transaction by hand, async or sync, fails with `TransactionEnded` all the same, and an
    /// inbox handler that does so fails as the handler's, its attempts counted up to a dead
    /// letter. Before, the toolkit read MariaDB's English words for the missing savepoint
    /// ("SAVEPOINT outbox_unit_of_work does not exist"); under German ones ("... existiert
    /// nicht") a closure that had committed by hand was reported rolled back (`Database`),
    /// and the inbox took such a handler for the database failing: it counted no attempt and
    /// redelivered the message for ever. (The inbox's sessions have since taken English words,
    /// `mysql::establish`; a service's own connection, the units of work's here, keeps the
    /// server's language.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transaction_ended_by_hand_is_told_in_any_language_of_the_servers() {
        let server = a_server_set("SET GLOBAL lc_messages = 'de_DE'").await;
        on_a_server_of_its_own(&server, async {
            let env = AsyncMysql::setup().await;
            let mut conn = database(&env).conn().await;
            let german = conn
                .batch_execute("RELEASE SAVEPOINT nowhere")
                .await
                .expect_err("no such savepoint")
                .to_string();
            assert!(
                german.contains("existiert nicht"),
                "the server words its errors in German: {german}"
            );
            super::a_transaction_ended_inside_the_closure_writes_no_ghost_event::<AsyncMysql>()
                .await;
            super::a_transaction_ended_inside_the_closure_writes_no_ghost_event::<SyncMysql>()
                .await;
            super::an_inbox_replays_its_consumers_dead_letters_oldest_first::<AsyncMysql>().await;
        })
        .await;
    }

    /// The MySQL migrations name what keeps them from the database, as PostgreSQL's do: a
    /// URL without a database (`mysql://host:3306`) is refused before connecting, and a
    /// server that cannot be reached or refuses the account is named without the URL's
    /// password, as a connect error. Before, each was "an outbox migration failed: No
    /// database selected" (or the driver's words alone, "Connection refused", "Access
    /// denied"), and a URL without a database went as far as the migrations; `outbox status`
    /// said to run them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_migrations_name_a_url_without_a_database_and_a_server_they_cannot_reach() {
        let admin = admin_url();
        let (server, database) = admin.rsplit_once('/').expect("a database in the URL");
        for url in [server.to_owned(), format!("{server}/")] {
            let error = outbox_runtime::mysql::run_migrations(&url)
                .await
                .expect_err("no database");
            assert!(
                matches!(error, outbox_runtime::MigrationError::Connect(_)),
                "{url}: {error:?}"
            );
            assert!(
                error.to_string().ends_with(
                    "the URL names no database, where the outbox's tables are: \
                     mysql://user@host:3306/<database>"
                ),
                "{url}: {error}"
            );
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let unreachable = format!("mysql://app:s3cret-pw@127.0.0.1:{port}/orders");
        // An account the server does not know, on the test's server.
        let stranger = format!(
            "outbox_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let host = server
            .rsplit_once(['@', '/'])
            .map_or(server, |(_, host)| host);
        let refused = format!("mysql://{stranger}:s3cret-pw@{host}/{database}");
        for (url, shown, why) in [
            (
                unreachable,
                format!("mysql://app@127.0.0.1:{port}/orders"),
                "nothing listens",
            ),
            (
                refused,
                format!("mysql://{stranger}@{host}/{database}"),
                "no such account",
            ),
        ] {
            let error = outbox_runtime::mysql::run_migrations(&url)
                .await
                .expect_err(why);
            let text = error.to_string();
            assert!(
                matches!(error, outbox_runtime::MigrationError::Connect(_))
                    && text.starts_with(&format!(
                        "cannot run the outbox migrations: cannot connect to the database at \
                         {shown}: "
                    ))
                    && !text.contains("s3cret-pw"),
                "{why}: {text}"
            );
        }
    }

    /// A relay, an inbox and units of work (async and sync) given a database of the server
    /// that holds no outbox tables, where the service's database holds them: each names the
    /// databases that hold them and how to name one in the URL, beside what a new outbox there
    /// needs. Before, each said only to run the migrations, which there make a second, empty
    /// outbox that the service's units of work never write to. Migrated, the relay starts.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_database_without_the_outbox_names_those_of_the_server_that_hold_one() {
        use diesel::Connection as _;
        use outbox_runtime::{InboxError, MissingMigrations, RelayError, TablesElsewhere};

        let env = AsyncMysql::setup().await;
        env.create_stream(Duration::from_secs(120)).await;
        let holder = database(&env).name.clone();
        let bare = Database::unmigrated_on(admin_url()).await;
        let check = |missing: &MissingMigrations| {
            match &missing.elsewhere {
                Some(TablesElsewhere::Databases {
                    databases,
                    database,
                }) => {
                    assert_eq!(database, &bare.name);
                    assert!(
                        databases.contains(&holder) && !databases.contains(&bare.name),
                        "{databases:?}"
                    );
                }
                other => panic!("{other:?}"),
            }
            let text = missing.to_string();
            assert!(
                text.starts_with("the outbox tables are not migrated: migrations 20261124000001, ")
                    && text.contains(&format!(
                        " outbox tables, not the URL's database {}: to use ",
                        bare.name
                    ))
                    && text.contains(", name it as the URL's database (`mysql://host/")
                    && text.ends_with(
                        "`), as the URL its migrations ran on did; to make a new one here, run \
                         the outbox migrations first (outbox_runtime::run_migrations(database_url), \
                         or outbox_runtime::MIGRATIONS with your own diesel migration harness)"
                    ),
                "{text}"
            );
        };
        let mut config = AsyncMysql::relay_config(&env);
        config.database_url = bare.url.clone();
        match MysqlRelay::connect(config.clone(), env.nats.clone()).await {
            Err(RelayError::MissingMigrations(missing)) => check(&missing),
            other => panic!("{:?}", other.err()),
        }
        let mut inbox = InboxConfig::new("elsewhere", &bare.url);
        inbox.topology = env.topology();
        match Inbox::<_, AsyncMysqlConnection>::connect(
            inbox,
            env.nats.clone(),
            Applier::<AsyncMysql>::new(),
        )
        .await
        {
            Err(InboxError::MissingMigrations(missing)) => check(&missing),
            other => panic!("{:?}", other.err()),
        }
        let mut order = shipped("o-1");
        match env
            .outbox()
            .transaction(&mut bare.conn().await, async |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
        {
            Err(UnitOfWorkError::MissingMigrations(missing)) => check(&missing),
            other => panic!("{other:?}"),
        }
        #[cfg(feature = "mysql-sync")]
        {
            let (url, outbox) = (bare.url.clone(), env.outbox());
            let missing = tokio::task::spawn_blocking(move || {
                let mut conn = diesel::MysqlConnection::establish(&url).unwrap();
                let mut order = shipped("o-2");
                match outbox.sync_transaction(&mut conn, |uow| {
                    uow.track(&mut order);
                    Ok::<_, UnitOfWorkError>(())
                }) {
                    Err(UnitOfWorkError::MissingMigrations(missing)) => missing,
                    other => panic!("{other:?}"),
                }
            })
            .await
            .unwrap();
            check(&missing);
        }

        outbox_runtime::mysql::run_migrations(&bare.url)
            .await
            .unwrap();
        MysqlRelay::connect(config, env.nats.clone())
            .await
            .expect("migrated, a new outbox there relays");
    }

    /// An operator's default isolation level (global `transaction_isolation`, on a server of
    /// the test's own for each): SERIALIZABLE, under which InnoDB's plain reads in a
    /// transaction take shared locks, and READ UNCOMMITTED, under which they see other
    /// transactions' uncommitted rows. Units of work (async and sync, on the service's own
    /// connections, in the server's level) racing on the same aggregates keep their sequences
    /// contiguous and never deadlock on the outbox's rows; three relays racing keep each
    /// aggregate in order; a rejection is dead-lettered while the rest flows; an inbox applies
    /// each event once, in order. (The relays' and the inbox's sessions run READ COMMITTED
    /// whatever the server's default.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_contract_holds_under_an_operators_isolation_levels() {
        for level in ["SERIALIZABLE", "READ-UNCOMMITTED"] {
            let server = a_server_set(&format!("SET GLOBAL tx_isolation = '{level}'")).await;
            #[derive(QueryableByName)]
            struct Level {
                #[diesel(sql_type = Text)]
                level: String,
            }
            on_a_server_of_its_own(&server, async {
                let env = AsyncMysql::setup().await;
                let Level { level: session } =
                    diesel::sql_query("SELECT @@SESSION.tx_isolation AS level")
                        .get_result(&mut database(&env).conn().await)
                        .await
                        .unwrap();
                assert_eq!(
                    session, level,
                    "a service's sessions run at the server's level"
                );
                super::committed_units_of_work_become_exactly_the_expected_messages::<AsyncMysql>()
                    .await;
                super::sequences_stay_contiguous_under_concurrent_units_of_work::<AsyncMysql>()
                    .await;
                super::sequences_stay_contiguous_under_concurrent_units_of_work::<SyncMysql>()
                    .await;
                super::three_relays_racing_keep_each_aggregate_in_order::<AsyncMysql>().await;
                super::a_rejected_message_is_dead_lettered_while_the_others_flow::<AsyncMysql>()
                    .await;
                super::an_inbox_applies_each_event_once_in_order::<AsyncMysql>().await;
            })
            .await;
        }
    }

    /// An operator's lock wait timeouts (global, 1 s here, on a server of the test's own;
    /// meant for the applications' sessions), shorter than a lock a relay's statement waits
    /// for (2 s): a `LOCK TABLES` over the claim (a metadata lock: `lock_wait_timeout`),
    /// then a transaction holding a rejected row's aggregate, as a unit of work does (a row
    /// lock: `innodb_lock_wait_timeout`). The relay's sessions wait as long as their
    /// `statement_timeout`, and each batch commits. Before, the claim failed ("Lock wait
    /// timeout exceeded"), and so did the rejection's record: a running relay logged its
    /// database as failing and reconnected with backoff.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_waits_out_a_lock_whatever_the_servers_lock_wait_timeouts() {
        const HELD: Duration = Duration::from_secs(2);
        let (_server, env) = a_server_whose_operator_set(
            "SET GLOBAL innodb_lock_wait_timeout = 1, GLOBAL lock_wait_timeout = 1",
            &support::nats_url(),
        )
        .await;
        AsyncMysql::commit(&env, vec![shipped("o-1")], None, End::Ok)
            .await
            .1
            .unwrap();
        let mut config = AsyncMysql::relay_config(&env);
        config.max_attempts = 1;
        let mut relay = MysqlRelay::connect(config, env.nats.clone()).await.unwrap();
        let tables = ("LOCK TABLES outbox_events WRITE", "UNLOCK TABLES");
        let report = one_batch_behind(&env, &mut relay, tables, HELD).await;
        assert_eq!((report.claimed, report.published), (2, 2), "{report:?}");

        // Over the server's max payload (1 MiB): JetStream refuses it, and the relay records
        // the dead letter (`max_attempts` 1) on its row and its aggregate's.
        let blob = "x".repeat(1_100_000);
        <AsyncMysql as Backend>::execute(
            &env,
            &format!(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, \
                                            event_type, partition_key, subject, payload) \
                 VALUES ('Big', 'b-1', 1, 'Uploaded', 'b-1', '{{prefix}}.Big.b-1.Uploaded', \
                         '{{\"blob\": \"{blob}\"}}')"
            ),
        )
        .await;
        <AsyncMysql as Backend>::execute(
            &env,
            "INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, last_seq) \
             VALUES ('Big', 'b-1', 1)",
        )
        .await;
        let aggregate = (
            "BEGIN; SELECT last_seq FROM outbox_aggregates \
             WHERE aggregate_type = 'Big' AND aggregate_id = 'b-1' FOR UPDATE",
            "COMMIT",
        );
        let report = one_batch_behind(&env, &mut relay, aggregate, HELD).await;
        assert_eq!((report.claimed, report.dead_lettered), (1, 1), "{report:?}");
        assert_eq!(
            AsyncMysql::dead_letters(&env).await,
            [("b-1".to_owned(), 1, 1)],
            "the dead letter's record committed"
        );
    }

    /// MariaDB's `idle_transaction_timeout` (an operator's, global; 2 s here, on a server of
    /// the test's own) shorter than a batch's publishes (a broker slow to ack: 4 s): the
    /// relay sends its session a statement within it, and the batch commits what was acked.
    /// Before, its keep-alive came every third of its `wait_timeout` only (7 s), the server
    /// closed the session mid-batch, and the batch failed, as every batch after it would.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_slower_than_mariadbs_idle_transaction_timeout_keeps_its_session() {
        let nats = support::NatsServer::start().await;
        let (_server, env) = idle_transactions_cut_after(2, &nats.url()).await;
        one_batch_through_a_frozen_broker(&env, nats.port, Duration::from_secs(4)).await;
    }

    /// MariaDB's `idle_transaction_timeout` (an operator's, global; 1 s here, on a server of
    /// the test's own) shorter than a handler that works without the database (2 s on each
    /// aggregate's first event): the inbox's sessions turn it off for themselves, and the
    /// message commits. Before, the server closed the session while the handler worked, and
    /// the message, redelivered, failed so again, for ever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handler_slower_than_mariadbs_idle_transaction_timeout_commits() {
        let (_server, env) = idle_transactions_cut_after(1, &support::nats_url()).await;
        <AsyncMysql as Backend>::execute(&env, <AsyncMysql as Consumed>::APPLIED_TABLE).await;
        super::four_events_each::<AsyncMysql>(&env, &["o-1", "o-2"]).await;
        let config = super::inbox_config::<AsyncMysql>(&env, "slow");
        super::consume(&env, &config, 1, || super::Applier::<AsyncMysql> {
            slow_first: Duration::from_secs(2),
            ..super::Applier::new()
        })
        .await;
        let expected: BTreeMap<String, Vec<i64>> = ["o-1", "o-2"]
            .into_iter()
            .map(|id| (id.to_owned(), vec![1, 2, 3, 4]))
            .collect();
        assert_eq!(AsyncMysql::applied(&env).await, expected);
        assert!(AsyncMysql::inbox_dead_letters(&env).await.is_empty());
    }

    /// A handler that works 61 s without the database, within a `handler_timeout` of 90 s:
    /// the message commits once. The inbox's sessions keep `handler_timeout` plus
    /// `statement_timeout` as their `wait_timeout`; before, their 60 s closed the session
    /// while the handler worked, and the message, redelivered, failed so again, for ever
    /// (each time a database failure, no attempt counted, never dead-lettered), under the
    /// default `handler_timeout` of 5 min too. (About 65 s.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handler_that_works_past_a_minute_without_the_database_commits() {
        let env = AsyncMysql::setup().await;
        <AsyncMysql as Backend>::execute(&env, <AsyncMysql as Consumed>::APPLIED_TABLE).await;
        super::four_events_each::<AsyncMysql>(&env, &["o-1"]).await;
        let mut config = super::inbox_config::<AsyncMysql>(&env, "past-a-minute");
        config.handler_timeout = Duration::from_secs(90);
        let inbox: Inbox<super::Applier<AsyncMysql>, AsyncMysqlConnection> = Inbox::connect(
            config,
            env.nats.clone(),
            super::Applier {
                slow_first: Duration::from_secs(61),
                ..super::Applier::new()
            },
        )
        .await
        .unwrap();
        let running = inbox.clone().spawn();
        support::consumer::wait_until_settled(
            &inbox,
            "every message settled",
            Duration::from_secs(150),
        )
        .await;
        running.shutdown().await.unwrap();
        let expected: BTreeMap<String, Vec<i64>> =
            [("o-1".to_owned(), vec![1, 2, 3, 4])].into_iter().collect();
        assert_eq!(AsyncMysql::applied(&env).await, expected);
        assert!(AsyncMysql::inbox_dead_letters(&env).await.is_empty());
    }

    /// A MariaDB user that takes TLS sessions only (`REQUIRE SSL`, as a server with
    /// `require_secure_transport` on takes every user): with `require_ssl=true` in the URL
    /// (mysql_async's options) the migrations, the relay and the inbox reach it over TLS. The
    /// driver was built without TLS, and panicked at such a URL ("Client had asked for TLS
    /// connection but TLS support is disabled"). The certificate's authority is outside the
    /// public roots the driver verifies against by default: `ssl_ca` names it, and the
    /// connections are verified, the server's name too, where only `verify_ca=false`, which
    /// takes any certificate, connected before (mysql_async refused `ssl_ca` as an unknown
    /// parameter). A certificate of another authority is refused, naming why.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_relay_and_the_inbox_reach_mariadb_over_tls() {
        let certificates = support::postgres::TestCertificates::new();
        let server = a_server_with_a_tls_only_user(&certificates).await;
        let app = |options: &str| {
            format!(
                "mysql://app:s3cret-pw@localhost:{}/mysql?prefer_socket=false{options}",
                server.port
            )
        };
        let file = |name: &str| certificates.path(name).display().to_string();
        let refused = |url: String| async move {
            match AsyncMysqlConnection::establish(&url).await {
                Ok(_) => panic!("{url} connected"),
                Err(error) => error.to_string(),
            }
        };
        let without_tls = refused(app("")).await;
        assert!(without_tls.contains("Access denied"), "{without_tls}");
        let unknown_authority = refused(app("&require_ssl=true")).await;
        assert!(
            unknown_authority.contains("UnknownIssuer"),
            "{unknown_authority}"
        );
        let refused_by_the_toolkit = |url: String| async move {
            match outbox_runtime::mysql::establish(&url).await {
                Ok(_) => panic!("{url} connected"),
                Err(error) => error.to_string(),
            }
        };
        let another_authority =
            refused_by_the_toolkit(app(&format!("&ssl_ca={}", file("other-ca.pem")))).await;
        assert!(
            another_authority.contains("UnknownIssuer"),
            "{another_authority}"
        );
        let no_file = refused_by_the_toolkit(app("&ssl_ca=/nonexistent/ca.pem")).await;
        assert_eq!(no_file, "ssl_ca /nonexistent/ca.pem: no such file");

        let mysql = Database::create_on(app(&format!("&ssl_ca={}", file("ca.pem")))).await;
        let env = AsyncMysql::setup_with(&support::nats_url(), mysql).await;
        <AsyncMysql as Backend>::execute(&env, <AsyncMysql as Consumed>::APPLIED_TABLE).await;
        super::four_events_each::<AsyncMysql>(&env, &["o-1", "o-2"]).await;
        let config = super::inbox_config::<AsyncMysql>(&env, "over-tls");
        super::consume(&env, &config, 1, super::Applier::<AsyncMysql>::new).await;
        let expected: BTreeMap<String, Vec<i64>> = ["o-1", "o-2"]
            .into_iter()
            .map(|id| (id.to_owned(), vec![1, 2, 3, 4]))
            .collect();
        assert_eq!(AsyncMysql::applied(&env).await, expected);
    }

    /// diesel's `ssl_mode` (MySQL's `--ssl-mode` values), which a URL of diesel's own
    /// `MysqlConnection` carries, asks the toolkit's connections for the TLS it names, on a
    /// MariaDB whose user takes TLS sessions only and whose certificate is of a private
    /// authority (its name `localhost`): `required` is TLS without the certificate checked,
    /// `verify_ca` and `verify_identity` check its chain to `ssl_ca` and its name (the driver
    /// cannot leave the name out, and the error says why), and `disabled` is no TLS. Before, mysql_async refused the URL ("Unknown connection URL
    /// parameter `ssl_mode'").
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn diesels_ssl_mode_asks_for_the_tls_it_names() {
        let certificates = support::postgres::TestCertificates::new();
        let server = a_server_with_a_tls_only_user(&certificates).await;
        let file = |name: &str| certificates.path(name).display().to_string();
        let url = |host: &str, options: &str| {
            format!(
                "mysql://app:s3cret-pw@{host}:{}/mysql?prefer_socket=false&{options}",
                server.port
            )
        };
        let cipher = |url: String| async move {
            let mut conn = match outbox_runtime::mysql::establish(&url).await {
                Ok(conn) => conn,
                Err(error) => panic!("{url}: {error}"),
            };
            let row: Variable = diesel::sql_query("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
                .get_result(&mut conn)
                .await
                .unwrap();
            assert_eq!(row.variable_name, "Ssl_cipher");
            row.value
        };
        let refused = |url: String| async move {
            match outbox_runtime::mysql::establish(&url).await {
                Ok(_) => panic!("{url} connected"),
                Err(error) => error.to_string(),
            }
        };
        let ca = format!("ssl_ca={}", file("ca.pem"));
        let other_ca = format!("ssl_ca={}", file("other-ca.pem"));
        for connected in [
            url("127.0.0.1", "ssl_mode=required"),
            url("127.0.0.1", "ssl_mode=REQUIRED"),
            url("localhost", &format!("ssl_mode=verify_ca&{ca}")),
            url("localhost", &format!("ssl_mode=verify_identity&{ca}")),
        ] {
            let cipher = cipher(connected.clone()).await;
            assert!(!cipher.is_empty(), "{connected}: no TLS");
        }
        let plain = refused(url("127.0.0.1", "ssl_mode=disabled")).await;
        assert!(plain.contains("Access denied for user 'app'"), "{plain}");
        let another_authority =
            refused(url("127.0.0.1", &format!("ssl_mode=required&{other_ca}"))).await;
        assert!(
            another_authority.contains("UnknownIssuer"),
            "{another_authority}"
        );
        let public_roots = refused(url("127.0.0.1", "ssl_mode=verify_ca")).await;
        assert!(public_roots.contains("UnknownIssuer"), "{public_roots}");
        let another_name =
            refused(url("127.0.0.1", &format!("ssl_mode=verify_identity&{ca}"))).await;
        assert!(
            another_name.contains("certificate not valid for name \"127.0.0.1\""),
            "{another_name}"
        );
        // verify_ca checks the name too: mysql_async's option to skip it is inert on rustls
        // (mysql_async issue 404), which the error says.
        let name_checked = refused(url("127.0.0.1", &format!("ssl_mode=verify_ca&{ca}"))).await;
        assert!(
            name_checked.contains("certificate not valid for name \"127.0.0.1\"")
                && name_checked.contains("mysql_async issue 404"),
            "{name_checked}"
        );
        let unknown = refused(url("127.0.0.1", "ssl_mode=require")).await;
        assert!(
            unknown.contains("ssl_mode=require: not one of disabled, preferred, required"),
            "{unknown}"
        );
    }

    /// A MariaDB of the test's own with TLS on `certificates`, and its user `app` (password
    /// `s3cret-pw`, every privilege) that takes TLS sessions only (`REQUIRE SSL`).
    async fn a_server_with_a_tls_only_user(
        certificates: &support::postgres::TestCertificates,
    ) -> support::mariadb::MariadbServer {
        let server = support::mariadb::MariadbServer::start_with_tls(certificates).await;
        AsyncMysqlConnection::establish(&server.url("mysql"))
            .await
            .unwrap()
            .batch_execute(
                "CREATE USER app IDENTIFIED BY 's3cret-pw' REQUIRE SSL; \
                 GRANT ALL ON *.* TO app WITH GRANT OPTION",
            )
            .await
            .unwrap();
        server
    }

    /// A row of `SHOW STATUS`.
    #[derive(QueryableByName)]
    struct Variable {
        #[diesel(sql_type = Text, column_name = "Variable_name")]
        variable_name: String,
        #[diesel(sql_type = Text, column_name = "Value")]
        value: String,
    }

    /// An account created `REQUIRE SUBJECT` (a client certificate required, as Google Cloud SQL
    /// and Azure ask) logs in with `ssl_cert` and `ssl_key` in the URL: its RSA key in PKCS#8
    /// form (`openssl genpkey`'s, which mysql_async alone cannot read) or PKCS#1; the
    /// migrations, the relay and the inbox reach it so. Before, the toolkit had no way to give
    /// a client certificate (mysql_async's URL takes none), and such an account could not log
    /// in. A certificate without its key, a file without a certificate or key, and an EC key,
    /// which the driver cannot sign with, are refused before connecting, each named.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_account_that_requires_a_client_certificate_logs_in_with_one() {
        let certificates = support::postgres::TestCertificates::new();
        let file = |name: &str| certificates.path(name).display().to_string();
        let openssl = |args: &[&str]| certificates.openssl(args);
        // An RSA key in PKCS#8 (OpenSSL 3's default), its certificate signed by the server's
        // authority, and the same key in PKCS#1.
        openssl(&[
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
            "rsa.key",
        ]);
        openssl(&[
            "req",
            "-new",
            "-key",
            "rsa.key",
            "-subj",
            "/CN=cert-user",
            "-out",
            "rsa.csr",
        ]);
        openssl(&[
            "x509",
            "-req",
            "-in",
            "rsa.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "rsa.pem",
            "-days",
            "2",
            "-extfile",
            "client.ext",
        ]);
        openssl(&[
            "rsa",
            "-in",
            "rsa.key",
            "-traditional",
            "-out",
            "rsa-pkcs1.key",
        ]);
        assert!(
            std::fs::read_to_string(file("rsa.key"))
                .unwrap()
                .contains("BEGIN PRIVATE KEY")
        );

        let server = support::mariadb::MariadbServer::start_with_tls(&certificates).await;
        AsyncMysqlConnection::establish(&server.url("mysql"))
            .await
            .unwrap()
            .batch_execute(
                "CREATE USER certified REQUIRE SUBJECT '/CN=cert-user'; \
                 GRANT ALL ON *.* TO certified WITH GRANT OPTION",
            )
            .await
            .unwrap();
        let url = |options: &str| {
            format!(
                "mysql://certified@localhost:{}/mysql?prefer_socket=false&ssl_ca={}{options}",
                server.port,
                file("ca.pem")
            )
        };
        let identity =
            |cert: &str, key: &str| url(&format!("&ssl_cert={}&ssl_key={}", file(cert), file(key)));
        let refused = |url: String| async move {
            match outbox_runtime::mysql::establish(&url).await {
                Ok(_) => panic!("{url} connected"),
                Err(error) => error.to_string(),
            }
        };
        let without = refused(url("")).await;
        assert!(without.contains("Access denied"), "{without}");
        for key in ["rsa.key", "rsa-pkcs1.key"] {
            let mut conn = outbox_runtime::mysql::establish(&identity("rsa.pem", key))
                .await
                .unwrap_or_else(|e| panic!("{key}: {e}"));
            conn.batch_execute("DO 1").await.unwrap();
        }
        assert_eq!(
            refused(url(&format!("&ssl_cert={}", file("rsa.pem")))).await,
            "ssl_cert needs ssl_key beside it: the client certificate's private key"
        );
        assert_eq!(
            refused(url(&format!("&ssl_key={}", file("rsa.key")))).await,
            "ssl_key needs ssl_cert beside it: the client certificate it is the key of"
        );
        assert_eq!(
            refused(identity("rsa.key", "rsa.key")).await,
            format!(
                "ssl_cert {}: no certificate in it (a PEM file: BEGIN CERTIFICATE)",
                file("rsa.key")
            )
        );
        assert_eq!(
            refused(identity("rsa.pem", "rsa.pem")).await,
            format!(
                "ssl_key {}: no private key in it (a PEM file: BEGIN RSA PRIVATE KEY or BEGIN \
                 PRIVATE KEY; an encrypted key is not read)",
                file("rsa.pem")
            )
        );
        assert_eq!(
            refused(identity("client.pem", "client.key")).await,
            format!(
                "ssl_key {}: a PKCS#8 key of algorithm 1.2.840.10045.2.1 (not RSA: EC is \
                 1.2.840.10045.2.1, Ed25519 1.3.101.112); the driver (mysql_async on rustls) \
                 signs with RSA keys only; give a client certificate whose key is RSA",
                file("client.key")
            )
        );

        let mysql = Database::create_on(identity("rsa.pem", "rsa.key")).await;
        let env = AsyncMysql::setup_with(&support::nats_url(), mysql).await;
        <AsyncMysql as Backend>::execute(&env, <AsyncMysql as Consumed>::APPLIED_TABLE).await;
        super::four_events_each::<AsyncMysql>(&env, &["o-1", "o-2"]).await;
        let config = super::inbox_config::<AsyncMysql>(&env, "certified");
        super::consume(&env, &config, 1, super::Applier::<AsyncMysql>::new).await;
        let expected: BTreeMap<String, Vec<i64>> = ["o-1", "o-2"]
            .into_iter()
            .map(|id| (id.to_owned(), vec![1, 2, 3, 4]))
            .collect();
        assert_eq!(AsyncMysql::applied(&env).await, expected);
    }

    /// A relay and an inbox given a replica's URL (a server with `read_only` on, and a user
    /// without `READ_ONLY ADMIN`, as an application's is) stop at start naming the database,
    /// why and what to give them. Before, both started: each of the relay's batches failed
    /// ("The MariaDB server is running with the --read-only option"), publishing nothing,
    /// and each message of the inbox failed and came again, for as long as they ran.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_and_an_inbox_given_a_read_only_server_name_it() {
        let server = support::mariadb::MariadbServer::start().await;
        let mysql = Database::create_on(server.url("mysql")).await;
        let app = format!(
            "mysql://app:s3cret-pw@127.0.0.1:{}/{}?prefer_socket=false",
            server.port, mysql.name
        );
        let grant = format!(
            "CREATE USER app IDENTIFIED BY 's3cret-pw'; GRANT ALL ON {}.* TO app",
            mysql.name
        );
        let env = AsyncMysql::setup_with(&support::nats_url(), mysql).await;
        let mut root = AsyncMysqlConnection::establish(&server.url("mysql"))
            .await
            .unwrap();
        root.batch_execute(&grant).await.unwrap();
        root.batch_execute("SET GLOBAL read_only = 1")
            .await
            .unwrap();
        let hint = "the database takes no writes (a replica, with read_only or \
                    super_read_only on, or transaction_read_only on for the session), and";
        let target = outbox_runtime::database::redacted(&app);

        let mut config = AsyncMysql::relay_config(&env);
        config.database_url = app.clone();
        let relay = match MysqlRelay::connect(config, env.nats.clone()).await {
            Ok(_) => panic!("a relay started on a read-only server"),
            Err(error) => error.to_string(),
        };
        assert!(
            relay.starts_with(&format!(
                "relay: cannot connect to the database at {target}: checking that the relay \
                 can write the outbox: "
            )) && relay.contains("--read-only option")
                && relay.contains(&format!("{hint} the relay writes the outbox's tables")),
            "{relay}"
        );
        let inbox = super::inbox_refusal::<AsyncMysql>(&env, "read-only", Some(&app)).await;
        assert!(
            inbox.starts_with(&format!(
                "inbox: cannot connect to the database at {target}: checking that the inbox \
                 can write its tables: "
            )) && inbox.contains("--read-only option")
                && inbox.contains(&format!("{hint} the inbox writes the outbox's tables")),
            "{inbox}"
        );
    }

    /// An account of the test's own on the test's server, which logs in with a password and
    /// holds what `outbox grants --mysql` gives each of its components on the test's database
    /// (`outbox_runtime::privileges::mysql_grants`), and what `also` grants (`{account}` and
    /// `{database}` in it replaced); dropped with the value (accounts are the server's, not
    /// the database's).
    struct Account {
        name: String,
        url: String,
        admin_url: String,
    }

    impl Account {
        async fn create(
            database: &Database,
            what: &str,
            components: &[Component],
            also: &str,
        ) -> Self {
            let name = format!(
                "o{}_{what}",
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            );
            let mut admin = database.conn().await;
            admin
                .batch_execute(&format!("CREATE USER '{name}'@'%' IDENTIFIED BY 'pw'"))
                .await
                .unwrap();
            let account = Self {
                url: support::roles::as_role(&database.url, &name),
                admin_url: database.url.clone(),
                name,
            };
            for component in components {
                let grants =
                    privileges::mysql_grants(*component, &account.name, &database.name).unwrap();
                admin
                    .batch_execute(&grants)
                    .await
                    .unwrap_or_else(|e| panic!("the grants of the {component}: {e}\n{grants}"));
            }
            if !also.is_empty() {
                admin
                    .batch_execute(
                        &also
                            .replace("{account}", &format!("'{}'", account.name))
                            .replace("{database}", &database.name),
                    )
                    .await
                    .unwrap();
            }
            account
        }

        async fn conn(&self) -> AsyncMysqlConnection {
            services_connection(&self.url)
                .await
                .unwrap_or_else(|e| panic!("connect as {}: {e}", self.name))
        }
    }

    impl Drop for Account {
        fn drop(&mut self) {
            clean_up(
                &self.admin_url,
                format!("DROP USER IF EXISTS '{}'@'%'", self.name),
            );
        }
    }

    /// The service, the relay (archiving), the inbox and the operator each log in as an
    /// account of its own that holds only what `outbox grants <component> <account> --mysql
    /// <database>` gives it, and each does its whole job: units of work commit, the relay
    /// archives every event to the stream and its retention deletes the archive's rows, the
    /// inbox applies each in order, and the operator's functions read and purge.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_part_runs_as_an_account_holding_only_the_grants_written_for_it() {
        let mut env = AsyncMysql::setup().await;
        <AsyncMysql as Backend>::execute(&env, <AsyncMysql as Consumed>::APPLIED_TABLE).await;
        let db = database(&env);
        let service = Account::create(
            db,
            "service",
            &[Component::Service],
            "GRANT SELECT, INSERT ON `{database}`.orders TO {account}",
        )
        .await;
        let relay = Account::create(db, "relay", &[Component::MessageRelay], "").await;
        let inbox = Account::create(
            db,
            "inbox",
            &[Component::InboxConsumer],
            "GRANT SELECT, INSERT ON `{database}`.applied TO {account}",
        )
        .await;
        let operator = Account::create(db, "operator", &[Component::Operator], "").await;
        let root_url = db.url.clone();
        let use_url = |env: &mut Env, url: &str| {
            env.mysql.as_mut().expect("a MySQL environment").url = url.to_owned();
        };

        // Units of work as the service: three of them, four events for each of two orders,
        // one with a dedup key.
        use_url(&mut env, &service.url);
        let mut orders = vec![shipped("o-1"), shipped("o-2")];
        for round in 0..3 {
            if round > 0 {
                for order in &mut orders {
                    order.record(OrderEvent::ItemAdded {
                        sku: format!("sku-{round}"),
                        quantity: 1,
                    });
                }
            }
            let key = (round == 1).then(|| "invoice-1".to_owned());
            let (committed, result) = AsyncMysql::commit(&env, orders, key, End::Ok).await;
            result.unwrap();
            orders = committed;
        }

        // The relay, archiving, and its retention.
        use_url(&mut env, &relay.url);
        let mut config = AsyncMysql::relay_config(&env);
        config.published = outbox_runtime::PublishedRows::Archive;
        let mut relaying = MysqlRelay::connect(config, env.nats.clone()).await.unwrap();
        let mut relayed = 0;
        loop {
            match relaying.relay_batch().await.unwrap().claimed {
                0 => break,
                claimed => relayed += claimed,
            }
        }
        assert_eq!(relayed, 9);
        env.until_stream_holds(9, Duration::from_secs(10)).await;

        // The inbox.
        use_url(&mut env, &inbox.url);
        let config = super::inbox_config::<AsyncMysql>(&env, "accounts");
        super::consume(&env, &config, 1, super::Applier::<AsyncMysql>::new).await;
        let expected: BTreeMap<String, Vec<i64>> = ["o-1", "o-2"]
            .into_iter()
            .map(|id| (id.to_owned(), vec![1, 2, 3, 4]))
            .collect();
        assert_eq!(AsyncMysql::applied(&env).await, expected);

        // The operator.
        let mut conn = operator.conn().await;
        assert!(dead_letter::list(&mut conn, 10).await.unwrap().is_empty());
        assert!(
            outbox_runtime::outbox::queued_by_type(&mut conn)
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            outbox_runtime::outbox::published_last_minute(&mut conn, 100)
                .await
                .unwrap(),
            9
        );
        assert!(
            outbox_runtime::inbox::dead_letters(&mut conn, None, 10)
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            outbox_runtime::outbox::purge_dedup_keys(&mut conn, Duration::ZERO, 100)
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            outbox_runtime::outbox::purge_published(&mut conn, Duration::ZERO, 100, |_| {})
                .await
                .unwrap(),
            0
        );
        // The relay's retention, as the relay.
        let purged = outbox_runtime::mysql::purge_archived(
            &mut relay.conn().await,
            Duration::ZERO,
            100,
            |_| {},
        )
        .await
        .unwrap();
        assert_eq!(purged, 9);
        use_url(&mut env, &root_url);
        assert_eq!(AsyncMysql::count(&env, "outbox_published").await, 0);
    }

    /// A relay and an inbox whose account lacks privileges they need stop at connect naming
    /// each, the account, and the command that writes the grants. Before, on MySQL their
    /// write check named the one privilege the server refused first (and a relay lacking
    /// only INSERT on the archive started, and failed every batch), and an account without a
    /// privilege on `__diesel_schema_migrations` was told that the database lacked every
    /// migration, to run `outbox migrate` (MySQL shows an account only the tables it holds a
    /// privilege on).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_and_an_inbox_whose_account_lacks_privileges_name_each_one() {
        let mut env = AsyncMysql::setup().await;
        let db = database(&env);
        let name = db.name.clone();
        let service = Account::create(db, "service", &[Component::Service], "").await;
        let blind = Account::create(
            db,
            "blind",
            &[],
            "GRANT SELECT ON `{database}`.outbox_events TO {account}",
        )
        .await;
        let archiving = Account::create(
            db,
            "archiving",
            &[Component::MessageRelay],
            "REVOKE INSERT ON `{database}`.outbox_published FROM {account}",
        )
        .await;
        let target = |account: &Account| outbox_runtime::database::redacted(&account.url);

        env.mysql.as_mut().unwrap().url = service.url.clone();
        let mut config = AsyncMysql::relay_config(&env);
        config.published = outbox_runtime::PublishedRows::Archive;
        let refused = match MysqlRelay::connect(config, env.nats.clone()).await {
            Ok(_) => panic!("a relay started without the privileges it needs"),
            Err(error) => error.to_string(),
        };
        assert_eq!(
            refused,
            format!(
                "relay: cannot connect to the database at {}: checking the relay's privileges: \
                 the account '{}'@'%' lacks UPDATE on outbox_events, DELETE on outbox_events, \
                 INSERT on outbox_published, which the relay needs; as the tables' owner, run \
                 the statements `outbox grants relay {} --mysql {name}` prints \
                 (outbox_runtime::privileges::mysql_grants)",
                target(&service),
                service.name,
                service.name,
            )
        );
        // In Delete mode the archive is not needed.
        let mut config = AsyncMysql::relay_config(&env);
        config.published = outbox_runtime::PublishedRows::Delete;
        let refused = match MysqlRelay::connect(config, env.nats.clone()).await {
            Ok(_) => panic!("a relay started without the privileges it needs"),
            Err(error) => error.to_string(),
        };
        assert!(
            refused.contains("lacks UPDATE on outbox_events, DELETE on outbox_events, which"),
            "{refused}"
        );

        let refused = super::inbox_refusal::<AsyncMysql>(&env, "lacking", None).await;
        let inbox_tables = [
            "outbox_inbox",
            "outbox_inbox_positions",
            "outbox_inbox_attempts",
            "outbox_inbox_gaps",
            "outbox_inbox_dead_letters",
        ];
        let lacking: Vec<String> = inbox_tables
            .iter()
            .flat_map(|table| {
                ["SELECT", "INSERT", "UPDATE", "DELETE"]
                    .map(|privilege| format!("{privilege} on {table}"))
            })
            .collect();
        assert_eq!(
            refused,
            format!(
                "inbox: cannot connect to the database at {}: checking the inbox's privileges: \
                 the account '{}'@'%' lacks {}, which the inbox needs; as the tables' owner, \
                 run the statements `outbox grants inbox {} --mysql {name}` prints \
                 (outbox_runtime::privileges::mysql_grants)",
                target(&service),
                service.name,
                lacking.join(", "),
                service.name,
            )
        );

        // A relay's account without INSERT on the archive only: before, it started, and each
        // batch failed.
        env.mysql.as_mut().unwrap().url = archiving.url.clone();
        let mut config = AsyncMysql::relay_config(&env);
        config.published = outbox_runtime::PublishedRows::Archive;
        let refused = match MysqlRelay::connect(config, env.nats.clone()).await {
            Ok(_) => panic!("a relay started without the privileges it needs"),
            Err(error) => error.to_string(),
        };
        assert!(
            refused.contains(&format!(
                "the account '{}'@'%' lacks INSERT on outbox_published, which the relay needs",
                archiving.name
            )),
            "{refused}"
        );

        // An account that may not see `__diesel_schema_migrations` is told so, not that the
        // database lacks every migration.
        env.mysql.as_mut().unwrap().url = blind.url.clone();
        let refused =
            match MysqlRelay::connect(AsyncMysql::relay_config(&env), env.nats.clone()).await {
                Ok(_) => panic!("a relay started without the privileges it needs"),
                Err(error) => error.to_string(),
            };
        assert!(
            refused.contains(&format!(
                "checking the relay's privileges: the account '{}'@'%' lacks SELECT on \
                 __diesel_schema_migrations, UPDATE on outbox_events,",
                blind.name
            )) && !refused.contains("outbox migrate"),
            "{refused}"
        );
    }

    /// A privilege revoked under a running MySQL relay is named in its log with what to run,
    /// and once it is granted again the relay goes on, nothing lost or stored twice. Before,
    /// the log gave the server's "DELETE command denied ..." alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_privilege_revoked_under_a_running_relay_is_named_with_what_to_run() {
        a_privilege_revoked_under_a_running_relay_is_named().await;
    }

    /// [`a_privilege_revoked_under_a_running_relay_is_named_with_what_to_run`]'s body.
    async fn a_privilege_revoked_under_a_running_relay_is_named() {
        let (logs, _turn) = support::Logs::capture().await;
        let mut env = AsyncMysql::setup().await;
        let db = database(&env);
        let relay = Account::create(db, "relay", &[Component::MessageRelay], "").await;
        let (root_url, name) = (db.url.clone(), db.name.clone());
        let mut owner = db.conn().await;
        env.mysql.as_mut().unwrap().url = relay.url.clone();
        let mut config = AsyncMysql::relay_config(&env);
        env.mysql.as_mut().unwrap().url = root_url;
        config.max_backoff = Duration::from_millis(200);
        config.poll_interval = Duration::from_millis(100);
        let running = MysqlRelay::connect(config, env.nats.clone())
            .await
            .unwrap()
            .spawn();
        AsyncMysql::commit(&env, vec![shipped("o-1")], None, End::Ok)
            .await
            .1
            .unwrap();
        env.until_stream_holds(2, Duration::from_secs(10)).await;

        owner
            .batch_execute(&format!(
                "REVOKE DELETE ON `{name}`.outbox_events FROM '{}'",
                relay.name
            ))
            .await
            .unwrap();
        AsyncMysql::commit(&env, vec![shipped("o-2")], None, End::Ok)
            .await
            .1
            .unwrap();
        logs.until_contains(
            "the relay's log names the missing privilege and what to run",
            &format!(
                "for table `{name}`.`outbox_events`: the account the relay logs in as lacks a \
                 privilege the relay needs; as the tables' owner, run the statements `outbox \
                 grants relay <account> --mysql <database>` prints"
            ),
            Duration::from_secs(10),
        )
        .await;
        // Published and not deleted, the rows stay queued; their republishes are JetStream's
        // duplicates.
        assert_eq!(AsyncMysql::count(&env, "outbox_events").await, 2);

        owner
            .batch_execute(&format!(
                "GRANT DELETE ON `{name}`.outbox_events TO '{}'",
                relay.name
            ))
            .await
            .unwrap();
        support::wait_until("the queue drained", Duration::from_secs(10), || async {
            (AsyncMysql::count(&env, "outbox_events").await == 0).then_some(())
        })
        .await;
        running.shutdown().await.unwrap();
        assert_eq!(env.stream_len().await, 4, "each event stored once");
    }

    /// The same for a running MySQL inbox: each retry's warning names the missing privilege
    /// and what to run; once it is granted again, the message is applied once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_privilege_revoked_under_a_running_inbox_is_named_with_what_to_run() {
        a_privilege_revoked_under_a_running_inbox_is_named().await;
    }

    /// The same under a server that words its errors in another language (an operator's
    /// `lc_messages`, German here, on a server of the test's own): the toolkit's sessions
    /// take English words, which its hints read. Before, the relay's and the inbox's logs gave
    /// the server's German words alone ("DELETE Befehl nicht erlaubt ..."), no hint.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_privilege_revoked_under_a_running_relay_or_inbox_is_named_in_any_language() {
        let server = a_server_set("SET GLOBAL lc_messages = 'de_DE'").await;
        on_a_server_of_its_own(&server, async {
            a_privilege_revoked_under_a_running_relay_is_named().await;
            a_privilege_revoked_under_a_running_inbox_is_named().await;
        })
        .await;
    }

    /// [`a_privilege_revoked_under_a_running_inbox_is_named_with_what_to_run`]'s body.
    async fn a_privilege_revoked_under_a_running_inbox_is_named() {
        let (logs, _turn) = support::Logs::capture().await;
        let mut env = AsyncMysql::setup().await;
        <AsyncMysql as Backend>::execute(&env, <AsyncMysql as Consumed>::APPLIED_TABLE).await;
        let db = database(&env);
        let inbox = Account::create(
            db,
            "inbox",
            &[Component::InboxConsumer],
            "GRANT SELECT, INSERT ON `{database}`.applied TO {account}",
        )
        .await;
        let (root_url, name) = (db.url.clone(), db.name.clone());
        let mut owner = db.conn().await;
        env.mysql.as_mut().unwrap().url = inbox.url.clone();
        let config = super::inbox_config::<AsyncMysql>(&env, "revoked");
        env.mysql.as_mut().unwrap().url = root_url;
        // The relay makes the stream.
        drop(
            MysqlRelay::connect(AsyncMysql::relay_config(&env), env.nats.clone())
                .await
                .unwrap(),
        );
        let consumer = Inbox::connect(
            config,
            env.nats.clone(),
            super::Applier::<AsyncMysql>::new(),
        )
        .await
        .unwrap();
        let probe = consumer.clone();
        let running = consumer.spawn();
        owner
            .batch_execute(&format!(
                "REVOKE INSERT ON `{name}`.outbox_inbox FROM '{}'",
                inbox.name
            ))
            .await
            .unwrap();
        AsyncMysql::commit(&env, vec![shipped("o-1")], None, End::Ok)
            .await
            .1
            .unwrap();
        AsyncMysql::relay_all(&env).await;
        logs.until_contains(
            "the inbox's log names the missing privilege and what to run",
            &format!(
                "for table `{name}`.`outbox_inbox`: the account the inbox logs in as lacks a \
                 privilege the inbox needs; as the tables' owner, run the statements `outbox \
                 grants inbox <account> --mysql <database>` prints"
            ),
            Duration::from_secs(10),
        )
        .await;
        owner
            .batch_execute(&format!(
                "GRANT INSERT ON `{name}`.outbox_inbox TO '{}'",
                inbox.name
            ))
            .await
            .unwrap();
        support::consumer::wait_until_settled(&probe, "the order applied", Duration::from_secs(10))
            .await;
        running.shutdown().await.unwrap();
        let expected: BTreeMap<String, Vec<i64>> = [("o-1".to_owned(), vec![1, 2])].into();
        assert_eq!(AsyncMysql::applied(&env).await, expected);
        assert_eq!(AsyncMysql::count(&env, "outbox_inbox").await, 2);
    }

    /// After a broker outage longer than its session's `wait_timeout` (25 s against 21 s), in
    /// which the server closed the idle session, a MySQL relay opens a new connection quietly
    /// rather than fail a batch on the closed one and warn of a database failure; so does a
    /// relay driven batch by batch (`relay_batch`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a broker outage of 25 s, its log read alone; CI runs it"]
    async fn a_relay_idle_past_its_sessions_wait_timeout_reconnects_quietly() {
        let (logs, _turn) = support::Logs::capture().await;
        let mut server = support::NatsServer::start().await;
        let env = AsyncMysql::setup_on(&server.url()).await;
        let mut config = AsyncMysql::relay_config(&env);
        config.workers = 1;
        let relay = MysqlRelay::connect(config.clone(), env.nats.clone())
            .await
            .unwrap()
            .spawn();
        // Another, driven batch by batch: its connection waits as long.
        let mut driven = MysqlRelay::connect(config, env.nats.clone()).await.unwrap();
        server.stop();
        tokio::time::sleep(Duration::from_secs(25)).await;
        server.restart().await;
        AsyncMysql::commit(&env, vec![shipped("o-1")], None, End::Ok)
            .await
            .1
            .unwrap();
        env.until_stream_holds(2, Duration::from_secs(30)).await;
        relay.shutdown().await.unwrap();
        if let Err(error) = driven.relay_batch().await {
            panic!("a batch on the connection the server closed: {error}");
        }
        let text = logs.text();
        assert!(
            !text.contains("the relay's database fails"),
            "a database failure was reported:\n{text}"
        );
    }

    /// A MySQL relay whose host vanishes mid-batch (no FIN, no RST: a node lost, a network
    /// cut) holds its claimed heads in an open transaction until the server closes its
    /// session. The relay's sessions set `wait_timeout` (21 s with the defaults, not 8
    /// hours), so another relay publishes those aggregates within about half a minute.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs root and nftables to cut a connection; CI runs it"]
    async fn a_relay_whose_host_vanished_gives_its_heads_back_within_a_minute() {
        let server = support::NatsServer::start().await;
        let env = AsyncMysql::setup_on(&server.url()).await;
        let orders = ["o-1", "o-2", "o-3"].into_iter().map(shipped).collect();
        AsyncMysql::commit(&env, orders, None, End::Ok)
            .await
            .1
            .unwrap();

        // Relay A claims the three heads and publishes them to a broker that never answers
        // (a proxy the test freezes): its transaction stays open, the heads locked.
        let proxy = support::Proxy::start(([127, 0, 0, 1], server.port).into()).await;
        let unanswered = outbox_runtime::nats::connect(&format!("nats://127.0.0.1:{}", proxy.port))
            .await
            .unwrap();
        let mut config = AsyncMysql::relay_config(&env);
        config.workers = 1;
        config.poll_interval = Duration::from_millis(200);
        // Over TCP, which a host's loss cuts (the client prefers the server's Unix socket on
        // loopback otherwise).
        config.database_url = format!("{}?prefer_socket=false", config.database_url);
        let a = MysqlRelay::connect(config.clone(), unanswered)
            .await
            .unwrap();
        proxy.freeze(true);
        let a = a.spawn();
        #[derive(QueryableByName)]
        struct Session {
            #[diesel(sql_type = Text)]
            host: String,
        }
        let session = support::wait_until(
            "relay A's claim, open in its transaction",
            Duration::from_secs(10),
            || async {
                let read = diesel::sql_query(
                    "SELECT p.HOST AS host FROM information_schema.INNODB_TRX t \
                     JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id \
                     WHERE p.DB = DATABASE() AND p.ID <> CONNECTION_ID()",
                )
                .get_result::<Session>(&mut database(&env).conn().await)
                .await;
                // No row: no transaction of A's open yet. Anything else is said, so that a
                // run that times out here tells which it was (one CI run did, once).
                if let Err(error) = &read
                    && *error != diesel::result::Error::NotFound
                {
                    eprintln!("relay A's session could not be read: {error}");
                }
                read.ok()
            },
        )
        .await;
        let (_, client_port) = session
            .host
            .rsplit_once(':')
            .unwrap_or_else(|| panic!("relay A's session is not over TCP: {}", session.host));
        let server_port = admin_url()
            .rsplit_once(':')
            .and_then(|(_, rest)| rest.split('/').next()?.parse().ok())
            .unwrap_or(3306);

        // A's host vanishes; relay B takes over once the server has closed A's session.
        let cut = support::Cut::new(server_port, client_port.parse().unwrap());
        let cut_at = std::time::Instant::now();
        let b = MysqlRelay::connect(config, env.nats.clone())
            .await
            .unwrap()
            .spawn();
        let took = support::taken_over(&env, (cut, cut_at), &proxy, (a, b), 6).await;
        assert!(
            took < Duration::from_secs(45),
            "the heads came back {took:?} after the cut"
        );
    }

    /// A batch of more rows than MySQL takes placeholders in one statement (65,535) is
    /// finished in several deletes: all of it published, none of it left queued. About 25 s
    /// of publishing on two cores, so it runs apart from the others (`.ci/run` runs it:
    /// `cargo test --features mysql --test contract -- --ignored placeholder_limit`, with the
    /// same features as the other contract tests).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "66,000 rows in one batch: run alone, as .ci/run does"]
    async fn a_batch_over_the_placeholder_limit_is_finished_in_chunks() {
        const ROWS: i64 = 66_000;
        let env = AsyncMysql::setup().await;
        let digits = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                      UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                      UNION ALL SELECT 8 UNION ALL SELECT 9)";
        <AsyncMysql as Backend>::execute(
            &env,
            &format!(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, \
                                            event_type, partition_key, subject, payload) \
                 SELECT 'Bulk', 'b-1', n + 1, 'Loaded', 'b-1', '{{prefix}}.Bulk.b-1.Loaded', '{{}}' \
                 FROM (SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d AS n \
                       FROM {digits} a, {digits} b, {digits} c, {digits} e, {digits} f) g \
                 WHERE n < {ROWS}"
            ),
        )
        .await;
        assert_eq!(AsyncMysql::stats(&env).await.queued, ROWS);
        let mut config = AsyncMysql::relay_config(&env);
        config.batch_size = 70_000;
        let mut relay = MysqlRelay::connect(config, env.nats.clone()).await.unwrap();
        let report = relay.relay_batch().await.unwrap();
        assert_eq!(
            (report.claimed, report.published),
            (ROWS as usize, ROWS as usize)
        );
        assert_eq!(AsyncMysql::stats(&env).await.queued, 0, "every row deleted");
        env.until_stream_holds(ROWS as u64, Duration::from_secs(30))
            .await;
    }

    /// The statements that record published rows (`... WHERE id IN (...)`) sent on the
    /// connections opened while [`Finishes`] is diesel's default instrumentation (the
    /// process's, so other tests' statements are here too: a test picks its own by its ids).
    static FINISHES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

    /// Records into [`FINISHES`].
    struct Finishes;

    impl diesel::connection::Instrumentation for Finishes {
        fn on_connection_event(&mut self, event: diesel::connection::InstrumentationEvent<'_>) {
            if let diesel::connection::InstrumentationEvent::StartQuery { query, .. } = event {
                let sql = query.to_string();
                if sql.contains("WHERE id IN") {
                    FINISHES.lock().unwrap_or_else(|p| p.into_inner()).push(sql);
                }
            }
        }
    }

    /// A batch of up to 64 published rows records them (deletes, marks, or archives and
    /// deletes) and commits in one multi-statement string; a larger batch binds their ids in
    /// statements of their own and commits apart.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_batch_records_its_published_rows_in_the_commits_round_trip() {
        use outbox_runtime::PublishedRows;
        #[derive(QueryableByName)]
        struct Id {
            #[diesel(sql_type = Text)]
            id: String,
        }
        let env = AsyncMysql::setup().await;
        let ids = async || -> Vec<String> {
            diesel::sql_query("SELECT id FROM outbox_events WHERE published_at IS NULL")
                .load::<Id>(&mut database(&env).conn().await)
                .await
                .unwrap()
                .into_iter()
                .map(|row| row.id)
                .collect()
        };
        diesel::connection::set_default_instrumentation(|| Some(Box::new(Finishes))).unwrap();
        for (n, (mode, statements)) in [
            (PublishedRows::Delete, ["DELETE"].as_slice()),
            (PublishedRows::Mark, &["UPDATE"]),
            (PublishedRows::Archive, &["INSERT", "DELETE"]),
        ]
        .into_iter()
        .enumerate()
        {
            let mut config = AsyncMysql::relay_config(&env);
            config.published = mode;
            let mut relay = MysqlRelay::connect(config, env.nats.clone()).await.unwrap();
            for events in [3, 65] {
                let orders = (0..events)
                    .map(|k| Order::place(&format!("o-{n}-{events}-{k}"), "ada", 1))
                    .collect();
                let (_, committed) = AsyncMysql::commit(&env, orders, None, End::Ok).await;
                committed.unwrap();
                let queued = ids().await;
                assert_eq!(queued.len(), events, "{mode:?}");
                let report = relay.relay_batch().await.unwrap();
                assert_eq!(report.published, events, "{mode:?}");
                let sent: Vec<String> = FINISHES
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .filter(|sql| queued.iter().any(|id| sql.contains(id.as_str())))
                    .cloned()
                    .collect();
                let shapes: Vec<String> = sent
                    .iter()
                    .map(|sql| {
                        let words: Vec<&str> = sql
                            .split("; ")
                            .map(|statement| statement.split(' ').next().unwrap_or(""))
                            .collect();
                        words.join("; ")
                    })
                    .collect();
                if events <= 64 {
                    let one = format!("{}; COMMIT", statements.join("; "));
                    assert_eq!(shapes, [one], "{mode:?}: {sent:?}");
                    assert!(
                        queued.iter().all(|id| sent[0].contains(&format!("'{id}'"))),
                        "{mode:?}: every id as a literal: {sent:?}"
                    );
                } else {
                    assert_eq!(shapes, statements, "{mode:?}, {events} rows: {sent:?}");
                }
                if mode == PublishedRows::Mark {
                    assert!(ids().await.is_empty(), "{mode:?}: every row marked");
                }
            }
            assert_eq!(AsyncMysql::stats(&env).await.queued, 0, "{mode:?}");
        }
        diesel::connection::set_default_instrumentation(|| None).unwrap();
        assert_eq!(env.stream_len().await, 3 * (3 + 65));
    }

    /// A batch whose delete fails in its COMMIT's string commits nothing (MySQL stops the
    /// string at the failed statement, and the batch is rolled back): the rows stay queued,
    /// an archive copy made before the failed delete is gone with it, and the next batch
    /// publishes the rows again, as duplicates JetStream drops.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_batch_whose_delete_fails_commits_nothing_and_the_rows_are_published_again() {
        use outbox_runtime::PublishedRows;
        #[derive(QueryableByName)]
        struct Count {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let env = AsyncMysql::setup().await;
        let archived = async || {
            diesel::sql_query("SELECT COUNT(*) AS n FROM outbox_published")
                .get_result::<Count>(&mut database(&env).conn().await)
                .await
                .unwrap()
                .n
        };
        for (n, mode) in [PublishedRows::Delete, PublishedRows::Archive]
            .into_iter()
            .enumerate()
        {
            <AsyncMysql as Backend>::execute(
                &env,
                "CREATE TRIGGER refuse_delete BEFORE DELETE ON outbox_events FOR EACH ROW \
                 SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'deletes refused'",
            )
            .await;
            let orders = vec![shipped(&format!("o-{n}")), shipped(&format!("p-{n}"))];
            let (_, committed) = AsyncMysql::commit(&env, orders, None, End::Ok).await;
            committed.unwrap();
            let mut config = AsyncMysql::relay_config(&env);
            config.published = mode;
            let mut relay = MysqlRelay::connect(config, env.nats.clone()).await.unwrap();
            let error = relay.relay_batch().await.unwrap_err().to_string();
            assert!(error.contains("deletes refused"), "{mode:?}: {error}");
            assert_eq!(AsyncMysql::stats(&env).await.queued, 4, "{mode:?}");
            assert_eq!(
                archived().await,
                0,
                "{mode:?}: the archive's copies rolled back"
            );
            assert_eq!(
                env.stream_len().await,
                4 * (n as u64 + 1),
                "{mode:?}: published"
            );

            <AsyncMysql as Backend>::execute(&env, "DROP TRIGGER refuse_delete").await;
            let report = relay.relay_batch().await.unwrap();
            assert_eq!(
                (report.published, report.duplicates),
                (4, 4),
                "{mode:?}: {report:?}"
            );
            assert_eq!(AsyncMysql::stats(&env).await.queued, 0, "{mode:?}");
            assert_eq!(
                archived().await,
                if mode == PublishedRows::Archive { 4 } else { 0 },
                "{mode:?}"
            );
        }
        assert_eq!(
            env.stream_len().await,
            8,
            "JetStream dropped the duplicates"
        );
    }

    /// MySQL commits the open transaction before a DDL statement (MySQL 8.0 Reference Manual,
    /// 15.3.3 "Statements That Cause an Implicit Commit"): a `CREATE TABLE` inside the
    /// closure ends the unit of work's transaction as a COMMIT would, and its events are not
    /// written on their own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_statement_that_commits_implicitly_ends_the_unit_of_work() {
        let env = AsyncMysql::setup().await;
        ends_the_unit_of_work::<AsyncMysql>(&env, "CREATE TABLE audit (id INT)").await;
        #[cfg(feature = "mysql-sync")]
        ends_the_unit_of_work::<SyncMysql>(&env, "CREATE TABLE audit_sync (id INT)").await;
        assert!(AsyncMysql::rows(&env).await.is_empty(), "no event");
    }

    /// Commits an order whose closure sends `statement`: the unit of work fails with
    /// `TransactionEnded`, and its events stay pending.
    async fn ends_the_unit_of_work<B: Backend>(env: &Env, statement: &'static str) {
        let (orders, result) =
            B::commit(env, vec![shipped("o-1")], None, End::Send(statement)).await;
        assert!(
            matches!(result, Err(UnitOfWorkError::TransactionEnded)),
            "{statement}: {result:?}"
        );
        assert_eq!(
            orders[0].pending_events().len(),
            2,
            "the events stay pending"
        );
    }

    /// diesel's sync `MysqlConnection` through `Outbox::sync_transaction`; the rest as
    /// [`AsyncMysql`].
    #[cfg(feature = "mysql-sync")]
    pub struct SyncMysql;

    #[cfg(feature = "mysql-sync")]
    impl Backend for SyncMysql {
        async fn setup() -> Env {
            AsyncMysql::setup().await
        }

        fn server(env: &Env) -> std::net::SocketAddr {
            AsyncMysql::server(env)
        }

        fn connect_through(env: &mut Env, port: u16) {
            AsyncMysql::connect_through(env, port);
        }

        async fn commit(
            env: &Env,
            mut orders: Vec<Order>,
            dedup_key: Option<String>,
            end: End,
        ) -> (Vec<Order>, Result<(), UnitOfWorkError>) {
            let (url, outbox) = (database(env).url.clone(), env.outbox());
            tokio::task::spawn_blocking(move || {
                use diesel::Connection as _;
                use diesel::RunQueryDsl as Sync;
                let mut conn = diesel::MysqlConnection::establish(&url).expect("a connection");
                let result = outbox.sync_transaction(&mut conn, |uow| {
                    // A read first, as business code does (REPEATABLE READ's snapshot), of a
                    // table no unit of work writes (see `AsyncMysql::commit`).
                    let count =
                        diesel::sql_query("SELECT COUNT(*) AS n FROM __diesel_schema_migrations");
                    Sync::execute(count, uow.conn())?;
                    for order in &mut orders {
                        let insert = diesel::sql_query("INSERT INTO orders VALUES (?)")
                            .bind::<Text, _>(&order.id);
                        Sync::execute(insert, uow.conn())?;
                        uow.track(order);
                    }
                    if let Some(request) = dedup_key {
                        uow.emit("Invoice", "i-1", &Invoiced { request });
                    }
                    match end {
                        End::Fail => return Err(diesel::result::Error::RollbackTransaction.into()),
                        End::Send(statement) => {
                            diesel::connection::SimpleConnection::batch_execute(
                                uow.conn(),
                                statement,
                            )?
                        }
                        End::Ok => {}
                    }
                    Ok(())
                });
                (orders, result)
            })
            .await
            .expect("the sync unit of work ran")
        }

        async fn rows(env: &Env) -> Vec<(String, i64)> {
            AsyncMysql::rows(env).await
        }

        async fn business_rows(env: &Env) -> i64 {
            AsyncMysql::business_rows(env).await
        }

        async fn stats(env: &Env) -> OutboxStats {
            AsyncMysql::stats(env).await
        }

        async fn execute(env: &Env, statement: &str) {
            <AsyncMysql as Backend>::execute(env, statement).await;
        }

        async fn try_execute(env: &Env, statement: &str) -> Result<(), String> {
            AsyncMysql::try_execute(env, statement).await
        }

        async fn dead_letters(env: &Env) -> Vec<(String, i64, i32)> {
            AsyncMysql::dead_letters(env).await
        }

        fn relay_config(env: &Env) -> RelayConfig {
            AsyncMysql::relay_config(env)
        }

        async fn relay_all(env: &Env) {
            AsyncMysql::relay_all(env).await;
        }

        async fn relay_once(env: &Env) -> Result<usize, String> {
            AsyncMysql::relay_once(env).await
        }

        const BLOCK_DELETES: [&str; 2] = AsyncMysql::BLOCK_DELETES;

        async fn spawn_relay(env: &Env, config: RelayConfig) -> RelayHandle {
            AsyncMysql::spawn_relay(env, config).await
        }
    }

    #[cfg(feature = "mysql-sync")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_relay_is_woken_by_each_sync_commit_of_its_process() {
        super::an_idle_relay_is_woken_by_each_commit_of_its_process::<SyncMysql>().await;
    }

    /// `sync_transaction` takes an r2d2-pooled `MysqlConnection`, and a dedup key taken by
    /// an async unit of work holds for a sync one on the same table.
    #[cfg(feature = "mysql-sync")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sync_unit_of_work_runs_on_a_pooled_connection_and_shares_dedup_keys() {
        let env = SyncMysql::setup().await;
        let (_, first) = AsyncMysql::commit(&env, vec![], Some("r-1".into()), End::Ok).await;
        first.unwrap();
        let (url, outbox) = (database(&env).url.clone(), env.outbox());
        tokio::task::spawn_blocking(move || {
            use diesel::r2d2::{ConnectionManager, Pool};
            let pool = Pool::builder()
                .max_size(1)
                .build(ConnectionManager::<diesel::MysqlConnection>::new(url))
                .expect("an r2d2 pool");
            let mut order = shipped("o-1");
            outbox
                .sync_transaction(&mut pool.get().unwrap(), |uow| {
                    uow.track(&mut order);
                    uow.emit(
                        "Invoice",
                        "i-1",
                        &Invoiced {
                            request: "r-1".into(),
                        },
                    );
                    Ok::<_, UnitOfWorkError>(())
                })
                .unwrap();
            assert!(order.pending_events().is_empty());
        })
        .await
        .unwrap();
        assert_eq!(SyncMysql::rows(&env).await.len(), 2, "the order's events");
        #[derive(QueryableByName)]
        struct Count {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let invoices = diesel::sql_query(
            "SELECT COUNT(*) AS n FROM outbox_events WHERE aggregate_type = 'Invoice'",
        )
        .get_result::<Count>(&mut database(&env).conn().await)
        .await
        .unwrap();
        assert_eq!(invoices.n, 1, "the key's second event was not written");
    }

    /// A unit of work whose account lacks a privilege on the outbox's tables fails naming
    /// what to run, not only "INSERT command denied to user"; nothing is written, the
    /// aggregate keeps its events, and once granted the same unit of work commits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_unit_of_work_whose_account_lacks_a_privilege_names_what_to_run() {
        let env = AsyncMysql::setup().await;
        let db = database(&env);
        let service = Account::create(
            db,
            "service",
            &[Component::Service],
            "REVOKE INSERT ON `{database}`.outbox_events FROM {account}",
        )
        .await;
        let mut conn = service.conn().await;
        let mut order = shipped("o-1");
        let error = outbox_runtime::Outbox::new()
            .transaction(&mut conn, async |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .expect_err("a unit of work without INSERT on outbox_events");
        assert!(
            matches!(error, UnitOfWorkError::MissingPrivilege { .. }),
            "{error:?}"
        );
        let text = error.to_string();
        assert!(
            text.contains(&format!("INSERT command denied to user '{}'", service.name))
                && text.ends_with(
                    "outbox_events`: the account the service logs in as lacks a privilege the \
                     service needs; as the tables' owner, run the statements `outbox grants \
                     service <account> --mysql <database>` prints"
                ),
            "{text}"
        );
        assert_eq!(order.pending_events().len(), 2, "the events are kept");
        db.conn()
            .await
            .batch_execute(&format!(
                "GRANT INSERT ON `{}`.outbox_events TO '{}'@'%'",
                db.name, service.name
            ))
            .await
            .unwrap();
        outbox_runtime::Outbox::new()
            .transaction(&mut conn, async |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap();
        assert_eq!(order.pending_events().len(), 0);
    }
}

/// The SQLite backend: a database file of its own per test, migrated with
/// `outbox_runtime::sqlite::run_migrations`; the stream and prefix come from the test kit.
#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use diesel::QueryableByName;
    use diesel::sql_types::{BigInt, Integer, Text};
    use outbox_runtime::diesel_async::RunQueryDsl;
    use outbox_runtime::sqlite::{AsyncSqliteConnection, SqliteRelay};

    /// A throwaway database file, removed with the value.
    pub struct Database {
        pub path: String,
    }

    impl Database {
        fn create() -> Self {
            let path = std::env::temp_dir()
                .join(format!("outbox-test-{}.db", uuid::Uuid::new_v4().simple()))
                .to_string_lossy()
                .into_owned();
            let mut conn = outbox_runtime::sqlite::establish(&path).unwrap();
            outbox_runtime::sqlite::run_migrations(&mut conn)
                .unwrap_or_else(|e| panic!("the SQLite migrations on {path}: {e}"));
            Self { path }
        }

        pub fn conn(&self) -> AsyncSqliteConnection {
            AsyncSqliteConnection::new(
                outbox_runtime::sqlite::establish(&self.path)
                    .unwrap_or_else(|e| panic!("open {}: {e}", self.path)),
            )
        }
    }

    impl Drop for Database {
        fn drop(&mut self) {
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", self.path));
            }
        }
    }

    fn database(env: &Env) -> &Database {
        env.sqlite.as_ref().expect("a SQLite environment")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_unit_of_work_dropped_part_way_on_a_pooled_connection_leaves_nothing_locked() {
        use diesel_async::pooled_connection::deadpool::Pool;
        use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};

        let env = AsyncSqlite::setup().await;
        let mut config = ManagerConfig::default();
        // The toolkit's settings for each connection: write-ahead log, a 5-s busy timeout.
        config.custom_setup = Box::new(|path| {
            let opened = outbox_runtime::sqlite::establish(path).map(AsyncSqliteConnection::new);
            Box::pin(std::future::ready(opened))
        });
        let manager = AsyncDieselConnectionManager::<AsyncSqliteConnection>::new_with_config(
            &database(&env).path,
            config,
        );
        let pool = Pool::builder(manager).max_size(2).build().unwrap();
        super::dropped_part_way_on_a_pooled_connection::<AsyncSqlite, _, _>(&env, async || {
            outbox_runtime::Pooled::get(&pool).await
        })
        .await;
    }

    /// A relay and an inbox given the path of a file that does not exist (a typo beside the
    /// service's database, as a path, a `sqlite://` URL and a `file:` URI) stop at start
    /// naming it, and leave no file there. Before, each made an empty database at that path
    /// and said to run the migrations, which there make a second outbox that the service's
    /// units of work never write to.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_and_an_inbox_given_a_path_where_no_database_is_make_none() {
        let env = AsyncSqlite::setup().await;
        let typo = format!("{}-typo", database(&env).path);
        for url in [
            typo.clone(),
            format!("sqlite://{typo}"),
            format!("file:{typo}?cache=private"),
        ] {
            let mut config = AsyncSqlite::relay_config(&env);
            config.database_url = url.clone();
            let relay = match SqliteRelay::connect(config, env.nats.clone()).await {
                Ok(_) => panic!("a relay started on {url}"),
                Err(error) => error.to_string(),
            };
            let inbox = super::inbox_refusal::<AsyncSqlite>(&env, "typo", Some(&url)).await;
            for (component, said) in [("relay", relay), ("inbox", inbox)] {
                assert!(
                    said.starts_with(&format!(
                        "{component}: cannot connect to the database at {}: no SQLite \
                         database at {typo}: the relay and the inbox open the database that \
                         the service's migrations made, and make none; check the path",
                        outbox_runtime::database::redacted(&url)
                    )),
                    "{url}: {said}"
                );
            }
            assert!(
                !std::path::Path::new(&typo).exists(),
                "{url}: a database was made at {typo}"
            );
        }
    }

    /// A relay and an inbox given a database file opened read-only (`file:...?mode=ro`)
    /// stop at start naming the file, why and what to give them. Before, both started: each
    /// of the relay's batches failed ("attempt to write a readonly database"), publishing
    /// nothing, and each message of the inbox failed and came again, for as long as they ran.
    /// The same for a file in SQLite's rollback journal (as a service's own connection
    /// migrated it, before one of the toolkit's put it in write-ahead logging), where before
    /// both failed at the change of its journal mode, in SQLite's words alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_and_an_inbox_given_a_read_only_file_name_it() {
        use diesel::Connection as _;
        use diesel::connection::SimpleConnection as _;

        let env = AsyncSqlite::setup().await;
        let path = &database(&env).path;
        let journal = format!("{path}-rollback-journal.db");
        diesel::SqliteConnection::establish(path)
            .unwrap()
            .batch_execute(&format!(
                "VACUUM INTO '{journal}'; \
                 ATTACH DATABASE '{journal}' AS copy; PRAGMA copy.journal_mode = DELETE"
            ))
            .unwrap();
        let hint = "attempt to write a readonly database: the database file takes no writes \
                    (opened read-only, as mode=ro, or a file or directory this process may \
                    not write), and";
        for (file, consumer) in [(path, "read-only"), (&journal, "read-only-journal")] {
            let read_only = format!("file:{file}?mode=ro");
            let target = outbox_runtime::database::redacted(&read_only);
            let mut config = AsyncSqlite::relay_config(&env);
            config.database_url = read_only.clone();
            let relay = match SqliteRelay::connect(config, env.nats.clone()).await {
                Ok(_) => panic!("a relay started on a read-only file"),
                Err(error) => error.to_string(),
            };
            assert!(
                relay.starts_with(&format!(
                    "relay: cannot connect to the database at {target}: checking that the \
                     relay can write the outbox: {hint} the relay writes the outbox's tables"
                )),
                "{relay}"
            );
            let inbox = super::inbox_refusal::<AsyncSqlite>(&env, consumer, Some(&read_only)).await;
            assert!(
                inbox.starts_with(&format!(
                    "inbox: cannot connect to the database at {target}: checking that the \
                     inbox can write its tables: {hint} the inbox writes the outbox's tables"
                )),
                "{inbox}"
            );
        }
        // The file is read as it is: the outbox's state, for an operator.
        let mut reader = outbox_runtime::sqlite::AsyncSqliteConnection::new(
            outbox_runtime::sqlite::establish(&format!("file:{journal}?mode=ro")).unwrap(),
        );
        let queued = outbox_runtime::outbox::queued_by_type(&mut reader)
            .await
            .unwrap();
        assert!(queued.is_empty(), "{queued:?}");
        std::fs::remove_file(&journal).unwrap();
    }

    pub struct AsyncSqlite;

    impl Consumed for AsyncSqlite {
        const APPLIED_TABLE: &'static str = "CREATE TABLE applied (n INTEGER PRIMARY KEY \
             AUTOINCREMENT, aggregate TEXT NOT NULL, seq INTEGER NOT NULL)";

        async fn apply(
            conn: &mut AsyncSqliteConnection,
            aggregate: &str,
            seq: i64,
        ) -> diesel::QueryResult<usize> {
            diesel::sql_query("INSERT INTO applied (aggregate, seq) VALUES (?, ?)")
                .bind::<Text, _>(aggregate)
                .bind::<BigInt, _>(seq)
                .execute(conn)
                .await
        }

        async fn applied(env: &Env) -> BTreeMap<String, Vec<i64>> {
            let rows = diesel::sql_query("SELECT aggregate, seq FROM applied ORDER BY n")
                .load(&mut database(env).conn())
                .await
                .unwrap();
            by_aggregate(rows)
        }

        async fn count(env: &Env, table: &str) -> i64 {
            let row: Count = diesel::sql_query(format!("SELECT count(*) AS n FROM {table}"))
                .get_result(&mut database(env).conn())
                .await
                .unwrap();
            row.n
        }

        async fn inbox_dead_letters(env: &Env) -> Vec<(String, String)> {
            let rows: Vec<InboxDeadLetter> = diesel::sql_query(INBOX_DEAD_LETTERS)
                .load(&mut database(env).conn())
                .await
                .unwrap();
            rows.into_iter().map(|r| (r.message_id, r.error)).collect()
        }
    }

    impl Operated for AsyncSqlite {
        type Conn = outbox_runtime::sqlite::AsyncSqliteConnection;

        async fn operator_conn(env: &Env) -> Self::Conn {
            database(env).conn()
        }

        async fn archived(env: &Env) -> Vec<Archived> {
            diesel::sql_query(archived_sql("id", "payload"))
                .load(&mut database(env).conn())
                .await
                .unwrap()
        }
    }

    impl PurgedByRow for AsyncSqlite {
        async fn purge_archived(
            conn: &mut AsyncSqliteConnection,
            older_than: Duration,
            batch: i64,
            progress: impl FnMut(usize) + Send,
        ) -> diesel::QueryResult<usize> {
            outbox_runtime::sqlite::purge_archived(conn, older_than, batch, progress).await
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_purge_of_the_archive_deletes_only_old_rows() {
        super::a_purge_of_the_archive_deletes_only_old_rows::<AsyncSqlite>().await;
    }

    impl Backend for AsyncSqlite {
        async fn setup() -> Env {
            let env = TestEnv::unmigrated(&support::nats_url()).await;
            let sqlite = Database::create();
            sqlite
                .conn()
                .batch_execute("CREATE TABLE orders (id TEXT)")
                .await
                .unwrap();
            Env {
                env,
                #[cfg(feature = "mysql")]
                mysql: None,
                sqlite: Some(sqlite),
                transaction_ids: false,
                max_payload: outbox_runtime::DEFAULT_MAX_PAYLOAD_BYTES,
            }
        }

        async fn commit(
            env: &Env,
            mut orders: Vec<Order>,
            dedup_key: Option<String>,
            end: End,
        ) -> (Vec<Order>, Result<(), UnitOfWorkError>) {
            let mut conn = database(env).conn();
            let result = env
                .outbox()
                .transaction(&mut conn, async |uow| {
                    // A read first, as business code does: in a deferred transaction it
                    // would pin a snapshot that another writer's commit makes stale.
                    diesel::sql_query("SELECT COUNT(*) AS n FROM orders")
                        .execute(uow.conn())
                        .await?;
                    for order in &mut orders {
                        diesel::sql_query("INSERT INTO orders VALUES (?)")
                            .bind::<Text, _>(&order.id)
                            .execute(uow.conn())
                            .await?;
                        uow.track(order);
                    }
                    if let Some(request) = dedup_key {
                        uow.emit("Invoice", "i-1", &Invoiced { request });
                    }
                    match end {
                        End::Fail => return Err(diesel::result::Error::RollbackTransaction.into()),
                        End::Send(statement) => uow.conn().batch_execute(statement).await?,
                        End::Ok => {}
                    }
                    Ok(())
                })
                .await;
            (orders, result)
        }

        async fn rows(env: &Env) -> Vec<(String, i64)> {
            #[derive(QueryableByName)]
            struct Row {
                #[diesel(sql_type = Text)]
                aggregate_id: String,
                #[diesel(sql_type = BigInt)]
                aggregate_seq: i64,
            }
            diesel::sql_query(
                "SELECT aggregate_id, aggregate_seq FROM outbox_events \
                 WHERE aggregate_type = 'Order' ORDER BY aggregate_id, aggregate_seq",
            )
            .load::<Row>(&mut database(env).conn())
            .await
            .unwrap()
            .into_iter()
            .map(|row| (row.aggregate_id, row.aggregate_seq))
            .collect()
        }

        async fn stats(env: &Env) -> OutboxStats {
            let mut conn = outbox_runtime::sqlite::establish(&database(env).path).unwrap();
            outbox_runtime::sqlite::stats(&mut conn).unwrap()
        }

        async fn business_rows(env: &Env) -> i64 {
            #[derive(QueryableByName)]
            struct Count {
                #[diesel(sql_type = BigInt)]
                n: i64,
            }
            diesel::sql_query("SELECT COUNT(*) AS n FROM orders")
                .get_result::<Count>(&mut database(env).conn())
                .await
                .unwrap()
                .n
        }

        async fn execute(env: &Env, statement: &str) {
            let statement = statement.replace("{prefix}", &env.prefix);
            database(env)
                .conn()
                .batch_execute(&statement)
                .await
                .unwrap();
        }

        async fn try_execute(env: &Env, statement: &str) -> Result<(), String> {
            let statement = statement.replace("{prefix}", &env.prefix);
            database(env)
                .conn()
                .batch_execute(&statement)
                .await
                .map_err(|e| e.to_string())
        }

        async fn dead_letters(env: &Env) -> Vec<(String, i64, i32)> {
            #[derive(QueryableByName)]
            struct Dead {
                #[diesel(sql_type = Text)]
                aggregate_id: String,
                #[diesel(sql_type = BigInt)]
                aggregate_seq: i64,
                #[diesel(sql_type = Integer)]
                attempts: i32,
            }
            diesel::sql_query(
                "SELECT aggregate_id, aggregate_seq, attempts FROM outbox_events \
                 WHERE dead_lettered_at IS NOT NULL ORDER BY aggregate_id",
            )
            .load::<Dead>(&mut database(env).conn())
            .await
            .unwrap()
            .into_iter()
            .map(|d| (d.aggregate_id, d.aggregate_seq, d.attempts))
            .collect()
        }

        fn relay_config(env: &Env) -> RelayConfig {
            let mut config = env.relay_config();
            config.database_url = database(env).path.clone();
            config
        }

        async fn relay_all(env: &Env) {
            let mut relay = SqliteRelay::connect(Self::relay_config(env), env.nats.clone())
                .await
                .unwrap();
            while relay.relay_batch().await.unwrap().claimed > 0 {}
        }

        async fn relay_once(env: &Env) -> Result<usize, String> {
            let mut relay = SqliteRelay::connect(Self::relay_config(env), env.nats.clone())
                .await
                .unwrap();
            relay
                .relay_batch()
                .await
                .map(|report| report.claimed)
                .map_err(|e| e.to_string())
        }

        const BLOCK_DELETES: [&str; 2] = [
            "CREATE TRIGGER outbox_test_no_delete BEFORE DELETE ON outbox_events \
             BEGIN SELECT RAISE(ABORT, 'deletes blocked by the test'); END",
            "DROP TRIGGER outbox_test_no_delete",
        ];

        async fn relay_died(env: &Env) {
            <Self as Backend>::execute(
                env,
                "UPDATE outbox_relay_lease SET expires_at = '2000-01-01 00:00:00.000'",
            )
            .await;
        }

        async fn spawn_relay(env: &Env, config: RelayConfig) -> RelayHandle {
            SqliteRelay::connect(config, env.nats.clone())
                .await
                .unwrap()
                .spawn()
        }
    }

    /// A relay whose batch failed opens a new connection, and keeps its lease on it: it goes
    /// on at once, not after its own lease has run out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_keeps_its_lease_across_a_failed_batch() {
        let env = AsyncSqlite::setup().await;
        let relay = AsyncSqlite::spawn_relay(&env, AsyncSqlite::relay_config(&env)).await;
        <AsyncSqlite as Backend>::execute(&env, AsyncSqlite::BLOCK_DELETES[0]).await;
        let (_, result) = AsyncSqlite::commit(&env, vec![shipped("o-1")], None, End::Ok).await;
        result.unwrap();
        // Published, then the delete fails: the batch fails, and the worker reconnects.
        env.until_stream_holds(2, Duration::from_secs(5)).await;
        <AsyncSqlite as Backend>::execute(&env, AsyncSqlite::BLOCK_DELETES[1]).await;
        let lease = SqliteRelay::lease(&AsyncSqlite::relay_config(&env));
        let started = std::time::Instant::now();
        support::wait_until("the rows deleted", lease / 2, || async {
            AsyncSqlite::rows(&env).await.is_empty().then_some(())
        })
        .await;
        relay.shutdown().await.unwrap();
        assert!(started.elapsed() < lease / 2);
        assert_eq!(env.stream_messages().await.len(), 2, "stored once");
    }

    /// Another database's URL is refused at connect, naming the relay to use.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_refuses_another_databases_url() {
        let env = AsyncSqlite::setup().await;
        let mut config = AsyncSqlite::relay_config(&env);
        config.database_url = env.database_url.clone();
        let error = SqliteRelay::connect(config, env.nats.clone())
            .await
            .err()
            .expect("refused")
            .to_string();
        assert!(error.contains("use outbox_runtime::Relay"), "{error}");
    }

    /// A relay that stops gracefully gives its lease back: the next one publishes at once,
    /// not after the lease would have run out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_that_stops_gives_its_lease_back() {
        let env = AsyncSqlite::setup().await;
        let (_, result) = AsyncSqlite::commit(&env, vec![shipped("o-1")], None, End::Ok).await;
        result.unwrap();
        let running = AsyncSqlite::spawn_relay(&env, AsyncSqlite::relay_config(&env)).await;
        env.until_stream_holds(2, Duration::from_secs(5)).await;
        running.shutdown().await.unwrap();
        let (_, result) = AsyncSqlite::commit(&env, vec![shipped("o-2")], None, End::Ok).await;
        result.unwrap();
        let mut next = SqliteRelay::connect(AsyncSqlite::relay_config(&env), env.nats.clone())
            .await
            .unwrap();
        assert_eq!(next.relay_batch().await.unwrap().claimed, 2);
    }

    /// A relay driven batch by batch gives its lease back when closed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_closed_after_its_batches_gives_its_lease_back() {
        let env = AsyncSqlite::setup().await;
        let (_, result) = AsyncSqlite::commit(&env, vec![shipped("o-1")], None, End::Ok).await;
        result.unwrap();
        let connect = || SqliteRelay::connect(AsyncSqlite::relay_config(&env), env.nats.clone());
        let mut first = connect().await.unwrap();
        assert_eq!(first.relay_batch().await.unwrap().claimed, 2);
        first.close().await;
        let (_, result) = AsyncSqlite::commit(&env, vec![shipped("o-2")], None, End::Ok).await;
        result.unwrap();
        let mut next = connect().await.unwrap();
        assert_eq!(
            next.relay_batch().await.unwrap().claimed,
            2,
            "no lease to wait for"
        );
    }

    /// diesel's sync `SqliteConnection` through `Outbox::sync_transaction`; the rest as
    /// [`AsyncSqlite`].
    pub struct SyncSqlite;

    impl Backend for SyncSqlite {
        async fn setup() -> Env {
            AsyncSqlite::setup().await
        }

        async fn commit(
            env: &Env,
            mut orders: Vec<Order>,
            dedup_key: Option<String>,
            end: End,
        ) -> (Vec<Order>, Result<(), UnitOfWorkError>) {
            let (path, outbox) = (database(env).path.clone(), env.outbox());
            tokio::task::spawn_blocking(move || {
                use diesel::RunQueryDsl as Sync;
                let mut conn = outbox_runtime::sqlite::establish(&path).expect("a connection");
                let result = outbox.sync_transaction(&mut conn, |uow| {
                    let count = diesel::sql_query("SELECT COUNT(*) AS n FROM orders");
                    Sync::execute(count, uow.conn())?;
                    for order in &mut orders {
                        let insert = diesel::sql_query("INSERT INTO orders VALUES (?)")
                            .bind::<Text, _>(&order.id);
                        Sync::execute(insert, uow.conn())?;
                        uow.track(order);
                    }
                    if let Some(request) = dedup_key {
                        uow.emit("Invoice", "i-1", &Invoiced { request });
                    }
                    match end {
                        End::Fail => return Err(diesel::result::Error::RollbackTransaction.into()),
                        End::Send(statement) => {
                            diesel::connection::SimpleConnection::batch_execute(
                                uow.conn(),
                                statement,
                            )?
                        }
                        End::Ok => {}
                    }
                    Ok(())
                });
                (orders, result)
            })
            .await
            .expect("the sync unit of work ran")
        }

        async fn rows(env: &Env) -> Vec<(String, i64)> {
            AsyncSqlite::rows(env).await
        }

        async fn business_rows(env: &Env) -> i64 {
            AsyncSqlite::business_rows(env).await
        }

        async fn stats(env: &Env) -> OutboxStats {
            AsyncSqlite::stats(env).await
        }

        async fn execute(env: &Env, statement: &str) {
            <AsyncSqlite as Backend>::execute(env, statement).await;
        }

        async fn try_execute(env: &Env, statement: &str) -> Result<(), String> {
            AsyncSqlite::try_execute(env, statement).await
        }

        async fn dead_letters(env: &Env) -> Vec<(String, i64, i32)> {
            AsyncSqlite::dead_letters(env).await
        }

        fn relay_config(env: &Env) -> RelayConfig {
            AsyncSqlite::relay_config(env)
        }

        async fn relay_all(env: &Env) {
            AsyncSqlite::relay_all(env).await;
        }

        async fn relay_once(env: &Env) -> Result<usize, String> {
            AsyncSqlite::relay_once(env).await
        }

        const BLOCK_DELETES: [&str; 2] = AsyncSqlite::BLOCK_DELETES;

        async fn relay_died(env: &Env) {
            AsyncSqlite::relay_died(env).await;
        }

        async fn spawn_relay(env: &Env, config: RelayConfig) -> RelayHandle {
            AsyncSqlite::spawn_relay(env, config).await
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_relay_is_woken_by_each_commit_of_its_process() {
        super::an_idle_relay_is_woken_by_each_commit_of_its_process::<AsyncSqlite>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_relay_is_woken_by_each_sync_commit_of_its_process() {
        super::an_idle_relay_is_woken_by_each_commit_of_its_process::<SyncSqlite>().await;
    }

    /// `sync_transaction` takes an r2d2-pooled `SqliteConnection`, and says what is missing
    /// on a database file without the outbox tables.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sync_unit_of_work_runs_on_a_pooled_connection_and_names_missing_migrations() {
        let env = SyncSqlite::setup().await;
        let (path, outbox) = (database(&env).path.clone(), env.outbox());
        let bare = Database {
            path: format!("{path}.bare"),
        };
        let bare_path = bare.path.clone();
        tokio::task::spawn_blocking(move || {
            use diesel::r2d2::{ConnectionManager, Pool};
            let pool = Pool::builder()
                .max_size(2)
                .build(ConnectionManager::<diesel::SqliteConnection>::new(path))
                .expect("an r2d2 pool");
            let mut order = shipped("o-1");
            outbox
                .sync_transaction(&mut pool.get().unwrap(), |uow| {
                    uow.track(&mut order);
                    Ok::<_, UnitOfWorkError>(())
                })
                .unwrap();
            assert!(order.pending_events().is_empty());

            let mut bare = outbox_runtime::sqlite::establish(&bare_path).unwrap();
            let mut order = shipped("o-2");
            let error = outbox
                .sync_transaction(&mut bare, |uow| {
                    uow.track(&mut order);
                    Ok::<_, UnitOfWorkError>(())
                })
                .unwrap_err();
            assert!(
                matches!(&error, UnitOfWorkError::MissingMigrations(missing) if !missing.pending.is_empty()),
                "{error:?}"
            );
            assert_eq!(order.pending_events().len(), 2, "the events stay pending");
        })
        .await
        .unwrap();
        assert_eq!(SyncSqlite::rows(&env).await.len(), 2);
        drop(bare);
    }

    /// A unit of work that meets another writer's lock begins within a few milliseconds of
    /// its release. SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20, 25, 25, 25, 50, 50
    /// and 100 ms between its tries: for a lock held 200 ms, its try after the release comes
    /// at 228 ms, 28 ms late.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_unit_of_work_takes_the_write_lock_soon_after_its_release() {
        let env = SyncSqlite::setup().await;
        let (path, outbox) = (database(&env).path.clone(), env.outbox());
        tokio::task::spawn_blocking(move || {
            use diesel::connection::SimpleConnection as _;
            let mut holder = outbox_runtime::sqlite::establish(&path).unwrap();
            holder.batch_execute("BEGIN IMMEDIATE").unwrap();
            let writer = std::thread::spawn(move || {
                let mut conn = outbox_runtime::sqlite::establish(&path).unwrap();
                let mut order = shipped("o-1");
                let mut began = None;
                let asked = std::time::Instant::now();
                outbox
                    .sync_transaction(&mut conn, |uow| {
                        began = Some(std::time::Instant::now());
                        uow.track(&mut order);
                        Ok::<_, UnitOfWorkError>(())
                    })
                    .unwrap();
                (asked, began.expect("the closure ran"))
            });
            std::thread::sleep(Duration::from_millis(200));
            holder.batch_execute("COMMIT").unwrap();
            let released = std::time::Instant::now();
            let (asked, began) = writer.join().unwrap();
            assert!(
                asked < released,
                "the unit of work began after the lock's release: it never met the lock"
            );
            let late = began.saturating_duration_since(released);
            assert!(
                late < Duration::from_millis(15),
                "the unit of work began {late:?} after the lock's release"
            );
        })
        .await
        .unwrap();
        assert_eq!(SyncSqlite::rows(&env).await.len(), 2);
    }

    /// The wait for the write lock still ends at the connection's `busy_timeout`, with
    /// SQLite's "database is locked", and leaves the connection's `busy_timeout` as it was.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_unit_of_work_waits_for_the_write_lock_no_longer_than_busy_timeout() {
        #[derive(QueryableByName)]
        struct BusyTimeout {
            #[diesel(sql_type = Integer)]
            timeout: i32,
        }
        let env = SyncSqlite::setup().await;
        let (path, outbox) = (database(&env).path.clone(), env.outbox());
        tokio::task::spawn_blocking(move || {
            use diesel::connection::SimpleConnection as _;
            let mut holder = outbox_runtime::sqlite::establish(&path).unwrap();
            holder.batch_execute("BEGIN IMMEDIATE").unwrap();
            let mut conn = outbox_runtime::sqlite::establish(&path).unwrap();
            conn.batch_execute("PRAGMA busy_timeout = 150").unwrap();
            let mut order = shipped("o-1");
            let started = std::time::Instant::now();
            let error = outbox
                .sync_transaction(&mut conn, |uow| {
                    uow.track(&mut order);
                    Ok::<_, UnitOfWorkError>(())
                })
                .unwrap_err();
            let waited = started.elapsed();
            assert!(error.to_string().contains("database is locked"), "{error}");
            assert!(
                waited >= Duration::from_millis(150),
                "gave up after {waited:?}, before the busy_timeout of 150 ms"
            );
            let BusyTimeout { timeout } = diesel::RunQueryDsl::get_result(
                diesel::sql_query("PRAGMA busy_timeout"),
                &mut conn,
            )
            .unwrap();
            assert_eq!(timeout, 150, "the connection's busy_timeout");
            assert_eq!(order.pending_events().len(), 2, "the events stay pending");
            holder.batch_execute("COMMIT").unwrap();
        })
        .await
        .unwrap();
        assert!(SyncSqlite::rows(&env).await.is_empty());
    }

    /// One relay publishes a file's rows at a time: a second one claims nothing while the
    /// first holds the lease, and takes over once it has expired.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_relay_waits_for_the_lease_and_takes_over_when_it_expires() {
        let env = AsyncSqlite::setup().await;
        let connect = || async {
            SqliteRelay::connect(AsyncSqlite::relay_config(&env), env.nats.clone())
                .await
                .unwrap()
        };
        let (mut first, mut second) = (connect().await, connect().await);
        assert_eq!(first.relay_batch().await.unwrap().claimed, 0, "empty");
        let (_, result) = AsyncSqlite::commit(&env, vec![shipped("o-1")], None, End::Ok).await;
        result.unwrap();
        assert_eq!(
            second.relay_batch().await.unwrap().claimed,
            0,
            "the first relay holds the lease"
        );
        assert_eq!(first.relay_batch().await.unwrap().claimed, 2);
        let (_, result) = AsyncSqlite::commit(&env, vec![shipped("o-2")], None, End::Ok).await;
        result.unwrap();
        assert_eq!(second.relay_batch().await.unwrap().claimed, 0);
        // The first relay stops renewing: its lease runs out.
        <AsyncSqlite as Backend>::execute(
            &env,
            "UPDATE outbox_relay_lease SET expires_at = '2000-01-01 00:00:00.000'",
        )
        .await;
        assert_eq!(second.relay_batch().await.unwrap().claimed, 2, "took over");
        let (_, result) = AsyncSqlite::commit(&env, vec![shipped("o-3")], None, End::Ok).await;
        result.unwrap();
        assert_eq!(
            first.relay_batch().await.unwrap().claimed,
            0,
            "the second relay holds the lease now, though the first renewed it a moment ago"
        );
        assert_eq!(second.relay_batch().await.unwrap().claimed, 2);
        let messages = env.stream_messages().await;
        assert_eq!(messages.len(), 6);
    }
}

/// On sync diesel's `PgConnection`: a unit of work that cannot have its transaction's id
/// fails before its closure runs, with the server's error, and ends the transaction its BEGIN
/// opened, so that the next unit of work on the same connection commits.
#[cfg(feature = "postgres-sync")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_unit_of_work_whose_transaction_id_fails_ends_its_transaction() {
    let env = AsyncPg::setup().await;
    let (url, outbox) = (env.database_url.clone(), env.outbox());
    let (error, ran, second) = tokio::task::spawn_blocking(move || {
        use diesel::RunQueryDsl;
        use diesel::connection::SimpleConnection;
        let mut conn = diesel::PgConnection::establish(&url).expect("a sync connection");
        conn.batch_execute(support::NO_TRANSACTION_IDS).unwrap();
        let mut ran = false;
        let error = outbox
            .clone()
            .report_transaction_ids(true)
            .sync_transaction(&mut conn, |_uow| {
                ran = true;
                Ok::<_, UnitOfWorkError>(())
            })
            .unwrap_err()
            .to_string();
        let mut order = shipped("o-1");
        let second = outbox.sync_transaction(&mut conn, |uow| {
            diesel::sql_query("INSERT INTO orders VALUES ('o-1')").execute(uow.conn())?;
            uow.track(&mut order);
            Ok::<_, UnitOfWorkError>(())
        });
        (error, ran, second)
    })
    .await
    .unwrap();
    assert!(error.contains("no transaction ids here"), "{error}");
    assert!(!ran, "the closure ran without its transaction's id");
    second.unwrap();
    assert_eq!(AsyncPg::business_rows(&env).await, 1);
    assert_eq!(AsyncPg::rows(&env).await.len(), 2);
}
