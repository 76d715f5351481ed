//! The harness every end-to-end test shares: each test gets its own PostgreSQL database
//! (migrated) and its own JetStream stream and subject prefix, so tests run in parallel and
//! twice in a row against the machine's real servers. Both are removed when the test ends.
//! The environment itself is the test kit's `TestEnv` (`outbox_runtime::testing`); what is
//! here is this project's own.
//!
//! `OUTBOX_TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`) is the
//! server to create databases on; `NATS_URL` (default `nats://127.0.0.1:4222`) the broker.

#![allow(dead_code)] // each test binary uses part of the harness

pub mod cluster;
pub mod consumer;
pub mod counters;
pub mod domain;
pub mod libtest;
#[cfg(feature = "mysql")]
pub mod mariadb;
pub mod nats;
pub mod postgres;
pub mod roles;

use std::time::Duration;

use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
#[allow(unused_imports)] // each test binary uses part of the harness
pub use nats::{NatsServer, free_port, signal};

/// The test kit's environment (`outbox_runtime::testing`, which users get too).
#[allow(unused_imports)] // each test binary uses part of the harness
pub use outbox_runtime::testing::{StoredMessage as Received, TestEnv, nats_url};

/// The `ce-sequence`s of `messages` per aggregate id (`ce-subject`, percent-decoded), in
/// stream order.
pub fn sequences(messages: &[Received]) -> std::collections::BTreeMap<String, Vec<u64>> {
    let mut sequences: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    for message in messages {
        let id = percent_encoding::percent_decode_str(&message.header("ce-subject"))
            .decode_utf8()
            .expect("a UTF-8 ce-subject")
            .into_owned();
        sequences.entry(id).or_default().push(
            message
                .header("ce-sequence")
                .parse()
                .expect("a numeric ce-sequence"),
        );
    }
    sequences
}

/// Asserts that `messages` hold the events `1..=events_each` of `aggregates` aggregates, each
/// once and each aggregate's in sequence order: nothing lost, stored twice or reordered.
pub fn assert_each_once_in_order(messages: &[Received], aggregates: usize, events_each: u64) {
    assert_eq!(
        messages.len(),
        aggregates * events_each as usize,
        "nothing lost, nothing stored twice"
    );
    let in_order: Vec<u64> = (1..=events_each).collect();
    let sequences = sequences(messages);
    assert_eq!(sequences.len(), aggregates, "aggregates in the stream");
    for (aggregate, seqs) in sequences {
        assert_eq!(seqs, in_order, "aggregate {aggregate} in stream order");
    }
}

/// The configuration of `env`'s stream, as JetStream reports it.
pub async fn stream_config(env: &TestEnv) -> async_nats::jetstream::stream::Config {
    env.jetstream()
        .get_stream(&env.stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone()
}

/// Inserts a row by plain SQL, as another writer would: aggregate `Raw`, sequence 1.
pub async fn insert_raw(conn: &mut AsyncPgConnection, aggregate_id: &str, subject: &str) {
    use diesel_async::RunQueryDsl;
    diesel::sql_query(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                    partition_key, subject, payload) \
         VALUES ('Raw', $1, 1, 'Written', $1, $2, '{}')",
    )
    .bind::<diesel::sql_types::Text, _>(aggregate_id)
    .bind::<diesel::sql_types::Text, _>(subject)
    .execute(conn)
    .await
    .unwrap();
}

/// The number `sql` selects as its column `count` (`SELECT count(*) FROM ...`).
///
/// # Panics
/// When the query fails, naming it.
pub async fn count(conn: &mut AsyncPgConnection, sql: &str) -> i64 {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        count: i64,
    }
    diesel::sql_query(sql)
        .get_result::<Count>(conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .count
}

