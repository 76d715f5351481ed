//! A PostgreSQL server of the test's own, for tests that crash the database itself (they
//! never touch the shared one): a data directory made by `initdb` in the temporary
//! directory, a `postgres` process on a free port of loopback, killed the way a crash kills
//! it and started again on the same directory, which runs PostgreSQL's crash recovery.
//!
//! The binaries are those of `OUTBOX_TEST_PG_BINDIR`, else of `pg_config --bindir`, else the
//! newest `/usr/lib/postgresql/*/bin` (Debian's layout). `initdb` refuses to run as root, so
//! as root the server runs as the user `postgres` (`runuser`), which owns its directory.

use std::os::unix::fs::MetadataExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection};

use super::free_port;

/// The test's own PostgreSQL server. Dropping it kills the server and removes its directory.
pub struct PostgresServer {
    pub port: u16,
    bin: PathBuf,
    /// The temporary directory: the data directory `data` and the server's log.
    dir: PathBuf,
    /// As root, the user the server runs as.
    user: Option<&'static str>,
    /// Settings beyond the defaults below, `name=value` each.
    settings: Vec<String>,
    /// The command that runs the server: the postmaster, or `runuser` with the postmaster
    /// as its child. Its process group is the server's: every process PostgreSQL forks.
    child: Option<Child>,
}

impl PostgresServer {
    /// Creates a data directory (trust authentication, the superuser `postgres`) and starts
    /// the server on it.
    ///
    /// # Panics
    /// When the binaries are not found, or `initdb` or the server fails, with its output.
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// The same, with `settings` (`name=value`, given to the server as `-c`) over the
    /// defaults.
    ///
    /// # Panics
    /// As [`start`](Self::start).
    pub async fn start_with(settings: &[&str]) -> Self {
        let bin = binaries();
        let dir = std::env::temp_dir().join(format!("outbox-test-pg-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("the server's directory");
        let root = std::fs::metadata("/proc/self").is_ok_and(|me| me.uid() == 0);
        let user = root.then_some("postgres");
        if let Some(user) = user {
            let status = Command::new("chown")
                .args([user, &dir.display().to_string()])
                .status()
                .expect("run chown");
            assert!(status.success(), "chown {user} {}", dir.display());
        }
        let mut server = Self {
            port: free_port(),
            bin,
            dir,
            user,
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
            child: None,
        };
        let initdb = server
            .command("initdb")
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "-D",
            ])
            .arg(server.data())
            .output()
            .unwrap_or_else(|e| panic!("cannot run initdb (set OUTBOX_TEST_PG_BINDIR): {e}"));
        assert!(
            initdb.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&initdb.stdout),
            String::from_utf8_lossy(&initdb.stderr)
        );
        // A port found free can be taken before the server binds it: then another is tried.
        for _ in 0..5 {
            match server.try_start().await {
                Ok(()) => return server,
                Err(failure) if failure.contains("Address already in use") => {
                    server.port = free_port();
                }
                Err(failure) => panic!("{failure}"),
            }
        }
        panic!("the test's PostgreSQL did not start:\n{}", server.log());
    }

    /// The URL of database `database` on this server.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// The directory of the server's Unix socket (`.s.PGSQL.<port>`).
    pub fn socket_directory(&self) -> &std::path::Path {
        &self.dir
    }

    /// Creates the database `name` on this server, through the database `postgres` (which
    /// every server of this harness lets in without TLS).
    pub async fn create_database(&self, name: &str) {
        use diesel_async::SimpleAsyncConnection as _;
        AsyncPgConnection::establish(&self.url("postgres"))
            .await
            .unwrap()
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
    }

    /// Kills every process of the server at once with SIGKILL (the postmaster, its
    /// backends, the WAL writer, the checkpointer), as a crash of its host's processes does:
    /// nothing is flushed or shut down, and what sat in PostgreSQL's WAL buffers is lost.
    /// Returns once every one of them has exited.
    pub async fn crash(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // The postmaster's children each run in a session of their own (PostgreSQL's
        // `InitPostmasterChild` calls setsid), outside the group a signal to the postmaster's
        // reaches: stopped first, the postmaster forks no more of them, and each is killed by
        // its pid. Left alive, a backend exits only when it notices the postmaster gone, and
        // a new postmaster started meanwhile refuses the directory ("pre-existing shared
        // memory block ... is still in use").
        let group = format!("-{}", child.id());
        let _ = Command::new("kill").args(["-STOP", "--", &group]).status();
        let processes = descendants(child.id());
        // Children first: a stopped parent killed before them would leave its group
        // orphaned, which the kernel answers with SIGHUP and SIGCONT to its stopped members.
        for pid in processes.iter().rev() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
        kill_group(&mut child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while processes.iter().any(|pid| alive(*pid)) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the test's PostgreSQL processes outlived SIGKILL by 10 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Starts the server again on the same directory and port (PostgreSQL recovers from its
    /// WAL first), and waits until it accepts connections.
    ///
    /// # Panics
    /// When it does not within 60 s, with its log.
    pub async fn restart(&mut self) {
        if let Err(failure) = self.try_start().await {
            panic!("{failure}");
        }
    }

    /// Stops the server (`pg_ctl stop`, a fast shutdown) and starts it again as a hot standby
    /// without a primary (a `standby.signal` file in its data directory: PostgreSQL docs,
    /// "Log-Shipping Standby Servers"), as a replica is: it stays in recovery, takes sessions
    /// that read, and refuses every write ("cannot execute ... in a read-only transaction").
    ///
    /// # Panics
    /// When the server does not stop, or does not take sessions within 60 s, with its log.
    pub async fn restart_as_standby(&mut self) {
        let mut child = self.child.take().expect("the test's PostgreSQL is running");
        let stopped = self
            .command("pg_ctl")
            .args(["stop", "-m", "fast", "-D"])
            .arg(self.data())
            .output()
            .expect("run pg_ctl");
        assert!(
            stopped.status.success(),
            "pg_ctl stop: {}{}",
            String::from_utf8_lossy(&stopped.stderr),
            self.log()
        );
        let _ = child.wait();
        std::fs::write(self.data().join("standby.signal"), "").expect("standby.signal");
        self.restart().await;
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// `program` of the server's binaries, as the server's user.
    fn command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        match self.user {
            Some(user) => {
                let mut command = Command::new("runuser");
                command.args(["-u", user, "--"]).arg(program);
                command
            }
            None => Command::new(program),
        }
    }

    async fn try_start(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "the test's PostgreSQL is running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("the server's log file");
        let socket_dir = self.dir.display().to_string();
        let mut child = self
            .command("postgres")
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args(["-c", &format!("unix_socket_directories={socket_dir}")])
            .args(["-c", "max_connections=60", "-c", "shared_buffers=32MB"])
            // Durable commits, as in production: what a unit of work was told committed must
            // survive the crash.
            .args(["-c", "fsync=on", "-c", "synchronous_commit=on"])
            .args(self.settings.iter().flat_map(|setting| ["-c", setting]))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log file"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start postgres (set OUTBOX_TEST_PG_BINDIR): {e}"));
        let url = self.url("postgres");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "the test's PostgreSQL on port {} exited ({status}); its log:\n{}",
                    self.port,
                    self.log()
                ));
            }
            // Accepting TCP is not enough: during recovery the server refuses sessions.
            if AsyncPgConnection::establish(&url).await.is_ok() {
                self.child = Some(child);
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                kill_group(&mut child);
                return Err(format!(
                    "the test's PostgreSQL did not accept a session within 60 s; its log:\n{}",
                    self.log()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(&mut child);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// SIGKILLs the process group `child` leads (the server's processes: see
/// [`PostgresServer::child`]) and reaps `child`.
/// The processes descended from `root` (its children, theirs, ...), read from `/proc`.
fn descendants(root: u32) -> Vec<u32> {
    let mut parents = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<u32>().ok())
        else {
            continue;
        };
        // `pid (comm) state ppid ...`: the command may hold spaces and parentheses.
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|ppid| ppid.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parents.push((pid, ppid));
        }
    }
    let mut found = vec![root];
    let mut at = 0;
    while at < found.len() {
        let parent = found[at];
        found.extend(
            parents
                .iter()
                .filter(|(_, ppid)| *ppid == parent)
                .map(|(pid, _)| *pid),
        );
        at += 1;
    }
    found
}

