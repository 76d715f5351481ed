//! The harness every end-to-end test shares: each test gets its own PostgreSQL database
//! (migrated) and its own JetStream stream and subject prefix, so tests run in parallel and
//! twice in a row against the machine's real servers. Both are removed when the test ends.
//!
//! `OUTBOX_TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`) is the
//! server to create databases on; `NATS_URL` (default `nats://127.0.0.1:4222`) the broker.

#![allow(dead_code)] // each test binary uses part of the harness

pub mod cluster;
pub mod consumer;
pub mod counters;
pub mod domain;

use std::time::Duration;

use async_nats::jetstream::{
    self,
    consumer::{DeliverPolicy, pull},
};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use futures::StreamExt;
use outbox_runtime::{Aggregate, Outbox, RelayConfig, StreamSettings, Topology, UnitOfWorkError};

pub struct TestEnv {
    /// The URL of this test's own database.
    pub database_url: String,
    admin_url: String,
    database: String,
    nats_url: String,
    pub nats: async_nats::Client,
    /// This test's subject prefix (one token).
    pub prefix: String,
    /// This test's stream, capturing `{prefix}.>`.
    pub stream: String,
}

fn admin_url() -> String {
    std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

impl TestEnv {
    /// A fresh, migrated database and a unique stream name and subject prefix (the stream
    /// itself is created by the first relay, as in production), on the shared NATS.
    pub async fn new() -> Self {
        Self::with_nats(&nats_url()).await
    }

    /// The same, on the NATS server at `nats_url`.
    pub async fn with_nats(nats_url: &str) -> Self {
        let env = Self::unmigrated(nats_url).await;
        outbox_runtime::run_migrations(&env.database_url)
            .await
            .expect("migrations apply");
        env
    }

    /// A fresh database without the outbox tables, on the NATS server at `nats_url`.
    pub async fn unmigrated(nats_url: &str) -> Self {
        let nats = outbox_runtime::nats::connect(nats_url)
            .await
            .expect("NATS is reachable (see README: the services)");
        Self::unmigrated_with(nats, nats_url).await
    }

    /// A fresh, migrated database, with a NATS client the test connected itself (with
    /// credentials a URL cannot carry); `nats_url` is where the cleanup connects.
    pub async fn with_client(nats: async_nats::Client, nats_url: &str) -> Self {
        let env = Self::unmigrated_with(nats, nats_url).await;
        outbox_runtime::run_migrations(&env.database_url)
            .await
            .expect("migrations apply");
        env
    }

    async fn unmigrated_with(nats: async_nats::Client, nats_url: &str) -> Self {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..16].to_owned();
        let admin_url = admin_url();
        let database = format!("outbox_test_{tag}");
        let mut admin = AsyncPgConnection::establish(&admin_url)
            .await
            .expect("PostgreSQL is reachable (see README: the services)");
        admin
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .await
            .expect("create the test database");
        let database_url = match admin_url.rsplit_once('/') {
            Some((server, _)) => format!("{server}/{database}"),
            None => panic!("OUTBOX_TEST_DATABASE_URL has no database part: {admin_url}"),
        };
        Self {
            database_url,
            admin_url,
            database,
            nats_url: nats_url.to_owned(),
            nats,
            prefix: format!("t{tag}"),
            stream: format!("TEST_{}", tag.to_uppercase()),
        }
    }

    pub async fn conn(&self) -> AsyncPgConnection {
        AsyncPgConnection::establish(&self.database_url)
            .await
            .expect("connect to the test database")
    }

    /// This test's topology: its prefix and stream.
    pub fn topology(&self) -> Topology {
        Topology::new(
            self.prefix.parse().expect("a valid prefix"),
            StreamSettings {
                name: self.stream.clone(),
                ..StreamSettings::default()
            },
        )
    }

    pub fn outbox(&self) -> Outbox {
        Outbox::with_topology(self.topology())
    }

    /// Commits `aggregate`'s pending events through this test's outbox, in a unit of work of
    /// their own on a fresh connection.
    pub async fn commit(&self, aggregate: &mut impl Aggregate) {
        self.outbox()
            .transaction(&mut self.conn().await, async |uow| {
                uow.track(aggregate);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .expect("commit the aggregate's events");
    }

    /// A relay configuration for this test's database, prefix and stream, polling fast.
    pub fn relay_config(&self) -> RelayConfig {
        let mut config = RelayConfig::new(&self.database_url);
        config.topology = self.topology();
        config.source = "/tests".to_owned();
        config.poll_interval = std::time::Duration::from_millis(20);
        config
    }

    pub fn jetstream(&self) -> jetstream::Context {
        jetstream::new(self.nats.clone())
    }

    /// Creates this test's stream, capturing `{prefix}.>`, with `duplicate_window` (before a
    /// relay does, for a test that needs it first or with another window).
    pub async fn create_stream(&self, duplicate_window: Duration) {
        self.jetstream()
            .create_stream(jetstream::stream::Config {
                name: self.stream.clone(),
                subjects: vec![format!("{}.>", self.prefix)],
                duplicate_window,
                ..Default::default()
            })
            .await
            .expect("create the test's stream");
    }

    /// How many messages this test's stream holds (0 before a relay created it).
    pub async fn stream_len(&self) -> u64 {
        match self.jetstream().get_stream(&self.stream).await {
            Ok(mut stream) => stream.info().await.unwrap().state.messages,
            Err(_) => 0,
        }
    }

    /// Waits until this test's stream holds `count` messages.
    pub async fn until_stream_holds(&self, count: u64, timeout: Duration) {
        wait_until(
            &format!("{count} messages in the stream"),
            timeout,
            || async { (self.stream_len().await >= count).then_some(()) },
        )
        .await;
    }

    /// Every message in this test's stream, in stream order, read by an ordered consumer
    /// (the protocol's header parser keeps every value of a multi-valued header; the
    /// stream's raw-get API, as async-nats 0.51 decodes it, keeps only the last).
    pub async fn stream_messages(&self) -> Vec<Received> {
        let mut stream = self
            .jetstream()
            .get_stream(&self.stream)
            .await
            .expect("the stream exists");
        let stored = stream.info().await.expect("stream info").state.messages;
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .expect("an ordered consumer");
        let mut messages = consumer.messages().await.expect("consume the stream");
        let mut received = Vec::new();
        while (received.len() as u64) < stored {
            let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
                .await
                .expect("a stored message is delivered")
                .expect("the consumer is open")
                .expect("a message");
            received.push(Received {
                subject: message.subject.to_string(),
                headers: message.headers.clone().unwrap_or_default(),
                payload: message.payload.to_vec(),
            });
        }
        received
    }
}

/// A message as a consumer received it.
#[derive(Debug)]
pub struct Received {
    pub subject: String,
    pub headers: async_nats::HeaderMap,
    pub payload: Vec<u8>,
}

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

impl Received {
    /// The value of header `name`; panics, naming the header and the subject, when it is
    /// missing.
    pub fn header(&self, name: &str) -> String {
        self.headers
            .get(name)
            .unwrap_or_else(|| panic!("header {name} on {}", self.subject))
            .as_str()
            .to_owned()
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let database = self.database.clone();
        let stream = self.stream.clone();
        let nats_url = self.nats_url.clone();
        // Drop cannot await, so the cleanup runs on a thread and runtime of its own, with
        // connections of its own: the test's NATS client is driven by the test's runtime,
        // which is blocked in this very drop.
        let cleanup = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for cleanup");
            runtime.block_on(async move {
                let connect = async {
                    let (options, servers) = outbox_runtime::nats::options(&nats_url).ok()?;
                    options
                        .connection_timeout(Duration::from_secs(2))
                        .connect(servers)
                        .await
                        .ok()
                };
                if let Some(nats) = connect.await {
                    let _ = jetstream::new(nats).delete_stream(&stream).await;
                }
                if let Ok(mut admin) = AsyncPgConnection::establish(&admin_url).await {
                    let _ = admin
                        .batch_execute(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
                        .await;
                }
            });
        });
        let _ = cleanup.join();
    }
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

/// Waits until `check` returns `Some`, polling every 20 ms, for at most `timeout`; panics
/// with `what` when it does not.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
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
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A nats-server of the test's own, on a free port with a temporary JetStream store, for
/// tests that stop and restart the broker (they never touch the shared one). The binary is
/// `NATS_SERVER_BIN`, else `nats-server` on the PATH, else `/usr/sbin/nats-server`.
pub struct NatsServer {
    pub port: u16,
    store: std::path::PathBuf,
    /// Arguments beyond the address, port and store (authentication, say).
    extra: Vec<String>,
    child: Option<std::process::Child>,
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

impl NatsServer {
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// A server started with `extra` arguments too (e.g. `--config`, `--user`).
    pub async fn start_with(extra: &[&str]) -> Self {
        let store = std::env::temp_dir().join(format!("outbox-test-nats-{}", uuid::Uuid::new_v4()));
        let mut server = Self {
            port: free_port(),
            store,
            extra: extra.iter().map(|arg| (*arg).to_owned()).collect(),
            child: None,
        };
        server.restart().await;
        server
    }

    /// Where the server keeps its JetStream store (a test may put a config file beside it).
    pub fn store(&self) -> &std::path::Path {
        &self.store
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn binary() -> std::path::PathBuf {
        cluster::nats_server_binary()
    }

    /// Starts the server (again, with the same port and store) and waits until it accepts
    /// connections.
    pub async fn restart(&mut self) {
        assert!(
            self.child.is_none(),
            "the test's nats-server is already running"
        );
        let binary = Self::binary();
        std::fs::create_dir_all(&self.store).expect("the store directory");
        let log = self.store.with_extension("log");
        let log_file = std::fs::File::create(&log).expect("the server's log file");
        let child = std::process::Command::new(&binary)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.store)
            .args(&self.extra)
            .stdout(std::process::Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {} (set NATS_SERVER_BIN): {e}",
                    binary.display()
                )
            });
        self.child = Some(child);
        let address = format!("127.0.0.1:{}", self.port);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(&address).await.is_err() {
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "the test's nats-server did not listen within 10 s; its log:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the server, as an outage would.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server gracefully (SIGTERM: nats-server shuts JetStream down, then closes
    /// its connections), and waits until it has exited.
    pub async fn terminate(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "TERM");
            tokio::task::spawn_blocking(move || child.wait())
                .await
                .expect("wait for the server")
                .expect("the server exits");
        }
    }
}

/// Sends `signal` (`TERM`, `KILL`, ...) to the process `pid`, with the system's `kill`.
pub fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal} {pid}");
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
pub struct Proxy {
    pub port: u16,
    frozen: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(target: std::net::SocketAddr) -> Self {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let frozen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = frozen.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                for (mut from, mut to) in [(client_read, server_write), (server_read, client_write)]
                {
                    let flag = flag.clone();
                    tokio::spawn(async move {
                        use tokio::io::{AsyncReadExt, AsyncWriteExt};
                        let mut buffer = vec![0_u8; 16 * 1024];
                        loop {
                            let Ok(read) = from.read(&mut buffer).await else {
                                return;
                            };
                            if read == 0 {
                                return;
                            }
                            while flag.load(Ordering::SeqCst) {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                            if to.write_all(&buffer[..read]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        Self { port, frozen, task }
    }

    pub fn freeze(&self, frozen: bool) {
        self.frozen
            .store(frozen, std::sync::atomic::Ordering::SeqCst);
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

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.store);
        let _ = std::fs::remove_file(self.store.with_extension("log"));
    }
}
