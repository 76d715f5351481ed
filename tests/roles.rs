//! Roles of their own, against the real PostgreSQL and NATS: the service, the relay, the inbox
//! and the operator each log in as a role that holds only what `outbox grants` gives it, in a
//! database where no function runs for PUBLIC; and a role that lacks a privilege is named at
//! start, with each privilege it lacks.

mod support;

use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use outbox_runtime::privileges::{self, Component};
use outbox_runtime::{
    DomainEvent, Handler, Inbox, InboxConfig, Metadata, PublishedRows, Relay, UnitOfWork,
    UnitOfWorkError, dead_letter, inbox, outbox,
};
use serde::{Deserialize, Serialize};
use support::consumer::wait_until_settled;
use support::domain::{Order, OrderEvent};
use support::roles::{drop_roles, role};
use support::{Logs, TestEnv, count, insert_raw, sequences, wait_until};

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[event(name = "PaymentTaken")]
struct PaymentTaken {
    #[event(dedup_key)]
    request: String,
}

/// Fails every event of order `o-1`; for each other event, commits an event of its own (a
/// handler's unit of work writes the outbox too).
#[derive(Clone)]
struct Billing;

impl Handler for Billing {
    type Event = OrderEvent;
    type Error = String;

    async fn handle(
        &self,
        _event: OrderEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), String> {
        let order = message.aggregate_id.as_str();
        if order == "o-1" {
            return Err("the card was declined".to_owned());
        }
        uow.emit(
            "Payment",
            order,
            &PaymentTaken {
                request: message.id.clone(),
            },
        );
        Ok(())
    }
}

/// The consumer `billing` of `env`'s orders on the database at `url`, with [`Billing`]'s
/// unit of work and fast redeliveries.
fn billing(env: &TestEnv, url: &str) -> InboxConfig {
    let mut config = InboxConfig::new("billing", url);
    config.outbox = env.outbox();
    config.topology = env.topology();
    config.filter_subjects = vec![format!("{}.Order.>", env.prefix)];
    config.ack_wait = Duration::from_secs(1);
    config.retry_delay = Duration::from_millis(50);
    config.max_retry_delay = Duration::from_millis(200);
    config
}