/// Whether process `pid` exists, a zombie not yet reaped too: a new postmaster takes the
/// pid in the old one's `postmaster.pid` for a running server while it exists.
fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

pub(super) fn kill_group(child: &mut Child) {
    let group = format!("-{}", child.id());
    let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
    let _ = child.wait();
}

/// The directory of PostgreSQL's server binaries (`initdb`, `postgres`).
fn binaries() -> PathBuf {
    if let Ok(dir) = std::env::var("OUTBOX_TEST_PG_BINDIR") {
        return dir.into();
    }
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()))
        .filter(|dir| dir.join("initdb").exists());
    if let Some(dir) = from_pg_config {
        return dir;
    }
    let mut installed: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    installed.sort();
    installed.pop().map(|(_, bin)| bin).unwrap_or_else(|| {
        panic!(
            "no PostgreSQL server binaries (initdb, postgres) found: set OUTBOX_TEST_PG_BINDIR, \
             or put pg_config on the PATH"
        )
    })
}

/// Certificates for a PostgreSQL server with TLS, made by `openssl` in a directory of their
/// own (removed when dropped): a certificate authority, a server certificate it signed for
/// the name `localhost` only (no IP address), a client certificate it signed for the user
/// `postgres`, and a second authority that signed a client certificate for `postgres` too.
pub struct TestCertificates {
    dir: PathBuf,
}

