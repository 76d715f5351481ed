//! The unit of work against the real PostgreSQL: atomicity, the checks done at commit, and
//! per-aggregate sequence numbers under concurrency.

mod support;

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_runtime::outbox::schema::outbox_events;
use outbox_runtime::{DomainEvent, Outbox, TokenRole, UnitOfWorkError};
use serde::{Deserialize, Serialize};
use support::domain::{Order, OrderEvent, PaymentCaptured};
use support::{SentStatements, TestEnv};

diesel::table! {
    orders (id) {
        id -> Text,
        status -> Text,
    }
}

async fn create_orders_table(conn: &mut AsyncPgConnection) {
    conn.batch_execute("CREATE TABLE orders (id text PRIMARY KEY, status text NOT NULL)")
        .await
        .unwrap();
}

async fn insert_order(conn: &mut AsyncPgConnection, order: &Order) -> QueryResult<usize> {
    diesel::insert_into(orders::table)
        .values((orders::id.eq(&order.id), orders::status.eq(&order.status)))
        .execute(conn)
        .await
}

/// `(aggregate_id, aggregate_seq, event_type)` of every outbox row, in sequence order.
async fn outbox_rows(conn: &mut AsyncPgConnection) -> Vec<(String, i64, String)> {
    outbox_events::table
        .select((
            outbox_events::aggregate_id,
            outbox_events::aggregate_seq,
            outbox_events::event_type,
        ))
        .order((outbox_events::aggregate_id, outbox_events::aggregate_seq))
        .load(conn)
        .await
        .unwrap()
}

/// Commits `order`'s business row and its events in one unit of work of `outbox`.
async fn commit_order(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    order: &mut Order,
) -> Result<(), UnitOfWorkError> {
    outbox
        .transaction(conn, async |uow| {
            insert_order(uow.conn(), order).await?;
            uow.track(order);
            Ok(())
        })
        .await
}

async fn order_count(conn: &mut AsyncPgConnection) -> i64 {
    orders::table.count().get_result(conn).await.unwrap()
}

#[tokio::test]
async fn a_rolled_back_unit_of_work_leaves_no_row_and_keeps_the_events_pending() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    create_orders_table(&mut conn).await;
    let mut order = Order::place("o-1", "ada", 4200);
    order.record(OrderEvent::Shipped);

    let result = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            insert_order(uow.conn(), &order).await?;
            uow.track(&mut order);
            assert_eq!(uow.event_count(), 2);
            Err::<(), _>(UnitOfWorkError::Database(
                diesel::result::Error::RollbackTransaction,
            ))
        })
        .await;

    assert!(result.is_err());
    assert_eq!(order_count(&mut conn).await, 0, "no business row");
    assert!(outbox_rows(&mut conn).await.is_empty(), "no outbox row");
    assert_eq!(order.pending_events().len(), 2, "events stay pending");

    // The same aggregate commits on the next attempt, and only then is drained.
    commit_order(&env.outbox(), &mut conn, &mut order)
        .await
        .unwrap();
    assert_eq!(order_count(&mut conn).await, 1);
    assert_eq!(
        outbox_rows(&mut conn).await,
        [
            ("o-1".to_owned(), 1, "Placed".to_owned()),
            ("o-1".to_owned(), 2, "Shipped".to_owned())
        ]
    );
    assert!(order.pending_events().is_empty());
}

#[tokio::test]
async fn a_failing_business_write_rolls_back_the_events_too() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    create_orders_table(&mut conn).await;
    let mut first = Order::place("dup", "ada", 1);
    let mut second = Order::place("dup", "grace", 2);

    let result = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            uow.track(&mut first);
            insert_order(uow.conn(), &first).await?;
            uow.track(&mut second);
            insert_order(uow.conn(), &second).await?; // primary key violation
            Ok::<_, UnitOfWorkError>(())
        })
        .await;

    assert!(
        matches!(result, Err(UnitOfWorkError::Database(_))),
        "{result:?}"
    );
    assert_eq!(order_count(&mut conn).await, 0);
    assert!(outbox_rows(&mut conn).await.is_empty());
    assert_eq!(first.pending_events().len(), 1);
}