/// The sessions connected to `conn`'s database but `conn`'s own, each as its state
/// (`idle`, `idle in transaction`, ...) and its `application_name`, as
/// `pg_stat_activity` shows them.
pub async fn other_sessions(conn: &mut AsyncPgConnection) -> Vec<(String, String)> {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Session {
        #[diesel(sql_type = diesel::sql_types::Text)]
        state: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        application_name: String,
    }
    let sessions: Vec<Session> = diesel::sql_query(
        "SELECT coalesce(state, '') AS state, application_name FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .load(conn)
    .await
    .unwrap();
    sessions
        .into_iter()
        .map(|session| (session.state, session.application_name))
        .collect()
}

/// The backend pids of the sessions of `env`'s database named `application_name`, sorted,
/// read on a connection of its own (which a short `idle_session_timeout` cannot end).
pub async fn sessions_named(env: &TestEnv, application_name: &str) -> Vec<i32> {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Session {
        #[diesel(sql_type = diesel::sql_types::Int4)]
        pid: i32,
    }
    let sessions: Vec<Session> = diesel::sql_query(
        "SELECT pid FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = $1 ORDER BY pid",
    )
    .bind::<diesel::sql_types::Text, _>(application_name)
    .load(&mut env.conn().await)
    .await
    .unwrap();
    sessions.into_iter().map(|session| session.pid).collect()
}

/// Ends the sessions of `env`'s database named `application_name` (`pg_terminate_backend`,
/// as a database restart or a failover does to them); returns how many.
pub async fn terminate_sessions(env: &TestEnv, application_name: &str) -> i64 {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Terminated {
        #[diesel(sql_type = diesel::sql_types::Int8)]
        count: i64,
    }
    let terminated: Terminated = diesel::sql_query(
        "SELECT count(pg_terminate_backend(pid)) AS count FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = $1",
    )
    .bind::<diesel::sql_types::Text, _>(application_name)
    .get_result(&mut env.conn().await)
    .await
    .unwrap();
    terminated.count
}

/// Sets `setting` to `value` for every later session of `env`'s database, as an operator's
/// `ALTER DATABASE ... SET` does (the connections already open keep theirs). Works on a
/// database whose sessions are read-only by default (its own session is not).
pub async fn set_database_default(env: &TestEnv, setting: &str, value: &str) {
    let mut conn = env.conn().await;
    conn.batch_execute("SET default_transaction_read_only = off")
        .await
        .unwrap();
    conn.batch_execute(&format!(
        "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET {setting} = %L', \
         current_database(), '{value}'); END $$"
    ))
    .await
    .unwrap();
}

/// Whether a connection of an inbox (named `outbox-inbox`) to `env`'s database is inside a
/// transaction and idle there (between two of its statements).
pub async fn inbox_in_transaction(env: &TestEnv) -> bool {
    other_sessions(&mut env.conn().await)
        .await
        .iter()
        .any(|(state, name)| name == "outbox-inbox" && state.starts_with("idle in transaction"))
}

/// Waits up to 5 s until no connection of an inbox to `env`'s database is inside a
/// transaction (see [`inbox_in_transaction`]).
pub async fn until_no_inbox_transaction_open(env: &TestEnv) {
    wait_until(
        "no transaction of the inbox left open",
        Duration::from_secs(5),
        || async { (!inbox_in_transaction(env).await).then_some(()) },
    )
    .await;
}

/// Waits up to 10 s until no session named `application_name` (the relay's connections name
/// themselves `outbox-relay`, the inbox's `outbox-inbox`) is connected to `env`'s database.
/// By name, not any session: a probe's own connection, closed a moment ago, may still be
/// listed while its backend exits.
pub async fn until_no_session_named(env: &TestEnv, application_name: &str) {
    wait_until(
        &format!("no session named {application_name}"),
        Duration::from_secs(10),
        || async {
            let sessions = other_sessions(&mut env.conn().await).await;
            (!sessions.iter().any(|(_, name)| name == application_name)).then_some(())
        },
    )
    .await;
}

/// Waits until `check` returns `Some`, polling every 20 ms, for at most `timeout`; panics
/// with `what` when it does not.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    poll_until(what, timeout, Duration::from_millis(20), check).await
}

/// [`wait_until`], polling every `interval` (a test that must act within milliseconds of a
/// state, a crash at a given point of a batch, polls more often).
pub async fn poll_until<T, F, Fut>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut check: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(interval).await;
    }
}

/// Deletes the durable consumer `consumer` of `env`'s stream, as an operator's `nats consumer
/// rm` does.
pub async fn delete_consumer(env: &TestEnv, consumer: &str) {
    env.jetstream()
        .get_stream(&env.stream)
        .await
        .unwrap()
        .delete_consumer(consumer)
        .await
        .unwrap_or_else(|e| panic!("delete the consumer {consumer}: {e}"));
}

