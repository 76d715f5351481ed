//! The unit of work's contract, one set of test bodies run against every backend this build
//! has: diesel-async's `AsyncPgConnection`, and sync diesel's `PgConnection` with the feature
//! `postgres-sync` (`cargo test --features postgres-sync --test contract`; libpq needed). A rollback leaves nothing; committed units of work become exactly the
//! expected messages; sequences stay contiguous under concurrent units of work; dedup keys
//! hold across backends (they share one table).

mod support;

use std::collections::BTreeMap;

#[cfg(feature = "postgres-sync")]
use diesel::Connection as _;
use diesel_async::SimpleAsyncConnection;
use outbox_runtime::outbox::schema::outbox_events;
use outbox_runtime::{DomainEvent, UnitOfWorkError};
use serde::{Deserialize, Serialize};
use support::TestEnv;
use support::domain::{Order, OrderEvent};

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
struct Invoiced {
    #[event(dedup_key)]
    request: String,
}

/// One way to run units of work.
trait Backend {
    /// Commits, in one unit of work, the events of `orders` (tracked), a business row per
    /// order, and one `Invoiced` with `dedup_key` when given; the closure fails at the end
    /// when `fail`. Returns the orders as the unit of work left them.
    fn commit(
        env: &TestEnv,
        orders: Vec<Order>,
        dedup_key: Option<String>,
        fail: bool,
    ) -> impl Future<Output = (Vec<Order>, Result<(), UnitOfWorkError>)> + Send;
}

struct AsyncPg;

impl Backend for AsyncPg {
    async fn commit(
        env: &TestEnv,
        mut orders: Vec<Order>,
        dedup_key: Option<String>,
        fail: bool,
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
                if fail {
                    return Err(diesel::result::Error::RollbackTransaction.into());
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
    async fn commit(
        env: &TestEnv,
        mut orders: Vec<Order>,
        dedup_key: Option<String>,
        fail: bool,
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
                if fail {
                    return Err(diesel::result::Error::RollbackTransaction.into());
                }
                Ok(())
            });
            (orders, result)
        })
        .await
        .expect("the sync unit of work ran")
    }
}

async fn setup() -> TestEnv {
    let env = TestEnv::new().await;
    env.conn()
        .await
        .batch_execute("CREATE TABLE orders (id text)")
        .await
        .unwrap();
    env
}

/// `(aggregate_id, aggregate_seq)` of every outbox row of `Order`s.
async fn rows(env: &TestEnv) -> Vec<(String, i64)> {
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

async fn business_rows(env: &TestEnv) -> i64 {
    use diesel_async::RunQueryDsl;
    diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM orders")
        .get_result(&mut env.conn().await)
        .await
        .unwrap()
}

fn shipped(id: &str) -> Order {
    let mut order = Order::place(id, "ada", 990);
    order.record(OrderEvent::Shipped);
    order
}

async fn a_rollback_leaves_nothing<B: Backend>() {
    let env = setup().await;
    let (orders, result) = B::commit(&env, vec![shipped("o-1")], Some("r-1".into()), true).await;
    assert!(result.is_err());
    assert!(rows(&env).await.is_empty(), "no outbox row");
    assert_eq!(business_rows(&env).await, 0, "no business row");
    assert_eq!(
        orders[0].pending_events().len(),
        2,
        "the events stay pending"
    );
    // Nor did it take its dedup key.
    let (_, again) = B::commit(&env, vec![], Some("r-1".into()), false).await;
    again.unwrap();
}

async fn committed_units_of_work_become_exactly_the_expected_messages<B: Backend>() {
    let env = setup().await;
    let (orders, result) = B::commit(&env, vec![shipped("o-1"), shipped("o-2")], None, false).await;
    result.unwrap();
    assert!(
        orders.iter().all(|o| o.pending_events().is_empty()),
        "drained"
    );
    let (_, result) = B::commit(&env, vec![shipped("o-1")], None, false).await;
    result.unwrap();
    support::consumer::relay_all(&env).await;
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

async fn sequences_stay_contiguous_under_concurrent_units_of_work<B: Backend + 'static>() {
    const WRITERS: usize = 6;
    const UNITS: usize = 8;
    let env = std::sync::Arc::new(setup().await);
    let writers: Vec<_> = (0..WRITERS)
        .map(|_| {
            let env = std::sync::Arc::clone(&env);
            tokio::spawn(async move {
                for _ in 0..UNITS {
                    let (_, result) = B::commit(&env, vec![shipped("hot")], None, false).await;
                    result.unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    let seqs: Vec<i64> = rows(&env).await.into_iter().map(|(_, seq)| seq).collect();
    let expected: Vec<i64> = (1..=(WRITERS * UNITS * 2) as i64).collect();
    assert_eq!(seqs, expected);
}

/// The dedup keys of units of work on different backends share one table.
#[cfg(feature = "postgres-sync")]
async fn a_dedup_key_taken_on_one_backend_holds_on_the_other<A: Backend, B: Backend>() {
    let env = setup().await;
    let (_, first) = A::commit(&env, vec![], Some("r-1".into()), false).await;
    first.unwrap();
    let (_, second) = B::commit(&env, vec![shipped("o-1")], Some("r-1".into()), false).await;
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
        rows(&env).await.len(),
        2,
        "the other events of the second were written"
    );
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
            async fn committed_units_of_work_become_exactly_the_expected_messages() {
                super::committed_units_of_work_become_exactly_the_expected_messages::<$backend>()
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sequences_stay_contiguous_under_concurrent_units_of_work() {
                super::sequences_stay_contiguous_under_concurrent_units_of_work::<$backend>()
                    .await;
            }
        }
    )*};
}

contract!(async_pg => AsyncPg);
#[cfg(feature = "postgres-sync")]
contract!(sync_pg => SyncPg);

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
/// `&mut PgConnection`), and says what is missing on a database without the outbox tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_unit_of_work_runs_on_a_pooled_connection_and_names_missing_migrations() {
    let env = setup().await;
    let unmigrated = TestEnv::unmigrated(&support::nats_url()).await;
    let (url, bare_url, outbox) = (
        env.database_url.clone(),
        unmigrated.database_url.clone(),
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
            matches!(&error, UnitOfWorkError::MissingMigrations(missing) if !missing.pending.is_empty()),
            "{error:?}"
        );
        assert_eq!(order.pending_events().len(), 2);
    })
    .await
    .unwrap();
    assert_eq!(rows(&env).await.len(), 2);
}