#[tokio::test]
async fn an_aggregate_id_that_would_break_a_subject_is_rejected_at_commit_by_name() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    create_orders_table(&mut conn).await;
    let mut good = Order::place("fine", "ada", 1);
    let mut bad = Order::place("eu.42", "grace", 2);

    let error = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            insert_order(uow.conn(), &good).await?;
            uow.track(&mut good);
            uow.track(&mut bad);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap_err();

    match &error {
        UnitOfWorkError::InvalidSubjectToken { role, value, .. } => {
            assert_eq!((*role, value.as_str()), (TokenRole::AggregateId, "eu.42"));
        }
        other => panic!("expected InvalidSubjectToken, got {other:?}"),
    }
    assert_eq!(
        error.to_string(),
        "aggregate id \"eu.42\" of Order \"eu.42\" (event Placed) is not a valid NATS subject \
         token: it contains '.', the NATS token separator"
    );
    assert_eq!(
        order_count(&mut conn).await,
        0,
        "the business row is rolled back too"
    );
    assert!(outbox_rows(&mut conn).await.is_empty());
    assert_eq!(good.pending_events().len(), 1);
}

#[tokio::test]
async fn a_partition_key_and_a_standalone_aggregate_type_are_checked_too() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;

    let error = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            let payment = PaymentCaptured {
                merchant: "acme shop".into(),
                amount_cents: 100,
            };
            uow.emit("Payment", "p-1", &payment);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap_err();
    assert!(
        error.to_string().starts_with(
            "partition key \"acme shop\" of Payment \"p-1\" (event PaymentCaptured) is not a \
             valid NATS subject token: it contains whitespace"
        ),
        "{error}"
    );

    let error = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            uow.emit("Pay*", "p-1", &OrderEvent::Shipped);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&error, UnitOfWorkError::InvalidSubjectToken { role: TokenRole::AggregateType, value, .. } if value == "Pay*"),
        "{error:?}"
    );
    assert!(outbox_rows(&mut conn).await.is_empty());
}

#[tokio::test]
async fn a_unit_of_work_refuses_a_connection_already_in_a_transaction() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let outbox = env.outbox();
    let mut order = Order::place("o-1", "ada", 1);

    let result = conn
        .transaction::<_, UnitOfWorkError, _>(async |conn| {
            outbox
                .transaction(conn, async |uow| {
                    uow.track(&mut order);
                    Ok::<_, UnitOfWorkError>(())
                })
                .await
        })
        .await;

    assert!(
        matches!(result, Err(UnitOfWorkError::NestedTransaction)),
        "{result:?}"
    );
    assert!(outbox_rows(&mut conn).await.is_empty());
    assert_eq!(order.pending_events().len(), 1);
}

#[tokio::test]
async fn events_carry_type_version_partition_key_subject_and_payload() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let mut order = Order::place("o-7", "ada", 4200);

    env.outbox()
        .transaction(&mut conn, async |uow| {
            uow.track(&mut order);
            // Recorded after the first track: a second track takes only this one.
            order.record(OrderEvent::ItemAdded {
                sku: "tea".into(),
                quantity: 3,
            });
            uow.track(&mut order);
            let payment = PaymentCaptured {
                merchant: "acme".into(),
                amount_cents: 4200,
            };
            uow.emit("Payment", "pay-9", &payment);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();

    type Row = (
        String,
        String,
        i64,
        String,
        i32,
        String,
        String,
        serde_json::Value,
    );
    let rows: Vec<Row> = outbox_events::table
        .select((
            outbox_events::aggregate_type,
            outbox_events::aggregate_id,
            outbox_events::aggregate_seq,
            outbox_events::event_type,
            outbox_events::event_version,
            outbox_events::partition_key,
            outbox_events::subject,
            outbox_events::payload,
        ))
        .order(outbox_events::id)
        .load(&mut conn)
        .await
        .unwrap();
    let p = &env.prefix;
    let expected: Vec<Row> = vec![
        (
            "Order".into(),
            "o-7".into(),
            1,
            "Placed".into(),
            1,
            "o-7".into(),
            format!("{p}.Order.o-7.Placed"),
            serde_json::json!({"customer": "ada", "total_cents": 4200}),
        ),
        (
            "Order".into(),
            "o-7".into(),
            2,
            "LineAdded".into(),
            2,
            "o-7".into(),
            format!("{p}.Order.o-7.LineAdded"),
            serde_json::json!({"sku": "tea", "quantity": 3}),
        ),
        (
            "Payment".into(),
            "pay-9".into(),
            1,
            "PaymentCaptured".into(),
            1,
            "acme".into(),
            format!("{p}.Payment.acme.PaymentCaptured"),
            serde_json::json!({"merchant": "acme", "amount_cents": 4200}),
        ),
    ];
    assert_eq!(rows, expected);
    assert!(order.pending_events().is_empty());
}

#[tokio::test]
async fn sequences_continue_after_rows_inserted_by_hand() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let mut order = Order::place("o-1", "ada", 1);
    env.commit(&mut order).await;
    // Another service appends sequence 2 by hand.
    conn.batch_execute(&format!(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
         partition_key, subject, payload) \
         VALUES ('Order', 'o-1', 2, 'Shipped', 'o-1', '{}.Order.o-1.Shipped', '{{}}')",
        env.prefix
    ))
    .await
    .unwrap();
    order.record(OrderEvent::Shipped);
    env.commit(&mut order).await;
    let seqs: Vec<i64> = outbox_rows(&mut conn).await.iter().map(|r| r.1).collect();
    assert_eq!(seqs, [1, 2, 3]);
}