impl TestCertificates {
    /// Makes them; as root the directory and the server's key belong to the user the test's
    /// server runs as, which PostgreSQL requires of its key (mode 0600).
    ///
    /// # Panics
    /// When `openssl` fails, with its output.
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("outbox-test-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("the certificates' directory");
        let certificates = Self { dir };
        let openssl = |args: &[&str]| certificates.openssl(args);
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for (ca, subject) in [
            ("ca", "/CN=outbox test authority"),
            ("other-ca", "/CN=another authority"),
        ] {
            let key = format!("{ca}.key");
            let pem = format!("{ca}.pem");
            let mut args = vec!["req", "-x509"];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &pem, "-days", "2"]);
            args.extend(["-subj", subject]);
            args.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
            args.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
            openssl(&args);
        }
        std::fs::write(
            certificates.dir.join("server.ext"),
            "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
        )
        .expect("the server certificate's extensions");
        std::fs::write(
            certificates.dir.join("client.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=clientAuth\n",
        )
        .expect("the client certificates' extensions");
        // The server's certificate, the client's (its common name is the database user that
        // `cert` authentication lets in), and a stranger's for the same user.
        for (name, subject, ca, extensions) in [
            ("server", "/CN=localhost", "ca", "server.ext"),
            ("client", "/CN=postgres", "ca", "client.ext"),
            ("stranger", "/CN=postgres", "other-ca", "client.ext"),
        ] {
            let (key, csr, pem) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.pem"),
            );
            let mut args = vec!["req"];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &csr, "-subj", subject]);
            openssl(&args);
            let (ca_pem, ca_key) = (format!("{ca}.pem"), format!("{ca}.key"));
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &ca_pem,
                "-CAkey",
                &ca_key,
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                extensions,
            ]);
        }
        let root = std::fs::metadata("/proc/self").is_ok_and(|me| me.uid() == 0);
        if root {
            let status = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&certificates.dir)
                .status()
                .expect("run chown");
            assert!(status.success(), "chown the certificates");
        }
        let status = Command::new("chmod")
            .arg("600")
            .arg(certificates.path("server.key"))
            .status()
            .expect("run chmod");
        assert!(status.success(), "chmod the server's key");
        certificates
    }

    /// Runs `openssl` with `args` in their directory, for a test that makes more.
    ///
    /// # Panics
    /// When it fails, with its output.
    pub fn openssl(&self, args: &[&str]) {
        let output = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .output()
            .expect("run openssl");
        assert!(
            output.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// The file `name` of them: `ca.pem`, `other-ca.pem`, `server.pem`, `server.key`,
    /// `client.pem`, `client.key`, `stranger.pem`, `stranger.key`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

impl Drop for TestCertificates {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl PostgresServer {
    /// A server with TLS on `certificates`' server certificate, whose TCP sessions must use
    /// TLS (`hostssl`; PostgreSQL docs, "The pg_hba.conf File"), but for the database
    /// `postgres`, which the test's set-up and this harness's readiness check reach without.
    ///
    /// # Panics
    /// As [`start`](Self::start).
    pub async fn start_with_tls(certificates: &TestCertificates) -> Self {
        Self::start_with_hba(certificates, "trust").await
    }

    /// As [`start_with_tls`](Self::start_with_tls), and each TLS session but the database
    /// `postgres`'s must show a client certificate of `certificates`' authority whose common
    /// name is its user (`cert` authentication; PostgreSQL docs, "Certificate
    /// Authentication"), and no password.
    ///
    /// # Panics
    /// As [`start`](Self::start).
    pub async fn start_with_client_certificates(certificates: &TestCertificates) -> Self {
        Self::start_with_hba(certificates, "cert").await
    }

    /// A server without TLS whose TCP sessions must give their role's password
    /// (`scram-sha-256`; PostgreSQL docs, "Password Authentication"), but for the database
    /// `postgres`, which the test's set-up and this harness's readiness check reach without.
    ///
    /// # Panics
    /// As [`start`](Self::start).
    pub async fn start_with_passwords() -> Self {
        let hba = std::env::temp_dir().join(format!("outbox-test-hba-{}", uuid::Uuid::new_v4()));
        std::fs::write(
            &hba,
            "local all all trust\n\
             host postgres all 127.0.0.1/32 trust\n\
             host all all 127.0.0.1/32 scram-sha-256\n",
        )
        .expect("the server's pg_hba.conf");
        let server = Self::start_with(&[&format!("hba_file={}", hba.display())]).await;
        // Read at start; the server keeps what it read.
        let _ = std::fs::remove_file(&hba);
        server
    }

    async fn start_with_hba(certificates: &TestCertificates, method: &str) -> Self {
        let hba = certificates.path("pg_hba.conf");
        std::fs::write(
            &hba,
            format!(
                "local all all trust\n\
                 hostnossl postgres all 127.0.0.1/32 trust\n\
                 hostssl postgres all 127.0.0.1/32 trust\n\
                 hostssl all all 127.0.0.1/32 {method}\n"
            ),
        )
        .expect("the server's pg_hba.conf");
        let settings = [
            format!("ssl_ca_file={}", certificates.path("ca.pem").display()),
            "ssl=on".to_owned(),
            format!(
                "ssl_cert_file={}",
                certificates.path("server.pem").display()
            ),
            format!("ssl_key_file={}", certificates.path("server.key").display()),
            format!("hba_file={}", hba.display()),
        ];
        let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
        Self::start_with(&settings).await
    }
}