/// A TCP server on loopback that accepts connections and never answers: a database host
/// that hangs.
pub struct BlackHole {
    pub port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl BlackHole {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        Self { port, task }
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A TCP proxy on loopback to another address, which a test can freeze: while frozen, it
/// forwards nothing in either direction (a database host that stops answering mid-query).
/// It can also cut a connection at the client's bytes that hold a pattern ([`Proxy::cut_at`]).
pub struct Proxy {
    pub port: u16,
    frozen: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cut: ArmedCut,
    task: tokio::task::JoinHandle<()>,
}

/// The pattern [`Proxy::cut_at`] waits for, and where it severs the connection; `None` once
/// used.
type ArmedCut = std::sync::Arc<std::sync::Mutex<Option<(Vec<u8>, Severed)>>>;

/// Where [`Proxy::cut_at`] severs a connection.
#[derive(Clone, Copy, Debug)]
pub enum Severed {
    /// The client's connection is closed, then the server receives the client's bytes: the
    /// server runs the statement, and its answer is not forwarded (a connection lost with the
    /// statement in flight, which the server then completes; a test waits for its effects).
    AfterForwarding,
    /// The bytes are not forwarded; the server's connection is closed, and the client's once
    /// the server closed it (a connection lost before the statement arrived).
    BeforeForwarding,
}

impl Proxy {
    pub async fn start(target: std::net::SocketAddr) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let frozen = Arc::new(AtomicBool::new(false));
        let cut = ArmedCut::default();
        let (flag, armed) = (frozen.clone(), cut.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                // Notified when this connection is cut after forwarding: the client's side
                // closes, and `severed` is notified once it has, before the client's bytes are
                // forwarded; the server's answer then goes nowhere.
                let sever = Arc::new(tokio::sync::Notify::new());
                let severed = Arc::new(tokio::sync::Notify::new());
                let (flag_up, armed) = (flag.clone(), armed.clone());
                let (sever_up, severed_up) = (sever.clone(), severed.clone());
                tokio::spawn(async move {
                    let mut buffer = vec![0_u8; 16 * 1024];
                    loop {
                        let Ok(read @ 1..) = client_read.read(&mut buffer).await else {
                            return;
                        };
                        while flag_up.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        let chunk = &buffer[..read];
                        let cut = {
                            let mut armed = armed.lock().unwrap();
                            let hit = armed.as_ref().is_some_and(|(pattern, _)| {
                                chunk
                                    .windows(pattern.len())
                                    .any(|w| w == pattern.as_slice())
                            });
                            if hit {
                                armed.take().map(|(_, cut)| cut)
                            } else {
                                None
                            }
                        };
                        match cut {
                            Some(Severed::AfterForwarding) => {
                                // The client's side first: a server that answers at once
                                // must not find it still open.
                                sever_up.notify_one();
                                severed_up.notified().await;
                                let _ = server_write.write_all(chunk).await;
                                // The server's side stays open, unclosed, until the test ends:
                                // the server runs the statement and answers, and no end of
                                // its connection can make it stop first.
                                std::future::pending::<()>().await;
                            }
                            // Dropping the server's write half closes it unsent.
                            Some(Severed::BeforeForwarding) => return,
                            None => {
                                if server_write.write_all(chunk).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
                let flag_down = flag.clone();
                tokio::spawn(async move {
                    let mut buffer = vec![0_u8; 16 * 1024];
                    loop {
                        let read = tokio::select! {
                            read = server_read.read(&mut buffer) => read,
                            () = sever.notified() => {
                                // The client reads the end of its connection; what the server
                                // answers is read (its writes must not fail: PostgreSQL ends
                                // a session whose client is gone before its next statement,
                                // a COMMIT too) and forwarded nowhere.
                                drop(client_write);
                                severed.notify_one();
                                while let Ok(1..) = server_read.read(&mut buffer).await {}
                                return;
                            }
                        };
                        // Returning drops the client's write half: the client reads the end
                        // of its connection.
                        let Ok(read @ 1..) = read else {
                            return;
                        };
                        while flag_down.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        if client_write.write_all(&buffer[..read]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self {
            port,
            frozen,
            cut,
            task,
        }
    }

    pub fn freeze(&self, frozen: bool) {
        self.frozen
            .store(frozen, std::sync::atomic::Ordering::SeqCst);
    }

    /// Cuts the next connection whose client sends bytes holding `pattern` (in one read),
    /// there, as `cut` says; once.
    pub fn cut_at(&self, pattern: &[u8], cut: Severed) {
        *self.cut.lock().unwrap() = Some((pattern.to_vec(), cut));
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Everything `tracing` writes, at any level, from the moment [`Logs::capture`] is called.
///
/// One subscriber for the whole test binary, installed as the global default on first use:
/// `tracing` caches per call site whether anyone listens, and a subscriber set for one
/// thread only can miss the events of call sites that another test's threads reached first.
/// The tests that read logs take turns (the guard), so that what they read is theirs and
/// the other tests' only.
#[derive(Clone, Default)]
pub struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

/// What one test captured: the global log from its start.
pub struct Captured {
    logs: Logs,
    from: usize,
}

impl Logs {
    pub async fn capture() -> (Captured, tokio::sync::MutexGuard<'static, ()>) {
        static GLOBAL: std::sync::OnceLock<Logs> = std::sync::OnceLock::new();
        static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let turn = TURN.lock().await;
        let logs = GLOBAL
            .get_or_init(|| {
                let logs = Logs::default();
                let subscriber = tracing_subscriber::fmt()
                    .with_writer(logs.clone())
                    .with_max_level(tracing::Level::TRACE)
                    .with_ansi(false)
                    .finish();
                tracing::subscriber::set_global_default(subscriber)
                    .expect("the only global subscriber of this test binary");
                logs
            })
            .clone();
        let from = logs.0.lock().unwrap().len();
        (Captured { logs, from }, turn)
    }
}

impl Captured {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.logs.0.lock().unwrap()[self.from..]).into_owned()
    }

    /// Waits up to `timeout` until the captured log holds `text` (`what`, for the panic).
    pub async fn until_contains(&self, what: &str, text: &str, timeout: Duration) {
        wait_until(what, timeout, || {
            let found = self.text().contains(text);
            async move { found.then_some(()) }
        })
        .await;
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Drops every packet between the database server's port and one client port on loopback,
/// both ways, as a network cut does (no FIN, no RST), until dropped: an nftables table of
/// the test's own (`nft`, as root), named after the test process. Tables that a killed test
/// process left (its process gone) are deleted first: a client port is reused, and a stale
/// rule would cut an unrelated connection.
pub struct Cut {
    table: String,
}

impl Cut {
    pub fn new(server_port: u16, client_port: u16) -> Self {
        Self::delete_orphans();
        let table = format!(
            "outbox_test_{}_{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        );
        let cut = Self { table };
        let t = &cut.table;
        for command in [
            format!("add table inet {t}"),
            format!("add chain inet {t} out {{ type filter hook output priority 0 ; }}"),
            format!("add rule inet {t} out tcp sport {server_port} tcp dport {client_port} drop"),
            format!("add rule inet {t} out tcp sport {client_port} tcp dport {server_port} drop"),
        ] {
            Self::nft(&command);
        }
        cut
    }

    /// Deletes the `outbox_test_<pid>_..` tables whose process no longer runs.
    fn delete_orphans() {
        let Ok(listed) = std::process::Command::new("nft")
            .args(["list", "tables"])
            .output()
        else {
            return;
        };
        for table in String::from_utf8_lossy(&listed.stdout)
            .lines()
            .filter_map(|line| line.strip_prefix("table inet "))
        {
            let Some(pid) = table
                .strip_prefix("outbox_test_")
                .and_then(|rest| rest.split('_').next())
            else {
                continue;
            };
            if !std::path::Path::new("/proc").join(pid).exists() {
                let _ = std::process::Command::new("nft")
                    .arg(format!("delete table inet {table}"))
                    .output();
            }
        }
    }

    fn nft(command: &str) {
        let output = std::process::Command::new("nft")
            .arg(command)
            .output()
            .unwrap_or_else(|e| panic!("this test needs nftables' `nft` (and root): {e}"));
        assert!(
            output.status.success(),
            "nft {command}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for Cut {
    fn drop(&mut self) {
        let _ = std::process::Command::new("nft")
            .arg(format!("delete table inet {}", self.table))
            .output();
    }
}

/// The end of a host-vanished test: relay `b` took over the aggregates of relay `a`, whose
/// connection `cut` drops and whose broker `proxy` froze. Waits until the stream holds
/// `expected` messages, then heals both, stops both relays, checks each event was stored
/// once, and returns how long after `cut_at` the stream held them all.
pub async fn taken_over(
    env: &TestEnv,
    (cut, cut_at): (Cut, std::time::Instant),
    proxy: &Proxy,
    (a, b): (outbox_runtime::RelayHandle, outbox_runtime::RelayHandle),
    expected: u64,
) -> Duration {
    env.until_stream_holds(expected, Duration::from_secs(120))
        .await;
    let took = cut_at.elapsed();
    println!("relay A's host vanished; relay B published its aggregates {took:.1?} later");
    b.shutdown().await.unwrap();
    // A comes back: its publishes are duplicates JetStream drops, its session is gone.
    drop(cut);
    proxy.freeze(false);
    let _ = tokio::time::timeout(Duration::from_secs(30), a.shutdown()).await;
    assert_eq!(
        env.stream_messages().await.len() as u64,
        expected,
        "each event once"
    );
    took
}

/// SQL that makes asking for a transaction's id fail on the connection that runs it, as on a
/// server without `pg_current_xact_id` (PostgreSQL 12): a function of that name in a schema
/// searched before `pg_catalog`.
pub const NO_TRANSACTION_IDS: &str = "\
    CREATE SCHEMA IF NOT EXISTS outbox_test_shadow; \
    CREATE OR REPLACE FUNCTION outbox_test_shadow.pg_current_xact_id() RETURNS xid8 \
        LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'no transaction ids here'; END $$; \
    SET search_path = outbox_test_shadow, public, pg_catalog";

/// The statements a connection sends, as diesel's instrumentation sees them (async or sync
/// connections alike: `conn.set_instrumentation(sent.clone())`).
#[derive(Clone, Default)]
pub struct SentStatements(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl diesel::connection::Instrumentation for SentStatements {
    fn on_connection_event(&mut self, event: diesel::connection::InstrumentationEvent<'_>) {
        if let diesel::connection::InstrumentationEvent::StartQuery { query, .. } = event {
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(query.to_string());
        }
    }
}

impl SentStatements {
    /// What each statement sent since the last call was, in a unit of work's terms (`BEGIN`,
    /// `the business insert`, `the events`, `the events with COMMIT`, `COMMIT`; any other
    /// statement as its SQL), leaving out the outbox's registration of its topology.
    pub fn take_shapes(&self) -> Vec<String> {
        let sent = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        sent.into_iter()
            .filter(|sql| !sql.starts_with("SELECT role, subject_prefix"))
            .map(|sql| {
                let shape = if sql.starts_with("BEGIN") {
                    "BEGIN"
                } else if sql.starts_with("INSERT INTO \"orders\"") {
                    "the business insert"
                } else if sql.starts_with("SELECT outbox_insert_events(E'{")
                    && sql.ends_with("); COMMIT")
                {
                    "the events with COMMIT"
                } else if sql.starts_with("SELECT outbox_insert_events($1") {
                    "the events"
                } else if sql == "COMMIT" {
                    "COMMIT"
                } else {
                    return sql;
                };
                shape.to_owned()
            })
            .collect()
    }
}

/// The address of the server of a database URL (`scheme://[user@]host:port/...`).
pub fn server_of(url: &str) -> std::net::SocketAddr {
    use std::net::ToSocketAddrs;
    let authority = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = authority.split('/').next().unwrap_or_default();
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    host.to_socket_addrs()
        .ok()
        .and_then(|mut addresses| addresses.next())
        .unwrap_or_else(|| panic!("no server address in {url}"))
}

/// `url` with its server replaced by port `port` on loopback, in plain text all the way, so
/// that a proxy there reads the statements: without TLS (libpq's `sslmode=prefer` would
/// encrypt), and over TCP (mysql_async's `prefer_socket` moves a loopback connection to the
/// server's Unix socket after the handshake).
pub fn through(url: &str, port: u16) -> String {
    let (scheme, rest) = url.split_once("://").expect("a database URL");
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let user = authority
        .rsplit_once('@')
        .map_or(String::new(), |(user, _)| format!("{user}@"));
    let plain = if scheme.starts_with("postgres") {
        "sslmode=disable"
    } else {
        "prefer_socket=false"
    };
    let separator = if path.contains('?') { '&' } else { '?' };
    format!("{scheme}://{user}127.0.0.1:{port}/{path}{separator}{plain}")
}