/// Many concurrent units of work on one aggregate. Commit order is observed with a deferred
/// constraint trigger on a business table: it runs at COMMIT, after the outbox rows were
/// written and while the transaction still holds its locks, and logs the transaction id and
/// the clock. Ordering the transactions by that log, their sequence numbers must be
/// contiguous ranges, each after the previous one's. (An implementation that drew numbers
/// from a PostgreSQL SEQUENCE, say, would give numbers in draw order, not commit order, and
/// fail here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_units_of_work_on_one_aggregate_get_contiguous_sequences_in_commit_order() {
    const WORKERS: usize = 6;
    const TRANSACTIONS: usize = 15;

    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    conn.batch_execute(
        "CREATE TABLE touches (txid bigint NOT NULL);
         CREATE TABLE commit_log (txid bigint NOT NULL, committed_at timestamptz NOT NULL);
         CREATE FUNCTION log_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO commit_log VALUES (NEW.txid, clock_timestamp());
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER log_commit AFTER INSERT ON touches
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION log_commit();",
    )
    .await
    .unwrap();

    let mut workers = Vec::new();
    for worker in 0..WORKERS {
        let outbox = env.outbox();
        let database_url = env.database_url.clone();
        workers.push(tokio::spawn(async move {
            let mut conn = AsyncPgConnection::establish(&database_url).await.unwrap();
            let mut order = Order::place("hot", "ada", 1);
            let mut written = 0;
            for n in 0..TRANSACTIONS {
                // 1 to 3 events per transaction (the first carries Placed).
                for _ in 0..(worker + n) % 3 {
                    order.record(OrderEvent::Shipped);
                }
                written += order.pending_events().len();
                outbox
                    .transaction(&mut conn, async |uow| {
                        diesel::sql_query(
                            "INSERT INTO touches VALUES (txid_current() % 4294967296)",
                        )
                        .execute(uow.conn())
                        .await?;
                        uow.track(&mut order);
                        Ok::<_, UnitOfWorkError>(())
                    })
                    .await
                    .unwrap();
                if order.pending_events().is_empty() {
                    order.record(OrderEvent::Shipped);
                }
            }
            written
        }));
    }
    let mut total = 0;
    for worker in workers {
        total += worker.await.unwrap();
    }

    // Per transaction, in commit order: the lowest and highest sequence it wrote, and count.
    #[derive(QueryableByName, Debug)]
    struct Committed {
        #[diesel(sql_type = diesel::sql_types::Int8)]
        first: i64,
        #[diesel(sql_type = diesel::sql_types::Int8)]
        last: i64,
        #[diesel(sql_type = diesel::sql_types::Int8)]
        events: i64,
    }
    let committed: Vec<Committed> = diesel::sql_query(
        "SELECT min(e.aggregate_seq) AS first, max(e.aggregate_seq) AS last, count(*) AS events
         FROM outbox_events e JOIN commit_log c ON e.xmin::text::bigint = c.txid
         GROUP BY c.txid, c.committed_at
         ORDER BY c.committed_at",
    )
    .load(&mut conn)
    .await
    .unwrap();

    assert_eq!(committed.len(), WORKERS * TRANSACTIONS);
    let mut next = 1;
    for tx in &committed {
        assert_eq!(
            tx.first, next,
            "sequences follow commit order: {committed:?}"
        );
        assert_eq!(
            tx.last - tx.first + 1,
            tx.events,
            "contiguous within a transaction"
        );
        next = tx.last + 1;
    }
    assert_eq!(
        next - 1,
        i64::try_from(total).unwrap(),
        "every event numbered once"
    );
}

