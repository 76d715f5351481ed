//! Producer dedup keys (`#[event(dedup_key)]`) against the real PostgreSQL and NATS: a second
//! unit of work emitting a key writes nothing for it (or fails, by its `DuplicateEvents`),
//! racing units of work write one event, and a rollback takes no key.

mod support;

use std::sync::Arc;
use std::time::Duration;

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_runtime::outbox::schema::outbox_events;
use outbox_runtime::{DomainEvent, DuplicateEvents, UnitOfWorkError};
use serde::{Deserialize, Serialize};
use support::TestEnv;

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
enum UserEvent {
    /// Keyed by the request that created the user.
    Created {
        #[event(dedup_key)]
        request: String,
        name: String,
    },
    /// Keyed only sometimes.
    Renamed {
        #[event(dedup_key)]
        request: Option<String>,
        name: String,
    },
}

fn created(request: &str) -> UserEvent {
    UserEvent::Created {
        request: request.to_owned(),
        name: "ada".to_owned(),
    }
}

fn renamed(request: Option<&str>) -> UserEvent {
    UserEvent::Renamed {
        request: request.map(str::to_owned),
        name: "grace".to_owned(),
    }
}

/// `(aggregate_id, aggregate_seq, event_type)` of every outbox row.
async fn rows(conn: &mut AsyncPgConnection) -> Vec<(String, i64, String)> {
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

async fn users(conn: &mut AsyncPgConnection) -> i64 {
    diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM users")
        .get_result(conn)
        .await
        .unwrap()
}

/// Commits `events` for aggregate `User`/`id`, with a business row, under `duplicates`.
async fn commit(
    env: &TestEnv,
    conn: &mut AsyncPgConnection,
    id: &str,
    events: &[UserEvent],
    duplicates: DuplicateEvents,
) -> Result<(), UnitOfWorkError> {
    env.outbox()
        .transaction(conn, async |uow| {
            uow.set_duplicate_events(duplicates);
            diesel::sql_query("INSERT INTO users VALUES ($1)")
                .bind::<diesel::sql_types::Text, _>(id)
                .execute(uow.conn())
                .await?;
            for event in events {
                uow.emit("User", id, event);
            }
            Ok(())
        })
        .await
}

async fn setup() -> (TestEnv, AsyncPgConnection) {
    let env = TestEnv::new().await;
    let mut conn = env.conn().await;
    conn.batch_execute("CREATE TABLE users (id text)")
        .await
        .unwrap();
    (env, conn)
}

#[tokio::test]
async fn a_second_unit_of_work_with_a_taken_key_writes_nothing_for_it_and_commits_the_rest() {
    let (env, mut conn) = setup().await;
    commit(
        &env,
        &mut conn,
        "u-1",
        &[created("req-1")],
        DuplicateEvents::Skip,
    )
    .await
    .unwrap();
    // The retried request: the same key, and an event without one after it.
    let retried = [created("req-1"), renamed(None), renamed(Some("req-2"))];
    commit(&env, &mut conn, "u-1", &retried, DuplicateEvents::Skip)
        .await
        .unwrap();
    // The aggregate's sequence has no hole where the duplicate was dropped.
    let expected = [
        ("u-1".to_owned(), 1, "Created".to_owned()),
        ("u-1".to_owned(), 2, "Renamed".to_owned()),
        ("u-1".to_owned(), 3, "Renamed".to_owned()),
    ];
    assert_eq!(rows(&mut conn).await, expected);
    assert_eq!(users(&mut conn).await, 2, "the business writes committed");

    // A third time, both keys taken: only the keyless event is written.
    let again = [created("req-1"), renamed(Some("req-2")), renamed(None)];
    commit(&env, &mut conn, "u-1", &again, DuplicateEvents::Skip)
        .await
        .unwrap();
    assert_eq!(rows(&mut conn).await.len(), 4);

    // The stream gets exactly what was written.
    support::consumer::relay_all(&env).await;
    env.until_stream_holds(4, Duration::from_secs(10)).await;
    let subjects: Vec<String> = env
        .stream_messages()
        .await
        .iter()
        .map(|m| m.subject.clone())
        .collect();
    let prefix = &env.prefix;
    assert_eq!(
        subjects,
        [
            format!("{prefix}.User.u-1.Created"),
            format!("{prefix}.User.u-1.Renamed"),
            format!("{prefix}.User.u-1.Renamed"),
            format!("{prefix}.User.u-1.Renamed"),
        ]
    );
}

#[tokio::test]
async fn with_fail_a_taken_key_rolls_the_unit_of_work_back_whole() {
    let (env, mut conn) = setup().await;
    commit(
        &env,
        &mut conn,
        "u-1",
        &[created("req-1")],
        DuplicateEvents::Fail,
    )
    .await
    .unwrap();
    let error = commit(
        &env,
        &mut conn,
        "u-2",
        &[renamed(None), created("req-1")],
        DuplicateEvents::Fail,
    )
    .await
    .unwrap_err();
    match &error {
        UnitOfWorkError::DuplicateEvent {
            dedup_key,
            aggregate_id,
            event_type,
            ..
        } => assert_eq!(
            (
                dedup_key.as_str(),
                aggregate_id.as_str(),
                event_type.as_str()
            ),
            ("req-1", "u-2", "Created")
        ),
        other => panic!("expected DuplicateEvent, got {other:?}"),
    }
    assert!(error.to_string().contains("\"req-1\""), "{error}");
    assert_eq!(
        rows(&mut conn).await.len(),
        1,
        "nothing of the second was written"
    );
    assert_eq!(users(&mut conn).await, 1, "its business write rolled back");
}

#[tokio::test]
async fn a_rolled_back_unit_of_work_takes_no_key() {
    let (env, mut conn) = setup().await;
    let failed: Result<(), UnitOfWorkError> = env
        .outbox()
        .transaction(&mut conn, async |uow| {
            uow.emit("User", "u-1", &created("req-1"));
            Err(diesel::result::Error::RollbackTransaction.into())
        })
        .await;
    assert!(failed.is_err());
    commit(
        &env,
        &mut conn,
        "u-1",
        &[created("req-1")],
        DuplicateEvents::Fail,
    )
    .await
    .unwrap();
    assert_eq!(rows(&mut conn).await.len(), 1);
}

#[tokio::test]
async fn one_unit_of_work_with_a_key_twice_writes_its_first_event() {
    let (env, mut conn) = setup().await;
    let events = [created("req-1"), renamed(Some("req-1")), renamed(None)];
    commit(&env, &mut conn, "u-1", &events, DuplicateEvents::Skip)
        .await
        .unwrap();
    let kinds: Vec<String> = rows(&mut conn).await.into_iter().map(|r| r.2).collect();
    assert_eq!(kinds, ["Created", "Renamed"]);
    let twice = commit(&env, &mut conn, "u-2", &events[..2], DuplicateEvents::Fail).await;
    assert!(
        matches!(twice, Err(UnitOfWorkError::DuplicateEvent { .. })),
        "{twice:?}"
    );
}

/// Units of work on their own connections, all emitting one key and reaching COMMIT together:
/// exactly one writes its event, whichever policy.
#[tokio::test]
async fn units_of_work_racing_with_one_key_write_one_event() {
    const RACERS: usize = 8;
    for (round, duplicates) in [DuplicateEvents::Skip, DuplicateEvents::Fail]
        .into_iter()
        .enumerate()
    {
        let (env, mut conn) = setup().await;
        let env = Arc::new(env);
        let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
        let key = format!("race-{round}");
        let racers: Vec<_> = (0..RACERS)
            .map(|n| {
                let (env, barrier, key) = (Arc::clone(&env), Arc::clone(&barrier), key.clone());
                tokio::spawn(async move {
                    let mut conn = env.conn().await;
                    env.outbox()
                        .transaction(&mut conn, async |uow| {
                            uow.set_duplicate_events(duplicates);
                            // Each holds a row lock of its own before the race, so the
                            // transactions overlap.
                            diesel::sql_query("INSERT INTO users VALUES ($1)")
                                .bind::<diesel::sql_types::Text, _>(format!("u-{n}"))
                                .execute(uow.conn())
                                .await?;
                            uow.emit("User", &format!("u-{n}"), &created(&key));
                            barrier.wait().await;
                            Ok::<_, UnitOfWorkError>(())
                        })
                        .await
                })
            })
            .collect();
        let mut results = Vec::new();
        for racer in racers {
            results.push(racer.await.unwrap());
        }
        assert_eq!(rows(&mut conn).await.len(), 1, "{duplicates:?}: one event");
        let failed = results.iter().filter(|r| r.is_err()).count();
        match duplicates {
            DuplicateEvents::Skip => {
                assert_eq!(failed, 0, "{results:?}");
                assert_eq!(users(&mut conn).await, RACERS as i64);
            }
            DuplicateEvents::Fail => {
                assert_eq!(failed, RACERS - 1, "{results:?}");
                assert!(results.iter().flatten().count() == 1);
                assert!(
                    results
                        .iter()
                        .all(|r| matches!(r, Ok(()) | Err(UnitOfWorkError::DuplicateEvent { .. })))
                );
                assert_eq!(users(&mut conn).await, 1);
            }
        }
    }
}

#[tokio::test]
async fn an_unstorable_key_fails_the_commit_and_names_the_event() {
    let (env, mut conn) = setup().await;
    for (key, reason) in [
        (String::new(), "it is empty"),
        (
            "k".repeat(513),
            "it is 513 bytes long, over the limit of 512 bytes",
        ),
        ("a\0b".to_owned(), "it contains a NUL character"),
    ] {
        let error = commit(
            &env,
            &mut conn,
            "u-1",
            &[created(&key)],
            DuplicateEvents::Skip,
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&error, UnitOfWorkError::InvalidDedupKey { reason: r, event_type, .. }
                if r == reason && event_type == "Created"),
            "{error:?}"
        );
    }
    assert!(rows(&mut conn).await.is_empty());
    assert_eq!(users(&mut conn).await, 0);
}

#[tokio::test]
async fn purged_keys_are_free_again_and_recent_ones_are_kept() {
    let (env, mut conn) = setup().await;
    let events = [created("old"), renamed(Some("recent"))];
    commit(&env, &mut conn, "u-1", &events, DuplicateEvents::Fail)
        .await
        .unwrap();
    conn.batch_execute(
        "UPDATE outbox_dedup_keys SET created_at = now() - interval '2 days' \
         WHERE dedup_key = 'old'",
    )
    .await
    .unwrap();
    let day = Duration::from_secs(86_400);
    let purged = outbox_runtime::outbox::purge_dedup_keys(&mut conn, day, 1)
        .await
        .unwrap();
    assert_eq!(purged, 1);
    commit(
        &env,
        &mut conn,
        "u-2",
        &[created("old")],
        DuplicateEvents::Fail,
    )
    .await
    .expect("a purged key is free");
    let recent = [renamed(Some("recent"))];
    let kept = commit(&env, &mut conn, "u-3", &recent, DuplicateEvents::Fail).await;
    assert!(
        matches!(kept, Err(UnitOfWorkError::DuplicateEvent { .. })),
        "{kept:?}"
    );
}
