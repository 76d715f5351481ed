//! A MariaDB server of the test's own, for tests that crash the database itself (they never
//! touch the shared one): a data directory made by `mariadb-install-db` in the temporary
//! directory, a `mariadbd` on a free port of loopback, killed the way a crash kills it and
//! started again on the same directory, which runs InnoDB's crash recovery.
//!
//! The binaries are `OUTBOX_TEST_MARIADBD` (the server) and `mariadb-install-db` beside it or
//! on the PATH, else Debian's `/usr/sbin/mariadbd`. As root the server runs as root
//! (`--user=root`: a directory of the test's own, no user to create).

use std::os::unix::fs::MetadataExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use outbox_runtime::diesel_async::{AsyncConnection, AsyncMysqlConnection};

use super::free_port;
use super::postgres::kill_group;

/// The test's own MariaDB server. Dropping it kills the server and removes its directory.
pub struct MariadbServer {
    pub port: u16,
    server: PathBuf,
    /// The temporary directory: the data directory `data`, the socket and the error log.
    dir: PathBuf,
    root: bool,
    /// Options beyond the defaults of [`try_start`](Self::try_start), `--name=value` each.
    options: Vec<String>,
    /// `mariadbd`, leading a process group of its own.
    child: Option<Child>,
}

impl MariadbServer {
    /// Creates a data directory (`root` without a password) and starts the server on it,
    /// durable as in production (`innodb_flush_log_at_trx_commit=1`, the default: each
    /// COMMIT is on disk when it returns).
    ///
    /// # Panics
    /// When the binaries are not found, or the install or the server fails, with its output.
    pub async fn start() -> Self {
        Self::start_with(Vec::new()).await
    }

    /// A server with TLS on `certificates`' server certificate (`--ssl-cert`, `--ssl-key`;
    /// MariaDB docs, "Securing Connections for Client and Server"); `root` connects without
    /// TLS, and a user the test creates `REQUIRE SSL` with it.
    ///
    /// # Panics
    /// As [`start`](Self::start).
    pub async fn start_with_tls(certificates: &super::postgres::TestCertificates) -> Self {
        let file = |name: &str| certificates.path(name).display().to_string();
        Self::start_with(vec![
            format!("--ssl-cert={}", file("server.pem")),
            format!("--ssl-key={}", file("server.key")),
            format!("--ssl-ca={}", file("ca.pem")),
        ])
        .await
    }

    /// [`start`](Self::start), with `options` given to `mariadbd` too.
    async fn start_with(options: Vec<String>) -> Self {
        let server = std::env::var_os("OUTBOX_TEST_MARIADBD")
            .map_or_else(|| PathBuf::from("/usr/sbin/mariadbd"), PathBuf::from);
        let dir =
            std::env::temp_dir().join(format!("outbox-test-mariadb-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("the server's directory");
        let root = std::fs::metadata("/proc/self").is_ok_and(|me| me.uid() == 0);
        let mut this = Self {
            port: free_port(),
            server,
            dir,
            root,
            options,
            child: None,
        };
        let beside = this.server.with_file_name("mariadb-install-db");
        let install_db = if beside.exists() {
            beside
        } else {
            PathBuf::from("mariadb-install-db")
        };
        let mut install = Command::new(install_db);
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", this.data().display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"]);
        if root {
            install.arg("--user=root");
        }
        let installed = install.output().unwrap_or_else(|e| {
            panic!("cannot run mariadb-install-db (set OUTBOX_TEST_MARIADBD): {e}")
        });
        assert!(
            installed.status.success(),
            "mariadb-install-db failed: {}{}",
            String::from_utf8_lossy(&installed.stdout),
            String::from_utf8_lossy(&installed.stderr)
        );
        // A port found free can be taken before the server binds it: then another is tried.
        for _ in 0..5 {
            match this.try_start().await {
                Ok(()) => return this,
                Err(failure) if failure.contains("Address already in use") => {
                    this.port = free_port();
                }
                Err(failure) => panic!("{failure}"),
            }
        }
        panic!("the test's MariaDB did not start:\n{}", this.log());
    }

    /// The URL of database `database` on this server, over TCP (mysql_async would move a
    /// loopback connection to the shared server's default socket otherwise).
    pub fn url(&self, database: &str) -> String {
        format!(
            "mysql://root@127.0.0.1:{}/{database}?prefer_socket=false",
            self.port
        )
    }

    /// The server's Unix socket (`--socket`).
    pub fn socket(&self) -> PathBuf {
        self.dir.join("socket")
    }

    /// Kills the server with SIGKILL, as a crash does: nothing is flushed or shut down.
    /// Returns once it has exited.
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(&mut child);
        }
    }

    /// Starts the server again on the same directory and port (InnoDB recovers from its redo
    /// log first), and waits until it accepts a session.
    ///
    /// # Panics
    /// When it does not within 60 s, with its log.
    pub async fn restart(&mut self) {
        if let Err(failure) = self.try_start().await {
            panic!("{failure}");
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("error.log")
    }

    /// The server's error log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    async fn try_start(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "the test's MariaDB is running");
        let mut command = Command::new(&self.server);
        command
            .arg("--no-defaults")
            .arg(format!("--datadir={}", self.data().display()))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", self.socket().display()))
            .arg(format!("--pid-file={}", self.dir.join("pid").display()))
            .arg(format!("--log-error={}", self.log_path().display()))
            .args([
                "--skip-name-resolve",
                "--innodb-buffer-pool-size=32M",
                "--innodb-flush-log-at-trx-commit=1",
                "--max-connections=100",
            ])
            .args(&self.options);
        if self.root {
            command.arg("--user=root");
        }
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start mariadbd (set OUTBOX_TEST_MARIADBD): {e}"));
        let url = self.url("mysql");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "the test's MariaDB on port {} exited ({status}); its log:\n{}",
                    self.port,
                    self.log()
                ));
            }
            if AsyncMysqlConnection::establish(&url).await.is_ok() {
                self.child = Some(child);
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                kill_group(&mut child);
                return Err(format!(
                    "the test's MariaDB did not accept a session within 60 s; its log:\n{}",
                    self.log()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for MariadbServer {
    fn drop(&mut self) {
        self.crash();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