#[tokio::test]
async fn a_pooled_connection_runs_a_unit_of_work_and_goes_back_to_the_pool_clean() {
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use diesel_async::pooled_connection::deadpool::Pool;

    let env = TestEnv::new().await;
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(&env.database_url);
    let pool = Pool::builder(manager).max_size(1).build().unwrap();
    let outbox = env.outbox();

    let mut order = Order::place("o-1", "ada", 1);
    let mut conn = pool.get().await.unwrap();
    let failed = outbox
        .transaction(&mut conn, async |uow| {
            uow.track(&mut order);
            Err::<(), _>(UnitOfWorkError::Database(
                diesel::result::Error::RollbackTransaction,
            ))
        })
        .await;
    assert!(failed.is_err());
    drop(conn);

    // The one pooled connection is reused, outside any transaction.
    let mut conn = pool.get().await.unwrap();
    outbox
        .transaction(&mut conn, async |uow| {
            uow.track(&mut order);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
    assert_eq!(
        outbox_rows(&mut conn).await,
        [("o-1".to_owned(), 1, "Placed".to_owned())]
    );
    assert!(order.pending_events().is_empty());
}

/// An event with values JSON and `jsonb` may not carry.
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
enum Reading {
    Measured {
        sensor: String,
        celsius: f64,
        notes: Vec<String>,
    },
}

/// An event whose name is as long as a token may be.
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[event(
    name = "EEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEE"
)]
struct Long {}

#[tokio::test]
async fn a_nan_or_a_nul_in_a_payload_fails_the_commit_naming_the_field() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    for (reading, wanted) in [
        (
            Reading::Measured {
                sensor: "s-1".into(),
                celsius: f64::NAN,
                notes: vec![],
            },
            "the number at $.celsius is NaN",
        ),
        (
            Reading::Measured {
                sensor: "s-1".into(),
                celsius: 21.5,
                notes: vec!["ok".into(), "bad\0byte".into()],
            },
            "the string at $.notes[1] contains a NUL character",
        ),
    ] {
        let error = env
            .outbox()
            .transaction(&mut conn, async |uow| {
                uow.emit("Sensor", "s-1", &reading);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap_err();
        assert!(
            matches!(error, UnitOfWorkError::Payload { .. }),
            "{error:?}"
        );
        assert!(error.to_string().contains(wanted), "{error}");
    }
    let fine = Reading::Measured {
        sensor: "s-1".into(),
        celsius: 21.5,
        notes: vec!["null".into()],
    };
    env.outbox()
        .transaction(&mut conn, async |uow| {
            uow.emit("Sensor", "s-1", &fine);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
    assert_eq!(
        outbox_rows(&mut conn).await.len(),
        1,
        "only the storable one"
    );
}

#[tokio::test]
async fn ids_keys_and_subjects_are_bounded_at_commit_with_the_limit_named() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let mut huge = Order::place(&"x".repeat(10_000), "ada", 1);
    let error = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            uow.track(&mut huge);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains(
            "it is 10000 bytes long, over the limit of 256 bytes a subject token may hold"
        ),
        "{error}"
    );

    // Every token at its limit: the subject would pass the control line's quarter.
    let prefix = "p".repeat(256);
    let outbox = outbox_runtime::Outbox::with_topology(outbox_runtime::Topology {
        subject_prefix: prefix.parse().unwrap(),
        ..Default::default()
    });
    let (aggregate_type, aggregate_id) = ("T".repeat(256), "i".repeat(256));
    let error = outbox
        .transaction(&mut conn, async |uow| {
            uow.emit(&aggregate_type, &aggregate_id, &Long {});
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap_err();
    assert!(
        matches!(error, UnitOfWorkError::SubjectTooLong { len: 1027, .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("over the limit of 1024 bytes"),
        "{error}"
    );

    let error = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            uow.set_correlation("c".repeat(600), "cause");
            uow.emit("Sensor", "s-1", &Long {});
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "the correlation id is 600 bytes long, over the limit of 512 bytes an id may hold"
    );
    assert!(outbox_rows(&mut conn).await.is_empty());
}

#[tokio::test]
async fn a_transaction_ended_inside_the_closure_writes_no_ghost_event() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    create_orders_table(&mut conn).await;
    for statement in ["ROLLBACK", "COMMIT"] {
        let mut order = Order::place(&format!("o-{statement}"), "ada", 1);
        let error = env
            .outbox()
            .transaction(&mut conn, async |uow| {
                insert_order(uow.conn(), &order).await?;
                uow.conn().batch_execute(statement).await?;
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap_err();
        assert!(
            matches!(error, UnitOfWorkError::TransactionEnded),
            "{statement}: {error:?}"
        );
        assert!(
            outbox_rows(&mut conn).await.is_empty(),
            "{statement}: no event without its transaction"
        );
        assert_eq!(order.pending_events().len(), 1, "the events stay pending");
    }
    // The ROLLBACK undid the business row; the COMMIT was the closure's own.
    let ids: Vec<String> = orders::table
        .select(orders::id)
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(ids, ["o-COMMIT"]);
    // The connection is usable again.
    let mut next = Order::place("o-next", "ada", 1);
    env.outbox()
        .transaction(&mut conn, async |uow| {
            uow.track(&mut next);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
    assert_eq!(outbox_rows(&mut conn).await.len(), 1);
}

#[tokio::test]
async fn a_commit_on_a_database_without_the_outbox_tables_says_to_run_the_migrations() {
    let env = TestEnv::unmigrated(&support::nats_url()).await;
    let mut conn = env.conn().await;
    let mut order = Order::place("o-1", "ada", 1);
    let error = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            uow.track(&mut order);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&error, UnitOfWorkError::MissingMigrations(missing) if <[String]>::first(&missing.pending).map(String::as_str) == Some("20261121000001")),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .contains("run the outbox migrations first"),
        "{error}"
    );
}

#[tokio::test]
async fn events_recorded_after_track_are_written_in_order_and_drained_once() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let mut order = Order::place("o-1", "ada", 4200);
    let mut other = Order::place("o-2", "bob", 10);

    env.outbox()
        .transaction(&mut conn, async |uow| {
            uow.track(&mut order);
            uow.track(&mut other);
            order.record(OrderEvent::ItemAdded {
                sku: "tea".to_owned(),
                quantity: 2,
            });
            assert_eq!(uow.event_count(), 3, "a late event counts at once");
            uow.track(&mut order); // again: nothing taken twice
            order.record(OrderEvent::Shipped);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();

    assert_eq!(
        outbox_rows(&mut conn).await,
        [
            ("o-1".to_owned(), 1, "Placed".to_owned()),
            ("o-1".to_owned(), 2, "LineAdded".to_owned()),
            ("o-1".to_owned(), 3, "Shipped".to_owned()),
            ("o-2".to_owned(), 1, "Placed".to_owned()),
        ]
    );
    assert!(order.pending_events().is_empty() && other.pending_events().is_empty());

    // Once the unit of work has ended, recording is for the next one.
    order.record(OrderEvent::Shipped);
    assert_eq!(order.pending_events().len(), 1);
    env.commit(&mut order).await;
    assert_eq!(outbox_rows(&mut conn).await.len(), 5);
}

#[tokio::test]
async fn a_late_event_of_a_rolled_back_unit_stays_pending_and_a_bad_one_fails_the_commit() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let mut order = Order::place("o-1", "ada", 4200);
    let rolled_back = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            uow.track(&mut order);
            order.record(OrderEvent::Shipped);
            Err::<(), _>(UnitOfWorkError::Database(
                diesel::result::Error::RollbackTransaction,
            ))
        })
        .await;
    assert!(rolled_back.is_err());
    assert_eq!(order.pending_events().len(), 2);
    // Detached: recording now reaches no finished unit of work, and the next one takes all.
    order.record(OrderEvent::Shipped);
    env.commit(&mut order).await;
    assert_eq!(outbox_rows(&mut conn).await.len(), 3);

    let mut keyed = Keyed {
        id: "k-1".to_owned(),
        pending_events: outbox_runtime::PendingEvents::new(),
    };
    keyed.record(KeyedEvent {
        key: "fine".to_owned(),
    });
    let failed = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            uow.track(&mut keyed);
            keyed.record(KeyedEvent {
                key: "not a token".to_owned(),
            });
            Ok::<_, UnitOfWorkError>(())
        })
        .await;
    assert!(
        matches!(
            &failed,
            Err(UnitOfWorkError::InvalidSubjectToken {
                role: TokenRole::PartitionKey,
                value,
                ..
            }) if value == "not a token"
        ),
        "{failed:?}"
    );
    assert_eq!(
        outbox_rows(&mut conn).await.len(),
        3,
        "nothing of it written"
    );
    assert_eq!(keyed.pending_events().len(), 2, "both stay pending");
    keyed.discard_pending_events();
}

/// An event partitioned by a field of its own, which a unit of work checks.
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[event(name = "Keyed")]
struct KeyedEvent {
    #[event(partition_key)]
    key: String,
}

#[outbox_runtime::aggregate]
struct Keyed {
    id: String,
    pending_events: outbox_runtime::PendingEvents<KeyedEvent>,
}

/// An event only the drop test records, so that its warnings are told from other tests'.
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
struct DropProbeCounted {
    n: u32,
}

#[outbox_runtime::aggregate]
struct DropProbe {
    id: String,
    pending_events: outbox_runtime::PendingEvents<DropProbeCounted>,
}

fn drop_probe(events: u32) -> DropProbe {
    let mut probe = DropProbe {
        id: "p-1".to_owned(),
        pending_events: outbox_runtime::PendingEvents::new(),
    };
    for n in 0..events {
        probe.record(DropProbeCounted { n });
    }
    probe
}

#[tokio::test]
async fn dropping_an_aggregate_with_uncommitted_events_warns_in_debug_builds() {
    let env = TestEnv::new().await;
    let (logs, _turn) = support::Logs::capture().await;
    let warnings = || {
        logs.text()
            .lines()
            .filter(|line| line.contains("DropProbeCounted"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };

    drop(drop_probe(2));
    let seen = warnings();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(
        seen[0].contains("WARN") && seen[0].contains("events=2") && seen[0].contains("lost"),
        "{}",
        seen[0]
    );

    // Committed, discarded on purpose, or never recorded: no warning.
    let mut committed = drop_probe(3);
    env.commit(&mut committed).await;
    drop(committed);
    let mut discarded = drop_probe(1);
    assert_eq!(discarded.discard_pending_events().len(), 1);
    drop(discarded);
    drop(drop_probe(0));
    assert_eq!(warnings().len(), 1, "{:?}", warnings());
}

#[tokio::test]
async fn a_nested_unit_of_work_on_the_same_aggregate_leaves_the_outer_ones_late_events_to_it() {
    let env = TestEnv::new().await;
    let (mut outer_conn, mut inner_conn) = (env.conn().await, env.conn().await);
    let mut order = Order::place("o-1", "ada", 1);
    env.outbox()
        .transaction(&mut outer_conn, async |outer| {
            outer.track(&mut order);
            // A second unit of work, open at the same time on another connection, tracking
            // the same aggregate value: it takes what is pending, and nothing of the outer's.
            env.outbox()
                .transaction(&mut inner_conn, async |inner| {
                    inner.track(&mut order);
                    Ok::<_, UnitOfWorkError>(())
                })
                .await?;
            order.record(OrderEvent::Shipped);
            assert_eq!(
                outer.event_count(),
                2,
                "the outer one still takes late events"
            );
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
    let rows = outbox_rows(&mut env.conn().await).await;
    let types: Vec<&str> = rows.iter().map(|r| r.2.as_str()).collect();
    assert_eq!(types, ["Placed", "Placed", "Shipped"], "{rows:?}");
    assert!(order.pending_events().is_empty());
}

/// Values an SQL text could be fooled by: quotes, backslashes, dollar quotes, a comment,
/// statement ends, escapes, non-ASCII. Each is a valid subject token (`/*` is not).
const SQL_LOOKALIKES: [&str; 18] = [
    "it's",
    r"back\slash",
    r"\'",
    "''",
    "$$",
    "$o$",
    "E'x'",
    "--",
    "%s",
    "\u{e9}\u{1f600}",
    r"\x41",
    r"\u0041",
    ";COMMIT;",
    // And what an array's text gives a meaning to.
    "NULL",
    "{a,b}",
    "\"",
    r#"\""#,
    "}'::text[]",
];

/// An event whose payload carries what it is given.
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
struct Noted {
    sensor: String,
    round: u32,
    notes: Vec<String>,
}

#[tokio::test]
async fn values_that_look_like_sql_are_stored_as_they_are_however_many_events() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    let correlation_id = "c'\\\n$$;/*--";
    let causation_id = r"d\'E'";
    let note = |lookalike: &str| format!("{lookalike} \"quoted\"\t\u{7}\r\n");
    // 18 events go with the COMMIT; 180 in a statement of their own (more than 64).
    for (aggregate_type, rounds) in [("Few", 1), ("Many", 10)] {
        env.outbox()
            .transaction(&mut conn, async |uow| {
                uow.set_correlation(correlation_id, causation_id);
                for round in 0..rounds {
                    for lookalike in SQL_LOOKALIKES {
                        let noted = Noted {
                            sensor: lookalike.to_owned(),
                            round,
                            notes: vec![note(lookalike)],
                        };
                        uow.emit(aggregate_type, lookalike, &noted);
                    }
                }
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap();
    }

    type Row = (String, String, i64, String, String, String, String, String);
    let rows: Vec<Row> = outbox_events::table
        .select((
            outbox_events::aggregate_type,
            outbox_events::aggregate_id,
            outbox_events::aggregate_seq,
            outbox_events::partition_key,
            outbox_events::subject,
            diesel::dsl::sql::<diesel::sql_types::Text>("payload::text"),
            outbox_events::correlation_id.assume_not_null(),
            outbox_events::causation_id.assume_not_null(),
        ))
        .order((
            outbox_events::aggregate_type,
            outbox_events::aggregate_id,
            outbox_events::aggregate_seq,
        ))
        .load(&mut conn)
        .await
        .unwrap();
    let mut expected: Vec<Row> = Vec::new();
    for (aggregate_type, rounds) in [("Few", 1), ("Many", 10)] {
        for lookalike in SQL_LOOKALIKES {
            let id = lookalike.to_owned();
            for round in 0..rounds {
                let noted = Noted {
                    sensor: lookalike.to_owned(),
                    round,
                    notes: vec![note(lookalike)],
                };
                expected.push((
                    aggregate_type.to_owned(),
                    id.clone(),
                    i64::from(round) + 1,
                    id.clone(),
                    format!("{}.{aggregate_type}.{id}.Noted", env.prefix),
                    serde_json::to_string(&noted).unwrap(),
                    correlation_id.to_owned(),
                    causation_id.to_owned(),
                ));
            }
        }
    }
    expected.sort_by(|a, b| (&a.0, &a.1, a.2).cmp(&(&b.0, &b.1, b.2)));
    assert_eq!(rows.len(), expected.len());
    for (row, expected) in rows.iter().zip(&expected) {
        assert_eq!(row, expected);
    }
}

#[tokio::test]
async fn a_nul_in_a_correlation_id_fails_the_commit_and_writes_nothing() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    create_orders_table(&mut conn).await;
    let mut order = Order::place("o-1", "ada", 1);
    let error = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            insert_order(uow.conn(), &order).await?;
            uow.set_correlation("c\0", "d");
            uow.track(&mut order);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains("0x00"),
        "PostgreSQL names the byte: {error}"
    );
    assert!(outbox_rows(&mut conn).await.is_empty());
    assert_eq!(order_count(&mut conn).await, 0);
    assert_eq!(order.pending_events().len(), 1, "the events stay pending");
    commit_order(&env.outbox(), &mut conn, &mut order)
        .await
        .unwrap();
    assert_eq!(outbox_rows(&mut conn).await.len(), 1);
}

#[tokio::test]
async fn a_unit_of_work_writes_its_events_in_the_commits_round_trip() {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    create_orders_table(&mut conn).await;
    let sent = SentStatements::default();
    conn.set_instrumentation(sent.clone());
    let outbox = env.outbox();
    // Up to 64 events go with the COMMIT.
    for (n, events) in [1, 64, 65].into_iter().enumerate() {
        let mut order = Order::place(&format!("o-{n}"), "ada", 1);
        for _ in 1..events {
            order.record(OrderEvent::Shipped);
        }
        commit_order(&outbox, &mut conn, &mut order).await.unwrap();
        let shapes = sent.take_shapes();
        let expected: &[&str] = if events <= 64 {
            &["BEGIN", "the business insert", "the events with COMMIT"]
        } else {
            &["BEGIN", "the business insert", "the events", "COMMIT"]
        };
        assert_eq!(shapes, expected, "{events} events");
    }
    assert_eq!(outbox_rows(&mut conn).await.len(), 1 + 64 + 65);
}

/// With `report_transaction_ids`, a unit of work knows its transaction's id from its BEGIN
/// on: the id PostgreSQL gives the transaction its statements run in. `transaction_status`
/// then tells, on any connection to the server, a unit of work that committed from one that
/// rolled back (after a crash it no longer calls an id committed: see
/// `database_crash`). Without the setting there is no id.
#[tokio::test]
async fn a_unit_of_work_reports_its_transaction_id_and_the_server_tells_what_became_of_it() {
    use outbox_runtime::{TransactionStatus, transaction_status};
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    create_orders_table(&mut conn).await;
    let outbox = env.outbox().report_transaction_ids(true);
    let server_id = "SELECT pg_current_xact_id()::text::int8";
    let sent = SentStatements::default();
    conn.set_instrumentation(sent.clone());

    let mut order = Order::place("o-1", "ada", 4200);
    let (reported, seen) = outbox
        .transaction(&mut conn, async |uow| {
            let seen: i64 = diesel::dsl::sql::<diesel::sql_types::BigInt>(server_id)
                .get_result(uow.conn())
                .await?;
            insert_order(uow.conn(), &order).await?;
            uow.track(&mut order);
            Ok::<_, UnitOfWorkError>((uow.transaction_id(), seen))
        })
        .await
        .unwrap();
    let committed = reported.expect("an id, with report_transaction_ids");
    assert_eq!(committed.get(), seen as u64);
    // Pipelined: the instrumentation sees the query before the BEGIN (diesel-async records a
    // prepared statement when it builds its future, a batch when it is first polled); the
    // server ran it inside the transaction, or the id would be None.
    let shapes = sent.take_shapes();
    assert!(
        shapes[..2].contains(&"BEGIN".to_owned())
            && shapes[..2]
                .iter()
                .any(|sql| sql.contains("pg_current_xact_id()")),
        "the id asked with the BEGIN: {shapes:?}"
    );
    assert_eq!(committed.to_string(), seen.to_string());

    let mut rolled_back = None;
    let mut failed = Order::place("o-2", "grace", 990);
    let result = outbox
        .transaction(&mut conn, async |uow| {
            insert_order(uow.conn(), &failed).await?;
            uow.track(&mut failed);
            rolled_back = uow.transaction_id();
            Err::<(), _>(UnitOfWorkError::from(
                diesel::result::Error::RollbackTransaction,
            ))
        })
        .await;
    assert!(result.is_err());
    let rolled_back = rolled_back.expect("an id, with report_transaction_ids");
    assert!(
        rolled_back.get() > committed.get(),
        "{rolled_back} after {committed}"
    );

    // Asked on another connection, as after a lost one.
    let mut other = env.conn().await;
    assert_eq!(
        transaction_status(&mut other, committed).await.unwrap(),
        TransactionStatus::Committed
    );
    assert_eq!(
        transaction_status(&mut other, rolled_back).await.unwrap(),
        TransactionStatus::Aborted
    );

    // Without the setting, no id, and no statement for it.
    sent.take_shapes();
    let id = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            Ok::<_, UnitOfWorkError>(uow.transaction_id())
        })
        .await
        .unwrap();
    assert_eq!(id, None);
    assert_eq!(sent.take_shapes(), ["BEGIN", "COMMIT"]);
}

/// A unit of work that cannot have its transaction's id fails before its closure runs,
/// with the server's error, and ends the transaction its BEGIN opened: the connection is
/// out of any transaction, and the next unit of work on it commits.
#[tokio::test]
async fn a_unit_of_work_whose_transaction_id_fails_ends_its_transaction_and_leaves_the_connection_usable()
 {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    create_orders_table(&mut conn).await;
    conn.batch_execute(support::NO_TRANSACTION_IDS)
        .await
        .unwrap();
    let mut ran = false;
    let result = env
        .outbox()
        .report_transaction_ids(true)
        .transaction(&mut conn, async |_uow| {
            ran = true;
            Ok::<_, UnitOfWorkError>(())
        })
        .await;
    let error = result.unwrap_err().to_string();
    assert!(error.contains("no transaction ids here"), "{error}");
    assert!(!ran, "the closure ran without its transaction's id");

    let mut order = Order::place("o-1", "ada", 4200);
    commit_order(&env.outbox(), &mut conn, &mut order)
        .await
        .unwrap();
    assert_eq!(order_count(&mut env.conn().await).await, 1);
    assert_eq!(outbox_rows(&mut env.conn().await).await.len(), 1);
}
