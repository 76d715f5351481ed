//! A nats-server of a test's or a benchmark's own ([`NatsServer`]): a process on a free
//! loopback port with a temporary JetStream store, which can be killed, stopped gracefully
//! and started again on the same port and store. The test harness (`support`) re-exports it;
//! `examples/retention_bench.rs` includes this file beside `cluster.rs`, its `super`.

#![allow(dead_code)] // each binary uses part of it

use std::time::Duration;

use super::cluster;

/// A nats-server of the test's own, on a free port with a temporary JetStream store, for
/// tests that stop and restart the broker (they never touch the shared one). The binary is
/// `NATS_SERVER_BIN`, else `nats-server` on the PATH, else `/usr/sbin/nats-server`.
pub struct NatsServer {
    pub port: u16,
    store: std::path::PathBuf,
    /// Arguments beyond the address, port and store (authentication, say).
    extra: Vec<String>,
    /// Whether it runs JetStream (`-js`).
    jetstream: bool,
    child: Option<std::process::Child>,
}

/// A free TCP port on loopback for a server to listen on, outside the range of connections'
/// local ports, so that none takes it while the server is killed and started again on it
/// (see [`cluster::free_ports`]).
pub fn free_port() -> u16 {
    cluster::free_ports(1)[0]
}

impl NatsServer {
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// A server started with `extra` arguments too (e.g. `--user`).
    pub async fn start_with(extra: &[&str]) -> Self {
        let extra = extra.iter().map(|arg| (*arg).to_owned()).collect();
        Self::launch(Self::new_store(), extra).await
    }

    /// A server without JetStream (no `-js`), as a newcomer may start one.
    pub async fn start_without_jetstream() -> Self {
        let mut server = Self::unstarted(Self::new_store(), Vec::new());
        server.jetstream = false;
        server.launched().await
    }

    /// A server started with `--config` and a file holding `config` (nats-server's
    /// configuration format), kept beside its store and removed with it.
    pub async fn start_with_config(config: &str) -> Self {
        let store = Self::new_store();
        let file = store.with_extension("conf");
        std::fs::write(&file, config).expect("the server's config file");
        let extra = vec!["--config".to_owned(), file.display().to_string()];
        Self::launch(store, extra).await
    }

    /// A store path of the test's own in the temporary directory (created at start).
    fn new_store() -> std::path::PathBuf {
        std::env::temp_dir().join(format!("outbox-test-nats-{}", uuid::Uuid::new_v4()))
    }

    async fn launch(store: std::path::PathBuf, extra: Vec<String>) -> Self {
        Self::unstarted(store, extra).launched().await
    }

    fn unstarted(store: std::path::PathBuf, extra: Vec<String>) -> Self {
        Self {
            port: free_port(),
            store,
            extra,
            jetstream: true,
            child: None,
        }
    }

    async fn launched(mut self) -> Self {
        // A port found free can be taken before the server binds it (by another test's
        // server, or as the local port of a connection): then it exits, and another port is
        // tried.
        for _ in 0..5 {
            match self.try_start().await {
                Ok(()) => return self,
                Err(Start::Exited(_)) => self.port = free_port(),
                Err(Start::Failed(failure)) => panic!("{failure}"),
            }
        }
        self.restart().await;
        self
    }

    /// Where the server keeps its JetStream store (a test may look into it; its log and a
    /// config of `start_with_config` lie beside it).
    pub fn store(&self) -> &std::path::Path {
        &self.store
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The running server's process id (`None` while it is stopped), for a look at its
    /// `/proc/<pid>` (its memory, say).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    fn binary() -> std::path::PathBuf {
        cluster::nats_server_binary()
    }

    /// Starts the server (again, with the same port and store) and waits until it accepts
    /// connections.
    pub async fn restart(&mut self) {
        match self.try_start().await {
            Ok(()) => {}
            Err(Start::Exited(failure) | Start::Failed(failure)) => panic!("{failure}"),
        }
    }

    /// Starts the server and waits until it greets a client with its `INFO` line (a bare
    /// TCP connect could succeed without it: a connection to a free port of the ephemeral
    /// range can connect to itself).
    async fn try_start(&mut self) -> Result<(), Start> {
        assert!(
            self.child.is_none(),
            "the test's nats-server is already running"
        );
        let binary = Self::binary();
        std::fs::create_dir_all(&self.store).expect("the store directory");
        let log = self.store.with_extension("log");
        let log_file = std::fs::File::create(&log).expect("the server's log file");
        let mut child = std::process::Command::new(&binary)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(&self.store)
            .args(self.jetstream.then_some("-js"))
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
        let address = format!("127.0.0.1:{}", self.port);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(Start::Exited(format!(
                    "the test's nats-server on port {} exited ({status}); its log:\n{}",
                    self.port,
                    std::fs::read_to_string(&log).unwrap_or_default()
                )));
            }
            if greets(&address).await {
                self.child = Some(child);
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Start::Failed(format!(
                    "the test's nats-server did not listen within 10 s; its log:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )));
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

/// Why a test's nats-server did not start.
enum Start {
    /// It exited (its port was taken, say), with its log.
    Exited(String),
    /// It did not listen in time, with its log.
    Failed(String),
}

/// Whether a NATS server at `address` sends its `INFO` line to a new connection.
async fn greets(address: &str) -> bool {
    use tokio::io::AsyncReadExt as _;
    let Ok(mut stream) = tokio::net::TcpStream::connect(address).await else {
        return false;
    };
    let mut greeting = [0_u8; 5];
    matches!(
        tokio::time::timeout(Duration::from_secs(2), stream.read_exact(&mut greeting)).await,
        Ok(Ok(_)) if &greeting == b"INFO "
    )
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

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.store);
        let _ = std::fs::remove_file(self.store.with_extension("log"));
        let _ = std::fs::remove_file(self.store.with_extension("conf"));
    }
}
