//! PostgreSQL itself crashing under the unit of work, the relay and the inbox: every process
//! of a server of the test's own SIGKILLed (nothing flushed, PostgreSQL's WAL buffers lost)
//! and started again on the same directory, which runs PostgreSQL's crash recovery. Twice:
//! first while the relay publishes a backlog in one batch, its acks held back so that the
//! batch has rows in the stream and has not committed; then while writers commit, the relay
//! publishes and an inbox consumer applies, on the same server.
//!
//! What must hold after the crashes: every unit of work the writers were told committed is
//! there; the events in the stream are exactly those of the business rows that committed
//! (none lost, no ghost of a transaction the crash rolled back), each once, each aggregate's
//! in order without gaps; the rows of the batch the crash rolled back were published again,
//! and JetStream dropped them as duplicates; the consumer applied each event exactly once,
//! in its aggregate's order; nothing is left queued or dead-lettered.
//!
//! A second test crashes a server right after a relay batch committed, its commit record
//! still in the WAL buffers (the relay's batches commit asynchronously): the batch's rows
//! come back, and are published again without a copy in the stream.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_runtime::{
    DomainEvent, Handler, Inbox, InboxConfig, Metadata, PendingEvents, Relay, TransactionId,
    TransactionStatus, UnitOfWork, UnitOfWorkError, aggregate, transaction_status,
};
use serde::{Deserialize, Serialize};
use support::postgres::PostgresServer;
use support::{NatsServer, Proxy, Received, TestEnv, count, poll_until, sequences, wait_until};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
enum LedgerEvent {
    Booked { token: String },
}

#[aggregate]
struct Account {
    id: String,
    pending_events: PendingEvents<LedgerEvent>,
}

/// Applies each booking into `applied`, in the inbox's transaction.
#[derive(Clone)]
struct Applying;

impl Handler for Applying {
    type Event = LedgerEvent;
    type Error = diesel::result::Error;

    async fn handle(
        &self,
        event: LedgerEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        let LedgerEvent::Booked { token } = event;
        diesel::sql_query("INSERT INTO applied (token, account, seq) VALUES ($1, $2, $3)")
            .bind::<diesel::sql_types::Text, _>(token)
            .bind::<diesel::sql_types::Text, _>(&message.aggregate_id)
            .bind::<diesel::sql_types::Int8, _>(message.sequence)
            .execute(uow.conn())
            .await?;
        Ok(())
    }
}

/// What one writer saw: the tokens of the units of work it was told committed, how many
/// failed, and of those the ones whose COMMIT the crash cut off, with their transaction's id
/// (whether they committed is for `transaction_status` to tell).
#[derive(Default)]
struct Written {
    committed: Vec<String>,
    failed: usize,
    unknown: Vec<(String, TransactionId)>,
}

const WRITERS: usize = 4;
const ACCOUNTS_PER_WRITER: usize = 10;
/// Events committed before the relay starts, over `BACKLOG_ACCOUNTS` accounts.
const BACKLOG: usize = 2_000;
const BACKLOG_ACCOUNTS: usize = 2;