/// Each part runs as a role that holds only what `outbox grants` gives it, in a database
/// where no function runs for PUBLIC (`REVOKE EXECUTE ON ALL FUNCTIONS ... FROM PUBLIC`, as
/// hardened databases are set up): units of work commit events with dedup keys; the relay
/// publishes in Archive mode, making the archive's day itself, and dead-letters a row the
/// broker refuses; the inbox records, retries, dead-letters and commits events of its own;
/// the operator reads the queue, skips the dead letter, discards the inbox's and purges.
///
/// Before, the relay's role could not make the archive's day: only outbox_published's owner
/// may attach a partition to it, and every archive failed with "must be owner of table
/// outbox_published" once the days the migrations made had passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_part_runs_as_a_role_holding_only_the_grants_written_for_it() {
    let env = TestEnv::new().await;
    let mut owner = env.conn().await;
    owner
        .batch_execute("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM PUBLIC")
        .await
        .unwrap();
    // No archive day exists: the relay's role has to make today's.
    let days = count(
        &mut owner,
        "SELECT count(*) FROM pg_inherits WHERE inhparent = 'outbox_published'::regclass",
    )
    .await;
    assert!(days >= 3, "the migrations made {days} days");
    owner
        .batch_execute(
            "DO $$ DECLARE p regclass; BEGIN \
                 FOR p IN SELECT inhrelid::regclass FROM pg_inherits \
                          WHERE inhparent = 'outbox_published'::regclass LOOP \
                     EXECUTE format('DROP TABLE %s', p); \
                 END LOOP; \
             END $$",
        )
        .await
        .unwrap();
    let app = role(&env, "app", &[Component::Service]).await;
    let relay_role = role(&env, "relay", &[Component::MessageRelay]).await;
    let inbox_role = role(
        &env,
        "inbox",
        &[Component::InboxConsumer, Component::Service],
    )
    .await;
    let operator = role(&env, "operator", &[Component::Operator]).await;

    // The service.
    let mut conn = AsyncPgConnection::establish(&app.url).await.unwrap();
    for n in 0..3 {
        let mut order = Order::place(&format!("o-{n}"), "ada", n);
        env.outbox()
            .transaction(&mut conn, async |uow| {
                uow.track(&mut order);
                uow.emit(
                    "Payment",
                    &format!("p-{n}"),
                    &PaymentTaken {
                        request: format!("r-{n}"),
                    },
                );
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap();
    }
    // A row the broker refuses (its subject outside the stream): a dead letter at once.
    insert_raw(&mut owner, "poison", "elsewhere.Raw.poison.Written").await;

    // The relay.
    let mut config = env.relay_config();
    config.database_url = relay_role.url.clone();
    config.published = PublishedRows::Archive;
    config.max_attempts = 1;
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    env.until_stream_holds(6, Duration::from_secs(20)).await;
    let operator_conn = || async { AsyncPgConnection::establish(&operator.url).await.unwrap() };
    let letters = wait_until("the dead letter", Duration::from_secs(10), || async {
        let letters = dead_letter::list(&mut operator_conn().await, 10)
            .await
            .unwrap();
        (!letters.is_empty()).then_some(letters)
    })
    .await;
    wait_until("six rows archived", Duration::from_secs(10), || async {
        let archived = count(
            &mut env.conn().await,
            "SELECT count(*) FROM outbox_published",
        )
        .await;
        (archived == 6).then_some(())
    })
    .await;
    relay.shutdown().await.unwrap();
    assert_eq!(
        count(
            &mut owner,
            "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = 'outbox_published'::regclass \
               AND pg_get_userbyid(c.relowner) = current_user",
        )
        .await,
        3,
        "today and two days ahead, made by the relay's role, owned by the tables' owner"
    );

    // Mark and Delete modes, and the relay's purge (`--purge-older-than`), as the same role.
    for (n, mode) in [(3, PublishedRows::Mark), (4, PublishedRows::Delete)] {
        let mut order = Order::place(&format!("o-{n}"), "ada", n);
        env.outbox()
            .transaction(&mut conn, async |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap();
        let mut config = env.relay_config();
        config.database_url = relay_role.url.clone();
        config.published = mode;
        let mut relay = Relay::connect(config, env.nats.clone()).await.unwrap();
        let report = relay.relay_batch().await.unwrap();
        assert_eq!(report.published, 1, "{mode:?}: {report:?}");
    }
    let mut relay_conn = AsyncPgConnection::establish(&relay_role.url).await.unwrap();
    let purged = outbox::purge_published(&mut relay_conn, Duration::ZERO, 100, |_| {})
        .await
        .unwrap();
    assert_eq!(purged, 1, "the row Mark mode kept");
    outbox::stats(&mut relay_conn).await.unwrap();

    // The inbox.
    let mut config = billing(&env, &inbox_role.url);
    config.max_attempts = 2;
    let inbox = Inbox::connect(config, env.nats.clone(), Billing)
        .await
        .unwrap();
    let probe = inbox.clone();
    let running = inbox.spawn();
    wait_until_settled(&probe, "every order settled", Duration::from_secs(20)).await;
    running.shutdown().await.unwrap();
    assert_eq!(
        count(&mut owner, "SELECT count(*) FROM outbox_inbox").await,
        5
    );
    assert_eq!(
        count(
            &mut owner,
            "SELECT count(*) FROM outbox_events WHERE aggregate_type = 'Payment'"
        )
        .await,
        4,
        "the handler's own events, for each order but o-1"
    );

    // The operator.
    let mut op = operator_conn().await;
    let stats = outbox::stats(&mut op).await.unwrap();
    assert_eq!(stats.dead_letters, 1, "{stats:?}");
    assert!(dead_letter::skip(&mut op, letters[0].id).await.unwrap());
    outbox::queued_by_type(&mut op).await.unwrap();
    outbox::published_last_minute(&mut op, 50_000)
        .await
        .unwrap();
    let inbox_letters = inbox::dead_letters(&mut op, Some("billing"), 10)
        .await
        .unwrap();
    assert_eq!(inbox_letters.len(), 1, "{inbox_letters:?}");
    assert_eq!(
        inbox::discard_dead_letters(&mut op, Some("billing"))
            .await
            .unwrap(),
        1
    );
    outbox::purge_published(&mut op, Duration::ZERO, 100, |_| {})
        .await
        .unwrap();
    outbox::purge_dedup_keys(&mut op, Duration::ZERO, 100)
        .await
        .unwrap();
    drop((conn, op));
    drop_roles(&env, &[&app, &relay_role, &inbox_role, &operator]).await;
}

/// A relay or an inbox whose role lacks privileges stops at start naming the role, each
/// privilege it lacks, and the command that writes the grants. Before, the relay started and
/// failed every batch with "permission denied for table outbox_events", and the inbox every
/// message, for as long as they ran.
#[tokio::test]
async fn a_relay_and_an_inbox_whose_role_lacks_privileges_name_each_one() {
    let env = TestEnv::new().await;
    env.conn()
        .await
        .batch_execute("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM PUBLIC")
        .await
        .unwrap();
    // The stream, as a relay with every privilege leaves it.
    drop(
        Relay::connect(env.relay_config(), env.nats.clone())
            .await
            .unwrap(),
    );
    let relay_role = role(&env, "relay", &[Component::MessageRelay]).await;
    env.conn()
        .await
        .batch_execute(&format!(
            "REVOKE UPDATE ON outbox_events FROM {0}; REVOKE SELECT ON outbox_aggregates FROM {0}",
            relay_role.name
        ))
        .await
        .unwrap();
    let mut config = env.relay_config();
    config.database_url = relay_role.url.clone();
    let error = match Relay::connect(config, env.nats.clone()).await {
        Ok(_) => panic!("a relay started without UPDATE on outbox_events"),
        Err(error) => error.to_string(),
    };
    let target = outbox_runtime::database::redacted(&relay_role.url);
    assert_eq!(
        error,
        format!(
            "relay: cannot connect to the database at {target}: checking the relay's \
             privileges: the role {:?} lacks UPDATE on outbox_events, SELECT on \
             outbox_aggregates, which the relay needs; as the tables' owner, run the \
             statements `outbox grants relay {}` prints (outbox_runtime::privileges::grants)",
            relay_role.name, relay_role.name
        )
    );

    // Archive mode needs the archive too; Delete mode does not.
    let archive_role = role(&env, "archive", &[]).await;
    let mut owner = env.conn().await;
    let grants = privileges::grants(Component::MessageRelay, &archive_role.name, "public").unwrap();
    owner.batch_execute(&grants).await.unwrap();
    owner
        .batch_execute(&format!(
            "REVOKE INSERT ON outbox_published FROM {0}; \
             REVOKE EXECUTE ON FUNCTION outbox_published_create_partitions FROM {0}",
            archive_role.name
        ))
        .await
        .unwrap();
    let mut config = env.relay_config();
    config.database_url = archive_role.url.clone();
    drop(
        Relay::connect(config.clone(), env.nats.clone())
            .await
            .unwrap(),
    );
    config.published = PublishedRows::Archive;
    let error = match Relay::connect(config, env.nats.clone()).await {
        Ok(_) => panic!("an archiving relay started without INSERT on outbox_published"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains(&format!(
            "the role {:?} lacks INSERT on outbox_published, EXECUTE on \
             outbox_published_create_partitions, which the relay needs",
            archive_role.name
        )),
        "{error}"
    );

    // An inbox given a role with the unit of work's grants, not the inbox's.
    let inbox_role = role(&env, "inbox", &[Component::Service]).await;
    let mut config = InboxConfig::new("billing", &inbox_role.url);
    config.topology = env.topology();
    let error = match Inbox::connect(config, env.nats.clone(), Billing).await {
        Ok(_) => panic!("an inbox started without its grants"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains(&format!(
            "checking the inbox's privileges: the role {:?} lacks SELECT on outbox_inbox, \
             INSERT on outbox_inbox, UPDATE on outbox_inbox, DELETE on outbox_inbox, SELECT on \
             outbox_inbox_positions,",
            inbox_role.name
        )) && error.contains(
            "EXECUTE on outbox_inbox_record, EXECUTE on outbox_inbox_finish, which the inbox \
             needs"
        ) && !error.contains("outbox_assert_unit_of_work"),
        "{error}"
    );

    // An inbox whose tables are in a schema of their own: the grants name it, and so does
    // the command in the error.
    let mut owner = env.conn().await;
    owner.batch_execute("CREATE SCHEMA second").await.unwrap();
    let search_path = "?options=-csearch_path%3Dsecond%2Cpublic";
    outbox_runtime::run_migrations(&format!("{}{search_path}", env.database_url))
        .await
        .unwrap();
    let second_role = role(&env, "second", &[]).await;
    let grants = privileges::grants(Component::InboxConsumer, &second_role.name, "second").unwrap();
    owner.batch_execute(&grants).await.unwrap();
    let mut config = InboxConfig::new("billing", format!("{}{search_path}", second_role.url));
    config.topology = env.topology();
    drop(
        Inbox::connect(config.clone(), env.nats.clone(), Billing)
            .await
            .unwrap(),
    );
    owner
        .batch_execute(&format!(
            "REVOKE DELETE ON second.outbox_inbox_gaps FROM {}",
            second_role.name
        ))
        .await
        .unwrap();
    let error = match Inbox::connect(config, env.nats.clone(), Billing).await {
        Ok(_) => panic!("an inbox started without DELETE on its gaps"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains(&format!(
            "the role {0:?} lacks DELETE on outbox_inbox_gaps, which the inbox needs; as the \
             tables' owner, run the statements `outbox grants inbox {0} --schema second` prints",
            second_role.name
        )),
        "{error}"
    );
    // Without USAGE on that schema, PostgreSQL leaves it out of the search_path without a
    // word, and the inbox found no tables: it said they were not migrated.
    owner
        .batch_execute(&format!(
            "GRANT DELETE ON second.outbox_inbox_gaps TO {0}; \
             REVOKE USAGE ON SCHEMA second FROM {0}",
            second_role.name
        ))
        .await
        .unwrap();
    let mut config = InboxConfig::new(
        "billing",
        format!("{}?options=-csearch_path%3Dsecond", second_role.url),
    );
    config.topology = env.topology();
    let error = match Inbox::connect(config, env.nats.clone(), Billing).await {
        Ok(_) => panic!("an inbox started without USAGE on its schema"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains(&format!(
            "the role {0:?} lacks USAGE on schema second, which the inbox needs; as the \
             tables' owner, run the statements `outbox grants inbox {0} --schema second` prints",
            second_role.name
        )),
        "{error}"
    );
    drop_roles(
        &env,
        &[&relay_role, &archive_role, &inbox_role, &second_role],
    )
    .await;
}

/// A privilege revoked from a running relay (an operator's mistake, a role rebuilt by a
/// deployment tool) is named in its log with what to run, not only "permission denied"; once
/// granted again, the relay publishes what waited, nothing lost, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_privilege_revoked_under_a_running_relay_is_named_with_what_to_run() {
    let (logs, _turn) = Logs::capture().await;
    let env = TestEnv::new().await;
    let relay_role = role(&env, "relay", &[Component::MessageRelay]).await;
    let mut config = env.relay_config();
    config.database_url = relay_role.url.clone();
    config.max_backoff = Duration::from_millis(200);
    config.poll_interval = Duration::from_millis(200);
    let relay = Relay::connect(config, env.nats.clone())
        .await
        .unwrap()
        .spawn();
    let mut owner = env.conn().await;
    env.commit(&mut Order::place("o-1", "ada", 1)).await;
    env.until_stream_holds(1, Duration::from_secs(5)).await;

    owner
        .batch_execute(&format!(
            "REVOKE UPDATE ON outbox_events FROM {}",
            relay_role.name
        ))
        .await
        .unwrap();
    let mut order = Order::place("o-2", "ada", 2);
    order.record(OrderEvent::Shipped);
    env.commit(&mut order).await;
    logs.until_contains(
        "the relay's log names the missing privilege and what to run",
        "permission denied for table outbox_events: the role the relay logs in as lacks a \
         privilege the relay needs; as the tables' owner, run the statements `outbox grants \
         relay <role>` prints",
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(env.stream_len().await, 1, "nothing published meanwhile");

    owner
        .batch_execute(&format!(
            "GRANT UPDATE ON outbox_events TO {}",
            relay_role.name
        ))
        .await
        .unwrap();
    env.until_stream_holds(3, Duration::from_secs(10)).await;
    relay.shutdown().await.unwrap();
    assert_eq!(sequences(&env.stream_messages().await)["o-2"], [1, 2]);
    drop_roles(&env, &[&relay_role]).await;
}

/// The same for a running inbox: each retry's warning names the missing privilege and what to
/// run; once granted again, the message is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_privilege_revoked_under_a_running_inbox_is_named_with_what_to_run() {
    let (logs, _turn) = Logs::capture().await;
    let env = TestEnv::new().await;
    let inbox_role = role(
        &env,
        "inbox",
        &[Component::InboxConsumer, Component::Service],
    )
    .await;
    drop(
        Relay::connect(env.relay_config(), env.nats.clone())
            .await
            .unwrap(),
    );
    let config = billing(&env, &inbox_role.url);
    let inbox = Inbox::connect(config, env.nats.clone(), Billing)
        .await
        .unwrap();
    let probe = inbox.clone();
    let running = inbox.spawn();
    let mut owner = env.conn().await;
    owner
        .batch_execute(&format!(
            "REVOKE INSERT ON outbox_inbox FROM {}",
            inbox_role.name
        ))
        .await
        .unwrap();
    env.commit(&mut Order::place("o-2", "ada", 2)).await;
    let mut relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    relay.relay_batch().await.unwrap();
    logs.until_contains(
        "the inbox's log names the missing privilege and what to run",
        "permission denied for table outbox_inbox: the role the inbox logs in as lacks a \
         privilege the inbox needs; as the tables' owner, run the statements `outbox grants \
         inbox <role>` prints",
        Duration::from_secs(10),
    )
    .await;
    owner
        .batch_execute(&format!(
            "GRANT INSERT ON outbox_inbox TO {}",
            inbox_role.name
        ))
        .await
        .unwrap();
    wait_until_settled(&probe, "the order applied", Duration::from_secs(10)).await;
    running.shutdown().await.unwrap();
    assert_eq!(
        count(&mut owner, "SELECT count(*) FROM outbox_inbox").await,
        1
    );
    assert_eq!(
        count(
            &mut owner,
            "SELECT count(*) FROM outbox_events WHERE aggregate_type = 'Payment'"
        )
        .await,
        1,
        "the handler's event, once"
    );
    drop_roles(&env, &[&inbox_role]).await;
}

/// A unit of work whose role lacks a privilege on the outbox's tables (a service given the
/// inbox's grants only, or one revoked by a deployment tool) fails naming what to run, not
/// only "permission denied for table outbox_events"; nothing is written, and once granted
/// the same unit of work commits.
#[tokio::test]
async fn a_unit_of_work_whose_role_lacks_a_privilege_names_what_to_run() {
    let env = TestEnv::new().await;
    let service = role(&env, "service", &[Component::Service]).await;
    let mut owner = env.conn().await;
    for (revoke, object) in [
        ("INSERT ON outbox_events", "table outbox_events"),
        ("UPDATE ON outbox_aggregates", "table outbox_aggregates"),
        ("INSERT ON outbox_dedup_keys", "table outbox_dedup_keys"),
    ] {
        owner
            .batch_execute(&format!("REVOKE {revoke} FROM {}", service.name))
            .await
            .unwrap();
        let mut conn = AsyncPgConnection::establish(&service.url).await.unwrap();
        let mut order = Order::place("o-1", "ada", 1);
        let error = env
            .outbox()
            .transaction(&mut conn, async |uow| {
                uow.track(&mut order);
                uow.emit(
                    "Payment",
                    "p-1",
                    &PaymentTaken {
                        request: "r-1".to_owned(),
                    },
                );
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .expect_err("a unit of work without the privilege");
        assert!(
            matches!(error, UnitOfWorkError::MissingPrivilege { .. }),
            "{revoke}: {error:?}"
        );
        assert_eq!(
            error.to_string(),
            format!(
                "permission denied for {object}: the role the service logs in as lacks a \
                 privilege the service needs; as the tables' owner, run the statements \
                 `outbox grants service <role>` prints"
            ),
            "{revoke}"
        );
        assert_eq!(
            order.pending_events().len(),
            1,
            "{revoke}: the events are kept"
        );
        assert_eq!(
            count(&mut owner, "SELECT count(*) FROM outbox_events").await,
            0,
            "{revoke}"
        );
        owner
            .batch_execute(&format!("GRANT {revoke} TO {}", service.name))
            .await
            .unwrap();
        env.outbox()
            .transaction(&mut conn, async |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap_or_else(|e| panic!("{revoke} granted again: {e}"));
        owner
            .batch_execute("DELETE FROM outbox_events; DELETE FROM outbox_aggregates")
            .await
            .unwrap();
    }
    drop_roles(&env, &[&service]).await;
}
