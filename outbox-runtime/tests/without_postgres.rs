//! The runtime built for SQLite alone, as a service that uses no other database builds it:
//!
//! ```sh
//! cargo test -p outbox-runtime --no-default-features --features sqlite,testing --test without_postgres
//! ```
//!
//! Units of work commit to a SQLite file, the `SqliteRelay` publishes them, a consumer reads
//! exactly the committed events from the stream, each aggregate's in order, and an inbox on
//! another SQLite file applies each once; the test
//! kit's aggregate tests and in-memory outbox run too. CI also checks that this build holds
//! no tokio-postgres. Needs the NATS server at `NATS_URL` (default `nats://127.0.0.1:4222`).

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use outbox_runtime::async_nats::jetstream::{self, consumer::pull};
use outbox_runtime::diesel::sql_types::{BigInt, Text};
use outbox_runtime::diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use outbox_runtime::sqlite::{AsyncSqliteConnection, SqliteRelay};
use outbox_runtime::testing::{AggregateTest, InMemoryOutbox};
use outbox_runtime::{
    DomainEvent, Handler, Inbox, InboxConfig, Metadata, Outbox, PendingEvents, RelayConfig,
    StreamSettings, Topology, UnitOfWork, UnitOfWorkError, aggregate,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
enum LampEvent {
    SwitchedOn { by: String },
    SwitchedOff,
}

#[aggregate]
struct Lamp {
    id: String,
    on: bool,
    pending_events: PendingEvents<LampEvent>,
}

impl Lamp {
    fn new(id: &str) -> Self {
        Self {
            id: id.to_owned(),
            on: false,
            pending_events: PendingEvents::new(),
        }
    }

    fn toggle(&mut self, by: &str) {
        self.on = !self.on;
        if self.on {
            self.record(LampEvent::SwitchedOn { by: by.to_owned() });
        } else {
            self.record(LampEvent::SwitchedOff);
        }
    }
}

/// A SQLite file in a directory of a test's own, removed with all it holds when dropped:
/// the file, and the write-ahead log and wal-index WAL mode keeps beside it (`<path>-wal`
/// and `<path>-shm`: SQLite's "Database File Format", 4.0 and 4.5).
struct TempDatabase {
    /// The file's path, the database URL.
    path: String,
    dir: std::path::PathBuf,
}

impl Drop for TempDatabase {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh SQLite file, migrated, and its async connection. Bound as `let (file, conn) =
/// database();`, the connection is dropped before the file is removed.
fn database() -> (TempDatabase, AsyncSqliteConnection) {
    let dir = std::env::temp_dir().join(format!(
        "outbox-without-postgres-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir(&dir).expect("a temporary directory");
    let file = TempDatabase {
        path: dir.join("outbox.db").to_string_lossy().into_owned(),
        dir,
    };
    let mut conn = outbox_runtime::sqlite::establish(&file.path).expect("a SQLite file");
    outbox_runtime::sqlite::run_migrations(&mut conn).expect("the SQLite migrations");
    (file, AsyncSqliteConnection::new(conn))
}

/// Logs each lamp event it applies into `lamp_log`.
struct LampLog;

impl Handler<AsyncSqliteConnection> for LampLog {
    type Event = LampEvent;
    type Error = outbox_runtime::diesel::result::Error;

    async fn handle(
        &self,
        _event: LampEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_, AsyncSqliteConnection>,
    ) -> Result<(), Self::Error> {
        outbox_runtime::diesel::sql_query("INSERT INTO lamp_log (lamp, seq) VALUES (?, ?)")
            .bind::<Text, _>(&message.aggregate_id)
            .bind::<BigInt, _>(message.sequence)
            .execute(uow.conn())
            .await?;
        Ok(())
    }
}

#[tokio::test]
async fn units_of_work_on_sqlite_reach_the_stream_without_postgresql_compiled() {
    let (file, mut conn) = database();
    let path = file.path.clone();
    let unique = uuid::Uuid::now_v7().simple().to_string();
    let topology = Topology::new(
        format!("lamps{}", &unique[16..]).parse().expect("a prefix"),
        StreamSettings {
            name: format!("LAMPS_{unique}"),
            ..StreamSettings::default()
        },
    );
    let outbox = Outbox::with_topology(topology.clone());

    // Three lamps toggled in three units of work each; one more unit of work rolls back.
    let mut lamps: Vec<Lamp> = ["hall", "porch", "desk"].map(Lamp::new).into();
    for round in 0..3 {
        for lamp in &mut lamps {
            lamp.toggle(&format!("round-{round}"));
            outbox
                .transaction(&mut conn, async |uow| {
                    uow.track(lamp);
                    Ok::<_, UnitOfWorkError>(())
                })
                .await
                .expect("the unit of work commits");
        }
    }
    let mut ghost = Lamp::new("ghost");
    ghost.toggle("nobody");
    let rolled_back = outbox
        .transaction(&mut conn, async |uow| {
            uow.track(&mut ghost);
            Err::<(), _>(UnitOfWorkError::Database(
                outbox_runtime::diesel::result::Error::RollbackTransaction,
            ))
        })
        .await;
    assert!(rolled_back.is_err(), "the closure's error rolls back");
    assert_eq!(ghost.pending_events().len(), 1, "kept for a retry");

    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let nats = outbox_runtime::async_nats::connect(&nats_url)
        .await
        .expect("the NATS server");
    let mut config = RelayConfig::new(path.clone());
    config.topology = topology.clone();
    let mut relay = SqliteRelay::connect(config, nats.clone())
        .await
        .expect("the relay connects");
    let mut published = 0;
    while published < 9 {
        let report = relay.relay_batch().await.expect("a batch");
        assert!(report.claimed > 0, "9 events, {published} published");
        published += report.published;
    }
    assert_eq!(relay.relay_batch().await.expect("a batch").claimed, 0);

    let js = jetstream::new(nats);
    let mut stream = js
        .get_stream(&topology.stream.name)
        .await
        .expect("the relay created the stream");
    assert_eq!(stream.info().await.expect("stream info").state.messages, 9);
    let consumer = stream
        .create_consumer(pull::Config::default())
        .await
        .expect("a consumer");
    let mut messages = consumer
        .fetch()
        .max_messages(100)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .expect("a fetch");
    let mut seen: BTreeMap<String, Vec<(i64, String)>> = BTreeMap::new();
    while let Some(message) = messages.next().await {
        let message = message.expect("a message");
        let headers = message.headers.as_ref().expect("headers");
        let header = |name: &str| headers.get(name).expect(name).as_str().to_owned();
        seen.entry(header("ce-subject")).or_default().push((
            header("ce-sequence").parse().expect("a sequence"),
            message.subject.to_string(),
        ));
    }
    let prefix = topology.subject_prefix.as_str();
    for lamp in ["desk", "hall", "porch"] {
        let expected: Vec<(i64, String)> = ["SwitchedOn", "SwitchedOff", "SwitchedOn"]
            .iter()
            .zip(1..)
            .map(|(event, seq)| (seq, format!("{prefix}.Lamp.{lamp}.{event}")))
            .collect();
        assert_eq!(seen.remove(lamp), Some(expected), "{lamp}");
    }
    assert!(seen.is_empty(), "nothing else published: {seen:?}");

    // Another service's inbox, on a SQLite file of its own, applies each event once.
    let (consumer_file, mut consumer_conn) = database();
    let consumer_path = consumer_file.path.clone();
    consumer_conn
        .batch_execute("CREATE TABLE lamp_log (n INTEGER PRIMARY KEY, lamp TEXT, seq INTEGER)")
        .await
        .expect("the consumer's table");
    let mut inbox_config = InboxConfig::new("lamp-log", &consumer_path);
    inbox_config.topology = topology.clone();
    let inbox: Inbox<LampLog, AsyncSqliteConnection> =
        Inbox::connect(inbox_config, js.client(), LampLog)
            .await
            .expect("the inbox connects");
    let mut durable = inbox.consumer().clone();
    let running = inbox.spawn();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let info = durable.info().await.expect("the consumer's info");
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "settled within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.shutdown().await.expect("the inbox stops");
    #[derive(outbox_runtime::diesel::QueryableByName)]
    struct Logged {
        #[diesel(sql_type = Text)]
        lamp: String,
        #[diesel(sql_type = BigInt)]
        seq: i64,
    }
    let logged: Vec<Logged> =
        outbox_runtime::diesel::sql_query("SELECT lamp, seq FROM lamp_log ORDER BY n")
            .load(&mut consumer_conn)
            .await
            .expect("the log");
    let mut applied: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for row in logged {
        applied.entry(row.lamp).or_default().push(row.seq);
    }
    let once_in_order: BTreeMap<String, Vec<i64>> = ["desk", "hall", "porch"]
        .map(|lamp| (lamp.to_owned(), vec![1, 2, 3]))
        .into();
    assert_eq!(applied, once_in_order);

    js.delete_stream(&topology.stream.name)
        .await
        .expect("the stream is removed");
}

#[tokio::test]
async fn the_test_kit_runs_without_postgresql() {
    AggregateTest::given(Lamp::new("hall"))
        .when(|lamp| lamp.toggle("ada"))
        .then_recorded([LampEvent::SwitchedOn { by: "ada".into() }]);

    let outbox = InMemoryOutbox::new();
    let mut lamp = Lamp::new("porch");
    lamp.toggle("ada");
    lamp.toggle("ada");
    outbox
        .transaction(async |uow| {
            uow.track(&mut lamp);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .expect("the in-memory unit of work commits");
    let written: Vec<(String, i64)> = outbox
        .written()
        .into_iter()
        .map(|event| (event.subject, event.aggregate_seq))
        .collect();
    assert_eq!(
        written,
        [
            ("events.Lamp.porch.SwitchedOn".to_owned(), 1),
            ("events.Lamp.porch.SwitchedOff".to_owned(), 2)
        ]
    );
}