/// Commits one booking per unit of work over its accounts, round after round, until `stop`;
/// after a failure it reconnects (waiting while the server is down) and carries on with a
/// new token: the failed booking's event is discarded with it, since it may have committed.
async fn write(env: Arc<TestEnv>, writer: usize, stop: CancellationToken) -> Written {
    let mut accounts: Vec<Account> = (0..ACCOUNTS_PER_WRITER)
        .map(|n| Account {
            id: format!("acct-{writer}-{n}"),
            pending_events: PendingEvents::new(),
        })
        .collect();
    let mut written = Written::default();
    let mut conn: Option<AsyncPgConnection> = None;
    let mut n = 0_usize;
    while !stop.is_cancelled() {
        let Some(live) = conn.as_mut() else {
            match tokio::time::timeout(
                Duration::from_secs(2),
                AsyncPgConnection::establish(&env.database_url),
            )
            .await
            {
                Ok(Ok(fresh)) => conn = Some(fresh),
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
            continue;
        };
        let token = format!("{writer}-{n}");
        let account = &mut accounts[n % ACCOUNTS_PER_WRITER];
        n += 1;
        account.record(LedgerEvent::Booked {
            token: token.clone(),
        });
        let outcome = env
            .outbox()
            .report_transaction_ids(true)
            .transaction(live, async |uow| {
                diesel::sql_query("INSERT INTO bookings (token, account) VALUES ($1, $2)")
                    .bind::<diesel::sql_types::Text, _>(&token)
                    .bind::<diesel::sql_types::Text, _>(&account.id)
                    .execute(uow.conn())
                    .await?;
                uow.track(account);
                Ok::<_, UnitOfWorkError>(())
            })
            .await;
        match outcome {
            Ok(()) => written.committed.push(token),
            Err(error) => {
                if let UnitOfWorkError::CommitOutcomeUnknown { transaction, .. } = error {
                    let id = transaction.expect("an id, with report_transaction_ids");
                    written.unknown.push((token, id));
                }
                account.discard_pending_events();
                written.failed += 1;
                conn = None;
            }
        }
    }
    written
}

#[derive(QueryableByName)]
struct Booking {
    #[diesel(sql_type = diesel::sql_types::Text)]
    token: String,
}

#[derive(QueryableByName)]
struct Applied {
    #[diesel(sql_type = diesel::sql_types::Text)]
    token: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    account: String,
    #[diesel(sql_type = diesel::sql_types::Int8)]
    seq: i64,
}

/// The relay's duplicates counter is the test binary's: its tests take turns.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How many rows `env`'s outbox holds (queued: the relay deletes what it published).
async fn queued(env: &TestEnv) -> i64 {
    count(
        &mut env.conn().await,
        "SELECT count(*) AS count FROM outbox_events",
    )
    .await
}

/// A booking's token, from its message's payload (the variant's fields: `{"token":".."}`).
fn token(message: &Received) -> String {
    let payload: serde_json::Value = serde_json::from_slice(&message.payload)
        .unwrap_or_else(|e| panic!("the payload of {}: {e}", message.subject));
    payload["token"]
        .as_str()
        .unwrap_or_else(|| panic!("no token in the payload of {}", message.subject))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgresql_crash_loses_no_committed_event_publishes_no_ghost_and_applies_each_once() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let counters = support::counters::Counters::installed();
    let mut server = PostgresServer::start().await;
    let nats = NatsServer::start().await;
    // The test kit's environment gives the NATS client, prefix and stream; its database is
    // the crashing server's (the one it created on the shared server goes unused).
    let mut env = TestEnv::with_nats(&nats.url()).await;
    env.database_url = server.url("postgres");
    outbox_runtime::run_migrations(&env.database_url)
        .await
        .unwrap();
    env.conn()
        .await
        .batch_execute(
            "CREATE TABLE bookings (token text PRIMARY KEY, account text NOT NULL); \
             CREATE TABLE applied (n bigserial PRIMARY KEY, token text NOT NULL, \
             account text NOT NULL, seq bigint NOT NULL)",
        )
        .await
        .unwrap();
    let env = Arc::new(env);

    // A backlog the relay publishes in one batch, two aggregates' long chains, one publish
    // after the other's ack: the first crash comes while it publishes them, so that rows
    // are in the stream whose batch has not committed. The relay reaches NATS through a
    // proxy that holds its acks back from just before the crash, so that the batch cannot
    // commit in between, however late the crash comes.
    let mut conn = env.conn().await;
    let mut backlog: Vec<Account> = (0..BACKLOG_ACCOUNTS)
        .map(|n| Account {
            id: format!("backlog-{n}"),
            pending_events: PendingEvents::new(),
        })
        .collect();
    let mut backlog_tokens = Vec::new();
    for unit in 0..BACKLOG / 100 {
        let mut tokens = Vec::new();
        let mut owners = Vec::new();
        for (n, account) in backlog.iter_mut().enumerate() {
            for event in 0..100 / BACKLOG_ACCOUNTS {
                let token = format!("backlog-{unit}-{n}-{event}");
                account.record(LedgerEvent::Booked {
                    token: token.clone(),
                });
                tokens.push(token);
                owners.push(account.id.clone());
            }
        }
        env.outbox()
            .transaction(&mut conn, async |uow| {
                diesel::sql_query(
                    "INSERT INTO bookings (token, account) \
                     SELECT * FROM unnest($1::text[], $2::text[])",
                )
                .bind::<diesel::sql_types::Array<diesel::sql_types::Text>, _>(&tokens)
                .bind::<diesel::sql_types::Array<diesel::sql_types::Text>, _>(&owners)
                .execute(uow.conn())
                .await?;
                for account in backlog.iter_mut() {
                    uow.track(account);
                }
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap();
        backlog_tokens.extend(tokens);
    }
    drop(conn);

    let proxy = Proxy::start(([127, 0, 0, 1], nats.port).into()).await;
    let relay_nats = outbox_runtime::nats::connect(&format!("nats://127.0.0.1:{}", proxy.port))
        .await
        .unwrap();
    let mut relay_config = env.relay_config();
    relay_config.batch_size = BACKLOG;
    relay_config.max_backoff = Duration::from_millis(500);
    relay_config.connect_timeout = Duration::from_secs(2);
    relay_config.statement_timeout = Duration::from_secs(5);
    let relay = Relay::connect(relay_config, relay_nats)
        .await
        .unwrap()
        .spawn();
    poll_until(
        "the relay publishing 200 of the backlog",
        Duration::from_secs(30),
        Duration::from_millis(2),
        || async { (env.stream_len().await >= 200).then_some(()) },
    )
    .await;
    proxy.freeze(true);
    server.crash().await;
    // Less than the whole backlog: its batch had acks to wait for, and could not commit. (A
    // host that stalled the test for the rest of the batch, a few hundred milliseconds,
    // would leave nothing to publish again.)
    let published = env.stream_len().await;
    let mid_batch = published < BACKLOG as u64;
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart().await;
    proxy.freeze(false);
    let restarted = std::time::Instant::now();
    wait_until(
        "the backlog published again",
        Duration::from_secs(30),
        || async { (queued(&env).await == 0).then_some(()) },
    )
    .await;
    let recovered = restarted.elapsed();

    let mut inbox_config = InboxConfig::new("crash", &env.database_url);
    inbox_config.outbox = env.outbox();
    inbox_config.topology = env.topology();
    inbox_config.ack_wait = Duration::from_secs(1);
    inbox_config.retry_delay = Duration::from_millis(50);
    inbox_config.max_retry_delay = Duration::from_millis(200);
    inbox_config.connect_timeout = Duration::from_secs(2);
    inbox_config.statement_timeout = Duration::from_secs(5);
    let inbox = Inbox::connect(inbox_config, env.nats.clone(), Applying)
        .await
        .unwrap();
    let settled = inbox.clone();
    let inbox = inbox.spawn();

    // The second crash comes while writers commit, the relay publishes and the consumer
    // applies.
    let stop = CancellationToken::new();
    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| tokio::spawn(write(env.clone(), writer, stop.clone())))
        .collect();
    // A unit of work that committed before the crash, with its transaction's id: the server
    // calls it committed now, and after the crash can no longer vouch for the id.
    let mut witness = Account {
        id: "witness".to_owned(),
        pending_events: PendingEvents::new(),
    };
    witness.record(LedgerEvent::Booked {
        token: "witness-0".to_owned(),
    });
    let witness_id = env
        .outbox()
        .report_transaction_ids(true)
        .transaction(&mut env.conn().await, async |uow| {
            diesel::sql_query(
                "INSERT INTO bookings (token, account) VALUES ('witness-0', 'witness')",
            )
            .execute(uow.conn())
            .await?;
            uow.track(&mut witness);
            Ok::<_, UnitOfWorkError>(uow.transaction_id())
        })
        .await
        .unwrap()
        .expect("an id, with report_transaction_ids");
    assert_eq!(
        transaction_status(&mut env.conn().await, witness_id)
            .await
            .unwrap(),
        TransactionStatus::Committed
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.crash().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.restart().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    let mut committed: BTreeSet<String> = backlog_tokens.into_iter().collect();
    committed.insert("witness-0".to_owned());
    let mut failed = 0;
    let mut unknown = Vec::new();
    for writer in writers {
        let written = writer.await.unwrap();
        failed += written.failed;
        committed.extend(written.committed);
        unknown.extend(written.unknown);
    }

    let mut conn = env.conn().await;
    let bookings: BTreeSet<String> = diesel::sql_query("SELECT token FROM bookings")
        .load::<Booking>(&mut conn)
        .await
        .unwrap()
        .into_iter()
        .map(|booking| booking.token)
        .collect();
    eprintln!(
        "the first crash came with {published} of the backlog's {BACKLOG} events in the \
         stream, the relay had published and deleted them all {recovered:.2?} after the \
         restart; {} events committed in all, {failed} units of work failed at the second \
         crash, {} bookings in the database after recovery",
        committed.len(),
        bookings.len()
    );
    let lost: Vec<&String> = committed.difference(&bookings).collect();
    assert!(
        lost.is_empty(),
        "committed, then lost by the crash: {lost:?}"
    );
    // What the server tells of each unit of work the crash left unknown must not contradict
    // its rows. Recovery ended every transaction, and may have given the id of one whose
    // COMMIT it lost to a later one (seen here: called committed, its row not written), so
    // after the crash only "aborted" can be told, and it must hold.
    assert_eq!(
        transaction_status(&mut conn, witness_id).await.unwrap(),
        TransactionStatus::Undecidable,
        "a transaction of before the crash, its id possibly handed out again since"
    );
    let mut resolved_aborted = 0;
    for (token, id) in &unknown {
        let status = transaction_status(&mut conn, *id).await.unwrap();
        let written = bookings.contains(token);
        match status {
            TransactionStatus::Aborted => {
                assert!(
                    !written,
                    "booking {token} (transaction {id}): aborted, yet written"
                );
                resolved_aborted += 1;
            }
            TransactionStatus::Undecidable => {}
            other => panic!(
                "booking {token} (transaction {id}, {}written): {other:?} across a crash",
                if written { "" } else { "not " }
            ),
        }
    }
    eprintln!(
        "{} units of work of unknown outcome, {resolved_aborted} of them told aborted by the \
         server's record (transaction_status), the others undecidable across the crash",
        unknown.len()
    );
    assert!(
        failed > 0,
        "the crashes met no unit of work: the test tested nothing"
    );

    // Everything committed reaches the stream and the consumer; should it not, the last
    // state seen says which of the three stopped short.
    let expected = i64::try_from(bookings.len()).unwrap();
    let seen = LastSeen::default();
    let drain_started = std::time::Instant::now();
    wait_until(
        "the relay and the inbox drain",
        Duration::from_secs(60),
        || {
            let (env, settled, seen) = (env.clone(), settled.clone(), seen.clone());
            async move {
                let queued = queued(&env).await;
                let applied = count(
                    &mut env.conn().await,
                    "SELECT count(*) AS count FROM applied",
                )
                .await;
                let mut consumer = settled.consumer().clone();
                let info = consumer.info().await;
                let consumer = match &info {
                    Ok(i) => format!(
                        "{} pending, {} ack-pending, {} redelivered",
                        i.num_pending, i.num_ack_pending, i.num_redelivered
                    ),
                    Err(error) => format!("unreadable ({error})"),
                };
                seen.set(format!(
                    "{queued} queued, {applied} of {expected} applied, consumer: {consumer}"
                ));
                let acks_pending = info.ok()?.num_ack_pending;
                (queued == 0 && applied >= expected && acks_pending == 0).then_some(())
            }
        },
    )
    .await;
    let drained = drain_started.elapsed();
    let deliveries = support::consumer::deliveries(&settled).await;
    relay.shutdown().await.unwrap();
    inbox.shutdown().await.unwrap();

    let messages = env.stream_messages().await;
    let mut in_stream: BTreeMap<String, usize> = BTreeMap::new();
    for message in &messages {
        *in_stream.entry(token(message)).or_default() += 1;
    }
    let missing: Vec<&String> = bookings
        .iter()
        .filter(|token| !in_stream.contains_key(*token))
        .collect();
    assert!(
        missing.is_empty(),
        "committed, never published: {missing:?}"
    );
    let ghosts: Vec<&String> = in_stream
        .keys()
        .filter(|token| !bookings.contains(*token))
        .collect();
    assert!(ghosts.is_empty(), "published, never committed: {ghosts:?}");
    let twice: Vec<(&String, &usize)> = in_stream.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "in the stream more than once: {twice:?}");
    for (account, seqs) in sequences(&messages) {
        let contiguous: Vec<u64> = (1..=seqs.len() as u64).collect();
        assert_eq!(seqs, contiguous, "{account}'s events in the stream");
    }

    let applied: Vec<Applied> =
        diesel::sql_query("SELECT token, account, seq FROM applied ORDER BY n")
            .load(&mut conn)
            .await
            .unwrap();
    let applied_tokens: BTreeSet<&String> = applied.iter().map(|row| &row.token).collect();
    assert_eq!(
        applied.len(),
        applied_tokens.len(),
        "a booking applied twice"
    );
    assert_eq!(
        applied_tokens,
        bookings.iter().collect(),
        "the consumer applied what committed"
    );
    let mut per_account: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for row in &applied {
        per_account.entry(&row.account).or_default().push(row.seq);
    }
    let accounts = per_account.len();
    for (account, seqs) in per_account {
        let in_order: Vec<i64> = (1..=seqs.len() as i64).collect();
        assert_eq!(
            seqs, in_order,
            "{account}'s events as the consumer applied them"
        );
    }
    for table in ["outbox_events", "outbox_inbox_dead_letters"] {
        let left = count(&mut conn, &format!("SELECT count(*) AS count FROM {table}")).await;
        assert_eq!(left, 0, "rows left in {table}");
    }
    // The rows of the batch the first crash rolled back, in the stream already, published
    // again and acked by JetStream as duplicates.
    let again = counters.get("outbox_relay_duplicates_total{}");
    if mid_batch {
        assert!(
            again >= published,
            "{published} rows of the batch the first crash rolled back were in the stream, \
             and only {again} were published again"
        );
    } else {
        eprintln!("the backlog's batch was published whole before the crash");
    }
    eprintln!(
        "{} messages in the stream, {} applied, over {accounts} accounts; {again} rows \
         published again after a crash, dropped by JetStream as duplicates; the relay and \
         the inbox drained {drained:.1?} after the writers stopped; {deliveries} deliveries \
         to the consumer",
        messages.len(),
        applied.len(),
    );
}

/// The relay's batch commits asynchronously: a crash soon after it loses the commit's record,
/// and the rows the batch deleted are queued again. The rows are published again, in order,
/// and JetStream drops the copies: the stream holds each event once.
///
/// The loss is made likely, then checked. The server's WAL writer waits 10 s
/// (`wal_writer_delay`, 200 ms by default) before it writes a commit that did not wait, and
/// nothing else commits, so the crash that follows the relay's batch usually finds the
/// commit's record still in PostgreSQL's WAL buffers. Not always: an asynchronous commit that
/// completes a WAL page nudges the WAL writer (`XLogSetAsyncXactLSN`), which writes, and on
/// its first round flushes, what it finds (`XLogBackgroundFlush`; PostgreSQL 15
/// src/backend/access/transam/xlog.c), and whether the batch's WAL crosses a page depends on
/// what was written before it. A round whose commit outlived the crash (its rows stay
/// deleted, already published) is followed by another, with new events, until one loses its
/// commit: a batch of 30 rows is about 1.7 kB of WAL (a 54-byte record per deleted row,
/// `pg_waldump`), so a round crosses an 8-kB page about one time in five, and eight rounds all
/// crossing is a chance in hundreds of thousands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_batch_whose_commit_a_crash_lost_is_published_again_and_dropped_by_jetstream() {
    const EVENTS: usize = 30;
    const ROUNDS: usize = 8;
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut server = PostgresServer::start_with(&["wal_writer_delay=10s"]).await;
    let mut env = TestEnv::new().await;
    env.database_url = server.url("postgres");
    outbox_runtime::run_migrations(&env.database_url)
        .await
        .unwrap();
    let mut account = Account {
        id: "acct-1".to_owned(),
        pending_events: PendingEvents::new(),
    };
    let mut written = 0;
    let mut lost = false;
    for round in 1..=ROUNDS {
        for n in written..written + EVENTS {
            account.record(LedgerEvent::Booked {
                token: n.to_string(),
            });
        }
        written += EVENTS;
        env.commit(&mut account).await;

        let relay = Relay::connect(env.relay_config(), env.nats.clone())
            .await
            .unwrap()
            .spawn();
        poll_until(
            "the relay's batch committing",
            Duration::from_secs(30),
            Duration::from_millis(2),
            || async { (queued(&env).await == 0).then_some(()) },
        )
        .await;
        // The batch committed (its delete is visible); its record is, as a rule, not written.
        server.crash().await;
        relay.shutdown().await.unwrap();
        server.restart().await;
        match queued(&env).await {
            0 => eprintln!(
                "round {round}: the batch's commit outlived the crash (the WAL writer wrote it); \
                 another round"
            ),
            again => {
                assert_eq!(
                    again, EVENTS as i64,
                    "after the crash, the rows of the batch whose commit it lost are queued again"
                );
                lost = true;
                break;
            }
        }
    }
    assert!(
        lost,
        "no crash in {ROUNDS} rounds lost the relay batch's commit: each batch's asynchronous \
         commit was written before the crash"
    );

    let relay = Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap()
        .spawn();
    wait_until(
        "the rows published again",
        Duration::from_secs(30),
        || async { (queued(&env).await == 0).then_some(()) },
    )
    .await;
    relay.shutdown().await.unwrap();
    let messages = env.stream_messages().await;
    let tokens: Vec<String> = messages.iter().map(token).collect();
    let expected: Vec<String> = (0..written).map(|n| n.to_string()).collect();
    assert_eq!(tokens, expected, "each event once, in order");
}

/// Why a transaction's id cannot be trusted across a crash, made certain: a unit of work's
/// transaction writes, and the server crashes before its COMMIT, with the write's WAL still in
/// PostgreSQL's buffers (the WAL writer waits 10 s, and nothing else commits). Recovery never
/// sees the id, and hands it out again: a later transaction that commits takes it, and the
/// server's record (`pg_xact_status`) calls the lost unit of work committed. The unit of work
/// reports its outcome unknown with its id, and `transaction_status` answers `Undecidable`,
/// never `Committed`; the row was not written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_hands_a_lost_transactions_id_out_again_and_transaction_status_does_not_call_it_committed()
 {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut server = PostgresServer::start_with(&["wal_writer_delay=10s"]).await;
    let url = server.url("postgres");
    outbox_runtime::run_migrations(&url).await.unwrap();
    let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
    conn.batch_execute("CREATE TABLE bookings (token text PRIMARY KEY, account text NOT NULL)")
        .await
        .unwrap();
    drop(conn);

    let mut account = Account {
        id: "acct-1".to_owned(),
        pending_events: PendingEvents::new(),
    };
    account.record(LedgerEvent::Booked {
        token: "lost".to_owned(),
    });
    let mut seen = None;
    let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
    let result = outbox_runtime::Outbox::new()
        .report_transaction_ids(true)
        .transaction(&mut conn, async |uow| {
            diesel::sql_query("INSERT INTO bookings (token, account) VALUES ('lost', 'acct-1')")
                .execute(uow.conn())
                .await?;
            uow.track(&mut account);
            seen = uow.transaction_id();
            server.crash().await;
            Ok::<_, UnitOfWorkError>(())
        })
        .await;
    let id = match result {
        Err(UnitOfWorkError::CommitOutcomeUnknown {
            transaction: Some(id),
            ..
        }) => id,
        other => panic!("the COMMIT met a dead server: {other:?}"),
    };
    assert_eq!(Some(id), seen);
    server.restart().await;

    // Later transactions, each taking an id and committing, until one has taken the lost
    // unit of work's.
    let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
    let mut reused = false;
    for _ in 0..100 {
        let taken: i64 = diesel::dsl::sql::<diesel::sql_types::BigInt>(
            "SELECT pg_current_xact_id()::text::int8",
        )
        .get_result(&mut conn)
        .await
        .unwrap();
        if taken as u64 >= id.get() {
            reused = taken as u64 == id.get();
            break;
        }
    }
    assert!(
        reused,
        "the crash lost transaction {id}, and recovery did not hand it out again"
    );
    let record: String = diesel::dsl::sql::<diesel::sql_types::Text>(&format!(
        "SELECT pg_xact_status('{id}'::xid8)"
    ))
    .get_result(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        record, "committed",
        "the server's record is of the later transaction"
    );
    assert_eq!(
        transaction_status(&mut conn, id).await.unwrap(),
        TransactionStatus::Undecidable
    );
    assert_eq!(
        count(&mut conn, "SELECT count(*) AS count FROM bookings").await,
        0
    );
}

/// The last state a wait saw, printed (as "last seen") when the test panics while it is
/// alive: a timed-out wait then says what it was waiting on.
#[derive(Clone, Default)]
struct LastSeen(std::sync::Arc<std::sync::Mutex<String>>);

impl LastSeen {
    fn set(&self, state: String) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = state;
    }
}

impl Drop for LastSeen {
    fn drop(&mut self) {
        if std::thread::panicking() && std::sync::Arc::strong_count(&self.0) == 1 {
            let seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
            eprintln!("last seen: {seen}");
        }
    }
}
